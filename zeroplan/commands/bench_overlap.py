"""`zeroplan bench overlap`: does communication hide behind compute on this node? (bench/overlap.py)

torch is imported only inside the command body.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from zeroplan.bench.limits import MAX_BUFFER_TEXT, MAX_REPEATS  # no torch: the bound is in --help
from zeroplan.commands._common import console, finite_float, handle_errors

__all__ = ["overlap"]


def _render(report: Any, saved: str | None) -> None:
    from zeroplan.commands.bench import _fmt_size

    out = console()
    out.print(f"bench overlap — {report.backend}, {report.world_size} rank(s), {report.device}, {report.dtype}, "
              f"{report.iters} iters", highlight=False)
    what = "output" if report.op == "all_gather" else "input"
    label = {"compute": "compute alone", "comm": report.op.replace("_", "-") + " alone", "both": "both together"}
    w = max(len(v) for v in label.values()) + 1
    out.print(f"  {label['compute']:{w}}{report.compute_s * 1e3:10.3f} ms   {report.gemms} × ({report.tokens} × "
              f"{report.hidden}) @ ({report.hidden} × {4 * report.hidden}), {report.compute_tflops:.3g} TFLOP/s",
              highlight=False)
    out.print(f"  {label['comm']:{w}}{report.comm_s * 1e3:10.3f} ms   {_fmt_size(report.size_bytes)} {what}, busbw "
              f"{report.busbw_GBps:.3g} GB/s", highlight=False)
    out.print(f"  {label['both']:{w}}{report.both_s * 1e3:10.3f} ms   (hidden for free: "
              f"{max(report.compute_s, report.comm_s) * 1e3:.3f} ms; serialised: "
              f"{(report.compute_s + report.comm_s) * 1e3:.3f} ms)", highlight=False)
    out.print(f"  {'slowdown':{w}}{report.slowdown:10.3f}      of the hidden time is lost (0 = hidden for free, "
              f"1 = nothing hides); the planner's default is {report.planner_default:g}", highlight=False)
    out.print("slowdown = (together − the longer alone) / the shorter alone; each time is the slowest rank's mean.",
              highlight=False)
    for w in report.warnings:
        out.print(f"[yellow]warning:[/] {w}")
    if saved:
        out.print(f"node.overlap_slowdown = {round(report.slowdown, 4):g} → {saved}", highlight=False)


def overlap(
    hidden: Optional[int] = typer.Option(None, "--hidden",
                                         help="Matmul width: (tokens × hidden) @ (hidden × 4·hidden). "
                                              "Default 4096 on CUDA, 256 on CPU."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Matmul rows (micro-batch × sequence). "
                                                                "Default 4096 on CUDA, 256 on CPU."),
    size: Optional[str] = typer.Option(None, "--size", help="The collective's full buffer (all-gather output, "
                                                            "reduce-scatter input; bytes, K/M/G = 2^10/2^20/2^30; "
                                                            f"at most {MAX_BUFFER_TEXT}). "
                                                            "Default 256M on CUDA, 4M on CPU."),
    op: str = typer.Option("all_gather", "--op", help="all_gather (ZeRO-3's parameter prefetch) or reduce_scatter "
                                                      "(its gradient buckets behind the backward)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default bfloat16 on "
                                                              "CUDA, float32 on CPU)."),
    warmup: int = typer.Option(3, "--warmup",
                               help=f"Untimed repetitions before each measurement (0 to {MAX_REPEATS:,})."),
    iters: int = typer.Option(10, "--iters", help=f"Timed repetitions per measurement (1 to {MAX_REPEATS:,})."),
    nproc: int = typer.Option(2, "--nproc", help="Local ranks to start (ignored under torchrun, which sets the world)."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl if CUDA is available, else gloo), nccl or gloo."),
    timeout: float = typer.Option(600.0, "--timeout", parser=finite_float,
                                  help="Seconds before hung ranks are killed."),
    save_profile: Optional[str] = typer.Option(None, "--save-profile",
                                               help="Write --hardware's profile with node.overlap_slowdown set to the "
                                                    "measurement (TOML, atomic)."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="The base profile for --save-profile."),
    output: Optional[str] = typer.Option(None, "--output", help="Also write the JSON report to this file (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
) -> None:
    """Time an all-gather and a run of matmuls alone and together: how much communication hides.

    ZeRO-3 gathers the next module's parameters on a side stream while the current module
    computes (and reduce-scatters gradient buckets beside the backward: --op reduce_scatter);
    the planner charges a fraction of that hidden time back to compute (0.15 by default). This measures the fraction on your node: 0 = the collective hides for free,
    1 = it serialises with compute. The matmul count is calibrated so compute covers the
    collective twice over. Run it across nodes under torchrun for the inter-node figure, then
    --save-profile PATH --hardware BASE so every plan on that profile uses it.
    A rank's matrices and buffers (--tokens, --hidden, --size) must fit the cap that bounds --size
    and, on CPU/gloo, with every local rank's, the host's available memory: checked before any rank starts.
    """
    from zeroplan.commands.bench import check_profile_paths, emit_report, require_torch, run_ranks

    from zeroplan.bench.collectives import parse_size
    from zeroplan.bench.overlap import OverlapConfig, resolve_config, run_overlap, save_overlap_profile
    from zeroplan.runtime.launch import check_timeout

    cfg = OverlapConfig(hidden=hidden, tokens=tokens, dtype=dtype, warmup=warmup, iters=iters, op=op.replace("-", "_"),
                        size_bytes=None if size is None else parse_size(size, "--size"))
    resolve_config(cfg, "cpu")  # the flags' own checks, torch-free (run_overlap applies the device's defaults)
    check_profile_paths(save_profile, output, hardware)
    check_timeout(timeout)
    if hardware is not None:
        from zeroplan.specs.hardware import load_profile

        load_profile(hardware)  # a bad profile fails before any rank starts
    require_torch("bench overlap")  # after the torch-free checks: a typo is reported at once
    report = run_ranks("bench overlap", lambda: run_overlap(cfg, nproc=nproc, backend=backend, timeout_s=timeout))
    if report is None:  # a non-zero torchrun rank: rank 0 reports
        return
    emit_report(report, save=save_overlap_profile, save_profile=save_profile, hardware=hardware, output=output,
                json_out=json_out, render=_render)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("overlap")(handle_errors(overlap))
