"""The row every `zeroplan validate` check returns: predicted beside measured, with the error."""

from __future__ import annotations

from typing import Any

__all__ = ["row", "skip_row"]


def row(check: str, figure: str, predicted: float | None, measured: float | None, *, unit: str = "bytes",
        note: str = "") -> dict[str, Any]:
    """One predicted-vs-measured row (error = measured/predicted - 1 when both are there)."""
    err = None
    if predicted not in (None, 0) and measured is not None:
        err = (measured - predicted) / predicted
    return {"check": check, "figure": figure, "predicted": predicted, "measured": measured, "unit": unit,
            "error": err, "note": note}


def skip_row(check: str, why: str) -> dict[str, Any]:
    return row(check, "skipped", None, None, unit="", note=why)
