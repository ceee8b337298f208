"""A compact, faithful ZeRO engine (stages 0-3) on an ``InstrumentedComm``.

It executes exactly the collective schedule of the ledger (/work/briefs/ledger.md, revision 2,
measured on DeepSpeed 0.19.8; predicted by ``zeroplan.core.comm``) for both flavours, and keeps
the buffers DeepSpeed keeps (deepspeed-internals.md §4), tagged by category for
``zeroplan.runtime.memory``.

Notation: Ψ parameters in the model's tensor order (forward order), N ranks, b bytes of the
model dtype (= gradient and communication dtype), g micro-steps per optimizer step.

- Every stage keeps an fp32 master copy — also in fp32 training (4/4/12 bytes per parameter,
  the planner's 20-byte baseline; DeepSpeed's stage 0 in fp32 has no separate master) — and
  AdamW m, v in fp32: ``optimizer_states`` = 12 bytes per owned element (stage 0: Ψ; stages
  1-2: Ψ₁₂/N; stage 3: Σ⌈numel/N⌉).
- stage 0: flat Ψ-element params; autograd's own per-parameter gradients, from the backward that
  reaches each until the step's ``zero_grad``. At the boundary the gradients are all-reduced in
  DeepSpeed's stage-0 buckets: forward order, a constant 5e8 elements, flushed after adding once
  over (``paper``: reduce_bucket_size, reverse order, flushed before overflowing); each bucket is
  flattened (a bucket-sized copy; a lone tensor is reduced in place). The step casts them into one
  fp32 vector (bf16/fp16: beside the 16-bit gradients, as FP16_UnfusedOptimizer around a client
  optimizer; under the ``deepspeed-cuda`` mimic as FP16_Optimizer around FusedAdam, every cast and their
  flat copy at once, then the 16-bit gradients dropped). fp32: one 4-byte norm all-reduce after the step.
- stages 1-2: one flat bit16 buffer padded to Ψ₁₂ = ⌈Ψ/2N⌉·2N; rank r owns
  [r·Ψ₁₂/N, (r+1)·Ψ₁₂/N). Buckets of ``reduce_bucket_size`` elements, flushed before
  overflowing, in forward order for stage 1 without ``overlap_comm`` and gradient-ready order
  otherwise. Gradients are copied into the ``ipg`` buffer (two with ``overlap_comm``: double
  buffering, async all-reduce) as they arrive; each bucket is sliced at owner-partition
  boundaries and the slices are packed (flush after adding once over ``reduce_bucket_size``)
  into all-reduces, of a flatten copy where a group has two or more slices (one is reduced in
  place, as torch's ``flatten_dense_tensors`` returns a lone tensor as a view); a lone gradient
  larger than the bucket skips the ipg buffer and is reduced where autograd left it; with
  ``use_multi_rank_bucket_allreduce=false`` each slice is ``reduce``d to its owner. Stage 1
  keeps autograd's per-parameter gradients to the boundary (with ``contiguous_gradients``; one flat
  Ψ₁₂ buffer without) and reduces once there, after the backward or, with ``overlap_comm``, in the
  boundary micro-step's hooks as stage 2 (measured against DeepSpeed 0.19.8 on CPU:
  tests/test_stage1_hooks.py); stage 2 reduces every
  micro-step from post-accumulate-grad hooks (a full bucket in the hook of the gradient that
  overflows it, the last after the backward) and keeps only its Ψ₁₂/N partition. After the step: one in-place all-gather of the flat buffer, the
  1-byte overflow flag (bf16/fp16 only) and the 4-byte norm.
- stage 3: every parameter is partitioned on its own, padded to p̂ = ⌈numel/N⌉·N; rank r keeps
  its p̂/N slice (``params``), an equal bit16 gradient partition (``gradients``, persistent)
  and the fp32 states. Parameters with numel <= ``param_persistence_threshold`` (within
  ``model_persistence_threshold``) are also kept whole, stored padded to p̂. Forward
  all-gathers follow DeepSpeed's prefetch: with bound = min(max_live_parameters,
  prefetch_bucket_size) > Σ non-persistent numel, ONE gather of everything; else chunks of
  consecutive params closed once their unpadded numel reaches the bound (bound 0: one per
  module). A module's params are released after its last forward use iff it is re-gathered
  in backward: D(i) = 2·Σ numel of later modules >= ``max_reuse_distance`` (``paper``: every
  module, one gather per module). A custom autograd node on the module's output re-gathers a
  released module (one call, Σp̂) before its backward; the module is released again once all
  its gradients are reduced. A coalesced gather makes one flat buffer then one copy per
  param (the ~2x transient); a single param is a view into its padded buffer. Gradient buckets
  are cut on the unpadded sizes; each gradient is copied, unpadded, into the persistent ``ipg``
  bucket as it arrives (a lone gradient larger than the bucket stays autograd's), then the bucket
  is reduce-scattered as ``reduce_scatter_coalesced`` does it (padded, interleaved per rank in one
  copy, none for a lone gradient that divides evenly; in place) or, with ``reduce_scatter`` off, a
  bucket in the ipg buffer is all-reduced there in place and post-scaled into a copy (on N > 1). A bucket
  is reduced in the hook of the gradient that would overflow it, the last one after the backward. After the step: one all-gather per
  persistent param, in place, and the norm all-reduce (8-byte fp64; 4-byte fp32 with offload).
- Frozen parameters (``requires_grad`` False; runtime/lora.py): stages 0-2 leave them whole on
  every rank, outside the flat buffers, buckets and optimizer; stage 3 partitions and gathers
  them (their own flat partition buffer) and re-gathers the persistent ones after the step, but
  gives them no gradient partition, bucket slot or optimizer state. A module whose output needs
  no gradient gets no pre-backward node, so it is never re-gathered in backward (as DeepSpeed).
- Bucketing always follows the ledger's canonical order whatever order autograd produces
  gradients in (a ready-pointer walks the canonical order).
- ``paper`` flavour, stages 1-2: gradients are reduce-scattered in partition-aligned buckets:
  each rank's partition is cut into chunks of c = max(1, ⌊reduce_bucket_size/N⌋) elements and
  bucket k holds chunk k of every rank (N·c elements, the last one shorter): ⌈(Ψ₁₂/N)/c⌉
  calls per reduction, Σ = Ψ₁₂ elements. A reduce-scatter needs equal per-rank chunks, so the
  greedy tensor buckets of ``core.comm``'s paper flavour cannot be executed as such.
- The step, DeepSpeed's flavour of stages 1-2 with contiguous gradients (stage_1_and_2.py ``step``):
  the norm first, each gradient tensor of the partition cast to fp64 in turn; then the bit16 flatten
  copy and its fp32 cast, the flat copy deleted and the gradient partition freed before AdamW (measured
  against DeepSpeed on CPU: tests/test_step_norm.py). Otherwise, per optimizer group (stage 3:
  ``sub_group_size`` sub-groups; else the partition) a
  bit16 flatten copy of the gradient partition, its fp32 copy (mixed precision) and one fp32
  AdamW temporary (the denominator) are live, then the bit16 values are written back.
  ``offload_optimizer`` keeps the fp32 master, m, v, the fp32 gradient and (stages 2-3) the
  bit16 gradient partition on the host (pinned on CUDA; host memory, not device memory) and
  runs AdamW there, on CPU and CUDA alike.
- ``mimic`` chooses whose allocations the engine reproduces. ``"planner"`` (the default on
  CPU) keeps the accounting above, which is also the planner's. ``"deepspeed-cuda"`` (the
  default on a CUDA device) does what DeepSpeed 0.19.8 does on CUDA, so that comparing the
  engine with the planner is not circular:
  * the optimizer is FusedAdam (``deepspeed/ops/adam/fused_adam.py``: ``multi_tensor_adam``
    updates in chunks of 2048·32 elements in registers): no step temporary of the group's
    size; the emulation here applies AdamW chunk by chunk (``FUSED_ADAM_CHUNK`` elements);
  * ``DeepSpeedZeroOptimizer.step`` (stage_1_and_2.py) flattens the gradient partition,
    converts it to fp32 and deletes the bit16 flat copy BEFORE ``_optimizer_step``.
  Stage 1's per-parameter gradients are DeepSpeed's with either mimic (DeepSpeed keeps them on CPU
  too): ``reduce_independent_p_g_buckets_and_remove_grads`` copies each into the ipg bucket and
  re-points ``.grad`` into it (the full-size gradient is freed), and ``reduce_ipg_grads`` ->
  ``copy_grads_in_partition`` copies the owned slices into ``grads_in_partition`` (sized by the whole
  params overlapping the partition); ``step`` frees the gradients outside the partition
  (``free_grad_in_param_list``) before flattening.
- Not implemented: stage-3 param offload (``offload_param``), prefetch *ahead* of use (chunks
  are gathered on demand; the bytes and calls are DeepSpeed's), ZeRO++ (qwZ/hpZ/qgZ), fp16
  loss scaling (fp16 runs unscaled), gradient clipping.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

from zeroplan.runtime.engine_flat import Stage0Strategy
from zeroplan.runtime.engine_frozen import split_frozen
from zeroplan.runtime.engine_gather import _LazyFunction, _make_pre_backward, _PreBackward  # noqa: F401
from zeroplan.runtime.engine_stage3 import Stage3Strategy
from zeroplan.runtime.engine_stage12 import Stage1Strategy, Stage2Strategy
from zeroplan.runtime.engine_strategy import StageStrategy
from zeroplan.runtime.engine_util import (  # noqa: F401 - re-exported: zeroplan.runtime.engine keeps its names
    FUSED_ADAM_CHUNK, MIMICS, STAGE0_BUCKET_ELEMS, StepResult, _scalar, ceil_div, grad_span, greedy_buckets,
    greedy_buckets_after, resolve_mimic)
from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default

__all__ = ["ZeroEngine", "StepResult", "ceil_div", "greedy_buckets", "grad_span", "MIMICS", "FUSED_ADAM_CHUNK",
           "resolve_mimic", "STRATEGIES", "StageStrategy"]

# the stage family's implementation, chosen once in ZeroEngine.__init__ (engine_strategy.py: the interface)
STRATEGIES: dict[int, type[StageStrategy]] = {
    0: Stage0Strategy, 1: Stage1Strategy, 2: Stage2Strategy, 3: Stage3Strategy}


class ZeroEngine:
    """ZeRO stages 0-3 over ``model`` (parameters in forward order), collectives through ``comm``.

    ``zero``: a ``zeroplan.specs.ds_schema.ZeroConfig``, or None for DeepSpeed's defaults
    (``zero_or_default``: each default is written once, in the schema). ``meter``: a
    ``zeroplan.runtime.memory`` meter (tags + phases) or None.

    The configuration every stage shares is resolved here once; the stage's buffers and schedule live
    in ``self.strategy`` (``STRATEGIES[stage]``, interface ``engine_strategy.StageStrategy``), which
    the training step calls without branching on the stage.
    """

    def __init__(self, model: Any, zero: ZeroConfig | None, *, precision: str = "fp32", optimizer: str = "adamw",
                 comm: Any, grad_accum: int = 1, comm_model: str = "deepspeed",
                 offload_optimizer: bool | None = None, meter: Any = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 mimic: str = "auto") -> None:
        import torch

        from zeroplan.runtime.memory import NullMeter
        from zeroplan.runtime.model import param_units

        if comm_model not in ("deepspeed", "paper"):
            raise ValueError(f"comm_model {comm_model!r}: expected 'deepspeed' or 'paper'")
        if str(optimizer).lower() not in ("adamw", "adam"):
            raise ValueError(f"optimizer {optimizer!r}: the bundled engine implements AdamW only")
        self.torch = torch
        self.model = model
        self.zero = zero = zero_or_default(zero)
        self.comm = comm
        self.meter = meter if meter is not None else NullMeter()
        self.stage = zero.stage
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage {self.stage}: expected 0..3")
        self.flavour = comm_model
        self.ds = comm_model == "deepspeed"
        self.grad_accum = int(grad_accum)
        self.precision = precision
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.n = comm.world_size
        self.rank = comm.rank
        self.rbs = max(1, zero.reduce_bucket_size)
        self.overlap = zero.overlap_comm
        if offload_optimizer is None:
            offload_optimizer = zero.offload_optimizer.device != "none"
        self.offload = bool(offload_optimizer) and self.stage >= 1
        self.contiguous = zero.contiguous_gradients or self.offload
        self.reduce_scatter_cfg = zero.reduce_scatter
        self.multi_rank = zero.use_multi_rank_bucket_allreduce or not self.reduce_scatter_cfg
        self.mixed = precision != "fp32"
        self.step_count = 0
        self.micro_step = 0

        units = param_units(model)
        self.units = units
        self.params: list[Any]
        self.names: list[str]
        self.params, self.names, self.frozen = split_frozen(
            [p for _, _, ps in units for _, p in ps], [n for _, _, ps in units for n, _ in ps], self.stage)
        for p in self.params:
            if p.dtype != self.dtype:
                raise ValueError(f"parameter dtype {p.dtype} does not match precision {precision}")
        self.device = self.params[0].device
        self.mimic = resolve_mimic(mimic, self.device.type)
        self.fused_adam = self.mimic == "deepspeed-cuda"
        self.host = torch.device("cpu")
        self.numels = [p.numel() for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.psi = sum(self.numels)
        self._opt_dev = self.host if self.offload else self.device
        self._hooks: list[Any] = []
        self.strategy: StageStrategy = STRATEGIES[self.stage](self)

    def train_step(self, batches: Iterable[Any]) -> StepResult:
        """One optimizer step over grad_accum micro-batches of input ids.

        ``batches`` may be a list or a generator. A generator makes each micro-batch when it is
        needed, as a training loop does (DeepSpeed's ``for micro: engine(ids)``): the previous
        micro-batch's ids are then released when the next are made, not held for the whole step.
        """
        if isinstance(batches, Sized) and len(batches) != self.grad_accum:
            raise ValueError(f"train_step: got {len(batches)} micro-batches, grad_accum is {self.grad_accum}")
        strategy = self.strategy
        total_loss = 0.0
        count = 0
        for mb in batches:
            count += 1
            if count > self.grad_accum:
                raise ValueError(f"train_step: got more than {self.grad_accum} micro-batches (grad_accum)")
            self._phase("forward")
            strategy.before_forward()
            loss = self.model(mb)
            self._phase("backward")
            strategy.before_backward()
            (loss / self.grad_accum).backward()
            total_loss += _scalar(loss)
            del loss
            strategy.after_backward()
            self.micro_step += 1
        if count != self.grad_accum:
            raise ValueError(f"train_step: got {count} micro-batches, grad_accum is {self.grad_accum}")
        strategy.boundary()
        self._phase("step")
        states = self._model_state_snapshot()
        with self.torch.no_grad():
            strategy.step()
        self.step_count += 1
        self._phase("forward")
        return StepResult(loss=total_loss / count, model_states=states)

    def _phase(self, name: str) -> None:
        """The phase the meter's peaks and the comm's records are attributed to."""
        self.meter.phase = name
        self.comm.phase = name

    def _model_state_snapshot(self) -> dict[str, int]:
        cur = self.meter.current_by_category()
        out = {k: cur.get(k, 0) for k in ("params", "gradients", "optimizer_states")}
        out["gradients"] = max(out["gradients"], self.strategy.accumulated_grad_bytes())
        return out

    def close(self) -> None:
        """Remove the hooks the engine installed on the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
