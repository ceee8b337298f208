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
Stage 1 (its bucket from the first hook, its reduction after autograd's backward), stage 0 and the
offload paths: the head's or the activations' backward peak, and the gradients and buffers at the end
(``_two_ends``).

Autograd's own gradients (``autograd``, every stage; torch ``engine.cpp`` / ``input_buffer.cpp``):
- lm_head's weight gradient exists before its hook copies it into DeepSpeed's bucket;
- a tied weight (lm_head reading the embedding's Parameter) has one ``AccumulateGrad`` node fed by
  both uses, so the engine keeps lm_head's contribution in the node's input buffer through the whole
  backward, and at the embedding's backward adds the embedding's dense gradient to it out of place
  (``accumulate``: ``old_var + var``): three weight-sized gradients at once, after which the sum is
  what the hook (or ``p.grad``) receives. Measured on real DeepSpeed 0.19.8 (2 layers of Qwen2.5-3B,
  ``examples/validation/cpu-replay/peak-live-tied-*.json``): this moment is the peak of stages 1, 2 and 3.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from zeroplan.core.grad_buckets import (
    lone_oversized, ready_buckets, stage1_partition_copy_extra, stage3_flush_temp_elements,
)
from zeroplan.core.layout import Layout
from zeroplan.core.stage3_live import BackwardGathered

__all__ = ["BackwardMoment", "HeadGradients", "activation_at", "head_gradients", "backward_moments", "set_backward_side",
           "stage2_flushes"]


class BackwardMoment(BaseModel):
    """Bytes live at one moment of the backward, beside the parameters and optimizer states."""

    what: str
    buffers: int  # DeepSpeed (and cuBLAS) buffers live then
    held_buffers: int  # of which allocated at their own size (no split slack: core/allocator.py)
    gradients: int  # gradient bytes live then (beyond those live through the forward)
    activations: str  # "head", "layer", "layer_start", "peak" or "none" (activation_at)
    layers_done: int = 0  # layers already back-propagated below the top ("layer")
    # bytes on each side stream's pool then (stage 3: "allgather", "reduce_scatter"); None: the phase's
    side: dict[str, int] | None = None
    # gradients autograd holds then, not yet handed to DeepSpeed's hook (beside ``gradients``; they churn
    # with the activations: core/memory.py held_bytes)
    autograd: int = 0


def activation_at(act: Any, kind: str, layers_done: int) -> int:
    """The activation bytes live at a moment (``act``: core.activation_terms.ActivationBreakdown). Stage 3's
    forward moments (core/memory.py ``forward_moments``): ``fwd_layer``, the forward of the layer with
    ``layers_done`` layers above it (the top layer's forward peak, a layer's kept activations less per layer
    above; the embeddings' forward counts every layer as above it), ``fwd_head`` (lm_head's fetch: all but the
    logits) and ``fwd_loss`` (the loss). Without those traced regions, the forward's peak. The backward's:
    ``head``, ``layer`` (the layer's backward at its most), ``layer_start`` (what the layers saved when the
    layer's backward starts, before its transients; where the trace gives no such level, ``layer``),
    ``peak`` and ``none``."""
    if kind.startswith("fwd_"):
        if kind == "fwd_head":
            return act.total - act.logits
        if kind == "fwd_loss":
            return act.forward_peak if act.forward_loss_peak is None else act.forward_loss_peak
        top = act.forward_peak if act.forward_layer_peak is None else act.forward_layer_peak
        return max(0, top - layers_done * act.per_layer)
    if kind == "none":
        return 0
    if kind == "peak":
        return act.backward_peak
    if kind == "head":
        return act.backward_peak if act.backward_head_peak is None else act.backward_head_peak
    top = act.backward_peak if act.backward_layer_peak is None else act.backward_layer_peak
    if kind == "layer_start" and act.backward_layer_start is not None:
        top = act.backward_layer_start
    return max(0, top - layers_done * act.per_layer)


def stage2_flushes(layout: Layout, bucket_elems: int) -> tuple[list[tuple[int, int]], int]:
    """(elements, layers back-propagated before it) of every flush inside the backward, in gradient-ready
    order, and the elements of the last bucket (flushed by the epilogue). A hook of a gradient outside
    the decoder layers counts as the top layer's (final norm, lm_head: their gradients come first) or,
    once the layers' gradients have begun, as the bottom one's (the embeddings)."""
    flushes, last = ready_buckets(layout, bucket_elems)
    return [(sum(b), done) for b, done in flushes], sum(last)


class HeadGradients(BaseModel):
    """Elements of the gradients autograd makes at the two ends of the backward, from the layout's spec."""

    head: int  # lm_head's weight gradient: its own weight's, or the embedding's it is tied to
    tied: int  # a trained weight lm_head shares with the embedding (0: untied, or frozen)
    embed: int  # the embedding's gradient if it is the backward's last (the layout's first tensor), else 0


def head_gradients(layout: Layout) -> HeadGradients:
    """lm_head's, the tied weight's and the embedding's gradient elements (``layout`` holds the trained
    parameters: a frozen weight has none). Without a per-tensor spec: the largest tensor after the
    decoder layers as lm_head's, nothing tied."""
    if "head_gradients" in layout._memo:
        return layout._memo["head_gradients"]
    numel = {t.name: t.numel for t in layout.tensors}
    spec = layout._spec
    head, tied = 0, 0
    for t in spec.tensors if spec is not None else ():
        if t.role == "lm_head":
            head = max(head, numel.get(t.tied_to or t.name, 0))
            if t.tied_to is not None:
                tied += numel.get(t.tied_to, 0)
    if spec is None or not any(t.role == "lm_head" for t in spec.tensors):
        head = _head_numel(layout)
    first = layout.tensors[0] if layout.tensors else None
    roles = {t.name: t.role for t in spec.tensors} if spec is not None else {}
    embed = first.numel if first is not None and roles.get(first.name) in ("embed", "pos_embed") else 0
    out = HeadGradients(head=head, tied=tied, embed=embed)
    layout._memo["head_gradients"] = out
    return out


def backward_moments(pb: Any, layout: Layout, *, stage: int, off_opt: str, b_c: int, bucket_elems: int,
                     grads_end: int, b_p: int = 2, gathered: BackwardGathered | None = None, overlap: bool = False,
                     grads_in_p_grad: bool = False, multi_rank_flatten: bool = True,
                     keep_oversized: bool = False, reduce_scatter: bool = True,
                     lp_grads_end: int = 0) -> list[BackwardMoment]:
    """The moments of one backward (``pb``: core.memory_buffers.PhaseBuffers; ``gathered``: stage 3's
    gathered parameters through the backward, core/stage3_live.py; ``overlap``: ``overlap_comm``;
    ``grads_in_p_grad``: the gradients kept to the step are autograd's ``p.grad``, core/memory.py
    grads_from_autograd; ``multi_rank_flatten``: stage 2 all-reduces a bucket's owner pieces together,
    flattened (``reduce_scatter`` and ``use_multi_rank_bucket_allreduce``, Layout.flatten_copy_12);
    ``keep_oversized``: stage 1 reducing in the hooks as stage 2 (core/memory_states.py
    ``stage1_reduces_in_hooks``), which never clears a reduced gradient, so a lone gradient larger than the
    bucket stays autograd's to the epilogue's ``_clear_param_grad_only``); ``reduce_scatter``: DeepSpeed's
    switch (off, stage 3 all-reduces a bucket that fits in place and post-scales it into a copy:
    core/grad_buckets.py); ``lp_grads_end``: bytes of autograd's 16-bit gradients still held at the end of the
    backward beside the reduction (BF16_Optimizer: they are added into its fp32 buffer, then all-reduced)."""
    held = pb.held.get("backward", 0)
    ipg = pb.detail.get("ipg_bucket", 0)
    hg = head_gradients(layout)
    if stage == 3 and gathered is not None and ipg:
        return _stage3(pb, layout, hg, b_c=b_c, b_p=b_p, bucket_elems=bucket_elems, grads_end=grads_end,
                       gathered=gathered, reduce_scatter=reduce_scatter)
    if stage != 2 or off_opt != "none" or not ipg:  # ipg_bucket: contiguous gradients
        # stage 1 reducing after the backward: its gradient partition buffer beside the gradients not yet moved
        # into the bucket (core/grad_buckets.py)
        copy = b_p * stage1_partition_copy_extra(layout, bucket_elems) if (
            stage == 1 and ipg and off_opt == "none" and not overlap) else 0
        return _two_ends(pb, hg, stage=stage, grads_end=grads_end, b_p=b_p, overlap=overlap, kept=grads_in_p_grad,
                         offload=off_opt != "none", ipg_kept=pb.ipg_through_forward, partition_copy=copy,
                         lp_grads_end=lp_grads_end)
    return _stage2(pb, layout, hg, b_c=b_c, b_p=b_p, bucket_elems=bucket_elems, grads_end=grads_end,
                   copies=multi_rank_flatten, keep_oversized=keep_oversized)


def _stage2(pb: Any, layout: Layout, hg: HeadGradients, *, b_c: int, b_p: int, bucket_elems: int, grads_end: int,
            copies: bool, keep_oversized: bool = False) -> list[BackwardMoment]:
    """Stage 2 with contiguous gradients: the moments around the bucket's flushes (module docstring).
    Each flush adds what it holds beside the bucket (``_flush_extra``); of the flushes after the first,
    a moment is kept only where that exceeds every earlier one's (those stack on more activations).
    ``keep_oversized`` (stage 1 in the hooks): a lone oversized gradient, once flushed, stays to the end."""
    held = pb.held.get("backward", 0)
    ipg = pb.detail.get("ipg_bucket", 0)
    flushes, last = ready_buckets(layout, bucket_elems)
    buckets = [sizes for sizes, _ in flushes] + [last]
    extra = [_flush_extra(sizes, span, layout, b_c=b_c, b_p=b_p, bucket_elems=bucket_elems, copies=copies)
             for sizes, span in zip(buckets, layout.bucket_ranges_12(bucket_elems, "reverse"))]
    # a flush runs in the hook of the gradient that overflows the bucket, before that gradient (autograd's
    # own) is copied in: it is live beside the flush (the next bucket's first)
    trigger = [b_p * nxt[0] for nxt in buckets[1:]] + [0]
    # stage 1 (keep_oversized): the lone oversized gradients of the buckets flushed before each one
    kept = [0]
    for ex in extra:
        kept.append(kept[-1] + (ex[1] if keep_oversized else 0))
    by_embed = _embedding_flush(hg, layout, bucket_elems)
    regular = flushes[:-1] if by_embed else flushes
    lazy = ipg + pb.detail.get("allreduce_flatten", 0) + pb.detail.get("gradient_partition_whole_params", 0)
    other, other_held = pb.backward - lazy, held - ipg
    held_tied = b_p * hg.tied  # the tied gradient autograd holds from lm_head's backward to the embedding's

    def moment(what: str, flush: tuple[int, int], activations: str, done: int = 0, grads: int = 0,
               autograd: int = 0) -> BackwardMoment:
        return BackwardMoment(what=what, buffers=other + ipg + flush[0], held_buffers=held, gradients=grads,
                              activations=activations, layers_done=done, autograd=autograd + flush[1])

    out = [BackwardMoment(what="head backward (before the first gradient hook)", buffers=other, held_buffers=other_held,
                          gradients=0, activations="head"),
           moment("lm_head's gradient hook (ipg bucket allocated, the gradient copied in)", (0, 0), "layer",
                  autograd=b_p * hg.head)]
    if regular:
        d1 = regular[0][1]
        out.append(moment("first bucket flush" + (" (flatten copy)" if extra[0][0] else ""), extra[0], "layer", d1,
                          autograd=held_tied + trigger[0]))
        out.append(moment("after the first flush (grads_in_partition allocated)", (0, 0), "layer", d1,
                          grads=grads_end, autograd=held_tied + kept[1]))
        top = 0
        for k, ((_, done), ex, trig) in enumerate(zip(regular[1:], extra[1:], trigger[1:]), start=1):
            if sum(ex) + trig + kept[k] > top:
                out.append(moment(f"bucket flush after {done} layers' backward" + (" (flatten copy)" if ex[0] else ""),
                                  ex, "layer", done, grads=grads_end, autograd=held_tied + trig + kept[k]))
                top = sum(ex) + trig + kept[k]
    grads = grads_end if regular else 0
    embed_extra = extra[len(flushes) - 1] if by_embed else None
    before_embed = kept[len(flushes) - 1] if by_embed else kept[len(flushes)]
    for what, flush, autograd in _embedding_moments(hg, b_p, embed_extra):
        out.append(moment(what, flush, "none", grads=grads, autograd=autograd + before_embed))
    # copy_grads_in_partition allocates grads_in_partition after the first flush's reduction: where the epilogue's
    # flush is the first, after it (its flatten copy freed by then)
    first = not flushes
    out.append(moment("backward end (epilogue flush)", extra[-1], "none", grads=0 if first else grads_end,
                      autograd=kept[len(flushes)]))
    if first:
        out.append(moment("after the epilogue flush (grads_in_partition allocated)", (0, 0), "none", grads=grads_end,
                          autograd=kept[-1]))
    return out


def _flush_extra(sizes: list[int], span: tuple[int, int], layout: Layout, *, b_c: int, b_p: int, bucket_elems: int,
                 copies: bool) -> tuple[int, int]:
    """(flatten copy bytes, gradient bytes outside the bucket) a stage-2 flush holds beside the bucket. A
    lone gradient larger than the bucket is never copied into it (``extra_large_param_to_reduce``): it is
    reduced from autograd's own gradient, which lives until then."""
    copy = b_c * layout.flatten_copy_12(*span, bucket_elems) if copies else 0
    return copy, b_p * lone_oversized(sizes, bucket_elems)


def _two_ends(pb: Any, hg: HeadGradients, *, stage: int, grads_end: int, b_p: int, overlap: bool, kept: bool,
              offload: bool, ipg_kept: bool = False, partition_copy: int = 0,
              lp_grads_end: int = 0) -> list[BackwardMoment]:
    """Every other stage: its buffers beside the activations' backward peak, and the gradients and
    buffers at the end; a tied weight's gradient held between them. Stages 0-1 without ``overlap_comm``
    reduce after autograd's backward (engine.py ``allreduce_gradients``, stage_1_and_2.py
    ``reduce_gradients``), so their flatten copy exists only at the end; and stage 1 with contiguous
    gradients (an ipg bucket) moves each ``p.grad`` into the bucket before a flush copies it
    (``reduce_independent_p_g_buckets_and_remove_grads``), so its flatten copy never adds to the
    gradients either, and its bucket is allocated at the first gradient hook (``process_gradients``
    ``setup_buckets``), after the head's backward. Where the gradient kept is ``p.grad`` (``kept``) the
    tied sum becomes it (counted in the gradients at the end). Stage 1 with ``overlap_comm`` over several
    micro-steps: the same, with its two buckets. ``ipg_kept``: the bucket lives on from an earlier
    micro-step (stage 1 with gradient accumulation), so the head's backward already holds it.
    ``partition_copy``: bytes stage 1's reduction holds beyond the gradients at its first owned flush
    (``stage1_partition_copy_extra``)."""
    held = pb.held.get("backward", 0)
    ipg = pb.detail.get("ipg_bucket", 0) if stage == 1 and not offload else 0
    # with overlap_comm and several micro-steps (the boundary's backward starts with the accumulated p.grad,
    # core/memory_states.py stage1_reduces_in_hooks) each gradient is moved into the bucket before a flush
    # copies it, so a flush never adds to what the backward's start holds
    flatten = pb.detail.get("allreduce_flatten", 0) if (stage <= 1 and not overlap) or ipg else 0
    during = pb.backward - flatten
    end = pb.backward - (flatten if ipg else 0)
    if ipg:  # lm_head's gradient is its p.grad from the first hook on
        head_ipg = 0 if ipg_kept else ipg
        out = [BackwardMoment(what="head backward (before the first gradient hook)", buffers=during - head_ipg,
                              held_buffers=held - head_ipg, gradients=0, activations="head"),
               BackwardMoment(what="top layer backward (ipg bucket allocated at lm_head's hook)", buffers=during,
                              held_buffers=held, gradients=0, activations="layer", autograd=b_p * hg.head)]
    else:
        out = [BackwardMoment(what="backward start", buffers=during, held_buffers=held, gradients=0,
                              activations="peak")]
        if hg.tied:  # lm_head's share of the tied gradient, held to the embedding's backward
            out.append(BackwardMoment(what="top layer backward (lm_head's tied gradient held)", buffers=during,
                                      held_buffers=held, gradients=0, activations="layer", autograd=b_p * hg.tied))
    if hg.tied:
        out.append(BackwardMoment(what="embedding backward (the tied gradient summed)", buffers=during,
                                  held_buffers=held, gradients=grads_end, activations="none",
                                  autograd=b_p * hg.tied * (2 if kept else 3)))
    out.append(BackwardMoment(what="backward end", buffers=end, held_buffers=held, gradients=grads_end,
                              activations="none", autograd=lp_grads_end))
    if partition_copy > 0:
        out.append(BackwardMoment(what="reduction after the backward (gradient partition buffer allocated beside "
                                       "the gradients not yet moved into the bucket)", buffers=end, held_buffers=held,
                                  gradients=grads_end + partition_copy, activations="none"))
    return out


def _embedding_flush(hg: HeadGradients, layout: Layout, bucket_elems: int) -> list[int] | None:
    """The tensor sizes of the bucket flushed by the embedding's gradient hook (its gradient overflows
    the bucket, so it is the epilogue's alone), or None."""
    flushes, last = ready_buckets(layout, bucket_elems)
    return flushes[-1][0] if flushes and hg.embed and last == [hg.embed] else None


def _embedding_moments(hg: HeadGradients, b_p: int, flush: tuple[int, int] | None
                       ) -> list[tuple[str, tuple[int, int], int]]:
    """(what, what the flush holds beside the bucket: (copy bytes, other bytes), autograd bytes) at the
    embedding's backward: a tied weight's three gradients (lm_head's share, the embedding's dense one and
    their sum), then, where the summed or own gradient overflows the bucket, the flush its hook makes
    before copying it in (``flush``; None: no flush there)."""
    out = []
    if hg.tied and hg.embed:
        out.append(("embedding backward (the tied gradient summed)", (0, 0), 3 * b_p * hg.tied))
    if hg.embed:
        out.append(("embedding's gradient hook" + (" (bucket flush)" if flush is not None and sum(flush) else ""),
                    flush or (0, 0), b_p * hg.embed))
    return out


def _stage3(pb: Any, layout: Layout, hg: HeadGradients, *, b_c: int, b_p: int, bucket_elems: int, grads_end: int,
            gathered: BackwardGathered, reduce_scatter: bool = True) -> list[BackwardMoment]:
    """Stage 3 (DeepSpeed 0.19.8 ``stage3.py``): the ipg bucket lives from ``__init__``; each flush
    (``__reduce_and_partition_ipg_grads``) makes the reduce-scatter's interleaved copy of the bucket (where
    ``reduce_scatter`` is off and the bucket fits: the all-reduced bucket's post-scaled copy, core/grad_buckets.py)
    inside the backward of the layer whose gradient would overflow it; the gathered parameters are
    what the coordinator holds then (core/stage3_live.py). A layer's moment is kept only where its
    buffers exceed every layer's above it (those stack on more activations)."""
    held = pb.held.get("backward", 0)
    other = pb.backward - pb.detail.get("gathered_params_backward", 0) - pb.detail.get("reduce_scatter_temp", 0)
    flushes, last = ready_buckets(layout, bucket_elems)
    by_embed = _embedding_flush(hg, layout, bucket_elems)
    buckets = [sizes for sizes, _ in flushes] + [last]
    # per layer, the most its flushes hold: the reduce-scatter copy (the largest: it sizes the side stream's
    # pool), and the gradients outside the bucket (the one whose hook runs the flush, as in stage 2, and a
    # lone gradient larger than the bucket, kept as autograd's)
    def copy_bytes(sizes: list[int]) -> int:
        return b_c * stage3_flush_temp_elements(sizes, layout.n, bucket_elems, reduce_scatter=reduce_scatter,
                                                contiguous=True)

    temp_at: dict[int, tuple[int, int]] = {}
    for k, (sizes, done) in enumerate(flushes[:-1] if by_embed else flushes):
        lone = b_p * lone_oversized(sizes, bucket_elems)
        temp, grads_out = temp_at.get(done, (0, 0))
        temp_at[done] = (max(temp, copy_bytes(sizes)),
                         max(grads_out, lone + b_p * buckets[k + 1][0]))
    held_tied = b_p * hg.tied

    def moment(what: str, g: int, temp: int, activations: str, done: int = 0, grads: int = 0,
               autograd: int = 0) -> BackwardMoment:
        return BackwardMoment(what=what, buffers=other + b_p * g + temp, held_buffers=held, gradients=grads,
                              activations=activations, layers_done=done, autograd=autograd,
                              side={"allgather": b_p * g, "reduce_scatter": temp})

    out = [moment("head backward (lm_head, final norm)", gathered.head, 0, "head"),
           # autograd's AccumulateGrad allocates lm_head's whole weight gradient before DeepSpeed's hook copies
           # it into the bucket (stage3.py reduce_partition_and_remove_grads); the logits and their fp32
           # gradients are freed by then: the activations are at least those of the top layer's backward
           moment("lm_head weight gradient (before its hook)", gathered.head, 0, "layer", autograd=b_p * hg.head)]
    top = -1
    leaf = layout.leaf_elements_by_layer  # a ZeRO-3 leaf's gradients, all live at its backward hook
    for done, g in enumerate(gathered.layers):
        temp, grads_out = temp_at.get(done, (0, 0))
        layer = len(gathered.layers) - 1 - done
        flushed = " (bucket flush)" if done in temp_at else ""
        kind = "layer"
        if leaf.get(layer):
            # a layer with a ZeRO-3 leaf (its MoE block, the layer's last module): no gradient of the layer
            # exists before the leaf's hook, which is where its first flush runs; what is gathered there is
            # less than at the leaf's fetch (core/stage3_live.py leaf_layers)
            if b_p * g > top:
                out.append(moment(f"backward of layer {layer}: its MoE leaf fetched", g, 0, "layer_start", done,
                                  autograd=held_tied))
                top = b_p * g
            g, grads_out = gathered.leaf_layers[done], max(grads_out, b_p * leaf[layer])
            flushed = ": its MoE leaf's gradient hook" + flushed
            kind = "layer_start"
        if b_p * g + temp + grads_out > top:
            out.append(moment(f"backward of layer {layer}{flushed}", g, temp, kind, done,
                              autograd=held_tied + grads_out))
            top = b_p * g + temp + grads_out
    if gathered.bottom > gathered.bottom_held:  # the embeddings re-gathered: a coalesced flat buffer copied out
        out.append(moment("embeddings re-gathered (a flat buffer copied out)", gathered.bottom, 0, "none",
                          autograd=held_tied))
    flush = (copy_bytes(by_embed), 0) if by_embed else None
    for what, (temp, _), autograd in _embedding_moments(hg, b_p, flush):
        out.append(moment(what, gathered.bottom_held, temp, "none", autograd=autograd))
    last_temp = copy_bytes(last)
    out.append(moment("backward end (epilogue flush)", gathered.bottom_held, last_temp, "none", grads=grads_end,
                      autograd=b_p * lone_oversized(last, bucket_elems)))
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
