"""The row every `zeroplan validate` check returns: predicted beside measured, with the error."""

from __future__ import annotations

from typing import Any

__all__ = ["op_build_failure", "row", "skip_row"]


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


def op_build_failure(exc: BaseException) -> str:
    """Why a DeepSpeed op failed, with the fix where it is known: DeepSpeed 0.19.8's JIT builder
    (``CUDAOpBuilder.compute_capability_args``) reads every ``TORCH_CUDA_ARCH_LIST`` entry as
    numbers, so an arch-specific entry such as ``9.0a`` stops it with ``int('0a')``."""
    import os

    text = f"{type(exc).__name__}: {exc}"
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    suffixed = [a for a in arch.replace(";", " ").split() if a.split("+")[0][-1:].isalpha()]
    if "invalid literal for int()" in text and suffixed:
        text += (f" (TORCH_CUDA_ARCH_LIST={arch!r}: DeepSpeed's JIT builder cannot read the arch suffix of "
                 f"{', '.join(suffixed)}; set it without one, e.g. TORCH_CUDA_ARCH_LIST=9.0)")
    return text[:500]
