"""`zeroplan validate`'s pcie check: host <-> GPU copy bandwidth, the link ZeRO-Offload moves its
gradients down and its parameters up over.

The planner times offload traffic at the profile's ``node.pcie_bandwidth_GBps_per_gpu`` (one
direction, per GPU; core/timing.py). This copies a pinned host buffer to every GPU and back
(``non_blocking`` copies from pinned memory, the kind DeepSpeed's offload uses), first on one
GPU alone and then on all GPUs at once: GPUs that share a PCIe switch, a root port or the host's
memory bandwidth slow each other down, and in training every rank copies at the same time.
Each figure is bytes per GPU / the wall time of the copies, the median of ``iters`` rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["measure_pcie", "pcie_rows", "cuda_copy_round"]

SIZE_BYTES = 256 * 2**20  # per GPU and direction: large enough that the copy's fixed cost is noise


def cuda_copy_round(torch: Any, devices: list[int], size_bytes: int) -> Callable[[str], float]:
    """A function timing one round of ``size_bytes`` copies on every device in ``devices`` at once,
    ``"h2d"`` or ``"d2h"``: seconds from the first copy's launch to the last one's end."""
    host = [torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True) for _ in devices]
    dev = [torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{d}") for d in devices]
    streams = [torch.cuda.Stream(device=f"cuda:{d}") for d in devices]

    def one_round(direction: str) -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for h, g, s in zip(host, dev, streams):
            with torch.cuda.stream(s):
                (g.copy_(h, non_blocking=True) if direction == "h2d" else h.copy_(g, non_blocking=True))
        for s in streams:
            s.synchronize()
        return time.perf_counter() - t0
    return one_round


def pcie_rows(time_round: Callable[[list[int], str], float], gpu_count: int, predicted_GBps: float | None, *,
              size_bytes: int = SIZE_BYTES, iters: int = 5) -> list[dict[str, Any]]:
    """Rows for one GPU alone and (with more than one) all GPUs at once, each direction;
    ``time_round(devices, direction)`` -> seconds of one round (the first round is a warm-up)."""
    from zeroplan.bench.validate_rows import row

    rows = []
    groups = [[0]] + ([list(range(gpu_count))] if gpu_count > 1 else [])
    for devices in groups:
        for direction, name in (("h2d", "host to GPU"), ("d2h", "GPU to host")):
            time_round(devices, direction)
            t = statistics.median(time_round(devices, direction) for _ in range(iters))
            who = "one GPU alone" if len(devices) == 1 else f"{len(devices)} GPUs at once"
            rows.append(row("pcie", f"{name}, {who}: GB/s per GPU", predicted_GBps, size_bytes / t / 1e9,
                            unit="GB/s", note=f"{size_bytes:,} B pinned per GPU in {t * 1e3:.3f} ms (median of "
                                              f"{iters}); planned: node.pcie_bandwidth_GBps_per_gpu"))
    return rows


def measure_pcie(device: str, hardware: Any = None, *, size_bytes: int = SIZE_BYTES,
                 iters: int = 5) -> list[dict[str, Any]]:
    """The pcie check on this node (CUDA only; skipped with the reason elsewhere)."""
    from zeroplan.bench.validate_rows import skip_row

    if device != "cuda":
        return [skip_row("pcie", "host <-> GPU copies need CUDA")]
    import torch

    n = torch.cuda.device_count()
    rounds: dict[tuple[int, ...], Callable[[str], float]] = {}

    def time_round(devices: list[int], direction: str) -> float:
        key = tuple(devices)
        if key not in rounds:
            rounds.clear()  # one group's buffers at a time
            rounds[key] = cuda_copy_round(torch, devices, size_bytes)
        return rounds[key](direction)

    predicted = getattr(getattr(hardware, "node", None), "pcie_bandwidth_GBps_per_gpu", None)
    return pcie_rows(time_round, n, predicted, size_bytes=size_bytes, iters=iters)
