"""`zeroplan bench overlap`: how much of a collective really hides behind compute on this node.

ZeRO-3 and FSDP gather the next module's parameters and reduce-scatter gradients on side
streams while the current module computes (core/overlap.py). Whether that communication is
hidden is a property of the node and its software: NCCL's kernels take SMs and HBM bandwidth
from the GEMMs beside them, and a driver, NCCL or launcher setting can serialise the two outright.
The ZeRO++ paper's V100 runs, for one, behave as if nothing hid (tests/data/published/README.md).
Each rank measures:

- ``compute_s``: ``gemms`` matmuls of a transformer MLP's shape, (tokens × hidden) @ (hidden ×
  4·hidden), alone on the compute stream;
- ``comm_s``: one all-gather of ``size_bytes`` (the full output buffer, as in the ledger) alone,
  or with ``op="reduce_scatter"`` one reduce-scatter of a ``size_bytes`` bucket (ZeRO's gradient
  buckets, which run beside the next layers' backward);
- ``both_s``: the collective issued first from a side stream (CUDA; DeepSpeed's
  ``__allgather_stream`` and ``reduce_and_partition_stream``) or as an async work (gloo runs it on
  its own thread), then the matmuls on the compute stream, then both waited for.

``gemms`` is chosen (the same on every rank) so the matmuls take about ``COVER`` times the
collective: there is compute to hide the whole collective behind. Each time is the slowest rank's
mean over ``iters`` repetitions (a collective ends with its last rank). The slowdown is the part of
the shorter activity that did not hide, ``(both_s − max(compute_s, comm_s)) / min(compute_s,
comm_s)`` clamped to [0, 1]: 0 = hidden for free, 1 = serialised. That is the planner's
``OVERLAP_SLOWDOWN`` (the fraction of hidden communication time added back to compute), and
``--save-profile`` writes it as ``node.overlap_slowdown`` so plans on that profile use it.
"""

from __future__ import annotations

import math
import os
import socket
import time
from datetime import date
from typing import Any, Callable

from pydantic import BaseModel, Field

from zeroplan._util import InputError
from zeroplan.bench.collectives import DTYPE_BYTES
from zeroplan.bench.limits import check_rank_bytes, check_repeats, parse_size, ranks_on_this_host

__all__ = ["OverlapConfig", "OverlapReport", "slowdown_fraction", "resolve_config", "overlap_rank",
           "aggregate_overlap", "run_overlap", "save_overlap_profile", "COVER", "OPS", "rank_bytes",
           "check_memory"]

COVER = 2.0  # matmul time / collective time the calibration aims for
OPS = ("all_gather", "reduce_scatter")
MAX_GEMMS = 10_000
# Shapes by device: a Llama-7B-like MLP matmul and a 256 MiB gather (a ZeRO-3 prefetch of a few
# layers) on CUDA; a small shape on CPU, where gloo and the matmul share a few cores.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"hidden": 4096, "tokens": 4096, "size_bytes": 256 * 2**20, "dtype": "bfloat16"},
    "cpu": {"hidden": 256, "tokens": 256, "size_bytes": 4 * 2**20, "dtype": "float32"},
}


class OverlapConfig(BaseModel):
    """What to measure; a field left None takes the device's default (``_DEFAULTS``)."""

    hidden: int | None = None
    tokens: int | None = None
    size_bytes: int | None = Field(None, description="the collective's full buffer (all-gather output, "
                                                      "reduce-scatter input), bytes")
    dtype: str | None = None
    op: str = "all_gather"  # or reduce_scatter (ZeRO's gradient buckets behind the backward)
    warmup: int = 3
    iters: int = 10


class OverlapReport(BaseModel):
    op: str = "all_gather"
    world_size: int
    backend: str
    launcher: str
    device: str
    dtype: str
    hidden: int
    tokens: int
    gemms: int = Field(description="matmuls per measurement (calibrated to cover the collective)")
    gemm_flops: float = Field(description="FLOPs of one matmul, 2·tokens·hidden·4·hidden")
    size_bytes: int
    warmup: int
    iters: int
    compute_s: float = Field(description="the matmuls alone, slowest rank's mean")
    comm_s: float = Field(description="the collective alone, slowest rank's mean")
    both_s: float = Field(description="the collective and the matmuls issued together, slowest rank's mean")
    slowdown: float = Field(description="(both - max) / min, in [0, 1]: 0 hidden for free, 1 serialised")
    compute_tflops: float = Field(description="matmul throughput alone, 1e12 FLOP/s")
    busbw_GBps: float = Field(description="the collective's bus bandwidth alone, 1e9 B/s")
    planner_default: float = Field(description="core/overlap.py OVERLAP_SLOWDOWN, used without a measurement")
    ranks: list[dict[str, Any]]
    warnings: list[str] = Field(default_factory=list)
    profile: str | None = None


def slowdown_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The part of the shorter activity that failed to hide behind the longer, in [0, 1]."""
    short = min(compute_s, comm_s)
    if not short > 0:
        return 0.0
    return min(1.0, max(0.0, (both_s - max(compute_s, comm_s)) / short))


def resolve_config(cfg: OverlapConfig, device: str) -> dict[str, Any]:
    """The settings to run with: the config's, else the device's defaults; checked."""
    d = _DEFAULTS["cuda" if device == "cuda" else "cpu"]
    out = {k: (getattr(cfg, k) if getattr(cfg, k) is not None else d[k]) for k in d}
    for key, flag in (("hidden", "--hidden"), ("tokens", "--tokens"), ("size_bytes", "--size")):
        if not isinstance(out[key], int) or out[key] < 1:
            raise InputError(f"{flag} {out[key]!r}: expected a positive integer")
    if out["dtype"] not in DTYPE_BYTES:
        raise InputError(f"--dtype {out['dtype']!r}: expected one of {', '.join(DTYPE_BYTES)}")
    check_repeats(cfg.iters, cfg.warmup)
    if cfg.op not in OPS:
        raise InputError(f"--op {cfg.op!r}: expected one of {', '.join(OPS)}")
    parse_size(out["size_bytes"], "--size")  # at most MAX_BUFFER_BYTES (also for an OverlapConfig built in code)
    return out


def _collective_count(size_bytes: int, dtype: str, world_size: int) -> int:
    """Elements of the collective's full buffer: ``size_bytes`` rounded down to a multiple of the world."""
    return max(world_size, size_bytes // DTYPE_BYTES[dtype] // world_size * world_size)


def rank_bytes(s: dict[str, Any], world_size: int) -> int:
    """Bytes one rank holds at its peak for settings ``s`` (``resolve_config``), as ``overlap_rank``
    allocates them: the matmul operands a (tokens × hidden), b (hidden × 4·hidden; the random matrix it
    is scaled from is a second one for a moment) and c (tokens × 4·hidden), then the collective's full
    buffer and its shard."""
    h, t = s["hidden"], s["tokens"]
    count = _collective_count(s["size_bytes"], s["dtype"], world_size)
    a, b, c = t * h, 4 * h * h, 4 * t * h
    return DTYPE_BYTES[s["dtype"]] * max(a + 2 * b, a + b + c + count + count // world_size)


def check_memory(s: dict[str, Any], device: str, world_size: int, ranks: int) -> None:
    """InputError before any rank starts when one rank's tensors (``rank_bytes``) are over
    ``MAX_BUFFER_BYTES``, or on CPU over the host's available memory shared by ``ranks`` local ranks."""
    check_rank_bytes(rank_bytes(s, world_size), device=device, ranks=ranks,
                     what=(f"--hidden {s['hidden']} × --tokens {s['tokens']} with --size {s['size_bytes']} "
                           f"({s['dtype']}): the matmul operands (tokens × hidden, hidden × 4·hidden, "
                           "tokens × 4·hidden) and the collective's buffer and shard need"),
                     lower="--hidden, --tokens or --size")


# ------------------------------------------------------------------ one rank
def overlap_rank(rank: int, world_size: int, cfg_json: str) -> dict[str, Any]:
    """The per-rank measurement (runs inside a launched rank); JSON-able means in seconds."""
    import torch
    import torch.distributed as dist

    from zeroplan.runtime.comm import all_gather_fn, reduce_scatter_fn

    cfg = OverlapConfig.model_validate_json(cfg_json)
    cuda = dist.get_backend() == "nccl"
    s = resolve_config(cfg, "cuda" if cuda else "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, s["dtype"])
    h, t = s["hidden"], s["tokens"]
    a = torch.randn(t, h, dtype=dtype, device=device)
    b = torch.randn(h, 4 * h, dtype=dtype, device=device) / math.sqrt(h)
    c = torch.empty(t, 4 * h, dtype=dtype, device=device)
    count = _collective_count(s["size_bytes"], s["dtype"], world_size)
    full = torch.ones(count, dtype=dtype, device=device)  # the gathered buffer, or the gradient bucket
    shard = torch.ones(count // world_size, dtype=dtype, device=device)
    if cfg.op == "reduce_scatter":
        scatter = reduce_scatter_fn(dist)

        def collective(async_op: bool = False) -> Any:
            return scatter(shard, full, async_op=async_op)
    else:
        gather = all_gather_fn(dist)

        def collective(async_op: bool = False) -> Any:
            return gather(full, shard, async_op=async_op)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Callable[[], None], iters: int) -> float:
        for _ in range(cfg.warmup):
            fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters

    def gemms(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b, out=c)

    comm_s = timed(collective, cfg.iters)
    one_gemm_s = timed(lambda: gemms(1), cfg.iters)
    k = _agree_max(min(MAX_GEMMS, max(1, math.ceil(COVER * comm_s / max(one_gemm_s, 1e-9)))), device)
    compute_s = timed(lambda: gemms(k), cfg.iters)
    if cuda:
        side = torch.cuda.Stream()

        def both() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                collective()  # NCCL's stream waits for `side`, and `side` for NCCL's
            gemms(k)
            main.wait_stream(side)
    else:
        def both() -> None:
            work = collective(async_op=True)  # gloo runs it on its own thread
            gemms(k)
            work.wait()
    both_s = timed(both, cfg.iters)
    return {"rank": rank, "hostname": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "settings": s, "gemms": k,
            "gathered_bytes": count * DTYPE_BYTES[s["dtype"]], "compute_s": compute_s, "comm_s": comm_s,
            "both_s": both_s}


def _agree_max(k: int, device: Any) -> int:
    """Every rank runs the same number of matmuls: the largest any rank asked for."""
    import torch
    import torch.distributed as dist

    v = torch.tensor([k], dtype=torch.int64, device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return int(v.item())


# ------------------------------------------------------------------ all ranks
def aggregate_overlap(per_rank: list[dict[str, Any]], cfg: OverlapConfig, *, backend: str,
                      launcher: str) -> OverlapReport:
    """The report from every rank's means (pure Python)."""
    from zeroplan.core.overlap import OVERLAP_SLOWDOWN
    from zeroplan.specs.collectives import busbw_factor

    first = per_rank[0]
    s, world = first["settings"], len(per_rank)
    compute_s = max(r["compute_s"] for r in per_rank)
    comm_s = max(r["comm_s"] for r in per_rank)
    both_s = max(r["both_s"] for r in per_rank)
    flops = 2.0 * s["tokens"] * s["hidden"] * 4 * s["hidden"]
    size = int(first["gathered_bytes"])
    warnings = []
    name = cfg.op.replace("_", "-")
    if world < 2:
        warnings.append(f"one rank: the {name} is a local copy, not network traffic; run with at least 2 ranks "
                        "(2 GPUs, or torchrun across nodes) to measure what a ZeRO collective costs")
    if compute_s < comm_s:
        warnings.append(f"the matmuls ({compute_s * 1e3:.3g} ms) are shorter than the {name} "
                        f"({comm_s * 1e3:.3g} ms): the slowdown is the part of the matmuls that did not hide; "
                        f"raise --tokens or lower --size")
    return OverlapReport(
        op=cfg.op, world_size=world, backend=backend, launcher=launcher, device=first["device"], dtype=s["dtype"],
        hidden=s["hidden"], tokens=s["tokens"], gemms=first["gemms"], gemm_flops=flops, size_bytes=size,
        warmup=cfg.warmup, iters=cfg.iters, compute_s=compute_s, comm_s=comm_s, both_s=both_s,
        slowdown=slowdown_fraction(compute_s, comm_s, both_s),
        compute_tflops=flops * first["gemms"] / compute_s / 1e12 if compute_s > 0 else 0.0,
        busbw_GBps=size * busbw_factor(cfg.op, world) / comm_s / 1e9 if comm_s > 0 else 0.0,
        planner_default=OVERLAP_SLOWDOWN,
        ranks=[{k: r[k] for k in ("rank", "hostname", "local_rank", "device", "compute_s", "comm_s", "both_s")}
               for r in per_rank],
        warnings=warnings,
    )


def run_overlap(cfg: OverlapConfig, *, nproc: int = 2, backend: str = "auto",
                timeout_s: float = 600) -> OverlapReport | None:
    """Join torchrun when launched under it, else fork ``nproc`` local ranks. Under torchrun only
    rank 0 gets the report (the others get None)."""
    from zeroplan.runtime.launch import check_world_size, join_torchrun, resolve_backend, spawn, under_torchrun

    backend = resolve_backend(backend)
    device = "cuda" if backend == "nccl" else "cpu"
    s = resolve_config(cfg, device)  # bad settings: one line before any rank starts
    if under_torchrun():
        check_memory(s, device, int(os.environ["WORLD_SIZE"]), ranks_on_this_host(1))
        per_rank = join_torchrun(overlap_rank, args=(cfg.model_dump_json(),), backend=backend, timeout_s=timeout_s)
        return None if per_rank is None else aggregate_overlap(per_rank, cfg, backend=backend, launcher="torchrun")
    check_world_size(nproc)
    check_memory(s, device, nproc, nproc)
    per_rank = spawn(overlap_rank, nproc, args=(cfg.model_dump_json(),), backend=backend, timeout_s=timeout_s)
    return aggregate_overlap(per_rank, cfg, backend=backend, launcher="local")


def save_overlap_profile(report: OverlapReport, path: str, hardware: str) -> Any:
    """Write ``hardware`` (a profile name or TOML path) with ``node.overlap_slowdown`` set to the
    measured fraction and its source; returns the profile written."""
    from zeroplan.specs import hardware as hw

    base = hw.load_profile(hardware)
    note = (f"measured by zeroplan bench overlap on {date.today().isoformat()}: {report.backend}, "
            f"{report.world_size} rank(s) on {report.device}, {report.op.replace('_', '-')} of {report.size_bytes} B "
            f"beside "
            f"{report.gemms} x ({report.tokens} x {report.hidden}) @ ({report.hidden} x {4 * report.hidden}) "
            f"{report.dtype} matmuls: alone {report.comm_s:.6g} s and {report.compute_s:.6g} s, together "
            f"{report.both_s:.6g} s, {report.iters} iterations")
    sources = dict(base.sources)
    sources["node.overlap_slowdown"] = note + ("; WARNING " + "; ".join(report.warnings) if report.warnings else "")
    name = base.name if base.name.endswith("-measured") else f"{base.name}-measured"
    profile = base.model_copy(update={
        "node": base.node.model_copy(update={"overlap_slowdown": round(report.slowdown, 4)}),
        "sources": sources, "name": name,
    })
    hw.save_profile(profile, path)
    return profile
