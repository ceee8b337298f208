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
from zeroplan.core.allocator import (STAGE3_CACHE_NOTE, communicators, release_under_pressure, required_bytes,
                                     reserved_bytes)
from zeroplan.core.backward_moments import BackwardMoment, activation_at, backward_moments, set_backward_side
from zeroplan.core.finetune import FineTuneViews, backward_skips
from zeroplan.core.host_memory import HostMemory, host_memory
from zeroplan.core.layout import Layout, zero_layout
from zeroplan.core.memory_buffers import PHASES, GatherPeak, PhaseBuffers, phase_buffers
from zeroplan.core.memory_states import model_state_bytes, stage1_reduces_in_hooks, state_plan
from zeroplan.core.stage3_live import BackwardGathered, backward_gathered
from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.training import TrainingSetup

__all__ = [
    "CATEGORIES",
    "PHASES",
    "GatherPeak",
    "HostMemory",
    "MemoryBreakdown",
    "PhaseMemory",
    "grads_from_autograd",
    "held_bytes",
    "memory_for_stage",
    "model_state_bytes",
    "paper_model_states",
]

CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations")


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


class MemoryBreakdown(BaseModel):
    """Per-GPU bytes. ``model_states`` = params + gradients + optimizer_states (paper's sum)."""

    params: int
    gradients: int
    optimizer_states: int
    model_states: int
    buffers: int  # at the peak phase
    activations: int  # at the peak phase
    overhead: int  # peak - allocated: allocator pools and slack, CUDA context, NCCL
    allocated: int  # what torch.cuda.max_memory_allocated would show
    reserved: int  # the caching allocator's segments (torch.cuda.max_memory_reserved), at most what the card leaves
    required: int = 0  # what the allocator cannot release at the worst moment (core/allocator.py required_bytes)
    peak: int  # reserved + CUDA context + NCCL: what the device holds (nvidia-smi); fits/OOM use this
    peak_phase: str
    peak_reason: str
    phases: dict[str, PhaseMemory]
    buffers_detail: dict[str, int]  # named buffers (bytes) at their own maximum
    activations_detail: ActivationBreakdown
    overhead_detail: dict[str, int]
    gather: GatherPeak | None = None
    host: HostMemory
    communicators: int = 0  # NCCL communicators this rank creates
    side_stream_bytes: dict[str, int] = Field(default_factory=dict)  # per side-stream pool, its own maximum
    optimizer_impl: str = "fused-adam"
    optimizer_wrapper: str = "zero"  # what DeepSpeed wraps the optimizer in (core/memory_states.py)
    step_transient_bytes: int = 0  # the step's large new blocks (core/allocator.py)
    held_bytes: dict[str, int] = Field(default_factory=dict)  # per phase, live bytes with no split slack (held_bytes)
    gradients_churned: bool = False  # the step's gradients are autograd's p.grad (grads_from_autograd)
    backward_moments: list[BackwardMoment] = Field(default_factory=list)  # core/backward_moments.py
    forward_moments: list[BackwardMoment] = Field(default_factory=list)  # stage 3's forward (memory.py forward_moments)
    notes: list[str] = Field(default_factory=list)


def _phase(p_params: int, p_grads: int, p_opt: int, p_buf: int, p_act: int) -> PhaseMemory:
    cats = {"params": p_params, "gradients": p_grads, "optimizer_states": p_opt, "buffers": p_buf, "activations": p_act}
    return PhaseMemory(peak=sum(cats.values()), by_category=cats)


def _phases(act: ActivationBreakdown, pb: Any, moments: list[BackwardMoment], gpu_params: int, gpu_opt: int,
            grads_fwd: int, step_grads: int, fwd_moments: list[BackwardMoment]) -> dict[str, PhaseMemory]:
    """What is live in the forward, backward and step phases. The activations' own forward peak
    (core/activations.py: with a transformers trace, the logits, their gradient and a recomputed layer
    are only stacked where they coexist); the backward is its largest moment (core/backward_moments.py:
    DeepSpeed's buffers beside the activations live when they are), the first on a tie. Sets
    ``pb.held["backward"]`` to the held buffers of that moment and ``pb.churned["backward"]`` to the
    gradients autograd holds then (counted as gradients). Stage 3's forward, where it gathers, is its largest
    moment too (``forward_moments``), whose gathered bytes become the forward's."""
    if fwd_moments:
        fat = [(gpu_params, grads_fwd, gpu_opt, m.buffers, activation_at(act, m.activations, m.layers_done))
               for m in fwd_moments]
        j = max(range(len(fat)), key=lambda k: sum(fat[k]))  # the first of the largest
        _set_forward(pb, fwd_moments[j])
        fwd = _phase(*fat[j])
    else:
        fwd = _phase(gpu_params, grads_fwd, gpu_opt, pb.forward, act.forward_peak)
    at = [(gpu_params, max(grads_fwd, m.gradients) + m.autograd, gpu_opt, m.buffers,
           activation_at(act, m.activations, m.layers_done)) for m in moments]
    i = max(range(len(at)), key=lambda k: sum(at[k]))
    pb.held["backward"] = moments[i].held_buffers
    pb.churned["backward"] = moments[i].autograd
    set_backward_side(pb.side, moments, i)
    stp = _phase(gpu_params, step_grads, gpu_opt, pb.step, 0)
    return {"forward": fwd, "backward": _phase(*at[i]), "step": stp}


def _gathered(layout: Layout, tl: Layout, zero: ZeroConfig, training: TrainingSetup,
              finetune: FineTuneViews | None, flavour: str) -> BackwardGathered | None:
    """Stage 3's gathered parameters through the backward, from the coordinator replay (DeepSpeed's
    flavour; the paper's keeps its stacked buffers)."""
    if int(zero.stage) != 3 or flavour == "paper":
        return None
    return backward_gathered(layout, tl, backward_skips(finetune, training.checkpointing),
                             max_live=zero.max_live_parameters, prefetch_bucket=zero.prefetch_bucket_size,
                             max_reuse=zero.max_reuse_distance, grad_accum=training.grad_accum,
                             recompute_layers=training.checkpointing == "full")


def forward_moments(pb: Any, gathered: BackwardGathered | None, b_p: int) -> list[BackwardMoment]:
    """Stage 3's forward as moments (core/backward_moments.py ``activation_at``'s ``fwd_`` kinds): at each
    region of the forward the coordinator replay's gathered parameters (core/stage3_live.py), a fetch's flat
    buffer being copied out included, beside the activations live there; the other buffers as the phase's.
    Empty where nothing is gathered in the forward (the heuristic ``memory_buffers.stage3_gather`` peak
    stacked on the forward's activation peak stays). Measured against real DeepSpeed on CPU
    (tests/test_backward_moments.py, tests/test_lora_replays.py)."""
    if gathered is None or pb.gather_forward is None or not gathered.forward_layers:
        return []
    other, held, n = pb.forward - pb.gather_forward.total_bytes, pb.held.get("forward", 0), len(gathered.forward_layers)
    regions = [("the embeddings' forward", gathered.forward_bottom, "fwd_layer", n)]
    regions += [(f"forward of layer {k}", g, "fwd_layer", n - 1 - k) for k, g in enumerate(gathered.forward_layers)]
    regions += [("lm_head's fetch", gathered.forward_head, "fwd_head", 0), ("the loss", gathered.forward_end, "fwd_loss", 0)]
    return [BackwardMoment(what=what, buffers=other + b_p * g, held_buffers=held, gradients=0, activations=kind,
                           layers_done=done, side={"allgather": b_p * g}) for what, g, kind, done in regions]


def _set_forward(pb: Any, moment: BackwardMoment) -> None:
    """The forward's gathered bytes are those of its winning moment (reported as its gather)."""
    g = moment.side["allgather"]
    pb.forward = moment.buffers
    pb.side.setdefault("allgather", {})["forward"] = g
    pb.detail["gathered_params_forward"] = g
    pb.gather_forward = GatherPeak(module=f"{moment.what} (coordinator replay)", module_bytes=0, transient_bytes=0,
                                   kept_bytes=g, prefetch_bytes=0, total_bytes=g, phase="forward")


def _moments(pb: Any, layout: Layout, tl: Layout, zero: ZeroConfig, training: TrainingSetup,
             finetune: FineTuneViews | None, flavour: str, grads_end: int, step_pinned: bool,
             hooked: bool, wrapper: str) -> tuple[list[BackwardMoment], list[BackwardMoment]]:
    """The backward's moments (core/backward_moments.py) for one stage's buffers ``pb``, and stage 3's forward
    moments (``forward_moments``, from the same coordinator replay); ``hooked``: stage 1 reducing in the gradient
    hooks, whose backward is stage 2's (core/memory_states.py)."""
    gathered = _gathered(layout, tl, zero, training, finetune, flavour)
    fwd_moments = forward_moments(pb, gathered, training.precision.param_bytes)
    # BF16_Optimizer keeps autograd's bf16 gradients to its epilogue and the all-reduce after it
    lp_grads_end = training.precision.param_bytes * tl.params if wrapper == "bf16_optimizer" else 0
    moments = backward_moments(pb, tl, stage=2 if hooked else int(zero.stage), off_opt=zero.optimizer_offload_device,
                            b_c=training.precision.comm_bytes, bucket_elems=int(zero.reduce_bucket_size),
                            grads_end=grads_end, b_p=training.precision.param_bytes,
                            gathered=gathered,
                            overlap=bool(zero.overlap_comm), grads_in_p_grad=step_pinned,
                            multi_rank_flatten=bool(zero.reduce_scatter and zero.use_multi_rank_bucket_allreduce),
                            keep_oversized=hooked, reduce_scatter=bool(zero.reduce_scatter),
                            lp_grads_end=lp_grads_end)
    return moments, fwd_moments


def _layouts(spec: ModelSpec, n_gpus: int, zero: ZeroConfig, layout: Layout | None, finetune: FineTuneViews | None,
             train_layout: Layout | None) -> tuple[Layout, Layout]:
    """(every parameter's layout, the trainable parameters' layout), built where not given."""
    if layout is None:
        layout = zero_layout(spec, n_gpus, zero)
    if finetune is not None and train_layout is None:
        train_layout = zero_layout(finetune.trainable, n_gpus, zero)
    return layout, (layout if train_layout is None else train_layout)


def _grads_outside_backward(stage: int, wrapper: str, grad_accum: int, grads_end: int, pb: Any) -> tuple[int, int]:
    """(gradient bytes live through the forward, at the step). Persisting outside backward and step:
    stage 3's partition buffer and BF16_Optimizer's fp32 gradients always; with gradient accumulation
    the previous micro-steps' gradients."""
    persistent = stage == 3 or wrapper == "bf16_optimizer" or grad_accum > 1
    return (grads_end if persistent else 0), (grads_end if pb.step_grads is None else pb.step_grads)


def _reason(phases: dict[str, PhaseMemory], peak_phase: str, live_peak: int, stage: int, gp: GatherPeak | None,
            buffers: dict[str, int], step_note: bool) -> str:
    cats = phases[peak_phase].by_category
    top = max(cats, key=lambda c: cats[c])
    label = {"params": "parameters", "optimizer_states": "optimizer states"}.get(top, top)
    reason = f"{label} ({cats[top] / 1e9:.2f} GB) dominate the {peak_phase} peak"
    if stage == 3 and gp is not None and gp.total_bytes > 0 and (top == "buffers" or gp.module_bytes >= 0.05 * live_peak):
        reason = (
            f"stage-3 gather of `{gp.module}` ({gp.transient_bytes / 1e9:.2f} GB in flight, "
            f"{gp.total_bytes / 1e9:.2f} GB gathered in all) during {gp.phase}; " + reason
        )
    if step_note and peak_phase == "step" and phases["step"].by_category["buffers"]:
        reason = (
            f"the optimizer step's transients (fp32 gradient copy {buffers.get('step_fp32_grad', 0) / 1e9:.2f} GB, "
            f"optimizer temporaries {buffers.get('optimizer_temp', 0) / 1e9:.2f} GB) on top of the model states; " + reason
        )
    return reason


def _hooked(training: TrainingSetup, zero: ZeroConfig, flavour: str) -> bool:
    """ZeRO-1 reducing in the gradient hooks, whose gradients live as stage 2's (core/memory_states.py
    ``stage1_reduces_in_hooks``); the paper's accounting has no hooks."""
    offload = zero.optimizer_offload_device != "none"
    return flavour != "paper" and stage1_reduces_in_hooks(int(zero.stage), zero, training, offload=offload)


def step_reads_autograd(training: TrainingSetup, zero: ZeroConfig, *, flavour: str = "deepspeed") -> bool:
    """``grads_from_autograd`` for one configuration, as ``memory_for_stage`` decides it."""
    stage, hooked = int(zero.stage), _hooked(training, zero, flavour)
    sp = state_plan(training, stage, offload=zero.optimizer_offload_device != "none", flavour=flavour, hooked=hooked)
    return grads_from_autograd(sp.wrapper, 2 if hooked else stage)


def grads_from_autograd(wrapper: str, stage: int) -> bool:
    """Whether the step reads autograd's ``p.grad`` kept from backward (FP16_Optimizer / no wrapper,
    ZeRO stage 1) rather than a buffer DeepSpeed allocates once: core/allocator.py ``step_pinned``."""
    return wrapper in ("fp16_optimizer", "fp16_unfused_optimizer", "basic", "unsupported") or (
        wrapper == "zero" and stage == 1)


def held_bytes(phases: dict[str, PhaseMemory], held_buffers: dict[str, int], step_pinned: bool,
               churned: dict[str, int] | None = None) -> dict[str, int]:
    """Per phase, the live bytes whose allocator segments fit them exactly (core/allocator.py: no
    split-segment slack): the parameters, the optimizer states and the gradient buffers DeepSpeed
    allocates once (stages 2–3's contiguous partition, BF16_Optimizer's fp32 gradients), and the
    buffers ``phase_buffers`` tags as held (ipg buckets, the step's same-size transients). Where the
    step's gradients are autograd's ``p.grad`` (``step_pinned``: FP16_Optimizer, ZeRO stage 1) they
    are re-allocated every step in freed activation blocks, so they churn with the activations, as do
    the gradients autograd holds before DeepSpeed's hooks take them (``churned``, per phase)."""
    out = {}
    for p in PHASES:
        c = phases[p].by_category
        grads = 0 if step_pinned else c["gradients"] - (churned or {}).get(p, 0)
        out[p] = c["params"] + c["optimizer_states"] + grads + held_buffers.get(p, 0)
    return out


def _device_figures(phases: dict[str, PhaseMemory], pb: Any, training: TrainingSetup,
                    overhead: dict[str, Any] | None, n_comm: int, gpu_memory_bytes: int | None,
                    step_pinned: bool, notes: list[str],
                    stage: int) -> tuple[int, int, int, dict[str, int], dict[str, int]]:
    """(allocated, reserved, required, side pools, overhead detail): the caching allocator's view of
    the phases (core/allocator.py) plus the CUDA context and NCCL per communicator from the profile;
    on a card of ``gpu_memory_bytes`` the cache gives way before an OOM (``release_under_pressure``)."""
    frag = float(overhead.get("fragmentation_fraction", 0.0)) if overhead else 0.0
    live = {p: phases[p].peak for p in PHASES}
    held = held_bytes(phases, pb.held, step_pinned, pb.churned)
    allocated, reserved, side = reserved_bytes(
        live, pb.side, fragmentation_fraction=frag,
        expandable_segments=training.expandable_segments, step_transient=pb.step_transient, held_by_phase=held)
    required = required_bytes(live, pb.side, fragmentation_fraction=frag,
                              expandable_segments=training.expandable_segments, step_transient=pb.step_transient,
                              step_pinned=step_pinned, held_by_phase=held)
    required = min(required, reserved)  # what cannot be released is at most what is cached
    od: dict[str, int] = {}
    if overhead:
        od["cuda_context"] = int(overhead.get("cuda_context_bytes", 0))
        od["nccl"] = int(overhead.get("nccl_bytes", 0)) * n_comm
    else:
        notes.append("no hardware profile: CUDA context, NCCL buffers and cuBLAS workspaces are not included; no allocator slack")
    if stage == 3:
        notes.append(STAGE3_CACHE_NOTE)
    capped = release_under_pressure(reserved, required, sum(od.values()), gpu_memory_bytes)
    if capped != reserved:
        notes.append(f"the allocator's cache ({reserved / 2**30:.2f} GiB) would outgrow the card: PyTorch frees cached "
                     f"segments on a failed cudaMalloc and retries, so it fills the card and needs "
                     f"{required / 2**30:.2f} GiB it cannot release (core/allocator.py)")
    return allocated, capped, required, side, {"allocator": capped - allocated, **od}


def _finetune_param_bytes(ft: FineTuneViews, layout: Layout, trainable_bytes: int, b_p: int, stage: int) -> int:
    """Parameter bytes per GPU with frozen weights (core/finetune.py): stages 0–2 hold the frozen
    weights whole beside the trainable ones; stage 3 partitions all of them. Quantised weights are
    stored packed: ZeRO-3 partitions them as elements of ``bnb_4bit_quant_storage`` (which must be
    the model dtype), so their share is their packed bytes over N."""
    if stage < 3:
        return trainable_bytes + ft.frozen_storage_bytes
    whole = b_p * (layout.partition_3 + layout.persistent_padded)
    if ft.quantized_params:
        inv = ft.inventory
        quant_bytes = ft.frozen_storage_bytes - (inv.frozen_params - ft.quantized_params) * b_p
        whole -= (b_p * ft.quantized_params - quant_bytes) // layout.n
    return whole


def _finetune_note(ft: FineTuneViews, stage: int) -> str:
    inv = ft.inventory
    where = ("partitioned across the GPUs and gathered every micro-step" if stage == 3
             else "held whole on every GPU, with no gradient or optimizer state")
    return (f"{inv.method}: {inv.trainable_params:,} trainable of {inv.total_params:,} parameters "
            f"({100 * inv.trainable_fraction:.2f}%); frozen weights ({ft.frozen_storage_bytes / 1e9:.2f} GB) {where}")


def memory_for_stage(
    spec: ModelSpec,
    training: TrainingSetup,
    zero: ZeroConfig | None,
    n_gpus: int,
    *,
    gpus_per_node: int = 1,
    overhead: dict[str, Any] | None = None,
    layout: Layout | None = None,
    flavour: str = "deepspeed",
    finetune: FineTuneViews | None = None,
    train_layout: Layout | None = None,
    gpu_memory_bytes: int | None = None,
) -> MemoryBreakdown:
    """Per-GPU memory for ``zero.stage`` on ``n_gpus`` data-parallel GPUs.

    ``zero`` is a zeroplan.specs.deepspeed_config.ZeroConfig (None: DeepSpeed's defaults, stage 0).
    ``overhead`` = {"cuda_context_bytes", "nccl_bytes" (per communicator),
    "fragmentation_fraction"} from the hardware profile, or None (reported as 0, with a note).
    ``flavour``: "deepspeed" (what DeepSpeed 0.19.8 allocates) or "paper" (the ZeRO paper's
    accounting of model states; core/memory_states.py).
    ``finetune`` (core/finetune.py): frozen weights and adapters; ``layout`` then holds every
    parameter (what stage 3 partitions and gathers) and ``train_layout`` the trainable ones
    (gradients, optimizer states, buckets, offload).
    ``gpu_memory_bytes``: the card's memory; where the cache would outgrow it the allocator releases
    cached segments (core/allocator.py ``release_under_pressure``). None: the cache is not capped.
    """
    zero = zero_or_default(zero)
    stage = int(zero.stage)
    layout, tl = _layouts(spec, n_gpus, zero, layout, finetune, train_layout)
    off_opt, off_par = zero.optimizer_offload_device, zero.param_offload_device
    hooked = _hooked(training, zero, flavour)
    grad_stage = 2 if hooked else stage  # whose gradient life the buffers and the backward follow
    sp = state_plan(training, stage, offload=off_opt != "none", flavour=flavour, hooked=hooked)
    notes: list[str] = [sp.note] if sp.note else []
    params, grads_end, opt = model_state_bytes(tl, training, stage, offload=off_opt != "none", flavour=flavour,
                                               hooked=hooked)
    if finetune is not None:
        params = _finetune_param_bytes(finetune, layout, params, training.precision.param_bytes, stage)
        notes.append(_finetune_note(finetune, stage))
    model_states = params + grads_end + opt

    gpu_params, gpu_opt, gpu_grads_end = _on_gpu(params, opt, grads_end, sp.grad_bytes, tl, layout, training,
                                                 stage, off_opt, off_par)

    pb = phase_buffers(tl, training, zero, grad_stage, off_opt=off_opt, grad_bytes=sp.grad_bytes,
                       grad_end=gpu_grads_end, wrapper=sp.wrapper, gather_layout=layout,
                       cublas_workspace_bytes=int((overhead or {}).get("cublas_workspace_bytes", 0)))
    grads_fwd, step_grads = _grads_outside_backward(stage, sp.wrapper, training.grad_accum, gpu_grads_end, pb)

    act = activation_memory(spec, training, flavour=flavour)  # paper: Korthikanti; else the transformers trace
    host = host_memory(tl, training, zero, stage, off_opt=off_opt, off_par=off_par, gpus_per_node=gpus_per_node,
                       master_bytes=sp.master_bytes or 4, grad_bytes=sp.grad_bytes,
                       activation_host_bytes=act.host_checkpoints)
    step_pinned = grads_from_autograd(sp.wrapper, grad_stage)
    moments, fwd_moments = _moments(pb, layout, tl, zero, training, finetune, flavour, gpu_grads_end, step_pinned,
                                    hooked, sp.wrapper)
    phases = _phases(act, pb, moments, gpu_params, gpu_opt, grads_fwd, step_grads, fwd_moments)
    peak_phase = max(PHASES, key=lambda k_: phases[k_].peak)

    # ---- the caching allocator, CUDA context, NCCL (core/allocator.py) ----
    n_comm = communicators(zero, stage, n_gpus)
    allocated, reserved, required, side, od = _device_figures(phases, pb, training, overhead, n_comm,
                                                              gpu_memory_bytes, step_pinned, notes, stage)
    peak = reserved + od.get("cuda_context", 0) + od.get("nccl", 0)

    gp, gather = _peak_gather(pb, stage, peak_phase)
    cats = phases[peak_phase].by_category
    return MemoryBreakdown(
        params=gpu_params,
        gradients=gpu_grads_end,
        optimizer_states=gpu_opt,
        model_states=model_states if (off_opt == "none" and off_par == "none") else gpu_params + gpu_grads_end + gpu_opt,
        buffers=cats["buffers"],
        activations=cats["activations"],
        overhead=peak - allocated,
        allocated=allocated,
        reserved=reserved,
        required=required,
        peak=peak,
        peak_phase=peak_phase,
        peak_reason=_reason(phases, peak_phase, allocated, stage, gp, pb.detail, off_opt == "none"),
        phases=phases,
        buffers_detail=pb.detail,
        activations_detail=act,
        overhead_detail=od,
        gather=gather,
        host=host,
        communicators=n_comm,
        side_stream_bytes=side,
        optimizer_impl=training.optimizer_impl if off_opt == "none" else "cpu-adam",
        optimizer_wrapper=sp.wrapper,
        step_transient_bytes=pb.step_transient,
        held_bytes=held_bytes(phases, pb.held, step_pinned, pb.churned),
        backward_moments=moments,
        forward_moments=fwd_moments,
        gradients_churned=step_pinned,
        notes=notes,
    )


def _on_gpu(params: int, opt: int, grads_end: int, grad_bytes: int, tl: Layout, layout: Layout,
            training: TrainingSetup, stage: int, off_opt: str, off_par: str) -> tuple[int, int, int]:
    """What stays on the GPU under offload: (parameters, optimizer states, gradients at the end of
    backward). Optimizer offload moves the states and (stages 2-3) the gradient partition to the host;
    stage 1 keeps its reduced gradients on the GPU. Parameter offload keeps only persistent params."""
    gpu_params, gpu_opt, gpu_grads_end = params, opt, grads_end
    if off_opt != "none":
        gpu_opt = 0
        gpu_grads_end = grad_bytes * tl.params if stage == 1 else 0
    if off_par != "none":
        gpu_params = training.precision.param_bytes * layout.persistent_padded
    return gpu_params, gpu_opt, gpu_grads_end


def _peak_gather(pb: PhaseBuffers, stage: int, peak_phase: str) -> tuple[GatherPeak | None, GatherPeak | None]:
    """Stage 3's gathered parameters: those live in the peak phase (for the peak's reason) and the
    larger of the forward and backward gathers (reported)."""
    gp = pb.gather_forward if peak_phase == "forward" else pb.gather_backward if peak_phase == "backward" else None
    gathers = [g for g in (pb.gather_forward, pb.gather_backward) if g]
    gather = max(gathers, key=lambda g: g.total_bytes) if stage == 3 and gathers else None
    return gp, gather
