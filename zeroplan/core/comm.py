"""The per-step collective ledger: which collectives one optimizer step issues, how big,
how often, over which group, in which phase, and whether they can overlap compute.

Conventions (zeroplan/specs/collectives.py): ``buffer_bytes`` is the full (unsharded)
buffer of one call in the communication dtype; ``sent_bytes_per_call`` is what one GPU
sends under ring algorithms. ``bytes_per_gpu_per_step`` = Σ count × sent_bytes_per_call.

Two flavours (``comm_model``):
- ``deepspeed`` (default) — what DeepSpeed 0.19.8 issues (deepspeed-internals.md §4.3, §7):
  stage 0 all-reduces gradient buckets once per step; stages 1–2 all-reduce gradient
  buckets (per-owner ``reduce`` with ``use_multi_rank_bucket_allreduce: false``) — stage 2
  every micro-step — then all-gather the padded flat parameters once, plus a 1-byte
  overflow flag and a 4-byte norm all-reduce; stage 3 gathers parameters as DeepSpeed's
  parameter coordinator does (core/stage3_fetch.py: fetch, prefetch within
  ``stage3_prefetch_bucket_size`` / ``stage3_max_live_parameters``, release unless reused within
  ``stage3_max_reuse_distance``; a tied head gathers the embedding's weight; under full
  checkpointing the recomputed layers fetch again inside backward), reduce-scatters
  gradient buckets every micro-step (with ``reduce_scatter: false``, all-reduces each bucket that
  fits: core/grad_buckets.py), and after the step gathers each persistent parameter and
  all-reduces an 8-byte norm.
- ``paper`` — the ZeRO paper: stages 1–2 reduce-scatter (in partition-aligned buckets of
  ``reduce_bucket_size // N`` elements per rank) + all-gather (2Ψ), stage 3
  gathers in forward and again in backward for every module (3Ψ: a tied weight and a recomputed
  layer's weights are gathered once a pass, as the runtime's paper flavour issues them).
Both use the same padded layout (core/layout.py). ZeRO++ (stage 3): qwZ gathers int8
weights plus fp32 block scales, hpZ re-gathers in backward inside the node from a
secondary partition, qgZ replaces the gradient reduce-scatter by an int4 hierarchical
all-to-all (intra-node then inter-node) when there is more than one node.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, Field

from zeroplan.core.grad_buckets import bucket_sizes, stage3_all_reduced
from zeroplan.core.layout import Layout, ceil_div, greedy_buckets_after
from zeroplan.core.memory_states import state_plan
from zeroplan.core.optimizer_step import OptimizerTraffic, optimizer_traffic
from zeroplan.core.stage3_fetch import stage3_gathers
from zeroplan.core.stage3_live import ReplayInputs, replay_inputs
from zeroplan.specs.collectives import sent_bytes
from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default
from zeroplan.specs.training import TrainingSetup

__all__ = ["LedgerEntry", "PcieTransfer", "CommLedger", "build_ledger", "offload_costs", "QWZ_BLOCK"]

# DeepSpeed's stage-0 all-reduce bucket: engine.allreduce_gradients() uses the constant
# MEMORY_OPT_ALLREDUCE_SIZE (elements), not reduce_bucket_size (measured, DS 0.19.8)
STAGE0_BUCKET = 500_000_000
# qwZ block quantisation: one fp32 scale per block of this many elements (approximation)
QWZ_BLOCK = 2048


class LedgerEntry(BaseModel):
    op: str
    phase: Literal["forward", "backward", "step"]
    what: str
    buffer_bytes: int  # full buffer of ONE call
    count: int  # calls per optimizer step
    dtype: str
    group: Literal["all", "intra-node", "inter-node"]
    group_size: int
    overlap: bool  # can overlap compute
    sent_bytes_per_call: int
    sent_bytes: int  # count × sent_bytes_per_call


class PcieTransfer(BaseModel):
    direction: Literal["host_to_device", "device_to_host"]
    what: str
    bytes_per_step: int  # per GPU
    source: Literal["cpu", "nvme"] = "cpu"  # nvme: the bytes also cross the node's NVMe bandwidth


class CommLedger(BaseModel):
    flavour: Literal["deepspeed", "paper"]
    collectives: list[LedgerEntry]
    bytes_per_gpu_per_step: int
    bytes_per_gpu_per_step_by_op: dict[str, int]
    inter_node_bytes_per_gpu_per_step: int  # bytes that cross the node boundary (per GPU)
    pcie: list[PcieTransfer] = Field(default_factory=list)
    cpu_optimizer_params_per_gpu: int = 0  # parameters the CPU optimizer updates per step (optimizer offload)
    nvme_bytes_per_gpu_per_step: int = 0  # optimizer-state swap traffic to NVMe (read + write)
    optimizer: OptimizerTraffic = Field(default_factory=OptimizerTraffic)  # the step's HBM passes on the GPU
    notes: list[str] = Field(default_factory=list)


class _Builder:
    """Collects the ledger's calls; identical calls merge into one entry with a count. Counts are kept
    in plain integers while building (a replayed stage-3 schedule adds ~1,400 calls per step) and
    turned into ``LedgerEntry`` models once, in first-call order (``entries``)."""

    def __init__(self, n: int, gpus_per_node: int):
        self.n = n
        self.gpn = min(gpus_per_node, n)
        self.nodes = ceil_div(n, self.gpn)
        self._counts: dict[tuple, list[int]] = {}  # key -> [count, bytes sent per call], insertion-ordered
        self._entries: list[LedgerEntry] | None = None

    def add(self, op: str, phase: str, what: str, buffer_bytes: int, count: int, dtype: str,
            overlap: bool, group: str = "all", group_size: int | None = None) -> None:
        if count <= 0 or buffer_bytes <= 0:
            return
        gs = self.n if group_size is None else group_size
        if gs <= 1:
            return
        key = (op, phase, what, buffer_bytes, dtype, group, gs, overlap)
        slot = self._counts.get(key)
        if slot is None:
            self._counts[key] = [count, sent_bytes(op, buffer_bytes, gs)]
        else:  # merge identical calls
            slot[0] += count
        self._entries = None

    @property
    def entries(self) -> list[LedgerEntry]:
        if self._entries is None:
            self._entries = [
                LedgerEntry(op=op, phase=phase, what=what, buffer_bytes=bb, count=c, dtype=dt, group=g, group_size=gs,
                            overlap=ov, sent_bytes_per_call=per, sent_bytes=c * per)
                for (op, phase, what, bb, dt, g, gs, ov), (c, per) in self._counts.items()]
        return self._entries

    def buckets(self, op: str, phase: str, what: str, sizes: list[int], elem_bytes: int, count: int,
                dtype: str, overlap: bool) -> None:
        for s in sizes:
            self.add(op, phase, what, s * elem_bytes, count, dtype, overlap)


def offload_costs(layout: Layout, training: TrainingSetup, zero: ZeroConfig | None) -> tuple[int, int]:
    """(parameters the CPU optimizer updates per step per GPU, NVMe optimizer swap bytes per step per GPU)."""
    zero = zero_or_default(zero)
    stage = zero.stage
    dev = zero.optimizer_offload_device  # "none" below stage 1
    if dev == "none":
        return 0, 0
    part = layout.partition_12 if stage < 3 else layout.partition_3
    nvme = 0
    if dev == "nvme":
        # fp32 master + optimizer states + fp32 gradients are read and written back each step
        nvme = 2 * int((training.optimizer_bytes_per_param + 4) * part)
    return part, nvme


def build_ledger(
    layout: Layout,
    training: TrainingSetup,
    zero: ZeroConfig | None,
    *,
    gpus_per_node: int,
    comm_model: str = "deepspeed",
    train_layout: Layout | None = None,
    no_backward: frozenset[str] = frozenset(),
) -> CommLedger:
    """The collectives of one optimizer step for ``zero.stage`` (see module docstring).

    With frozen weights (core/finetune.py) stages 0–2 communicate only the trainable parameters,
    so the caller passes their layout as ``layout``; stage 3 gathers every parameter (``layout``)
    but reduces and updates only the trainable ones (``train_layout``); ``no_backward`` names the
    modules whose output needs no gradient (``FineTuneViews.no_backward``): never re-gathered.
    """
    tl = layout if train_layout is None else train_layout
    if comm_model not in ("deepspeed", "paper"):
        raise ValueError(f"comm_model must be 'deepspeed' or 'paper', got {comm_model!r}")
    zero = zero_or_default(zero)  # every default below is ZeroConfig's (DeepSpeed's), written once
    B = _Builder(layout.n, gpus_per_node)
    notes: list[str] = []
    ds = comm_model == "deepspeed"
    if zero.stage == 0:
        _stage0(B, layout, training, zero, ds)
    elif ds and state_plan(training, zero.stage, offload=zero.optimizer_offload_device != "none").wrapper == \
            "bf16_optimizer":
        _bf16_optimizer(B, layout, training)
    elif zero.stage in (1, 2):
        _stages12(B, layout, training, zero, ds)
    else:
        _stage3_gathers(B, layout, tl, training, zero, ds, no_backward, notes)
        _stage3_reduce_and_step(B, layout, tl, training, zero, ds, notes)
    cpu_params, nvme_bytes = offload_costs(tl, training, zero)
    by_op, total, inter = _totals(B)
    return CommLedger(
        flavour=comm_model,  # type: ignore[arg-type]
        collectives=B.entries,
        bytes_per_gpu_per_step=total,
        bytes_per_gpu_per_step_by_op=by_op,
        inter_node_bytes_per_gpu_per_step=inter,
        pcie=_pcie(B, tl, training, zero),
        cpu_optimizer_params_per_gpu=cpu_params,
        nvme_bytes_per_gpu_per_step=nvme_bytes,
        optimizer=optimizer_traffic(tl, training, zero),
        notes=notes,
    )


def _stage0(B: _Builder, layout: Layout, training: TrainingSetup, zero: ZeroConfig, ds: bool) -> None:
    """Stage 0: gradient all-reduce buckets once per step (+ DeepSpeed's fp32 norm all-reduce)."""
    prec = training.precision
    B.buckets("all_reduce", "backward", "gradient bucket",
              layout.grad_buckets(STAGE0_BUCKET, order="forward", flush="after") if ds
              else layout.grad_buckets(zero.reduce_bucket_size), prec.comm_bytes, 1, prec.dtype, False)
    if ds and not prec.mixed:
        B.add("all_reduce", "step", "gradient norm", 4, 1, "float32", False)


def _bf16_optimizer(B: _Builder, layout: Layout, training: TrainingSetup) -> None:
    """BF16_Optimizer (ZeRO-1 in bf16 with fp32 gradient accumulation, core/memory_states.py): at the boundary
    engine.py ``buffered_allreduce_fallback`` all-reduces its whole-model fp32 gradient buffer cast to the
    communication dtype, one call (a single tensor is one bucket whatever its size); the step all-gathers the
    flat bf16 parameters. No overflow flag (bf16 has no loss scale) and no norm all-reduce (the norm is taken
    of gradients already reduced). Measured call for call on real DeepSpeed (tests/test_deepspeed_engine.py)."""
    prec = training.precision
    B.add("all_reduce", "backward", "fp32 gradient buffer, cast to the communication dtype",
          layout.flat_padded * prec.comm_bytes, 1, prec.dtype, False)
    B.add("all_gather", "step", "updated parameters (flat, padded to 2N)", layout.flat_padded * prec.param_bytes, 1,
          prec.dtype, False)


def _stages12(B: _Builder, layout: Layout, training: TrainingSetup, zero: ZeroConfig, ds: bool) -> None:
    """Stages 1-2: gradient buckets (all-reduce, per-owner reduce, or the paper's reduce-scatter),
    the flat parameter all-gather after the step, DeepSpeed's overflow flag and norm."""
    prec = training.precision
    b_c, cdt, n, rbs = prec.comm_bytes, prec.dtype, layout.n, zero.reduce_bucket_size
    overlap = zero.overlap_comm  # unset resolves to stage == 3 (ZeroConfig, DeepSpeed's overlap_comm_valid)
    per_step = 1 if zero.stage == 1 else training.grad_accum
    order = "forward" if (zero.stage == 1 and not overlap) else "reverse"
    if ds:
        ranges = layout.bucket_ranges_12(rbs, order)
        if zero.use_multi_rank_bucket_allreduce or not zero.reduce_scatter:
            for lo, hi in ranges:
                slices = layout.owner_slices_12(lo, hi) if zero.reduce_scatter else [hi - lo]
                for size in greedy_buckets_after(slices, rbs):
                    B.add("all_reduce", "backward", "gradient bucket", size * b_c, per_step, cdt, overlap)
        else:
            for lo, hi in ranges:
                for size in layout.owner_slices_12(lo, hi):
                    B.add("reduce", "backward", "gradient bucket slice to its owner", size * b_c, per_step, cdt,
                          overlap)
    else:
        # a reduce-scatter needs equal per-rank chunks: partition-aligned buckets of
        # c = max(1, reduce_bucket_size // N) elements per rank, ceil(Ψ₁₂/N / c) calls
        c = max(1, rbs // n)
        full, rest = divmod(layout.partition_12, c)
        B.add("reduce_scatter", "backward", "gradient bucket (partition-aligned)", n * c * b_c, per_step * full,
              cdt, overlap)
        if rest:
            B.add("reduce_scatter", "backward", "gradient bucket (partition-aligned)", n * rest * b_c, per_step,
                  cdt, overlap)
    B.add("all_gather", "step", "updated parameters (flat, padded to 2N)", layout.flat_padded * prec.param_bytes, 1,
          prec.dtype, False)
    if ds:
        if prec.mixed:
            B.add("all_reduce", "step", "overflow flag", 1, 1, "uint8", False)
        B.add("all_reduce", "step", "gradient norm", 4, 1, "float32", False)


def _stage3_gathers(B: _Builder, layout: Layout, tl: Layout, training: TrainingSetup, zero: ZeroConfig, ds: bool,
                    no_backward: frozenset[str], notes: list[str]) -> None:
    """Stage 3's parameter all-gathers in forward and backward (ZeRO++ qwZ / hpZ variants).

    DeepSpeed: replayed from its coordinator (core/stage3_fetch.py), tied weights included. Paper:
    every parameter gathered once in forward and once in backward (3Ψ with the reduce-scatter)."""
    prec = training.precision
    b_p, pdt, gas, n = prec.param_bytes, prec.dtype, training.grad_accum, layout.n
    qwz = zero.zero_quantized_weights
    hpz = zero.zero_hpz_partition_size or 1  # 0 and 1 both mean no secondary partition
    if ds:
        calls, whole = _replayed_calls(layout, tl, zero, gas, training.checkpointing == "full", no_backward)
        if whole:
            notes.append("the whole model fits in one stage-3 prefetch: one forward gather, no backward re-gather")
    else:  # the paper: every parameter gathered once in forward and once in backward (a tied one too)
        mods = [m for m in layout.modules if m.gathered > 0]
        skipped = layout.no_backward_units(no_backward)
        calls = [("forward", m.gathered, m.n_gathered, False, gas) for m in mods] + [
            ("backward", m.gathered, m.n_gathered, False, gas) for m in reversed(mods) if m.name not in skipped]
    for phase, size, nparams, recompute, count in calls:
        if phase == "backward" and hpz > 1:
            # groups of min(hpz, world) consecutive ranks (DeepSpeed 0.19.8 utils/groups.py::
            # _create_zero_param_parallel_group): larger than a node, the gather crosses the NICs
            hg = min(hpz, n)
            where = "in node" if hg <= B.gpn else f"across {-(-hg // B.gpn)} nodes"
            B.add("all_gather", "backward", f"module parameters (hpZ secondary partition, {where})",
                  size * b_p, count, pdt, True, group="intra-node" if hg <= B.gpn else "all", group_size=hg)
        elif qwz:
            B.add("all_gather", phase, "parameters (qwZ int8 + scales)", size + 4 * ceil_div(size, QWZ_BLOCK),
                  count, "int8", True)
        else:
            what = "parameters" if nparams > 1 else "module parameters"
            what = what if phase == "forward" else f"{what} re-gathered" + (" (layer recomputed)" if recompute else "")
            B.add("all_gather", phase, what, size * b_p, count, pdt, True)


def _replayed_calls(layout: Layout, tl: Layout, zero: ZeroConfig, gas: int, recompute: bool,
                    no_backward: frozenset[str]) -> tuple[tuple[tuple[str, int, int, bool, int], ...], bool]:
    """The replayed gathers of one optimizer step (core/stage3_fetch.py) as (phase, elements, parameters,
    recompute, calls), identical calls merged in first-call order (the ledger merges them the same way),
    and whether the whole model came in one forward gather. Cached per process by the replay's inputs
    (``ReplayInputs``, equal for every layout of the same model): ``recommend`` plans one model at many
    micro-batches and bucket sizes, and the replay depends on none of them."""
    return _merged_calls(replay_inputs(layout, tl, no_backward), int(zero.max_live_parameters),
                         int(zero.prefetch_bucket_size), int(zero.max_reuse_distance), int(gas), bool(recompute))


@lru_cache(maxsize=256)
def _merged_calls(inputs: ReplayInputs, max_live: int, prefetch_bucket: int, max_reuse: int, gas: int,
                  recompute: bool) -> tuple[tuple[tuple[str, int, int, bool, int], ...], bool]:
    numel, padded, persistent, units, frozen = inputs
    gathers = stage3_gathers(numel, padded, persistent, units, max_live=max_live, prefetch_bucket=prefetch_bucket,
                             max_reuse=max_reuse, grad_accum=gas, recompute_layers=recompute, frozen=frozen)
    merged: dict[tuple[str, int, int, bool], int] = {}
    for g, count in gathers:
        k = (g.phase, g.elements, min(g.params, 2), g.recompute)  # the ledger tells one parameter from several
        merged[k] = merged.get(k, 0) + count
    whole = (len(gathers) == 1 and gathers[0][0].phase == "forward"
             and gathers[0][0].params == len(numel) - sum(persistent))
    return tuple((ph, el, npar, rc, c) for (ph, el, npar, rc), c in merged.items()), whole


def _stage3_reduce_and_step(B: _Builder, layout: Layout, tl: Layout, training: TrainingSetup, zero: ZeroConfig,
                            ds: bool, notes: list[str]) -> None:
    """Stage 3's gradient buckets (core/grad_buckets.py: reduce-scatter, qgZ all-to-all, or with
    ``reduce_scatter`` off an all-reduce of a bucket that fits), the persistent gathers and the norm."""
    prec = training.precision
    gas, overlap, rbs, n = training.grad_accum, zero.overlap_comm, int(zero.reduce_bucket_size), tl.n
    buckets = bucket_sizes(tl, rbs)
    all_reduced = 0
    for sizes in buckets:
        padded = sum(ceil_div(s_, n) * n for s_ in sizes)  # reduce_scatter_coalesced pads each gradient
        if ds and stage3_all_reduced(sizes, rbs, reduce_scatter=zero.reduce_scatter,
                                     contiguous=zero.contiguous_gradients):
            all_reduced += 1
            B.add("all_reduce", "backward", "gradient bucket (reduce_scatter off: all-reduced)",
                  sum(sizes) * prec.comm_bytes, gas, prec.dtype, overlap)
        elif zero.zero_quantized_gradients and B.nodes > 1:
            int4 = ceil_div(padded, 2)
            B.add("all_to_all", "backward", "gradient bucket (qgZ int4, intra-node hop)", int4, gas, "int4",
                  overlap, group="intra-node", group_size=B.gpn)
            B.add("all_to_all", "backward", "gradient bucket (qgZ int4, inter-node hop)", ceil_div(int4, B.gpn),
                  gas, "int4", overlap, group="inter-node", group_size=B.nodes)
        else:
            B.add("reduce_scatter", "backward", "gradient bucket", padded * prec.comm_bytes, gas, prec.dtype, overlap)
    if all_reduced:
        notes.append(f"reduce_scatter is off: {all_reduced} of {len(buckets)} gradient buckets per micro-step "
                     "are all-reduced (twice a reduce-scatter's traffic)"
                     + (", which qgZ does not quantise" if zero.zero_quantized_gradients else ""))
    # stage3.py _post_step: `self.persistent_parameters[0].all_gather(self.persistent_parameters)`;
    # persistent_parameters is parameter_offload.py mark_persistent_parameters over EVERY named
    # parameter (frozen ones too: step() released them all, release_and_reset_all), so with
    # frozen weights the gathers cover the full layout's persistent tensors, not only the trainable
    for t in layout.persistent_tensors:
        B.add("all_gather", "step", "persistent parameter", layout.padded(t.numel) * prec.param_bytes, 1, prec.dtype,
              False)
    if ds:
        if zero.optimizer_offload_device != "none":
            B.add("all_reduce", "step", "gradient norm", 4, 1, "float32", False)
        else:
            B.add("all_reduce", "step", "gradient norm", 8, 1, "float64", False)


def _pcie(B: _Builder, tl: Layout, training: TrainingSetup, zero: ZeroConfig) -> list[PcieTransfer]:
    """PCIe traffic for offload (per GPU per step)."""
    prec = training.precision
    stage, n = zero.stage, tl.n
    pcie: list[PcieTransfer] = []
    off_opt = zero.optimizer_offload_device
    off_par = zero.param_offload_device
    if stage >= 1 and off_opt != "none":
        part = tl.partition_12 if stage < 3 else tl.partition_3
        down_count = 1 if stage == 1 else training.grad_accum
        pcie.append(PcieTransfer(direction="device_to_host", what="gradient partition to the CPU optimizer",
                                 bytes_per_step=part * prec.grad_bytes * down_count))
        pcie.append(PcieTransfer(direction="host_to_device", what="updated parameter partition",
                                 bytes_per_step=part * prec.param_bytes))
    if stage == 3 and off_par != "none":
        fetched = sum(e.count * (e.buffer_bytes // n) for e in B.entries if e.op == "all_gather" and e.phase != "step")
        pcie.append(PcieTransfer(direction="host_to_device", what="parameter partitions fetched for every gather",
                                 bytes_per_step=fetched, source="nvme" if off_par == "nvme" else "cpu"))
    return pcie


def _totals(B: _Builder) -> tuple[dict[str, int], int, int]:
    """(sent bytes by op, total, the part that crosses the node boundary) per GPU per step."""
    by_op: dict[str, int] = {}
    total = 0
    inter = 0
    gpn = B.gpn
    for e in B.entries:
        by_op[e.op] = by_op.get(e.op, 0) + e.sent_bytes
        total += e.sent_bytes
        if e.group == "inter-node":
            inter += e.sent_bytes
        elif e.group == "all" and B.nodes > 1:
            # a ring over all GPUs crosses each node boundary: the share of traffic that leaves
            # the node is (nodes-1)/(n-1) of a rank's ring steps
            # (a sub-group such as an hpZ group spanning k nodes: (k-1)/(group size - 1))
            inter += e.sent_bytes * (-(-e.group_size // gpn) - 1) // max(e.group_size - 1, 1)
    return by_op, total, inter
