"""Phase peaks of a CUDA device from the caching allocator's counters, categories from the engine's
tags (split out of ``runtime/memory.py``, whose docstring describes both meters; re-exported there)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from zeroplan.runtime.memory_ledger import CATEGORIES, PHASES

__all__ = ["CudaMemoryMeter"]


class CudaMemoryMeter:
    """Phase peaks from the CUDA caching allocator's counters; categories from the engine's tags.

    Per phase (``reset_peak_memory_stats`` when the phase starts, read when it closes):
    ``peak`` = ``max_memory_allocated`` (what tensors held) and ``reserved_peak`` =
    ``max_memory_reserved`` (the allocator's segments, about what ``nvidia-smi`` shows less the
    CUDA context). The category breakdown is the engine's tags as they were at the highest
    ``memory_allocated`` sampled during the phase (sampled at every tag, i.e. at every buffer
    the engine allocates), not the tags left alive when the phase closes; the rest of the peak
    is ``activations`` (forward) or ``other``.

    ``memory_limit_bytes`` is enforced by the allocator itself
    (``torch.cuda.set_per_process_memory_fraction``: an allocation above it raises
    ``torch.OutOfMemoryError``), and the device's total memory
    (``get_device_properties(device).total_memory``) is kept as ``device_total_bytes``.
    ``cuda``: the ``torch.cuda`` module (a stand-in in tests).
    """

    def __init__(self, device: Any = None, memory_limit_bytes: int | None = None, *, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self.device = device
        self._phase = "forward"
        self._tags: dict[int, list] = {}
        self.peaks: dict[str, dict[str, Any]] = {}
        self.host_bytes = 0
        self.device_total_bytes = int(cuda.get_device_properties(device).total_memory)
        self.memory_limit_bytes = memory_limit_bytes
        self.limit_bytes = self.device_total_bytes if memory_limit_bytes is None else int(memory_limit_bytes)
        self._sample_max = -1
        self._sample_tags: dict[str, int] | None = None

    def __enter__(self) -> "CudaMemoryMeter":
        cuda = self._cuda
        if self.memory_limit_bytes is not None:
            cuda.set_per_process_memory_fraction(min(1.0, self.memory_limit_bytes / self.device_total_bytes),
                                                 self.device)
        cuda.synchronize(self.device)
        self._start_phase()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close_phase()
        if self.memory_limit_bytes is not None:
            self._cuda.set_per_process_memory_fraction(1.0, self.device)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value not in PHASES:
            raise ValueError(f"phase {value!r}: expected one of {', '.join(PHASES)}")
        self._close_phase()
        self._phase = value
        self._start_phase()

    def _start_phase(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)
        self._sample_max = -1
        self._sample_tags = None
        self._sample()

    def _sample(self) -> None:
        now = int(self._cuda.memory_allocated(self.device))
        if now > self._sample_max:
            self._sample_max = now
            self._sample_tags = self.current_by_category()

    def _close_phase(self) -> None:
        cuda = self._cuda
        cuda.synchronize(self.device)
        self._sample()
        peak = int(cuda.max_memory_allocated(self.device))
        reserved = int(cuda.max_memory_reserved(self.device))
        pk = self.peaks.get(self._phase)
        if pk is None or peak > pk["peak"]:
            tagged = dict(self._sample_tags or self.current_by_category())
            rest = max(0, peak - sum(tagged.values()))
            tagged["activations" if self._phase == "forward" else "other"] += rest
            self.peaks[self._phase] = {"peak": peak, "reserved_peak": reserved, "by_category": tagged}
        elif reserved > pk.get("reserved_peak", 0):
            pk["reserved_peak"] = reserved

    def tag(self, t: Any, category: str, *, host: bool = False) -> Any:
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: expected one of {', '.join(CATEGORIES)}")
        st = t.untyped_storage()
        key = id(st)
        if key in self._tags:
            self._tags[key][1] = category
            self._sample()
            return t
        entry = [int(st.nbytes()), category, host]
        if host or t.device.type == "cpu":  # not in the CUDA allocator
            entry[2] = True
            self.host_bytes += entry[0]

        def _gone(_r: Any, k: int = key) -> None:
            e = self._tags.pop(k, None)
            if e is not None and e[2]:
                self.host_bytes -= e[0]

        entry.append(weakref.ref(st, _gone))
        self._tags[key] = entry
        self._sample()
        return t

    def current_by_category(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for nbytes, cat, host, _ in list(self._tags.values()):
            if not host:
                out[cat] += nbytes
        return out

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """Host tensors never appear in the CUDA allocator's counters: nothing to do."""
        yield

    def reset_peaks(self) -> None:
        self.peaks = {}
        self._start_phase()

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        return {p: {"peak": v["peak"], "reserved_peak": v["reserved_peak"], "by_category": dict(v["by_category"])}
                for p, v in self.peaks.items()}

    def memory_info(self) -> dict[str, int]:
        """Device total, the enforced limit and the allocator's counters now (bytes)."""
        cuda = self._cuda
        return {"device_total_bytes": self.device_total_bytes, "limit_bytes": self.limit_bytes,
                "allocated_bytes": int(cuda.memory_allocated(self.device)),
                "reserved_bytes": int(cuda.memory_reserved(self.device))}

    @property
    def live_bytes(self) -> int:
        return int(self._cuda.memory_allocated(self.device))
