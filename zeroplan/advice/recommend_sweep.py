"""The sweep's shared evaluation: what ``recommend`` computes once and reuses across the search grid.

``_Family`` holds one ZeRO stage's grid of (offload, reduce bucket, prefetch bucket, hpZ) points and
evaluates their non-activation bytes per phase, host/NVMe bytes and collective ledger, composing a
point additively from single-axis variants where that is exact (checked once per stage). ``_Sweep``
holds what is shared across stages (layouts per persistence setting, trainings per micro-batch and
checkpointing, per-sample activations) and turns a point into its peak and step time with the same
core functions ``evaluate()`` uses.

Imports: module level only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from zeroplan.advice.recommend_models import CKPT_ORDER, candidate_zero
from zeroplan.core.activations import activation_memory
from zeroplan.core.allocator import communicators, release_under_pressure, required_bytes, reserved_bytes
from zeroplan.core.backward_moments import activation_at
from zeroplan.core.comm import CommLedger, PcieTransfer, build_ledger, offload_costs
from zeroplan.core.cublas_workspace import device_overhead
from zeroplan.core.layout import build_layout, zero_layout_options
from zeroplan.core.finetune import backward_skips, ledger_layouts
from zeroplan.core.finetune_compute import matmul_work
from zeroplan.core.memory import memory_for_stage, step_reads_autograd
from zeroplan.core.optimizer_step import optimizer_traffic
from zeroplan.core.timing import estimate_time

__all__: list[str] = []  # internal to recommend: _State, _Family, _Sweep


@dataclass
class _State:
    """One (stage, offload, buckets, hpZ) point: everything that does not depend on the batch."""

    stage: int
    off_opt: str
    off_par: str
    rbs: int
    prefetch: int | None
    hpz: int
    zero: Any
    na: tuple[int, int]  # non-activation live bytes: forward, step
    host_per_node: int
    nvme_per_node: int
    deviation: int  # how many searched keys differ from the base config
    key: tuple = ()
    # side-stream pools (all-gather fwd/bwd, reduce-scatter, reduction), step blocks, then the held bytes
    # (no split slack) of the forward and the step
    side: tuple[int, ...] = (0, 0, 0, 0, 0, 0, 0)
    communicators: int = 2
    # the backward's moments (core/backward_moments.py): (activations, non-activation bytes, held bytes,
    # layers done, all-gather stream bytes, reduce-scatter stream bytes; -1: the phase's) each, in
    # core.memory's order
    moments: tuple[tuple[str, int, int, int, int, int], ...] = ()
    step_pinned: bool = False  # the step reads autograd's p.grad (core/memory.py grads_from_autograd)
    # stage 3 under full checkpointing: the recomputation's fetches change the gathers through the backward
    moments_full: tuple[tuple[str, int, int, int, int, int], ...] | None = None
    # stage 3's forward moments (core/memory.py forward_moments): (activations, non-activation bytes, layers done,
    # all-gather stream bytes) each; empty: the forward is ``na[0]`` beside the activations' forward peak
    fwd_moments: tuple[tuple[str, int, int, int], ...] = ()


def _moments(m: Any) -> tuple[tuple, tuple[int, ...]]:
    """core/memory.py's backward moments from one evaluation: their activation kinds with the layers
    done, and per moment the non-activation live bytes, the held bytes (core/memory.py held_bytes) and
    the bytes on the all-gather and reduce-scatter streams (-1: the phase's, core/backward_moments.py
    side); then stage 3's forward moments (core/memory.py forward_moments): kinds, and per moment the
    non-activation live bytes and the all-gather stream bytes. Kinds: (backward's, forward's)."""
    f = m.phases["forward"].by_category
    base = f["params"] + f["optimizer_states"]
    kinds, values = [], []
    for mo in m.backward_moments:
        grads = max(f["gradients"], mo.gradients)
        kinds.append((mo.activations, mo.layers_done))  # composed only between points with the same moments
        side = mo.side or {}
        values += [base + grads + mo.autograd + mo.buffers, base + (0 if m.gradients_churned else grads) + mo.held_buffers,
                   side.get("allgather", -1), side.get("reduce_scatter", -1)]
    fkinds = []
    for mo in m.forward_moments:
        fkinds.append((mo.activations, mo.layers_done))
        values += [base + f["gradients"] + mo.buffers, mo.side["allgather"]]
    return (tuple(kinds), tuple(fkinds)), tuple(values)


def _unpack(kinds: tuple, flat: tuple) -> tuple[tuple[str, int, int, int, int, int], ...]:
    """``_moments``' backward kinds and values as (activations, non-activation bytes, held bytes, layers done,
    all-gather stream bytes, reduce-scatter stream bytes) per moment."""
    back = kinds[0]
    return tuple((kind, nonact, h, done, ag, r)
                 for (kind, done), (nonact, h, ag, r) in zip(back, zip(*[iter(flat[:4 * len(back)])] * 4)))


def _unpack_forward(kinds: tuple, flat: tuple) -> tuple[tuple[str, int, int, int], ...]:
    """``_moments``' forward kinds and values as (activations, non-activation bytes, layers done, all-gather
    stream bytes) per moment."""
    rest = flat[4 * len(kinds[0]):]
    return tuple((kind, nonact, done, ag) for (kind, done), (nonact, ag) in zip(kinds[1], zip(*[iter(rest)] * 2)))


def _entry_key(e: Any) -> tuple:
    return (e.op, e.phase, e.what, e.buffer_bytes, e.dtype, e.group, e.group_size, e.overlap, e.sent_bytes_per_call)


class _Family:
    """All states of one stage, on a grid of axes (offload, reduce bucket, prefetch, hpZ).

    The non-activation bytes per phase, host/NVMe bytes and the collective ledger (as a multiset of
    calls) are evaluated directly at the base point and at every single-axis variant; any other
    point is composed additively from those (each axis changes its own buffers and collectives).
    The composition is checked once per stage against a direct evaluation of the far corner of the
    grid; if it differs — an interaction between axes — every point is evaluated directly.
    """

    def __init__(self, sweep: "_Sweep", stage: int, axes: list[list[Any]]):
        self.sw = sweep
        self.stage = stage
        self.axes = axes
        self.base = tuple(v[0] for v in axes)
        self.corner = tuple(v[-1] for v in axes)
        self._mem: dict[tuple, tuple] = {}
        self._led: dict[tuple, tuple] = {}
        # per recomputation flag (stage 3's gathered parameters through the backward depend on it)
        self.mem_ok: dict[bool, bool | None] = {r: None if self.corner != self.base else True for r in (False, True)}
        self.led_ok: bool | None = None if self.corner != self.base else True
        self.direct_evals = 0
        self.direct_ledgers = 0

    def _singles(self, point: tuple) -> list[tuple]:
        out = []
        for i, v in enumerate(point):
            if v != self.base[i]:
                q = list(self.base)
                q[i] = v
                out.append(tuple(q))
        return out

    # -- memory --
    def _mem_direct(self, point: tuple, recompute: bool = False) -> tuple:
        """``recompute``: full checkpointing (stage 3's backward gathers follow the recomputation)."""
        key = (point, recompute)
        if key not in self._mem:
            self.direct_evals += 1
            zero = self.sw.zero(self.stage, point)
            ref = self.sw.training(1, "full") if recompute else self.sw.ref_training
            m = memory_for_stage(self.sw.spec, ref, zero, self.sw.n, gpus_per_node=self.sw.gpn,
                                 overhead=self.sw.overhead, layout=self.sw.layout(zero), flavour=self.sw.comm_model,
                                 finetune=self.sw.inp.finetune, train_layout=self.sw.train_layout(zero))
            f = m.phases["forward"].by_category
            st = m.phases["step"].by_category
            kinds, moments = _moments(m)
            self._mem[key] = (kinds, f["params"] + f["gradients"] + f["optimizer_states"] + f["buffers"],
                                sum(st.values()), m.host.per_node_bytes, m.host.nvme_per_node_bytes,
                                m.buffers_detail.get("gathered_params_forward", 0),
                                m.buffers_detail.get("gathered_params_backward", 0),
                                m.buffers_detail.get("reduce_scatter_temp", 0) if self.stage == 3 else 0,
                                m.buffers_detail.get("allreduce_flatten", 0)
                                if self.stage in (1, 2) and zero.overlap_comm else 0,
                                m.step_transient_bytes, m.held_bytes["forward"], m.held_bytes["step"], *moments)
        return self._mem[key]

    def _mem_composed(self, point: tuple, recompute: bool = False) -> tuple | None:
        """The base plus each single-axis variant's difference; None where a variant has other backward
        moments than the base (then nothing composes)."""
        base = self._mem_direct(self.base, recompute)
        acc = list(base[1:])
        for q in self._singles(point):
            d = self._mem_direct(q, recompute)
            if d[0] != base[0]:
                return None
            acc = [a + (x - y) for a, x, y in zip(acc, d[1:], base[1:])]
        return (base[0], *acc)

    def memory(self, point: tuple, recompute: bool = False) -> tuple:
        if (point, recompute) in self._mem:
            return self._mem[(point, recompute)]
        if self.mem_ok[recompute] is None:
            self.mem_ok[recompute] = (self._mem_composed(self.corner, recompute)
                                      == self._mem_direct(self.corner, recompute))
        if self.mem_ok[recompute] and len(self._singles(point)) > 1:
            composed = self._mem_composed(point, recompute)
            if composed is not None:
                return composed
        return self._mem_direct(point, recompute)

    # -- ledger --
    def _led_direct(self, point: tuple, recompute: bool = False) -> tuple:
        """``recompute``: full checkpointing (stage 3 gathers again for the recomputed layers)."""
        if (point, recompute) not in self._led:
            self.direct_ledgers += 1
            zero = self.sw.zero(self.stage, point)
            lay, train = ledger_layouts(self.sw.layout(zero), self.sw.train_layout(zero), self.stage)
            ft = self.sw.inp.finetune
            training = self.sw.inp.training.model_copy(update={"checkpointing": "full" if recompute else "none"})
            led = build_ledger(lay, training, zero, gpus_per_node=self.sw.gpn,
                               comm_model=self.sw.comm_model, train_layout=train,
                               no_backward=backward_skips(ft, training.checkpointing))  # as core/plan.py
            calls = Counter()
            proto = {}
            for e in led.collectives:
                k = _entry_key(e)
                calls[k] += e.count
                proto[k] = e
            pcie = Counter((p.direction, p.what, p.bytes_per_step, p.source) for p in led.pcie)
            self._led[(point, recompute)] = (calls, pcie, proto)
        return self._led[(point, recompute)]

    def _led_composed(self, point: tuple, recompute: bool) -> tuple:
        calls0, pcie0, proto0 = self._led_direct(self.base, recompute)
        calls, pcie, proto = Counter(calls0), Counter(pcie0), dict(proto0)
        for q in self._singles(point):
            c, p, pr = self._led_direct(q, recompute)
            calls.update(c)
            calls.subtract(calls0)
            pcie.update(p)
            pcie.subtract(pcie0)
            proto.update(pr)
        if any(v < 0 for v in calls.values()) or any(v < 0 for v in pcie.values()):
            return None  # type: ignore[return-value]
        return (+calls, +pcie, proto)

    def ledger(self, point: tuple, recompute: bool = False) -> tuple:
        if (point, recompute) in self._led:
            return self._led[(point, recompute)]
        if self.led_ok is None:
            comp = self._led_composed(self.corner, recompute)
            self.led_ok = comp is not None and comp[:2] == self._led_direct(self.corner, recompute)[:2]
        if self.led_ok and len(self._singles(point)) > 1:
            comp = self._led_composed(point, recompute)
            if comp is not None:
                return comp
        return self._led_direct(point, recompute)


class _Sweep:
    def __init__(self, inp: Any, *, comm_model: str, mfu: float | None, base_zeros: dict[int, Any]):
        self.inp = inp
        self.hw = inp.hardware
        # with frozen weights, the layouts hold every parameter incl. adapters (core/finetune.py)
        self.spec = inp.spec if inp.finetune is None else inp.finetune.full
        self.work = matmul_work(inp.spec, inp.finetune)  # frozen weights skip the weight-gradient GEMM
        self.n = inp.n_gpus
        self.gpn = inp.gpus_per_node
        self.comm_model = comm_model
        self.mfu = mfu
        self.base_zeros = base_zeros
        self.overhead = device_overhead(self.hw)
        self.ref_training = inp.training.model_copy(update={"micro_batch": 1, "checkpointing": "none"})
        self._layouts: dict[tuple, Any] = {}
        self._trainings: dict[tuple, Any] = {}
        self._zeros: dict[tuple, Any] = {}
        self.families: dict[int, _Family] = {}
        # activations for ONE sample (exactly linear in the micro-batch), per checkpointing policy
        self.act_fwd: dict[str, int] = {}
        self.act_bwd: dict[str, tuple[int, ...]] = {}  # the backward's peaks: overall, head, top layer, per layer
        self._act: dict[str, Any] = {}
        for c in CKPT_ORDER:
            a = self._act[c] = activation_memory(self.spec, self.training(1, c))
            self.act_fwd[c] = a.forward_peak  # as core/memory.py charges them
            self.act_bwd[c] = (a.backward_peak, a.backward_head_peak or 0, a.backward_layer_peak or 0, a.per_layer)

    def training(self, mb: int, ckpt: str) -> Any:
        key = (mb, ckpt)
        t = self._trainings.get(key)
        if t is None:
            t = self.inp.training.model_copy(update={"micro_batch": mb, "checkpointing": ckpt})
            self._trainings[key] = t
        return t

    def layout(self, zero: Any) -> Any:
        # as core/layout.py zero_layout, kept per persistence knobs and stage 3 (the leaf classes are the config's)
        key = (int(zero.param_persistence_threshold) if zero.stage == 3 else 0, zero.model_persistence_threshold,
               zero.stage == 3)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = build_layout(self.spec, self.n, **zero_layout_options(self.spec, zero))
        return lay

    def train_layout(self, zero: Any) -> Any:
        """The trainable parameters' layout (None without frozen weights)."""
        if self.inp.finetune is None:
            return None
        key = ("train", int(zero.param_persistence_threshold) if zero.stage == 3 else 0,
               zero.model_persistence_threshold, zero.stage == 3)
        lay = self._layouts.get(key)
        if lay is None:
            trainable = self.inp.finetune.trainable
            lay = self._layouts[key] = build_layout(trainable, self.n, **zero_layout_options(trainable, zero))
        return lay

    def zero(self, stage: int, point: tuple) -> Any:
        key = (stage, point)
        z = self._zeros.get(key)
        if z is None:
            (oo, op), rbs, pf, hpz = point
            z = self._zeros[key] = candidate_zero(self.base_zeros[stage], offload_optimizer=oo, offload_param=op,
                                                  reduce_bucket_size=rbs, prefetch_bucket_size=pf,
                                                  hpz_partition_size=hpz)
        return z

    def state(self, stage: int, point: tuple) -> _State:
        fam = self.families[stage]
        kinds, fwd, stp, host, nvme, *rest = fam.memory(point)
        side, flat = rest[:7], rest[7:]
        (oo, op), rbs, pf, hpz = point
        bz = self.base_zeros[stage]
        dev = int(rbs != bz.reduce_bucket_size)
        if stage == 3:
            dev += int(pf != bz.prefetch_bucket_size) + int(hpz != bz.zero_hpz_partition_size)
        dev += int(oo != bz.optimizer_offload_device) + int(op != bz.param_offload_device)
        return _State(stage=stage, off_opt=oo, off_par=op, rbs=rbs, prefetch=pf, hpz=hpz, zero=None,
                      na=(fwd, stp), host_per_node=host, nvme_per_node=nvme, deviation=dev, key=point,
                      side=tuple(side), communicators=communicators(self.zero(stage, point), stage, self.n),
                      moments=_unpack(kinds, flat), fwd_moments=_unpack_forward(kinds, flat),
                      moments_full=_unpack(*self._full_moments(fam, point)) if stage == 3 else None,
                      step_pinned=step_reads_autograd(self.ref_training, self.zero(stage, point),
                                                      flavour=self.comm_model))

    @staticmethod
    def _full_moments(fam: _Family, point: tuple) -> tuple[tuple, tuple]:
        kinds, _fwd, _stp, _host, _nvme, *rest = fam.memory(point, True)  # laid out as in state()
        return kinds, tuple(rest[7:])

    def peak(self, s: _State, mb: int, ckpt: str) -> int:
        """Exactly core.memory's peak: the caching allocator's pools over the phases' live bytes
        (core/allocator.py), capped as on the card when the cache would outgrow it, plus the CUDA
        context and NCCL per communicator."""
        fwd, stp = s.na
        ag_f, ag_b, rs, red, step_transient, held_f, held_s = s.side
        # core/memory.py _phases: the largest backward moment, the first on a tie, with its held bytes;
        # every activation term is exactly linear in the micro-batch
        act = self._act[ckpt]
        moments = s.moments_full if ckpt == "full" and s.moments_full is not None else s.moments
        at = [(nonact + mb * activation_at(act, kind, done), h, ag, r) for kind, nonact, h, done, ag, r in moments]
        b_live, held_b, ag_at, rs_at = at[max(range(len(at)), key=lambda k: at[k][0])]
        live = {"forward": fwd + mb * self.act_fwd[ckpt], "backward": b_live, "step": stp}
        if s.fwd_moments:  # core/memory.py _phases: stage 3's largest forward moment, the first on a tie
            fat = [(nonact + mb * activation_at(act, kind, done), ag) for kind, nonact, done, ag in s.fwd_moments]
            live["forward"], ag_f = fat[max(range(len(fat)), key=lambda k: fat[k][0])]
        held = {"forward": held_f, "backward": held_b, "step": held_s}
        pools = {"allgather": {"forward": ag_f, "backward": ag_b}, "reduce_scatter": {"backward": rs},
                 "reduction": {"backward": red}}
        if ag_at >= 0:  # core/backward_moments.py set_backward_side: the streams' bytes at that moment
            pools["allgather"].update(backward=ag_at, backward_max=max(m[4] for m in moments))
            pools["reduce_scatter"].update(backward=rs_at, backward_max=max(m[5] for m in moments))
        o = self.overhead
        frag, expandable = float(o["fragmentation_fraction"]), self.inp.training.expandable_segments
        _, reserved, _ = reserved_bytes(live, pools, fragmentation_fraction=frag, expandable_segments=expandable,
                                        step_transient=step_transient, held_by_phase=held)
        outside = int(o["cuda_context_bytes"]) + int(o["nccl_bytes"]) * s.communicators
        capacity = int(self.hw.gpu.memory_bytes)
        if reserved + outside > capacity:  # core/memory.py _device_figures: the cache gives way before an OOM
            required = required_bytes(live, pools, fragmentation_fraction=frag, expandable_segments=expandable,
                                      step_transient=step_transient, step_pinned=s.step_pinned, held_by_phase=held)
            reserved = release_under_pressure(reserved, min(required, reserved), outside, capacity)
        return reserved + outside

    def ledger(self, s: _State, ckpt: str = "none") -> Any:
        """The state's collective ledger for estimate_time: independent of the micro-batch, and of
        checkpointing but in stage 3, where full checkpointing gathers again for the recomputed layers
        (core/stage3_fetch.py ``micro_step_events``)."""
        calls, pcie, proto = self.families[s.stage].ledger(s.key, s.stage == 3 and ckpt == "full")
        entries = []
        for k, count in calls.items():
            e = proto[k]
            entries.append(e.model_copy(update={"count": count, "sent_bytes": count * e.sent_bytes_per_call}))
        total = sum(e.sent_bytes for e in entries)
        by_op: dict[str, int] = {}
        for e in entries:
            by_op[e.op] = by_op.get(e.op, 0) + e.sent_bytes
        pc = [PcieTransfer(direction=d, what=w, bytes_per_step=b, source=src) for (d, w, b, src), c in pcie.items()
              for _ in range(c)]
        zero = self.zero(s.stage, s.key)
        layout = self.train_layout(zero) or self.layout(zero)  # what the optimizer updates (build_ledger's tl)
        cpu_params, nvme_bytes = offload_costs(layout, self.inp.training, zero)
        return CommLedger(flavour=self.comm_model, collectives=entries, bytes_per_gpu_per_step=total,
                          bytes_per_gpu_per_step_by_op=by_op, inter_node_bytes_per_gpu_per_step=0, pcie=pc,
                          cpu_optimizer_params_per_gpu=cpu_params, nvme_bytes_per_gpu_per_step=nvme_bytes,
                          optimizer=optimizer_traffic(layout, self.inp.training, zero))

    def time(self, ledger: Any, mb: int, ckpt: str) -> Any:
        return estimate_time(ledger, self.training(mb, ckpt), self.hw, active_params=self.spec.active_params,
                             n_gpus=self.n, gpus_per_node=self.gpn, mfu=self.mfu, model=self.spec,
                             work=self.work)

