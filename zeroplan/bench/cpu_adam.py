"""`zeroplan bench cpu-adam`: how fast DeepSpeedCPUAdam steps on this host, as ZeRO-Offload runs it.

With ``offload_optimizer: cpu`` every rank runs the Adam update of its fp32 partition on the
host between the backward and the next forward, and nothing hides it (core/timing.py
``cpu_adam_rate``: ``node.cpu_adam_params_per_s_per_core`` × the cores one rank gets). The update
reads a parameter, its gradient and the two moments and writes three of them back (28 bytes of
fp32 traffic per parameter), so a node whose ranks all step at once is bound by host memory
bandwidth long before its cores run out: one idle core's rate says little about eight busy ranks.

This starts ``nproc`` local processes (one per GPU rank, as the launcher would), each with
``threads`` OpenMP threads (the physical cores divided among the ranks, as DeepSpeed's
``--bind_cores_to_rank`` does), and a flat fp32 partition of ``params`` parameters with its
gradient. Each iteration every rank waits at a barrier, then times one
``DeepSpeedCPUAdam.step()`` (AdamW, fp32 states: DeepSpeed's ZeRO-Offload optimizer; ops/adam
``cpu_adam.py``). An iteration lasts from the first rank's start to the last rank's end on the
host's monotonic clock; the figure is the median over iterations. ``--optimizer torch`` times
``torch.optim.AdamW`` instead (for the ratio DeepSpeed quotes, 5-7x); only DeepSpeed's figure can
be saved to a profile.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from datetime import date
from typing import Any

from pydantic import BaseModel, Field

from zeroplan._util import InputError

__all__ = ["CpuAdamConfig", "CpuAdamReport", "core_cpus", "physical_cores", "rank_cpus", "plan_threads",
           "check_config", "cpu_adam_rank", "aggregate_cpu_adam", "run_cpu_adam", "check_savable",
           "save_cpu_adam_profile", "validation_rows", "BYTES_PER_PARAM", "UPDATE_BYTES_PER_PARAM", "DEFAULT_PARAMS"]

DEFAULT_PARAMS = 50_000_000  # per rank: 4 fp32 tensors of 200 MB each, far beyond any CPU cache
BYTES_PER_PARAM = 16  # memory one rank holds per parameter: fp32 parameter, gradient, exp_avg, exp_avg_sq
UPDATE_BYTES_PER_PARAM = 28  # traffic of one AdamW update: reads those four, writes parameter and moments back
OPTIMIZERS = ("deepspeed", "torch")
CPUINFO = "/proc/cpuinfo"  # the CPU topology and model name (Linux)


class CpuAdamConfig(BaseModel):
    params: int = DEFAULT_PARAMS
    threads: int | None = Field(None, description="OpenMP threads per rank; None: physical cores / nproc")
    warmup: int = 2
    iters: int = 5
    optimizer: str = "deepspeed"
    bind_cores: bool = False


class CpuAdamReport(BaseModel):
    optimizer: str = Field(description="deepspeed (DeepSpeedCPUAdam) or torch (torch.optim.AdamW)")
    optimizer_version: str
    simd: str = Field(description="the SIMD width DeepSpeed's op was built for ('' for torch)")
    cpu: str
    physical_cores: int = Field(description="physical cores this process may run on")
    nproc: int
    threads: int = Field(description="OpenMP threads per rank")
    cores_used: int = Field(description="min(physical cores, nproc × threads)")
    bind_cores: bool
    params: int = Field(description="parameters per rank")
    warmup: int
    iters: int
    step_s: float = Field(description="median over iterations of first start to last end across ranks")
    step_s_by_rank: list[float] = Field(description="each rank's median step")
    params_per_s_per_rank: float
    params_per_s_total: float
    params_per_s_per_core: float = Field(description="total / cores_used: node.cpu_adam_params_per_s_per_core")
    memory_GBps: float = Field(description="fp32 traffic of the update (UPDATE_BYTES_PER_PARAM) / step, 1e9 B/s")
    planner_default: float = Field(description="core/timing.py CPU_ADAM_PARAMS_PER_S_PER_CORE")
    profile_value: float | None = Field(None, description="--hardware's node.cpu_adam_params_per_s_per_core")
    warnings: list[str] = Field(default_factory=list)
    profile: str | None = None


def core_cpus() -> list[list[int]]:
    """The CPUs this process may run on, grouped by physical core (hyper-threads of one core
    together), in /proc/cpuinfo order; one group per CPU when the topology cannot be read."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    groups: dict[tuple[str, str], list[int]] = {}
    try:
        proc: int | None = None
        phys = core = ""
        with open(CPUINFO, encoding="utf-8", errors="replace") as fh:
            for line in [*fh, ""]:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    proc = int(value)
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                elif not key and proc is not None:  # the blank line that ends one processor's block
                    if proc in allowed:
                        groups.setdefault((phys, core or str(proc)), []).append(proc)
                    proc, phys, core = None, "", ""
    except (OSError, ValueError):
        groups = {}
    return list(groups.values()) or [[c] for c in allowed] or [[0]]


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once)."""
    return len(core_cpus())


def rank_cpus(nproc: int, threads: int) -> list[list[int]]:
    """Each rank's CPUs under --bind-cores: ``threads`` physical cores apiece in order (one CPU of
    each), as DeepSpeed's ``--bind_cores_to_rank`` splits the cores; wraps round when short."""
    cores = core_cpus()
    return [[cores[(r * threads + i) % len(cores)][0] for i in range(threads)] for r in range(nproc)]


def cpu_model() -> str:
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plan_threads(cfg: CpuAdamConfig, nproc: int, cores: int) -> int:
    """OpenMP threads per rank: ``cfg.threads``, else the physical cores shared among the ranks."""
    if cfg.threads is not None:
        return cfg.threads
    return max(1, cores // nproc)


def check_config(cfg: CpuAdamConfig, nproc: int) -> None:
    """InputError (exit 2) for settings that cannot run here, before any rank starts."""
    if cfg.optimizer not in OPTIMIZERS:
        raise InputError(f"--optimizer {cfg.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if cfg.params < 1:
        raise InputError(f"--params {cfg.params}: expected a positive number of parameters")
    if cfg.threads is not None and cfg.threads < 1:
        raise InputError(f"--threads {cfg.threads}: expected a whole number >= 1")
    from zeroplan.bench.limits import HOST_MEMORY_FRACTION, check_repeats
    from zeroplan.runtime.launch import mem_available_bytes

    check_repeats(cfg.iters, cfg.warmup)
    need = nproc * cfg.params * BYTES_PER_PARAM
    avail = mem_available_bytes()
    if avail is not None and need > HOST_MEMORY_FRACTION * avail:
        raise InputError(f"--params {cfg.params} × --nproc {nproc}: the partitions need {need / 2**30:.1f} GiB "
                         f"({BYTES_PER_PARAM} B per parameter), more than {HOST_MEMORY_FRACTION:.0%} of the "
                         f"{avail / 2**30:.1f} GiB available; lower --params")


# ------------------------------------------------------------------ one rank
def _optimizer(name: str, param: Any) -> Any:
    import torch

    if name == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01, adamw_mode=True, fp32_optimizer_states=True)
    return torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01)


def cpu_adam_rank(rank: int, world_size: int, cfg_json: str, threads: int, cpus: list[int]) -> dict[str, Any]:
    """Runs in each forked rank: its own partition, ``warmup`` untimed and ``iters`` timed steps,
    each timed step entered together with every other rank (a gloo barrier) and recorded as its
    start and end on the host's monotonic clock."""
    import torch
    import torch.distributed as dist

    cfg = CpuAdamConfig.model_validate_json(cfg_json)
    if cpus:  # --bind-cores: this rank's slice of the physical cores, as --bind_cores_to_rank does
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)  # also the OpenMP team size of DeepSpeed's op (same libgomp)
    gen = torch.Generator().manual_seed(rank)
    param = torch.nn.Parameter(torch.randn(cfg.params, generator=gen))
    param.grad = torch.randn(cfg.params, generator=gen) * 1e-3
    opt = _optimizer(cfg.optimizer, param)
    for _ in range(cfg.warmup):
        opt.step()
    spans = []  # CLOCK_MONOTONIC is one clock for every process of the host: spans compare across ranks
    for _ in range(cfg.iters):
        dist.barrier()
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        opt.step()
        spans.append((t0, time.clock_gettime(time.CLOCK_MONOTONIC)))
    return {"rank": rank, "spans_s": spans, "finite": bool(torch.isfinite(param).all())}


# ------------------------------------------------------------------ the parent
def optimizer_info(name: str) -> tuple[str, str]:
    """(version, SIMD width) of the optimizer to time; for DeepSpeed, builds or loads its cpu_adam
    op here, once, so no rank compiles it inside the timeout. InputError when it cannot."""
    import torch

    if name == "torch":
        return f"torch {torch.__version__}", ""
    # DeepSpeed's logger writes to the stdout it finds at import: bind it to stderr, so --json's
    # stdout stays one JSON object (the ranks fork from here and inherit the handler). Without a
    # GPU, name the CPU accelerator DeepSpeed would fall back to, so it does not warn that it did.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    with contextlib.redirect_stdout(sys.stderr):
        return _load_deepspeed_op()


def _load_deepspeed_op() -> tuple[str, str]:
    try:
        import deepspeed
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install: one line, exit 2
        raise InputError(f"bench cpu-adam needs DeepSpeed ({type(exc).__name__}: {exc}); install it with "
                         f"DS_BUILD_OPS=0 pip install deepspeed (its cpu_adam op is built on first use), "
                         f"or time torch's AdamW with --optimizer torch") from None
    builder = CPUAdamBuilder()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise InputError(f"bench cpu-adam: DeepSpeed's cpu_adam op could not be built or loaded "
                         f"({type(exc).__name__}: {first}); it needs a C++ compiler and ninja (pip install ninja)"
                         ) from None
    simd = str(builder.simd_width()).replace("-D__", "").replace("__", "")
    return f"deepspeed {deepspeed.__version__}", simd


def aggregate_cpu_adam(per_rank: list[dict[str, Any]], cfg: CpuAdamConfig, *, threads: int, cores: int,
                       version: str, simd: str, planner_default: float,
                       profile_value: float | None = None) -> CpuAdamReport:
    """The report from every rank's step times (all ranks ran the same iterations)."""
    nproc = len(per_rank)
    # An iteration lasts from the first rank's start to the last rank's end: ranks that take turns
    # on shared cores (one ends before the next starts) add up, as they do on the training node.
    by_iter = list(zip(*(r["spans_s"] for r in per_rank)))
    step_s = statistics.median(max(t1 for _, t1 in it) - min(t0 for t0, _ in it) for it in by_iter)
    by_rank = [statistics.median(t1 - t0 for t0, t1 in r["spans_s"]) for r in per_rank]
    cores_used = max(1, min(cores, nproc * threads))
    per_rank_rate = cfg.params / step_s
    total = per_rank_rate * nproc
    warnings = []
    if not all(r.get("finite", True) for r in per_rank):
        warnings.append("a rank's parameters became non-finite: the step did not run as AdamW")
    if nproc * threads > cores:
        warnings.append(f"{nproc} rank(s) × {threads} thread(s) oversubscribe the {cores} physical core(s): "
                        f"the processes take turns on the cores (the node figure still holds; the run says "
                        f"nothing about more cores)")
    elif nproc * threads < cores:
        warnings.append(f"{nproc * threads} of {cores} physical cores were busy: on a training node every "
                        f"core steps at once and shares memory bandwidth, so this per-core figure is likely "
                        f"high; run with the node's GPU count as --nproc and the default --threads")
    if max(by_rank) > 1.5 * min(by_rank):
        warnings.append(f"ranks differ: median steps {min(by_rank):.4g} s to {max(by_rank):.4g} s")
    return CpuAdamReport(
        optimizer=cfg.optimizer, optimizer_version=version, simd=simd, cpu=cpu_model(), physical_cores=cores,
        nproc=nproc, threads=threads, cores_used=cores_used, bind_cores=cfg.bind_cores, params=cfg.params,
        warmup=cfg.warmup, iters=cfg.iters, step_s=step_s, step_s_by_rank=by_rank,
        params_per_s_per_rank=per_rank_rate, params_per_s_total=total, params_per_s_per_core=total / cores_used,
        memory_GBps=UPDATE_BYTES_PER_PARAM * total / 1e9, planner_default=planner_default, profile_value=profile_value,
        warnings=warnings)


def run_cpu_adam(cfg: CpuAdamConfig, *, nproc: int = 1, timeout_s: float = 600,
                 profile_value: float | None = None) -> CpuAdamReport:
    """Fork ``nproc`` local ranks (gloo, for the barrier), time their steps, aggregate."""
    from zeroplan.core.timing import CPU_ADAM_PARAMS_PER_S_PER_CORE
    from zeroplan.runtime.launch import check_world_size, spawn

    check_world_size(nproc)
    check_config(cfg, nproc)
    cores = physical_cores()
    threads = plan_threads(cfg, nproc, cores)
    version, simd = optimizer_info(cfg.optimizer)
    cpus = rank_cpus(nproc, threads) if cfg.bind_cores else [[] for _ in range(nproc)]
    per_rank = spawn(_rank_entry, nproc, args=(cfg.model_dump_json(), threads, cpus), backend="gloo",
                     timeout_s=timeout_s)
    return aggregate_cpu_adam(per_rank, cfg, threads=threads, cores=cores, version=version, simd=simd,
                              planner_default=CPU_ADAM_PARAMS_PER_S_PER_CORE, profile_value=profile_value)


def _rank_entry(rank: int, world_size: int, cfg_json: str, threads: int, cpus: list[list[int]]) -> dict[str, Any]:
    return cpu_adam_rank(rank, world_size, cfg_json, threads, cpus[rank])


def check_savable(optimizer: str) -> None:
    """InputError unless ``optimizer``'s rate may go into a profile: only DeepSpeedCPUAdam's."""
    if optimizer != "deepspeed":
        raise InputError("--save-profile: only DeepSpeedCPUAdam's rate can be saved (the planner models "
                         "DeepSpeed's ZeRO-Offload step); drop --optimizer torch")


def save_cpu_adam_profile(report: CpuAdamReport, path: str, hardware: str) -> Any:
    """Write ``hardware`` (a profile name or TOML path) with ``node.cpu_adam_params_per_s_per_core``
    set to the measurement and its source; returns the profile written."""
    from zeroplan.specs import hardware as hw

    check_savable(report.optimizer)
    base = hw.load_profile(hardware)
    note = (f"measured by zeroplan bench cpu-adam on {date.today().isoformat()}: {report.optimizer_version} "
            f"DeepSpeedCPUAdam ({report.simd or 'scalar'}), {report.cpu}, {report.nproc} rank(s) x {report.threads} "
            f"thread(s) on {report.cores_used} of {report.physical_cores} physical cores"
            f"{', cores bound' if report.bind_cores else ''}, {report.params} fp32 parameters per rank: "
            f"median step {report.step_s:.6g} s over {report.iters} iterations = "
            f"{report.params_per_s_total:.4g} parameters/s on the node")
    if base.node.gpus_per_node != report.nproc:
        report.warnings.append(f"profile {base.name} runs {base.node.gpus_per_node} ranks per node, this ran "
                               f"{report.nproc}: memory bandwidth is shared, so measure with --nproc "
                               f"{base.node.gpus_per_node}")
    if base.node.cpu_cores and base.node.cpu_cores != report.physical_cores:
        report.warnings.append(f"profile {base.name} has node.cpu_cores = {base.node.cpu_cores}, this host "
                               f"{report.physical_cores}: the planner multiplies the per-core rate by its own count")
    sources = dict(base.sources)
    sources["node.cpu_adam_params_per_s_per_core"] = note + (
        "; WARNING " + "; ".join(report.warnings) if report.warnings else "")
    name = base.name if base.name.endswith("-measured") else f"{base.name}-measured"
    profile = base.model_copy(update={
        "node": base.node.model_copy(update={"cpu_adam_params_per_s_per_core": float(
            f"{report.params_per_s_per_core:.4g}")}),
        "sources": sources, "name": name,
    })
    hw.save_profile(profile, path)
    return profile


def validation_rows(nproc: int, hardware: Any = None, *, run: Any = None) -> list[dict[str, Any]]:
    """`zeroplan validate`'s cpu-adam check: the per-core rate with ``nproc`` ranks (the node's GPUs)
    stepping at once, beside the profile's figure (or the default); skipped with the reason when
    DeepSpeed or its op build is missing."""
    from zeroplan.bench.validate_rows import row, skip_row as _skip
    from zeroplan.core.timing import CPU_ADAM_PARAMS_PER_S_PER_CORE

    predicted = getattr(getattr(hardware, "node", None), "cpu_adam_params_per_s_per_core", None)
    try:
        rep = (run or run_cpu_adam)(CpuAdamConfig(), nproc=max(1, nproc), timeout_s=600)
    except InputError as exc:
        return [_skip("cpu-adam", str(exc))]
    return [row("cpu-adam", f"DeepSpeedCPUAdam parameters/s per core, {rep.nproc} rank(s) x {rep.threads} "
                            f"thread(s) stepping at once", predicted or CPU_ADAM_PARAMS_PER_S_PER_CORE,
                rep.params_per_s_per_core, unit="parameters/s",
                note=f"node {rep.params_per_s_total:.4g} parameters/s = {rep.memory_GBps:.3g} GB/s of fp32; "
                     f"{rep.cpu}, {rep.physical_cores} physical cores; {rep.optimizer_version} {rep.simd} "
                     f"(bench cpu-adam)" + ("; " + "; ".join(rep.warnings) if rep.warnings else ""))]
