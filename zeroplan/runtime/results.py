"""Measured-result records shared by the runtime and the bench (pydantic, torch-free).

- ``CollectiveRecord``: one executed collective. ``buffer_bytes`` follows the FULL-buffer
  convention of ``zeroplan.specs.collectives`` (the output of an all-gather, the input of a
  reduce-scatter, the tensor of an all-reduce / broadcast / reduce, the input of an
  all-to-all), in bytes of the dtype actually sent. ``duration_s`` is wall-clock seconds on
  the issuing rank, from issue to completion (for async calls: to the return of ``wait()``).
- ``RankFailure``: why one rank of a launched job did not return a result.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.specs.collectives import GroupKind, Op

__all__ = ["CollectiveRecord", "RankFailure", "FailureKind", "summarize_records", "group_records"]

FailureKind = Literal["died", "timeout", "error", "oom"]
PhaseName = Literal["forward", "backward", "step"]


class CollectiveRecord(BaseModel):
    """One collective as executed on one rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Op
    phase: PhaseName
    buffer_bytes: int = Field(ge=0, description="full (unsharded) buffer, bytes")
    dtype: str = Field(description="torch dtype name without the 'torch.' prefix, e.g. 'float32'")
    group_size: int = Field(ge=1)
    group: GroupKind = "all"
    duration_s: float = Field(ge=0.0, description="seconds, issue to completion on this rank")
    rank: int = Field(ge=0, description="rank within the default (world) group")


class RankFailure(BaseModel):
    """A rank that did not return: it died (signal / exit code), timed out, raised, or ran out of memory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    kind: FailureKind
    message: str


def summarize_records(records: list[CollectiveRecord]) -> dict[str, dict[str, int]]:
    """op -> {"count": calls, "bytes": sum of buffer_bytes} (full-buffer bytes, integers)."""
    out: dict[str, dict[str, int]] = {}
    for rec in records:
        entry = out.setdefault(rec.op, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += rec.buffer_bytes
    return out


def group_records(records: list[Any]) -> dict[str, dict[str, Any]]:
    """'op/phase' -> {count, bytes, dtypes} for one step's records."""
    g: dict[str, dict[str, Any]] = {}
    for rec in records:
        e = g.setdefault(f"{rec.op}/{rec.phase}", {"count": 0, "bytes": 0, "dtypes": []})
        e["count"] += 1
        e["bytes"] += rec.buffer_bytes
        if rec.dtype not in e["dtypes"]:
            e["dtypes"].append(rec.dtype)
    return g
