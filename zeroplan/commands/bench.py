"""`zeroplan bench collectives`, `bench overlap`, `bench cpu-adam` (commands/bench_overlap.py,
commands/bench_cpu_adam.py) and `bench zero`: the on-cluster proof.

torch is imported only inside the command bodies: `zeroplan --help` and the planning
commands never load it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import typer

from zeroplan._util import InputError, validate_output_path
from zeroplan.bench.limits import (  # no torch: the bounds are in --help
    MAX_BUFFER_TEXT, MAX_REPEATS, SWEEP_BUFFERS_PER_RANK)
from zeroplan.commands._common import (
    LoraAlpha,
    LoraR,
    LoraTargets,
    Method,
    Trainable,
    console,
    err_console,
    fail,
    finite_float,
    handle_errors,
    print_json,
)

__all__ = ["register", "bench_app"]

bench_app = typer.Typer(
    name="bench",
    help="Measure on the cluster: collective bandwidth sweeps, how much communication hides behind compute, "
         "and real ZeRO steps vs the plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


BENCH_EXTRA_HINT = "pip install 'zeroplan[bench]'"


def require_torch(command: str) -> None:
    """One line and exit 2 when torch cannot be imported (the bench commands need it).

    Checked before anything imports torch, so a missing extra is never a traceback.
    """
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # ModuleNotFoundError, or a broken install
        raise InputError(f"{command} needs PyTorch, which is not importable here ({exc}); "
                         f"install the extra: {BENCH_EXTRA_HINT}") from None


def run_ranks(command: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` (which starts or joins the ranks); a rank that fails or hangs ends the command with
    one line and exit 1. None on a non-zero torchrun rank (rank 0 reports)."""
    from zeroplan.runtime.launch import RankError

    try:
        return fn()
    except RankError as exc:
        fail(f"{command}: {exc}", 1)


def check_profile_paths(save_profile: str | None, output: str | None, hardware: str | None, *,
                        fields: str = "the other fields") -> None:
    """The checks every measuring bench makes before it starts: --save-profile and --output are
    writable and name no input, and --save-profile has a --hardware base for ``fields`` (InputError,
    exit 2)."""
    validate_output_path(save_profile, option="--save-profile", inputs={"--hardware": hardware})
    validate_output_path(output, option="--output", inputs={"--hardware": hardware,
                                                            "the --save-profile output": save_profile})
    if save_profile is not None and hardware is None:
        raise InputError(f"--save-profile needs --hardware BASE (a profile name or TOML path) for {fields}")


def emit_report(report: Any, *, save: Callable[[Any, str, str], Any], save_profile: str | None,
                hardware: str | None, output: str | None, json_out: bool,
                render: Callable[[Any, str | None], None]) -> None:
    """Save the measured profile (``save(report, path, hardware)``), write --output, then print the
    report as JSON or through ``render``."""
    from zeroplan.bench.collectives import write_report_json

    if save_profile is not None and hardware is not None:
        save(report, save_profile, hardware)
        report.profile = save_profile
    if output is not None:
        write_report_json(report, output)
    if json_out:
        print_json(report)
    else:
        render(report, save_profile)


def _fmt_size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _render_table(report: Any) -> None:
    from rich.table import Table

    t = Table(title=(f"bench collectives — {report.backend}, world {report.world_size} "
                     f"({report.nodes} node(s) × {report.gpus_per_node}), group {report.group}, {report.dtype}, "
                     f"{report.iters} iters"), title_justify="left")
    predicted = report.hardware is not None
    cols = ["op", "size", "n", "time µs", "algbw GB/s", "busbw GB/s"]
    if predicted:
        cols += [f"pred µs ({report.hardware})", "pred busbw GB/s"]
    # fixed minimum widths for the timing columns: the table's shape does not change with the timings
    widths = {"time µs": 10, "ranks min–med–max µs": 23}
    for col in cols + ["ranks min–med–max µs", "slow"]:
        t.add_column(col, justify="left" if col in ("op", "slow") else "right", no_wrap=True,
                     min_width=widths.get(col))
    for r in report.results:
        row = [r.op, _fmt_size(r.size_bytes), str(r.group_size), f"{r.time_s * 1e6:,.1f}",
               f"{r.algbw_GBps:.3f}", f"{r.busbw_GBps:.3f}"]
        if predicted:
            row += ["-" if r.predicted_time_s is None else f"{r.predicted_time_s * 1e6:,.1f}",
                    "-" if r.predicted_busbw_GBps is None else f"{r.predicted_busbw_GBps:.3f}"]
        t.add_row(*row, f"{r.min_s * 1e6:,.0f}–{r.median_s * 1e6:,.0f}–{r.max_s * 1e6:,.0f}",
                  ",".join(map(str, r.stragglers)) or "-")
    out = console()
    if not out.is_terminal:
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=False, width=max(out.width, 160 if predicted else 110))
    out.print(t)
    out.print("GB/s = 1e9 bytes/s; size = full buffer (nccl-tests convention); time = slowest rank's mean per call.")
    if predicted:
        out.print(f"pred = the planner's α–β time (core/timing.collective_time_s) for the same op, size and layout "
                  f"on --hardware {report.hardware}.")
    if report.stragglers:
        ranks = sorted({s["rank"] for s in report.stragglers})
        out.print(f"[yellow]stragglers (> {report.straggler_threshold:g} × median):[/] ranks "
                  f"{', '.join(map(str, ranks))} in {len(report.stragglers)} of {len(report.results)} measurements")


@bench_app.command("collectives")
@handle_errors
def collectives(
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,broadcast,all_to_all", "--ops",
                            help="Comma list of all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, reduce."),
    min_bytes: str = typer.Option("1K", "--min-bytes", help="Smallest full-buffer size (bytes; K/M/G = 2^10/2^20/2^30)."),
    max_bytes: str = typer.Option("16M", "--max-bytes",
                                  help=f"Largest full-buffer size (bytes; K/M/G binary; at most {MAX_BUFFER_TEXT}, "
                                       f"and on gloo {SWEEP_BUFFERS_PER_RANK} buffers of it per rank must fit the "
                                       "host's available memory)."),
    factor: int = typer.Option(2, "--factor", help="Size multiplier between steps of the sweep."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    warmup: int = typer.Option(5, "--warmup", help=f"Untimed calls per op and size (0 to {MAX_REPEATS:,})."),
    iters: int = typer.Option(20, "--iters", help=f"Timed calls per op and size (1 to {MAX_REPEATS:,})."),
    nproc: int = typer.Option(2, "--nproc", help="Local ranks to start (ignored under torchrun, which sets the world)."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl if CUDA is available, else gloo), nccl or gloo."),
    group: str = typer.Option("all", "--group", help="all (the world), intra (within each node) or inter (across nodes)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node",
                                                help="Ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else --nproc)."),
    straggler_threshold: float = typer.Option(1.5, "--straggler-threshold", parser=finite_float,
                                              help="Flag a rank whose time exceeds this × the median rank's."),
    timeout: float = typer.Option(600.0, "--timeout", parser=finite_float,
                                  help="Seconds before hung ranks are killed."),
    save_profile: Optional[str] = typer.Option(None, "--save-profile",
                                               help="Write a calibrated hardware-profile TOML (alpha-beta fit)."),
    hardware: Optional[str] = typer.Option(None, "--hardware",
                                           help="Profile to predict each row on (pred columns), and the base of "
                                                "--save-profile's other fields."),
    output: Optional[str] = typer.Option(None, "--output", help="Also write the JSON report to this file (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
) -> None:
    """nccl-tests style sweep: time, algbw, busbw per op and size, per-rank spread, stragglers.

    With --hardware, every row also shows the time and bus bandwidth the planner predicts for
    that op and size on that profile (core/timing.collective_time_s).
    """
    from zeroplan.bench.collectives import (
        BenchConfig,
        add_predictions,
        parse_size,
        validate_config,
        write_report_json,
    )
    from zeroplan.runtime.launch import check_timeout, under_torchrun

    cfg = BenchConfig(
        ops=[o.strip() for o in ops.split(",") if o.strip()],
        min_bytes=parse_size(min_bytes, "--min-bytes"), max_bytes=parse_size(max_bytes, "--max-bytes"),
        factor=factor, dtype=dtype, warmup=warmup, iters=iters, group=group, gpus_per_node=gpus_per_node,
        straggler_threshold=straggler_threshold,
    )
    validate_config(cfg)
    check_profile_paths(save_profile, output, hardware, fields="the non-link fields")
    check_timeout(timeout)  # nan, inf, <= 0: one line before any rank starts
    hw_profile = None
    if hardware is not None:
        from zeroplan.specs.hardware import load_profile

        hw_profile = load_profile(hardware)  # fail on a bad profile before running anything
    require_torch("bench collectives")  # after the torch-free checks: a typo is reported at once
    show_progress = not json_out and sys.stdout.isatty() and not under_torchrun()
    report = run_ranks("bench collectives", lambda: _run_sweep(cfg, nproc, backend, timeout, show_progress))
    if report is None:  # a non-zero torchrun rank: rank 0 reports
        return
    if hw_profile is not None:
        add_predictions(report, hw_profile)
    if save_profile is not None:
        save_profile = _save_fitted_profile(report, save_profile, hardware)
    if output is not None:
        write_report_json(report, output)
    if json_out:
        print_json(report)
    else:
        _render_table(report)
        if save_profile is not None:
            for tier, f in report.fit.items():
                console().print(f"{tier} ({f['link_name']}): latency {f['latency_us']:.1f} µs, bandwidth "
                                f"{f['bandwidth_GBps']:.3f} GB/s (R² {f['r2']:.3f}) → {save_profile}")


def _run_sweep(cfg: Any, nproc: int, backend: str, timeout: float, show_progress: bool) -> Any:
    """``run_collectives``, with a progress bar on stderr when ``show_progress``."""
    from zeroplan.bench.collectives import run_collectives

    if not show_progress:
        return run_collectives(cfg, nproc=nproc, backend=backend, timeout_s=timeout)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console(), transient=True) as prog:
        task = prog.add_task("sweep", total=None)

        def on_progress(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total)

        return run_collectives(cfg, nproc=nproc, backend=backend, timeout_s=timeout, on_progress=on_progress)


def _save_fitted_profile(report: Any, save_profile: str, hardware: str | None) -> str | None:
    """--save-profile: the fitted link tier(s) written (and recorded in ``report``); the path, or None
    with a warning when the measured times cannot be fitted."""
    from zeroplan.bench.collectives import save_profile_from_report

    try:
        report.fit = save_profile_from_report(report, save_profile, hardware)
        report.profile = save_profile
    except InputError as exc:  # the measured times cannot be fitted (base and path were checked first)
        reason = str(exc).removeprefix("--save-profile: ")
        err_console().print(f"warning: --save-profile: {reason}; no profile written", markup=False,
                            highlight=False, soft_wrap=True)
        save_profile = None
    for f in report.fit.values():
        if f.get("warning"):
            err_console().print(f"[yellow]warning:[/] {f['warning']}", markup=True)
    return save_profile


from zeroplan.commands import bench_cpu_adam as _bench_cpu_adam  # noqa: E402 - registered between the two
from zeroplan.commands import bench_overlap as _bench_overlap  # noqa: E402

_bench_overlap.register(bench_app)
_bench_cpu_adam.register(bench_app)


@bench_app.command("zero")
@handle_errors
def zero(
    model: str = typer.Option(..., "--model", help="Catalog name, HF config.json path, or a count like 125M."),
    stage: Optional[str] = typer.Option(None, "--stage", help="ZeRO stage(s): 0, 1, 2, 3 or a comma list."),
    ds_config: Optional[str] = typer.Option(None, "--ds-config", help="DeepSpeed JSON config."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="Profile name or TOML path (predicted step time)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32, bf16 or fp16."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="Optimizer preset (the engine runs adamw)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch",
                                              help="Sequences per rank per micro-step (default: the config's, else 2)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (default 32)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum",
                                             help="Micro-steps per optimizer step (default: the config's, else 1)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Measured optimizer steps per stage (default 2; "
                                                              f"at most {MAX_REPEATS:,})."),
    warmup: Optional[int] = typer.Option(None, "--warmup",
                                         help="Unmeasured optimizer steps first (default 2; stage 3 at least 2; "
                                              f"at most {MAX_REPEATS:,})."),
    layers: Optional[int] = typer.Option(None, "--layers",
                                         help="Scale the model to this many layers (default 2; with --simulate: keep)."),
    hidden: Optional[int] = typer.Option(None, "--hidden",
                                         help="Scale the model to this hidden size (default 64, vocabulary 512; "
                                              "with --simulate: keep)."),
    checkpointing: str = typer.Option("none", "--checkpointing",
                                      help="Activation checkpointing in the run and the prediction: none or full."),
    keep_buckets: bool = typer.Option(False, "--keep-buckets",
                                      help="Keep DeepSpeed's absolute bucket defaults (default: scale the buckets the "
                                           "config does not set by the model's scale factor)."),
    nproc: int = typer.Option(2, "--nproc", help="Local ranks (ignored under torchrun)."),
    simulate: bool = typer.Option(False, "--simulate", help="Trace one rank at --gpus ranks without real peers."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="World size to simulate with --simulate."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl if CUDA is available, else gloo), nccl or gloo."),
    comm_model: str = typer.Option("deepspeed", "--comm-model", help="deepspeed or paper."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Per-rank tensor-memory cap (bytes)."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", parser=finite_float,
                                              help="Relative error that fails the run."),
    timeout: float = typer.Option(300.0, "--timeout", parser=finite_float,
                                  help="Seconds before hung ranks are killed."),
    output: Optional[str] = typer.Option(None, "--output", help="Write the JSON report to this file (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
    engine: str = typer.Option("zeroplan", "--engine", help="zeroplan (the bundled runtime) or deepspeed (DeepSpeed's "
                               "real engine with --ds-config; needs zeroplan[deepspeed])."),
    method: Method = None,
    lora_r: LoraR = None,
    lora_alpha: LoraAlpha = None,
    lora_targets: LoraTargets = None,
    trainable: Trainable = None,
) -> None:
    """Run real ZeRO steps per stage and compare predicted vs measured memory and collectives.

    Defaults: the --model is scaled to 2 layers of hidden 64 and vocabulary 512 (a llama-2-7b
    becomes 164,672 parameters), micro-batch 2, sequence 32, grad-accum 1, 2 warm-up + 2 measured
    steps. Bucket sizes the DeepSpeed config does not set are scaled by the same factor as the
    model (--keep-buckets uses DeepSpeed's absolute defaults). The header prints every input.
    --method lora / --lora-r / --lora-targets / --trainable: both engines train LoRA adapters (or
    the matching tensors) on a frozen base, and the prediction plans the same fine-tuning.
    """
    if gpus is not None and not simulate:  # it was ignored: --nproc sets the ranks that really run
        raise InputError(f"--gpus {gpus} is the world size --simulate traces one rank of; without --simulate "
                         "the ranks that run are --nproc")
    require_torch("bench zero")
    from zeroplan.runtime.launch import check_gpus_for, resolve_backend, under_torchrun
    from zeroplan.runtime.torchrun import check_timeout

    check_timeout(timeout)  # nan, inf, <= 0: one line before any rank starts
    if not simulate and not under_torchrun() and resolve_backend(backend) == "nccl":
        check_gpus_for(nproc)  # one GPU per rank, before the model is built
    try:
        from zeroplan.bench.validate import run_bench_zero_cli
    except ImportError as exc:
        raise InputError(f"bench zero is not available in this build ({exc})") from None
    validate_output_path(output, option="--output", inputs={"--model": model, "--ds-config": ds_config,
                                                            "--hardware": hardware})
    options = dict(model=model, stage=stage, ds_config=ds_config, hardware=hardware, precision=precision,
                   optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                   steps=steps, warmup=warmup, layers=layers, hidden=hidden, nproc=nproc, simulate=simulate,
                   gpus=gpus, backend=backend, comm_model=comm_model, memory_limit=memory_limit,
                   tolerance=tolerance, timeout=timeout, output=output, json_out=json_out, engine=engine,
                   checkpointing=checkpointing, keep_buckets=keep_buckets, method=method, lora_r=lora_r,
                   lora_alpha=lora_alpha, lora_targets=lora_targets, trainable=trainable)
    code = run_bench_zero_cli(**options)
    if code:
        raise typer.Exit(int(code))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
