"""``parse_nccl_log``: the log split into records (any prefix, ranks interleaved or glued onto one
line, messages cut off by another rank's output), each record handed to inspect/nccl_records.py,
and the state summarised into an ``NcclLogSummary`` (the largest communicator is the main one).
"""

from __future__ import annotations

from zeroplan.inspect.nccl_collectives import collective_records
from zeroplan.inspect.nccl_patterns import _COLL, _MAX_LINE_CHARS, _segments
from zeroplan.inspect.nccl_records import _handle_record, _scan_free_text, _State, count_collective
from zeroplan.inspect.nccl_summary import NcclCommunicator, NcclLogSummary, NcclRing, NcclTransport


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
                count_collective(st, m, ("?", 0, 0), line_no)
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

    collectives, op_totals = collective_records(st.colls)

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
        op_totals=op_totals,
        issues=sorted(st.issues.values(), key=lambda i: i.line),
        issue_count=st.issue_count,
        lines_total=lines_total,
        lines_nccl=st.lines_nccl,
        lines_unrecognized=st.lines_unrecognized,
        lines_ignored=st.lines_ignored,
    )
