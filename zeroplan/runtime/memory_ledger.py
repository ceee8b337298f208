"""The memory categories and phases (the planner's names) and the bookkeeping both meters of
``runtime/memory.py`` share: live bytes per category, each phase's peak with its breakdown, and the
``MemoryError`` a simulated limit raises (split out of ``runtime/memory.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["CATEGORIES", "PHASES", "SimulatedOutOfMemory"]

CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations", "other")
PHASES = ("forward", "backward", "step")


class SimulatedOutOfMemory(MemoryError):
    """A ``StorageTracker`` allocation went above ``memory_limit_bytes``."""

    def __init__(self, message: str, *, phase: str, requested_bytes: int, live_bytes: int, limit_bytes: int,
                 by_category: dict[str, int]):
        super().__init__(message)
        self.phase = phase
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.limit_bytes = limit_bytes
        self.by_category = dict(by_category)


class _Ledger:
    """Live bytes per category + per-phase peak with its breakdown (pure bookkeeping)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.current = {c: 0 for c in CATEGORIES}
        self.total = 0
        self.peaks: dict[str, dict[str, Any]] = {}
        self.host_bytes = 0

    def add(self, cat: str, nbytes: int) -> None:
        self.current[cat] += nbytes
        self.total += nbytes
        if nbytes > 0:
            pk = self.peaks.get(self.phase)
            if pk is None or self.total > pk["peak"]:
                self.peaks[self.phase] = {"peak": self.total, "by_category": dict(self.current)}

    def reset_peaks(self) -> None:
        self.peaks = {}

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        return {p: {"peak": v["peak"], "by_category": dict(v["by_category"])} for p, v in self.peaks.items()}
