"""The NCCL_DEBUG=INFO line grammar: the record header, one regex per message zeroplan reads,
the messages it recognises and skips, and the bounds that keep a summary's text finite.

Every pattern sees user text and runs in time linear in the line (issue 17 §6). What each
message means is described in zeroplan/inspect/nccl_log.py; inspect/nccl_records.py applies them.
"""

from __future__ import annotations

import re

_MAX_ISSUES = 50
# NCCL formats one record into a 1 KB buffer (src/debug.cc); interleaved ranks make longer physical
# lines, but not 64K characters: a longer line is reported as skipped, never searched.
_MAX_LINE_CHARS = 65_536
# A COLL record's numbers beyond these cannot come from NCCL (inspect/nccl_records.count_collective):
# nranks is the communicator's size (the largest jobs run about 10^5 GPUs), count is elements of one
# buffer in device memory (2^48 one-byte elements = 256 TiB; an H200 holds 141 GB).
_MAX_NRANKS = 2**20
_MAX_COUNT = 2**48
_MAX_TEXT_CHARS = 500  # a message, "via" or support line quoted in the summary: output stays bounded
# Every number the patterns take has at most 30 digits (``\d{1,30}``): int() refuses strings of over
# 4,300 digits (a ValueError), and no NCCL number has more than 20; a longer one is no record.


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT_CHARS else text[: _MAX_TEXT_CHARS - 1] + "…"


# Every pattern below sees user text and must run in time linear in the line (issue 17 §6):
# no unanchored run that can start at every character of another run, no nested or adjacent
# quantifiers over overlapping classes. _HEADER's host starts only where a host-character run
# starts (the lookbehind), so a 10 MB run of letters is scanned once, not once per position.
_HEADER = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d{1,30}):(?P<tid>\d{1,30}) \[(?P<dev>\d{1,30})\] "
    r"NCCL (?P<level>INFO|WARN|TRACE|ABORT)\b ?"
)
_VERSION = re.compile(r"NCCL version (?P<v>\d{1,30}\.\d{1,30}\.\d{1,30})(?:\+cuda(?P<cuda>[\d.]+))?")
_CUDA_DRIVER = re.compile(r"^cudaDriverVersion (?P<v>\d{1,30})")
_INIT = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d{1,30}) nranks (?P<nranks>\d{1,30}) cudaDev (?P<cudadev>\d{1,30})"
    r"(?: nvmlDev \d{1,30})?(?: busId (?P<bus>[0-9a-fA-F]+))?(?: commId (?P<commid>0x[0-9a-fA-F]+))?"
)
_INIT_PHASE = re.compile(r"- Init (?P<phase>START|COMPLETE)")  # searched after an _INIT match (no ".*")
_COMM_NODES = re.compile(
    r"comm (?P<ptr>0x[0-9a-fA-F]+) rank (?P<rank>\d{1,30}) nRanks (?P<nranks>\d{1,30}) nNodes (?P<nnodes>\d{1,30})"
    r" localRanks (?P<lranks>\d{1,30}) localRank (?P<lrank>\d{1,30})"
)
_RING = re.compile(r"^Channel (?P<ch>\d{1,30})/(?P<n>\d{1,30}) :(?P<ranks>(?:\s+\d{1,30})+)\s*$")
_TREES = re.compile(r"^Trees(?P<body>(?: \[\d{1,30}\] [-\d/]+->-?\d{1,30}->-?\d{1,30})+)")
# children: "-1/-1/-1" style, each item an optional minus and digits (a garbled line does not match)
_TREE_ITEM = re.compile(r"\[(?P<ch>\d{1,30})\] (?P<down>-?\d{1,30}(?:/-?\d{1,30})*)->(?P<rank>-?\d{1,30})->(?P<up>-?\d{1,30})")
_CONN = re.compile(
    r"^Channel (?P<ch>\d{1,30})(?:/(?P<conn>\d{1,30}))? : (?P<src>\d{1,30})\[(?P<srcdev>[0-9a-fA-F]+)\] -> "
    r"(?P<dst>\d{1,30})\[(?P<dstdev>[0-9a-fA-F]+)\](?: \[(?P<dir>send|receive)\])? via (?P<via>.*\S)\s*$"
)
_CHANNELS = re.compile(
    r"^(?P<coll>\d{1,30}) coll channels, (?:(?P<collnet>\d{1,30}) collnet channels, )?(?:(?P<nvls>\d{1,30}) nvls channels, )?"
    r"(?P<p2p>\d{1,30}) p2p channels"
)
_NVLS_SUPPORT = re.compile(r"NVLS multicast support is (?P<not>not )?available on dev (?P<dev>\d{1,30})")
_NET_USING = re.compile(r"^NET/(?P<net>[A-Za-z][\w ]*?) ?: Using (?P<devs>.*?)(?:; OOB .*)?$")
_NET_DEV = re.compile(r"\[(\d{1,30})\](\S+)")
_USING_NETWORK = re.compile(r"^Using network (?P<net>.+?)\s*$")
_COLL = re.compile(
    r"^(?P<op>[A-Za-z]+): opCount (?P<opcount>[0-9a-fA-F]+) sendbuff (?P<send>\S+) recvbuff (?P<recv>\S+) "
    r"count (?P<count>\d{1,30}) datatype (?P<dtype>\d{1,30}) op (?P<redop>\d{1,30}) root (?P<root>-?\d{1,30}) "
    r"comm (?P<comm>\S+) \[nranks=(?P<nranks>\d{1,30})\]"
)
_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\((?P<body>[^()]*(?:\([^()]*\)[^()]*)?)\)"
    r"(?: ran for (?P<ran>\d{1,30}) milliseconds)?"
)
_ERROR = re.compile(
    r"NCCL error|nccl(?:Internal|System|UnhandledCuda|InvalidArgument|InvalidUsage|Remote)Error"
    r"|NCCL communicator was aborted|NCCL_ABORT"
)
# Messages NCCL prints that carry nothing this summary needs: recognised, not "unknown".
_KNOWN_QUIET = re.compile(
    r"^(Bootstrap|NET/Plugin|Plugin Path|P2P plugin|Setting affinity|P2P Chunksize|threadThresholds|"
    r"Connected all|Connected binomial|Connected NVLS|Connected CollNet|Init timings|NCCL_\w+ set|"
    r"[A-Z_]+ set by environment|comm 0x[0-9a-f]+ rank \d{1,30} nranks \d{1,30} cudaDev|NVLS comm|NVLS Head|"
    r"CC Off|TUNER/Plugin|PROFILER/Plugin|ncclCommInitRank|ncclCommSplit|ncclCommInitAll|"
    r"MNNVL|Channel \d{1,30}/\d{1,30} : \d{1,30}\[|Using non-device net plugin|Using internal|Assigned NET plugin|"
    r"NET/IB : No device found|NET/IB : Using|NET/Socket : Using|Allocated|cudaDriverVersion|"
    r"comm 0x[0-9a-f]+ rank \d{1,30} nRanks|Trees|NCCL version|Using network|NVLS multicast|"
    r"\d{1,30} coll channels|Check P2P Type|Enabled NCCL Func/Proto/Algo|Comm config|"
    r"ncclProxy|Proxy|init\.cc|transport|graph|misc/|TUNER|Symmetric)"
)



def _segments(line: str) -> tuple[str, list[re.Match[str]]]:
    """Split a physical line at every NCCL header: (text before the first, header matches)."""
    matches = list(_HEADER.finditer(line))
    head = line[: matches[0].start()] if matches else line
    return head, matches

