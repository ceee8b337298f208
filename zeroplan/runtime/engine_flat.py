"""Stages 0-2: the flat parameter buffer, its gradient buckets and gradient partition, and their
optimizer step (split out of ``runtime/engine.py``, whose docstring describes the schedule)."""

from __future__ import annotations

from typing import Any

from zeroplan.runtime.engine_util import STAGE0_BUCKET_ELEMS, ceil_div, grad_span, greedy_buckets, greedy_buckets_after


class FlatStages:
    """Stages 0, 1 and 2 over one flat buffer."""

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

    def _step0(self) -> None:
        """Stage 0: AdamW over the whole flat buffer (fp32 DeepSpeed: then the norm all-reduce)."""
        torch = self.torch
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

    def _step12(self) -> None:
        """Stages 1-2: AdamW on the owned partition, the flag and norm all-reduces, the all-gather."""
        torch = self.torch
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
