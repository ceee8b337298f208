"""Evaluate a suggested change with the same ``evaluate()`` the advice sits on.

``AdviceContext`` is one evaluated configuration (inputs, ZeRO config, training setup, comm model,
MFU, headroom). ``ctx.try_change(change, metric, claim)`` applies ``change`` (see
``reasons.Alternative``), evaluates the changed plan, and returns the Alternative with the metric
before and after. Advice words a suggestion only when ``alternative.holds``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroplan.advice.reasons import Alternative, Claim, Metric, Quantity, Reason, reason
from zeroplan.core.inputs import PlanInputs, zero_for_stage
from zeroplan.core.plan import Plan, evaluate
from zeroplan.core.timing import collective_time_s
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.training import TrainingSetup

__all__ = ["AdviceContext", "apply_change", "metric_of", "bucket_latency_share", "fits_with_headroom", "is_ethernet",
           "comm_remedies", "NDR_GBPS_PER_GPU"]

_TRAINING_KEYS = ("micro_batch", "grad_accum")


def bucket_latency_share(plan: Plan, hw: Any) -> tuple[float, int, float]:
    """(latency share, calls per step, seconds) of the gradient-bucket collectives under the α–β model.

    The α part of one call is ``collective_time_s`` of the same call with a zero-byte buffer.
    """
    lat = tot = 0.0
    calls = 0
    for e in plan.comm.collectives:
        if "gradient bucket" not in e.what:
            continue
        t = collective_time_s(e, hw, plan.n_gpus, plan.gpus_per_node)
        a = collective_time_s(e.model_copy(update={"buffer_bytes": 0}), hw, plan.n_gpus, plan.gpus_per_node)
        tot += e.count * t
        lat += e.count * a
        calls += e.count
    return (lat / tot if tot > 0 else 0.0), calls, tot


def fits_with_headroom(plan: Plan, min_headroom: float) -> bool:
    """Peak <= GPU memory × (1 − min_headroom) and host RAM / NVMe fit."""
    return plan.memory.peak <= (plan.gpu_memory_bytes or 0) * (1 - min_headroom) and bool(plan.host_fits)


def metric_of(plan: Plan, metric: Metric, hw: Any) -> float:
    if metric == "comm_share":
        return float(plan.time.comm_share) if plan.time is not None else 0.0
    if metric == "tokens_per_s":
        return float(plan.tokens_per_s or 0.0)
    if metric == "peak_bytes":
        return float(plan.memory.peak)
    if metric == "comm_bytes_per_gpu_per_step":
        return float(plan.comm.bytes_per_gpu_per_step)
    return bucket_latency_share(plan, hw)[0]


def apply_change(inp: PlanInputs, zero: ZeroConfig, training: TrainingSetup, hw: Any,
                 change: dict[str, Any]) -> tuple[ZeroConfig, TrainingSetup, Any]:
    """(zero, training, hardware) with ``change`` applied. A ``stage`` change starts from the inputs'
    config for that stage and keeps this configuration's offload devices where the stage allows them."""
    t_upd: dict[str, Any] = {k: int(v) for k, v in change.items() if k in _TRAINING_KEYS}
    if "checkpointing" in change:
        t_upd["checkpointing"] = str(change["checkpointing"])
    training = training.model_copy(update=t_upd) if t_upd else training
    if "stage" in change:
        s = int(change["stage"])
        new = zero_for_stage(inp, s)
        if s >= 1:
            new = new.model_copy(update={"offload_optimizer": zero.offload_optimizer})
        if s == 3:
            new = new.model_copy(update={"offload_param": zero.offload_param})
        zero = new
    z_upd: dict[str, Any] = {}
    if "hpz_partition_size" in change:
        z_upd["zero_hpz_partition_size"] = int(change["hpz_partition_size"])
    if "reduce_bucket_size" in change:
        z_upd["reduce_bucket_size"] = int(change["reduce_bucket_size"])
    if "reduce_scatter" in change:
        z_upd["reduce_scatter"] = bool(change["reduce_scatter"])
    if "prefetch_bucket_size" in change:
        z_upd["prefetch_bucket_size"] = int(change["prefetch_bucket_size"])
    if change.get("leaf_module") == "none":  # zero_optimization.leaf_module with no classes, names or suffixes
        z_upd["leaf_module"] = {"classes": [], "names": [], "name_suffixes": []}
    if "offload_optimizer" in change:
        z_upd["offload_optimizer"] = zero.offload_optimizer.model_copy(update={"device": change["offload_optimizer"]})
    if "offload_param" in change:
        z_upd["offload_param"] = zero.offload_param.model_copy(update={"device": change["offload_param"]})
    zero = zero.model_copy(update=z_upd) if z_upd else zero
    if "inter_node_GBps_per_gpu" in change:
        link = hw.inter_node.model_copy(update={"bandwidth_GBps_per_gpu": float(change["inter_node_GBps_per_gpu"])})
        hw = hw.model_copy(update={"inter_node": link})
    return zero, training, hw


@dataclass
class AdviceContext:
    """One evaluated configuration that advice reasons about."""

    inp: PlanInputs
    zero: ZeroConfig
    training: TrainingSetup
    comm_model: str = "deepspeed"
    mfu: float = 0.4
    min_headroom: float = 0.10
    _plans: dict[tuple, Plan] = field(default_factory=dict)

    @property
    def hw(self) -> Any:
        return self.inp.hardware

    def plan(self, change: dict[str, Any] | None = None) -> Plan:
        key = tuple(sorted((change or {}).items()))
        if key not in self._plans:
            zero, training, hw = apply_change(self.inp, self.zero, self.training, self.hw, change or {})
            self._plans[key] = evaluate(model=self.inp.spec, training=training, zero=zero, n_gpus=self.inp.n_gpus,
                                        gpus_per_node=self.inp.gpus_per_node, hardware=hw,
                                        comm_model=self.comm_model, mfu=self.mfu, finetune=self.inp.finetune)
        return self._plans[key]

    def try_change(self, change: dict[str, Any], metric: Metric, claim: Claim) -> Alternative:
        base, alt = self.plan(), self.plan(change)
        return Alternative(change=dict(change), metric=metric, claim=claim, before=metric_of(base, metric, self.hw),
                           after=metric_of(alt, metric, apply_change(self.inp, self.zero, self.training, self.hw,
                                                                     change)[2]),
                           fits=fits_with_headroom(alt, self.min_headroom), after_peak_bytes=alt.memory.peak)


# --------------------------------------------------------------------------------------------
# Remedies for a communication-bound step (check ZP201, recommend's warning)
# --------------------------------------------------------------------------------------------

# 400 Gb/s NDR InfiniBand per GPU, as in hardware_profiles/h100-8x-ib400.toml and dgx-h100.toml
NDR_GBPS_PER_GPU = 50.0
_PER_MICRO_STEP = {2: "reduces gradients", 3: "re-gathers parameters (and reduces gradients)"}


def is_ethernet(link: Any) -> bool:
    """True when an inter-node LinkSpec is Ethernet/TCP (100GbE, RoCE, TCPX) rather than IB/EFA."""
    name = str(getattr(link, "name", "")).lower()
    return any(w in name for w in ("gbe", "ethernet", "tcp", "socket", "roce"))


def _q(value: float | int, unit: str) -> Quantity:
    return Quantity(value=value, unit=unit)  # type: ignore[arg-type]


def comm_remedies(ctx: AdviceContext) -> list[tuple[Alternative, Reason]]:
    """What the usual remedies for exposed communication do to this plan's comm share, evaluated:
    twice the micro-batch, twice the gradient accumulation, and (across nodes, on a link slower
    than NDR InfiniBand) a 400 Gb/s-per-GPU link. Each comes with a sentence that says what the
    numbers show, whether or not the remedy works."""
    out: list[tuple[Alternative, Reason]] = []
    mb, gas = ctx.training.micro_batch, ctx.training.grad_accum
    stage = int(ctx.zero.stage)
    a = ctx.try_change({"micro_batch": 2 * mb}, "comm_share", "lower")
    slots = dict(mb2=_q(2 * mb, "count"), after=_q(a.after, "fraction"), peak=_q(a.after_peak_bytes, "bytes"))
    if a.holds:
        out.append((a, reason("micro-batch {mb2} lowers it to {after} (peak {peak}, fits)", **slots)))
    elif not a.fits:
        out.append((a, reason("micro-batch {mb2} would make it {after} but does not fit (peak {peak})", **slots)))
    else:
        out.append((a, reason("micro-batch {mb2} leaves it at {after}", **slots)))
    g = ctx.try_change({"grad_accum": 2 * gas}, "comm_share", "lower")
    slots = dict(g2=_q(2 * gas, "count"), after=_q(g.after, "fraction"))
    if g.holds:
        out.append((g, reason("gradient accumulation {g2} lowers it to {after}", **slots)))
    else:
        why = (f"ZeRO-{stage} {_PER_MICRO_STEP[stage]} every micro-step, so " if stage in _PER_MICRO_STEP else "")
        out.append((g, reason(why + "gradient accumulation does not amortise it ({after} at {g2})", **slots)))
    link = ctx.hw.inter_node
    if ctx.inp.nodes > 1 and link.bandwidth_GBps_per_gpu < NDR_GBPS_PER_GPU:
        f = ctx.try_change({"inter_node_GBps_per_gpu": NDR_GBPS_PER_GPU}, "comm_share", "lower")
        slots = dict(bw=_q(NDR_GBPS_PER_GPU, "GB/s"), after=_q(f.after, "fraction"))
        verb = "lowers it to {after}" if f.holds else "leaves it at {after}"
        out.append((f, reason("a {bw}-per-GPU inter-node link (NDR InfiniBand, 400 Gb/s) " + verb, **slots)))
    return out
