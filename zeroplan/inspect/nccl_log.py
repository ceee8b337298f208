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

Where each part lives (inspect/): ``nccl_patterns`` (the line grammar: header and message
regexes, the bounds on quoted text), ``nccl_summary`` (the result models, ``NcclLogSummary``),
``nccl_collectives`` (NCCL's datatypes and op names, the full-buffer byte convention and the
per-rank call counts), ``nccl_records`` (the parse state and one handler per kind of record),
``nccl_parse`` (``parse_nccl_log``) and ``nccl_ledger`` (``compare_with_ledger``, the report
``nccl-log --json`` prints). This module re-exports their names, public and private, so
``from zeroplan.inspect.nccl_log import ...`` keeps working.
"""

from __future__ import annotations

from zeroplan.inspect.nccl_collectives import (  # noqa: F401
    NCCL_DATATYPES,
    NCCL_OPS,
    collective_records,
    full_buffer_elements,
)
from zeroplan.inspect.nccl_ledger import (  # noqa: F401
    _LEDGER_OPS,
    LedgerComparison,
    NcclLogPlan,
    NcclLogReport,
    OpComparison,
    _field,
    compare_with_ledger,
)
from zeroplan.inspect.nccl_parse import _summarise, parse_nccl_log  # noqa: F401
from zeroplan.inspect.nccl_patterns import (  # noqa: F401
    _CHANNELS,
    _COLL,
    _COMM_NODES,
    _CONN,
    _CUDA_DRIVER,
    _ERROR,
    _HEADER,
    _INIT,
    _INIT_PHASE,
    _KNOWN_QUIET,
    _MAX_ISSUES,
    _MAX_LINE_CHARS,
    _MAX_TEXT_CHARS,
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
    _segments,
)
from zeroplan.inspect.nccl_records import (  # noqa: F401
    _ctx_key,
    _handle_record,
    _network,
    _scan_free_text,
    _State,
    _support_line,
    _topology,
    _traffic,
    _transport_kind,
)
from zeroplan.inspect.nccl_summary import (  # noqa: F401
    NcclCollective,
    NcclCommunicator,
    NcclDevice,
    NcclIssue,
    NcclLogSummary,
    NcclOpTotal,
    NcclRing,
    NcclTransport,
    NcclTree,
)

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
