"""Stages 2-3: post-accumulate-grad hooks; gradients are bucketed in the ledger's canonical order
whatever order autograd produces them in (a ready-pointer walks it). A mixin of the stage-2 and
stage-3 strategies, which say what an arrival and a full bucket do (``_arrived``, ``_flush_bucket``)."""

from __future__ import annotations


class GradHooks:
    """Gradient-ready hooks and the bucket flush they trigger."""

    # True: a full bucket is flushed in the hook of the gradient that overflows it, before that gradient
    # is copied in, and the last one after the backward (DeepSpeed 0.19.8 stage_1_and_2.py
    # reduce_independent_p_g_buckets_and_remove_grads and its epilogue: ``_flush_last_bucket``);
    # False: as soon as its last gradient has arrived
    flush_in_next_hook = False

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
        self._first_in_bucket = {ps[0]: k for k, (_, _, ps) in enumerate(self.buckets)}
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i)))

    def _grad_ready(self, i: int) -> None:
        self._ready[i] = True
        order = self._order
        while self._ptr < len(order) and self._ready[order[self._ptr]]:
            j = order[self._ptr]
            self._ptr += 1
            if self.flush_in_next_hook:
                if self._first_in_bucket.get(j, 0) > 0:
                    self._flush_bucket(self._first_in_bucket[j] - 1)
                self._arrived(j)
            else:
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

    def _flush_last_bucket(self) -> None:
        """The epilogue's flush of the bucket still open after the backward (``flush_in_next_hook``)."""
        if self.flush_in_next_hook and self.buckets:
            self._flush_bucket(len(self.buckets) - 1)

    def _flush_bucket(self, k: int) -> None:
        """Every gradient of bucket k has arrived: reduce it (the strategy's reduction)."""
        raise NotImplementedError
