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
- stage 0: flat Ψ-element params and gradients (gradients from the first backward of a step
  until after the step). At the boundary the gradients are all-reduced in DeepSpeed's
  stage-0 buckets: forward order, a constant 5e8 elements, flushed after adding once over
  (``paper``: reduce_bucket_size, reverse order, flushed before overflowing); each bucket is
  flattened (a bucket-sized copy). fp32: one 4-byte norm all-reduce after the step.
- stages 1-2: one flat bit16 buffer padded to Ψ₁₂ = ⌈Ψ/2N⌉·2N; rank r owns
  [r·Ψ₁₂/N, (r+1)·Ψ₁₂/N). Buckets of ``reduce_bucket_size`` elements, flushed before
  overflowing, in forward order for stage 1 without ``overlap_comm`` and gradient-ready order
  otherwise. Gradients are copied into the ``ipg`` buffer (two with ``overlap_comm``: double
  buffering, async all-reduce) as they arrive; each bucket is sliced at owner-partition
  boundaries and the slices are packed (flush after adding once over ``reduce_bucket_size``)
  into all-reduces of a flatten copy; with ``use_multi_rank_bucket_allreduce=false`` each slice
  is ``reduce``d to its owner. Stage 1 keeps full flat gradients (Ψ₁₂) and reduces once at the
  boundary; stage 2 reduces every micro-step from post-accumulate-grad hooks and keeps only
  its Ψ₁₂/N partition. After the step: one in-place all-gather of the flat buffer, the
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
  param (the ~2x transient); a single param is a view into its padded buffer. Gradients are
  copied into the persistent ``ipg`` bucket (p̂ per param) as they arrive, interleaved per rank
  into a bucket-sized copy and reduce-scattered. After the step: one all-gather per
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
- The step: per optimizer group (stage 3: ``sub_group_size`` sub-groups; else the partition) a
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
    converts it to fp32 and deletes the bit16 flat copy BEFORE ``_optimizer_step``;
  * stage 1 with ``contiguous_gradients`` keeps per-parameter gradients until the boundary;
    ``reduce_independent_p_g_buckets_and_remove_grads`` copies each into the ipg bucket and
    re-points ``.grad`` into it (the full-size gradient is freed), and ``reduce_ipg_grads`` ->
    ``copy_grads_in_partition`` copies the owned slices into ``grads_in_partition`` (sized by
    the whole params overlapping the partition); ``step`` frees the gradients outside the
    partition (``free_grad_in_param_list``) before flattening.
- Not implemented: stage-3 param offload (``offload_param``), prefetch *ahead* of use (chunks
  are gathered on demand; the bytes and calls are DeepSpeed's), ZeRO++ (qwZ/hpZ/qgZ), fp16
  loss scaling (fp16 runs unscaled), gradient clipping.
"""

from __future__ import annotations

import math
from typing import Any

from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default

__all__ = ["ZeroEngine", "StepResult", "ceil_div", "greedy_buckets", "grad_span", "MIMICS", "FUSED_ADAM_CHUNK",
           "resolve_mimic"]

MIMICS = ("planner", "deepspeed-cuda")
# deepspeed/ops/adam/fused_adam.py (0.19.8): multi_tensor_applier = MultiTensorApply(2048 * 32)
FUSED_ADAM_CHUNK = 2048 * 32


def resolve_mimic(mimic: str, device_type: str) -> str:
    """"auto" -> "deepspeed-cuda" on a CUDA device, else "planner"."""
    if mimic == "auto":
        return "deepspeed-cuda" if device_type == "cuda" else "planner"
    if mimic not in MIMICS:
        raise ValueError(f"mimic {mimic!r}: expected auto, {' or '.join(MIMICS)}")
    return mimic


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def greedy_buckets(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Indices (into ``sizes``) per bucket: flush before adding when the bucket would overflow."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_n = 0
    for i, n in enumerate(sizes):
        if cur and cur_n + n > bucket_elems:
            out.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        out.append(cur)
    return out


def greedy_buckets_after(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Indices per bucket: add, then flush once the running size exceeds the bucket."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_n = 0
    for i, n in enumerate(sizes):
        cur.append(i)
        cur_n += n
        if cur_n > bucket_elems:
            out.append(cur)
            cur, cur_n = [], 0
    if cur:
        out.append(cur)
    return out


STAGE0_BUCKET_ELEMS = 500_000_000  # DeepSpeed's stage-0 all-reduce bucket, independent of reduce_bucket_size


class StepResult(dict):
    """``{"loss": float, "model_states": {category: bytes}}`` for one optimizer step."""



def grad_span(numels: list[int], p_lo: int, p_hi: int) -> tuple[int, int]:
    """[lo, hi) of the flat buffer covered by the WHOLE params overlapping [p_lo, p_hi): the size
    DeepSpeed gives a rank's stage-1/2 gradient partition buffer (copy_grads_in_partition)."""
    lo, hi, off = p_lo, p_hi, 0
    for n in numels:
        if off < p_hi and off + n > p_lo:
            lo, hi = min(lo, off), max(hi, off + n)
        off += n
    return lo, hi

class ZeroEngine:
    """ZeRO stages 0-3 over ``model`` (parameters in forward order), collectives through ``comm``.

    ``zero``: a ``zeroplan.specs.ds_schema.ZeroConfig``, or None for DeepSpeed's defaults
    (``zero_or_default``: each default is written once, in the schema). ``meter``: a ``zeroplan.runtime.memory`` meter (tags + phases) or None.
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
        self.params: list[Any] = [p for _, _, ps in units for _, p in ps]
        self.names: list[str] = [n for _, _, ps in units for n, _ in ps]
        # Frozen parameters (requires_grad False, runtime/lora.py), as DeepSpeed 0.19.8 treats them:
        # stages 0-2 leave them out of the optimizer's flat groups (stage_1_and_2.py
        # DeepSpeedZeroOptimizer.__init__: `if is_optimized_parameter(param)` -> bit16_groups;
        # bf16_optimizer.py BF16_Optimizer.__init__ likewise; the stage-0 all-reduce in engine.py
        # skips `not param.requires_grad`): whole on every rank, no gradient, no state, no
        # communication. Stage 3 partitions and gathers them like any parameter
        # (parameter_offload.py _convert_to_zero_parameters; mark_persistent_parameters walks every
        # named parameter) but reduces and updates only the trainable ones (stage3.py
        # _get_trainable_parameter_groups).
        self.frozen: list[Any] = [p for p in self.params if not p.requires_grad]
        if len(self.frozen) == len(self.params):
            raise ValueError("every parameter is frozen (requires_grad False): nothing to train")
        if self.stage < 3 and self.frozen:
            keep = [k for k, p in enumerate(self.params) if p.requires_grad]
            self.params = [self.params[k] for k in keep]
            self.names = [self.names[k] for k in keep]
        for p in self.params:
            if p.dtype != self.dtype:
                raise ValueError(f"parameter dtype {p.dtype} does not match precision {precision}")
        self.device = self.params[0].device
        self.mimic = resolve_mimic(mimic, self.device.type)
        self.fused_adam = self.mimic == "deepspeed-cuda"
        # stage 1, DeepSpeed on CUDA: per-param grads freed into the bucket, grads_in_partition kept
        self.ds_stage1_grads = (self.mimic == "deepspeed-cuda" and self.stage == 1 and self.ds
                                and self.contiguous and not self.offload)
        self.host = torch.device("cpu")
        self.numels = [p.numel() for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.psi = sum(self.numels)
        self._opt_dev = self.host if self.offload else self.device
        self._hooks: list[Any] = []
        if self.stage < 3:
            for p in self.frozen:  # held whole, as the module holds them
                self._tag(p.data, "params")
        [self._setup0, self._setup12, self._setup12, self._setup3][self.stage]()

    # ------------------------------------------------------------------ helpers
    def _tag(self, t: Any, cat: str, host: bool = False) -> Any:
        return self.meter.tag(t, cat, host=host)

    def _empty(self, n: int, cat: str, dtype: Any = None, zero: bool = False) -> Any:
        """A new device tensor of ``n`` elements tagged ``cat``."""
        torch = self.torch
        t = (torch.zeros if zero else torch.empty)(n, dtype=dtype or self.dtype, device=self.device)
        return self._tag(t, cat)

    def _host(self) -> Any:
        """A context in which new tensors are host memory when the optimizer is offloaded."""
        import contextlib

        return self.meter.host_scope() if self.offload else contextlib.nullcontext()

    def _opt_state(self, init: Any) -> tuple[Any, Any, Any]:
        """fp32 master (copy of ``init``), m, v on the optimizer device."""
        with self._host():
            return self._opt_state_inner(init)

    def _opt_state_inner(self, init: Any) -> tuple[Any, Any, Any]:
        torch = self.torch
        host = self.offload
        master = init.to(device=self._opt_dev, dtype=torch.float32, copy=True)
        if host and self.device.type == "cuda":
            master = master.pin_memory()
        self._tag(master, "optimizer_states", host=host)
        m = self._tag(torch.zeros_like(master), "optimizer_states", host=host)
        v = self._tag(torch.zeros_like(master), "optimizer_states", host=host)
        return master, m, v

    def _ready_order(self) -> list[int]:
        """Trainable parameters in gradient-ready (reverse forward) order."""
        return [i for i in range(len(self.params) - 1, -1, -1) if self.params[i].requires_grad]

    # ------------------------------------------------------------------ stage 0
    def _setup0(self) -> None:
        torch = self.torch
        self.flat_param = self._empty(self.psi, "params")
        self.offsets = []
        off = 0
        with torch.no_grad():
            for p, n, shape in zip(self.params, self.numels, self.shapes):
                self.flat_param[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.flat_param[off:off + n].view(shape)
                self.offsets.append(off)
                off += n
        if self.ds and not self.mixed and not self.offload:
            # DeepSpeed 0.19.8 without ZeRO in fp32 wraps no optimizer (engine.py
            # _configure_optimizer: no FP16_Optimizer): Adam steps the fp32 parameters themselves
            with self._host():
                self.master = self.flat_param
                self.m = self._tag(self.torch.zeros_like(self.flat_param), "optimizer_states")
                self.v = self._tag(self.torch.zeros_like(self.flat_param), "optimizer_states")
        else:
            self.master, self.m, self.v = self._opt_state(self.flat_param)
        self.part_lo, self.part_n = 0, self.psi
        self.flat_grad = None
        if self.ds:  # DeepSpeed's allreduce_no_retain: constant 5e8 elements, forward order, flush after adding
            self.buckets = self._flat_buckets("forward", STAGE0_BUCKET_ELEMS, after=True)
        else:
            self.buckets = self._flat_buckets("reverse", self.rbs)

    def _flat_buckets(self, order: str, cap: int, after: bool = False) -> list[tuple[int, int, list[int]]]:
        """(lo, hi, param indices) per gradient bucket in ``order``, flat coordinates."""
        seq = list(range(len(self.params))) if order == "forward" else self._ready_order()
        out = []
        split = greedy_buckets_after if after else greedy_buckets
        for idx in split([self.numels[i] for i in seq], cap):
            ps = [seq[k] for k in idx]
            lo = min(self.offsets[i] for i in ps)
            hi = max(self.offsets[i] + self.numels[i] for i in ps)
            out.append((lo, hi, ps))
        return out

    def _attach_flat_grads(self, padded: int) -> None:
        """Stages 0-1: a flat gradient buffer, params' .grad are views (autograd accumulates in place)."""
        if self.flat_grad is None:
            self.flat_grad = self._empty(padded, "gradients", zero=True)
            for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
                p.grad = self.flat_grad[off:off + n].view(shape)

    def _free_flat_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.flat_grad = None

    # ------------------------------------------------------------------ stages 1-2
    def _setup12(self) -> None:
        torch = self.torch
        n = self.n
        self.padded = ceil_div(self.psi, 2 * n) * 2 * n
        self.part_n = self.padded // n
        self.part_lo = self.rank * self.part_n
        self.flat_param = self._empty(self.padded, "params", zero=True)
        self.offsets = []
        off = 0
        with torch.no_grad():
            for p, k, shape in zip(self.params, self.numels, self.shapes):
                self.flat_param[off:off + k].copy_(p.detach().reshape(-1))
                p.data = self.flat_param[off:off + k].view(shape)
                self.offsets.append(off)
                off += k
        self.master, self.m, self.v = self._opt_state(self.flat_param[self.part_lo:self.part_lo + self.part_n])
        if self.offload:
            with self._host():
                self.grad32_host = self._tag(torch.zeros(self.part_n, dtype=torch.float32, device=self.host),
                                             "optimizer_states", host=True)
        self.flat_grad = None
        self.grad_part = None
        # stage 1 without overlap reduces after backward in parameter order; hooks give reverse order
        self.buckets = self._flat_buckets("forward" if self.stage == 1 and not self.overlap else "reverse", self.rbs)
        self.ipg: list[Any] = []
        self._pending: list[tuple[Any, Any, Any]] = []
        self._bucket_bufs: dict[int, tuple[Any, Any]] = {}
        self._copied: set[int] = set()
        if self.stage == 2 and self.ds:
            self._install_grad_hooks()

    def _alloc_ipg(self, count: int) -> None:
        if self.contiguous and not self.ipg:
            self.ipg = [self._empty(self.rbs, "buffers") for _ in range(count)]

    def _free_ipg(self) -> None:
        self.ipg = []

    def _grad_part(self) -> Any:
        if self.grad_part is None:
            self.grad_part = self._new_grad_part()
        return self.grad_part

    def _new_grad_part(self) -> Any:
        """The bit16 gradient partition: on the device, or on the host with optimizer offload."""
        if not self.offload:
            if self.stage in (1, 2):
                # DeepSpeed sizes the buffer by the whole params overlapping the partition
                # (copy_grads_in_partition); the partition is a view into it (core/layout.py)
                lo, hi = self._grad_span()
                buf = self._empty(hi - lo, "gradients", zero=True)
                return buf[self.part_lo - lo:self.part_lo - lo + self.part_n]
            return self._empty(self.part_n, "gradients", zero=True)
        with self._host():
            t = self.torch.zeros(self.part_n, dtype=self.dtype, device=self.host)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return self._tag(t, "gradients", host=True)

    def _grad_span(self) -> tuple[int, int]:
        return grad_span(self.numels, self.part_lo, self.part_lo + self.part_n)

    def _owned(self, lo: int, hi: int) -> tuple[int, int] | None:
        a, b = max(lo, self.part_lo), min(hi, self.part_lo + self.part_n)
        return (a, b) if a < b else None

    def _reduce_bucket_12(self, k: int, source: Any) -> None:
        """Reduce bucket k (flat [lo, hi)); ``source(i)`` gives param i's gradient (flat view).

        The bucket is sliced at owner-partition boundaries; with multi-rank all-reduce the
        slices are packed (flush after adding once over ``reduce_bucket_size``) into
        all-reduces of a flatten copy; otherwise every slice is ``reduce``d to its owner.
        """
        torch = self.torch
        lo, hi, ps = self.buckets[k]
        slot, buf = self._bucket_buffer(k)
        if buf is not None:
            for i in ps:
                if i not in self._copied:
                    self._copy_into_bucket(k, i, source(i))
                    if self.ds_stage1_grads:  # .grad re-pointed into the bucket: the full-size grad is freed
                        self.params[i].grad = None
        else:
            buf = self._tag(torch.cat([source(i) for i in sorted(ps, key=lambda j: self.offsets[j])]), "buffers")
        self._bucket_bufs.pop(k, None)
        if self.reduce_scatter_cfg:
            slices = []
            a = lo
            while a < hi:
                b = min(hi, (a // self.part_n + 1) * self.part_n)
                slices.append((a, b))
                a = b
        else:
            slices = [(lo, hi)]
        if self.multi_rank:
            groups: list[tuple[int, int]] = []
            start, run = None, 0
            for a, b in slices:
                start = a if start is None else start
                run += b - a
                if run > self.rbs:
                    groups.append((start, b))
                    start, run = None, 0
            if start is not None:
                groups.append((start, slices[-1][1]))
            async_op = self.overlap and slot is not None
            for a, b in groups:
                flat = self._tag(buf[a - lo:b - lo].clone(), "buffers")  # DeepSpeed's flatten copy
                h = self.comm.all_reduce(flat, async_op=async_op)
                item = (h, flat, (a, b))
                if async_op:
                    self._pending.append((slot, item))
                else:
                    self._finish_12(item)
        else:
            for a, b in slices:
                owner = a // self.part_n
                piece = buf[a - lo:b - lo]
                self.comm.reduce(piece, dst=owner)
                if owner == self.rank:
                    self._accumulate_owned(piece, a, b)
        del buf

    def _bucket_buffer(self, k: int) -> tuple[Any, Any]:
        """(ipg slot, view) holding bucket k; (None, None) when it does not go through the ipg buffer."""
        got = self._bucket_bufs.get(k)
        if got is not None:
            return got
        lo, hi, _ = self.buckets[k]
        if not (self.contiguous and hi - lo <= self.rbs):
            return None, None
        slot = self._ipg_slot
        self._ipg_slot = (slot + 1) % len(self.ipg)
        self._wait_slot(slot)
        got = (slot, self.ipg[slot][:hi - lo])
        self._bucket_bufs[k] = got
        return got

    def _copy_into_bucket(self, k: int, i: int, grad: Any) -> bool:
        """Copy param i's gradient into bucket k's buffer; False when the bucket has no buffer."""
        _, buf = self._bucket_buffer(k)
        if buf is None:
            return False
        lo = self.buckets[k][0]
        buf[self.offsets[i] - lo:self.offsets[i] - lo + self.numels[i]].copy_(grad)
        self._copied.add(i)
        return True

    def _wait_slot(self, slot: int) -> None:
        keep = []
        for s, item in self._pending:
            if s == slot:
                self._finish_12(item)
            else:
                keep.append((s, item))
        self._pending = keep

    def _drain(self) -> None:
        for _, item in self._pending:
            self._finish_12(item)
        self._pending = []

    def _finish_12(self, item: tuple) -> None:
        h, flat, (lo, hi) = item
        if h is not None:
            h.wait()
        own = self._owned(lo, hi)
        if own is not None:
            a, b = own
            self._accumulate_owned(flat[a - lo:b - lo], a, b)

    def _accumulate_owned(self, reduced: Any, a: int, b: int) -> None:
        """Averaged gradient slice [a, b) (flat coordinates) into this rank's partition."""
        reduced.div_(self.n)
        if self.ds_stage1_grads:  # copy_grads_in_partition: owned slices into grads_in_partition
            self._grad_part()[a - self.part_lo:b - self.part_lo].copy_(reduced)
        elif self.stage == 1:
            self.flat_grad[a:b].copy_(reduced)
        else:
            self._grad_part()[a - self.part_lo:b - self.part_lo].add_(reduced.to(self.grad_part.device))

    def _reduce_all_12(self, source: Any) -> None:
        """Reduce every bucket in canonical order (stage 1 at the boundary, stage 2 paper)."""
        if not self.ds:
            self._paper_reduce_scatter_12(source)
            return
        self._alloc_ipg(2 if self.overlap else 1)
        self._ipg_slot = 0
        self._bucket_bufs, self._copied = {}, set()
        for k in range(len(self.buckets)):
            self._reduce_bucket_12(k, source)
        self._drain()
        self._free_ipg()

    def _paper_reduce_scatter_12(self, source_flat: Any) -> None:
        """Partition-aligned reduce-scatter buckets (see the module docstring)."""
        torch = self.torch
        n, part = self.n, self.part_n
        c = max(1, self.rbs // n)
        for start in range(0, part, c):
            w = min(c, part - start)
            buf = self._empty(n * w, "buffers")
            for r in range(n):
                self._copy_flat_range(buf[r * w:(r + 1) * w], r * part + start, r * part + start + w, source_flat)
            out = self._empty(w, "buffers")
            self.comm.reduce_scatter(out, buf)
            a = self.part_lo + start
            self._accumulate_owned(out, a, a + w)
            del buf, out

    def _copy_flat_range(self, dst: Any, lo: int, hi: int, source: Any) -> None:
        """dst <- flat gradient elements [lo, hi) (zeros in the padding)."""
        if isinstance(source, self.torch.Tensor):
            end = min(hi, self.psi)
            if end > lo:
                dst[:end - lo].copy_(source[lo:end])
            if hi > max(lo, end):
                dst[max(lo, end) - lo:].zero_()
            return
        dst.zero_()
        for i, (off, k) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + k)
            if a < b:
                dst[a - lo:b - lo].copy_(source(i)[a - off:b - off])

    # ------------------------------------------------------------------ grad hooks (stages 2, 3)
    def _install_grad_hooks(self) -> None:
        self._ready = [False] * len(self.params)
        self._order = self._ready_order()
        self._pos = {i: k for k, i in enumerate(self._order)}
        self._ptr = 0
        self._bucket_of = {}
        for k, (_, _, ps) in enumerate(self.buckets):
            for i in ps:
                self._bucket_of[i] = k
        self._last_in_bucket = {ps[-1]: k for k, (_, _, ps) in enumerate(self.buckets)}
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i)))

    def _grad_ready(self, i: int) -> None:
        self._ready[i] = True
        order = self._order
        while self._ptr < len(order) and self._ready[order[self._ptr]]:
            j = order[self._ptr]
            self._ptr += 1
            self._arrived(j)
            if j in self._last_in_bucket:
                self._flush_bucket(self._last_in_bucket[j])

    def _arrived(self, j: int) -> None:
        """Gradient j is next in bucket order: copy it into the bucket buffer and free it (DeepSpeed)."""
        k = self._bucket_of[j]
        p = self.params[j]
        with self.torch.no_grad():
            if self.stage == 3:
                if self.contiguous and self._bucket_total[k] <= self.rbs:
                    pos, pad = self._pos3[j], self.chunk[j] * self.n
                    seg = self.ipg[0][pos:pos + pad]
                    seg[:self.numels[j]].copy_(p.grad.reshape(-1))
                    seg[self.numels[j]:].zero_()
                    p.grad = None
            elif self._copy_into_bucket(k, j, p.grad.reshape(-1)):
                p.grad = None

    def _begin_backward_hooks(self) -> None:
        self._ready = [False] * len(self.params)
        self._ptr = 0
        self._bucket_bufs, self._copied = {}, set()

    def _flush_bucket(self, k: int) -> None:
        if self.stage == 3:
            self._flush_bucket_3(k)
            return
        _, _, ps = self.buckets[k]
        self._reduce_bucket_12(k, lambda i: self.params[i].grad.reshape(-1))
        for i in ps:
            self.params[i].grad = None
        self._copied.difference_update(ps)

    # ------------------------------------------------------------------ stage 3
    def _setup3(self) -> None:
        torch = self.torch
        n = self.n
        thr = self.zero.param_persistence_threshold
        cap = self.zero.model_persistence_threshold
        used = 0
        self.persistent = []
        for k in self.numels:
            pers = k <= thr and used + k <= cap
            if pers:
                used += k
            self.persistent.append(pers)
        self.chunk = [ceil_div(k, n) for k in self.numels]  # p̂/N per param
        # the trainable partitions are one flat buffer (fp16_partitioned_groups_flat, the optimizer's
        # view); frozen ones are separate ds_tensors in DeepSpeed, one flat buffer here
        self.train = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.part_n = sum(self.chunk[i] for i in self.train)
        self.part_offsets = [0] * len(self.params)
        off = foff = 0
        for i, c in enumerate(self.chunk):
            if self.params[i].requires_grad:
                self.part_offsets[i] = off
                off += c
            else:
                self.part_offsets[i] = foff
                foff += c
        self.lp = self._empty(self.part_n, "params", zero=True)
        self.lp_frozen = self._empty(foff, "params", zero=True) if foff else None
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                c = self.chunk[i]
                full = self._tag(torch.zeros(c * n, dtype=self.dtype, device=self.device), "params")
                full[:self.numels[i]].copy_(p.detach().reshape(-1))
                self._part(i).copy_(full[self.rank * c:(self.rank + 1) * c])
                if self.persistent[i]:  # kept whole, stored padded to p̂ (the post-step gather writes in place)
                    p.data = full[:self.numels[i]].view(self.shapes[i])
                else:
                    p.data = self._placeholder
                del full
        self.master, self.m, self.v = self._opt_state(self.lp)
        if self.offload:
            with self._host():
                self.grad32_host = self._tag(torch.zeros(self.part_n, dtype=torch.float32, device=self.host),
                                             "optimizer_states", host=True)
        self.grad_part = self._new_grad_part()
        self.live = [bool(x) for x in self.persistent]
        # modules (units) in forward order; D(i) = 2·Σ_{j>i} numel_j over all params of later modules
        idx_of = {id(p): i for i, p in enumerate(self.params)}
        self.unit_params: list[list[int]] = []
        unit_numel: list[int] = []
        self.unit_of_param: dict[int, int] = {}
        for _name, _mod, ps in self.units:
            idx = [idx_of[id(p)] for _, p in ps]
            for i in idx:
                self.unit_of_param[i] = len(self.unit_params)
            self.unit_params.append([i for i in idx if not self.persistent[i]])
            unit_numel.append(sum(self.numels[i] for i in idx))
        nonpers = [i for i in range(len(self.params)) if not self.persistent[i]]
        max_live = self.zero.max_live_parameters
        prefetch = self.zero.prefetch_bucket_size
        reuse = self.zero.max_reuse_distance
        bound = min(max_live, prefetch)
        nu = len(self.unit_params)
        if not self.ds:  # paper: one gather per module in forward, again in backward
            chunks = [ps for ps in self.unit_params if ps]
            self.regather = [bool(ps) for ps in self.unit_params]
        elif bound > 0 and sum(self.numels[i] for i in nonpers) < bound:  # everything fits one prefetch
            chunks = [nonpers] if nonpers else []
            self.regather = [False] * nu
        else:
            if bound <= 0:
                chunks = [ps for ps in self.unit_params if ps]
            else:  # consecutive params, each chunk closed once its unpadded numel reaches the bound
                chunks, cur, run = [], [], 0
                for i in nonpers:
                    cur.append(i)
                    run += self.numels[i]
                    if run >= bound:
                        chunks.append(cur)
                        cur, run = [], 0
                if cur:
                    chunks.append(cur)
            self.regather = [False] * nu
            after = 0
            for u in range(nu - 1, -1, -1):
                self.regather[u] = bool(self.unit_params[u]) and 2 * after >= reuse
                after += unit_numel[u]
        self.chunks = chunks
        self.chunk_of = {i: c for c, ps in enumerate(chunks) for i in ps}
        # use-sites: modules whose forward reads a unit's non-persistent params
        self.sites: dict[int, list[int]] = {}
        for mod in self.model.modules():
            us = set()
            owners = [mod] + ([mod._source] if getattr(mod, "_source", None) is not None else [])
            for o in owners:
                for p in o.parameters(recurse=False):
                    i = idx_of.get(id(p))
                    if i is not None and not self.persistent[i]:
                        us.add(self.unit_of_param[i])
            if us:
                self.sites[id(mod)] = sorted(us)
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(mod.register_forward_hook(self._post_forward))
        self.unit_uses = [0] * nu
        for us in self.sites.values():
            for u in us:
                self.unit_uses[u] += 1
        self.unit_seen = [0] * nu
        self.unit_pending = [0] * nu
        # reduce-scatter buckets over padded sizes, gradient-ready order
        order = self._ready_order()  # trainable only: frozen parameters get no gradient
        self.buckets = [(0, 0, [order[k] for k in idx])
                        for idx in greedy_buckets([self.chunk[i] * n for i in order], self.rbs)]
        self.ipg = [self._empty(self.rbs, "buffers")] if self.contiguous else []
        self._bucket_total = [sum(self.chunk[i] for i in ps) * n for _, _, ps in self.buckets]
        self._pos3 = {}
        for _, _, ps in self.buckets:
            pos = 0
            for i in ps:
                self._pos3[i] = pos
                pos += self.chunk[i] * n
        self._install_grad_hooks()

    def _part(self, i: int) -> Any:
        """Param i's stage-3 partition (p̂/N elements): in the trainable flat buffer or the frozen one."""
        src = self.lp if self.params[i].requires_grad else self.lp_frozen
        return src[self.part_offsets[i]:self.part_offsets[i] + self.chunk[i]]

    # forward / backward hooks
    def _pre_forward(self, mod: Any, args: Any) -> None:
        for u in self.sites[id(mod)]:
            for i in self.unit_params[u]:
                if not self.live[i]:
                    self._gather_params([j for j in self.chunks[self.chunk_of[i]] if not self.live[j]])

    def _post_forward(self, mod: Any, args: Any, out: Any) -> Any:
        us = self.sites[id(mod)]
        for u in us:
            self.unit_seen[u] += 1
            if self.unit_seen[u] == self.unit_uses[u] and self.regather[u]:
                self._release(self.unit_params[u])
        torch = self.torch
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            return _PreBackward.apply(self, tuple(us), out)
        return out

    def _pre_backward(self, units: tuple[int, ...]) -> None:
        with self.comm.in_phase("backward"):
            for u in units:
                missing = [i for i in self.unit_params[u] if not self.live[i]]
                if missing:
                    self._gather_params(missing)

    def _gather_params(self, ps: list[int]) -> None:
        """One all-gather of the params ``ps`` (Σp̂ elements); each param becomes a full tensor.

        A ``MemoryError`` raised inside (a tracker's memory limit, a CUDA OOM) gets a ``where``
        attribute naming the gather and its size.
        """
        try:
            self._gather_params_inner(ps)
        except MemoryError as exc:
            names = sorted({self.names[i].rsplit(".", 1)[0] for i in ps})
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            exc.where = (f"stage-3 all-gather of {shown} ({sum(self.chunk[i] for i in ps) * self.n} elements, "
                         f"{self.comm.phase})")
            raise

    def _gather_params_inner(self, ps: list[int]) -> None:
        torch = self.torch
        n = self.n
        with torch.no_grad():
            if len(ps) == 1:  # the param is a view into its padded buffer
                i = ps[0]
                c = self.chunk[i]
                out = self._empty(c * n, "buffers")
                self.comm.all_gather(out, self._part(i))
                self.params[i].data = out[:self.numels[i]].view(self.shapes[i])
            else:  # coalesced: a flat buffer, then one copy per param (the ~2x transient)
                width = sum(self.chunk[i] for i in ps)
                inp = self._tag(torch.cat([self._part(i) for i in ps]), "buffers")
                out = self._empty(width * n, "buffers")
                self.comm.all_gather(out, inp)
                grid = out.view(n, width)
                col = 0
                for i in ps:
                    c = self.chunk[i]
                    full = self._tag(grid[:, col:col + c].reshape(-1), "buffers")  # a copy (non-contiguous)
                    self.params[i].data = full[:self.numels[i]].view(self.shapes[i])
                    col += c
                del inp, out, grid
        for i in ps:
            self.live[i] = True

    def _release(self, ps: list[int]) -> None:
        for i in ps:
            if not self.persistent[i]:
                self.params[i].data = self._placeholder
                self.live[i] = False

    def _flush_bucket_3(self, k: int) -> None:
        torch = self.torch
        n = self.n
        _, _, ps = self.buckets[k]
        total = sum(self.chunk[i] for i in ps) * n
        with torch.no_grad():
            if self.contiguous and total <= self.rbs:  # gradients were copied in as they arrived
                buf = self.ipg[0][:total]
                pieces = []
                pos = 0
                for i in ps:
                    pieces.append(buf[pos:pos + self.chunk[i] * n].view(n, self.chunk[i]))
                    pos += self.chunk[i] * n
            else:
                pieces = []
                for i in ps:
                    g = self.params[i].grad.reshape(-1)
                    pad = self.chunk[i] * n - self.numels[i]
                    pieces.append((torch.nn.functional.pad(g, (0, pad)) if pad else g).view(n, self.chunk[i]))
            inter = self._tag(torch.cat(pieces, dim=1).reshape(-1), "buffers")  # rank-major interleaved copy
            del pieces
            for i in ps:
                self.params[i].grad = None
            out = self._empty(total // n, "buffers")
            self.comm.reduce_scatter(out, inter)
            del inter
            out.div_(n)
            col = 0
            for i in ps:
                c = self.chunk[i]
                self.grad_part[self.part_offsets[i]:self.part_offsets[i] + c].add_(
                    out[col:col + c].to(self.grad_part.device))
                col += c
        for i in ps:
            u = self.unit_of_param[i]
            self.unit_pending[u] -= 1
            if self.unit_pending[u] == 0:
                self._release(self.unit_params[u])

    # ------------------------------------------------------------------ training step
    def train_step(self, batches: list[Any]) -> StepResult:
        """One optimizer step over ``len(batches)`` (= grad_accum) micro-batches of input ids."""
        torch = self.torch
        if len(batches) != self.grad_accum:
            raise ValueError(f"train_step: got {len(batches)} micro-batches, grad_accum is {self.grad_accum}")
        total_loss = 0.0
        for mb in batches:
            self.meter.phase = "forward"
            self.comm.phase = "forward"
            if self.stage == 3:
                self.unit_seen = [0] * len(self.unit_params)
            loss = self.model(mb)
            self.meter.phase = "backward"
            self.comm.phase = "backward"
            self._before_backward()
            (loss / self.grad_accum).backward()
            total_loss += _scalar(loss)
            del loss
            self._after_backward()
            self.micro_step += 1
        self._boundary()
        self.meter.phase = "step"
        self.comm.phase = "step"
        states = self._model_state_snapshot()
        self._optimizer_step()
        self.step_count += 1
        self.meter.phase = "forward"
        self.comm.phase = "forward"
        return StepResult(loss=total_loss / len(batches), model_states=states)

    def _model_state_snapshot(self) -> dict[str, int]:
        cur = self.meter.current_by_category()
        return {k: cur.get(k, 0) for k in ("params", "gradients", "optimizer_states")}

    def _before_backward(self) -> None:
        if self.stage == 0:
            self._attach_flat_grads(self.psi)
        elif self.stage == 1 and not self.ds_stage1_grads:
            self._attach_flat_grads(self.padded)
        elif self.stage == 2 and self.ds:
            self._alloc_ipg(2 if self.overlap else 1)
            self._ipg_slot = 0
            self._begin_backward_hooks()
        elif self.stage == 3:
            self._begin_backward_hooks()
            self.unit_pending = [0] * len(self.unit_params)
            for i in self.train:
                self.unit_pending[self.unit_of_param[i]] += 1

    def _after_backward(self) -> None:
        if self.stage == 2:
            if self.ds:
                if self._ptr != len(self._order):
                    raise RuntimeError("stage 2: some parameters received no gradient in backward")
                self._drain()
                self._free_ipg()
            else:
                self._paper_reduce_scatter_12(lambda i: self.params[i].grad.reshape(-1))
                for p in self.params:
                    p.grad = None
        elif self.stage == 3:
            if self._ptr != len(self._order):
                raise RuntimeError("stage 3: some parameters received no gradient in backward")
            self._release([i for i in range(len(self.params)) if self.live[i]])

    def _boundary(self) -> None:
        """Gradient reduction once per optimizer step (stages 0 and 1)."""
        torch = self.torch
        if self.stage == 0:
            with torch.no_grad():
                for lo, hi, ps in self.buckets:
                    flat = self._tag(self.flat_grad[lo:hi].clone(), "buffers")  # flatten copy
                    self.comm.all_reduce(flat)
                    flat.div_(self.n)
                    self.flat_grad[lo:hi].copy_(flat)
                    del flat
        elif self.ds_stage1_grads:
            with torch.no_grad():
                self._reduce_all_12(lambda i: self.params[i].grad.reshape(-1))
        elif self.stage == 1:
            with torch.no_grad():
                fg = self.flat_grad
                self._reduce_all_12(fg if not self.ds else (lambda i: fg[self.offsets[i]:self.offsets[i] + self.numels[i]]))

    # ------------------------------------------------------------------ the optimizer step
    def _adamw(self, master: Any, m: Any, v: Any, g32: Any) -> None:
        if self.fused_adam and master.numel() > FUSED_ADAM_CHUNK:
            # FusedAdam: chunk by chunk, no temporary of the group's size (fused_adam.py)
            for lo in range(0, master.numel(), FUSED_ADAM_CHUNK):
                hi = lo + FUSED_ADAM_CHUNK
                self._adamw_one(master[lo:hi], m[lo:hi], v[lo:hi], g32[lo:hi])
            return
        self._adamw_one(master, m, v, g32)

    def _adamw_one(self, master: Any, m: Any, v: Any, g32: Any) -> None:
        b1, b2 = self.betas
        t = self.step_count + 1
        if self.wd:
            master.mul_(1 - self.lr * self.wd)
        m.mul_(b1).add_(g32, alpha=1 - b1)
        v.mul_(b2).addcmul_(g32, g32, value=1 - b2)
        denom = self._tag(v.sqrt(), "buffers", host=self.offload)  # the one fp32 temporary of the group's size
        denom.div_(math.sqrt(1 - b2 ** t)).add_(self.eps)
        master.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** t))
        del denom

    def _optimizer_step(self) -> None:
        torch = self.torch
        with torch.no_grad():
            if self.stage == 0:
                g = self.flat_grad
                g32 = self._tag(g.float(), "buffers") if g.dtype != torch.float32 else g
                self._norm_sq = torch.dot(g32.reshape(-1), g32.reshape(-1)).to(torch.float64)
                self._adamw(self.master, self.m, self.v, g32)
                del g32
                if self.master is not self.flat_param:
                    self.flat_param.copy_(self.master)
                self._free_flat_grads()
                if self.ds and not self.mixed:  # DeepSpeed 0.19.8: fp32 stage 0 all-reduces the norm
                    norm = self._norm_sq.reshape(1).to(device=self.device, dtype=torch.float32)
                    self.comm.all_reduce(norm)
                return
            if self.stage in (1, 2):
                if self.ds_stage1_grads:
                    for p in self.params:  # free_grad_in_param_list before flattening
                        p.grad = None
                    src = self._grad_part()
                elif self.stage == 1:
                    src = self.flat_grad[self.part_lo:self.part_lo + self.part_n]
                else:
                    src = self._grad_part()
                self._step_group(src, self.master, self.m, self.v,
                                 self.flat_param[self.part_lo:self.part_lo + self.part_n], 0)
                del src
                if self.ds:
                    if self.mixed:  # the overflow flag exists with a loss scaler / bit16 only
                        flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
                        self.comm.all_reduce(flag, op="max")
                    norm = self._norm_sq.reshape(1).to(device=self.device, dtype=torch.float32)
                    self.comm.all_reduce(norm)
                lo = self.part_lo
                self.comm.all_gather(self.flat_param, self.flat_param[lo:lo + self.part_n])
                if self.stage == 1 and not self.ds_stage1_grads:
                    self._free_flat_grads()
                else:
                    self.grad_part = None
                return
            # stage 3: sub-groups of the partition
            sgs = self.zero.sub_group_size
            groups = []
            start = cur = 0
            for c in (self.chunk[i] for i in self.train):
                cur += c
                if cur - start >= sgs:
                    groups.append((start, cur))
                    start = cur
            if cur > start:
                groups.append((start, cur))
            norm_sq = torch.zeros((), dtype=torch.float64)
            for a, b in groups:
                self._step_group(self.grad_part[a:b], self.master[a:b], self.m[a:b], self.v[a:b], self.lp[a:b], a)
                norm_sq = norm_sq + self._norm_sq.cpu()
            self.grad_part.zero_()
            # stage3.py _post_step: `self.persistent_parameters[0].all_gather(self.persistent_parameters)`
            # re-gathers EVERY persistent parameter, frozen ones too (step() released them all first:
            # _partition_all_parameters -> release_and_reset_all)
            for i, p in enumerate(self.params):
                if self.persistent[i]:  # in place into the padded whole copy
                    c = self.chunk[i]
                    full = self.torch.empty(0, dtype=self.dtype, device=self.device).set_(
                        p.data.untyped_storage(), 0, (c * self.n,))
                    self.comm.all_gather(full, self._part(i))
                    del full
            if self.ds:
                dt = torch.float32 if self.offload else torch.float64  # DeepSpeed 0.19.8: 4 B with offload
                norm = norm_sq.reshape(1).to(device=self.device, dtype=dt)
                self.comm.all_reduce(norm)

    def _step_group(self, grad16: Any, master: Any, m: Any, v: Any, lp_out: Any, offset: int) -> None:
        """AdamW on one group: flatten copy + fp32 gradient transients, then write back bit16 values."""
        torch = self.torch
        if self.offload:  # the fp32 gradient partition is a persistent host buffer
            g32 = self.grad32_host[offset:offset + grad16.numel()]
            g32.copy_(grad16)
            with self._host():
                self._norm_sq = torch.dot(g32, g32).to(torch.float64)
                self._adamw(master, m, v, g32)
            lp_out.copy_(master)
            return
        else:
            flat = self._tag(grad16.clone(), "buffers")  # DeepSpeed's flatten of the averaged gradients
            g32 = self._tag(flat.float(), "buffers") if flat.dtype != torch.float32 else flat
            if self.mimic == "deepspeed-cuda":
                del flat  # stage_1_and_2.py step(): `del flat_grad_partition` before _optimizer_step
        self._norm_sq = torch.dot(g32, g32).to(torch.float64) if g32.numel() else torch.zeros((), dtype=torch.float64)
        self._adamw(master, m, v, g32)
        del g32
        lp_out.copy_(master.to(lp_out.device) if master.device != lp_out.device else master)

    def close(self) -> None:
        """Remove the hooks the engine installed on the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _scalar(t: Any) -> float:
    """float(t), or NaN for a fake tensor (simulated runs have no values)."""
    try:
        return float(t.detach())
    except Exception:  # noqa: BLE001 - FakeTensor has no data
        return float("nan")


def _make_pre_backward():
    import torch

    class PreBackward(torch.autograd.Function):
        """Identity in forward; in backward re-gathers the module's units before its gradients run."""

        @staticmethod
        def forward(ctx, engine, units, out):  # type: ignore[override]
            ctx.engine = engine
            ctx.units = units
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.engine._pre_backward(ctx.units)
            return None, None, grad

    return PreBackward


class _LazyPreBackward:
    _cls = None

    def apply(self, *args: Any) -> Any:
        if self._cls is None:
            type(self)._cls = _make_pre_backward()
        return self._cls.apply(*args)


_PreBackward = _LazyPreBackward()
