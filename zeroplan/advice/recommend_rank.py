"""The ranking of ``recommend``: capacity first, then match the stage to the network.

(1) only fitting configurations are candidates; (2) if some no-offload configuration reaches
≥ ``OFFLOAD_RATIO`` of the best offload configuration's useful throughput, offload configurations
are dropped; (3) every remaining configuration within ``NOISE`` of the best useful throughput is
"as fast"; among those the lowest stage wins, then no offload, then less checkpointing, then the
higher throughput, then the fewest changes from the base config. Also: the alternatives table (the
best configuration per stage and offload) and the per-stage summaries.

Imports: module level only.
"""

from __future__ import annotations

from typing import Any

from zeroplan.advice.reasons import qbytes
from zeroplan.advice.recommend_models import CKPT_ORDER, NOISE, OFFLOAD_RATIO, Candidate, StageSummary
from zeroplan.advice.recommend_search import SearchResult
from zeroplan.advice.recommend_sweep import _Sweep
from zeroplan.core.memory import memory_for_stage

__all__ = ["choose", "alternatives", "stage_summaries"]

_DEV_RANK = {"none": 0, "cpu": 1, "nvme": 2}


def choose(fit: list[Candidate], dev: dict[int, int]) -> Candidate | None:
    """The recommended configuration among the fitting ones (``dev``: id(candidate) → deviation)."""
    if not fit:
        return None
    non = [c for c in fit if not c.offload]
    off = [c for c in fit if c.offload]
    best_non = max((c.tokens_per_s for c in non), default=0.0)
    best_off = max((c.tokens_per_s for c in off), default=0.0)
    pool = non if non and best_non >= OFFLOAD_RATIO * best_off else fit
    best = max(c.tokens_per_s for c in pool)
    near = [c for c in pool if c.tokens_per_s >= (1 - NOISE) * best]
    return min(near, key=lambda c: (c.stage, _DEV_RANK[c.offload_optimizer] + _DEV_RANK[c.offload_param],
                                    CKPT_ORDER.index(c.checkpointing), -c.tokens_per_s, dev[id(c)]))


def alternatives(fit: list[Candidate], dev: dict[int, int], chosen: Candidate | None, top: int) -> list[Candidate]:
    """The best configuration per (stage, offload), fastest first, the chosen one first; at most ``top``."""
    best_by: dict[tuple, Candidate] = {}
    for c in fit:
        k = (c.stage, c.offload_optimizer, c.offload_param)
        b = best_by.get(k)
        if b is None or (c.tokens_per_s, -dev[id(c)]) > (b.tokens_per_s, -dev[id(b)]):
            best_by[k] = c
    out = sorted(best_by.values(), key=lambda c: -c.tokens_per_s)
    if chosen is not None:
        out = [chosen] + [c for c in out if (c.stage, c.offload_optimizer, c.offload_param)
                          != (chosen.stage, chosen.offload_optimizer, chosen.offload_param)]
    return out[:max(1, top)]


def _dominant(mem: Any, stage: int, training: Any) -> tuple[str, int]:
    """Plain words for the largest category of the peak phase, and its bytes."""
    cats = mem.phases[mem.peak_phase].by_category
    top = max(cats, key=lambda c: cats[c])
    bits = 8 * training.precision.param_bytes
    words = {
        "params": (f"the replicated {bits}-bit parameters" if stage < 3 else "the parameter partition"),
        "gradients": ("the replicated gradients" if stage < 2 else "the gradient partition"),
        "optimizer_states": ("the replicated optimizer states (fp32 master + moments)" if stage == 0
                             else "the optimizer-state partition (fp32 master + moments)"),
        "buffers": "communication buffers (gradient buckets, gathered parameters, fp32 step copies)",
        "activations": (f"the activations (micro-batch {training.micro_batch} × {training.seq_len} tokens, "
                        f"checkpointing {training.checkpointing})"),
    }
    text = words[top]
    if top == "buffers" and mem.gather is not None and stage == 3:
        text = f"the stage-3 gather of `{mem.gather.module}` and other buffers"
    return text, cats[top]



def stage_summaries(sw: _Sweep, inp: Any, stages: list[int], found: SearchResult,
                    fit: list[Candidate]) -> list[StageSummary]:
    """Per searched stage: does it fit (with or without offload), its fastest configuration, and its
    leanest no-offload configuration with what dominates that peak (by ``memory_for_stage``)."""
    summaries: list[StageSummary] = []
    for s in stages:
        if s not in found.leanest:
            continue
        _, lc, lst = found.leanest[s]
        lzero = sw.zero(s, lst.key)
        lmem = memory_for_stage(inp.spec, sw.training(lc.micro_batch, lc.checkpointing), lzero, inp.n_gpus,
                                gpus_per_node=inp.gpus_per_node, overhead=sw.overhead, layout=sw.layout(lzero),
                                flavour=sw.comm_model)
        dom, dom_bytes = _dominant(lmem, s, sw.training(lc.micro_batch, lc.checkpointing))
        stage_fit = [c for c in fit if c.stage == s]
        summaries.append(StageSummary(
            stage=s, fits=bool(stage_fit), fits_without_offload=any(not c.offload for c in stage_fit),
            best=max(stage_fit, key=lambda c: c.tokens_per_s) if stage_fit else None,
            leanest=lc, leanest_dominant=f"{dom} ({qbytes(dom_bytes).text()})", leanest_reason=lmem.peak_reason,
        ))
    return summaries
