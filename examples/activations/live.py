"""How the activation trace measures a model (torch only, no transformers).

Shared by ``trace.py``, which traces transformers' models into ``zeroplan/core/activation_data.json``,
and ``tests/test_bundled_activations.py``, which traces zeroplan's bundled runtime model the same way
and holds it to that data (the bundled engine's memory must be transformers', or comparing the planner
with it proves nothing).

A storage counts as an activation when one of its tensors has the sequence length (a prime no weight
dimension equals) in its shape. The measures, for one sequence (see trace.py's module doc):
``saved``, ``end_forward``, ``forward_peak``, ``fwd_layer_start``/``fwd_layer_peak``, ``head_peak``,
``layer_start``/``layer_peak``; :func:`combine` turns a 1- and a 2-layer run into the per-layer and
head terms the data holds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Live", "LayerMarks", "run_measures", "combine"]


class Live(TorchDispatchMode):
    """Tracks the activation storages alive after every op (seq length in the shape)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.live: dict[StorageWeakRef, int] = {}
        self.region = "forward"
        self.peaks: dict[str, int] = {}

    def is_act(self, t: torch.Tensor) -> bool:
        return any(d and d % self.seq == 0 for d in t.shape)

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and self.is_act(t):
            st = t.untyped_storage()
            self.live[StorageWeakRef(st)] = st.nbytes()

    def now(self) -> int:
        for k in [k for k in self.live if k.expired()]:
            del self.live[k]
        return sum(self.live.values())

    def mark(self, region: str) -> int:
        cur = self.now()
        self.region = region
        self.peaks[region] = max(self.peaks.get(region, 0), cur)
        return cur

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        cur = self.now()
        self.peaks[self.region] = max(self.peaks.get(self.region, 0), cur)
        return out


class LayerMarks:
    """The points the measures are taken at, called by the model's decoder-layer hooks: the last
    layer's forward start and end, its backward start (its output's gradient arrives) and the end
    of the previous layer's backward. Only the first forward pass marks (not checkpointing's
    recomputation)."""

    def __init__(self, tracker: Live) -> None:
        self.tracker = tracker
        self.marks: dict[str, int] = {}

    def _once(self, name: str, region: str) -> None:
        if name not in self.marks:
            self.marks[name] = self.tracker.mark(region)

    def _hook_mark(self, name: str | None, region: str) -> None:
        """A gradient hook's mark: returns None (a returned value would replace the gradient)."""
        if name is None:
            self.tracker.mark(region)
        else:
            self._once(name, region)

    def last_forward_start(self) -> None:
        self._once("fwd_layer_start", "fwd_layer")

    def last_forward_end(self, out: Any) -> None:
        t = out[0] if isinstance(out, tuple) else out
        if t.requires_grad:
            t.register_hook(lambda g: self._hook_mark("layer_start", "layer"))
        self._once("fwd_layer_end", "loss")

    def previous_forward_end(self, out: Any) -> None:
        t = out[0] if isinstance(out, tuple) else out
        if t.requires_grad:
            t.register_hook(lambda g: self._hook_mark(None, "after_layer"))


def run_measures(loss_of: Callable[[torch.Tensor], torch.Tensor], marks: LayerMarks, seq: int) -> dict[str, int]:
    """One forward (``loss_of(input_ids)``, input ids of one sequence) and backward under ``marks.tracker``."""
    tracker = marks.tracker
    saved: dict[StorageWeakRef, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if tracker.is_act(x):
            st = x.untyped_storage()
            saved[StorageWeakRef(st)] = st.nbytes()
        return x

    ids = torch.zeros((1, seq), dtype=torch.long)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = loss_of(ids)
        end_forward = tracker.mark("head")
        saved_bytes = sum(v for k, v in saved.items() if not k.expired())
        loss.backward()
        tracker.mark("done")
    return {
        "saved": saved_bytes,
        "end_forward": end_forward,
        "forward_peak": tracker.peaks["loss"],
        "fwd_layer_start": marks.marks["fwd_layer_start"],
        "fwd_layer_peak": tracker.peaks["fwd_layer"],
        "head_peak": tracker.peaks["head"],
        "layer_start": marks.marks["layer_start"],
        "layer_peak": tracker.peaks["layer"],
    }


def combine(one: dict[str, int], two: dict[str, int]) -> dict[str, int]:
    """The data's per-layer and head terms from a 1- and a 2-layer run (activation_data.json's measures)."""
    layer = two["end_forward"] - one["end_forward"]
    if two["saved"] - one["saved"] != layer:
        raise RuntimeError(f"saved and live per-layer bytes differ: {two['saved'] - one['saved']} vs {layer}")
    end = two["end_forward"]
    return {
        "layer": layer,
        "head": one["end_forward"] - layer,
        "loss_extra": two["forward_peak"] - end,
        "fwd_layer_start_delta": two["fwd_layer_start"] - end,
        "fwd_layer_extra": two["fwd_layer_peak"] - two["fwd_layer_start"],
        "head_extra": two["head_peak"] - end,
        "layer_start_delta": two["layer_start"] - end,
        "layer_extra": two["layer_peak"] - two["layer_start"],
    }
