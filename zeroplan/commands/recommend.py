"""`zeroplan recommend`: the ZeRO stage, offload, micro-batch and buckets to use, and why."""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer
from typing_extensions import Annotated

from zeroplan.commands._common import (
    DEFAULT_COMM_MODEL, DEFAULT_HEADROOM, DEFAULT_MFU, Checkpointing, CommModel, DsConfig, FlashAttention,
    GpusPerNode, GradAccum, Gpus, Hardware, Headroom, Json, Lenient, MicroBatch, Mfu, Model, Nodes, Optimizer,
    Precision, SeqLen, Stage, Strict, console, handle_errors, parse_stages, print_json,
)

__all__ = ["register", "run_recommend", "render_recommendation"]


def run_recommend(*, headroom: float = DEFAULT_HEADROOM, comm_model: str = DEFAULT_COMM_MODEL,
                  mfu: float | None = DEFAULT_MFU, max_micro_batch: Optional[int] = None, checkpointing: Optional[str] = None,
                  stages: Optional[list[int]] = None, allow_nvme: bool = True, top: int = 8,
                  progress: Any = None, lenient: bool = False, **kw: Any):
    """Library entry: build the inputs from CLI-style keywords and return (Recommendation, PlanInputs).

    The chosen DeepSpeed config (``rec.ds_config``) carries a ``zeroplan`` block with the sequence
    length, checkpointing and flash attention it was planned for, so ``check`` reads them back.
    """
    from zeroplan.advice.recommend import recommend
    from zeroplan.core.inputs import annotate_ds_config, build_plan_inputs, refuse_ds_errors

    inp = build_plan_inputs(**kw)
    if not lenient:
        refuse_ds_errors(inp.ds)
    rec = recommend(inp, headroom=headroom, comm_model=comm_model, mfu=mfu, max_micro_batch=max_micro_batch,
                    micro_batch=kw.get("micro_batch"), checkpointing=checkpointing, stages=stages,
                    allow_nvme=allow_nvme, top=top, progress=progress)
    if rec.ds_config is not None and rec.chosen is not None:
        rec.ds_config = annotate_ds_config(
            rec.ds_config, seq_len=inp.training.seq_len, checkpointing=rec.chosen.checkpointing,
            flash_attention=inp.training.flash_attention, model=inp.spec.name,
            hardware=inp.hardware.name if inp.hardware is not None else None, n_gpus=inp.n_gpus)
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
                  "The emitted config records it (zeroplan.checkpointing) for `zeroplan check`.", markup=False, highlight=False)
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
        model: Model,
        hardware: Hardware = None,
        gpus: Gpus = None,
        nodes: Nodes = None,
        gpus_per_node: GpusPerNode = None,
        ds_config: DsConfig = None,
        precision: Precision = None,
        optimizer: Optimizer = None,
        micro_batch: MicroBatch = None,
        max_micro_batch: Annotated[Optional[int], typer.Option(
            "--max-micro-batch", metavar="N", show_default="1024",
            help="Largest micro-batch to search.")] = None,
        seq_len: SeqLen = None,
        grad_accum: GradAccum = None,
        checkpointing: Checkpointing = None,
        flash_attention: FlashAttention = None,
        stage: Stage = None,
        headroom: Headroom = DEFAULT_HEADROOM,
        nvme: Annotated[bool, typer.Option("--nvme/--no-nvme", help="Consider NVMe offload.")] = True,
        top: Annotated[int, typer.Option("--top", metavar="N", help="Alternatives shown.")] = 8,
        comm_model: CommModel = DEFAULT_COMM_MODEL,
        mfu: Mfu = DEFAULT_MFU,
        strict: Strict = False,
        lenient: Lenient = False,
        emit_config: Annotated[Optional[str], typer.Option(
            "--emit-config", metavar="PATH", show_default="none",
            help="Write the chosen DeepSpeed config (JSON, atomically), with a zeroplan block recording the "
                 "sequence length and checkpointing it assumes, so `zeroplan check` reads them back.")] = None,
        json_out: Json = False,
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
                checkpointing=checkpointing, stages=parse_stages(stage), allow_nvme=nvme, top=top, progress=prog_cb,
                lenient=lenient,
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
