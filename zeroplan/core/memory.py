"""Per-GPU memory for ZeRO stages 0–3: model states, buffers, activations, phase peaks, host RAM.

Units: bytes (ints). Ψ = parameters, N = data-parallel GPUs. Per-parameter bytes come from
the precision preset (params b_p, gradients b_g, fp32 master m) and the optimizer (state s);
K = m + s (the ZeRO paper's K = 12 for Adam).

Model states (ZeRO paper §5, generalised; padded exactly as DeepSpeed lays buffers out,
see core/layout.py):
  stage 0: b_p·Ψ + b_g·Ψ + K·Ψ
  stage 1: b_p·Ψ + b_g·Ψ + K·Ψ/N
  stage 2: b_p·Ψ + (b_g + K)·Ψ/N
  stage 3: (b_p + b_g + K)·Ψ/N   (+ persistent small params kept whole on every rank)

Peaks are the maximum over three phases of what is live, with DeepSpeed's real buffers
(deepspeed-internals.md §4): gradient buckets (``reduce_bucket_size`` elements, doubled by
``overlap_comm`` in stages 1–2, one persistent bucket in stage 3), bucket flatten copies, the
transient fp32 gradient partition at the step (bounded by ``sub_group_size`` in stage 3), the
optimizer's foreach temporaries, stage-3 gathered parameters (current module — 2× while a
multi-parameter coalesced gather is unpacked — plus modules kept for reuse within
``stage3_max_reuse_distance``, plus prefetch bounded by ``stage3_prefetch_bucket_size`` and
``stage3_max_live_parameters``), activations (core/activations.py) and an explicit overhead
allowance from the hardware profile (CUDA context, NCCL, fragmentation).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from pydantic import BaseModel, Field

from zeroplan.core.activations import ActivationBreakdown, activation_memory
from zeroplan.core.comm import STAGE0_BUCKET
from zeroplan.core.layout import Layout, Stage3Schedule, build_layout, stage3_schedule
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.training import TrainingSetup

__all__ = [
    "CATEGORIES",
    "PHASES",
    "PhaseMemory",
    "GatherPeak",
    "HostMemory",
    "MemoryBreakdown",
    "memory_for_stage",
    "paper_model_states",
    "model_state_bytes",
]

CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations")
PHASES = ("forward", "backward", "step")


def paper_model_states(params: int, n: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2) -> Fraction:
    """The ZeRO paper's per-device model states (Table I), exact rational bytes, no padding."""
    p = Fraction(params)
    if stage == 0:
        return (param_bytes + grad_bytes + k) * p
    if stage == 1:
        return (param_bytes + grad_bytes) * p + k * p / n
    if stage == 2:
        return param_bytes * p + (grad_bytes + k) * p / n
    if stage == 3:
        return (param_bytes + grad_bytes + k) * p / n
    raise ValueError(f"stage must be 0..3, got {stage}")


class PhaseMemory(BaseModel):
    peak: int
    by_category: dict[str, int]


class GatherPeak(BaseModel):
    """Stage 3: what sets the gathered-parameter peak."""

    module: str
    module_bytes: int  # the module's gathered parameters
    transient_bytes: int  # incl. the ~2× of a coalesced multi-parameter gather
    kept_bytes: int  # modules kept gathered for reuse at that moment
    prefetch_bytes: int
    total_bytes: int
    phase: str


class HostMemory(BaseModel):
    """Host (CPU) RAM and NVMe that offload needs; nvidia-smi does not show these."""

    per_gpu_bytes: int = 0
    per_node_bytes: int = 0
    pinned_per_node_bytes: int = 0
    nvme_per_node_bytes: int = 0
    detail: dict[str, int] = Field(default_factory=dict)  # per GPU (rank)


class MemoryBreakdown(BaseModel):
    """Per-GPU bytes. ``model_states`` = params + gradients + optimizer_states (paper's sum)."""

    params: int
    gradients: int
    optimizer_states: int
    model_states: int
    buffers: int  # at the peak phase
    activations: int  # at the peak phase
    overhead: int
    peak: int
    peak_phase: str
    peak_reason: str
    phases: dict[str, PhaseMemory]
    buffers_detail: dict[str, int]  # named buffers (bytes) at their own maximum
    activations_detail: ActivationBreakdown
    overhead_detail: dict[str, int]
    gather: GatherPeak | None = None
    host: HostMemory
    notes: list[str] = Field(default_factory=list)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _offload_device(zero: Any, which: str) -> str:
    off = _get(zero, which)
    dev = _get(off, "device", "none") if off is not None else "none"
    return str(getattr(dev, "value", dev) or "none")


def model_state_bytes(layout: Layout, training: TrainingSetup, stage: int) -> tuple[int, int, int]:
    """(params, gradients, optimizer_states) bytes per GPU, padded as DeepSpeed does, no offload."""
    prec = training.precision
    k = training.optimizer_bytes_per_param
    if stage == 0:
        n_p = n_g = n_o = layout.params
    elif stage in (1, 2):
        n_p = layout.flat_padded
        n_g = layout.flat_padded if stage == 1 else layout.partition_12
        n_o = layout.partition_12
    else:
        n_p = layout.partition_3 + layout.persistent_padded
        n_g = layout.partition_3
        n_o = layout.partition_3
    return prec.param_bytes * n_p, prec.grad_bytes * n_g, int(k * n_o)


def _stage3_gather(layout: Layout, sched: Stage3Schedule, b_p: int) -> tuple[GatherPeak | None, GatherPeak | None]:
    """Forward and backward gathered-parameter peaks (bytes).

    Forward: the gather in flight (2× while a multi-parameter coalesced gather is unpacked)
    on top of everything gathered earlier that is kept for backward. Backward: the kept
    modules (released as backward reaches them) plus a re-gathered module in flight.
    """
    if not sched.forward_chunks:
        return None, None
    kept_total = sum(m.gathered for m, again in zip(layout.modules, sched.regather) if m.gathered and not again)
    if sched.one_shot:
        size, n, label = sched.forward_chunks[0]
        t = size * (2 if n > 1 else 1)
        f = GatherPeak(module=label, module_bytes=size * b_p, transient_bytes=t * b_p, kept_bytes=0,
                       prefetch_bytes=0, total_bytes=t * b_p, phase="forward")
        return f, GatherPeak(module=label, module_bytes=size * b_p, transient_bytes=0, kept_bytes=size * b_p,
                             prefetch_bytes=0, total_bytes=size * b_p, phase="backward")
    # forward: walk the chunks; what stays gathered is the kept modules' share of earlier chunks
    frac_kept = kept_total / max(1, sum(c[0] for c in sched.forward_chunks))
    best_f = None
    done = 0
    for size, n, label in sched.forward_chunks:
        t = size * (2 if n > 1 else 1)
        kept = int(done * frac_kept)
        total = kept + t
        if best_f is None or total * b_p > best_f.total_bytes:
            best_f = GatherPeak(module=label, module_bytes=size * b_p, transient_bytes=t * b_p, kept_bytes=kept * b_p,
                                prefetch_bytes=0, total_bytes=total * b_p, phase="forward")
        done += size
    best_b = None
    held = kept_total
    for m, again in reversed(list(zip(layout.modules, sched.regather))):
        if not m.gathered:
            continue
        cur = m.gathered * (2 if m.n_gathered > 1 else 1) if again else 0
        total = held + cur
        if best_b is None or total * b_p > best_b.total_bytes:
            best_b = GatherPeak(module=m.name, module_bytes=m.gathered * b_p, transient_bytes=cur * b_p,
                                kept_bytes=held * b_p, prefetch_bytes=0, total_bytes=total * b_p, phase="backward")
        if not again:
            held -= m.gathered
    return best_f, best_b


def memory_for_stage(
    spec: ModelSpec,
    training: TrainingSetup,
    zero: Any,
    n_gpus: int,
    *,
    gpus_per_node: int = 1,
    overhead: dict[str, Any] | None = None,
    layout: Layout | None = None,
) -> MemoryBreakdown:
    """Per-GPU memory for ``zero.stage`` on ``n_gpus`` data-parallel GPUs.

    ``zero`` is a zeroplan.specs.deepspeed_config.ZeroConfig (or any object with the same
    attribute names). ``overhead`` = {"cuda_context_bytes", "nccl_bytes",
    "fragmentation_fraction"} from the hardware profile, or None (reported as 0, with a note).
    """
    stage = int(_get(zero, "stage", 0))
    prec = training.precision
    b_p, b_g, b_c = prec.param_bytes, prec.grad_bytes, prec.comm_bytes
    mixed = prec.mixed
    if layout is None:
        layout = build_layout(
            spec, n_gpus,
            persistence_threshold=int(_get(zero, "param_persistence_threshold", 100_000)) if stage == 3 else 0,
            model_persistence_threshold=_get(zero, "model_persistence_threshold", None),
        )
    notes: list[str] = []
    off_opt = _offload_device(zero, "offload_optimizer") if stage >= 1 else "none"
    off_par = _offload_device(zero, "offload_param") if stage == 3 else "none"
    rbs = int(_get(zero, "reduce_bucket_size", 500_000_000))
    overlap = bool(_get(zero, "overlap_comm", stage == 3))
    contiguous = bool(_get(zero, "contiguous_gradients", True)) or off_opt != "none"
    psi = layout.params

    params, grads_end, opt = model_state_bytes(layout, training, stage)
    model_states = params + grads_end + opt
    part = {0: psi, 1: layout.partition_12, 2: layout.partition_12, 3: layout.partition_3}[stage]
    k = training.optimizer_bytes_per_param
    host = HostMemory()
    buffers: dict[str, int] = {}

    # hpZ secondary partition (ZeRO++): +b_p·Ψ/k per GPU
    hpz = int(_get(zero, "zero_hpz_partition_size", 1) or 1)
    if stage == 3 and hpz > 1:
        buffers["hpz_secondary_partition"] = b_p * (layout.padded_total_3 // hpz)

    # ---- offload: states move to host RAM (per rank), or NVMe ----
    gpu_params = params
    gpu_opt = opt
    gpu_grads_end = grads_end
    pinned = 0
    if off_opt != "none":
        gpu_opt = 0
        host.detail["optimizer_states"] = int(k * part)
        host.detail["fp32_gradient_partition"] = 4 * part
        if stage in (1, 2):
            host.detail["bit16_gradient_buffer"] = b_g * part
            # one host temp buffer of the largest param in the 16-bit dtype (measured, DS 0.19.8)
            host.detail["offload_temp_grad_buffer"] = b_g * layout.largest_tensor
            if stage == 2 and training.grad_accum > 1:
                # accumulated_grads_in_cpu: whole params overlapping the rank's partition
                host.detail["accumulated_grads_in_cpu"] = b_g * layout.grad_partition_12_max
            gpu_grads_end = b_g * psi if stage == 1 else 0
            buffers["offload_gpu_temp_grad"] = b_g * layout.largest_tensor
        else:
            gpu_grads_end = 0
            host.detail["bit16_gradient_partition"] = b_g * part
        if off_opt == "nvme":
            host.nvme_per_node_bytes = gpus_per_node * (host.detail.pop("optimizer_states") + host.detail.pop("fp32_gradient_partition"))
            bc = int(_get(_get(zero, "offload_optimizer"), "buffer_count", 4) or 4)
            sub = max(layout.sub_groups_3(int(_get(zero, "sub_group_size", 1_000_000_000)))) if stage == 3 else part
            host.detail["nvme_swap_buffers"] = bc * 4 * sub
        if bool(_get(_get(zero, "offload_optimizer"), "pin_memory", True)):
            pinned += sum(host.detail.values())
    if off_par != "none":
        gpu_params = b_p * layout.persistent_padded
        if off_par == "cpu":
            host.detail["param_partition"] = b_p * layout.partition_3
            if bool(_get(_get(zero, "offload_param"), "pin_memory", True)):
                pinned += b_p * layout.partition_3
        else:
            host.nvme_per_node_bytes += gpus_per_node * b_p * layout.partition_3
            bc = int(_get(_get(zero, "offload_param"), "buffer_count", 5) or 5)
            bs = int(_get(_get(zero, "offload_param"), "buffer_size", 100_000_000) or 100_000_000)
            host.detail["param_nvme_buffers"] = bc * bs * b_p
    host.per_gpu_bytes = sum(host.detail.values())
    host.per_node_bytes = host.per_gpu_bytes * gpus_per_node
    host.pinned_per_node_bytes = pinned * gpus_per_node

    # gradients that persist outside backward/step: stage 3's partition buffer always; with
    # gradient accumulation the previous micro-steps' gradients are live in the next forward
    grads_fwd = gpu_grads_end if (stage == 3 or training.grad_accum > 1) else 0

    # ---- buffers by phase ----
    fwd_buf = 0
    bwd_buf = 0
    step_buf = 0
    gather_f = gather_b = None
    if stage == 0:
        # stage 0 buckets are DeepSpeed's constant 5e8 elements, not reduce_bucket_size
        buffers["allreduce_flatten"] = b_c * min(STAGE0_BUCKET, psi)
        bwd_buf += buffers["allreduce_flatten"]
    elif stage in (1, 2):
        if contiguous:
            buffers["ipg_bucket"] = b_g * rbs * (2 if overlap else 1)
            bwd_buf += buffers["ipg_bucket"]
        buffers["allreduce_flatten"] = b_c * min(rbs, psi)
        bwd_buf += buffers["allreduce_flatten"]
        bwd_buf += buffers.get("offload_gpu_temp_grad", 0)
        if stage == 2 and off_opt == "none":
            # DeepSpeed sizes the gradient partition buffer by the whole params that overlap a
            # rank's slice (copy_grads_in_partition): the largest rank holds this much more
            extra = b_g * (layout.grad_partition_12_max - layout.partition_12)
            if extra:
                buffers["gradient_partition_whole_params"] = extra
                bwd_buf += extra
                step_buf += extra
                if training.grad_accum > 1:
                    fwd_buf += extra
    else:
        if contiguous:
            buffers["ipg_bucket"] = b_g * rbs
        buffers["reduce_scatter_temp"] = b_c * min(rbs, layout.padded_total_3)
        sched = stage3_schedule(
            layout, max_live=int(_get(zero, "max_live_parameters", 1_000_000_000)),
            prefetch_bucket=int(_get(zero, "prefetch_bucket_size", 50_000_000)),
            max_reuse=int(_get(zero, "max_reuse_distance", 1_000_000_000)))
        gather_f, gather_b = _stage3_gather(layout, sched, b_p)
        if gather_f:
            buffers["gathered_params_forward"] = gather_f.total_bytes
        if gather_b:
            buffers["gathered_params_backward"] = gather_b.total_bytes
        persistent = buffers.get("ipg_bucket", 0) + buffers.get("hpz_secondary_partition", 0)
        fwd_buf += persistent + (gather_f.total_bytes if gather_f else 0)
        bwd_buf += persistent + buffers["reduce_scatter_temp"] + (gather_b.total_bytes if gather_b else 0)
        step_buf += persistent

    # transient fp32 gradient at the step + optimizer foreach temporaries (GPU only without offload)
    if off_opt == "none":
        if stage == 3:
            group = max(layout.sub_groups_3(int(_get(zero, "sub_group_size", 1_000_000_000))))
        else:
            group = part
        if stage == 0:
            fp32_grad = 4 * group if mixed else 0
        else:
            fp32_grad = (b_g + 4) * group if mixed else 4 * group
        buffers["step_fp32_grad"] = fp32_grad
        adam_like = training.optimizer.state_bytes >= 8
        buffers["optimizer_temp"] = 4 * group if adam_like else 0
        step_buf += fp32_grad + buffers["optimizer_temp"]

    # ---- activations ----
    act = activation_memory(spec, training)

    def phase(p_params: int, p_grads: int, p_opt: int, p_buf: int, p_act: int) -> PhaseMemory:
        cats = {"params": p_params, "gradients": p_grads, "optimizer_states": p_opt, "buffers": p_buf, "activations": p_act}
        return PhaseMemory(peak=sum(cats.values()), by_category=cats)

    # the activations' own forward and backward peaks (core/activations.py: with a transformers
    # trace, the logits, their gradient and a recomputed layer are only stacked where they coexist)
    fwd = phase(gpu_params, grads_fwd, gpu_opt, fwd_buf, act.forward_peak)
    bwd_start = phase(gpu_params, grads_fwd, gpu_opt, bwd_buf, act.backward_peak)
    bwd_end = phase(gpu_params, gpu_grads_end, gpu_opt, bwd_buf, 0)
    bwd = bwd_start if bwd_start.peak >= bwd_end.peak else bwd_end
    stp = phase(gpu_params, gpu_grads_end, gpu_opt, step_buf, 0)
    phases = {"forward": fwd, "backward": bwd, "step": stp}
    peak_phase = max(PHASES, key=lambda k_: phases[k_].peak)
    live_peak = phases[peak_phase].peak

    # ---- overhead (explicit, labelled) ----
    od: dict[str, int] = {}
    if overhead:
        od["cuda_context"] = int(overhead.get("cuda_context_bytes", 0))
        od["nccl"] = int(overhead.get("nccl_bytes", 0))
        od["fragmentation"] = int(float(overhead.get("fragmentation_fraction", 0.0)) * live_peak)
    else:
        notes.append("no hardware profile: CUDA context, NCCL buffers and fragmentation are not included")
    over = sum(od.values())

    # ---- what sets the peak ----
    cats = phases[peak_phase].by_category
    top = max(cats, key=lambda c: cats[c])
    label = {"params": "parameters", "optimizer_states": "optimizer states"}.get(top, top)
    reason = f"{label} ({cats[top] / 1e9:.2f} GB) dominate the {peak_phase} peak"
    gp = gather_f if peak_phase == "forward" else gather_b if peak_phase == "backward" else None
    if stage == 3 and gp is not None and gp.total_bytes > 0 and (top == "buffers" or gp.module_bytes >= 0.05 * live_peak):
        reason = (
            f"stage-3 gather of `{gp.module}` ({gp.transient_bytes / 1e9:.2f} GB in flight, "
            f"{gp.total_bytes / 1e9:.2f} GB gathered in all) during {gp.phase}; " + reason
        )
    if off_opt == "none" and peak_phase == "step" and step_buf:
        reason = (
            f"the optimizer step's transients (fp32 gradient copy {buffers['step_fp32_grad'] / 1e9:.2f} GB, "
            f"optimizer temporaries {buffers['optimizer_temp'] / 1e9:.2f} GB) on top of the model states; " + reason
        )

    return MemoryBreakdown(
        params=gpu_params,
        gradients=gpu_grads_end,
        optimizer_states=gpu_opt,
        model_states=model_states if (off_opt == "none" and off_par == "none") else gpu_params + gpu_grads_end + gpu_opt,
        buffers=cats["buffers"],
        activations=cats["activations"],
        overhead=over,
        peak=live_peak + over,
        peak_phase=peak_phase,
        peak_reason=reason,
        phases=phases,
        buffers_detail=buffers,
        activations_detail=act,
        overhead_detail=od,
        gather=(max((g for g in (gather_f, gather_b) if g), key=lambda g: g.total_bytes) if stage == 3 and (gather_f or gather_b) else None),
        host=host,
        notes=notes,
    )
