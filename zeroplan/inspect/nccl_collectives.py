"""Collectives logged with ``NCCL_DEBUG_SUBSYS=COLL``: NCCL's datatypes and op names, the full-buffer
byte convention, and the calls per (op, count, datatype, nranks) aggregated over the logging ranks.

**Byte convention.** A collective's ``buffer_bytes`` follows zeroplan.specs.collectives: the FULL
(unsharded) buffer in bytes = elements × datatype size. NCCL's ``count`` is the full buffer for
AllReduce, Broadcast and Reduce, but for AllGather it is the per-rank SEND count (one shard) and
for ReduceScatter the per-rank RECEIVE count (one shard); for those two the full buffer is
``count × nranks`` elements. Send/Recv are point-to-point (PyTorch's all_to_all is a group of
them) and are reported with their own byte count, not converted.

**Per-rank counts.** Every rank logs its own calls. ``calls_per_rank`` is the largest number of
calls any one logging process (host, pid, device) made; ``ranks_logging`` how many processes
logged it; ``uneven`` flags ranks that logged different numbers of the same collective (a hang
or a truncated log).
"""

from __future__ import annotations

from collections import Counter

from zeroplan.inspect.nccl_summary import NcclCollective, NcclOpTotal

# ncclDataType_t (nccl.h): enum value -> (name, bytes per element). 10/11 are the fp8 types
# added in NCCL 2.19; anything above is reported with an unknown size.
NCCL_DATATYPES: dict[int, tuple[str, int]] = {
    0: ("int8", 1),
    1: ("uint8", 1),
    2: ("int32", 4),
    3: ("uint32", 4),
    4: ("int64", 8),
    5: ("uint64", 8),
    6: ("float16", 2),
    7: ("float32", 4),
    8: ("float64", 8),
    9: ("bfloat16", 2),
    10: ("float8e4m3", 1),
    11: ("float8e5m2", 1),
}

# NCCL's name in the COLL line -> zeroplan op name (zeroplan.specs.collectives.OPS), or a
# lower-case name for point-to-point calls that have no ledger counterpart.
NCCL_OPS: dict[str, str] = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
}

def full_buffer_elements(nccl_op: str, count: int, nranks: int) -> int:
    """Elements of the full (unsharded) buffer for one call, from NCCL's ``count`` argument.

    AllGather: ``count`` is each rank's send count → ``count × nranks``.
    ReduceScatter: ``count`` is each rank's receive count → ``count × nranks``.
    Everything else: ``count`` already is the whole buffer.
    """
    if nccl_op in ("AllGather", "ReduceScatter"):
        return count * nranks
    return count


def collective_records(
    colls: dict[tuple[str, int, int, int], Counter[tuple[str, int, int]]],
) -> tuple[list[NcclCollective], list[NcclOpTotal]]:
    """The collectives (sorted by op, largest buffer first) and the totals per op, from the calls
    counted per (NCCL op, count, datatype, nranks) and per logging process (host, pid, device)."""
    collectives: list[NcclCollective] = []
    for (nccl_op, count, dtype, nranks), per_source in colls.items():
        dname, dsize = NCCL_DATATYPES.get(dtype, (f"datatype{dtype}", None))
        elems = full_buffer_elements(nccl_op, count, nranks)
        calls = list(per_source.values())
        collectives.append(
            NcclCollective(
                op=NCCL_OPS.get(nccl_op, nccl_op),
                nccl_op=nccl_op,
                datatype=dname,
                dtype_bytes=dsize,
                count=count,
                nranks=nranks,
                buffer_bytes=elems * dsize if dsize is not None else None,
                calls_per_rank=max(calls),
                ranks_logging=len(per_source),
                log_lines=sum(calls),
                uneven=min(calls) != max(calls),
            )
        )
    collectives.sort(key=lambda c: (c.op, -(c.buffer_bytes or 0), c.nranks, c.datatype))
    totals: dict[str, NcclOpTotal] = {}
    for c in collectives:
        t = totals.setdefault(c.op, NcclOpTotal(op=c.op, calls_per_rank=0, bytes_per_rank=0, sizes=0))
        t.calls_per_rank += c.calls_per_rank
        t.bytes_per_rank += (c.buffer_bytes or 0) * c.calls_per_rank
        t.sizes += 1
    return collectives, sorted(totals.values(), key=lambda t: t.op)
