"""`zeroplan bench collectives`: an nccl-tests style sweep through the instrumented comm layer.

Per op and message size (``size_bytes`` = the FULL buffer, as in the ledger: all-reduce
tensor, all-gather output, reduce-scatter input, all-to-all input, broadcast tensor):

- every rank runs ``warmup`` untimed calls, a barrier (and a device synchronise on CUDA),
  then ``iters`` timed calls; its time is the mean seconds per call;
- ``time_s`` = max over ranks of that mean (nccl-tests reports the slowest rank);
- ``algbw_GBps = size_bytes / time_s / 1e9``; ``busbw_GBps = algbw × busbw_factor(op, n)``
  (nccl-tests doc/PERFORMANCE.md; n = size of the group the op runs on);
- per-rank spread (min / median / max of the per-rank means) and stragglers: ranks whose
  time exceeds ``straggler_threshold × median``. With blocking collectives a rank that
  ARRIVES late delays every rank alike; what the per-rank spread shows is a rank whose own
  completion is late (slow device or receive path).

Groups: "all" (the world), "intra" (each node's ranks, concurrently on every node) or
"inter" (ranks with the same local rank across nodes). Node layout: contiguous ranks,
``gpus_per_node`` per node (torchrun's LOCAL_WORLD_SIZE, or a simulated layout locally).

The planner's prediction for each row and the α–β fit saved as a hardware profile are
``bench/collectives_profile.py`` (re-exported here).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from zeroplan._util import InputError, ascii_digits, atomic_write_text, fmt_bytes
from zeroplan.bench.collectives_profile import (  # re-exported: zeroplan.bench.collectives keeps its names
    R2_WARN_BELOW, add_predictions, fit_tiers, measured_link_name, save_profile_from_report)
from zeroplan.bench.limits import (  # parse_size: re-exported
    MAX_BUFFER_BYTES, SWEEP_BUFFERS_PER_RANK, check_rank_bytes, check_repeats, parse_size, ranks_on_this_host)
from zeroplan.specs.collectives import busbw_factor

__all__ = [
    "BenchConfig",
    "SizeResult",
    "CollectivesReport",
    "BENCH_OPS",
    "DTYPE_BYTES",
    "parse_size",
    "MAX_BUFFER_BYTES",
    "message_sizes",
    "check_sweep_memory",
    "bench_rank",
    "aggregate",
    "run_collectives",
    "fit_tiers",
    "save_profile_from_report",
    "add_predictions",
    "measured_link_name",
    "R2_WARN_BELOW",
]

BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GROUP_CHOICES = ("all", "intra", "inter")
_GROUP_KIND = {"all": "all", "intra": "intra-node", "inter": "inter-node"}


class BenchConfig(BaseModel):
    """What to sweep. Sizes in bytes (full buffer); times in seconds."""

    ops: list[str] = Field(default_factory=lambda: list(DEFAULT_OPS))
    min_bytes: int = 1024
    max_bytes: int = 16 * 2**20
    factor: int = 2
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    group: str = "all"
    gpus_per_node: int | None = None
    straggler_threshold: float = 1.5
    # test hook: {rank: seconds} added to that rank's timed region per call (simulates a rank
    # whose completion is late); also read from ZEROPLAN_BENCH_DELAY="rank:seconds[,rank:seconds]".
    inject_delay_s: dict[int, float] = Field(default_factory=dict)


class SizeResult(BaseModel):
    op: str
    size_bytes: int = Field(description="full buffer, bytes")
    count: int = Field(description="elements in the full buffer")
    dtype: str
    group: str
    group_size: int
    time_s: float = Field(description="max over ranks of the mean seconds per call")
    algbw_GBps: float
    busbw_GBps: float
    busbw_factor: float
    rank_time_s: list[float]
    min_s: float
    median_s: float
    max_s: float
    stragglers: list[int]
    records: dict[str, int] = Field(description="instrumented-layer records on rank 0: count, buffer_bytes")
    predicted_time_s: float | None = Field(None, description="core/timing.collective_time_s on --hardware")
    predicted_busbw_GBps: float | None = Field(None, description="size × busbw_factor / predicted time, 1e9 B/s")


class CollectivesReport(BaseModel):
    world_size: int
    backend: str
    launcher: str
    dtype: str
    group: str
    gpus_per_node: int
    nodes: int
    warmup: int
    iters: int
    straggler_threshold: float
    ranks: list[dict[str, Any]]
    groups: dict[str, list[list[int]]]
    results: list[SizeResult]
    stragglers: list[dict[str, Any]]
    profile: str | None = None
    hardware: str | None = Field(None, description="the profile the predicted columns are computed on")
    fit: dict[str, dict[str, Any]] = Field(default_factory=dict)


# ------------------------------------------------------------------ inputs
def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric sweep min, min·f, ... <= max (bytes)."""
    if factor < 2:
        raise InputError(f"--factor {factor}: expected an integer >= 2")
    if min_bytes > max_bytes:
        raise InputError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _elements(size_bytes: int, elem: int, n: int) -> int:
    """Elements of the full buffer: rounded down to a multiple of the group size (>= n)."""
    count = max(1, size_bytes // elem)
    return max(n, (count // n) * n)


def validate_config(cfg: BenchConfig) -> None:
    bad = [o for o in cfg.ops if o not in BENCH_OPS]
    if bad or not cfg.ops:
        raise InputError(f"--ops {','.join(cfg.ops)!r}: expected a comma list of {', '.join(BENCH_OPS)}")
    if cfg.dtype not in DTYPE_BYTES:
        raise InputError(f"--dtype {cfg.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    if cfg.group not in GROUP_CHOICES:
        raise InputError(f"--group {cfg.group!r}: expected all, intra or inter")
    check_repeats(cfg.iters, cfg.warmup)
    if not (cfg.straggler_threshold > 1.0 and math.isfinite(cfg.straggler_threshold)):  # inf reached the ranks as null
        raise InputError(f"--straggler-threshold {cfg.straggler_threshold}: expected a finite ratio > 1 (e.g. 1.5)")
    for flag, value in (("--min-bytes", cfg.min_bytes), ("--max-bytes", cfg.max_bytes)):
        parse_size(value, flag)  # at least 1 byte, at most MAX_BUFFER_BYTES (also for a BenchConfig built in code)
    message_sizes(cfg.min_bytes, cfg.max_bytes, cfg.factor)
    _env_delays()


def check_sweep_memory(cfg: BenchConfig, backend: str, ranks: int) -> None:
    """InputError (before any rank starts) when the largest size's buffers do not fit one rank: over
    ``MAX_BUFFER_BYTES``, or on gloo over the host's available memory shared by ``ranks`` local ranks."""
    check_rank_bytes(SWEEP_BUFFERS_PER_RANK * cfg.max_bytes, device="cuda" if backend == "nccl" else "cpu",
                     ranks=ranks, lower="--max-bytes",
                     what=f"--max-bytes {cfg.max_bytes} ({fmt_bytes(cfg.max_bytes)}): the largest size's "
                          f"{SWEEP_BUFFERS_PER_RANK} buffers (full, output, shard) need")


def _env_delays() -> dict[int, float]:
    """ZEROPLAN_BENCH_DELAY="rank:seconds[,rank:seconds]" (a test hook); InputError naming the
    variable otherwise (validate_config reads it in the launcher, before any rank starts)."""
    raw = os.environ.get("ZEROPLAN_BENCH_DELAY", "").strip()
    out: dict[int, float] = {}
    for part in raw.split(",") if raw else []:
        r, _, s = part.strip().partition(":")
        try:
            rank, delay_s = int(r) if ascii_digits(r, 9) else -1, float(s)
        except ValueError:
            rank, delay_s = -1, 0.0
        if rank < 0 or not 0 <= delay_s <= 3600:
            raise InputError(f"ZEROPLAN_BENCH_DELAY={raw[:80]!r}: {part[:40]!r} is not rank:seconds "
                             "(a rank >= 0 and 0-3600 seconds, e.g. 1:0.05)")
        out[rank] = delay_s
    return out


# ------------------------------------------------------------------ one rank
def bench_rank(rank: int, world_size: int, cfg_json: str, progress_path: str | None = None) -> dict[str, Any]:
    """The per-rank sweep (runs inside a launched rank). Returns JSON: per (op, size) mean seconds."""
    import torch
    import torch.distributed as dist

    from zeroplan.runtime.comm import InstrumentedComm
    from zeroplan.runtime.launch import node_groups

    cfg = BenchConfig.model_validate_json(cfg_json)
    delays = {**_env_delays(), **{int(k): v for k, v in cfg.inject_delay_s.items()}}
    my_delay = delays.get(rank, 0.0)
    backend = dist.get_backend()
    cuda = backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    elem = DTYPE_BYTES[cfg.dtype]

    groups = node_groups(world_size, cfg.gpus_per_node)
    if cfg.group == "all":
        comm = InstrumentedComm(None, group_kind="all", cuda_sync_timing=False)
    elif cfg.group == "intra":
        comm = InstrumentedComm(groups.intra, group_kind="intra-node")
    else:
        comm = InstrumentedComm(groups.inter, group_kind="inter-node")
    n = comm.world_size

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sizes = message_sizes(cfg.min_bytes, cfg.max_bytes, cfg.factor)
    total = len(sizes) * len(cfg.ops)
    done = 0
    out: list[dict[str, Any]] = []
    for op in cfg.ops:
        for size in sizes:
            count = _elements(size, elem, n)
            full = torch.ones(count, dtype=dtype, device=device)
            shard = torch.ones(count // n, dtype=dtype, device=device)
            other = torch.empty(count, dtype=dtype, device=device)
            if op == "all_reduce":
                call = lambda: comm.all_reduce(full)  # noqa: E731
            elif op == "all_gather":
                call = lambda: comm.all_gather(full, shard)  # noqa: E731
            elif op == "reduce_scatter":
                call = lambda: comm.reduce_scatter(shard, full)  # noqa: E731
            elif op == "broadcast":
                call = lambda: comm.broadcast(full, 0)  # noqa: E731
            elif op == "reduce":
                call = lambda: comm.reduce(full, 0)  # noqa: E731
            else:
                call = lambda: comm.all_to_all(other, full)  # noqa: E731
            for _ in range(cfg.warmup):
                call()
            sync()
            comm.reset()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg.iters):
                call()
            sync()
            if my_delay:
                time.sleep(my_delay * cfg.iters)  # test hook: this rank completes late
            mean_s = (time.perf_counter() - t0) / cfg.iters
            recs = comm.records
            out.append({
                "op": op, "size_bytes": count * elem, "count": count, "group_size": n, "time_s": mean_s,
                "records": {"count": len(recs),
                            "buffer_bytes": recs[0].buffer_bytes if recs else 0,
                            "consistent": int(all(r.buffer_bytes == recs[0].buffer_bytes and r.op == op
                                                  and r.group_size == n for r in recs))},
            })
            comm.reset()
            done += 1
            if progress_path and rank == 0:
                try:
                    atomic_write_text(progress_path, f"{done}/{total}")
                except OSError:
                    pass
    return {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", rank // groups.gpus_per_node)),
        "local_rank": int(os.environ.get("LOCAL_RANK", rank % groups.gpus_per_node)),
        "hostname": socket.gethostname(),
        "gpus_per_node": groups.gpus_per_node,
        "intra_ranks": groups.intra_ranks,
        "inter_ranks": groups.inter_ranks,
        "results": out,
    }


# ------------------------------------------------------------------ aggregation
def aggregate(per_rank: list[dict[str, Any]], cfg: BenchConfig, *, backend: str, launcher: str) -> CollectivesReport:
    """Combine every rank's means into the report (pure Python)."""
    world = len(per_rank)
    gpn = per_rank[0]["gpus_per_node"]
    results: list[SizeResult] = []
    stragglers: list[dict[str, Any]] = []
    for i, first in enumerate(per_rank[0]["results"]):
        times = [pr["results"][i]["time_s"] for pr in per_rank]
        t = max(times)
        med = statistics.median(times)
        n = first["group_size"]
        factor = busbw_factor(first["op"], n)
        algbw = first["size_bytes"] / t / 1e9
        slow = [r for r, x in enumerate(times) if x > cfg.straggler_threshold * med]
        for r in slow:
            stragglers.append({"rank": r, "op": first["op"], "size_bytes": first["size_bytes"],
                               "time_s": times[r], "median_s": med, "ratio": times[r] / med})
        recs = first["records"]
        results.append(SizeResult(
            op=first["op"], size_bytes=first["size_bytes"], count=first["count"], dtype=cfg.dtype,
            group=_GROUP_KIND[cfg.group], group_size=n, time_s=t, algbw_GBps=algbw, busbw_GBps=algbw * factor,
            busbw_factor=factor, rank_time_s=times, min_s=min(times), median_s=med, max_s=t, stragglers=slow,
            records={"count": recs["count"], "buffer_bytes": recs["buffer_bytes"], "consistent": recs["consistent"]},
        ))
    intra = sorted({tuple(pr["intra_ranks"]) for pr in per_rank})
    inter = sorted({tuple(pr["inter_ranks"]) for pr in per_rank})
    ranks = [{k: pr[k] for k in ("rank", "node", "local_rank", "hostname")} for pr in per_rank]
    return CollectivesReport(
        world_size=world, backend=backend, launcher=launcher, dtype=cfg.dtype, group=_GROUP_KIND[cfg.group],
        gpus_per_node=gpn, nodes=world // gpn, warmup=cfg.warmup, iters=cfg.iters,
        straggler_threshold=cfg.straggler_threshold, ranks=ranks,
        groups={"intra-node": [list(g) for g in intra], "inter-node": [list(g) for g in inter]},
        results=results, stragglers=stragglers,
    )


def run_collectives(cfg: BenchConfig, *, nproc: int = 2, backend: str = "auto", timeout_s: float = 600,
                    on_progress: Callable[[int, int], None] | None = None) -> CollectivesReport | None:
    """Run the sweep: join torchrun when launched under it, else fork ``nproc`` local ranks.

    Returns the report (under torchrun: on rank 0 only; other ranks get None).
    """
    from zeroplan.runtime.launch import join_torchrun, resolve_backend, spawn, under_torchrun

    validate_config(cfg)
    backend = resolve_backend(backend)
    if under_torchrun():
        check_sweep_memory(cfg, backend, ranks_on_this_host(1))
        world = int(os.environ["WORLD_SIZE"])
        _check_groups(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if cfg.gpus_per_node is None
                      else cfg.gpus_per_node)
        per_rank = join_torchrun(bench_rank, args=(cfg.model_dump_json(), None), backend=backend,
                                 timeout_s=timeout_s)
        if per_rank is None:  # not rank 0
            return None
        return aggregate(per_rank, cfg, backend=backend, launcher="torchrun")
    from zeroplan.runtime.launch import check_world_size

    check_world_size(nproc)  # --nproc first: the node layout is derived from it
    check_sweep_memory(cfg, backend, nproc)
    if cfg.gpus_per_node is None:
        cfg = cfg.model_copy(update={"gpus_per_node": nproc})
    _check_groups(cfg, nproc, cfg.gpus_per_node)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zeroplan-bench-") as tmp:
        progress_path = str(Path(tmp) / "progress") if on_progress else None
        poll = None
        if on_progress:
            def poll() -> None:
                try:
                    done, _, total = Path(progress_path).read_text().partition("/")
                    on_progress(int(done), int(total))
                except (OSError, ValueError):
                    pass
        per_rank = spawn(bench_rank, nproc, args=(cfg.model_dump_json(), progress_path), backend=backend,
                         timeout_s=timeout_s, on_poll=poll)
    return aggregate(per_rank, cfg, backend=backend, launcher="local")


def _check_groups(cfg: BenchConfig, world: int, gpus_per_node: int) -> None:
    if gpus_per_node < 1 or world % gpus_per_node:
        raise InputError(f"--gpus-per-node {gpus_per_node}: world size {world} is not a multiple of it")
    nodes = world // gpus_per_node
    if cfg.group == "inter" and nodes < 2:
        raise InputError(f"--group inter: needs at least 2 nodes, world size {world} is one node of {gpus_per_node}")
    if cfg.group == "intra" and gpus_per_node < 2:
        raise InputError(f"--group intra: needs at least 2 ranks per node, got {gpus_per_node}")


def write_report_json(report: BaseModel, path: str) -> None:
    """Any bench report (collectives, overlap) as indented JSON, atomically."""
    atomic_write_text(path, json.dumps(report.model_dump(mode="json"), indent=2, allow_nan=False) + "\n")
