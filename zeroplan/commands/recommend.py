"""`zeroplan recommend`: the ZeRO stage, offload, micro-batch and buckets to use, and why."""

from __future__ import annotations

import sys
from typing import Any, List, Optional

import typer

from zeroplan.commands._common import console, handle_errors, print_json
from zeroplan.commands.estimate import (
    COMM_OPT,
    DS_OPT,
    FLASH_OPT,
    GAS_OPT,
    GPN_OPT,
    GPUS_OPT,
    HARDWARE_OPT,
    JSON_OPT,
    MFU_OPT,
    MODEL_OPT,
    NODES_OPT,
    OPT_OPT,
    PREC_OPT,
    SEQ_OPT,
    STRICT_OPT,
)

__all__ = ["register", "run_recommend", "render_recommendation"]


def run_recommend(*, headroom: float = 0.10, comm_model: str = "deepspeed", mfu: float | None = None,
                  max_micro_batch: Optional[int] = None, checkpointing: Optional[str] = None,
                  stages: Optional[list[int]] = None, allow_nvme: bool = True, top: int = 8,
                  progress: Any = None, **kw: Any):
    """Library entry: build the inputs from CLI-style keywords and return (Recommendation, PlanInputs)."""
    from zeroplan.advice.recommend import recommend
    from zeroplan.core.inputs import build_plan_inputs

    inp = build_plan_inputs(**kw)
    rec = recommend(inp, headroom=headroom, comm_model=comm_model, mfu=mfu, max_micro_batch=max_micro_batch,
                    micro_batch=kw.get("micro_batch"), checkpointing=checkpointing, stages=stages,
                    allow_nvme=allow_nvme, top=top, progress=progress)
    return rec, inp


def _elems(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def _fmt_value(v: Any) -> str:
    import json

    return "(absent)" if v is None else json.dumps(v)


def render_recommendation(con: Any, rec: Any) -> None:
    from rich.table import Table

    from zeroplan.report.render import gb, seconds

    if not con.is_terminal:
        con.width = max(con.width, 150)  # pipes and files: keep the table and sentences on one line each
    m, c = rec.model, rec.cluster
    con.print(f"[bold]{m.name}[/]: {m.params:,} parameters on {c.n_gpus} GPUs = {c.nodes} node(s) × "
              f"{c.gpus_per_node} of {c.hardware} ({c.gpu}, {gb(c.gpu_memory_bytes)} each)", markup=True)
    t = rec.training
    con.print(f"{t['precision']} ({t['precision_source']}), {t['optimizer']}, sequence {t['seq_len']}, grad-accum "
              f"{t['grad_accum']}, micro-batch {t['micro_batch']}, checkpointing {t['checkpointing']}; "
              f"headroom {rec.headroom:.0%}; {rec.searched:,} configurations decided", markup=False)
    con.print()
    if rec.chosen is not None:
        con.print(f"[bold green]Use {rec.chosen.label()}[/] with micro-batch {rec.chosen.micro_batch} and "
                  f"checkpointing {rec.chosen.checkpointing}.", markup=True)
    else:
        con.print("[bold red]Nothing fits.[/]", markup=True)
    con.print("[bold]Why[/]", markup=True)
    for line in rec.explanation:
        con.print(f"  {line}", markup=False, highlight=False)
    for w in rec.warnings:
        con.print(f"[yellow]warning[/] {w}", markup=True, highlight=False)
    if rec.alternatives:
        table = Table(title="Best configuration per stage and offload (GB = 1e9 bytes; tokens/s for the cluster)",
                      title_justify="left")
        for col, just in (("stage", "left"), ("offload", "left"), ("micro-batch", "right"), ("checkpointing", "left"),
                          ("bucket", "right"), ("peak/GPU", "right"), ("headroom", "right"), ("step time", "right"),
                          ("tokens/s", "right"), ("comm share", "right")):
            table.add_column(col, justify=just)
        for a in rec.alternatives:
            bucket = _elems(a.reduce_bucket_size)
            if a.stage == 3:
                bucket += f" / pf {_elems(a.prefetch_bucket_size)}" + (f" / hpZ {a.hpz_partition_size}" if a.hpz_partition_size > 1 else "")
            mark = "→ " if rec.chosen is not None and a == rec.chosen else ""
            table.add_row(f"{mark}ZeRO-{a.stage}", a.offload_label(), str(a.micro_batch), a.checkpointing, bucket,
                          gb(a.peak_bytes), f"{gb(a.headroom_bytes)} ({a.headroom_bytes / a.gpu_memory_bytes:.0%})",
                          seconds(a.step_time_s), f"{a.tokens_per_s:,.0f}", f"{a.comm_share:.0%}")
        con.print(table)
    if rec.ds_config_diff is not None:
        con.print("[bold]Changes to your DeepSpeed config[/]", markup=True)
        if not rec.ds_config_diff:
            con.print("  none", markup=False)
        for d in rec.ds_config_diff:
            con.print(f"  {d['key']}: {_fmt_value(d['old'])} → {_fmt_value(d['new'])}", markup=False, highlight=False)
    if rec.chosen is not None and rec.chosen.checkpointing != "none":
        con.print(f"  Enable {rec.chosen.checkpointing} activation checkpointing in the model (e.g. "
                  "model.gradient_checkpointing_enable()); it is not a DeepSpeed config key. "
                  f"Pass --checkpointing {rec.chosen.checkpointing} to `zeroplan check`.", markup=False, highlight=False)
    if rec.chosen is not None and "nvme" in (rec.chosen.offload_optimizer, rec.chosen.offload_param):
        con.print("  Set nvme_path in the emitted config to your NVMe mount (a placeholder is written).", markup=False)
    if rec.assumptions:
        con.print("[bold]Assumptions[/]", markup=True)
        for a in rec.assumptions:
            con.print(f"  - {a}", markup=False, highlight=False)
    con.print(f"[dim]{rec.useful_throughput}[/]", markup=True, highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("recommend")
    @handle_errors
    def recommend_cmd(
        model: str = MODEL_OPT,
        hardware: Optional[str] = HARDWARE_OPT,
        gpus: Optional[int] = GPUS_OPT,
        nodes: Optional[int] = NODES_OPT,
        gpus_per_node: Optional[int] = GPN_OPT,
        ds_config: Optional[str] = DS_OPT,
        precision: Optional[str] = PREC_OPT,
        optimizer: Optional[str] = OPT_OPT,
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", "-b", help="Fix the micro-batch per GPU (default: search 1, 2, 4, … up to the largest that fits)."),
        max_micro_batch: Optional[int] = typer.Option(None, "--max-micro-batch", help="Largest micro-batch to search (default 1024)."),
        seq_len: int = SEQ_OPT,
        grad_accum: Optional[int] = GAS_OPT,
        checkpointing: Optional[str] = typer.Option(None, "--checkpointing", help="Fix activation checkpointing: none, selective or full (default: search all three)."),
        flash_attention: bool = FLASH_OPT,
        stage: Optional[List[int]] = typer.Option(None, "--stage", help="Only these ZeRO stages (repeatable; default 0–3)."),
        headroom: float = typer.Option(0.10, "--headroom", help="Fraction of GPU memory and host RAM kept free (0–1)."),
        nvme: bool = typer.Option(True, "--nvme/--no-nvme", help="Consider NVMe offload."),
        top: int = typer.Option(8, "--top", help="Alternatives shown."),
        comm_model: str = COMM_OPT,
        mfu: Optional[float] = MFU_OPT,
        strict: bool = STRICT_OPT,
        emit_config: Optional[str] = typer.Option(None, "--emit-config", help="Write the chosen DeepSpeed config (JSON) to this path (atomically)."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Which ZeRO stage, offload, micro-batch, checkpointing and buckets to use on this cluster, and why.

        Capacity first (peak per GPU, host RAM and NVMe per node must fit with --headroom), then the
        highest useful throughput, preferring the lower stage within 5% and no offload unless it is
        twice as fast. Example: zeroplan recommend -m llama-2-70b -H h100-8x-ib400 --nodes 4 -p bf16
        """
        from zeroplan._util import InputError

        if hardware is None:
            raise InputError("recommend needs --hardware (a profile name from `zeroplan profiles list` or a TOML path)")
        if top < 1:
            raise InputError(f"--top {top} must be a positive integer")
        show_progress = not json_out and sys.stdout.isatty()
        prog_cb = None
        progress = None
        if show_progress:
            from rich.progress import Progress

            progress = Progress(transient=True)
            task = progress.add_task("searching", total=None)
            progress.start()

            def prog_cb(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)
        try:
            rec, _ = run_recommend(
                model=model, hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node,
                ds_config=ds_config, strict=strict, precision=precision, optimizer=optimizer,
                micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, flash_attention=flash_attention,
                headroom=headroom, comm_model=comm_model, mfu=mfu, max_micro_batch=max_micro_batch,
                checkpointing=checkpointing, stages=stage or None, allow_nvme=nvme, top=top, progress=prog_cb,
            )
        finally:
            if progress is not None:
                progress.stop()
        if emit_config is not None and rec.ds_config is not None:
            from zeroplan.specs.deepspeed_config import write_ds_config

            write_ds_config(emit_config, rec.ds_config)
        if json_out:
            print_json(rec)
        else:
            con = console()
            render_recommendation(con, rec)
            if emit_config is not None and rec.ds_config is not None:
                con.print(f"wrote {emit_config}", markup=False, highlight=False)
        if emit_config is not None and rec.ds_config is None:
            from zeroplan.commands._common import fail

            fail(f"--emit-config {emit_config}: nothing fits, so no config was written", 1)
