"""Gradient buckets as DeepSpeed 0.19.8's hooks fill them, and how stage 3 reduces each one.

Filling (stages 1-3, ``stage_1_and_2.py`` and ``stage3.py``
``reduce_independent_p_g_buckets_and_remove_grads``): gradients arrive in gradient-ready order (the
layout's tensors reversed); the bucket is flushed before a gradient that would overflow it, when it
holds any (``bucket.elements + param.ds_numel > reduce_bucket_size and bucket.elements > 0``, on the
unpadded sizes), and the epilogue flushes the last one. A gradient larger than the bucket is thus a
bucket of its own, and is never copied into the contiguous buffer (``__add_grad_to_ipg_bucket`` copies
only while ``bucket.elements + numel <= reduce_bucket_size``).

Reducing a stage-3 bucket (``__reduce_and_partition_ipg_grads``), two ways:
- with ``contiguous_gradients`` and ``reduce_scatter: false`` (the ZeRO++ tutorial's config), a bucket
  that fits the buffer is all-reduced in place (``__avg_scatter_contiguous_grads``): its unpadded
  elements, no padding; then it is post-scaled out of place (a copy of the bucket, on more than one rank)
  and each rank takes its slice of that copy. An all-reduce moves twice a reduce-scatter's bytes, and qgZ
  (which replaces only the reduce-scatter) does not apply to it;
- otherwise ``__avg_scatter_grads``: ``reduce_scatter_coalesced`` pads each gradient to a multiple of
  the world size and interleaves them in one copy (none for a lone gradient that divides evenly), or
  qgZ's ``all_to_all_quant_reduce`` across nodes.

Stage 1 without ``overlap_comm`` reduces after autograd's backward (``reduce_gradients``), in parameter
order: each gradient no larger than the bucket is moved into it (autograd's storage freed), a larger one
stays autograd's, and no reduced gradient is cleared. At the first flush that holds a parameter of a rank's
partition, ``reduce_ipg_grads`` -> ``copy_grads_in_partition`` allocates that rank's gradient partition
buffer (the whole parameters overlapping its partition) beside every gradient not yet moved
(``stage1_partition_copy_extra``).
"""

from __future__ import annotations

from bisect import bisect_right

from zeroplan.core.layout import Layout

__all__ = ["ready_buckets", "bucket_sizes", "lone_oversized", "scatter_temp_elements", "stage3_all_reduced",
           "stage3_flush_temp_elements", "stage1_partition_copy_extra", "stage0_flatten_elements"]


def ready_buckets(layout: Layout, bucket_elems: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """(every flush inside the backward as (its tensors' element counts, layers back-propagated before
    it), the last bucket's element counts, flushed by the epilogue). A hook of a gradient outside the
    decoder layers counts as the top layer's (final norm, lm_head: their gradients come first) or, once
    the layers' gradients have begun, as the bottom one's (the embeddings). Kept on the layout (never
    mutated) per bucket size."""
    key = ("bucket_flushes", bucket_elems)
    if key in layout._memo:
        return layout._memo[key]
    n_layers = 1 + max((t.layer for t in layout.tensors if t.layer is not None), default=0)
    cur: list[int] = []
    total, seen_layer = 0, False
    flushes: list[tuple[list[int], int]] = []
    for t in layout.grad_ready:
        seen_layer = seen_layer or t.layer is not None
        done = n_layers - 1 - t.layer if t.layer is not None else (n_layers - 1 if seen_layer else 0)
        if cur and total + t.numel > bucket_elems:
            flushes.append((cur, done))
            cur, total = [], 0
        cur.append(t.numel)
        total += t.numel
    layout._memo[key] = (flushes, cur)
    return flushes, cur


def bucket_sizes(layout: Layout, bucket_elems: int) -> list[list[int]]:
    """Every bucket's element counts in gradient-ready order (``ready_buckets`` without the layers)."""
    flushes, last = ready_buckets(layout, bucket_elems)
    return [sizes for sizes, _ in flushes] + ([last] if last else [])


def lone_oversized(sizes: list[int], bucket_elems: int) -> int:
    """Elements of a bucket's lone gradient larger than the bucket (DeepSpeed keeps it as autograd's
    until the flush that reduces it), else 0."""
    return sizes[0] if len(sizes) == 1 and sizes[0] > bucket_elems else 0


def scatter_temp_elements(sizes: list[int], n: int) -> int:
    """Elements of the interleaved copy stage 3's reduce-scatter makes of a bucket (``comm/
    coalesced_collectives.py`` ``reduce_scatter_coalesced``: each gradient padded to a multiple of the
    world size, none for a lone gradient that divides evenly)."""
    if len(sizes) == 1 and sizes[0] % n == 0:
        return 0
    return sum(-(-s // n) * n for s in sizes)


def stage3_all_reduced(sizes: list[int], bucket_elems: int, *, reduce_scatter: bool, contiguous: bool) -> bool:
    """True where stage 3 all-reduces this bucket in place rather than reduce-scattering it
    (``__reduce_and_partition_ipg_grads``: ``contiguous_gradients and bucket.elements <=
    reduce_bucket_size and not reduce_scatter``)."""
    return contiguous and not reduce_scatter and sum(sizes) <= bucket_elems


def stage3_flush_temp_elements(sizes: list[int], n: int, bucket_elems: int, *, reduce_scatter: bool,
                               contiguous: bool) -> int:
    """Elements of the copy a stage-3 flush makes of its bucket (in the communication dtype, the gradients'
    in every plan zeroplan makes).

    - All-reduced (``reduce_scatter`` off, a bucket that fits): the all-reduce runs in place in the ipg
      buffer, but ``__avg_scatter_contiguous_grads`` then post-scales it out of place,
      ``buffer.mul(gradient_predivide_factor)``, whenever that factor (1.0 by default) is not the averaging
      world size: a copy of the whole bucket, which the rank's partitions are views of until they are
      copied into the gradient partition. None on one rank. Measured on real DeepSpeed 0.19.8 (6 ranks,
      ``examples/validation/cpu-replay/peak-live-stage3-rsoff-*.json``): every such flush raised the live
      bytes by exactly twice its elements in bf16. ``prescale_gradients: true`` or a predivide factor equal
      to the world size would skip it; zeroplan plans DeepSpeed's defaults.
    - Reduce-scattered: ``reduce_scatter_coalesced``'s interleaved copy (``scatter_temp_elements``)."""
    if stage3_all_reduced(sizes, bucket_elems, reduce_scatter=reduce_scatter, contiguous=contiguous):
        return sum(sizes) if n > 1 else 0
    return scatter_temp_elements(sizes, n)


def stage1_partition_copy_extra(layout: Layout, bucket_elems: int) -> int:
    """Elements stage 1's reduction after the backward holds beyond the model's gradients, on the heaviest rank:
    its gradient partition buffer, less the gradients already moved into the bucket (freed) by the flush that
    allocates it; 0 where the buffer comes after more than its size has been moved (the backward's end, every
    gradient and the bucket, is then the larger moment). Over the distinct ranks' spans, not every rank."""
    key = ("stage1_partition_copy", bucket_elems)
    if key in layout._memo:
        return layout._memo[key]
    starts = [lo for lo, _ in layout.bucket_ranges_12(bucket_elems, "forward")]
    moved = [0] * len(starts)  # gradients moved into the bucket by each flush, then through each flush
    pos = 0
    for t in layout.tensors:
        if t.numel <= bucket_elems:
            moved[bisect_right(starts, pos) - 1] += t.numel
        pos += t.numel
    for k in range(1, len(moved)):
        moved[k] += moved[k - 1]
    best = 0
    for lo, hi in layout.grad_partition_spans_12:
        if lo >= layout.params:  # a partition of padding only: no parameter, no copy
            continue
        k = bisect_right(starts, lo) - 1
        best = max(best, (hi - lo) - moved[k])
    layout._memo[key] = best
    return best


def stage0_flatten_elements(layout: Layout, bucket_elems: int) -> int:
    """Elements of the largest copy stage 0's gradient all-reduce makes (engine.py ``allreduce_no_retain``:
    the gradients in parameter order, a tensor added before the bucket is flushed once it is over
    ``bucket_elems``; ``allreduce_bucket`` flattens the bucket, and torch's ``flatten_dense_tensors``
    returns a lone tensor as a view, so a bucket of one tensor is reduced in place)."""
    key = ("stage0_flatten", bucket_elems)
    if key not in layout._memo:
        best = count = total = 0
        for t in layout.tensors:
            count, total = count + 1, total + t.numel
            if total > bucket_elems:
                best = max(best, total if count > 1 else 0)
                count = total = 0
        layout._memo[key] = max(best, total if count > 1 else 0)
    return layout._memo[key]

