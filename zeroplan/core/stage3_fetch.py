"""Stage 3's parameter gathers per micro-step, replayed from DeepSpeed 0.19.8's coordinator.

DeepSpeed decides every stage-3 all-gather in ``runtime/zero/partitioned_param_coordinator.py``
(``PartitionedParameterCoordinator``), driven by the module hooks of ``parameter_offload.py``.
This module replays that state machine over the fetch units of a ``Layout`` (torch-free), so the
ledger carries the calls DeepSpeed issues, tied weights included:

- The trace (``record_module`` / ``construct_parameter_trace_from_module_trace``): every call of
  ``fetch_sub_module`` appends its module; forward visits the root (the model; no parameters of
  its own) and then every unit in call order, backward the root and then the units in reverse
  (``PreBackwardFunctionForModule`` on each output). A unit's parameters are its own plus a tied
  parameter it reads (the lm head of a tied model: HF registers the embedding's Parameter on the
  head too, or DeepSpeed registers it as an external parameter on first access,
  ``ZeROOrderedDict.__getitem__``); ``__param_order`` lists, per trace entry, its parameters in
  ``ds_id`` order with the entry's step id.
- ``fetch_sub_module``: one coalesced all-gather of the unit's parameters that are
  NOT_AVAILABLE (``__all_gather_params``); then, with a complete trace, the unit's parameters
  not already fetched for this step are popped off the queue (``__most_recent_step_id_param_fetched_for``
  set to each entry's step), and, when ``prefetch_bucket_size`` > 0, entries are popped while
  ``numel_prefetching < min(max_live_parameters - __n_available_params, prefetch_bucket_size)``:
  each NOT_AVAILABLE one joins ONE coalesced prefetch all-gather. ``__n_available_params`` grows by
  ``ds_numel`` (unpadded) per gathered parameter and shrinks at each release.
- ``release_sub_module`` after a unit's forward and after its backward (``PostBackwardFunctionModule``
  on its inputs: never for an embedding, whose input ids need no gradient; those are released by
  ``release_backward_leftovers`` at the end of backward): a parameter is released unless it is
  persistent, still active in another unit, fetched by the prefetcher for a later step
  (``__most_recent_step_id_param_fetched_for > step_id``) or used again within the next
  ``max_reuse_distance`` elements of the trace (``__params_to_release``, an ``lru_cache`` keyed by
  (unit, step id): the first complete micro-step decides for all later ones).
- ``reset_step`` at each forward (the root's pre-forward hook): the prefetch queue restarts,
  ``__n_available_params`` = 0, in-flight prefetches are released; at the optimizer step every
  parameter is released (``release_and_reset_all``) and the persistent ones re-gathered.

The trace is the spec's module order: the runtime model and HF implementations call the modules
in that order (measured, DS 0.19.8: tests/test_deepspeed_tied.py). Under full activation
checkpointing (``torch.utils.checkpoint``, non-reentrant as transformers 5.x calls it) the
recomputed forward inside the backward fires the module hooks again, so its fetches are trace
entries too, in the order autograd runs them (``micro_step_events``; measured on GPT-2, Llama and
Mixtral layers, call for call in order).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["FetchUnit", "Gather", "stage3_gathers"]

_NEVER = -(10**10)  # DeepSpeed's defaultdict(lambda: int(-1e10))


@dataclass(frozen=True)
class FetchUnit:
    """A module whose forward reads parameters (``params``: indices into ``Layout.tensors``)."""

    name: str
    params: tuple[int, ...]
    grad_input: bool = True  # its input needs a gradient: the post-backward release runs
    backward: bool = True  # its output needs a gradient: fetched again in backward
    layer: int | None = None  # the transformer layer it belongs to (what full checkpointing recomputes)
    expert: bool = False  # an MoE expert's module (its layer ends in tensor-saving routing ops)
    # autograd saves views of its gathered parameters (transformers 5's fused experts: grouped_mm on
    # ``weight.transpose(-2, -1)``), so a release after its forward frees nothing until its backward
    saved_views: bool = False
    # a ZeRO-3 leaf module (zero_optimization.leaf_module): DeepSpeed fetches and releases it whole, and
    # its release's reuse scan reads every module's parameters recursively (``_to_release``)
    leaf: bool = False


@dataclass(frozen=True)
class Gather:
    """One all-gather: the phase, Σ padded elements, how many parameters, the unit that issued it."""

    phase: str
    elements: int
    params: int
    unit: str
    prefetch: bool
    recompute: bool = False  # issued by a module's fetch while its layer is recomputed in backward


@dataclass
class _Coordinator:
    numel: list[int]
    padded: list[int]
    persistent: list[bool]
    events: list[tuple[str, int, str, bool]]  # micro_step_events: (fetch | release, unit, phase, recompute)
    units: list[FetchUnit]
    max_live: int
    prefetch_bucket: int
    max_reuse: int
    available: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    frozen: list[bool] = field(default_factory=list)  # requires_grad False (a fine-tuning's frozen base)
    backward_units: dict[int, None] = field(default_factory=dict)  # __active_backward_submodules, in order
    attributed: dict[int, set[int]] = field(default_factory=dict)  # ds_recompute_parameters per unit
    active: dict[int, set[int]] = field(default_factory=dict)
    cache: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)
    gathers: list[Gather] = field(default_factory=list)
    # what core/stage3_live.py reads: padded elements of the non-persistent parameters available (gathered
    # or in flight); the flat buffers of coalesced prefetches already waited on that are still held beside
    # their parameters' copies (``flat``), of which ``freed`` go once the current fetch ends; and the flat
    # buffer of a gather the current fetch issued and waited on (``transient``)
    live: int = 0
    flat: int = 0
    freed: int = 0
    transient: int = 0
    # the coalesced prefetch each in-flight parameter came in (an id of ``bundles``: its elements, members
    # not yet fetched, waited on) when it holds more than one parameter
    bundle: dict[int, int] = field(default_factory=dict)
    bundles: dict[int, list[int]] = field(default_factory=dict)
    # elements released after a forward that autograd still holds through saved views, per unit;
    # ``saves_forward`` False: full checkpointing, whose first forward of a layer saves nothing
    retained: dict[int, int] = field(default_factory=dict)
    saves_forward: bool = True

    def __post_init__(self) -> None:
        self.trace = [u for kind, u, _, _ in self.events if kind == "fetch"]  # unit per step id; -1 = the root
        self.uses: list[list[int]] = [[] for _ in self.numel]  # trace entries reading each parameter
        # the root's entry at the backward's start (the forward's is entry 0)
        self.root_entry = next((sid for sid, u in enumerate(self.trace) if u < 0 and sid > 0), -1)
        self.cum = [0]  # elements of the trace before each entry (DeepSpeed's params_traversed)
        for sid, u in enumerate(self.trace):
            for p in self.params_of(u):
                self.uses[p].append(sid)
            self.cum.append(self.cum[-1] + sum(self.numel[p] for p in self.params_of(u)))

    def params_of(self, u: int) -> tuple[int, ...]:
        return () if u < 0 else self.units[u].params

    def reset_step(self) -> None:
        """``reset_step``: in-flight prefetches released, queue and counters restarted."""
        for p in sorted(self.inflight):  # _clean_inflight_param_registry: waited on, released, handles dropped
            self.inflight.discard(p)
            self.bundle.pop(p, None)
            self._release_param(p)
        self.bundles.clear()
        self.flat = self.freed = 0
        self.retained.clear()
        self.queue = deque((p, sid) for sid, u in enumerate(self.trace) for p in self.params_of(u))
        self.recent: dict[int, int] = {}
        self.step_id = 0
        self.n_available = 0

    def _gather(self, ps: Sequence[int], phase: str, u: int, prefetch: bool, recompute: bool) -> None:
        """``__all_gather_params``: one coalesced call for the NOT_AVAILABLE ones (issued by unit u)."""
        available = self.available
        todo = [p for p in ps if p not in available]
        if not todo:
            return
        numel, padded, persistent = self.numel, self.padded, self.persistent
        self.n_available += sum(numel[p] for p in todo)
        available.update(todo)
        elements = sum(padded[p] for p in todo)
        self.live += sum(padded[p] for p in todo if not persistent[p])
        if prefetch:
            self.inflight.update(todo)
            if len(todo) > 1:
                bid = len(self.gathers)
                self.bundles[bid] = [elements, len(todo), 0]
                self.bundle.update((p, bid) for p in todo)
        elif len(todo) > 1:
            # partition_parameters.py AllGatherCoalescedHandle.wait: each parameter is copied out of
            # the flat buffer (torch.cat of its rank slices) while the flat buffer still lives
            self.transient = max(self.transient, elements)
        name = "(model)" if u < 0 else self.units[u].name
        self.gathers.append(Gather(phase, elements, len(todo), name, prefetch, recompute))

    def fetch(self, u: int, phase: str, recompute: bool = False) -> None:
        """``fetch_sub_module`` / ``_fetch_sub_module_impl`` with a complete trace."""
        ps = self.params_of(u)
        self._end_hook()
        self._gather(ps, phase, u, False, recompute)
        active, inflight = self.active, self.inflight
        for p in ps:
            users = active.get(p)
            if users is None:
                active[p] = {u}
            else:
                users.add(u)
            if p in inflight:
                self._waited(p)
                inflight.discard(p)
        if phase == "backward" and not recompute:  # fetch_sub_module(forward=False)
            self.backward_units.setdefault(u)
        elif recompute and self.backward_units:
            # a frozen parameter fetched by the recomputation is held for the backward module that
            # is running (update_recompute_parameters): released with it, not after its forward
            owner = next(reversed(self.backward_units))
            for p in ps:
                if self.frozen and self.frozen[p]:
                    self.attributed.setdefault(owner, set()).add(p)
                    self.active.setdefault(p, set()).add(owner)
        sid = self.step_id
        recent, queue = self.recent, self.queue
        not_fetched = len({p for p in ps if recent.get(p, _NEVER) < sid})
        popped = 0
        while queue and popped < not_fetched:
            p, at = queue.popleft()
            recent[p] = at
            popped += 1
        if self.prefetch_bucket > 0:
            room = min(self.max_live - self.n_available, self.prefetch_bucket)
            chosen: list[int] = []
            numel = 0
            available = self.available
            while queue and numel < room:
                p, at = queue.popleft()
                if p not in available and p not in chosen:
                    chosen.append(p)
                    numel += self.numel[p]
                recent[p] = max(recent.get(p, _NEVER), at)
            if numel > 0:
                self._gather(chosen, phase, u, True, recompute)
        self.step_id += 1

    def _waited(self, p: int) -> None:
        """An in-flight parameter fetched: its handle is popped off ``__inflight_param_registry`` and waited on.
        The first wait copies every parameter of a coalesced prefetch out of its flat buffer
        (``AllGatherCoalescedHandle.wait``); the handle keeps the buffer (``self.partitions``) while any of its
        parameters' registry entries holds it, so the buffer is freed only when the last of them is fetched
        (``fetch_sub_module`` pops them in set order, so every buffer a fetch touches counts at that fetch)."""
        bid = self.bundle.pop(p, None)
        if bid is None:
            return
        b = self.bundles[bid]
        if not b[2]:
            b[2] = 1
            self.flat += b[0]
        b[1] -= 1
        if b[1] == 0:
            del self.bundles[bid]
            self.freed += b[0]

    def _end_hook(self) -> None:
        """A new hook: what the previous fetch waited on and freed is gone, and no gather is being unpacked."""
        self.transient = 0
        self.flat -= self.freed
        self.freed = 0

    def _to_release(self, u: int) -> frozenset[int]:
        """``__params_to_release`` (cached per (unit, step id) as DeepSpeed's ``lru_cache``)."""
        key = (u, self.step_id)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        sid = self.step_id
        # the scan visits trace entries from sid on while the elements traversed before each stay
        # below max_reuse_distance: entries [sid, end); a parameter used there is kept
        end = bisect_left(self.cum, self.cum[sid] + self.max_reuse, lo=sid) if self.max_reuse > 0 else sid
        if u >= 0 and self.units[u].leaf and sid <= self.root_entry < end:
            # a leaf's scan reads each module with ``iter_params(module, recurse=True)`` (the flag is the
            # released module's, ``z3_leaf_module``): the root met at the backward's start then reads
            # every parameter, so nothing of the leaf is released. Seen on transformers' Mixtral: the
            # last layer's MoE block stays gathered from its forward to its backward
            # (tests/test_transformers_replays.py test_a_leaf_release_scan_reads_the_root_whole)
            self.cache[key] = frozenset()
            return self.cache[key]
        out = frozenset(p for p in self.params_of(u) if not self.persistent[p]
                        and self.recent.get(p, _NEVER) <= sid and not self._used_in(p, sid, end))
        self.cache[key] = out
        return self.cache[key]

    def _used_in(self, p: int, lo: int, hi: int) -> bool:
        """Whether parameter p is read by a trace entry in [lo, hi)."""
        at = self.uses[p]
        i = bisect_left(at, lo)
        return i < len(at) and at[i] < hi

    def _release_param(self, p: int) -> None:
        """``__release_param``: only an available parameter no unit is still using."""
        if p in self.available and p not in self.inflight and not self.active.get(p):
            self.available.discard(p)
            self.n_available -= self.numel[p]
            if not self.persistent[p]:
                self.live -= self.padded[p]

    def release(self, u: int, backward: bool = False, recompute: bool = False) -> None:
        """``release_sub_module``; after a backward (``forward=False``) the unit also releases the
        frozen parameters attributed to it by a recomputation, whatever the reuse distance. What a unit
        with ``saved_views`` releases after a forward that saves tensors stays held by autograd until its
        backward ends (measured: tests/test_transformers_replays.py)."""
        self._end_hook()  # only a fetch waits on a gather
        if backward:
            self.retained.pop(u, None)
        unit = self.units[u] if u >= 0 else None
        keep = (not backward and unit is not None and unit.saved_views
                and (recompute or self.saves_forward or unit.layer is None))
        before = self.live
        rel = self._to_release(u)
        ps: Iterable[int] = self.params_of(u)
        if backward:
            self.backward_units.pop(u, None)
            extra = self.attributed.pop(u, None)
            if extra:
                rel = rel | {p for p in extra if not self.persistent[p]}
                ps = set(ps) | extra
        active = self.active
        for p in ps:  # each parameter's release depends on its own state only: any order
            users = active.get(p)
            if users is not None:
                users.discard(u)
            if p in rel:
                self._release_param(p)
        if keep and self.live < before:
            self.retained[u] = self.retained.get(u, 0) + before - self.live

    @property
    def autograd_held(self) -> int:
        """Elements released by DeepSpeed that autograd still holds (``retained``)."""
        return sum(self.retained.values())

    def leftovers(self) -> None:
        """``release_backward_leftovers``: backward units whose post-backward hook never ran (LIFO)."""
        while self.backward_units:
            u = next(reversed(self.backward_units))
            del self.backward_units[u]
            for p in sorted(set(self.params_of(u)) | self.attributed.pop(u, set())):
                self.active.get(p, set()).discard(u)
                if not self.persistent[p]:
                    self._release_param(p)
        self.retained.clear()  # the backward is over: autograd has freed what it saved

    def micro_step(self, observe: Callable[[str, int, str], None] | None = None) -> None:
        """One forward and backward with a complete trace: the hooks' events in order (``observe``
        is called after each with its kind, unit and phase)."""
        self.reset_step()
        for kind, u, phase, recompute in self.events:
            if kind == "fetch":
                self.fetch(u, phase, recompute)
            else:
                self.release(u, backward=phase == "backward" and not recompute, recompute=recompute)
            if observe is not None:
                observe(kind, u, phase)
        self.leftovers()

    def boundary(self) -> None:
        """``release_and_reset_all`` at the optimizer step, then the persistent parameters re-gathered."""
        self.inflight.clear()
        self.active.clear()
        self.bundle.clear()
        self.bundles.clear()
        self.flat = self.freed = 0
        self.retained.clear()
        self.available = {p for p in range(len(self.numel)) if self.persistent[p]}
        self.live = 0


def micro_step_events(units: list[FetchUnit], recompute_layers: bool = False) -> list[tuple[str, int, str, bool]]:
    """One micro-step as parameter_offload.py's hooks drive the coordinator: (kind, unit, phase,
    recompute) with kind ``fetch`` (``fetch_sub_module``) or ``release`` (``release_sub_module``);
    unit -1 is the root. A unit fetched in backward whose post-backward release never runs (the
    root, an embedding: no gradient reaches their input) is released at the end of backward
    (``release_backward_leftovers``). Forward: the root, then each unit fetched and released (``_pre_forward_module_hook`` /
    ``_post_forward_module_hook``). Backward: the root, then the units in reverse, each fetched by the
    ``PreBackwardFunctionForModule`` on its output and released by the ``PostBackwardFunctionModule``
    on its inputs.

    ``recompute_layers`` (full checkpointing, torch.utils.checkpoint as transformers calls it): a
    layer's forward runs again inside the backward, its module hooks fire, so each of its units is
    fetched (``pre_sub_module_forward_function``: recorded in the trace, a step id of its own) and
    released after its forward. When the recomputation runs is set by autograd: it starts at the
    first backward node of the layer that unpacks a saved tensor (``_checkpoint_hook.unpack_hook``).
    A dense layer ends in a residual add (nothing saved), so its last unit's pre-backward fetch runs
    first; the recomputation then stops inside that unit's forward once the last tensor is saved
    again (``_recomputation_hook``, early stop: ``_StopRecomputationError``), so that unit is not
    released by the recomputation. An MoE layer ends in the routing's multiply and ``index_add``
    (saved tensors): the whole layer is recomputed, every unit released, before any of its
    backward fetches.
    """
    ev: list[tuple[str, int, str, bool]] = [("fetch", -1, "forward", False)]
    for u in range(len(units)):
        ev += [("fetch", u, "forward", False), ("release", u, "forward", False)]
    ev += [("release", -1, "forward", False), ("fetch", -1, "backward", False)]
    layers: dict[int, list[int]] = {}
    for u, unit in enumerate(units):
        if unit.layer is not None:
            layers.setdefault(unit.layer, []).append(u)
    done: set[int] = set()
    for u in range(len(units) - 1, -1, -1):
        unit = units[u]
        if not unit.backward:
            continue
        lay = unit.layer
        if recompute_layers and lay is not None and lay not in done:
            done.add(lay)
            members = layers[lay]
            inside = u if u == members[-1] and not any(units[v].expert for v in members) else None
            if inside is not None:
                ev.append(("fetch", u, "backward", False))
            for v in members:
                ev.append(("fetch", v, "backward", True))
                if v != inside:
                    ev.append(("release", v, "backward", True))
            if inside is None:
                ev.append(("fetch", u, "backward", False))
        else:
            ev.append(("fetch", u, "backward", False))
        if unit.grad_input:
            ev.append(("release", u, "backward", False))
    return ev


def stage3_gathers(numel: list[int], padded: list[int], persistent: list[bool], units: list[FetchUnit], *,
                   max_live: int, prefetch_bucket: int, max_reuse: int,
                   grad_accum: int, recompute_layers: bool = False,
                   frozen: list[bool] | None = None) -> list[tuple[Gather, int]]:
    """The all-gathers of one steady optimizer step (``grad_accum`` micro-steps): (gather, calls).

    ``recompute_layers``: full activation checkpointing (``micro_step_events``); ``frozen``: per
    parameter, no gradient (a frozen base: the recomputation's fetches of it are held for the running
    backward unit, ``update_recompute_parameters``). A warm-up step
    runs first so that ``__params_to_release``'s cache holds what DeepSpeed's first complete-trace
    micro-step put in it (the measured steps come after two warm-up steps). A micro-step that
    starts from the state the previous one started from, and adds nothing to the cache, repeats it
    exactly: the remaining micro-steps are counted, not replayed. So every accumulation beyond the
    micro-step where both steps repeat gives the same calls but the last one's count: those are
    read off one replay of ``_STEADY_MICRO_STEPS`` micro-steps (``recommend`` plans many).
    """
    args = (tuple(numel), tuple(padded), tuple(persistent), tuple(units), max_live, prefetch_bucket, max_reuse)
    tail = (recompute_layers, tuple(frozen or ()))
    # a micro-step repeats its predecessor at k >= 1: one or two micro-steps are replayed as they are
    steady = _replayed(*args, _STEADY_MICRO_STEPS, *tail) if grad_accum > 2 else None
    steps, warm_repeat, repeat_at = steady if _serves(steady, grad_accum) else _replayed(*args, grad_accum, *tail)
    out = [(g, 1) for step in steps[:repeat_at] for g in step]
    if repeat_at is not None:  # that micro-step and every later one
        out += [(g, grad_accum - repeat_at) for g in steps[repeat_at]]
    return out


_STEADY_MICRO_STEPS = 16
_Replay = tuple[tuple[tuple[Gather, ...], ...], int | None, int | None]  # per micro-step gathers, repeats


def _serves(steady: _Replay | None, grad_accum: int) -> bool:
    """Whether the steady replay holds ``grad_accum``'s: both its steps repeated before that many micro-steps."""
    if steady is None or steady[1] is None or steady[2] is None:
        return False
    return grad_accum > max(steady[1], steady[2])


@lru_cache(maxsize=64)
def _replayed(numel: tuple[int, ...], padded: tuple[int, ...], persistent: tuple[bool, ...],
              units: tuple[FetchUnit, ...], max_live: int, prefetch_bucket: int, max_reuse: int, grad_accum: int,
              recompute_layers: bool, frozen: tuple[bool, ...]) -> _Replay:
    """A warm-up and a measured step of ``grad_accum`` micro-steps for hashable inputs, kept per process:
    the measured step's gathers per micro-step up to the first that repeats its predecessor, and the
    index of that micro-step in the warm-up and in the measured step (None: none repeated). The replay
    depends on no micro-batch or bucket size (a replay of a 405B model takes about 0.1 s)."""
    events = micro_step_events(list(units), recompute_layers)
    c = _Coordinator(list(numel), list(padded), list(persistent), events, list(units), max_live, prefetch_bucket,
                     max_reuse, frozen=list(frozen))
    repeats: list[int | None] = []
    steps: list[tuple[Gather, ...]] = []
    for measured in (False, True):
        c.boundary()
        c.gathers = []
        last: tuple | None = None
        repeats.append(None)
        for k in range(grad_accum):
            start = (frozenset(c.available), len(c.cache))
            mark = len(c.gathers)
            c.micro_step()
            if measured:
                steps.append(tuple(c.gathers[mark:]))
            if last is not None and start == last and len(c.cache) == start[1]:
                repeats[-1] = k
                break
            last = start
    return tuple(steps), repeats[0], repeats[1]
