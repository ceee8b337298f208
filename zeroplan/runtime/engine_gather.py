"""Stage 3 at run time: parameters gathered before a module's forward, released after its last use,
re-gathered before its backward (a custom autograd node on its output), and the bucketed
reduce-scatter that releases a module once its gradients are in (used by ``engine_stage3``)."""

from __future__ import annotations

from typing import Any


class Stage3Gather:
    """Stage 3 gather / release / reduce-scatter (a mixin of ``engine_stage3.Stage3Strategy``)."""

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

    def _arrived(self, j: int) -> None:
        """Gradient j is next in bucket order: copied into its padded slot of the ipg bucket and freed."""
        k = self._bucket_of[j]
        p = self.params[j]
        with self.torch.no_grad():
            if self.contiguous and self._bucket_total[k] <= self.rbs:
                pos, pad = self._pos3[j], self.chunk[j] * self.n
                seg = self.ipg[0][pos:pos + pad]
                seg[:self.numels[j]].copy_(p.grad.reshape(-1))
                seg[self.numels[j]:].zero_()
                p.grad = None

    def _flush_bucket(self, k: int) -> None:
        """Bucket k reduce-scattered into the gradient partition; modules whose gradients are all in released."""
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
