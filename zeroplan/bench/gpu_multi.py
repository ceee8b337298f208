"""`zeroplan validate`'s checks that need NCCL: on one GPU a one-rank NCCL smoke test of the
collective bench; on two or more, an NCCL sweep over every GPU with its α–β fit against the
profile, and how much of an all-gather hides behind matmuls (bench/overlap.py) against the
planner's slowdown."""

from __future__ import annotations

from typing import Any, Callable

from zeroplan.bench.validate_rows import row, skip_row

__all__ = ["multi_gpu_checks", "nccl_smoke"]


def nccl_smoke(*, run: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """One rank, NCCL: the collective bench's CUDA path (communicator, CUDA-event timing, the
    report) runs end to end; a one-rank all-reduce moves nothing over a link, so no prediction."""
    from zeroplan.bench.collectives import BenchConfig, run_collectives

    cfg = BenchConfig(ops=["all_reduce", "all_gather"], min_bytes=1 << 20, max_bytes=1 << 24, factor=16,
                      dtype="bfloat16", warmup=2, iters=5)
    try:
        report = (run or run_collectives)(cfg, nproc=1, backend="nccl", timeout_s=300)
    except Exception as exc:  # noqa: BLE001 - the smoke test's failure is its finding
        return [row("multi-gpu", "NCCL smoke test (1 rank) failed", None, None, unit="",
                    note=f"{type(exc).__name__}: {exc}"[:500])]
    return [row("multi-gpu", f"NCCL smoke test (1 rank): {r.op} {r.size_bytes:,} B", None, r.time_s * 1e6, unit="µs",
                note="one rank: a local copy, no link; shows the NCCL path runs") for r in report.results]


def multi_gpu_checks(gpu_count: int, hardware: Any = None, *, run: Callable[..., Any] | None = None,
                     run_overlap_fn: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """On one GPU the NCCL smoke test; on more, an NCCL all-reduce / all-gather / reduce-scatter
    sweep over every GPU and its α–β fit vs the profile, and the overlap slowdown of an all-gather
    and of a reduce-scatter (bench overlap) vs the planner's."""
    if gpu_count < 2:
        smoke = nccl_smoke(run=run) if gpu_count == 1 else []
        return smoke + [skip_row("multi-gpu", f"{gpu_count} GPU(s): a sweep over links, overlap and α–β need "
                                              f"at least 2")]
    from zeroplan.bench.collectives import BenchConfig, add_predictions, fit_tiers, run_collectives

    cfg = BenchConfig(ops=["all_reduce", "all_gather", "reduce_scatter"], min_bytes=1 << 20, max_bytes=1 << 28,
                      factor=4, dtype="bfloat16", warmup=5, iters=20)
    report = (run or run_collectives)(cfg, nproc=gpu_count, backend="nccl", timeout_s=300)
    if hardware is not None:
        add_predictions(report, hardware)
    rows = [row("multi-gpu", f"{r.op} {r.size_bytes:,} B busbw", r.predicted_busbw_GBps, r.busbw_GBps,
                unit="GB/s") for r in report.results]
    for tier, f in fit_tiers(report).items():
        link = getattr(hardware, tier, None)
        rows.append(row("multi-gpu", f"{tier} α–β bandwidth (R² {f.r2:.3f})",
                        getattr(link, "effective_GBps_per_gpu", None), f.bandwidth_GBps, unit="GB/s"))
        rows.append(row("multi-gpu", f"{tier} α–β latency", getattr(link, "latency_us", None), f.latency_us,
                        unit="µs"))
    return rows + _overlap_rows(gpu_count, hardware, run_overlap_fn)


def _overlap_rows(gpu_count: int, hardware: Any, run_overlap_fn: Callable[..., Any] | None) -> list[dict[str, Any]]:
    """bench overlap's slowdown for an all-gather (ZeRO-3's prefetch) and a reduce-scatter (its
    gradient buckets) beside matmuls, against the planner's; a failed run is a row of its own."""
    from zeroplan.bench.overlap import OPS, OverlapConfig, run_overlap
    from zeroplan.core.overlap import overlap_slowdown

    rows = []
    for op in OPS:
        name = op.replace("_", "-")
        try:
            ov = (run_overlap_fn or run_overlap)(OverlapConfig(op=op), nproc=gpu_count, backend="nccl", timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - reported as a row, like run_validation's other checks
            rows.append(row("multi-gpu", f"overlap slowdown ({name}) failed", None, None, unit="",
                            note=f"{type(exc).__name__}: {exc}"[:500]))
            continue
        rows.append(row("multi-gpu", f"overlap slowdown: {ov.size_bytes:,} B {name} beside {ov.gemms} matmuls",
                        overlap_slowdown(hardware)[0], ov.slowdown, unit="fraction",
                        note=f"alone {ov.comm_s * 1e3:.3f} ms and {ov.compute_s * 1e3:.3f} ms, together "
                             f"{ov.both_s * 1e3:.3f} ms (bench overlap --op {op})"))
    return rows
