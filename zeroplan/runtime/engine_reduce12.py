"""Stages 1-2: gradient buckets reduced into the owner's partition: ipg buffers (double-buffered with
``overlap_comm``), owner-boundary slices packed into all-reduces or ``reduce``d, the paper
flavour's partition-aligned reduce-scatter (used by ``engine_stage12``)."""

from __future__ import annotations

from typing import Any


class BucketReduce12:
    """The stage 1-2 bucket reduction (a mixin of ``engine_stage12.Stage12Strategy``, which owns the
    partition, the ipg buffers and ``_store_owned``)."""

    def _reduce_bucket_12(self, k: int, source: Any) -> None:
        """Reduce bucket k (flat [lo, hi)); ``source(i)`` gives param i's gradient (flat view).

        The bucket is sliced at owner-partition boundaries; with multi-rank all-reduce the
        slices are packed (flush after adding once over ``reduce_bucket_size``) into
        all-reduces, of a flatten copy where a group has two or more slices; otherwise every
        slice is ``reduce``d to its owner.
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
        elif len(ps) == 1:  # a lone gradient larger than the bucket is reduced where autograd left it
            buf = source(next(iter(ps)))  # (DeepSpeed's extra_large_param_to_reduce)
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
            groups: list[tuple[int, int, int]] = []  # (start, end, pieces)
            start, run, pieces = None, 0, 0
            for a, b in slices:
                start = a if start is None else start
                run, pieces = run + b - a, pieces + 1
                if run > self.rbs:
                    groups.append((start, b, pieces))
                    start, run, pieces = None, 0, 0
            if start is not None:
                groups.append((start, slices[-1][1], pieces))
            # with overlap_comm the all-reduce runs on DeepSpeed's reduction stream, and
            # allreduce_and_copy_with_multiple_ranks copies the result back and drops the flatten copy in
            # the same call: the caching allocator frees it at once (stream-ordered), so a flush's copy never
            # outlives the flush. Work.wait() on NCCL only orders the current stream after the collective.
            async_op = self.overlap and slot is not None
            for a, b, pieces in groups:
                src = buf[a - lo:b - lo]
                # DeepSpeed's flatten copy: flatten_dense_tensors of one piece is a view
                flat = self._tag(src.clone(), "buffers") if pieces > 1 else src
                item = [self.comm.all_reduce(flat, async_op=async_op), flat, (a, b), src]
                del flat  # held by the item alone, so that _finish_12 can free it
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

    def _finish_12(self, item: list) -> None:
        """Complete one all-reduce: [handle, flatten copy or the bucket's view, (lo, hi), the bucket's view].
        As DeepSpeed's ``allreduce_and_copy_with_multiple_ranks``, the reduced values are copied back into
        the bucket and the flatten copy is freed before the owned slice is stored (where stage 2 allocates
        its gradient partition: ``copy_grads_in_partition``)."""
        h, (lo, hi), src = item[0], item[2], item[3]
        if h is not None:
            h.wait()
        if item[1] is not src:
            src.copy_(item[1])
        item[0] = item[1] = None
        own = self._owned(lo, hi)
        if own is not None:
            a, b = own
            self._accumulate_owned(src[a - lo:b - lo], a, b)

    def _accumulate_owned(self, reduced: Any, a: int, b: int) -> None:
        """Averaged gradient slice [a, b) (flat coordinates) into this rank's partition."""
        reduced.div_(self.n)
        self._store_owned(reduced, a, b)  # stage 1: copied into the full gradients; stage 2: added

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
