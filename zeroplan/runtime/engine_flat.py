"""Stage 0 and the flat parameter buffer it shares with stages 1-2: layout, gradient buckets in flat
coordinates, the flat gradient buffer (``runtime/engine.py``'s docstring describes the schedule)."""

from __future__ import annotations

from typing import Any

from zeroplan.runtime.engine_strategy import StageStrategy
from zeroplan.runtime.engine_util import STAGE0_BUCKET_ELEMS, greedy_buckets, greedy_buckets_after


class FlatLayout:
    """The params as views into one flat buffer (stages 0-2); frozen params stay whole, outside it."""

    def _flatten_params(self, size: int, zero: bool) -> None:
        """``flat_param`` of ``size`` elements (``zero``: zero-filled, for the padding after Ψ); every
        param becomes a view into it."""
        torch = self.torch
        for p in self.frozen:  # held whole, as the module holds them
            self._tag(p.data, "params")
        self.flat_param = self._empty(size, "params", zero=zero)
        self.offsets = []
        off = 0
        with torch.no_grad():
            for p, k, shape in zip(self.params, self.numels, self.shapes):
                self.flat_param[off:off + k].copy_(p.detach().reshape(-1))
                p.data = self.flat_param[off:off + k].view(shape)
                self.offsets.append(off)
                off += k
        self.flat_grad = None

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

    def _note_autograd_grads(self) -> None:
        """Keep the most bytes autograd's ``p.grad`` have held after a backward (``accumulated_grad_bytes``:
        the model-state figure where no tagged buffer holds the gradients)."""
        self._accum_bytes = max(self._accum_bytes, sum(p.grad.numel() * p.grad.element_size()
                                                       for p in self.params if p.grad is not None))

    def _free_flat_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.flat_grad = None


class Stage0Strategy(FlatLayout, StageStrategy):
    """Stage 0: every rank holds everything; the gradients are all-reduced once per optimizer step.

    As DeepSpeed 0.19.8 without ZeRO: autograd allocates each ``p.grad`` as the backward reaches it (no
    flat gradient buffer: the head's backward runs with no gradient allocated, measured on real DeepSpeed,
    examples/validation/cpu-replay/peak-live-stage0-*.json); ``buffered_allreduce_fallback`` all-reduces
    them in buckets of the parameters that have one, each flattened into a copy (a lone tensor is a view:
    torch's ``flatten_dense_tensors``) and copied back; the step reads them and ``zero_grad`` frees them."""

    def setup(self) -> None:
        self._accum_bytes = 0
        self._flatten_params(self.psi, zero=False)
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
        if self.ds:  # DeepSpeed's allreduce_no_retain: constant 5e8 elements, forward order, flush after adding
            self.buckets = self._flat_buckets("forward", STAGE0_BUCKET_ELEMS, after=True)
        else:
            self.buckets = self._flat_buckets("reverse", self.rbs)

    def before_backward(self) -> None:
        pass  # autograd allocates (or, after the first micro-step, accumulates into) each p.grad

    def after_backward(self) -> None:
        self._note_autograd_grads()

    def accumulated_grad_bytes(self) -> int:
        return self._accum_bytes

    def boundary(self) -> None:
        """Each bucket's gradients flattened into one copy (none for a lone tensor), all-reduced, averaged
        and copied back (engine.py ``allreduce_and_copy``)."""
        torch = self.torch
        with torch.no_grad():
            for _, _, ps in self.buckets:
                grads = [self.params[i].grad for i in ps if self.params[i].grad is not None]
                if not grads:
                    continue
                if len(grads) == 1:
                    flat = grads[0].view(-1)
                else:
                    flat = self._tag(torch.cat([g.reshape(-1) for g in grads]), "buffers")  # flatten copy
                self.comm.all_reduce(flat)
                flat.div_(self.n)
                if len(grads) > 1:
                    at = 0
                    for g in grads:
                        g.copy_(flat[at:at + g.numel()].view_as(g))
                        at += g.numel()
                del flat, grads

    def _fp32_grads(self) -> Any:
        """The gradients as one fp32 vector for the flat AdamW. bf16/fp16 with DeepSpeed's FusedAdam (the
        ``deepspeed-cuda`` mimic: FP16_Optimizer.step): every gradient cast to fp32 and the casts flattened
        into one vector, both live at once, then the 16-bit gradients dropped. Otherwise (a client torch
        optimizer, FP16_UnfusedOptimizer.step): each cast to fp32 beside its 16-bit gradient, which stays
        until ``zero_grad``. fp32 (no wrapper: Adam steps the parameters' own gradients): moved into the
        vector one by one, each freed once moved, so the step holds Ψ gradient elements as DeepSpeed does
        (plus one tensor for a moment)."""
        torch = self.torch
        if self.mixed and self.fused_adam:
            casts = [self._tag(p.grad.float() if p.grad is not None else torch.zeros(n, device=self.device),
                               "buffers") for p, n in zip(self.params, self.numels)]
            g32 = self._tag(torch.cat([c.reshape(-1) for c in casts]), "buffers")
            del casts
            for p in self.params:
                p.grad = None
            return g32
        g32 = self._empty(self.psi, "buffers", dtype=torch.float32, zero=True)
        with torch.no_grad():
            for p, off, n in zip(self.params, self.offsets, self.numels):
                if p.grad is not None:
                    g32[off:off + n].copy_(p.grad.reshape(-1))
                    if not self.mixed:
                        p.grad = None
        return g32

    def step(self) -> None:
        """AdamW over the whole flat buffer (fp32 DeepSpeed: then the norm all-reduce)."""
        torch = self.torch
        g32 = self._fp32_grads()
        self._norm_sq = torch.dot(g32.reshape(-1), g32.reshape(-1)).to(torch.float64)
        self._adamw(self.master, self.m, self.v, g32)
        del g32
        if self.master is not self.flat_param:
            self.flat_param.copy_(self.master)
        self._free_flat_grads()
        if self.ds and not self.mixed:  # DeepSpeed 0.19.8: fp32 stage 0 all-reduces the norm
            norm = self._norm_sq.reshape(1).to(device=self.device, dtype=torch.float32)
            self.comm.all_reduce(norm)
