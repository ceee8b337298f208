"""The log against the planner's collective ledger, op by op, per rank; and ``NcclLogReport``,
what ``zeroplan nccl-log --json`` prints (the summary, the plan it was compared with, the comparison).
"""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import BaseModel

from zeroplan.inspect.nccl_summary import NcclLogSummary

_LEDGER_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")


class OpComparison(BaseModel):
    op: str
    predicted_calls: int  # per rank, over ``steps`` optimizer steps
    predicted_bytes: int  # Σ buffer_bytes × count × steps (full-buffer convention)
    logged_calls: int  # per rank (busiest logging process)
    logged_bytes: int
    calls_diff: int  # logged − predicted
    bytes_diff: int
    calls_ratio: float | None  # logged / predicted calls: ≈ the optimizer steps the log covers
    bytes_ratio: float | None  # logged / predicted bytes (None when nothing was predicted)
    match: bool  # same calls and bytes
    note: str = ""


class LedgerComparison(BaseModel):
    steps: int
    nranks: int | None  # only logged collectives on communicators of this size were counted
    ops: list[OpComparison]
    unmatched_logged_ops: list[str]  # logged ops with no ledger counterpart (send/recv...)
    all_match: bool


def _field(entry: Any, name: str) -> Any:
    if isinstance(entry, dict):
        return entry.get(name)
    return getattr(entry, name, None)


def compare_with_ledger(
    summary: NcclLogSummary,
    collectives: Iterable[Any],
    *,
    steps: int = 1,
    nranks: int | None = None,
) -> LedgerComparison:
    """Predicted ledger vs what the log shows, per op, per rank.

    ``collectives`` are ledger entries (objects or dicts) with ``op``, ``buffer_bytes`` (full
    buffer, bytes) and ``count`` (calls per optimizer step). The ledger describes ONE optimizer
    step; ``steps`` says how many steps the log covers. ``nranks`` restricts the logged side to
    collectives issued on communicators of that size (e.g. the data-parallel group), leaving out
    set-up broadcasts on other groups. Logged bytes use the same full-buffer convention (NCCL's
    AllGather/ReduceScatter shard counts are multiplied by nranks, see ``full_buffer_elements``).
    PyTorch implements all_to_all with grouped Send/Recv, which NCCL logs as such: an all_to_all
    in the ledger is compared with nothing and says so.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    predicted: dict[str, list[int]] = {}
    for entry in collectives:
        op = str(_field(entry, "op"))
        if op not in _LEDGER_OPS:
            raise ValueError(f"ledger entry has unknown op {op!r}; expected one of {', '.join(_LEDGER_OPS)}")
        count = int(_field(entry, "count") or 0)
        buf = int(_field(entry, "buffer_bytes") or 0)
        p = predicted.setdefault(op, [0, 0])
        p[0] += count * steps
        p[1] += buf * count * steps

    logged: dict[str, list[int]] = {}
    for c in summary.collectives:
        if nranks is not None and c.nranks != nranks:
            continue
        lg = logged.setdefault(c.op, [0, 0])
        lg[0] += c.calls_per_rank
        lg[1] += (c.buffer_bytes or 0) * c.calls_per_rank

    ops: list[OpComparison] = []
    for op in _LEDGER_OPS:
        if op not in predicted and op not in logged:
            continue
        pc, pb = predicted.get(op, [0, 0])
        lc, lb = logged.get(op, [0, 0])
        note = ""
        if op == "all_to_all":
            note = "NCCL logs all_to_all as grouped Send/Recv; not comparable op by op"
        elif op not in logged:
            note = "predicted but absent from the log (is NCCL_DEBUG_SUBSYS=COLL set?)"
        elif op not in predicted:
            note = "logged but not predicted (set-up, barriers or other process groups)"
        ops.append(
            OpComparison(
                op=op,
                predicted_calls=pc,
                predicted_bytes=pb,
                logged_calls=lc,
                logged_bytes=lb,
                calls_diff=lc - pc,
                bytes_diff=lb - pb,
                calls_ratio=(lc / pc) if pc else None,
                bytes_ratio=(lb / pb) if pb else None,
                match=(pc == lc and pb == lb),
                note=note,
            )
        )
    unmatched = sorted(op for op in logged if op not in _LEDGER_OPS)
    return LedgerComparison(
        steps=steps,
        nranks=nranks,
        ops=ops,
        unmatched_logged_ops=unmatched,
        all_match=all(o.match for o in ops),
    )


class NcclLogPlan(BaseModel):
    """The plan a log was compared with."""

    stage: int
    n_gpus: int
    comm_model: str
    model: str


class NcclLogReport(BaseModel):
    """What ``zeroplan nccl-log --json`` prints: the log's summary and, with a plan, the comparison."""

    file: str
    summary: NcclLogSummary
    comparison: LedgerComparison | None = None
    plan: NcclLogPlan | None = None
