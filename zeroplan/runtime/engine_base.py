"""What every stage of the engine shares: memory-tagged allocation, the host scope of an offloaded
optimizer, the fp32 optimizer states and AdamW (split out of ``runtime/engine.py``)."""

from __future__ import annotations

import math
from typing import Any

from zeroplan.runtime.engine_util import FUSED_ADAM_CHUNK


class EngineBase:
    """Allocation and optimizer helpers of every ``StageStrategy`` (engine_strategy.py); the
    configuration they read is the engine's (``SHARED_FIELDS``), the buffers the strategy's."""

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

    def _host_grad_part(self) -> Any:
        """The bit16 gradient partition on the host (optimizer offload; pinned on CUDA)."""
        with self._host():
            t = self.torch.zeros(self.part_n, dtype=self.dtype, device=self.host)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return self._tag(t, "gradients", host=True)

    def _ready_order(self) -> list[int]:
        """Trainable parameters in gradient-ready (reverse forward) order."""
        return [i for i in range(len(self.params) - 1, -1, -1) if self.params[i].requires_grad]

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
            if self.mimic == "deepspeed-cuda" or self.zero.stage == 3:
                # stage_1_and_2.py step(): `del flat_grad_partition` before _optimizer_step; stage3.py
                # _prepare_fp32_grad_for_sub_group: `flatten(...).to(fp32)` keeps no bit16 copy, with either
                # accelerator
                del flat
        self._norm_sq = torch.dot(g32, g32).to(torch.float64) if g32.numel() else torch.zeros((), dtype=torch.float64)
        self._adamw(master, m, v, g32)
        del g32
        lp_out.copy_(master.to(lp_out.device) if master.device != lp_out.device else master)
