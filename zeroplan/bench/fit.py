"""Fit the α–β link model to measured collective times (torch-free).

Model (the one the planner's comm timing uses): ``t = α + busbw_bytes / β`` where
``busbw_bytes = size_bytes × busbw_factor(op, n)`` (nccl-tests doc/PERFORMANCE.md), α is the
latency in seconds and β the bus bandwidth per GPU in bytes/s. Fitted by least squares over
all (op, size) points of a sweep. ``weighting="relative"`` (default) minimises squared
RELATIVE errors (weights 1/t²) so that small messages, which carry the latency, count as
much as large ones, which carry the bandwidth; ``"absolute"`` is plain least squares.
Reported as ``latency_us`` (10⁻⁶ s) and ``bandwidth_GBps`` (10⁹ bytes/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal

from zeroplan._util import InputError

__all__ = ["AlphaBetaFit", "fit_alpha_beta"]


@dataclass(frozen=True)
class AlphaBetaFit:
    """α (seconds), β (bytes/s), goodness of fit and the number of points used."""

    alpha_s: float
    beta_Bps: float
    r2: float
    points: int
    max_rel_error: float

    @property
    def latency_us(self) -> float:
        return self.alpha_s * 1e6

    @property
    def bandwidth_GBps(self) -> float:
        return self.beta_Bps / 1e9

    def predict_s(self, busbw_bytes: float) -> float:
        return self.alpha_s + busbw_bytes / self.beta_Bps


def fit_alpha_beta(points: Iterable[tuple[float, float]],
                   weighting: Literal["relative", "absolute"] = "relative") -> AlphaBetaFit:
    """Least-squares α, β from ``(busbw_bytes, time_s)`` points.

    α is constrained to be >= 0 (a negative intercept is noise: the fit is then redone
    through the origin). Raises InputError when the points cannot determine β (fewer than
    two distinct sizes, non-positive times, or time not increasing with size).
    """
    pts = [(float(x), float(y)) for x, y in points]
    if any(not (math.isfinite(x) and math.isfinite(y)) for x, y in pts):
        raise InputError("alpha-beta fit: non-finite size or time in the sweep")
    if any(y <= 0 for _, y in pts):
        raise InputError("alpha-beta fit: every measured time must be > 0 s")
    if len({x for x, _ in pts}) < 2:
        raise InputError("alpha-beta fit: need at least two distinct message sizes (widen --min-bytes/--max-bytes)")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting {weighting!r}: expected 'relative' or 'absolute'")
    w = [1.0 / (y * y) if weighting == "relative" else 1.0 for _, y in pts]

    # Weighted normal equations for y = a + b·x (b = 1/β).
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts))
    det = sw * sxx - sx * sx
    a = (sxx * sy - sx * sxy) / det
    b = (sw * sxy - sx * sy) / det
    if a < 0:  # through the origin
        a = 0.0
        b = sxy / sxx
    if b <= 0:
        raise InputError("alpha-beta fit: measured time does not grow with message size; "
                         "sweep larger sizes (--max-bytes) or more --iters")
    pred = [a + b * x for x, _ in pts]
    mean_y = sum(y for _, y in pts) / len(pts)
    ss_res = sum((y - p) ** 2 for (_, y), p in zip(pts, pred))
    ss_tot = sum((y - mean_y) ** 2 for _, y in pts)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    max_rel = max(abs(y - p) / y for (_, y), p in zip(pts, pred))
    return AlphaBetaFit(alpha_s=a, beta_Bps=1.0 / b, r2=r2, points=len(pts), max_rel_error=max_rel)
