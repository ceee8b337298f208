"""Stages 2-3: post-accumulate-grad hooks; gradients are bucketed in the ledger's canonical order
whatever order autograd produces them in (a ready-pointer walks it). A mixin of the stage-2 and
stage-3 strategies, which say what an arrival and a full bucket do (``_arrived``, ``_flush_bucket``)."""

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
        """Gradient j is next in bucket order (the strategy copies it into its bucket buffer)."""
        raise NotImplementedError

    def _begin_backward_hooks(self) -> None:
        self._ready = [False] * len(self.params)
        self._ptr = 0
        self._bucket_bufs, self._copied = {}, set()

    def _flush_bucket(self, k: int) -> None:
        """Every gradient of bucket k has arrived: reduce it (the strategy's reduction)."""
        raise NotImplementedError
