"""DeepSpeed's GPU buffers per phase: gradient buckets, flatten copies, stage-3 gathers and
prefetch, and the optimizer step's transients — each with the CUDA stream whose allocator pool
it comes from (core/allocator.py).

Element counts come from core/layout.py; bytes are ints. The ZeRO settings are read from the
typed ``ZeroConfig`` (specs/ds_schema.py holds DeepSpeed's defaults, once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pydantic import BaseModel

from zeroplan.core.comm import STAGE0_BUCKET
from zeroplan.core.cublas_workspace import CUBLAS_HANDLES_PER_STEP
from zeroplan.core.grad_buckets import bucket_sizes, stage0_flatten_elements, stage3_flush_temp_elements
from zeroplan.core.layout import Layout
from zeroplan.core.stage3_schedule import Stage3Schedule, stage3_schedule
from zeroplan.core.memory_states import optimizer_temp_bytes
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.training import TrainingSetup

__all__ = ["GatherPeak", "PHASES", "PhaseBuffers", "phase_buffers"]

PHASES = ("forward", "backward", "step")  # the phases every buffer figure is given for (PhaseBuffers' fields)


class GatherPeak(BaseModel):
    """Stage 3: what sets the gathered-parameter peak."""

    module: str
    module_bytes: int  # the module's gathered parameters
    transient_bytes: int  # incl. the ~2× of a coalesced multi-parameter gather
    kept_bytes: int  # modules kept gathered for reuse at that moment
    prefetch_bytes: int  # up to two prefetches in flight beside the module in use
    total_bytes: int
    phase: str


@dataclass
class PhaseBuffers:
    """Buffer bytes live per phase (default stream + side streams), and the named buffers."""

    forward: int = 0
    backward: int = 0
    step: int = 0
    detail: dict[str, int] = field(default_factory=dict)
    # side-stream pools: pool -> phase -> bytes (already included in the phase totals above)
    side: dict[str, dict[str, int]] = field(default_factory=dict)
    gather_forward: GatherPeak | None = None
    gather_backward: GatherPeak | None = None
    step_grads: int | None = None  # gradient bytes live at the step (None: the end-of-backward gradients)
    step_transient: int = 0  # the step's large new blocks (fp32 casts, flat copies, optimizer temporaries)
    # per phase, the buffer bytes whose segments fit them exactly (core/allocator.py): allocated once and
    # held (ipg buckets, the hpZ secondary partition), or re-requested at their own size every step
    # (the step's transients: best fit hands back the block they freed). Included in the totals above.
    held: dict[str, int] = field(default_factory=dict)
    # per phase, gradient bytes autograd holds before DeepSpeed's hooks take them (core/backward_moments.py
    # autograd): counted as gradients, but churned with the activations, never held
    churned: dict[str, int] = field(default_factory=dict)
    ipg_through_forward: bool = False  # stage 1 over several micro-steps: the bucket outlives each backward


def _prefetch(sizes: list[int], j: int, room: int) -> int:
    """Elements of the next two fetches after position j, within ``room`` (max_live_parameters)."""
    ahead = sum(sizes[j + 1:j + 3])
    return max(0, min(ahead, room))


def stage3_gather(layout: Layout, sched: Stage3Schedule, b_p: int, max_live: int) -> tuple[GatherPeak | None, GatherPeak | None]:
    """Forward and backward gathered-parameter peaks (bytes), with prefetch in flight.

    The coordinator (runtime/zero/partitioned_param_coordinator.py ``fetch_sub_module``) keeps
    prefetching the next parameters of the trace while ``numel_prefetching`` is below
    min(``max_live_parameters`` - available, ``prefetch_bucket_size``): the fetch issued at the
    previous module and the one issued now can both be in flight beside the module in use.
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
    sizes = [c[0] for c in sched.forward_chunks]
    frac_kept = kept_total / max(1, sum(sizes))
    best_f = None
    done = 0
    for j, (size, n, label) in enumerate(sched.forward_chunks):
        t = size * (2 if n > 1 else 1)
        kept = int(done * frac_kept)
        pre = _prefetch(sizes, j, max_live - kept - size)
        total = kept + t + pre
        if best_f is None or total * b_p > best_f.total_bytes:
            best_f = GatherPeak(module=label, module_bytes=size * b_p, transient_bytes=t * b_p, kept_bytes=kept * b_p,
                                prefetch_bytes=pre * b_p, total_bytes=total * b_p, phase="forward")
        done += size
    best_b = None
    held = kept_total
    order = [(m, again) for m, again in reversed(list(zip(layout.modules, sched.regather))) if m.gathered]
    regather_sizes = [m.gathered if again else 0 for m, again in order]
    for j, (m, again) in enumerate(order):
        cur = m.gathered * (2 if m.n_gathered > 1 else 1) if again else 0
        pre = _prefetch(regather_sizes, j, max_live - held - cur) if again else 0
        total = held + cur + pre
        if best_b is None or total * b_p > best_b.total_bytes:
            best_b = GatherPeak(module=m.name, module_bytes=m.gathered * b_p, transient_bytes=cur * b_p,
                                kept_bytes=held * b_p, prefetch_bytes=pre * b_p, total_bytes=total * b_p, phase="backward")
        if not again:
            held -= m.gathered
    return best_f, best_b


def _stage3(pb: PhaseBuffers, layout: Layout, zero: ZeroConfig, b_g: int, b_c: int, b_p: int, contiguous: bool,
            gather_layout: Layout) -> None:
    rbs = int(zero.reduce_bucket_size)
    d = pb.detail
    if contiguous:
        d["ipg_bucket"] = b_g * rbs
    # stage3.py __reduce_and_partition_ipg_grads: reduce-scatter outputs on reduce_and_partition_stream
    if contiguous and not zero.reduce_scatter:
        # a bucket that fits is all-reduced in place, then post-scaled into a copy; only a lone oversized
        # gradient is still reduce-scattered (core/grad_buckets.py): the largest of those copies
        d["reduce_scatter_temp"] = b_c * max(
            (stage3_flush_temp_elements(sizes, layout.n, rbs, reduce_scatter=False, contiguous=True)
             for sizes in bucket_sizes(layout, rbs)), default=0)
    else:
        d["reduce_scatter_temp"] = b_c * min(rbs, layout.padded_total_3)
    max_live = int(zero.max_live_parameters)
    # frozen parameters are partitioned and gathered like any other (core/finetune.py); kept on the
    # layout (never mutated) per knob setting: recommend's search plans one layout at many points
    key = ("stage3_gather", max_live, int(zero.prefetch_bucket_size), int(zero.max_reuse_distance), b_p)
    if key not in gather_layout._memo:
        sched = stage3_schedule(gather_layout, max_live=max_live, prefetch_bucket=key[2], max_reuse=key[3])
        gather_layout._memo[key] = stage3_gather(gather_layout, sched, b_p, max_live)
    gf, gb = gather_layout._memo[key]
    pb.gather_forward, pb.gather_backward = gf, gb
    if gf:
        d["gathered_params_forward"] = gf.total_bytes
    if gb:
        d["gathered_params_backward"] = gb.total_bytes
    persistent = d.get("ipg_bucket", 0) + d.get("hpz_secondary_partition", 0)
    g_f = gf.total_bytes if gf else 0
    g_b = gb.total_bytes if gb else 0
    pb.forward += persistent + g_f
    pb.backward += persistent + d["reduce_scatter_temp"] + g_b
    pb.step += persistent
    # stage3.py __init__ allocates the ipg bucket's flat buffer once (contiguous gradients)
    pb.held = {"forward": persistent, "backward": persistent, "step": persistent}
    pb.side["allgather"] = {"forward": g_f, "backward": g_b}
    pb.side["reduce_scatter"] = {"backward": d["reduce_scatter_temp"]}


def _bf16_optimizer(pb: PhaseBuffers, layout: Layout, b_c: int) -> None:
    """BF16_Optimizer (ZeRO-1 in bf16 with fp32 gradient accumulation; memory_states.py): no gradient bucket.
    After the backward its epilogue adds autograd's bf16 gradients into the whole-model fp32 gradient buffer,
    and the engine all-reduces that buffer (engine.py ``buffered_allreduce_fallback`` with the optimizer's
    ``get_grads_for_reduction``): one tensor, so ``allreduce_bucket``'s flatten is a view, but it is cast to
    the communication dtype (bf16 unless the config says otherwise), a copy of the whole buffer, while the
    bf16 gradients are still held. Measured on real DeepSpeed 0.19.8
    (examples/validation/cpu-replay/peak-live-bf16opt-stage1-b1-s512.json)."""
    if b_c != 4:
        pb.detail["allreduce_flatten"] = b_c * layout.flat_padded
        pb.backward += pb.detail["allreduce_flatten"]


def _stage12(pb: PhaseBuffers, layout: Layout, zero: ZeroConfig, training: TrainingSetup, stage: int, b_g: int, b_c: int,
             contiguous: bool, off_opt: str) -> None:
    rbs = int(zero.reduce_bucket_size)
    overlap = bool(zero.overlap_comm)
    d = pb.detail
    if contiguous:
        # stage_1_and_2.py setup_buckets: one bucket, two with overlap_comm (buf_0, buf_1)
        d["ipg_bucket"] = b_g * rbs * (2 if overlap else 1)
        pb.backward += d["ipg_bucket"]
        pb.held["backward"] = d["ipg_bucket"]  # allocated at the first backward, kept (ipg_buffer)
        if stage == 1 and training.grad_accum > 1 and off_opt == "none":
            # allocated at the first micro-step's first gradient hook and released by the epilogue, which
            # stage 1 runs at the boundary only (engine.py allreduce_gradients): live through the later
            # micro-steps' forwards (measured: peak-live-stage1-gas2-forward-b1-s512.json)
            pb.forward += d["ipg_bucket"]
            pb.held["forward"] = pb.held.get("forward", 0) + d["ipg_bucket"]
            pb.ipg_through_forward = True
    d["allreduce_flatten"] = b_c * _flatten_copy_12(layout, zero, stage, contiguous)
    pb.backward += d["allreduce_flatten"]
    if overlap:  # reduce_ipg_grads runs the reduction on reduction_stream
        pb.side["reduction"] = {"backward": d["allreduce_flatten"]}
    if off_opt != "none":
        pb.backward += d.get("offload_gpu_temp_grad", 0)
    elif contiguous and stage == 2:
        # copy_grads_in_partition: grads_in_partition spans the WHOLE params overlapping the
        # rank's slice; the .grad of those params is re-pointed into it (the originals freed).
        # (Stage 1 keeps the full gradients until the step, so the buffer adds nothing there.)
        extra = b_g * (layout.grad_partition_12_max - layout.partition_12)
        if extra:
            d["gradient_partition_whole_params"] = extra
            pb.backward += extra
            if training.grad_accum > 1:
                pb.forward += extra


def _flatten_copy_12(layout: Layout, zero: ZeroConfig, stage: int, contiguous: bool) -> int:
    """Elements of the largest flatten copy a stage-1/2 bucket reduction makes. Contiguous gradients go
    through ``average_tensor``: only a bucket spanning two owners' partitions (or a lone oversized
    gradient cut into several pieces) is copied (``Layout.flatten_copy_12``), and nothing is copied with
    ``reduce_scatter`` off (``gradient_reduction_w_predivide`` all-reduces the bucket in place) or
    without the multi-rank all-reduce (each owner's merged piece is reduced in place). Without
    contiguous gradients ``buffered_reduce_fallback`` flattens the bucket's gradients whatever their
    owners."""
    rbs = int(zero.reduce_bucket_size)
    if not contiguous:
        return min(rbs, layout.params)
    if not (zero.reduce_scatter and zero.use_multi_rank_bucket_allreduce):
        return 0
    # the order the buckets fill: the hooks' (stage 2, overlap_comm), or parameter order after the
    # backward (stage 1's reduce_gradients)
    order = "forward" if stage == 1 and not zero.overlap_comm else "reverse"
    return max((layout.flatten_copy_12(lo, hi, rbs) for lo, hi in layout.bucket_ranges_12(rbs, order)), default=0)


def _step(pb: PhaseBuffers, layout: Layout, zero: ZeroConfig, training: TrainingSetup, stage: int, b_g: int, grad_end: int,
          wrapper: str) -> None:
    """The optimizer step's transients (no optimizer offload); sets ``pb.step_grads``.

    Stages 1/2 (stage_1_and_2.py ``step``): the gradient norm casts each gradient tensor of the
    partition to fp64 in turn (``get_grad_norm_direct``); gradients outside the partition are freed, the
    partition's gradients are flattened (a b_g copy) and cast to fp32 (``single_grad_partition``);
    the flat copy is deleted and the 16-bit gradients freed *before* ``_optimizer_step`` — so the
    optimizer's temporaries never coexist with the 16-bit gradients. BF16_Optimizer keeps its
    whole-model fp32 gradients through the step (bf16_optimizer.py ``step``). Stage 3 (stage3.py
    ``_prepare_fp32_grad_for_sub_group``) casts per sub-group while the gradient partition buffer
    stays allocated. Stage 0 (FP16_Optimizer ``step``) casts every gradient into one fp32 flat
    gradient (the casts and the flat copy coexist); FP16_UnfusedOptimizer casts each into its fp32
    copy's ``.grad`` and keeps the 16-bit gradients through the step; fp32 without ZeRO steps the
    parameters' own gradients in place.
    """
    d = pb.detail
    if stage == 3:
        group = max(layout.sub_groups_3(int(zero.sub_group_size)))
    elif stage in (1, 2):
        group = layout.partition_12
    else:
        group = layout.params
    largest = group if stage >= 1 else layout.largest_tensor
    temps = optimizer_temp_bytes(training, group, largest)
    cast = (b_g + 4) * group if b_g != 4 else 4 * group  # flatten copy + fp32 cast (.to is a no-op on fp32)
    d["optimizer_temp"] = temps
    if stage in (1, 2) and wrapper != "bf16_optimizer":
        pb.step_grads = b_g * layout.grad_partition_12_max  # grads_in_partition, live through the cast
        d["step_fp32_grad"] = cast
        # scaled_global_norm first: each gradient tensor of the partition cast to fp64 in turn, beside the
        # gradient partition (Layout.step_norm_peak_12; cpu_offload takes another path)
        norm = layout.step_norm_peak_12(b_g, 8) - pb.step_grads if zero.compute_grad_norm else 0
        d["step_grad_norm_fp64"] = max(0, norm)
        pb.step_transient = max(cast, 4 * group + temps - pb.step_grads, norm)
    elif stage == 3:
        pb.step_grads = grad_end
        d["step_fp32_grad"] = cast
        pb.step_transient = max(cast, 4 * group + temps)
    elif wrapper == "bf16_optimizer":
        # bf16_optimizer.py step: the inner optimizer steps the fp32 master partition, whose gradients are views
        # of the whole-model fp32 buffer (no cast); autograd's bf16 gradients are still held until zero_grad
        # after the step. Measured on real DeepSpeed 0.19.8 (peak_live.py ... --phase step): the step's peak is
        # the model states and those bf16 gradients, 4 KB over the plan
        pb.step_grads = grad_end
        d["step_fp32_grad"] = 0
        d["step_lp_grads"] = training.precision.param_bytes * layout.params
        pb.step_transient = d["step_lp_grads"] + temps
    elif stage == 0 and wrapper == "fp16_unfused_optimizer":
        # fp16/unfused_optimizer.py FP16_UnfusedOptimizer.step: fp32_param.grad = fp16_param.grad.to(fp32) for
        # every parameter, then the inner optimizer's step; the 16-bit gradients stay until zero_grad.
        # Measured on real DeepSpeed 0.19.8 (examples/validation/cpu-replay/peak-live-stage0-*.json): the
        # step's peak is the 16-bit gradients beside every fp32 one
        pb.step_grads = grad_end
        d["step_fp32_grad"] = 4 * group
        pb.step_transient = 4 * group + temps
    elif stage == 0 and training.precision.mixed:
        # fp16/fused_optimizer.py FP16_Optimizer.step: _flatten_dense_tensors([p.grad.to(fp32) ...]):
        # the per-parameter fp32 casts and the flat copy coexist beside the 16-bit gradients,
        # which are freed (p.grad = None) before the inner optimizer steps
        pb.step_grads = grad_end
        d["step_fp32_grad"] = 8 * group
        pb.step_transient = max(8 * group, 4 * group + temps - grad_end)
    else:
        # no wrapper (fp32 without ZeRO): the optimizer steps the parameters' own gradients
        pb.step_grads = grad_end
        d["step_fp32_grad"] = 0
        pb.step_transient = temps
    pb.step += pb.step_transient
    pb.held["step"] = pb.held.get("step", 0) + pb.step_transient


def phase_buffers(layout: Layout, training: TrainingSetup, zero: ZeroConfig, stage: int, *, off_opt: str, grad_bytes: int,
                  grad_end: int, wrapper: str, gather_layout: Layout | None = None,
                  cublas_workspace_bytes: int = 0) -> PhaseBuffers:
    """Every DeepSpeed buffer per phase for one stage (gradients and states excluded), and torch's
    cuBLAS workspaces (``cublas_workspace_bytes`` per handle and stream: core/cublas_workspace.py).

    ``layout`` holds the trainable parameters (buckets, the step); ``gather_layout`` every
    parameter stage 3 partitions and gathers (the same layout unless some weights are frozen).
    """
    gather_layout = layout if gather_layout is None else gather_layout
    prec = training.precision
    b_p, b_c = prec.param_bytes, prec.comm_bytes
    b_g = grad_bytes
    contiguous = bool(zero.contiguous_gradients) or off_opt != "none"
    pb = PhaseBuffers()
    hpz = max(1, int(zero.zero_hpz_partition_size))
    if stage == 3 and hpz > 1:  # ZeRO++ hpZ secondary partition: +b_p·Ψ/k per GPU
        # the group is min(hpz, world) ranks (DeepSpeed 0.19.8 utils/groups.py::_create_zero_param_parallel_group)
        pb.detail["hpz_secondary_partition"] = b_p * (gather_layout.padded_total_3 // min(hpz, gather_layout.n))
    if off_opt != "none" and stage in (1, 2):
        pb.detail["offload_gpu_temp_grad"] = b_g * layout.largest_tensor
    if stage == 0:
        # stage 0 buckets are DeepSpeed's constant 5e8 elements, not reduce_bucket_size, and a bucket is
        # flushed once it has gone over (engine.py allreduce_no_retain: add, then flush when numel >
        # numel_per_bucket), so the largest flatten copy can exceed 5e8 elements by a tensor: measured on
        # real DeepSpeed 0.19.8 (examples/validation/cpu-replay/peak-live-stage0-*.json), 535,838,720
        pb.detail["allreduce_flatten"] = b_c * stage0_flatten_elements(layout, STAGE0_BUCKET)
        pb.backward += pb.detail["allreduce_flatten"]
    elif wrapper == "bf16_optimizer":
        _bf16_optimizer(pb, layout, b_c)
    elif stage in (1, 2):
        _stage12(pb, layout, zero, training, stage, b_g, b_c, contiguous, off_opt)
    else:
        _stage3(pb, layout, zero, b_g, b_c, b_p, contiguous, gather_layout)
    if off_opt == "none":
        _step(pb, layout, zero, training, stage, b_g, grad_end, wrapper)
    _cublas(pb, cublas_workspace_bytes * CUBLAS_HANDLES_PER_STEP)
    return pb


def _cublas(pb: PhaseBuffers, ws: int) -> None:
    """One workspace per GEMM-running thread, allocated in the caching allocator at the first step and held
    in every phase after it (torch CublasHandlePool.cpp ``setWorkspaceForHandle``)."""
    if not ws:
        return
    pb.detail["cublas_workspaces"] = ws
    for p in PHASES:
        setattr(pb, p, getattr(pb, p) + ws)
        pb.held[p] = pb.held.get(p, 0) + ws
