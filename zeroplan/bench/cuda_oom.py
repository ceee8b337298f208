"""A real CUDA out-of-memory error as a bench result, not a dead rank.

``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class since torch 2.1)
raised by the caching allocator ends one configuration: the rank records where it happened
and goes on with the next configuration of the matrix, like ``SimulatedOutOfMemory`` on CPU.
The allocator's message says "Tried to allocate 2.00 GiB ..."; the requested size is read
from it (rounded as printed: ``format_size`` in c10/cuda/CUDACachingAllocator.cpp prints
two decimals of B/KiB/MiB/GiB), so ``requested_bytes`` is approximate and marked so.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["is_cuda_oom", "cuda_oom_record", "requested_bytes_from_message"]

_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(B|bytes|KiB|MiB|GiB|TiB)")


def is_cuda_oom(exc: BaseException) -> bool:
    """True for torch's out-of-memory error (whatever device raised it)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the bench needs torch
        return False
    cls = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return cls is not None and isinstance(exc, cls)


def requested_bytes_from_message(message: str) -> int | None:
    """The "Tried to allocate X GiB" size in bytes (as printed), or None."""
    m = _TRIED.search(message)
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def cuda_oom_record(exc: BaseException, meter: Any) -> dict[str, Any]:
    """The ``oom`` entry of a rank's result (same keys as a simulated OOM)."""
    msg = " ".join(str(exc).split())
    info = meter.memory_info() if hasattr(meter, "memory_info") else {}
    return {
        "phase": getattr(meter, "phase", None), "where": None,
        "requested_bytes": requested_bytes_from_message(msg), "requested_is_approximate": True,
        "live_bytes": int(getattr(meter, "live_bytes", 0) or 0),
        "reserved_bytes": info.get("reserved_bytes"),
        "limit_bytes": getattr(meter, "limit_bytes", None) or getattr(meter, "memory_limit_bytes", None),
        "by_category": meter.current_by_category() if hasattr(meter, "current_by_category") else {},
        "message": msg[:500], "source": "torch.OutOfMemoryError",
    }
