"""Read an NCCL_DEBUG=INFO log: what NCCL chose, what it ran, and what went wrong.

``parse_nccl_log(text) -> NcclLogSummary`` understands the INFO lines NCCL 2.18–2.2x prints
(older variants too where they differ only in details):

- ``NCCL version 2.18.5+cuda12.2`` and ``cudaDriverVersion 12020``,
- communicator set-up: ``comm 0x.. rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 commId 0x..
  - Init START|COMPLETE`` and ``comm 0x.. rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0``,
- the topology: ring lines ``Channel 00/32 :    0   1   2 ...`` (printed by rank 0 of a
  communicator; the number after the slash is the channel count), per-rank tree lines
  ``Trees [0] 1/8/-1->0->-1 ...`` (children / self / parent), the channel totals
  ``32 coll channels, 0 collnet channels, 16 nvls channels, 32 p2p channels, ...``,
- one line per connection: ``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read``,
  ``... [send] via NET/IB/0/GDRDMA``, ``... via NET/Socket/0``, ``... via SHM/direct/direct``,
- the network: ``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ...``,
  ``NET/Socket : Using [0]eth0:10.0.0.1<0>``, ``Using network IB``,
- NVLS / CollNet support lines,
- with ``NCCL_DEBUG_SUBSYS=COLL``: every collective issued, e.g. ``AllReduce: opCount 3 sendbuff
  0x.. recvbuff 0x.. count 1048576 datatype 7 op 0 root 0 comm 0x.. [nranks=8] stream 0x..``,
- ``NCCL WARN`` lines, PyTorch watchdog timeouts and NCCL error messages.

Lines may carry any prefix (timestamps, ``[rank3]:``, pdsh host names, Ray worker tags) and
ranks may be interleaved, even glued onto one line; every ``host:pid:tid [dev] NCCL LEVEL``
header starts a new record. Lines that are not NCCL's are ignored and counted.

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

import re
from collections import Counter, defaultdict
from typing import Any, Iterable

from pydantic import BaseModel, Field

__all__ = [
    "NcclLogPlan",
    "NcclLogReport",
    "NCCL_DATATYPES",
    "NCCL_OPS",
    "NcclDevice",
    "NcclRing",
    "NcclTree",
    "NcclCommunicator",
    "NcclTransport",
    "NcclCollective",
    "NcclOpTotal",
    "NcclIssue",
    "NcclLogSummary",
    "LedgerComparison",
    "OpComparison",
    "parse_nccl_log",
    "compare_with_ledger",
    "full_buffer_elements",
]

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

_MAX_ISSUES = 50
# NCCL formats one record into a 1 KB buffer (src/debug.cc); interleaved ranks make longer physical
# lines, but not 64K characters: a longer line is reported as skipped, never searched.
_MAX_LINE_CHARS = 65_536
_MAX_TEXT_CHARS = 500  # a message, "via" or support line quoted in the summary: output stays bounded


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT_CHARS else text[: _MAX_TEXT_CHARS - 1] + "…"


# --------------------------------------------------------------------------- models


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
    """Calls of one op on one full-buffer size (see the module docstring for the convention)."""

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


# --------------------------------------------------------------------------- regexes

# Every pattern below sees user text and must run in time linear in the line (issue 17 §6):
# no unanchored run that can start at every character of another run, no nested or adjacent
# quantifiers over overlapping classes. _HEADER's host starts only where a host-character run
# starts (the lookbehind), so a 10 MB run of letters is scanned once, not once per position.
_HEADER = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"NCCL (?P<level>INFO|WARN|TRACE|ABORT)\b ?"
)
_VERSION = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)(?:\+cuda(?P<cuda>[\d.]+))?")
_CUDA_DRIVER = re.compile(r"^cudaDriverVersion (?P<v>\d+)")
_INIT = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<cudadev>\d+)"
    r"(?: nvmlDev \d+)?(?: busId (?P<bus>[0-9a-fA-F]+))?(?: commId (?P<commid>0x[0-9a-fA-F]+))?"
)
_INIT_PHASE = re.compile(r"- Init (?P<phase>START|COMPLETE)")  # searched after an _INIT match (no ".*")
_COMM_NODES = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+)"
    r" localRanks (?P<lranks>\d+) localRank (?P<lrank>\d+)"
)
_RING = re.compile(r"^Channel (?P<ch>\d+)/(?P<n>\d+) :(?P<ranks>(?:\s+\d+)+)\s*$")
_TREES = re.compile(r"^Trees(?P<body>(?: \[\d+\] [-\d/]+->-?\d+->-?\d+)+)")
# children: "-1/-1/-1" style, each item an optional minus and digits (a garbled line does not match)
_TREE_ITEM = re.compile(r"\[(?P<ch>\d+)\] (?P<down>-?\d+(?:/-?\d+)*)->(?P<rank>-?\d+)->(?P<up>-?\d+)")
_CONN = re.compile(
    r"^Channel (?P<ch>\d+)(?:/(?P<conn>\d+))? : (?P<src>\d+)\[(?P<srcdev>[0-9a-fA-F]+)\] -> "
    r"(?P<dst>\d+)\[(?P<dstdev>[0-9a-fA-F]+)\](?: \[(?P<dir>send|receive)\])? via (?P<via>.*\S)\s*$"
)
_CHANNELS = re.compile(
    r"^(?P<coll>\d+) coll channels, (?:(?P<collnet>\d+) collnet channels, )?(?:(?P<nvls>\d+) nvls channels, )?"
    r"(?P<p2p>\d+) p2p channels"
)
_NVLS_SUPPORT = re.compile(r"NVLS multicast support is (?P<not>not )?available on dev (?P<dev>\d+)")
_NET_USING = re.compile(r"^NET/(?P<net>[A-Za-z][\w ]*?) ?: Using (?P<devs>.*?)(?:; OOB .*)?$")
_NET_DEV = re.compile(r"\[(\d+)\](\S+)")
_USING_NETWORK = re.compile(r"^Using network (?P<net>.+?)\s*$")
_COLL = re.compile(
    r"^(?P<op>[A-Za-z]+): opCount (?P<opcount>[0-9a-fA-F]+) sendbuff (?P<send>\S+) recvbuff (?P<recv>\S+) "
    r"count (?P<count>\d+) datatype (?P<dtype>\d+) op (?P<redop>\d+) root (?P<root>-?\d+) "
    r"comm (?P<comm>\S+) \[nranks=(?P<nranks>\d+)\]"
)
_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\((?P<body>[^()]*(?:\([^()]*\)[^()]*)?)\)"
    r"(?: ran for (?P<ran>\d+) milliseconds)?"
)
_ERROR = re.compile(
    r"NCCL error|nccl(?:Internal|System|UnhandledCuda|InvalidArgument|InvalidUsage|Remote)Error"
    r"|NCCL communicator was aborted|NCCL_ABORT"
)
# Messages NCCL prints that carry nothing this summary needs: recognised, not "unknown".
_KNOWN_QUIET = re.compile(
    r"^(Bootstrap|NET/Plugin|Plugin Path|P2P plugin|Setting affinity|P2P Chunksize|threadThresholds|"
    r"Connected all|Connected binomial|Connected NVLS|Connected CollNet|Init timings|NCCL_\w+ set|"
    r"[A-Z_]+ set by environment|comm 0x[0-9a-f]+ rank \d+ nranks \d+ cudaDev|NVLS comm|NVLS Head|"
    r"CC Off|TUNER/Plugin|PROFILER/Plugin|ncclCommInitRank|ncclCommSplit|ncclCommInitAll|"
    r"MNNVL|Channel \d+/\d+ : \d+\[|Using non-device net plugin|Using internal|Assigned NET plugin|"
    r"NET/IB : No device found|NET/IB : Using|NET/Socket : Using|Allocated|cudaDriverVersion|"
    r"comm 0x[0-9a-f]+ rank \d+ nRanks|Trees|NCCL version|Using network|NVLS multicast|"
    r"\d+ coll channels|Check P2P Type|Enabled NCCL Func/Proto/Algo|Comm config|"
    r"ncclProxy|Proxy|init\.cc|transport|graph|misc/|TUNER|Symmetric)"
)


def full_buffer_elements(nccl_op: str, count: int, nranks: int) -> int:
    """Elements of the full (unsharded) buffer for one call, from NCCL's ``count`` argument.

    AllGather: ``count`` is each rank's send count → ``count × nranks``.
    ReduceScatter: ``count`` is each rank's receive count → ``count × nranks``.
    Everything else: ``count`` already is the whole buffer.
    """
    if nccl_op in ("AllGather", "ReduceScatter"):
        return count * nranks
    return count


# --------------------------------------------------------------------------- parsing


def _segments(line: str) -> tuple[str, list[re.Match[str]]]:
    """Split a physical line at every NCCL header: (text before the first, header matches)."""
    matches = list(_HEADER.finditer(line))
    head = line[: matches[0].start()] if matches else line
    return head, matches


class _State:
    def __init__(self) -> None:
        self.version: str | None = None
        self.version_cuda: str | None = None
        self.cuda_driver: int | None = None
        self.hosts: set[str] = set()
        self.processes: set[tuple[str, int]] = set()
        self.devices: dict[tuple[str, int, int, str | None], NcclDevice] = {}
        self.comms: dict[str, dict[str, Any]] = {}
        self.comm_order: list[str] = []
        self.ptr_to_comm: dict[tuple[str, int, str], str] = {}
        # (host, pid, tid) and (host, pid, "dev", dev) -> (comm key, rank): which communicator a
        # thread is setting up, so ring/tree/channel lines (which name none) land on the right one.
        self.thread_ctx: dict[tuple[Any, ...], tuple[str, int]] = {}
        self.transports: dict[str, Counter[str]] = defaultdict(Counter)
        self.gdrdma: Counter[str] = Counter()
        self.networks: list[str] = []
        self.net_devices: dict[str, list[str]] = {}
        self.nvls_yes: set[tuple[str, int]] = set()
        self.nvls_no: set[tuple[str, int]] = set()
        self.support_lines: list[str] = []
        # (nccl_op, count, dtype, nranks) -> Counter of source -> calls
        self.colls: dict[tuple[str, int, int, int], Counter[tuple[str, int, int]]] = defaultdict(Counter)
        self.issues: dict[tuple[str, str], NcclIssue] = {}
        self.issue_count = 0
        self.lines_nccl = 0
        self.lines_unrecognized = 0
        self.lines_ignored = 0
        # Headers whose message was cut off by another rank's output on the same line: the
        # next line without a header carries their message (first cut, first served).
        self.pending: list[tuple[str, int, int, int, str]] = []

    # -- communicators
    def comm(self, key: str) -> dict[str, Any]:
        if key not in self.comms:
            self.comms[key] = {
                "nranks": None,
                "nnodes": None,
                "local_ranks": None,
                "ranks": set(),
                "hosts": set(),
                "ring_channels": None,
                "coll_channels": None,
                "nvls_channels": None,
                "collnet_channels": None,
                "p2p_channels": None,
                "rings": {},
                "trees": {},
                "complete": set(),
            }
            self.comm_order.append(key)
        return self.comms[key]

    def comm_key_for_ptr(self, host: str, pid: int, ptr: str) -> str:
        return self.ptr_to_comm.get((host, pid, ptr), f"ptr:{host}:{pid}:{ptr}")

    def add_issue(self, kind: str, message: str, line_no: int, host: str | None, **extra: Any) -> None:
        self.issue_count += 1
        message = _clip(message)
        key = (kind, message)
        if key in self.issues:
            self.issues[key].occurrences += 1
            return
        if len(self.issues) >= _MAX_ISSUES:
            return
        self.issues[key] = NcclIssue(kind=kind, message=message, line=line_no, host=host, **extra)


def _scan_free_text(st: _State, text: str, line_no: int, host: str | None) -> bool:
    """Look for version / timeout / error text outside NCCL records. True if something matched."""
    found = False
    m = _VERSION.search(text)
    if m and st.version is None:
        st.version, st.version_cuda = m.group("v"), m.group("cuda")
        found = True
    elif m:
        found = True
    t = _TIMEOUT.search(text)
    if t:
        body = t.group("body")
        fields = dict(
            (k.strip(), v.strip())
            for k, v in (part.split("=", 1) for part in re.split(r",\s*", body) if "=" in part)
        )
        timeout_ms = fields.get("Timeout(ms)")
        st.add_issue(
            "timeout",
            text[t.start():].strip(),
            line_no,
            host,
            op=fields.get("OpType"),
            timeout_ms=int(timeout_ms) if timeout_ms and timeout_ms.isdigit() else None,
        )
        return True
    if _ERROR.search(text):
        st.add_issue("error", text.strip(), line_no, host)
        return True
    return found


def _handle_record(st: _State, hdr: tuple[str, int, int, int, str], msg: str, line_no: int) -> None:
    host, pid, tid, dev, level = hdr
    st.lines_nccl += 1
    st.hosts.add(host)
    st.processes.add((host, pid))
    msg = msg.strip()

    if level in ("WARN", "ABORT"):
        st.add_issue("warn", msg, line_no, host)
        return

    m = _COLL.match(msg)
    if m:
        key = (m.group("op"), int(m.group("count")), int(m.group("dtype")), int(m.group("nranks")))
        st.colls[key][(host, pid, dev)] += 1
        return

    m = _CONN.match(msg)
    if m:
        via = _clip(m.group("via"))
        kind = _transport_kind(via)
        st.transports[kind][via] += 1
        if "GDRDMA" in via:
            st.gdrdma[kind] += 1
        return

    m = _RING.match(msg)
    if m:
        c = st.comm(_ctx_key(st, host, pid, tid, dev))
        c["ring_channels"] = int(m.group("n"))
        c["rings"].setdefault(int(m.group("ch")), [int(x) for x in m.group("ranks").split()])
        return

    m = _TREES.match(msg)
    if m:
        c = st.comm(_ctx_key(st, host, pid, tid, dev))
        for item in _TREE_ITEM.finditer(m.group("body")):
            rank = int(item.group("rank"))
            children = [int(x) for x in item.group("down").split("/") if x and int(x) >= 0]
            parent = int(item.group("up"))
            c["trees"][(int(item.group("ch")), rank)] = NcclTree(
                channel=int(item.group("ch")), rank=rank, children=children, parent=parent if parent >= 0 else None
            )
        return

    m = _INIT.search(msg)
    phase = _INIT_PHASE.search(msg, m.end()) if m else None
    if m and phase:
        ptr = m.group("ptr")
        key = m.group("commid") or st.comm_key_for_ptr(host, pid, ptr)
        st.ptr_to_comm[(host, pid, ptr)] = key
        rank, nranks = int(m.group("rank")), int(m.group("nranks"))
        st.thread_ctx[(host, pid, tid)] = st.thread_ctx[(host, pid, "dev", dev)] = (key, rank)
        c = st.comm(key)
        c["nranks"] = nranks
        c["ranks"].add(rank)
        c["hosts"].add(host)
        if phase.group("phase") == "COMPLETE":
            c["complete"].add(rank)
        bus = m.group("bus")
        dkey = (host, int(m.group("cudadev")), rank, key)
        if dkey not in st.devices:
            st.devices[dkey] = NcclDevice(
                host=host, pid=pid, cuda_dev=int(m.group("cudadev")), bus_id=bus, rank=rank, nranks=nranks,
                comm_id=m.group("commid"),
            )
        return

    m = _COMM_NODES.search(msg)
    if m:
        ptr = m.group("ptr")
        key = st.comm_key_for_ptr(host, pid, ptr)
        st.thread_ctx[(host, pid, tid)] = st.thread_ctx[(host, pid, "dev", dev)] = (key, int(m.group("rank")))
        c = st.comm(key)
        c["nranks"] = int(m.group("nranks"))
        c["nnodes"] = int(m.group("nnodes"))
        c["local_ranks"] = int(m.group("lranks"))
        c["ranks"].add(int(m.group("rank")))
        c["hosts"].add(host)
        return

    m = _CHANNELS.match(msg)
    if m:
        c = st.comm(_ctx_key(st, host, pid, tid, dev))
        c["coll_channels"] = int(m.group("coll"))
        c["p2p_channels"] = int(m.group("p2p"))
        if m.group("nvls") is not None:
            c["nvls_channels"] = int(m.group("nvls"))
        if m.group("collnet") is not None:
            c["collnet_channels"] = int(m.group("collnet"))
        return

    m = _NVLS_SUPPORT.search(msg)
    if m:
        (st.nvls_no if m.group("not") else st.nvls_yes).add((host, int(m.group("dev"))))
        _support_line(st, re.sub(r"dev \d+", "dev N", msg))
        return

    m = _NET_USING.match(msg)
    if m:
        net = m.group("net").strip()
        name = "IB" if net.startswith("IB") else net
        devs = [d for _, d in _NET_DEV.findall(m.group("devs"))]
        known = st.net_devices.setdefault(name, [])
        for d in devs:
            if d not in known:
                known.append(d)
        return

    m = _USING_NETWORK.match(msg)
    if m:
        if m.group("net") not in st.networks:
            st.networks.append(m.group("net"))
        return

    m = _CUDA_DRIVER.match(msg)
    if m:
        st.cuda_driver = int(m.group("v"))
        return

    if _VERSION.search(msg):
        _scan_free_text(st, msg, line_no, host)
        return

    if re.search(r"\bCollNet\b|\bcollnet\b|\bNVLS\b|\bSHARP\b", msg) and not _KNOWN_QUIET.match(msg):
        _support_line(st, msg)
        return

    if _scan_free_text(st, msg, line_no, host):
        return

    if not _KNOWN_QUIET.match(msg):
        st.lines_unrecognized += 1


def _ctx_key(st: _State, host: str, pid: int, tid: int, dev: int) -> str:
    ctx = st.thread_ctx.get((host, pid, tid)) or st.thread_ctx.get((host, pid, "dev", dev))
    return ctx[0] if ctx else f"thread:{host}:{pid}:{tid}"


def _support_line(st: _State, text: str) -> None:
    text = _clip(text)
    if text not in st.support_lines and len(st.support_lines) < _MAX_ISSUES:
        st.support_lines.append(text)


def _transport_kind(via: str) -> str:
    """Classify a connection's "via ..." text: P2P, SHM, NET/IB, NET/Socket, NET/<plugin>, NVLS, CollNet."""
    head = via.split("/")
    first = head[0].strip()
    if first == "NET" and len(head) > 1:
        net = head[1].strip()
        if net.startswith("IB"):  # NET/IB, NET/IBext, NET/IBext_v8 (plugin)
            return "NET/IB"
        return f"NET/{net}"
    if first.upper() == "COLLNET":
        return "CollNet"
    return first


def parse_nccl_log(text: str) -> NcclLogSummary:
    """Parse the text of an NCCL_DEBUG=INFO log (any prefixes, ranks interleaved)."""
    st = _State()
    lines = text.splitlines()
    for line_no, line in enumerate(lines, start=1):
        if len(line) > _MAX_LINE_CHARS:  # not an NCCL record: skip it (the regexes stay linear anyway)
            st.lines_ignored += 1
            st.add_issue("skipped", f"a line of {len(line):,} characters (over {_MAX_LINE_CHARS:,}) was skipped",
                         line_no, None)
            continue
        head, headers = _segments(line)
        if not headers:
            if not line.strip():
                continue
            if st.pending:  # the message of a header that another rank's output cut off
                _handle_record(st, st.pending.pop(0), line, line_no)
                continue
            m = _COLL.match(line.strip())
            if m:  # an orphan COLL record whose header is lost: counted under an unknown rank
                key = (m.group("op"), int(m.group("count")), int(m.group("dtype")), int(m.group("nranks")))
                st.colls[key][("?", 0, 0)] += 1
                st.lines_nccl += 1
                continue
            if not _scan_free_text(st, line, line_no, None):
                st.lines_ignored += 1
            continue
        if head.strip():
            _scan_free_text(st, head, line_no, None)
        for i, h in enumerate(headers):
            end = headers[i + 1].start() if i + 1 < len(headers) else len(line)
            hdr = (h.group("host"), int(h.group("pid")), int(h.group("tid")), int(h.group("dev")), h.group("level"))
            msg = line[h.end():end]
            if not msg.strip() and i + 1 < len(headers):
                st.pending.append(hdr)
                continue
            _handle_record(st, hdr, msg, line_no)
    return _summarise(st, len(lines))


def _summarise(st: _State, lines_total: int) -> NcclLogSummary:
    comms: list[NcclCommunicator] = []
    for key in st.comm_order:
        c = st.comms[key]
        comms.append(
            NcclCommunicator(
                comm_id=key if key.startswith("0x") else None,
                nranks=c["nranks"],
                nnodes=c["nnodes"],
                local_ranks=c["local_ranks"],
                ranks_seen=sorted(c["ranks"]),
                hosts=sorted(c["hosts"]),
                ring_channels=c["ring_channels"],
                coll_channels=c["coll_channels"],
                nvls_channels=c["nvls_channels"],
                collnet_channels=c["collnet_channels"],
                p2p_channels=c["p2p_channels"],
                rings=[NcclRing(channel=ch, ranks=r) for ch, r in sorted(c["rings"].items())],
                trees=[c["trees"][k] for k in sorted(c["trees"])],
                init_complete=len(c["complete"]),
            )
        )
    # Communicators known only through a thread context that never got an Init line are
    # merged away when empty.
    comms = [c for c in comms if c.nranks is not None or c.rings or c.trees or c.coll_channels is not None]
    main = max(comms, key=lambda c: (c.nranks or 0, len(c.rings), c.coll_channels or 0), default=None)

    collectives: list[NcclCollective] = []
    for (nccl_op, count, dtype, nranks), per_source in st.colls.items():
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

    transports = [
        NcclTransport(kind=k, connections=sum(v.values()), variants=dict(sorted(v.items())), gdrdma=st.gdrdma[k])
        for k, v in sorted(st.transports.items())
    ]
    nvls_channels = main.nvls_channels if main else None
    if nvls_channels and not any(t.kind == "NVLS" for t in transports):
        # NVLS has no "via" lines: NCCL reports it through its channel count.
        transports.append(NcclTransport(kind="NVLS", connections=0, variants={}, gdrdma=0))

    return NcclLogSummary(
        nccl_version=st.version,
        nccl_cuda_version=st.version_cuda,
        cuda_driver_version=st.cuda_driver,
        nranks=main.nranks if main else None,
        nnodes=main.nnodes if main else None,
        hosts=sorted(st.hosts),
        processes=len(st.processes),
        devices=sorted(st.devices.values(), key=lambda d: (d.comm_id or "", d.rank or 0, d.host, d.cuda_dev)),
        communicators=comms,
        channels=(main.coll_channels or main.ring_channels) if main else None,
        rings=main.rings if main else [],
        trees=main.trees if main else [],
        transports=transports,
        networks=st.networks,
        net_devices=st.net_devices,
        nvls_available_devices=len(st.nvls_yes),
        nvls_unavailable_devices=len(st.nvls_no),
        nvls_channels=nvls_channels,
        collnet_channels=main.collnet_channels if main else None,
        support_lines=st.support_lines,
        collectives=collectives,
        op_totals=sorted(totals.values(), key=lambda t: t.op),
        issues=sorted(st.issues.values(), key=lambda i: i.line),
        issue_count=st.issue_count,
        lines_total=lines_total,
        lines_nccl=st.lines_nccl,
        lines_unrecognized=st.lines_unrecognized,
        lines_ignored=st.lines_ignored,
    )


# --------------------------------------------------------------------------- ledger comparison

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
