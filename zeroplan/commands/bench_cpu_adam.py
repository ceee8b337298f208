"""`zeroplan bench cpu-adam`: DeepSpeedCPUAdam's step rate on this host (bench/cpu_adam.py).

torch and DeepSpeed are imported only inside the command body.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from zeroplan._util import parse_count
from zeroplan.bench.cpu_adam import CpuAdamConfig  # pydantic only: torch and DeepSpeed load in the command
from zeroplan.bench.limits import MAX_REPEATS  # no torch: the bound is in --help
from zeroplan.commands._common import console, err_console, finite_float, handle_errors

__all__ = ["cpu_adam"]

_DEFAULT = CpuAdamConfig()  # the option defaults are the config's


def _render(report: Any, saved: str | None) -> None:
    from zeroplan.bench.cpu_adam import UPDATE_BYTES_PER_PARAM

    out = console()
    name = "DeepSpeedCPUAdam" if report.optimizer == "deepspeed" else "torch.optim.AdamW"
    simd = f", {report.simd}" if report.simd else ""
    out.print(f"bench cpu-adam — {name} ({report.optimizer_version}{simd}), {report.cpu}", highlight=False)
    out.print(f"  {report.nproc} rank(s) × {report.threads} thread(s) on {report.cores_used} of "
              f"{report.physical_cores} physical cores{' (bound)' if report.bind_cores else ''}, "
              f"{report.params:,} fp32 parameters per rank, {report.iters} iterations", highlight=False)
    out.print(f"  step            {report.step_s * 1e3:10.2f} ms   (first start to last end, median; each rank alone "
              f"{min(report.step_s_by_rank) * 1e3:.2f}–{max(report.step_s_by_rank) * 1e3:.2f} ms)", highlight=False)
    out.print(f"  per rank        {report.params_per_s_per_rank:10.3g} parameters/s", highlight=False)
    out.print(f"  node            {report.params_per_s_total:10.3g} parameters/s   ({report.memory_GBps:.3g} GB/s "
              f"of fp32 traffic at {UPDATE_BYTES_PER_PARAM} B per parameter)", highlight=False)
    out.print(f"  per core        {report.params_per_s_per_core:10.3g} parameters/s   "
              f"node.cpu_adam_params_per_s_per_core", highlight=False)
    ref = f"the planner's default is {report.planner_default:.3g}"
    if report.profile_value is not None:
        ref = f"--hardware's profile has {report.profile_value:.3g}; {ref}"
    out.print(f"  ({ref})", highlight=False)
    out.print("node = every rank's parameters / (first start to last end); per core = node / the busy cores.",
              highlight=False)
    for w in report.warnings:
        out.print(f"[yellow]warning:[/] {w}")
    if saved:
        out.print(f"node.cpu_adam_params_per_s_per_core = {report.params_per_s_per_core:.4g} → {saved}",
                  highlight=False)


def cpu_adam(
    nproc: Optional[int] = typer.Option(None, "--nproc",
                                        help="Processes stepping at once, one per GPU rank of the node. Default: "
                                             "--hardware's GPUs per node, else 1."),
    threads: Optional[int] = typer.Option(None, "--threads",
                                          help="OpenMP threads per process. Default: the physical cores divided "
                                               "among the processes."),
    params: str = typer.Option(str(_DEFAULT.params), "--params",
                               help="fp32 parameters per process (its optimizer partition), e.g. 50M, 2e8; "
                                    "16 bytes each."),
    optimizer: str = typer.Option(_DEFAULT.optimizer, "--optimizer",
                                  help="deepspeed (DeepSpeedCPUAdam, what ZeRO-Offload runs) or torch "
                                       "(torch.optim.AdamW, for comparison)."),
    bind_cores: bool = typer.Option(_DEFAULT.bind_cores, "--bind-cores",
                                    help="Pin each process to its own physical cores, as DeepSpeed's "
                                         "--bind_cores_to_rank does."),
    warmup: int = typer.Option(_DEFAULT.warmup, "--warmup",
                               help=f"Untimed steps per process (0 to {MAX_REPEATS:,})."),
    iters: int = typer.Option(_DEFAULT.iters, "--iters", help=f"Timed steps per process (1 to {MAX_REPEATS:,})."),
    timeout: float = typer.Option(600.0, "--timeout", parser=finite_float,
                                  help="Seconds before hung processes are killed."),
    save_profile: Optional[str] = typer.Option(None, "--save-profile",
                                               help="Write --hardware's profile with "
                                                    "node.cpu_adam_params_per_s_per_core set to the measurement "
                                                    "(TOML, atomic)."),
    hardware: Optional[str] = typer.Option(None, "--hardware",
                                           help="Profile to compare with, and the base for --save-profile."),
    output: Optional[str] = typer.Option(None, "--output", help="Also write the JSON report to this file (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
) -> None:
    """Time DeepSpeedCPUAdam's step on this host as ZeRO-Offload runs it, every rank at once.

    With offload_optimizer: cpu each rank updates its fp32 partition on the host after the
    backward, and nothing hides that step. Its rate is bound by host memory bandwidth once every
    rank steps together, so run this with one process per GPU of the node (--nproc, or the
    profile's GPUs per node via --hardware). Then --save-profile PATH --hardware BASE, and every
    plan on that profile times the CPU optimizer with your figure instead of the default.
    The first run builds DeepSpeed's cpu_adam op (a minute or so; it is cached afterwards).
    """
    from zeroplan.commands.bench import check_profile_paths, emit_report, require_torch, run_ranks

    from zeroplan.bench.cpu_adam import check_config, check_savable, run_cpu_adam, save_cpu_adam_profile
    from zeroplan.runtime.launch import check_timeout, check_world_size

    check_profile_paths(save_profile, output, hardware)
    if save_profile is not None:
        check_savable(optimizer)  # before the run, not after it
    check_timeout(timeout)
    base = None
    if hardware is not None:
        from zeroplan.specs.hardware import load_profile

        base = load_profile(hardware)  # a bad profile fails before any process starts
    if nproc is None:
        nproc = base.node.gpus_per_node if base is not None else 1
    cfg = CpuAdamConfig(params=parse_count(params, "--params"), threads=threads, warmup=warmup, iters=iters,
                        optimizer=optimizer, bind_cores=bind_cores)
    check_world_size(nproc)
    check_config(cfg, nproc)  # bad settings: one line before the progress line and any process
    require_torch("bench cpu-adam")  # after the torch-free checks: a typo is reported at once
    if not json_out:  # progress on stderr: stdout stays the report
        build = " (DeepSpeed builds its cpu_adam op on first use)" if optimizer == "deepspeed" else ""
        err_console().print(f"bench cpu-adam: {nproc} process(es) × {cfg.params:,} parameters{build} …",
                            highlight=False)
    profile_value = None if base is None else base.node.cpu_adam_params_per_s_per_core
    report = run_ranks("bench cpu-adam", lambda: run_cpu_adam(cfg, nproc=nproc, timeout_s=timeout,
                                                               profile_value=profile_value))
    emit_report(report, save=save_cpu_adam_profile, save_profile=save_profile, hardware=hardware, output=output,
                json_out=json_out, render=_render)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("cpu-adam")(handle_errors(cpu_adam))
