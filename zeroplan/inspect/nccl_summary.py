"""The result models of a parsed NCCL log: devices, communicators and their topology, transports,
collectives per size and per op, issues, and ``NcclLogSummary`` which holds them all.

Byte convention of ``NcclCollective.buffer_bytes``: see zeroplan/inspect/nccl_collectives.py.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class NcclDevice(BaseModel):
    """One GPU as a communicator saw it (from the ``Init`` lines)."""

    host: str
    pid: int
    cuda_dev: int
    bus_id: str | None = None  # NCCL's short form, e.g. "18000" = 0000:18:00.0
    rank: int | None = None
    nranks: int | None = None
    comm_id: str | None = None


class NcclRing(BaseModel):
    channel: int
    ranks: list[int]


class NcclTree(BaseModel):
    """One rank's place in one tree channel: ``children/…->rank->parent`` (-1 = none)."""

    channel: int
    rank: int
    children: list[int]
    parent: int | None


class NcclCommunicator(BaseModel):
    comm_id: str | None = None  # NCCL's commId (shared by every rank of the communicator)
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    ranks_seen: list[int] = Field(default_factory=list)
    hosts: list[str] = Field(default_factory=list)
    ring_channels: int | None = None  # the denominator of "Channel 00/32 :" ring lines
    coll_channels: int | None = None
    nvls_channels: int | None = None
    collnet_channels: int | None = None
    p2p_channels: int | None = None
    rings: list[NcclRing] = Field(default_factory=list)
    trees: list[NcclTree] = Field(default_factory=list)
    init_complete: int = 0  # ranks that logged "Init COMPLETE"


class NcclTransport(BaseModel):
    """Connections per transport. ``kind`` is P2P, SHM, NET/IB, NET/Socket, NET/<plugin>, NVLS."""

    kind: str
    connections: int  # connection lines logged (one per channel, peer and direction)
    variants: dict[str, int]  # the exact "via ..." text -> count, e.g. "NET/IB/0/GDRDMA"
    gdrdma: int = 0  # connections using GPUDirect RDMA


class NcclCollective(BaseModel):
    """Calls of one op on one full-buffer size (the byte convention: inspect/nccl_collectives.py)."""

    op: str  # zeroplan op name (all_reduce, ...) or send/recv, or NCCL's name if unknown
    nccl_op: str
    datatype: str
    dtype_bytes: int | None
    count: int  # NCCL's count argument as logged (elements; a shard for AllGather/ReduceScatter)
    nranks: int
    buffer_bytes: int | None  # full buffer in bytes; None if the datatype size is unknown
    calls_per_rank: int
    ranks_logging: int
    log_lines: int
    uneven: bool = False


class NcclOpTotal(BaseModel):
    op: str
    calls_per_rank: int
    bytes_per_rank: int  # Σ buffer_bytes over the calls of the busiest rank
    sizes: int  # distinct buffer sizes


class NcclIssue(BaseModel):
    kind: str  # "warn" (NCCL WARN), "timeout" (watchdog), "error" (NCCL error message), "skipped" (over-long line)
    message: str
    line: int  # first line (1-based) where it appears
    occurrences: int = 1
    host: str | None = None
    op: str | None = None  # timeouts: PyTorch's OpType
    timeout_ms: int | None = None


class NcclLogSummary(BaseModel):
    nccl_version: str | None = None  # e.g. "2.18.5"
    nccl_cuda_version: str | None = None  # the "+cuda12.2" part
    cuda_driver_version: int | None = None  # as logged, e.g. 12020 = CUDA 12.2
    nranks: int | None = None  # of the largest communicator
    nnodes: int | None = None
    hosts: list[str] = Field(default_factory=list)
    processes: int = 0
    devices: list[NcclDevice] = Field(default_factory=list)
    communicators: list[NcclCommunicator] = Field(default_factory=list)
    channels: int | None = None  # coll (or ring) channels of the largest communicator
    rings: list[NcclRing] = Field(default_factory=list)  # of the largest communicator
    trees: list[NcclTree] = Field(default_factory=list)
    transports: list[NcclTransport] = Field(default_factory=list)
    networks: list[str] = Field(default_factory=list)  # "Using network IB" -> IB
    net_devices: dict[str, list[str]] = Field(default_factory=dict)  # "IB"/"Socket" -> devices
    nvls_available_devices: int = 0  # "NVLS multicast support is available on dev N"
    nvls_unavailable_devices: int = 0
    nvls_channels: int | None = None
    collnet_channels: int | None = None
    support_lines: list[str] = Field(default_factory=list)  # distinct NVLS/CollNet lines
    collectives: list[NcclCollective] = Field(default_factory=list)
    op_totals: list[NcclOpTotal] = Field(default_factory=list)
    issues: list[NcclIssue] = Field(default_factory=list)
    issue_count: int = 0  # including those beyond the first 50 distinct ones
    lines_total: int = 0
    lines_nccl: int = 0  # NCCL records parsed (several can share one physical line)
    lines_unrecognized: int = 0  # NCCL records whose message this parser does not know
    lines_ignored: int = 0  # lines with no NCCL record (program output, tracebacks...)

