"""Stage 3's gathered parameters live at each point of the backward, from the coordinator replay.

``core/stage3_fetch.py`` replays DeepSpeed 0.19.8's ``PartitionedParameterCoordinator`` to count its
all-gathers. The same replay knows which parameters are available (gathered, or in flight from a
prefetch) after every hook, so it also gives the gathered bytes beside each moment of the backward
(``core/backward_moments.py``), instead of one maximum stacked on the activations' peak:
- at the head's backward, every parameter the forward left gathered (within
  ``stage3_max_reuse_distance`` of its next use, or marked by the prefetcher's skip of an
  available parameter) is still there;
- each layer's backward releases what it will not use again, and prefetches what comes next;
- a coalesced gather that is waited on is copied out of its flat buffer parameter by parameter
  (``AllGatherCoalescedHandle.wait``), and the buffer stays beside the copies until the last of its
  parameters is fetched (core/stage3_fetch.py ``_Coordinator._waited``; measured on transformers' Mixtral,
  tests/test_transformers_replays.py).

Measured: real DeepSpeed 0.19.8 on CPU (2 layers of Llama-2-7B, rank 0 of 8) holds 1,333,788,672
gathered bytes at the lm_head's backward, which is what this replay gives, to the byte
(tests/test_backward_moments.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from zeroplan.core.stage3_fetch import FetchUnit, _Coordinator, micro_step_events

if TYPE_CHECKING:  # layout.py imports stage3_fetch; a Layout is only read here
    from zeroplan.core.layout import Layout

__all__ = ["BackwardGathered", "ReplayInputs", "backward_gathered", "replay_inputs"]


@dataclass(frozen=True)
class BackwardGathered:
    """Padded elements of gathered, non-persistent parameters live in the backward (the largest at
    any hook of each part, coalesced flat buffers being copied out included)."""

    head: int  # from the backward's start to the first decoder layer's hook (lm_head, final norm)
    layers: tuple[int, ...]  # per layer, top first (index = layers back-propagated before it)
    bottom: int  # after the last decoder layer (the embeddings), a gather's flat buffer being copied out included
    # the same without that flat buffer: what stays gathered once the embeddings' fetch has completed, at their
    # gradient hook and the epilogue's flush (measured on real DeepSpeed, 6 ranks: the embedding re-gathered
    # with layer 0's first projections in one coalesced fetch, only the embedding live at the epilogue)
    bottom_held: int = 0
    # what the forward's last hook leaves gathered: live beside the loss, the forward's activation peak
    # (measured on real DeepSpeed, 8 ranks: the whole 2-layer model, 1,333,788,672 bytes, as at the head's backward)
    forward_end: int = 0
    # the forward's hooks, as ``layers`` (index = the layer, bottom first), before them (the embeddings) and
    # after them (final norm, lm_head), a fetch's flat buffer being copied out included
    forward_layers: tuple[int, ...] = ()
    forward_bottom: int = 0
    forward_head: int = 0
    # per layer, as ``layers`` (top first): what is gathered when a ZeRO-3 leaf's gradient hook runs (0: no
    # leaf). Autograd has freed the storage it held of that leaf's released forward copy by then, and the
    # flat buffers its fetch emptied are gone (measured: tests/test_transformers_replays.py)
    leaf_layers: tuple[int, ...] = ()


class ReplayInputs(tuple):
    """``replay_inputs``' five tuples, equal by content, with the hash computed once: the replays'
    caches key on it, and every plan builds its own ``Layout`` of the same model (``evaluate``,
    ``check``, ``recommend``'s alternatives), so a cache kept on the layout object alone misses."""

    _hash: int

    def __new__(cls, items: tuple) -> "ReplayInputs":
        obj = super().__new__(cls, items)
        obj._hash = hash(items)
        return obj

    def __hash__(self) -> int:
        return self._hash


def replay_inputs(layout: Layout, tl: Layout, no_backward: frozenset[str]) -> ReplayInputs:
    """What the coordinator replay reads of a layout: per tensor its numel, padded numel, persistence
    and whether it is frozen (not in ``tl``, the trainable layout), and the fetch units with their
    backward flag. Kept on the layout (``recommend``'s search plans one layout at many points)."""
    key = (no_backward, tl.tensor_names)
    cache = layout.__dict__.setdefault("_replay_inputs", {})
    if key not in cache:
        pset = {t.name for t in layout.persistent_tensors}
        trained = set(key[1])
        skipped = layout.no_backward_units(no_backward)
        cache[key] = _interned(ReplayInputs((
            tuple(t.numel for t in layout.tensors), tuple(layout.padded(t.numel) for t in layout.tensors),
            tuple(t.name in pset for t in layout.tensors),
            tuple(replace(u, backward=u.name not in skipped) for u in layout.units),
            tuple(t.name not in trained for t in layout.tensors))))
    return cache[key]


_INTERNED: dict[ReplayInputs, ReplayInputs] = {}


def _interned(inputs: ReplayInputs) -> ReplayInputs:
    """One object per content: the replays' caches then find their key by identity, not by comparing
    a thousand fetch units each call from a layout of its own."""
    if len(_INTERNED) > 256:
        _INTERNED.clear()
    return _INTERNED.setdefault(inputs, inputs)


def backward_gathered(layout: Layout, tl: Layout, no_backward: frozenset[str], *, max_live: int, prefetch_bucket: int,
                      max_reuse: int, grad_accum: int, recompute_layers: bool) -> BackwardGathered:
    """The gathered elements live through the backward of a steady micro-step (after a warm-up step,
    as ``stage3_gathers``; with gradient accumulation the larger of the first two micro-steps)."""
    return _gathered(replay_inputs(layout, tl, no_backward), int(max_live), int(prefetch_bucket), int(max_reuse),
                     min(int(grad_accum), 2), bool(recompute_layers))


@lru_cache(maxsize=256)  # by content: every plan of the same model builds a layout of its own
def _gathered(inputs: ReplayInputs, max_live: int, prefetch_bucket: int, max_reuse: int, micro_steps: int,
              recompute_layers: bool) -> BackwardGathered:
    numel, padded, persistent, units, frozen = inputs
    events = micro_step_events(list(units), recompute_layers)
    c = _Coordinator(list(numel), list(padded), list(persistent), events, list(units), max_live, prefetch_bucket,
                     max_reuse, frozen=list(frozen), saves_forward=not recompute_layers)
    c.boundary()
    c.micro_step()  # the warm-up step fills __params_to_release's cache as DeepSpeed's first one does
    c.boundary()
    n_layers = 1 + max((u.layer for u in units if u.layer is not None), default=-1)
    fwd, bwd = _Regions(n_layers), _Regions(n_layers)
    forward_end = 0
    leaf = [0] * n_layers

    def observe(kind: str, u: int, phase: str) -> None:
        nonlocal forward_end
        now = c.live + c.flat + c.transient + c.autograd_held
        held = c.live + c.flat - c.freed + c.autograd_held  # what stays once this hook is done
        layer = units[u].layer if u >= 0 else None
        if phase == "backward":
            bwd.see(layer, now, held)
            if kind == "fetch" and layer is not None and units[u].leaf and u in c.backward_units:
                leaf[layer] = max(leaf[layer], held - c.retained.get(u, 0))
        else:
            forward_end = now  # the last forward event's
            fwd.see(layer, now, held)

    for _ in range(micro_steps):
        fwd.seen = bwd.seen = False
        c.micro_step(observe)
    # the backward meets the layers top first: its "before" is the head, its "after" the embeddings
    return BackwardGathered(head=bwd.before, layers=tuple(reversed(bwd.layers)), bottom=bwd.after,
                            bottom_held=bwd.after_held, forward_end=forward_end, forward_layers=tuple(fwd.layers),
                            forward_bottom=fwd.before, forward_head=fwd.after, leaf_layers=tuple(reversed(leaf)))


class _Regions:
    """The most gathered elements seen in each region of one pass: before the decoder layers, in each layer
    (by layer index), after them (also without a fetch's flat buffer: ``after_held``)."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [0] * n_layers
        self.before = self.after = self.after_held = 0
        self.seen = False  # a decoder layer's hook has run in this pass

    def see(self, layer: int | None, now: int, held: int) -> None:
        if layer is not None:
            self.seen = True
            self.layers[layer] = max(self.layers[layer], now)
        elif self.seen:
            self.after = max(self.after, now)
            self.after_held = max(self.after_held, held)
        else:
            self.before = max(self.before, now)
