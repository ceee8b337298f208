"""How DeepSpeed lays parameters out in flat buffers and partitions — shared by the memory
model and the communication ledger so both see the same padded sizes and buckets.

Element counts throughout (multiply by a dtype size for bytes).

- Stages 1–2: one flat buffer of every parameter, padded at the end to a multiple of 2N
  (``nccl_start_alignment_factor = 2`` in stage_1_and_2.py); rank r owns 1/N of it.
- Stage 3: every parameter is partitioned on its own, padded to a multiple of N
  (``ds_tensor`` of ceil(numel/N) elements). Parameters with numel <= the persistence
  threshold stay whole on every rank as well (``mark_persistent_parameters``), within a
  total cap (``model_persistence_threshold``).
- Tied parameters are one parameter (the tied copy is skipped).
- Count-only specs: the default shape's tensors rarely sum to the stated count; the
  difference is absorbed so the inventory sums to Ψ exactly (added as one extra pseudo
  module when positive; every tensor scaled down proportionally when negative).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from zeroplan.core.moe_leaf import fused_parameters, moe_fetch_groups, moe_leaf_units
from zeroplan.core.stage3_fetch import FetchUnit
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.model import ModelSpec

__all__ = ["Tensor", "Module", "Layout", "build_layout", "zero_layout", "zero_layout_options", "ceil_div",
           "greedy_buckets", "greedy_buckets_after"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Tensor:
    name: str
    module: str
    numel: int
    layer: int | None = None  # the decoder layer it belongs to (specs.model.TensorSpec.layer); None outside them


@dataclass
class Module:
    name: str
    numel: int  # directly-owned parameters
    gathered: int  # stage 3: Σ padded numel of its non-persistent params (one all-gather)
    n_gathered: int  # how many non-persistent params it gathers
    persistent: int  # numel of its persistent params


@dataclass
class Layout:
    params: int
    n: int
    tensors: list[Tensor]
    modules: list[Module] = field(default_factory=list)
    persistent_tensors: list[Tensor] = field(default_factory=list)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # a layout is never mutated
    _spec: ModelSpec | None = field(default=None, repr=False, compare=False)  # what ``units`` is built from
    # spec module -> the fetch unit it is called in, where it is not its own (core/moe_leaf.py moe_fetch_groups)
    _groups: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # spec tensor name -> the parameter it is part of, where the model fuses it (core/moe_leaf.py fused_parameters)
    _renamed: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # fetch units DeepSpeed treats as ZeRO-3 leaf modules (core/moe_leaf.py moe_leaf_units)
    _leaf_units: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    @property
    def units(self) -> list[FetchUnit]:
        """Stage 3's fetch units in call order, tied parameters included (core/stage3_fetch.py). Built
        on first use: only stage 3's DeepSpeed ledger reads them, and they cost as much as the rest of
        the layout."""
        if "units" not in self._memo:
            self._memo["units"] = (_fetch_units(self._spec, self.tensors, self._groups, self._renamed,
                                                self._leaf_units) if self._spec is not None else [])
        return self._memo["units"]

    def no_backward_units(self, no_backward: frozenset[str]) -> frozenset[str]:
        """``no_backward`` (spec modules never re-gathered in backward) as names of ``modules`` and
        ``units``: a grouped unit is skipped when every module in it is."""
        if not self._groups:
            return no_backward
        grouped: dict[str, bool] = {}
        for module, unit in self._groups.items():
            grouped[unit] = grouped.get(unit, True) and module in no_backward
        return frozenset(no_backward | {u for u, skip in grouped.items() if skip})

    @cached_property
    def grad_ready(self) -> list[Tensor]:
        """The tensors in the order the backward hands their gradients to DeepSpeed's reduction: reverse
        parameter order, except that a ZeRO-3 leaf's parameters come together, in parameter order, at its
        backward hook (stage3.py ``reduce_leaf_module_grads`` loops over them; measured: tests/test_moe_leaf.py)."""
        seq = list(reversed(self.tensors))
        if not self._leaf_units:
            return seq
        unit = [self._groups.get(t.module, t.module) for t in seq]
        out: list[Tensor] = []
        i = 0
        while i < len(seq):
            j = i + 1
            if unit[i] in self._leaf_units:
                while j < len(seq) and unit[j] == unit[i]:
                    j += 1
            out.extend(reversed(seq[i:j]))
            i = j
        return out

    @cached_property
    def leaf_elements_by_layer(self) -> dict[int, int]:
        """Per decoder layer, the elements of its ZeRO-3 leaf modules' parameters: DeepSpeed reduces a leaf's
        gradients together once its backward ends, so they are all live then (core/moe_leaf.py moe_leaf_units)."""
        out: dict[int, int] = {}
        for t in self.tensors:
            if t.layer is not None and self._groups.get(t.module, t.module) in self._leaf_units:
                out[t.layer] = out.get(t.layer, 0) + t.numel
        return out

    @cached_property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors' names in order: what the stage-3 replays' memo keys tell trainable layouts apart by."""
        return tuple(t.name for t in self.tensors)

    # stages 1-2
    @property
    def flat_padded(self) -> int:
        return ceil_div(self.params, 2 * self.n) * 2 * self.n

    @property
    def partition_12(self) -> int:
        return self.flat_padded // self.n

    def grad_partition_span_12(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat buffer a rank's stage-1/2 gradient partition buffer covers.

        DeepSpeed's ``copy_grads_in_partition`` sizes it by the WHOLE parameters that overlap
        the rank's partition (measured, DS 0.19.8), so it can exceed Ψ₁₂/N by up to two
        parameters; the partition itself is a view into it.
        """
        part = self.partition_12
        p_lo, p_hi = rank * part, (rank + 1) * part
        lo, hi = p_lo, p_hi
        pos = 0
        for t in self.tensors:
            a, b = pos, pos + t.numel
            if a < p_hi and b > p_lo:
                lo, hi = min(lo, a), max(hi, b)
            pos = b
        return lo, hi

    @cached_property
    def grad_partition_12_max(self) -> int:
        """Elements of the largest stage-2 gradient partition buffer over all ranks (same result as
        grad_partition_span_12 over every rank)."""
        return max(hi - lo for lo, hi, _ in self._rank_spans_12)

    @property
    def grad_partition_spans_12(self) -> list[tuple[int, int]]:
        """[lo, hi) of every distinct rank's stage-1/2 gradient partition buffer (``grad_partition_span_12``)."""
        return [(lo, hi) for lo, hi, _ in self._rank_spans_12]

    @cached_property
    def _rank_spans_12(self) -> list[tuple[int, int, int]]:
        """Per distinct rank, (lo, hi) of its gradient partition buffer and the largest piece of one tensor
        inside its partition. O(T log T): a rank's span runs from the start of the tensor holding its
        first element to the end of the tensor holding its last, and is constant over ranks whose
        partition sits inside one tensor, so only ranks next to a tensor boundary (and the first and
        last rank) need computing, not every rank (a 2^20-GPU plan must not loop over them: issue 17 §3)."""
        from bisect import bisect_right

        starts, ends = [], []
        pos = 0
        for t in self.tensors:
            starts.append(pos)
            pos += t.numel
            ends.append(pos)
        total = pos
        part = self.partition_12
        ranks = {0, self.n - 1}
        for b in starts + ends:
            q = b // part
            ranks.update(r for r in (q - 1, q, q + 1) if 0 <= r < self.n)
        out = []
        for r in sorted(ranks):
            p_lo, p_hi = r * part, (r + 1) * part
            lo, hi, piece = p_lo, p_hi, 0
            if p_lo < total:
                first, last = bisect_right(starts, p_lo) - 1, bisect_right(starts, min(p_hi, total) - 1) - 1
                lo, hi = min(lo, starts[first]), max(hi, ends[last])
                piece = max(min(ends[i], p_hi) - max(starts[i], p_lo) for i in range(first, last + 1))
            out.append((lo, hi, piece))
        return out

    def step_norm_peak_12(self, grad_bytes: int, norm_bytes: int) -> int:
        """Bytes of the stage-1/2 step's gradient-norm moment on the heaviest rank: its gradient partition
        buffer and the ``norm_bytes`` cast of its largest piece (0.19.8 stage_1_and_2.py
        ``get_grad_norm_direct`` casts each tensor of the partition to ``get_norm_dtype()``, fp64 where the
        device has it, before the flatten)."""
        return max(grad_bytes * (hi - lo) + norm_bytes * piece for lo, hi, piece in self._rank_spans_12)

    # stage 3
    def padded(self, numel: int) -> int:
        return ceil_div(numel, self.n) * self.n

    @cached_property
    def partition_3(self) -> int:
        """Elements of one rank's stage-3 partition (every param, padded to N, / N)."""
        return sum(ceil_div(t.numel, self.n) for t in self.tensors)

    @cached_property
    def padded_total_3(self) -> int:
        return self.partition_3 * self.n

    @cached_property
    def persistent_numel(self) -> int:
        return sum(t.numel for t in self.persistent_tensors)

    @cached_property
    def largest_tensor(self) -> int:
        return max((t.numel for t in self.tensors), default=0)

    def sub_groups_3(self, sub_group_size: int) -> list[int]:
        """Stage-3 optimizer sub-groups: partition numel per group, groups close when >= size."""
        key = ("sg", sub_group_size)
        if key not in self._memo:
            self._memo[key] = self._sub_groups_3(sub_group_size)
        return list(self._memo[key])

    def _sub_groups_3(self, sub_group_size: int) -> list[int]:
        groups: list[int] = []
        cur = 0
        for t in self.tensors:
            cur += ceil_div(t.numel, self.n)
            if cur >= sub_group_size:
                groups.append(cur)
                cur = 0
        if cur:
            groups.append(cur)
        return groups or [0]

    def grad_buckets(self, bucket_elems: int, *, order: str = "reverse", flush: str = "before") -> list[int]:
        """Elements of each gradient bucket (unpadded). ``order``: "reverse" = gradient-ready order
        (hooks), "forward" = parameter order (stage 0). ``flush``: "before" adding or "after" adding
        once over the size (stage 0's allreduce_no_retain). Stages 1–3's hooks: core/grad_buckets.py."""
        key = ("gb", bucket_elems, order, flush)
        if key not in self._memo:
            seq = self.tensors if order == "forward" else self.grad_ready
            sizes = [t.numel for t in seq]
            self._memo[key] = (greedy_buckets_after if flush == "after" else greedy_buckets)(sizes, bucket_elems)
        return list(self._memo[key])

    def bucket_ranges_12(self, bucket_elems: int, order: str) -> list[tuple[int, int]]:
        """Stage 1/2 buckets as [start, end) ranges of the flat buffer (pre-add flush)."""
        offsets = []
        pos = 0
        for t in self.tensors:
            offsets.append((pos, t.numel))
            pos += t.numel
        seq = offsets if order == "forward" else list(reversed(offsets))
        ranges: list[tuple[int, int]] = []
        lo = hi = None
        cur = 0
        for start, numel in seq:
            if cur and cur + numel > bucket_elems:
                ranges.append((lo, hi))
                cur, lo, hi = 0, None, None
            cur += numel
            lo = start if lo is None else min(lo, start)
            hi = start + numel if hi is None else max(hi, start + numel)
        if cur:
            ranges.append((lo, hi))
        return ranges

    def owner_slices_12(self, lo: int, hi: int) -> list[int]:
        """Split a flat range at the owner-partition boundaries (partition = Ψ₁₂/N)."""
        part = self.partition_12
        out = []
        a = lo
        while a < hi:
            b = min(hi, (a // part + 1) * part)
            out.append(b - a)
            a = b
        return out

    def flatten_copy_12(self, lo: int, hi: int, bucket_elems: int) -> int:
        """Elements of the largest copy DeepSpeed makes to all-reduce the stage-1/2 bucket [lo, hi) with
        contiguous gradients, ``reduce_scatter`` and ``use_multi_rank_bucket_allreduce`` (0.19.8
        stage_1_and_2.py ``average_tensor``): the bucket is cut at owner-partition boundaries (one
        owner's consecutive pieces merged into one), the pieces are packed into all-reduces flushed once
        over ``reduce_bucket_size`` (``allreduce_and_scatter``), and ``allreduce_bucket`` flattens each
        group. torch's ``flatten_dense_tensors`` returns a lone tensor as a view, so only a group of two
        or more pieces is copied: a bucket inside one rank's partition makes no copy at all."""
        part = self.partition_12
        if hi - lo <= bucket_elems:  # one group (every bucket but a lone parameter larger than the size)
            return hi - lo if (hi - 1) // part > lo // part else 0
        best = run = count = 0
        for piece in self.owner_slices_12(lo, hi):
            run, count = run + piece, count + 1
            if run > bucket_elems:
                best, run, count = max(best, run if count > 1 else 0), 0, 0
        return max(best, run if count > 1 else 0)

    @cached_property
    def persistent_padded(self) -> int:
        """Persistent params are stored whole, padded to a multiple of N (measured, DS 0.19.8)."""
        return sum(self.padded(t.numel) for t in self.persistent_tensors)


def greedy_buckets(sizes: list[int], bucket_elems: int) -> list[int]:
    """Flush before adding when the bucket would overflow and is non-empty (DeepSpeed's rule)."""
    buckets: list[int] = []
    cur = 0
    for n in sizes:
        if cur and cur + n > bucket_elems:
            buckets.append(cur)
            cur = 0
        cur += n
    if cur:
        buckets.append(cur)
    return buckets


def greedy_buckets_after(sizes: list[int], bucket_elems: int) -> list[int]:
    """Add, then flush once the running size exceeds the bucket (stage 0, multi-rank packing)."""
    buckets: list[int] = []
    cur = 0
    for n in sizes:
        cur += n
        if cur > bucket_elems:
            buckets.append(cur)
            cur = 0
    if cur:
        buckets.append(cur)
    return buckets


def build_layout(
    spec: ModelSpec,
    n: int,
    *,
    persistence_threshold: int = 0,
    model_persistence_threshold: int | None = None,
    fetch_groups: dict[str, str] | None = None,
    leaf_units: frozenset[str] = frozenset(),
) -> Layout:
    fused = fused_parameters(spec)  # transformers 5's fused MoE experts (core/moe_leaf.py)
    if fused is None:
        tensors = [Tensor(t.name, t.module, t.numel, t.layer) for t in spec.tensors if t.tied_to is None]
    else:
        tensors = [Tensor(*p) for p in fused[0]]
    total = sum(t.numel for t in tensors)
    diff = spec.params - total
    if tensors and diff > 0:
        tensors.append(Tensor("(rest of the stated count)", "(rest of the stated count)", diff))
    elif tensors and diff < 0:
        # the default shape is larger than the stated count: scale every tensor down
        # proportionally (never below 0) and give the rounding remainder to the largest
        scaled = [Tensor(t.name, t.module, t.numel * spec.params // total, t.layer) for t in tensors]
        rest = spec.params - sum(t.numel for t in scaled)
        i = max(range(len(scaled)), key=lambda k: scaled[k].numel)
        t = scaled[i]
        scaled[i] = Tensor(t.name, t.module, t.numel + rest, t.layer)
        tensors = [t for t in scaled if t.numel > 0]
    elif not tensors:
        tensors = [Tensor("(all parameters)", "(model)", spec.params)]

    persistent: list[Tensor] = []
    if persistence_threshold > 0:
        cap = model_persistence_threshold if model_persistence_threshold is not None else 2**63
        used = 0
        for t in tensors:
            if t.numel <= persistence_threshold and used + t.numel <= cap:
                persistent.append(t)
                used += t.numel
    pset = {t.name for t in persistent}

    layout = Layout(params=spec.params, n=n, tensors=tensors, persistent_tensors=persistent, _spec=spec,
                    _groups=dict(fetch_groups or {}), _renamed=fused[1] if fused is not None else {},
                    _leaf_units=leaf_units)
    order: list[str] = []
    by_mod: dict[str, Module] = {}
    for t in tensors:  # one Module per fetch unit: a grouped MoE block's modules are one
        unit = layout._groups.get(t.module, t.module)
        m = by_mod.get(unit)
        if m is None:
            m = by_mod[unit] = Module(unit, 0, 0, 0, 0)
            order.append(unit)
        m.numel += t.numel
        if t.name in pset:
            m.persistent += t.numel
        else:
            m.gathered += layout.padded(t.numel)
            m.n_gathered += 1
    layout.modules = [by_mod[k] for k in order]
    return layout


# an embedding's input is token (or position) ids: no gradient reaches it, so DeepSpeed's
# post-backward hook (parameter_offload.py PostBackwardFunctionModule) never runs for it
_ID_INPUT_ROLES = ("embed", "pos_embed")


def _fetch_units(spec: ModelSpec, tensors: list[Tensor], groups: dict[str, str],
                 renamed: dict[str, str], leaf_units: frozenset[str]) -> list[FetchUnit]:
    """One unit per spec module in spec (call) order: its own tensors plus the ones it reads through a
    tie (a tied lm head reads the embedding's parameter); its layer (what full checkpointing
    recomputes) and whether it is an MoE expert's. Modules ``groups`` maps to one name are one unit
    (transformers 5's fused experts, a ZeRO-3 leaf block: core/moe_leaf.py), at the first one's place;
    ``renamed`` gives a fused checkpoint tensor's parameter; ``leaf_units`` are ZeRO-3 leaf modules."""
    index = {t.name: i for i, t in enumerate(tensors)}
    order: list[str] = []
    params: dict[str, list[int]] = {}
    ids_input: set[str] = set()
    layer: dict[str, int | None] = {}
    expert: set[str] = set()
    for t in spec.tensors:
        unit = groups.get(t.module, t.module)
        if unit not in params:
            order.append(unit)
            params[unit] = []
            layer[unit] = t.layer
        if t.expert is not None:
            expert.add(unit)
        own = t.tied_to if t.tied_to is not None else t.name
        i = index.get(renamed.get(own, own))
        if i is not None and i not in params[unit]:
            params[unit].append(i)
        if t.role in _ID_INPUT_ROLES:
            ids_input.add(unit)
    for i, t in enumerate(tensors):  # a count spec's remainder, or tensors renamed by scaling
        if groups.get(t.module, t.module) not in params:
            order.append(t.module)
            params[t.module] = [i]
    fused = {index[n] for n in set(renamed.values()) if n in index}  # transformers' fused expert parameters
    return [FetchUnit(m, tuple(sorted(params[m])), grad_input=m not in ids_input, layer=layer.get(m),
                      expert=m in expert, saved_views=not fused.isdisjoint(params[m]), leaf=m in leaf_units)
            for m in order if params[m]]


def zero_layout_options(spec: ModelSpec, zero: ZeroConfig) -> dict:
    """``build_layout``'s options for ``spec`` under ``zero``: small parameters stay whole only in stage 3
    (``param_persistence_threshold``, capped by ``model_persistence_threshold``), where MoE layers are also
    fetched as DeepSpeed fetches transformers' modules (core/moe_leaf.py)."""
    stage3 = int(zero.stage) == 3
    return {"persistence_threshold": int(zero.param_persistence_threshold) if stage3 else 0,
            "model_persistence_threshold": zero.model_persistence_threshold,
            "fetch_groups": moe_fetch_groups(spec, zero) if stage3 else None,
            "leaf_units": moe_leaf_units(spec, zero) if stage3 else frozenset()}


def zero_layout(spec: ModelSpec, n: int, zero: ZeroConfig) -> Layout:
    """``spec`` laid out on ``n`` ranks as ``zero`` partitions it (``zero_layout_options``)."""
    return build_layout(spec, n, **zero_layout_options(spec, zero))
