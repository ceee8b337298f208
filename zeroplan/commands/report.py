"""`zeroplan report`: terminal charts, a self-contained HTML report (inline SVG), sweeps.

The report data (what ``--json`` prints and what the HTML is rendered from) is one dict:

- ``model``, ``cluster``, ``training``, ``comm_model``, ``mfu``, ``assumptions``, ``notes``,
  ``inputs`` (the options as given), ``max_nodes``: as in ``zeroplan estimate --json``;
- ``plans``: one entry per evaluated option at the chosen cluster: ``label``, ``stage``,
  ``offload_optimizer``, ``offload_param``, ``memory`` (per-GPU bytes: ``params``, ``gradients``,
  ``optimizer_states``, ``model_states``, ``buffers``, ``activations``, ``overhead``, ``peak``: the
  Plan's, model states in steady state), ``memory_at_peak`` (per-GPU bytes by category live in
  the peak phase, plus ``overhead``; they add up to ``peak``: what the bars show), ``peak_phase``, ``peak_reason``, ``fits``, ``headroom_bytes``, ``comm_bytes_per_gpu_per_step``,
  ``time`` (seconds: ``compute_s``, ``comm_s``, ``exposed_best_s``, ``exposed_worst_s``,
  ``step_time_s``, ``step_time_best_s``, ``step_time_worst_s``; ``comm_share`` (0–1),
  ``tokens_per_s``) or null without a hardware profile;
- ``memory_sweep``: ``gpus_per_node``, ``gpus`` (1, 2, 4, … up to max_nodes × GPUs per node),
  ``series``: per stage 0–3 ``stage``, ``label``, ``offload_optimizer``, ``offload_param``,
  ``model_states``, ``peak`` (per-GPU bytes, one per entry of ``gpus``), ``fits``;
- ``time_sweep`` (null without a hardware profile): ``gpus_per_node``, ``nodes`` (1, 2, 4, …
  max_nodes), ``gpus``, ``series``: per stage ``stage``, ``label``, ``step_time_s``,
  ``step_time_best_s``, ``step_time_worst_s``, ``compute_time_s``, ``comm_share``,
  ``tokens_per_s`` (one per entry of ``nodes``);
- ``recommendation`` (null without a hardware profile): what ``zeroplan recommend`` chooses for
  the same inputs: ``chosen`` (its Candidate with a ``label``, or null when nothing fits),
  ``explanation``, ``warnings`` (sentences) and ``explanation_reasons``, ``warning_reasons`` (the
  same as templates with their quantities and units).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError
from zeroplan.commands._common import (
    DEFAULT_COMM_MODEL, DEFAULT_MFU, Checkpointing, CommModel, DsConfig, FlashAttention, GpusPerNode, GradAccum,
    Gpus, Hardware, Json, Lenient, MicroBatch, Mfu, Model, Nodes, OffloadOptimizer, OffloadParam, Optimizer,
    Precision, SeqLen, Stage, Strict, console, handle_errors, parse_stages, print_json,
)
from zeroplan.commands.estimate import run_estimate

__all__ = ["register", "build_report_data", "powers_of_two", "SWEEP_STAGES", "MAX_SWEEP_NODES"]

SWEEP_STAGES = (0, 1, 2, 3)
MAX_SWEEP_NODES = 4096


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … ≤ limit, plus ``limit`` itself when it is not a power of two."""
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    if out[-1] != limit:
        out.append(limit)
    return out


def _plan_summary(p: Any) -> dict[str, Any]:
    from zeroplan.report.charts import memory_at_peak, stage_label, time_parts

    m = p.memory
    t = p.time
    return {
        "label": stage_label(p),
        "stage": p.stage,
        "offload_optimizer": p.offload_optimizer,
        "offload_param": p.offload_param,
        "memory": {k: int(getattr(m, k)) for k in ("params", "gradients", "optimizer_states", "model_states",
                                                     "buffers", "activations", "overhead", "peak")},
        "memory_at_peak": {**memory_at_peak(p), "peak": int(m.peak)},
        "peak_phase": m.peak_phase,
        "peak_reason": m.peak_reason,
        "fits": p.fits,
        "headroom_bytes": p.headroom_bytes,
        "host_memory_per_node": int(p.host_memory_per_node),
        "host_ram_per_node_bytes": p.host_ram_per_node_bytes,
        "host_fits": p.host_fits,
        "comm_bytes_per_gpu_per_step": int(p.comm.bytes_per_gpu_per_step),
        "time": None if t is None else {
            "compute_s": t.compute_time_s,
            "comm_s": t.comm_time_s,
            "exposed_best_s": t.exposed_time_s["best"],
            "exposed_worst_s": t.exposed_time_s["worst"],
            "exposed_s": t.exposed_time_s.get("estimate", t.exposed_time_s["worst"]),
            "pcie_s": t.pcie_time_s,
            "cpu_optimizer_s": t.cpu_optimizer_time_s,
            "nvme_s": t.nvme_time_s,
            "parts": time_parts(t),
            "step_time_s": t.step_time_s,
            "step_time_best_s": t.step_time_best_s,
            "step_time_worst_s": t.step_time_worst_s,
            "comm_share": t.comm_share,
            "tokens_per_s": t.tokens_per_s,
        },
    }


def build_report_data(
    result: Any,
    inp: Any,
    *,
    max_nodes: int = 64,
    comm_model: str = DEFAULT_COMM_MODEL,
    mfu: float | None = DEFAULT_MFU,
    inputs: dict[str, Any] | None = None,
    on_step: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The report data dict (module docstring) for an estimate ``result`` and its PlanInputs.

    Evaluates every stage 0–3 (with the run's offload / DeepSpeed settings) at 1, 2, 4, … up to
    ``max_nodes`` × GPUs per node GPUs, and, with a hardware profile, at 1, 2, 4, … ``max_nodes``
    whole nodes. ``on_step`` is called after each evaluation (progress bars).
    """
    from zeroplan.core.plan import evaluate
    from zeroplan.report.charts import stage_label

    if not 1 <= max_nodes <= MAX_SWEEP_NODES:
        raise InputError(f"--max-nodes {max_nodes} must be between 1 and {MAX_SWEEP_NODES}")
    gpn = int(inp.gpus_per_node)
    gpus = powers_of_two(max_nodes * gpn)
    nodes = powers_of_two(max_nodes) if inp.hardware is not None else []
    cache: dict[tuple[int, int, int], Any] = {}

    def plan(stage: int, n_gpus: int, per_node: int) -> Any:
        key = (stage, n_gpus, per_node)
        if key not in cache:
            cache[key] = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(stage), n_gpus=n_gpus,
                                  gpus_per_node=per_node, hardware=inp.hardware, comm_model=comm_model, mfu=mfu)
            if on_step is not None:
                on_step()
        return cache[key]

    mem_series = []
    for s in SWEEP_STAGES:
        plans = [plan(s, g, min(gpn, g)) for g in gpus]
        mem_series.append({
            "stage": s, "label": stage_label(plans[0]), "offload_optimizer": plans[0].offload_optimizer,
            "offload_param": plans[0].offload_param,
            "model_states": [int(p.memory.model_states) for p in plans],
            "peak": [int(p.memory.peak) for p in plans],
            "fits": [p.fits for p in plans],
        })
    time_sweep = None
    if nodes:
        t_series = []
        for s in SWEEP_STAGES:
            plans = [plan(s, n * gpn, gpn) for n in nodes]
            t_series.append({
                "stage": s, "label": stage_label(plans[0]),
                "step_time_s": [p.time.step_time_s for p in plans],
                "step_time_best_s": [p.time.step_time_best_s for p in plans],
                "step_time_worst_s": [p.time.step_time_worst_s for p in plans],
                "compute_time_s": [p.time.compute_time_s for p in plans],
                "comm_share": [p.time.comm_share for p in plans],
                "tokens_per_s": [p.tokens_per_s for p in plans],
            })
        time_sweep = {"gpus_per_node": gpn, "nodes": nodes, "gpus": [n * gpn for n in nodes], "series": t_series}
    notes = list(dict.fromkeys(n for p in result.stages for n in p.notes))
    recommendation = None
    if inp.hardware is not None:
        from zeroplan.advice.recommend import recommend

        rec = recommend(inp, comm_model=comm_model, mfu=mfu, micro_batch=(inputs or {}).get("micro_batch"))
        recommendation = {
            "chosen": None if rec.chosen is None else {"label": rec.chosen.label(), **rec.chosen.model_dump(mode="json")},
            "explanation": list(rec.explanation), "warnings": list(rec.warnings),
            "explanation_reasons": [r.model_dump(mode="json") for r in rec.explanation_reasons],
            "warning_reasons": [r.model_dump(mode="json") for r in rec.warning_reasons],
        }
    return {
        "model": result.model.model_dump(mode="json"),
        "cluster": result.cluster.model_dump(mode="json"),
        "training": result.training,
        "comm_model": result.comm_model,
        "mfu": mfu,
        "assumptions": list(result.assumptions),
        "notes": notes,
        "inputs": dict(inputs or {}),
        "max_nodes": max_nodes,
        "plans": [_plan_summary(p) for p in result.stages],
        "memory_sweep": {"gpus_per_node": gpn, "gpus": gpus, "series": mem_series},
        "time_sweep": time_sweep,
        "recommendation": recommendation,
    }


def _sweep_evaluations(inp: Any, max_nodes: int) -> int:
    gpn = int(inp.gpus_per_node)
    keys = {(g, min(gpn, g)) for g in powers_of_two(max_nodes * gpn)}
    if inp.hardware is not None:
        keys |= {(n * gpn, gpn) for n in powers_of_two(max_nodes)}
    return len(keys) * len(SWEEP_STAGES)


def _check_target(path: str | None, option: str) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{option} {path}: is a directory, expected a file path to write")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{option} {path}: directory {parent} does not exist")


def _print_sweep_table(con: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    sw = data["memory_sweep"]
    table = Table(title="Per-GPU peak memory vs GPUs (GB = 10^9 bytes; * = over the GPU memory)",
                  title_justify="left")
    table.add_column("GPUs", justify="right")
    for s in sw["series"]:
        table.add_column(s["label"], justify="right")
    for i, g in enumerate(sw["gpus"]):
        table.add_row(f"{g:,}", *[f"{s['peak'][i] / 1e9:,.1f}" + ("*" if s["fits"][i] is False else "")
                                  for s in sw["series"]])
    con.print(table)
    ts = data.get("time_sweep")
    if ts:
        table = Table(title="Estimated step time (s) and exposed-comm share vs nodes", title_justify="left")
        table.add_column("nodes", justify="right")
        for s in ts["series"]:
            table.add_column(s["label"], justify="right")
        for i, n in enumerate(ts["nodes"]):
            table.add_row(f"{n:,}", *[f"{s['step_time_s'][i]:.3g} s, {s['comm_share'][i]:.0%}" for s in ts["series"]])
        con.print(table)


def register(app: typer.Typer) -> None:
    @app.command("report")
    @handle_errors
    def report(
        model: Model,
        hardware: Hardware = None,
        gpus: Gpus = None,
        nodes: Nodes = None,
        gpus_per_node: GpusPerNode = None,
        ds_config: DsConfig = None,
        precision: Precision = None,
        optimizer: Optimizer = None,
        micro_batch: MicroBatch = None,
        seq_len: SeqLen = None,
        grad_accum: GradAccum = None,
        checkpointing: Checkpointing = None,
        flash_attention: FlashAttention = None,
        offload_optimizer: OffloadOptimizer = None,
        offload_param: OffloadParam = None,
        stage: Stage = None,
        comm_model: CommModel = DEFAULT_COMM_MODEL,
        mfu: Mfu = DEFAULT_MFU,
        strict: Strict = False,
        lenient: Lenient = False,
        html: Annotated[Optional[str], typer.Option(
            "--html", metavar="PATH", show_default="none",
            help="Write a self-contained HTML report (inline SVG charts, no network) to this path.")] = None,
        svg: Annotated[Optional[str], typer.Option(
            "--svg", metavar="PATH", show_default="none",
            help="Write the per-GPU memory chart alone as an SVG file.")] = None,
        max_nodes: Annotated[int, typer.Option(
            "--max-nodes", metavar="N", help="Sweeps go to this many nodes (1, 2, 4, …).")] = 64,
        json_out: Json = False,
    ) -> None:
        """Charts: per-GPU memory by category vs GPU memory, compute vs communication, and sweeps over
        the number of GPUs and nodes — in the terminal, or as one self-contained HTML file.

        Example: zeroplan report --model llama-2-70b --hardware dgx-h100 --nodes 4 --precision bf16 --html r.html
        """
        _check_target(html, "--html")
        _check_target(svg, "--svg")
        if not 1 <= max_nodes <= MAX_SWEEP_NODES:
            raise InputError(f"--max-nodes {max_nodes} must be between 1 and {MAX_SWEEP_NODES}")
        options = dict(
            model=model, hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node,
            ds_config=ds_config, strict=strict, precision=precision, optimizer=optimizer,
            micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attention=flash_attention, offload_optimizer=offload_optimizer, offload_param=offload_param,
            stage=parse_stages(stage),
        )
        result, inp = run_estimate(**options, comm_model=comm_model, mfu=mfu, lenient=lenient)
        con = console()
        show_progress = not json_out and sys.stdout.isatty() and con.is_terminal
        total = _sweep_evaluations(inp, max_nodes)
        inputs = {k: v for k, v in options.items() if v is not None}
        if show_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("evaluating plans"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=con, transient=True) as progress:
                task = progress.add_task("sweep", total=total)
                data = build_report_data(result, inp, max_nodes=max_nodes, comm_model=comm_model, mfu=mfu,
                                         inputs=inputs, on_step=lambda: progress.advance(task))
        else:
            data = build_report_data(result, inp, max_nodes=max_nodes, comm_model=comm_model, mfu=mfu, inputs=inputs)

        from zeroplan._util import atomic_write_text

        written = []
        if html is not None:
            from zeroplan.report.html import render_report_html

            atomic_write_text(html, render_report_html(data))
            written.append(html)
        if svg is not None:
            from zeroplan.report.html import memory_chart_svg

            atomic_write_text(svg, memory_chart_svg(data, standalone=True))
            written.append(svg)
        if json_out:
            print_json(data)
            return
        if written:
            for path in written:
                con.print(f"wrote {path} ({Path(path).stat().st_size:,} bytes)", markup=False, highlight=False)
            return
        from zeroplan.report.charts import render_memory_bars, render_time_bars

        render_memory_bars(con, result)
        con.print()
        render_time_bars(con, result)
        con.print()
        _print_sweep_table(con, data)
