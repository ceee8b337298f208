"""``recommend``: search ZeRO stage × offload × micro-batch × checkpointing × buckets, rank, explain.

The decision frame (the seed article): **capacity first** — only configurations whose peak per
GPU, host RAM per node and NVMe per node fit are candidates — **then match the stage to the
network** — among those, rank by useful throughput, preferring the lower stage and no offload
when they are about as fast.

Search space (per ZeRO stage):

- optimizer offload ``none | cpu | nvme`` (stages 1–3) and parameter offload ``none | cpu | nvme``
  (stage 3 only, and only together with an optimizer offload at least as far away: parameters are
  2–4 bytes per element, optimizer states 12–16, so offloading parameters while keeping the
  optimizer on the GPU is never the better trade);
- micro-batch ``1, 2, 4, …`` up to the largest that fits (capped by ``max_micro_batch``), or the
  one the user fixed;
- activation checkpointing ``none | selective | full`` (``selective`` is skipped where it keeps
  the same bytes as ``none``, e.g. with flash attention);
- ``reduce_bucket_size`` 5e7, 2e8, 5e8 elements (plus the base config's value); stage 3 also
  ``stage3_prefetch_bucket_size`` (the base value and 1e7) and, on more than one node, hpZ
  (``zero_hpz_partition_size`` = GPUs per node).

Constraints: peak per GPU <= GPU memory × (1 − headroom); host RAM per node <= the profile's host
RAM × (1 − headroom); NVMe per node <= the profile's NVMe capacity.

**Useful throughput** (what is ranked): global training tokens per second of wall-clock time =
micro_batch × seq_len × grad_accum × n_gpus / step_time, with step_time = compute (6·Ψ_active
FLOPs per token, 8· with full recomputation, over peak FLOP/s × MFU) + exposed communication (the
mean of the best- and worst-case overlap, core/timing.py) + offload PCIe transfers. Recomputed
forward passes and offload traffic are cost, never work: a token counts once.

Ranking: (1) fit; (2) if some no-offload configuration reaches ≥ 50% of the best offload
configuration's useful throughput, offload configurations are dropped; (3) every remaining
configuration within 5% of the best useful throughput (the model's noise) is "as fast"; among
those the lowest stage wins, then no offload, then less checkpointing, then the higher throughput,
then the fewest changes from DeepSpeed's defaults (or the user's base config).

Speed: ``evaluate()`` rebuilds the parameter layout and the collective ledger on every call
(~60 ms for a 405B model on 512 GPUs). The sweep evaluates the same core functions but shares what
does not change: one layout per persistence setting, one ``memory_for_stage`` call per
(stage, offload, buckets, hpZ) with activations taken out (activations are exactly linear in the
micro-batch), one collective ledger per (stage, buckets, hpZ) (collectives do not depend on
offload; the PCIe transfers do not depend on buckets), and the α–β step time per micro-batch.
Micro-batches stop at the first that does not fit. The chosen configuration is then re-evaluated
with ``evaluate()``, whose numbers are the ones reported; tests check the sweep against
``evaluate()`` byte for byte.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, Field

from zeroplan._util import InputError
from zeroplan.core.activations import activation_memory
from zeroplan.core.comm import CommLedger, PcieTransfer, build_ledger, offload_costs
from zeroplan.core.layout import Layout, build_layout
from zeroplan.core.memory import memory_for_stage
from zeroplan.core.inputs import PlanInputs, zero_for_stage
from zeroplan.core.plan import ClusterSummary, ModelSummary, Plan, evaluate, model_summary, training_summary
from zeroplan.core.timing import estimate_time
from zeroplan.report.render import gb, seconds

__all__ = [
    "Candidate",
    "StageSummary",
    "Recommendation",
    "recommend",
    "candidate_zero",
    "is_ethernet",
    "USEFUL_THROUGHPUT",
    "NOISE",
    "OFFLOAD_RATIO",
    "BUCKET_SIZES",
    "PREFETCH_SMALL",
]

NOISE = 0.05  # configurations within 5% of the best useful throughput are "as fast"
OFFLOAD_RATIO = 0.5  # offload only when no-offload reaches < 50% of the best offload throughput
BUCKET_SIZES = (50_000_000, 200_000_000, 500_000_000)  # reduce_bucket_size, elements
PREFETCH_SMALL = 10_000_000  # stage3_prefetch_bucket_size for tight memory, elements
CKPT_ORDER = ("none", "selective", "full")
NVME_PATH = "/local_nvme"  # placeholder written into emitted configs; set it to the NVMe mount
USEFUL_THROUGHPUT = (
    "useful throughput = global training tokens per second = micro_batch × seq_len × grad_accum × "
    "n_gpus / step_time; step_time = compute (6·Ψ FLOPs per token, 8·Ψ with full recomputation, at "
    "peak FLOP/s × MFU) + exposed communication (mean of best/worst overlap) + offload PCIe time. "
    "Recomputation and offload traffic are cost, not work."
)

_OFFLOAD_COMBOS = {
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    2: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")],
}
_DEV_RANK = {"none": 0, "cpu": 1, "nvme": 2}


def is_ethernet(link: Any) -> bool:
    """True when an inter-node LinkSpec is Ethernet/TCP (100GbE, RoCE, TCPX) rather than IB/EFA."""
    name = str(getattr(link, "name", "")).lower()
    return any(w in name for w in ("gbe", "ethernet", "tcp", "socket", "roce"))


class Candidate(BaseModel):
    """One searched configuration. Bytes are per GPU unless named per node; sizes in elements."""

    stage: int
    offload_optimizer: str
    offload_param: str
    micro_batch: int
    checkpointing: str
    reduce_bucket_size: int
    prefetch_bucket_size: int | None = None  # stage 3 only
    hpz_partition_size: int = 1
    peak_bytes: int
    gpu_memory_bytes: int
    headroom_bytes: int  # gpu_memory_bytes − peak_bytes
    host_per_node_bytes: int
    nvme_per_node_bytes: int
    fits: bool
    limit: str | None = None  # what does not fit: "gpu", "host", "nvme"
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # useful throughput (see USEFUL_THROUGHPUT)
    comm_share: float | None = None
    comm_bytes_per_gpu_per_step: int | None = None
    exposed_comm_s: float | None = None  # mean of best/worst

    @property
    def offload(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"

    def offload_label(self) -> str:
        extra = []
        if self.offload_optimizer != "none":
            extra.append(f"optimizer→{self.offload_optimizer}")
        if self.offload_param != "none":
            extra.append(f"params→{self.offload_param}")
        return ", ".join(extra) or "no offload"

    def label(self) -> str:
        return f"ZeRO-{self.stage}" + (f" ({self.offload_label()})" if self.offload else "")


class StageSummary(BaseModel):
    stage: int
    fits: bool  # some configuration of this stage fits
    fits_without_offload: bool
    best: Candidate | None = None  # fastest fitting configuration of this stage
    leanest: Candidate  # smallest-peak configuration without offload
    leanest_dominant: str  # what dominates the leanest configuration's peak
    leanest_reason: str  # core's peak_reason for it


class Recommendation(BaseModel):
    """What ``zeroplan recommend --json`` prints. Bytes are ints; GB = 1e9 bytes."""

    model: ModelSummary
    cluster: ClusterSummary
    training: dict[str, Any]
    comm_model: str
    mfu: float
    headroom: float
    usable_gpu_bytes: int
    usable_host_bytes_per_node: int
    nvme_capacity_bytes_per_node: int
    useful_throughput: str = USEFUL_THROUGHPUT
    searched: int  # configurations whose fit was decided (micro-batch × checkpointing × state)
    chosen: Candidate | None = None
    plan: Plan | None = None  # evaluate() of the chosen configuration
    alternatives: list[Candidate] = Field(default_factory=list)
    stages: list[StageSummary] = Field(default_factory=list)
    explanation: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    nodes_needed: dict[str, int | None] = Field(default_factory=dict)  # "ZeRO-3" -> nodes (None: never)
    assumptions: list[str] = Field(default_factory=list)
    ds_config: dict[str, Any] | None = None  # the chosen DeepSpeed config (build_ds_config)
    ds_config_diff: list[dict[str, Any]] | None = None  # vs --ds-config: {key, old, new}


# --------------------------------------------------------------------------------------------
# Building one configuration's ZeroConfig
# --------------------------------------------------------------------------------------------

def candidate_zero(base_zero: Any, *, offload_optimizer: str, offload_param: str, reduce_bucket_size: int,
                   prefetch_bucket_size: int | None = None, hpz_partition_size: int = 1) -> Any:
    """``base_zero`` (a ZeroConfig for the stage) with the searched keys replaced."""
    oo = base_zero.offload_optimizer.model_copy(update={"device": offload_optimizer})
    if offload_optimizer == "nvme" and not oo.nvme_path:
        oo = oo.model_copy(update={"nvme_path": NVME_PATH})
    op = base_zero.offload_param.model_copy(update={"device": offload_param})
    if offload_param == "nvme" and not op.nvme_path:
        op = op.model_copy(update={"nvme_path": NVME_PATH})
    upd: dict[str, Any] = {"offload_optimizer": oo, "offload_param": op, "reduce_bucket_size": int(reduce_bucket_size)}
    if base_zero.stage == 3:
        if prefetch_bucket_size is not None:
            upd["prefetch_bucket_size"] = int(prefetch_bucket_size)
        upd["zero_hpz_partition_size"] = int(hpz_partition_size)
    return base_zero.model_copy(update=upd)


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------

@dataclass
class _State:
    """One (stage, offload, buckets, hpZ) point: everything that does not depend on the batch."""

    stage: int
    off_opt: str
    off_par: str
    rbs: int
    prefetch: int | None
    hpz: int
    zero: Any
    na: tuple[int, int, int, int]  # non-activation live bytes: forward, backward start/end, step
    host_per_node: int
    nvme_per_node: int
    deviation: int  # how many searched keys differ from the base config
    key: tuple = ()


def _entry_key(e: Any) -> tuple:
    return (e.op, e.phase, e.what, e.buffer_bytes, e.dtype, e.group, e.group_size, e.overlap, e.sent_bytes_per_call)


class _Family:
    """All states of one stage, on a grid of axes (offload, reduce bucket, prefetch, hpZ).

    The non-activation bytes per phase, host/NVMe bytes and the collective ledger (as a multiset of
    calls) are evaluated directly at the base point and at every single-axis variant; any other
    point is composed additively from those (each axis changes its own buffers and collectives).
    The composition is checked once per stage against a direct evaluation of the far corner of the
    grid; if it differs — an interaction between axes — every point is evaluated directly.
    """

    def __init__(self, sweep: "_Sweep", stage: int, axes: list[list[Any]]):
        self.sw = sweep
        self.stage = stage
        self.axes = axes
        self.base = tuple(v[0] for v in axes)
        self.corner = tuple(v[-1] for v in axes)
        self._mem: dict[tuple, tuple] = {}
        self._led: dict[tuple, tuple] = {}
        self.mem_ok: bool | None = None if self.corner != self.base else True
        self.led_ok: bool | None = None if self.corner != self.base else True
        self.direct_evals = 0
        self.direct_ledgers = 0

    def _singles(self, point: tuple) -> list[tuple]:
        out = []
        for i, v in enumerate(point):
            if v != self.base[i]:
                q = list(self.base)
                q[i] = v
                out.append(tuple(q))
        return out

    # -- memory --
    def _mem_direct(self, point: tuple) -> tuple:
        if point not in self._mem:
            self.direct_evals += 1
            zero = self.sw.zero(self.stage, point)
            m = memory_for_stage(self.sw.spec, self.sw.ref_training, zero, self.sw.n, gpus_per_node=self.sw.gpn,
                                 overhead=self.sw.overhead, layout=self.sw.layout(zero))
            f = m.phases["forward"].by_category
            b = m.phases["backward"].by_category
            st = m.phases["step"].by_category
            common = b["params"] + b["optimizer_states"] + b["buffers"]
            self._mem[point] = (f["params"] + f["gradients"] + f["optimizer_states"] + f["buffers"],
                                common + f["gradients"], common + st["gradients"], sum(st.values()),
                                m.host.per_node_bytes, m.host.nvme_per_node_bytes)
        return self._mem[point]

    def _mem_composed(self, point: tuple) -> tuple:
        base = self._mem_direct(self.base)
        acc = list(base)
        for q in self._singles(point):
            d = self._mem_direct(q)
            acc = [a + (x - y) for a, x, y in zip(acc, d, base)]
        return tuple(acc)

    def memory(self, point: tuple) -> tuple:
        if point in self._mem:
            return self._mem[point]
        if self.mem_ok is None:
            self.mem_ok = self._mem_composed(self.corner) == self._mem_direct(self.corner)
        if self.mem_ok and len(self._singles(point)) > 1:
            return self._mem_composed(point)
        return self._mem_direct(point)

    # -- ledger --
    def _led_direct(self, point: tuple) -> tuple:
        if point not in self._led:
            self.direct_ledgers += 1
            zero = self.sw.zero(self.stage, point)
            led = build_ledger(self.sw.layout(zero), self.sw.inp.training, zero, gpus_per_node=self.sw.gpn,
                               comm_model=self.sw.comm_model)
            calls = Counter()
            proto = {}
            for e in led.collectives:
                k = _entry_key(e)
                calls[k] += e.count
                proto[k] = e
            pcie = Counter((p.direction, p.what, p.bytes_per_step, p.source) for p in led.pcie)
            self._led[point] = (calls, pcie, proto)
        return self._led[point]

    def _led_composed(self, point: tuple) -> tuple:
        calls0, pcie0, proto0 = self._led_direct(self.base)
        calls, pcie, proto = Counter(calls0), Counter(pcie0), dict(proto0)
        for q in self._singles(point):
            c, p, pr = self._led_direct(q)
            calls.update(c)
            calls.subtract(calls0)
            pcie.update(p)
            pcie.subtract(pcie0)
            proto.update(pr)
        if any(v < 0 for v in calls.values()) or any(v < 0 for v in pcie.values()):
            return None  # type: ignore[return-value]
        return (+calls, +pcie, proto)

    def ledger(self, point: tuple) -> tuple:
        if point in self._led:
            return self._led[point]
        if self.led_ok is None:
            comp = self._led_composed(self.corner)
            self.led_ok = comp is not None and comp[:2] == self._led_direct(self.corner)[:2]
        if self.led_ok and len(self._singles(point)) > 1:
            comp = self._led_composed(point)
            if comp is not None:
                return comp
        return self._led_direct(point)


class _Sweep:
    def __init__(self, inp: Any, *, comm_model: str, mfu: float, base_zeros: dict[int, Any]):
        self.inp = inp
        self.hw = inp.hardware
        self.spec = inp.spec
        self.n = inp.n_gpus
        self.gpn = inp.gpus_per_node
        self.comm_model = comm_model
        self.mfu = mfu
        self.base_zeros = base_zeros
        self.overhead = self.hw.overhead.model_dump()
        self.ref_training = inp.training.model_copy(update={"micro_batch": 1, "checkpointing": "none"})
        self._layouts: dict[tuple, Any] = {}
        self._trainings: dict[tuple, Any] = {}
        self._zeros: dict[tuple, Any] = {}
        self.families: dict[int, _Family] = {}
        # activations for ONE sample (exactly linear in the micro-batch), per checkpointing policy
        self.act_fwd: dict[str, int] = {}
        self.act_bwd: dict[str, int] = {}
        for c in CKPT_ORDER:
            a = activation_memory(self.spec, self.training(1, c))
            self.act_fwd[c] = a.forward_peak  # as core/memory.py charges them
            self.act_bwd[c] = a.backward_peak

    def training(self, mb: int, ckpt: str) -> Any:
        key = (mb, ckpt)
        t = self._trainings.get(key)
        if t is None:
            t = self.inp.training.model_copy(update={"micro_batch": mb, "checkpointing": ckpt})
            self._trainings[key] = t
        return t

    def layout(self, zero: Any) -> Any:
        stage = zero.stage
        pt = int(zero.param_persistence_threshold) if stage == 3 else 0
        key = (pt, zero.model_persistence_threshold)
        lay = self._layouts.get(key)
        if lay is None:
            lay = (build_layout(self.spec, self.n, persistence_threshold=pt,
                                                model_persistence_threshold=zero.model_persistence_threshold))
            self._layouts[key] = lay
        return lay

    def zero(self, stage: int, point: tuple) -> Any:
        key = (stage, point)
        z = self._zeros.get(key)
        if z is None:
            (oo, op), rbs, pf, hpz = point
            z = self._zeros[key] = candidate_zero(self.base_zeros[stage], offload_optimizer=oo, offload_param=op,
                                                  reduce_bucket_size=rbs, prefetch_bucket_size=pf,
                                                  hpz_partition_size=hpz)
        return z

    def state(self, stage: int, point: tuple) -> _State:
        fam = self.families[stage]
        fwd, bs, be, stp, host, nvme = fam.memory(point)
        (oo, op), rbs, pf, hpz = point
        bz = self.base_zeros[stage]
        dev = int(rbs != bz.reduce_bucket_size)
        if stage == 3:
            dev += int(pf != bz.prefetch_bucket_size) + int(hpz != bz.zero_hpz_partition_size)
        dev += int(oo != bz.optimizer_offload_device) + int(op != bz.param_offload_device)
        return _State(stage=stage, off_opt=oo, off_par=op, rbs=rbs, prefetch=pf, hpz=hpz, zero=None,
                      na=(fwd, bs, be, stp), host_per_node=host, nvme_per_node=nvme, deviation=dev, key=point)

    def peak(self, s: _State, mb: int, ckpt: str) -> int:
        """Exactly core.memory's peak: max over phases of the live bytes, plus the overhead allowance."""
        fwd, bs, be, stp = s.na
        live = max(fwd + mb * self.act_fwd[ckpt], bs + mb * self.act_bwd[ckpt], be, stp)
        o = self.overhead
        return live + int(float(o["fragmentation_fraction"]) * live) + int(o["cuda_context_bytes"]) + int(o["nccl_bytes"])

    def ledger(self, s: _State) -> Any:
        """The state's collective ledger (independent of micro-batch and checkpointing), for estimate_time."""
        calls, pcie, proto = self.families[s.stage].ledger(s.key)
        entries = []
        for k, count in calls.items():
            e = proto[k]
            entries.append(e.model_copy(update={"count": count, "sent_bytes": count * e.sent_bytes_per_call}))
        total = sum(e.sent_bytes for e in entries)
        by_op: dict[str, int] = {}
        for e in entries:
            by_op[e.op] = by_op.get(e.op, 0) + e.sent_bytes
        pc = [PcieTransfer(direction=d, what=w, bytes_per_step=b, source=src) for (d, w, b, src), c in pcie.items()
              for _ in range(c)]
        zero = self.zero(s.stage, s.key)
        cpu_params, nvme_bytes = offload_costs(self.layout(zero), self.inp.training, zero)
        return CommLedger(flavour=self.comm_model, collectives=entries, bytes_per_gpu_per_step=total,
                          bytes_per_gpu_per_step_by_op=by_op, inter_node_bytes_per_gpu_per_step=0, pcie=pc,
                          cpu_optimizer_params_per_gpu=cpu_params, nvme_bytes_per_gpu_per_step=nvme_bytes)

    def time(self, ledger: Any, mb: int, ckpt: str) -> Any:
        return estimate_time(ledger, self.training(mb, ckpt), self.hw, active_params=self.spec.active_params,
                             n_gpus=self.n, gpus_per_node=self.gpn, mfu=self.mfu)


def _pow2_up_to(cap: int) -> list[int]:
    out = []
    m = 1
    while m <= cap:
        out.append(m)
        m *= 2
    return out


def _fmt_elems(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


# --------------------------------------------------------------------------------------------
# Explanations
# --------------------------------------------------------------------------------------------

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


def _nodes_needed(inp: Any, base_zeros: dict[int, Any], stage: int, *, usable_gpu: int, usable_host: int,
                  min_mb: int, comm_model: str, max_nodes: int = 16384) -> int | None:
    """Fewest nodes on which ``stage``'s leanest no-offload configuration fits (None: not within max_nodes)."""
    gpn = inp.gpus_per_node
    training = inp.training.model_copy(update={"micro_batch": min_mb, "checkpointing": "full"})
    zero = candidate_zero(base_zeros[stage], offload_optimizer="none", offload_param="none",
                          reduce_bucket_size=BUCKET_SIZES[0],
                          prefetch_bucket_size=min(PREFETCH_SMALL, base_zeros[stage].prefetch_bucket_size),
                          hpz_partition_size=1)
    overhead = inp.hardware.overhead.model_dump()

    def fits(nodes: int) -> bool:
        n = nodes * gpn
        lay = build_layout(inp.spec, n, persistence_threshold=int(zero.param_persistence_threshold) if stage == 3 else 0,
                           model_persistence_threshold=zero.model_persistence_threshold)
        mem = memory_for_stage(inp.spec, training, zero, n, gpus_per_node=gpn, overhead=overhead, layout=lay)
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


# --------------------------------------------------------------------------------------------
# recommend()
# --------------------------------------------------------------------------------------------

def recommend(
    inputs: Any,
    *,
    headroom: float = 0.10,
    comm_model: str = "deepspeed",
    mfu: float = 0.4,
    max_micro_batch: int | None = None,
    micro_batch: int | None = None,
    checkpointing: str | None = None,
    stages: list[int] | None = None,
    allow_nvme: bool = True,
    top: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Recommendation:
    """Search, rank and explain (see module docstring). ``inputs`` is a core.inputs.PlanInputs.

    ``micro_batch`` fixes the micro-batch (else 1, 2, 4, … up to the largest that fits, at most
    ``max_micro_batch``, default 1024); ``checkpointing`` fixes the policy (else all three);
    ``stages`` restricts the stages (default 0–3). ``progress(done, total)`` is called after each
    (stage, offload, buckets, hpZ) point.
    """
    from zeroplan.specs.deepspeed_config import build_ds_config, diff_ds_configs

    hw = inputs.hardware
    if hw is None:
        raise InputError("recommend needs a hardware profile: pass --hardware NAME (see `zeroplan profiles list`) or a profile TOML path")
    if not (0 <= headroom < 1):
        raise InputError(f"--headroom {headroom} must be in [0, 1): the fraction of GPU memory and host RAM kept free")
    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {comm_model!r} is unknown; expected deepspeed or paper")
    if not (0 < mfu <= 1):
        raise InputError(f"--mfu {mfu} must be in (0, 1]")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise InputError(f"--max-micro-batch {max_micro_batch} must be a positive integer")
    if micro_batch is not None and micro_batch < 1:
        raise InputError(f"--micro-batch {micro_batch} must be a positive integer")
    if checkpointing is not None and checkpointing not in CKPT_ORDER:
        raise InputError(f"--checkpointing {checkpointing!r} is unknown; expected none, selective or full")
    stages = sorted(set(stages)) if stages else [0, 1, 2, 3]
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise InputError(f"--stage {s} is not a ZeRO stage; expected 0, 1, 2 or 3")


    # The search decides offload itself: start from the base config without the user's offload override.
    inp = inputs
    if inp.offload_optimizer is not None or inp.offload_param is not None:
        from dataclasses import replace

        inp = replace(inp, offload_optimizer=None, offload_param=None)
    base_zeros = {s: zero_for_stage(inp, s) for s in (0, 1, 2, 3)}
    sw = _Sweep(inp, comm_model=comm_model, mfu=mfu, base_zeros=base_zeros)
    gpu_mem = int(hw.gpu.memory_bytes)
    usable_gpu = int(gpu_mem * (1 - headroom))
    usable_host = int(hw.node.host_ram_bytes * (1 - headroom))
    nvme_cap = int(hw.node.nvme_capacity_bytes)
    nvme_ok = allow_nvme and nvme_cap > 0

    mbs = [micro_batch] if micro_batch else _pow2_up_to(max_micro_batch or 1024)
    ckpts = [checkpointing] if checkpointing else list(CKPT_ORDER)
    if "selective" in ckpts and "none" in ckpts and sw.act_fwd["selective"] == sw.act_fwd["none"] \
            and sw.act_bwd["selective"] == sw.act_bwd["none"]:
        ckpts.remove("selective")  # identical bytes and time (e.g. flash attention): nothing to choose

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

    total = len(points)
    cands: list[tuple[Candidate, int]] = []
    leanest: dict[int, tuple[int, Candidate, _State]] = {}
    searched = 0
    min_mb = mbs[0]
    for i, (s, point) in enumerate(points):
        (oo, op), rbs, pf, hpz = point
        st = sw.state(s, point)
        host_ok = st.host_per_node <= usable_host
        nvme_fits = st.nvme_per_node <= nvme_cap

        def make(mb: int, ckpt: str, peak: int, fits: bool, limit: str | None) -> Candidate:
            return Candidate(
                stage=s, offload_optimizer=oo, offload_param=op, micro_batch=mb, checkpointing=ckpt,
                reduce_bucket_size=rbs, prefetch_bucket_size=pf, hpz_partition_size=hpz, peak_bytes=peak,
                gpu_memory_bytes=gpu_mem, headroom_bytes=gpu_mem - peak, host_per_node_bytes=st.host_per_node,
                nvme_per_node_bytes=st.nvme_per_node, fits=fits, limit=limit,
            )

        # the leanest point of this stage without offload (for "why it does not fit")
        if oo == "none" and op == "none":
            lean_ckpt = ckpts[-1]
            p = sw.peak(st, min_mb, lean_ckpt)
            if s not in leanest or p < leanest[s][0]:
                lim = None if p <= usable_gpu and host_ok else ("gpu" if p > usable_gpu else "host")
                leanest[s] = (p, make(min_mb, lean_ckpt, p, lim is None, lim), st)
        led = None
        for ckpt in ckpts:
            for mb in mbs:
                searched += 1
                p = sw.peak(st, mb, ckpt)
                if p > usable_gpu or not host_ok or not nvme_fits:
                    break  # larger micro-batches only need more
                if led is None:
                    led = sw.ledger(st)
                t = sw.time(led, mb, ckpt)
                c = make(mb, ckpt, p, True, None)
                c.step_time_s = t.step_time_s
                c.tokens_per_s = t.tokens_per_s
                c.comm_share = t.comm_share
                c.comm_bytes_per_gpu_per_step = led.bytes_per_gpu_per_step
                c.exposed_comm_s = (t.exposed_time_s["best"] + t.exposed_time_s["worst"]) / 2
                cands.append((c, st.deviation))
        if progress is not None:
            progress(i + 1, total)

    # ---- rank ----
    fit = [c for c, _ in cands]
    dev = {id(c): d for c, d in cands}
    chosen: Candidate | None = None
    if fit:
        non = [c for c in fit if not c.offload]
        off = [c for c in fit if c.offload]
        best_non = max((c.tokens_per_s for c in non), default=0.0)
        best_off = max((c.tokens_per_s for c in off), default=0.0)
        pool = non if non and best_non >= OFFLOAD_RATIO * best_off else fit
        best = max(c.tokens_per_s for c in pool)
        near = [c for c in pool if c.tokens_per_s >= (1 - NOISE) * best]
        chosen = min(near, key=lambda c: (c.stage, _DEV_RANK[c.offload_optimizer] + _DEV_RANK[c.offload_param],
                                          CKPT_ORDER.index(c.checkpointing), -c.tokens_per_s, dev[id(c)]))

    # best per (stage, offload) for the alternatives table and per-stage summaries
    best_by: dict[tuple, Candidate] = {}
    for c in fit:
        k = (c.stage, c.offload_optimizer, c.offload_param)
        b = best_by.get(k)
        if b is None or (c.tokens_per_s, -dev[id(c)]) > (b.tokens_per_s, -dev[id(b)]):
            best_by[k] = c
    alternatives = sorted(best_by.values(), key=lambda c: -c.tokens_per_s)
    if chosen is not None:
        alternatives = [chosen] + [c for c in alternatives if (c.stage, c.offload_optimizer, c.offload_param)
                                   != (chosen.stage, chosen.offload_optimizer, chosen.offload_param)]
    alternatives = alternatives[:max(1, top)]

    summaries: list[StageSummary] = []
    for s in stages:
        if s not in leanest:
            continue
        _, lc, lst = leanest[s]
        lzero = sw.zero(s, lst.key)
        lmem = memory_for_stage(inp.spec, sw.training(lc.micro_batch, lc.checkpointing), lzero, inp.n_gpus,
                                gpus_per_node=inp.gpus_per_node, overhead=sw.overhead, layout=sw.layout(lzero))
        dom, dom_bytes = _dominant(lmem, s, sw.training(lc.micro_batch, lc.checkpointing))
        stage_fit = [c for c in fit if c.stage == s]
        summaries.append(StageSummary(
            stage=s, fits=bool(stage_fit), fits_without_offload=any(not c.offload for c in stage_fit),
            best=max(stage_fit, key=lambda c: c.tokens_per_s) if stage_fit else None,
            leanest=lc, leanest_dominant=f"{dom} ({gb(dom_bytes)})", leanest_reason=lmem.peak_reason,
        ))

    # ---- the chosen plan, by evaluate() ----
    plan = None
    ds_cfg = None
    diff = None
    if chosen is not None:
        zero = candidate_zero(base_zeros[chosen.stage], offload_optimizer=chosen.offload_optimizer,
                              offload_param=chosen.offload_param, reduce_bucket_size=chosen.reduce_bucket_size,
                              prefetch_bucket_size=chosen.prefetch_bucket_size,
                              hpz_partition_size=chosen.hpz_partition_size)
        plan = evaluate(model=inp.spec, training=sw.training(chosen.micro_batch, chosen.checkpointing), zero=zero,
                        n_gpus=inp.n_gpus, gpus_per_node=inp.gpus_per_node, hardware=hw, comm_model=comm_model,
                        mfu=mfu)
        opt_type = None if inp.ds is not None else (
            "Adam" if inp.training.optimizer.name == "adam" else
            "AdamW" if inp.training.optimizer.name == "adamw" else None)
        ds_cfg = build_ds_config(zero, precision=inp.training.precision.name, micro_batch=chosen.micro_batch,
                                 grad_accum=inp.training.grad_accum, world_size=inp.n_gpus,
                                 optimizer_type=opt_type, base=inp.ds.raw if inp.ds is not None else None)
        if inp.ds is not None:
            diff = [{"key": k, "old": _jsonable(a), "new": _jsonable(b)} for k, a, b in diff_ds_configs(inp.ds.raw, ds_cfg)]

    rec = Recommendation(
        model=model_summary(inp.spec),
        cluster=ClusterSummary(n_gpus=inp.n_gpus, nodes=inp.nodes, gpus_per_node=inp.gpus_per_node,
                               hardware=hw.name, gpu=hw.gpu.name, gpu_memory_bytes=gpu_mem),
        training=training_summary(inp.training) | {"micro_batch": micro_batch or "searched",
                                                   "checkpointing": checkpointing or "searched"},
        comm_model=comm_model, mfu=mfu, headroom=headroom, usable_gpu_bytes=usable_gpu,
        usable_host_bytes_per_node=usable_host, nvme_capacity_bytes_per_node=nvme_cap, searched=searched,
        chosen=chosen, plan=plan, alternatives=alternatives, stages=summaries, assumptions=list(inp.assumptions),
        ds_config=ds_cfg, ds_config_diff=diff,
    )
    if chosen is None:
        for s in [x for x in (3, 2, 1) if x in stages]:
            rec.nodes_needed[f"ZeRO-{s}"] = _nodes_needed(
                inp, base_zeros, s, usable_gpu=usable_gpu, usable_host=usable_host, min_mb=min_mb, comm_model=comm_model)
    _explain(rec, inp, hw, micro_batch_fixed=micro_batch, ckpts=ckpts)
    return rec


def _jsonable(v: Any) -> Any:
    from zeroplan.specs.deepspeed_config import ABSENT

    return None if v is ABSENT else v


def _explain(rec: Recommendation, inp: Any, hw: Any, *, micro_batch_fixed: int | None, ckpts: list[str]) -> None:
    gpu = f"{gb(rec.usable_gpu_bytes)} usable on the {gb(rec.cluster.gpu_memory_bytes)} {hw.gpu.name}"
    if rec.headroom:
        gpu += f" ({rec.headroom:.0%} kept free)"
    c = rec.chosen
    ex = rec.explanation
    warn = rec.warnings
    by_stage = {s.stage: s for s in rec.stages}
    if c is not None:
        ex.append(
            f"Recommended: {c.label()}, micro-batch {c.micro_batch}, checkpointing {c.checkpointing}, "
            f"reduce_bucket_size {_fmt_elems(c.reduce_bucket_size)}"
            + (f", stage3_prefetch_bucket_size {_fmt_elems(c.prefetch_bucket_size)}" if c.stage == 3 else "")
            + (f", hpZ {c.hpz_partition_size}" if c.hpz_partition_size > 1 else "")
            + f": peak {gb(c.peak_bytes)} per GPU ({gb(c.headroom_bytes)} free of {gb(c.gpu_memory_bytes)}), "
            f"{c.tokens_per_s:,.0f} tokens/s on {rec.cluster.n_gpus} GPUs."
        )
    # why the lower stages (or no-offload) do not fit
    upto = c.stage if c is not None else 4
    for s in sorted(by_stage):
        ss = by_stage[s]
        if s > upto:
            continue
        ln = ss.leanest
        lean_desc = (f"micro-batch {ln.micro_batch}, checkpointing {ln.checkpointing}, "
                     f"reduce_bucket_size {_fmt_elems(ln.reduce_bucket_size)}, no offload")
        if not ss.fits_without_offload and (s < upto or c is None or c.offload):
            if ln.limit == "host":
                ex.append(f"ZeRO-{s} without offload does not fit: host RAM per node {gb(ln.host_per_node_bytes)} "
                          f"exceeds {gb(rec.usable_host_bytes_per_node)} usable.")
            else:
                over = ln.peak_bytes - rec.usable_gpu_bytes
                ex.append(
                    f"ZeRO-{s} does not fit without offload: even at its leanest ({lean_desc}) it needs "
                    f"{gb(ln.peak_bytes)} per GPU, {gb(over)} over the {gpu}; the largest part is {ss.leanest_dominant}."
                )
            if ss.fits and ss.best is not None and (c is None or s < upto):
                b = ss.best
                ex.append(f"  With offload ({b.offload_label()}) ZeRO-{s} fits "
                          f"(peak {gb(b.peak_bytes)}, host RAM {gb(b.host_per_node_bytes)} per node) but reaches "
                          f"{b.tokens_per_s:,.0f} tokens/s.")
        elif s < upto and ss.best is not None and c is not None:
            b = ss.best
            ex.append(
                f"ZeRO-{s} fits (best: {b.label()}, micro-batch {b.micro_batch}, {b.tokens_per_s:,.0f} tokens/s) but is "
                f"{'slower' if b.tokens_per_s < c.tokens_per_s else 'not faster'} than the choice by "
                f"{abs(1 - b.tokens_per_s / c.tokens_per_s):.0%}"
                + (" (within the 5% noise band the lower stage would have been preferred)." if b.tokens_per_s >= (1 - NOISE) * c.tokens_per_s else ".")
            )
    for s in sorted(by_stage):
        ss = by_stage[s]
        if c is not None and s > c.stage and ss.best is not None and ss.best.tokens_per_s > c.tokens_per_s:
            b = ss.best
            ex.append(f"ZeRO-{s} ({b.label()}, micro-batch {b.micro_batch}) would reach {b.tokens_per_s:,.0f} tokens/s, "
                      f"{b.tokens_per_s / c.tokens_per_s - 1:.1%} more: within the {NOISE:.0%} noise of the model, "
                      f"so the lower stage is preferred (less communication, fewer moving parts).")
    if c is not None and c.offload:
        non = [a for a in rec.alternatives if not a.offload]
        if not non:
            ex.append("Offload is recommended because no configuration without offload fits.")
        else:
            ex.append(f"Offload is recommended because the best configuration without it ({non[0].label()}, "
                      f"{non[0].tokens_per_s:,.0f} tokens/s) reaches less than {OFFLOAD_RATIO:.0%} of "
                      f"{c.tokens_per_s:,.0f} tokens/s.")
    elif c is not None:
        fit_off = [a for a in rec.alternatives if a.offload]
        if fit_off:
            ex.append(f"No offload: the best offload configuration ({fit_off[0].label()}) reaches "
                      f"{fit_off[0].tokens_per_s:,.0f} tokens/s; offload is used only when nothing without it "
                      f"reaches {OFFLOAD_RATIO:.0%} of that.")
    # communication on this hardware
    p = rec.plan
    if c is not None and p is not None and p.time is not None:
        t = p.time
        inter = p.comm.inter_node_bytes_per_gpu_per_step
        ex.append(
            f"Communication on {hw.name}: ZeRO-{c.stage} sends {gb(p.comm.bytes_per_gpu_per_step)} per GPU per "
            f"optimizer step" + (f" ({gb(inter)} of it across nodes over {hw.inter_node.name})" if rec.cluster.nodes > 1 else
                                 f" inside one node over {hw.intra_node.name}")
            + f"; {seconds(t.comm_time_s)} of collectives, {seconds(t.exposed_time_s['best'])}–"
            f"{seconds(t.exposed_time_s['worst'])} exposed, {t.comm_share:.0%} of the {seconds(t.step_time_s)} step "
            f"(compute {seconds(t.compute_time_s)}" + (f", offload PCIe {seconds(t.pcie_time_s)}" if t.pcie_time_s else "")
            + ")."
        )
        if c.stage == 3 and rec.cluster.nodes > 1 and is_ethernet(hw.inter_node):
            warn.append(f"ZeRO-3 across {rec.cluster.nodes} nodes over Ethernet ({hw.inter_node.name}, "
                        f"{hw.inter_node.bandwidth_GBps_per_gpu:g} GB/s per GPU): parameter all-gathers in forward and "
                        f"backward cross the slow link every micro-step; expect it to be communication-bound.")
        if t.comm_share > 0.5:
            warn.append(f"Communication-bound: exposed communication is {t.comm_share:.0%} of the step. "
                        "A larger micro-batch or gradient accumulation amortises it; a faster inter-node link removes it.")
    # ZeRO-3 communication-bound where it is the only option
    s3 = by_stage.get(3)
    if c is not None and c.stage < 3 and s3 is not None and s3.best is not None and s3.best.comm_share is not None \
            and s3.best.comm_share > 0.5:
        ex.append(f"ZeRO-3 would be communication-bound here ({s3.best.comm_share:.0%} of its step is exposed communication).")
    # nothing fits
    if c is None:
        ex.append(f"Nothing fits on {rec.cluster.n_gpus} GPUs ({rec.cluster.nodes} node(s) of {hw.name}) with "
                  f"{rec.headroom:.0%} headroom.")
        for k, v in rec.nodes_needed.items():
            if v is not None:
                ex.append(f"  {k} without offload (micro-batch {rec.stages[0].leanest.micro_batch if rec.stages else 1}, "
                          f"full checkpointing) fits on {v} nodes ({v * rec.cluster.gpus_per_node} GPUs).")
            else:
                ex.append(f"  {k} without offload does not fit on any number of nodes up to 16384: its replicated "
                          "states do not shrink with more GPUs.")
        s_off = [s for s in rec.stages if s.leanest.limit == "host"]
        for s in s_off:
            ex.append(f"  ZeRO-{s.stage}: host RAM is the limit ({gb(s.leanest.host_per_node_bytes)} per node).")
        if "full" not in ckpts:
            ex.append("  Try activation checkpointing (--checkpointing full) to cut activations to the layer inputs.")
        if micro_batch_fixed and micro_batch_fixed > 1:
            ex.append(f"  Try a smaller micro-batch than {micro_batch_fixed} (and more gradient accumulation).")
        ex.append("  Offload (CPU/NVMe) was searched too; see the host-RAM and NVMe limits above, or add nodes.")
