"""What each NCCL record adds to the parse state: ``_State`` (communicators, transports, collectives
counted per logging process, issues) and one handler per kind of message, tried in a fixed order.

The messages are described in zeroplan/inspect/nccl_log.py and matched by the regexes of
inspect/nccl_patterns.py; inspect/nccl_parse.py feeds the records in and summarises the state.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from zeroplan._util import ascii_digits
from zeroplan.inspect.nccl_patterns import (
    _CHANNELS,
    _COLL,
    _COMM_NODES,
    _CONN,
    _CUDA_DRIVER,
    _ERROR,
    _INIT,
    _INIT_PHASE,
    _KNOWN_QUIET,
    _MAX_COUNT,
    _MAX_ISSUES,
    _MAX_NRANKS,
    _NET_DEV,
    _NET_USING,
    _NVLS_SUPPORT,
    _RING,
    _TIMEOUT,
    _TREE_ITEM,
    _TREES,
    _USING_NETWORK,
    _VERSION,
    _clip,
)
from zeroplan.inspect.nccl_summary import NcclDevice, NcclIssue, NcclTree


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
            timeout_ms=int(timeout_ms) if timeout_ms and ascii_digits(timeout_ms) else None,
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

    if _traffic(st, hdr, msg, line_no) or _topology(st, hdr, msg, line_no) or _network(st, hdr, msg):
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


def count_collective(st: _State, m: re.Match[str], source: tuple[str, int, int], line_no: int) -> None:
    """Count one COLL record under ``source`` (host, pid, device), unless its numbers cannot come
    from NCCL: a communicator of no rank or over ``_MAX_NRANKS``, or a count over ``_MAX_COUNT``
    elements. Such a record is skipped and reported as an issue naming the line."""
    op, count, nranks = m.group("op"), int(m.group("count")), int(m.group("nranks"))
    if not 1 <= nranks <= _MAX_NRANKS or count > _MAX_COUNT:
        what = f"nranks={nranks:,}" if not 1 <= nranks <= _MAX_NRANKS else f"count {count:,}"
        st.add_issue("skipped", f"{_clip(op)} record with {_clip(what)} skipped: expected nranks from 1 to "
                     f"{_MAX_NRANKS:,} and a count of at most {_MAX_COUNT:,} elements", line_no,
                     None if source[0] == "?" else source[0])
        return
    st.colls[(op, count, int(m.group("dtype")), nranks)][source] += 1


def _traffic(st: _State, hdr: tuple[str, int, int, int, str], msg: str, line_no: int) -> bool:
    """Collectives (COLL lines) and connections ("via" lines)."""
    host, pid, _, dev, _ = hdr
    m = _COLL.match(msg)
    if m:
        count_collective(st, m, (host, pid, dev), line_no)
        return True

    m = _CONN.match(msg)
    if m:
        via = _clip(m.group("via"))
        kind = _transport_kind(via)
        st.transports[kind][via] += 1
        if "GDRDMA" in via:
            st.gdrdma[kind] += 1
        return True
    return False


def _impossible_comm(st: _State, rank: int, nranks: int, word: str, line_no: int, host: str) -> bool:
    """A communicator line NCCL cannot have written (no rank, over ``_MAX_NRANKS``, or a rank not below the
    size; ``word``: the line's own spelling of the size): reported as skipped with its line."""
    if 1 <= nranks <= _MAX_NRANKS and rank < nranks:
        return False
    st.add_issue("skipped", f"communicator line with rank {_clip(f'{rank:,}')} of {word} {_clip(f'{nranks:,}')} "
                            f"skipped: expected {word} from 1 to {_MAX_NRANKS:,} and a rank below it", line_no,
                 None if host == "?" else host)
    return True


def _topology(st: _State, hdr: tuple[str, int, int, int, str], msg: str, line_no: int) -> bool:
    """Communicator set-up (Init, nRanks/nNodes), rings, trees and the channel totals."""
    host, pid, tid, dev, _ = hdr
    m = _RING.match(msg)
    if m:
        c = st.comm(_ctx_key(st, host, pid, tid, dev))
        c["ring_channels"] = int(m.group("n"))
        c["rings"].setdefault(int(m.group("ch")), [int(x) for x in m.group("ranks").split()])
        return True

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
        return True

    m = _INIT.search(msg)
    phase = _INIT_PHASE.search(msg, m.end()) if m else None
    if m and phase:
        ptr = m.group("ptr")
        key = m.group("commid") or st.comm_key_for_ptr(host, pid, ptr)
        st.ptr_to_comm[(host, pid, ptr)] = key
        rank, nranks = int(m.group("rank")), int(m.group("nranks"))
        if _impossible_comm(st, rank, nranks, "nranks", line_no, host):
            return True
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
        return True

    m = _COMM_NODES.search(msg)
    if m:
        ptr = m.group("ptr")
        key = st.comm_key_for_ptr(host, pid, ptr)
        rank, nranks = int(m.group("rank")), int(m.group("nranks"))
        if _impossible_comm(st, rank, nranks, "nRanks", line_no, host):
            return True
        st.thread_ctx[(host, pid, tid)] = st.thread_ctx[(host, pid, "dev", dev)] = (key, rank)
        c = st.comm(key)
        c["nranks"] = nranks
        c["nnodes"] = int(m.group("nnodes"))
        c["local_ranks"] = int(m.group("lranks"))
        c["ranks"].add(rank)
        c["hosts"].add(host)
        return True

    m = _CHANNELS.match(msg)
    if m:
        c = st.comm(_ctx_key(st, host, pid, tid, dev))
        c["coll_channels"] = int(m.group("coll"))
        c["p2p_channels"] = int(m.group("p2p"))
        if m.group("nvls") is not None:
            c["nvls_channels"] = int(m.group("nvls"))
        if m.group("collnet") is not None:
            c["collnet_channels"] = int(m.group("collnet"))
        return True
    return False


def _network(st: _State, hdr: tuple[str, int, int, int, str], msg: str) -> bool:
    """NVLS support, the network and its devices, the CUDA driver."""
    host = hdr[0]
    m = _NVLS_SUPPORT.search(msg)
    if m:
        (st.nvls_no if m.group("not") else st.nvls_yes).add((host, int(m.group("dev"))))
        _support_line(st, re.sub(r"dev \d+", "dev N", msg))
        return True

    m = _NET_USING.match(msg)
    if m:
        net = m.group("net").strip()
        name = "IB" if net.startswith("IB") else net
        devs = [d for _, d in _NET_DEV.findall(m.group("devs"))]
        known = st.net_devices.setdefault(name, [])
        for d in devs:
            if d not in known:
                known.append(d)
        return True

    m = _USING_NETWORK.match(msg)
    if m:
        if m.group("net") not in st.networks:
            st.networks.append(m.group("net"))
        return True

    m = _CUDA_DRIVER.match(msg)
    if m:
        st.cuda_driver = int(m.group("v"))
        return True
    return False


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
