"""Stage 3's gathers as the memory model sizes them: a coarse schedule of chunks and backward re-gathers
over ``Layout.modules`` (core/memory_buffers.py ``stage3_gather``). The communication ledger and the
backward's live gathered bytes come from the coordinator replay instead (core/stage3_fetch.py,
core/stage3_live.py)."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.layout import Layout

__all__ = ["Stage3Schedule", "stage3_schedule"]


@dataclass
class Stage3Schedule:
    """The memory model's view of stage 3's gathers (core/memory_buffers.py): chunks and re-gathers.

    The ledger does not use it: its gathers are replayed from DeepSpeed's coordinator
    (core/stage3_fetch.py), exact with tied weights and every knob; this coarser schedule only
    sizes the gathered-parameter peaks.

    ``forward_chunks``: one all-gather each — (padded elements, number of params, label).
    ``regather``: per module of ``Layout.modules`` (same order), re-gathered in backward.
    """

    forward_chunks: list[tuple[int, int, str]]
    regather: list[bool]
    one_shot: bool


def stage3_schedule(layout: Layout, *, max_live: int, prefetch_bucket: int, max_reuse: int,
                    paper: bool = False) -> Stage3Schedule:
    mods = layout.modules
    pset = {t.name for t in layout.persistent_tensors}
    nonpersistent = [t for t in layout.tensors if t.name not in pset]
    if paper:
        chunks = [(m.gathered, m.n_gathered, m.name) for m in mods if m.gathered > 0]
        return Stage3Schedule(chunks, [m.gathered > 0 for m in mods], False)
    bound = min(max_live, prefetch_bucket)
    total_np = sum(t.numel for t in nonpersistent)
    if bound > 0 and total_np < bound:
        chunk = (sum(layout.padded(t.numel) for t in nonpersistent), len(nonpersistent), "all non-persistent parameters (one prefetch)")
        return Stage3Schedule([chunk] if nonpersistent else [], [False] * len(mods), True)
    chunks: list[tuple[int, int, str]] = []
    if bound <= 0:
        chunks = [(m.gathered, m.n_gathered, m.name) for m in mods if m.gathered > 0]
    else:
        cur = cur_p = n = 0
        first = ""
        for t in nonpersistent:
            if n == 0:
                first = t.module
            cur += t.numel
            cur_p += layout.padded(t.numel)
            n += 1
            if cur >= bound:
                chunks.append((cur_p, n, first if n == 1 else f"{first} …"))
                cur = cur_p = n = 0
        if n:
            chunks.append((cur_p, n, first if n == 1 else f"{first} …"))
    regather = [False] * len(mods)
    after = 0
    for i in range(len(mods) - 1, -1, -1):
        regather[i] = mods[i].gathered > 0 and 2 * after >= max_reuse
        after += mods[i].numel
    return Stage3Schedule(chunks, regather, False)
