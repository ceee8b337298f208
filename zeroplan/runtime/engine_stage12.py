"""Stages 1-2: the padded flat buffer partitioned across ranks, the owned gradient partition, the
partition's optimizer step and the all-gather after it. Stage 1 reduces once per optimizer step (at
the boundary), stage 2 every micro-step from gradient-ready hooks (``runtime/engine.py``'s docstring
describes the schedule)."""

from __future__ import annotations

from typing import Any

from zeroplan.runtime.engine_flat import FlatLayout
from zeroplan.runtime.engine_hooks import GradHooks
from zeroplan.runtime.engine_reduce12 import BucketReduce12
from zeroplan.runtime.engine_strategy import StageStrategy
from zeroplan.runtime.engine_util import ceil_div, grad_span


class Stage12Strategy(BucketReduce12, GradHooks, FlatLayout, StageStrategy):
    """What stages 1 and 2 share; ``Stage1Strategy`` and ``Stage2Strategy`` hold their differences."""

    ds_stage1_grads = False  # Stage1Strategy: DeepSpeed's per-parameter gradients on CUDA

    def _bucket_order(self) -> str:
        """The order gradients are bucketed in: reverse (gradient-ready) unless a subclass says otherwise."""
        return "reverse"

    def setup(self) -> None:
        torch = self.torch
        n = self.n
        self.padded = ceil_div(self.psi, 2 * n) * 2 * n
        self.part_n = self.padded // n
        self.part_lo = self.rank * self.part_n
        self._flatten_params(self.padded, zero=True)
        self.master, self.m, self.v = self._opt_state(self.flat_param[self.part_lo:self.part_lo + self.part_n])
        if self.offload:
            with self._host():
                self.grad32_host = self._tag(torch.zeros(self.part_n, dtype=torch.float32, device=self.host),
                                             "optimizer_states", host=True)
        self.grad_part = None
        self.buckets = self._flat_buckets(self._bucket_order(), self.rbs)
        self.ipg: list[Any] = []
        self._bucket_bufs: dict[int, tuple[Any, Any]] = {}
        self._copied: set[int] = set()

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
        if self.offload:
            return self._host_grad_part()
        # DeepSpeed sizes the buffer by the whole params overlapping the partition
        # (copy_grads_in_partition); the partition is a view into it (core/layout.py)
        lo, hi = grad_span(self.numels, self.part_lo, self.part_lo + self.part_n)
        buf = self._empty(hi - lo, "gradients", zero=True)
        return buf[self.part_lo - lo:self.part_lo - lo + self.part_n]

    def _owned(self, lo: int, hi: int) -> tuple[int, int] | None:
        a, b = max(lo, self.part_lo), min(hi, self.part_lo + self.part_n)
        return (a, b) if a < b else None

    def _store_owned(self, reduced: Any, a: int, b: int) -> None:
        """The averaged slice [a, b) (flat coordinates) added into this rank's gradient partition."""
        self._grad_part()[a - self.part_lo:b - self.part_lo].add_(reduced.to(self.grad_part.device))

    def _step_source(self) -> Any:
        """The averaged bit16 gradient partition the optimizer steps on."""
        return self._grad_part()

    def _after_step(self) -> None:
        """Free the gradients of the step just taken."""
        self.grad_part = None

    def step(self) -> None:
        """AdamW on the owned partition, the flag and norm all-reduces, the all-gather."""
        torch = self.torch
        lp_out = self.flat_param[self.part_lo:self.part_lo + self.part_n]
        if self._ds_partition_step():
            self._ds_step_12(lp_out)
        else:
            src = self._step_source()
            self._step_group(src, self.master, self.m, self.v, lp_out, 0)
            del src
        if self.ds:
            if self.mixed:  # the overflow flag exists with a loss scaler / bit16 only
                flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
                self.comm.all_reduce(flag, op="max")
            norm = self._norm_sq.reshape(1).to(device=self.device, dtype=torch.float32)
            self.comm.all_reduce(norm)
        lo = self.part_lo
        self.comm.all_gather(self.flat_param, self.flat_param[lo:lo + self.part_n])
        self._after_step()

    def _ds_partition_step(self) -> bool:
        """Whether the step is DeepSpeed's on a gradient partition buffer (``_ds_step_12``)."""
        return self.ds and not self.offload and self.contiguous

    def _ds_step_12(self, lp_out: Any) -> None:
        """DeepSpeed's stage-1/2 step (stage_1_and_2.py ``step``): the norm first, each gradient tensor of the
        partition cast to fp64 in turn (``get_grad_norm_direct``, ``get_norm_dtype``); then the flatten, its
        fp32 cast, the flat copy deleted and the gradient partition freed before the optimizer runs."""
        torch = self.torch
        src = self._step_source()
        norm_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        p_lo, p_hi = self.part_lo, self.part_lo + self.part_n
        for off, k in zip(self.offsets, self.numels):
            a, b = max(off, p_lo), min(off + k, p_hi)
            if a < b:
                piece = self._tag(src[a - p_lo:b - p_lo].double(), "buffers")
                norm_sq += torch.linalg.vector_norm(piece) ** 2
                del piece
        flat = self._tag(src.clone(), "buffers")
        g32 = self._tag(flat.float(), "buffers") if flat.dtype != torch.float32 else flat
        del flat, src
        self.grad_part = None  # free_grad_in_param_list(params_in_partition): the partition's last holder
        self._norm_sq = norm_sq
        self._adamw(self.master, self.m, self.v, g32)
        del g32
        lp_out.copy_(self.master)

    # ---- gradient-ready hooks (stage 2, DeepSpeed flavour)
    def _arrived(self, j: int) -> None:
        """Gradient j is next in bucket order: copy it into the bucket buffer and free it (DeepSpeed)."""
        with self.torch.no_grad():
            if self._copy_into_bucket(self._bucket_of[j], j, self.params[j].grad.reshape(-1)):
                self.params[j].grad = None

    def _flush_bucket(self, k: int) -> None:
        _, _, ps = self.buckets[k]
        self._reduce_bucket_12(k, lambda i: self.params[i].grad.reshape(-1))
        for i in ps:
            self.params[i].grad = None
        self._copied.difference_update(ps)


class Stage1Strategy(Stage12Strategy):
    """Stage 1: gradients accumulated over the micro-steps, reduced once at the boundary.

    With ``ds_stage1_grads`` (DeepSpeed's flavour with contiguous gradients and no offload, on any device:
    DeepSpeed does this on CPU too) autograd's per-parameter gradients are kept, the bucket is set up at
    each backward's first gradient hook and kept to the boundary (``setup_buckets``; the epilogue that
    releases it runs at the boundary only), the gradients are freed into the bucket as it is reduced, and
    the owned slices land in ``grads_in_partition`` (stage_1_and_2.py copy_grads_in_partition); otherwise
    one flat Ψ₁₂ buffer. With ``hooked`` (``overlap_comm`` too) the boundary micro-step's gradient hooks
    do the reduction as stage 2's do
    (``process_gradients`` -> ``reduce_ready_partitions_and_remove_grads``): each gradient moved into one
    of the two buckets as it arrives, a bucket flushed in the hook of the gradient that overflows it; the
    earlier micro-steps' hooks only allocate the buckets. A lone gradient larger than the bucket that this
    rank does not own is not cleared (``reduce_ipg_grads`` clears nothing at stage 1): it stays
    autograd's to the end of the backward (the epilogue's ``_clear_param_grad_only``)."""

    def setup(self) -> None:
        self.hooked = self.ds and self.overlap and self.contiguous and not self.offload
        self.ds_stage1_grads = self.ds and self.contiguous and not self.offload
        self.flush_in_next_hook = self.hooked
        self._at_boundary, self._kept, self._accum_bytes = True, [], 0
        super().setup()
        if self.ds_stage1_grads:  # contiguous gradients: DeepSpeed's hooks set the bucket up (and reduce: hooked)
            self._install_grad_hooks()

    def _bucket_order(self) -> str:
        # without overlap_comm stage 1 reduces after backward in parameter order; hooks give reverse order
        return "reverse" if self.overlap else "forward"

    def before_backward(self) -> None:
        if self.hooked:
            self._at_boundary = (self.engine.micro_step + 1) % self.grad_accum == 0
            self._ipg_slot = 0
            self._begin_backward_hooks()
        elif not self.ds_stage1_grads:
            self._attach_flat_grads(self.padded)

    def _grad_ready(self, i: int) -> None:
        self._alloc_ipg(2 if self.overlap else 1)  # setup_buckets, at the first hook of every backward
        if self.hooked and self._at_boundary:
            super()._grad_ready(i)

    def _flush_bucket(self, k: int) -> None:
        lo, hi, ps = self.buckets[k]
        if len(ps) == 1 and hi - lo > self.rbs and self._owned(lo, hi) is None:
            self._kept.append(self.params[ps[0]].grad)  # not cleared: autograd's to the end of the backward
        super()._flush_bucket(k)

    def accumulated_grad_bytes(self) -> int:
        return self._accum_bytes

    def after_backward(self) -> None:
        if self.ds_stage1_grads and not (self.hooked and self._at_boundary):
            # autograd's p.grad, accumulated to the boundary (its hooks, or reduce_gradients after it)
            self._note_autograd_grads()
        if self.hooked and self._at_boundary:  # the epilogue (engine.py allreduce_gradients: at the boundary only)
            if self._ptr != len(self._order):
                raise RuntimeError("stage 1: some parameters received no gradient in backward")
            self._flush_last_bucket()
            self._free_ipg()  # _release_ipg_buffers
            self._kept = []

    def boundary(self) -> None:
        if self.hooked:  # reduced in the boundary micro-step's hooks
            return
        with self.torch.no_grad():
            if self.ds_stage1_grads:
                self._reduce_all_12(lambda i: self.params[i].grad.reshape(-1))
                return
            fg = self.flat_grad
            self._reduce_all_12(fg if not self.ds else (lambda i: fg[self.offsets[i]:self.offsets[i] + self.numels[i]]))

    def _store_owned(self, reduced: Any, a: int, b: int) -> None:
        if self.ds_stage1_grads:  # copy_grads_in_partition: owned slices into grads_in_partition
            self._grad_part()[a - self.part_lo:b - self.part_lo].copy_(reduced)
        else:
            self.flat_grad[a:b].copy_(reduced)

    def _step_source(self) -> Any:
        if self.ds_stage1_grads:
            for p in self.params:  # free_grad_in_param_list before flattening
                p.grad = None
            return self._grad_part()
        return self.flat_grad[self.part_lo:self.part_lo + self.part_n]

    def _after_step(self) -> None:
        self._accum_bytes = 0
        if self.ds_stage1_grads:
            self.grad_part = None
        else:
            self._free_flat_grads()


class Stage2Strategy(Stage12Strategy):
    """Stage 2: each micro-step's gradients reduced into the owned partition (Ψ₁₂/N) during backward."""

    flush_in_next_hook = True

    def setup(self) -> None:
        super().setup()
        if self.ds:
            self._install_grad_hooks()

    def before_backward(self) -> None:
        if self.ds:
            self._ipg_slot = 0
            self._begin_backward_hooks()

    def _grad_ready(self, i: int) -> None:
        # DeepSpeed 0.19.8 stage_1_and_2.py process_gradients -> setup_buckets: the ipg bucket is allocated
        # at the first gradient hook of each backward (after the head's backward), not before the backward
        if self.ds:
            self._alloc_ipg(2 if self.overlap else 1)
        super()._grad_ready(i)

    def after_backward(self) -> None:
        if self.ds:
            if self._ptr != len(self._order):
                raise RuntimeError("stage 2: some parameters received no gradient in backward")
            self._flush_last_bucket()
            self._free_ipg()
        else:
            self._paper_reduce_scatter_12(lambda i: self.params[i].grad.reshape(-1))
            for p in self.params:
                p.grad = None
