"""The search of ``recommend``: the grid of ZeRO stage × offload × buckets × hpZ points, the walk over
micro-batch × checkpointing at each point, and the fewest nodes on which a stage would fit.

The walk keeps every fitting configuration (with how many searched keys it changes from the base
config) and, per stage, the leanest configuration without offload (for "why it does not fit").
Micro-batches stop at the first that does not fit: larger ones only need more.

Imports: module level only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from zeroplan.advice.recommend_models import BUCKET_SIZES, CKPT_ORDER, PREFETCH_SMALL, Candidate, candidate_zero
from zeroplan.advice.recommend_sweep import _Family, _State, _Sweep
from zeroplan.core.cublas_workspace import device_overhead
from zeroplan.core.layout import zero_layout
from zeroplan.core.memory import memory_for_stage

__all__ = ["Limits", "SearchResult", "search_grid", "micro_batches", "checkpointings", "search", "nodes_needed"]

_OFFLOAD_COMBOS = {
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    2: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")],
}


@dataclass(frozen=True)
class Limits:
    """What a configuration must fit: bytes per GPU, host RAM and NVMe per node."""

    gpu_mem: int  # the GPU's memory
    usable_gpu: int  # GPU memory × (1 − headroom)
    usable_host: int  # host RAM per node × (1 − headroom)
    nvme_cap: int  # NVMe capacity per node


@dataclass
class SearchResult:
    """Every fitting configuration with its deviation from the base config, the leanest no-offload
    configuration per stage (peak, candidate, state), and how many configurations were decided."""

    cands: list[tuple[Candidate, int]] = field(default_factory=list)
    leanest: dict[int, tuple[int, Candidate, _State]] = field(default_factory=dict)
    searched: int = 0


def _pow2_up_to(cap: int) -> list[int]:
    out = []
    m = 1
    while m <= cap:
        out.append(m)
        m *= 2
    return out


def micro_batches(micro_batch: int | None, max_micro_batch: int | None) -> list[int]:
    """The fixed micro-batch, else 1, 2, 4, … up to ``max_micro_batch`` (default 1024)."""
    return [micro_batch] if micro_batch else _pow2_up_to(max_micro_batch or 1024)


def checkpointings(sw: _Sweep, checkpointing: str | None) -> list[str]:
    """The fixed policy, else all three; ``selective`` is dropped where it keeps the same bytes as ``none``."""
    ckpts = [checkpointing] if checkpointing else list(CKPT_ORDER)
    if "selective" in ckpts and "none" in ckpts and sw.act_fwd["selective"] == sw.act_fwd["none"] \
            and sw.act_bwd["selective"] == sw.act_bwd["none"]:
        ckpts.remove("selective")  # identical bytes and time (e.g. flash attention): nothing to choose
    return ckpts


def search_grid(sw: _Sweep, inp: Any, stages: list[int], base_zeros: dict[int, Any], *,
                nvme_ok: bool) -> list[tuple]:
    """Every (stage, ((offload_optimizer, offload_param), reduce_bucket, prefetch, hpZ)) point, in
    search order; registers each stage's ``_Family`` on ``sw``."""
    points: list[tuple] = []
    for s in stages:
        bz = base_zeros[s]
        rbs_vals = sorted(set(BUCKET_SIZES) | ({int(bz.reduce_bucket_size)} if inp.ds is not None else set()))
        if s == 3:
            pf_vals = sorted({int(bz.prefetch_bucket_size), min(PREFETCH_SMALL, int(bz.prefetch_bucket_size))}, reverse=True)
            hpz_vals = sorted({1, int(bz.zero_hpz_partition_size or 1)} | ({inp.gpus_per_node} if inp.nodes > 1 else set()))
        else:
            pf_vals, hpz_vals = [None], [1]
        offs = [c for c in _OFFLOAD_COMBOS[s] if nvme_ok or "nvme" not in c]
        sw.families[s] = _Family(sw, s, [offs, rbs_vals, pf_vals, hpz_vals])
        for off in offs:
            for hpz in hpz_vals:
                for rbs in rbs_vals:
                    for pf in pf_vals:
                        points.append((s, (off, rbs, pf, hpz)))
    return points


def _candidate(s: int, point: tuple, st: _State, gpu_mem: int, mb: int, ckpt: str, peak: int, fits: bool,
               limit: str | None) -> Candidate:
    (oo, op), rbs, pf, hpz = point
    return Candidate(
        stage=s, offload_optimizer=oo, offload_param=op, micro_batch=mb, checkpointing=ckpt,
        reduce_bucket_size=rbs, prefetch_bucket_size=pf, hpz_partition_size=hpz, peak_bytes=peak,
        gpu_memory_bytes=gpu_mem, headroom_bytes=gpu_mem - peak, host_per_node_bytes=st.host_per_node,
        nvme_per_node_bytes=st.nvme_per_node, fits=fits, limit=limit,
    )


def _search_point(sw: _Sweep, s: int, point: tuple, mbs: list[int], ckpts: list[str], lim: Limits,
                  out: SearchResult) -> None:
    """Walk checkpointing × micro-batch at one point; add what fits (and the stage's leanest) to ``out``."""
    (oo, op), _, _, _ = point
    st = sw.state(s, point)
    host_ok = st.host_per_node <= lim.usable_host
    nvme_fits = st.nvme_per_node <= lim.nvme_cap
    # the leanest point of this stage without offload (for "why it does not fit")
    if oo == "none" and op == "none":
        min_mb, lean_ckpt = mbs[0], ckpts[-1]
        p = sw.peak(st, min_mb, lean_ckpt)
        if s not in out.leanest or p < out.leanest[s][0]:
            limit = None if p <= lim.usable_gpu and host_ok else ("gpu" if p > lim.usable_gpu else "host")
            out.leanest[s] = (p, _candidate(s, point, st, lim.gpu_mem, min_mb, lean_ckpt, p, limit is None, limit), st)
    for ckpt in ckpts:
        led = None  # stage 3's ledger depends on full checkpointing (the recomputation's gathers)
        for mb in mbs:
            out.searched += 1
            p = sw.peak(st, mb, ckpt)
            if p > lim.usable_gpu or not host_ok or not nvme_fits:
                break  # larger micro-batches only need more
            if led is None:
                led = sw.ledger(st, ckpt)
            t = sw.time(led, mb, ckpt)
            c = _candidate(s, point, st, lim.gpu_mem, mb, ckpt, p, True, None)
            c.step_time_s = t.step_time_s
            c.tokens_per_s = t.tokens_per_s
            c.comm_share = t.comm_share
            c.comm_bytes_per_gpu_per_step = led.bytes_per_gpu_per_step
            c.exposed_comm_s = t.exposed_time_s["estimate"]  # what step_time_s includes (core/overlap.py)
            out.cands.append((c, st.deviation))


def search(sw: _Sweep, points: list[tuple], mbs: list[int], ckpts: list[str], lim: Limits,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Walk every point of the grid; ``progress(done, total)`` after each."""
    out = SearchResult()
    total = len(points)
    for i, (s, point) in enumerate(points):
        _search_point(sw, s, point, mbs, ckpts, lim, out)
        if progress is not None:
            progress(i + 1, total)
    return out


def nodes_needed(inp: Any, base_zeros: dict[int, Any], stage: int, *, usable_gpu: int, usable_host: int,
                  min_mb: int, comm_model: str, max_nodes: int = 16384) -> int | None:
    """Fewest nodes on which ``stage``'s leanest no-offload configuration fits (None: not within max_nodes)."""
    gpn = inp.gpus_per_node
    training = inp.training.model_copy(update={"micro_batch": min_mb, "checkpointing": "full"})
    zero = candidate_zero(base_zeros[stage], offload_optimizer="none", offload_param="none",
                          reduce_bucket_size=BUCKET_SIZES[0],
                          prefetch_bucket_size=min(PREFETCH_SMALL, base_zeros[stage].prefetch_bucket_size),
                          hpz_partition_size=1)
    overhead = device_overhead(inp.hardware)

    def fits(nodes: int) -> bool:
        n = nodes * gpn
        lay = zero_layout(inp.spec if inp.finetune is None else inp.finetune.full, n, zero)
        mem = memory_for_stage(inp.spec, training, zero, n, gpus_per_node=gpn, overhead=overhead, layout=lay,
                               flavour=comm_model, finetune=inp.finetune)
        return mem.peak <= usable_gpu and mem.host.per_node_bytes <= usable_host

    lo = inp.nodes
    if fits(lo):
        return lo
    hi = lo
    while True:
        hi = hi * 2
        if hi > max_nodes:
            if fits(max_nodes):
                hi = max_nodes
                break
            return None
        if fits(hi):
            break
        lo = hi
    while hi - lo > 1:  # fits(hi) and not fits(lo)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi

