"""The backward pass as a sequence of moments: what is live at each, so that buffers DeepSpeed allocates
part-way through the backward are only stacked on the activations they really coexist with.

Each moment holds the bytes that do not depend on the micro-batch (DeepSpeed buffers, gradients beyond
those live in the forward) and says which activations are live beside them (``activation_at``):
- ``head``: the loss, log-softmax and lm_head backward (``ActivationBreakdown.backward_head_peak``);
- ``layer``: the backward of the layer ``layers_done`` below the top (``backward_layer_peak`` less
  ``layers_done`` × ``per_layer``: every layer already back-propagated has freed what it kept);
- ``peak``: the larger of both (where the engine's buffers exist for the whole backward);
- ``none``: the end of the backward, the activations freed.

ZeRO stage 2 with contiguous gradients (DeepSpeed 0.19.8 ``stage_1_and_2.py``):
- ``setup_buckets`` allocates the ipg bucket (two with ``overlap_comm``) at the first gradient hook
  of each backward (``process_gradients``), after the head's logit-sized transients are freed (the
  hook runs once lm_head's MmBackward node has consumed the logits' gradient), and
  ``_release_ipg_buffers`` frees it, and drops ``grads_in_partition``, at the end of the backward;
- ``reduce_independent_p_g_buckets_and_remove_grads`` flushes the bucket before a gradient that would
  overflow it, inside the backward of that gradient's layer: ``allreduce_bucket`` flattens the
  bucket (a copy of its elements in the communication dtype) while the layers below it still hold
  their activations;
- ``copy_grads_in_partition`` allocates ``grads_in_partition`` (the whole parameters overlapping the
  rank's slice) after the first flush's reduction, when the flatten copy is already freed;
- the epilogue flushes the last bucket with the activations gone.
Every other stage keeps the two moments the plan always had: its buffers beside the activations'
backward peak, and the gradients and buffers at the end.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from zeroplan.core.layout import Layout
from zeroplan.core.stage3_live import BackwardGathered

__all__ = ["BackwardMoment", "activation_at", "backward_moments", "scatter_temp_elements", "set_backward_side", "stage2_flushes"]


class BackwardMoment(BaseModel):
    """Bytes live at one moment of the backward, beside the parameters and optimizer states."""

    what: str
    buffers: int  # DeepSpeed (and cuBLAS) buffers live then
    held_buffers: int  # of which allocated at their own size (no split slack: core/allocator.py)
    gradients: int  # gradient bytes live then (beyond those live through the forward)
    activations: str  # "head", "layer", "peak" or "none" (activation_at)
    layers_done: int = 0  # layers already back-propagated below the top ("layer")
    # bytes on each side stream's pool then (stage 3: "allgather", "reduce_scatter"); None: the phase's
    side: dict[str, int] | None = None


def activation_at(act: Any, kind: str, layers_done: int) -> int:
    """The activation bytes live at a moment (``act``: core.activation_terms.ActivationBreakdown)."""
    if kind == "none":
        return 0
    if kind == "peak":
        return act.backward_peak
    if kind == "head":
        return act.backward_peak if act.backward_head_peak is None else act.backward_head_peak
    top = act.backward_peak if act.backward_layer_peak is None else act.backward_layer_peak
    return max(0, top - layers_done * act.per_layer)


def stage2_flushes(layout: Layout, bucket_elems: int) -> tuple[list[tuple[int, int]], int]:
    """(elements, layers back-propagated before it) of every flush inside the backward, in gradient-ready
    order, and the elements of the last bucket (flushed by the epilogue). A hook of a gradient outside
    the decoder layers counts as the top layer's (final norm, lm_head: their gradients come first) or,
    once the layers' gradients have begun, as the bottom one's (the embeddings)."""
    flushes, last = _flushes(layout, bucket_elems)
    return [(sum(b), done) for b, done in flushes], sum(last)


def _flushes(layout: Layout, bucket_elems: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """``stage2_flushes`` with each bucket's tensor sizes (stage 3's reduce-scatter pads each one).
    Kept on the layout (never mutated) per bucket size."""
    key = ("bucket_flushes", bucket_elems)
    if key in layout._memo:
        return layout._memo[key]
    n_layers = 1 + max((t.layer for t in layout.tensors if t.layer is not None), default=0)
    cur: list[int] = []
    total, seen_layer = 0, False
    flushes: list[tuple[list[int], int]] = []
    for t in reversed(layout.tensors):
        seen_layer = seen_layer or t.layer is not None
        done = n_layers - 1 - t.layer if t.layer is not None else (n_layers - 1 if seen_layer else 0)
        # stage_1_and_2.py and stage3.py: bucket.elements + numel > reduce_bucket_size, bucket not empty
        if cur and total + t.numel > bucket_elems:
            flushes.append((cur, done))
            cur, total = [], 0
        cur.append(t.numel)
        total += t.numel
    layout._memo[key] = (flushes, cur)
    return flushes, cur


def scatter_temp_elements(sizes: list[int], n: int) -> int:
    """Elements of the interleaved copy stage 3's reduce-scatter makes of a bucket (DeepSpeed 0.19.8
    ``comm/coalesced_collectives.py`` ``reduce_scatter_coalesced``: each gradient padded to a multiple
    of the world size, none for a lone gradient that divides evenly)."""
    if len(sizes) == 1 and sizes[0] % n == 0:
        return 0
    return sum(-(-s // n) * n for s in sizes)


def backward_moments(pb: Any, layout: Layout, *, stage: int, off_opt: str, b_c: int, bucket_elems: int,
                     grads_end: int, b_p: int = 2, gathered: BackwardGathered | None = None) -> list[BackwardMoment]:
    """The moments of one backward (``pb``: core.memory_buffers.PhaseBuffers; ``gathered``: stage 3's
    gathered parameters through the backward, core/stage3_live.py)."""
    held = pb.held.get("backward", 0)
    ipg = pb.detail.get("ipg_bucket", 0)
    if stage == 3 and gathered is not None and ipg:
        return _stage3(pb, layout, b_c=b_c, b_p=b_p, bucket_elems=bucket_elems, grads_end=grads_end, gathered=gathered)
    if stage != 2 or off_opt != "none" or not ipg:  # ipg_bucket: contiguous gradients
        return [BackwardMoment(what="backward start", buffers=pb.backward, held_buffers=held, gradients=0,
                               activations="peak"),
                BackwardMoment(what="backward end", buffers=pb.backward, held_buffers=held, gradients=grads_end,
                               activations="none")]
    flushes, last = stage2_flushes(layout, bucket_elems)
    lazy = ipg + pb.detail.get("allreduce_flatten", 0) + pb.detail.get("gradient_partition_whole_params", 0)
    other, other_held = pb.backward - lazy, held - ipg
    out = [BackwardMoment(what="head backward (before the first gradient hook)", buffers=other, held_buffers=other_held,
                          gradients=0, activations="head"),
           BackwardMoment(what="top layer backward, ipg bucket allocated", buffers=other + ipg, held_buffers=held,
                          gradients=0, activations="layer")]
    if flushes:
        (first, d1), later = flushes[0], flushes[1:]
        out.append(BackwardMoment(what="first bucket flush (flatten copy)", buffers=other + ipg + b_c * first,
                                  held_buffers=held, gradients=0, activations="layer", layers_done=d1))
        out.append(BackwardMoment(what="after the first flush (grads_in_partition allocated)", buffers=other + ipg,
                                  held_buffers=held, gradients=grads_end, activations="layer", layers_done=d1))
        if later:  # the highest activations among them are the earliest's; the largest flatten among them
            out.append(BackwardMoment(what="later bucket flushes", buffers=other + ipg + b_c * max(e for e, _ in later),
                                      held_buffers=held, gradients=grads_end, activations="layer",
                                      layers_done=later[0][1]))
    out.append(BackwardMoment(what="backward end (epilogue flush)", buffers=other + ipg + b_c * last, held_buffers=held,
                              gradients=grads_end, activations="none"))
    return out


def _stage3(pb: Any, layout: Layout, *, b_c: int, b_p: int, bucket_elems: int, grads_end: int,
            gathered: BackwardGathered) -> list[BackwardMoment]:
    """Stage 3 (DeepSpeed 0.19.8 ``stage3.py``): the ipg bucket lives from ``__init__``; each flush
    (``__reduce_and_partition_ipg_grads``) makes the reduce-scatter's interleaved copy of the bucket
    inside the backward of the layer whose gradient would overflow it; the gathered parameters are
    what the coordinator holds then (core/stage3_live.py). A layer's moment is kept only where its
    buffers exceed every layer's above it (those stack on more activations)."""
    held = pb.held.get("backward", 0)
    other = pb.backward - pb.detail.get("gathered_params_backward", 0) - pb.detail.get("reduce_scatter_temp", 0)
    flushes, last = _flushes(layout, bucket_elems)
    temp_at: dict[int, int] = {}
    for sizes, done in flushes:
        temp_at[done] = max(temp_at.get(done, 0), b_c * scatter_temp_elements(sizes, layout.n))

    def moment(what: str, g: int, temp: int, activations: str, done: int = 0, grads: int = 0,
               extra: int = 0) -> BackwardMoment:
        return BackwardMoment(what=what, buffers=other + b_p * g + temp + extra, held_buffers=held, gradients=grads,
                              activations=activations, layers_done=done,
                              side={"allgather": b_p * g, "reduce_scatter": temp})

    out = [moment("head backward (lm_head, final norm)", gathered.head, 0, "head"),
           # autograd's AccumulateGrad allocates lm_head's whole weight gradient before DeepSpeed's hook copies
           # it into the bucket (stage3.py reduce_partition_and_remove_grads); the logits and their fp32
           # gradients are freed by then: the activations are at least those of the top layer's backward
           moment("lm_head weight gradient (before its hook)", gathered.head, 0, "layer", extra=b_p * _head_numel(layout))]
    top = -1
    for done, g in enumerate(gathered.layers):
        temp = temp_at.get(done, 0)
        if b_p * g + temp > top:
            out.append(moment(f"backward of layer {len(gathered.layers) - 1 - done}" + (" (bucket flush)" if temp else ""),
                              g, temp, "layer", done))
            top = b_p * g + temp
    out.append(moment("backward end (epilogue flush)", gathered.bottom, b_c * scatter_temp_elements(last, layout.n),
                      "none", grads=grads_end))
    return out


def set_backward_side(side_pools: dict[str, dict[str, int]], moments: list[BackwardMoment], chosen: int) -> None:
    """Where the moments say what each side stream holds: the pools' backward bytes become the chosen
    moment's (the part of its live bytes not on the default stream), and each pool's maximum over the
    backward is kept as ``backward_max`` (its cached segments, core/allocator.py reserved_bytes)."""
    if moments[chosen].side is None:
        return
    for pool in moments[chosen].side:
        bytes_at = [m.side.get(pool, 0) for m in moments if m.side is not None]
        side_pools.setdefault(pool, {})["backward"] = moments[chosen].side[pool]
        side_pools[pool]["backward_max"] = max(bytes_at)


def _head_numel(layout: Layout) -> int:
    """The largest parameter after the decoder layers (lm_head; the final norm is small): the first
    gradient of the backward."""
    out = 0
    for t in reversed(layout.tensors):
        if t.layer is not None:
            break
        out = max(out, t.numel)
    return out
