"""`zeroplan recommend`: the ZeRO stage, offload, micro-batch and buckets to use, and why."""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError
from zeroplan.commands._common import (
    LoraRanks, GlobalBatchTarget, OptionalModel,
    DEFAULT_COMM_MODEL, DEFAULT_HEADROOM, DEFAULT_MFU, DEFAULT_TOP, Checkpointing, CommModel, DsConfig,
    FlashAttention, GpusPerNode, Kernels, GradAccum, Gpus, Hardware, Headroom, Json, Lenient, MicroBatch, Mfu, Nodes,
    Optimizer, Precision, SeqLen, Stage, Strict, console, handle_errors, with_fine_tuning_options, options_from, print_json,
    read_files,
)
from zeroplan.options import RecommendOptions

__all__ = ["register", "render_recommendation"]


def _elems(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def _fmt_value(v: Any) -> str:
    import json

    return "(absent)" if v is None else json.dumps(v)


def render_recommendation(con: Any, rec: Any) -> None:
    from rich.table import Table

    from zeroplan.report.render import esc, gb, seconds

    if not con.is_terminal:
        con.width = max(con.width, 150)  # pipes and files: keep the table and sentences on one line each
    m, c = rec.model, rec.cluster
    con.print(f"[bold]{esc(m.name)}[/]: {m.params:,} parameters on {c.n_gpus} GPUs = {c.nodes} node(s) × "
              f"{c.gpus_per_node} of {esc(c.hardware)} ({esc(c.gpu)}, {gb(c.gpu_memory_bytes)} each)", markup=True)
    t = rec.training
    con.print(f"{t['precision']} ({t['precision_source']}), {t['optimizer']}, sequence {t['seq_len']}, grad-accum "
              f"{t['grad_accum']}, micro-batch {t['micro_batch']}, checkpointing {t['checkpointing']}; "
              f"headroom {rec.headroom:.0%}; {rec.searched:,} configurations decided", markup=False)
    con.print()
    fs = rec.finetune_search
    if fs is not None:
        _render_finetune(con, fs)
    what = f"{fs.chosen} on " if fs is not None and fs.chosen is not None else ""
    if rec.chosen is not None:
        ga = f", gradient accumulation {rec.training['grad_accum']}" if rec.global_batch is not None else ""
        con.print(f"[bold green]Use {what}{rec.chosen.label()}[/] with micro-batch {rec.chosen.micro_batch}{ga} and "
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


def _render_finetune(con: Any, fs: Any) -> None:
    from rich.table import Table

    from zeroplan.report.render import gb

    table = Table(title=f"Fine-tuning methods searched (chosen: {fs.rule})", title_justify="left")
    for col, just in (("method", "left"), ("trainable", "right"), ("fits", "left"), ("configuration", "left"),
                      ("micro-batch", "right"), ("grad-accum", "right"), ("peak/GPU", "right"), ("tokens/s", "right")):
        table.add_column(col, justify=just)
    for v in fs.variants:
        c = v.configuration
        mark = "→ " if v.label == fs.chosen else ""
        table.add_row(f"{mark}{v.label}", f"{v.trainable_params:,}", "yes" if v.fits else "no (leanest shown)",
                      f"{c.label()}, {c.checkpointing} ckpt", str(c.micro_batch), str(v.grad_accum), gb(v.peak_bytes),
                      f"{v.tokens_per_s:,.0f}" if v.tokens_per_s is not None else "-")
    con.print(table)
    for n in fs.notes:
        con.print(f"  note: {n}", markup=False, highlight=False)


def _write_emitted(ds_config_path: str, sidecar: str, rec: Any) -> None:
    """The chosen DeepSpeed config and its PEFT / Trainer settings sidecar (advice/peft_settings.py,
    pointing at the DeepSpeed file), both or neither (``atomic_write_files``)."""
    import json

    from zeroplan._util import atomic_write_files
    from zeroplan.specs.ds_writer import ds_config_text

    settings = dict(rec.peft or {})
    if "trainer" in settings:
        settings["trainer"] = {**settings["trainer"], "deepspeed": ds_config_path}
    atomic_write_files([(ds_config_path, ds_config_text(ds_config_path, rec.ds_config).encode()),
                        (sidecar, (json.dumps(settings, indent=2, allow_nan=False) + "\n").encode())])


def _check_emit_path(emit_config: str | None) -> None:
    """--emit-config writes two files (the config and its ``.peft.json`` sidecar), so it needs a
    regular file path: not a device or FIFO (``-`` is refused before, in ``recommend``)."""
    import os
    import stat

    from zeroplan._util import display_path, expand_path

    if emit_config is None:
        return
    try:
        mode = os.stat(expand_path(emit_config)).st_mode
    except OSError:
        return  # a new file (validate_output_path checks its directory)
    if not stat.S_ISREG(mode):  # a device or a FIFO with a reader (validate_output_path refuses the rest)
        raise InputError(f"--emit-config {display_path(emit_config)}: not a regular file; it writes two files "
                         "(the config and its .peft.json sidecar beside it), so give a file path")


def recommend_cmd(
    model: OptionalModel = None,
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
    kernels: Kernels = None,
    stage: Stage = None,
    headroom: Headroom = DEFAULT_HEADROOM,
    allow_nvme: Annotated[bool, typer.Option("--nvme/--no-nvme", help="Consider NVMe offload.")] = (
        RecommendOptions.model_fields["allow_nvme"].default),
    top: Annotated[int, typer.Option("--top", metavar="N", help="Alternatives shown.")] = DEFAULT_TOP,
    comm_model: CommModel = DEFAULT_COMM_MODEL,
    mfu: Mfu = DEFAULT_MFU,
    strict: Strict = False,
    lenient: Lenient = False,
    emit_config: Annotated[Optional[str], typer.Option(
        "--emit-config", metavar="PATH", show_default="none",
        help="Write the chosen DeepSpeed config (JSON, atomically), with a zeroplan block recording the "
             "sequence length and checkpointing it assumes, so `zeroplan check` reads them back; and beside it "
             "(PATH.json -> PATH.peft.json) the PEFT, bitsandbytes and Trainer settings it assumes.")] = None,
    lora_ranks: LoraRanks = None,
    global_batch: GlobalBatchTarget = None,
    json_out: Json = False,
    **fine_tuning: Any,
) -> None:
    """Which ZeRO stage, offload, micro-batch, checkpointing and buckets to use on this cluster, and why.

    Capacity first (peak per GPU, host RAM and NVMe per node must fit with --headroom), then the
    highest useful throughput, preferring the lower stage within 5% and no offload unless it is
    twice as fast. Example: zeroplan recommend -m llama-2-70b -H h100-8x-ib400 --nodes 4 -p bf16
    """
    from zeroplan._util import validate_output_path
    from zeroplan.api import recommend as recommend_api

    from zeroplan.api import peft_sidecar_path

    if emit_config == "-":  # before validate_output_path, whose "-" message says less
        raise InputError("--emit-config -: writes two files (the config and its .peft.json sidecar), "
                         "so it needs a file path, not stdout")
    sidecar = peft_sidecar_path(emit_config) if emit_config is not None else None
    for path in (emit_config, sidecar):
        validate_output_path(path, option="--emit-config", inputs=read_files(model, hardware, ds_config, fine_tuning))
    _check_emit_path(emit_config)
    options = options_from(RecommendOptions, {**locals(), **fine_tuning})
    show_progress = not json_out and sys.stdout.isatty()
    prog_cb = None
    progress = None
    if show_progress and hardware is not None:
        from rich.progress import Progress

        progress = Progress(transient=True)
        task = progress.add_task("searching", total=None)
        progress.start()

        def prog_cb(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
    try:
        rec = recommend_api(options, progress=prog_cb)
    finally:
        if progress is not None:
            progress.stop()
    if emit_config is not None and rec.ds_config is not None:
        _write_emitted(emit_config, sidecar, rec)
    if json_out:
        print_json(rec)
    else:
        con = console()
        render_recommendation(con, rec)
        if emit_config is not None and rec.ds_config is not None:
            con.print(f"wrote {emit_config} and {sidecar}", markup=False, highlight=False)
    if emit_config is not None and rec.ds_config is None:
        from zeroplan.commands._common import fail

        fail(f"--emit-config {emit_config}: nothing fits, so no config was written", 1)


def register(app: typer.Typer) -> None:
    app.command("recommend")(handle_errors(with_fine_tuning_options(recommend_cmd)))
