"""The vocabulary shared by the predicted ledger (core.comm) and measured records (runtime).

Conventions:
- ``buffer_bytes`` is the size of the FULL (unsharded) buffer a collective operates on, in
  the communication dtype: the output of an all-gather, the input of a reduce-scatter, the
  tensor of an all-reduce / broadcast / reduce, the input of an all-to-all.
- ``sent_bytes_per_gpu`` is what one GPU sends for one call under ring algorithms
  (nccl-tests conventions): all-reduce 2(n-1)/n·S, all-gather and reduce-scatter (n-1)/n·S,
  reduce (n-1)/n·S (a ring reduce is a reduce-scatter plus a gather to the root),
  broadcast S·(n-1)/n (pipelined ring, each GPU forwards the buffer once except the last:
  averaged per GPU), all-to-all (n-1)/n·S. Integer floor of the exact rational.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Op", "Phase", "GroupKind", "OPS", "ring_factor", "sent_bytes", "busbw_factor"]

Op = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]
Phase = Literal["forward", "backward", "step"]
GroupKind = Literal["all", "intra-node", "inter-node"]
OPS: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


def ring_factor(op: str, n: int) -> tuple[int, int]:
    """(numerator, denominator) of the bytes one GPU sends per byte of full buffer."""
    if n <= 1:
        return (0, 1)
    if op == "all_reduce":
        return (2 * (n - 1), n)
    if op in ("all_gather", "reduce_scatter", "reduce", "all_to_all", "broadcast"):
        return (n - 1, n)
    raise ValueError(f"unknown collective {op!r}")


def sent_bytes(op: str, buffer_bytes: int, n: int) -> int:
    """Bytes one GPU sends for one call of ``op`` on a full buffer of ``buffer_bytes``."""
    num, den = ring_factor(op, n)
    return (buffer_bytes * num) // den


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw × factor."""
    if op == "all_reduce":
        return 2 * (n - 1) / n if n > 1 else 0.0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n if n > 1 else 0.0
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")

