"""Stages 2-3: post-accumulate-grad hooks; gradients are bucketed in the ledger's canonical order
whatever order autograd produces them in (a ready-pointer walks it) (split out of
``runtime/engine.py``)."""

from __future__ import annotations


class GradHooks:
    """Gradient-ready hooks and the bucket flush they trigger."""

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
