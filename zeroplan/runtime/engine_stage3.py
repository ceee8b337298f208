"""Stage 3 setup and step: per-parameter partitions (trainable and frozen), persistence, fetch units,
the coordinator's knobs and state, hooks on every module, reduce-scatter buckets, the sub-group
step, and the per-micro-step bookkeeping of the training step (``runtime/engine.py``'s docstring
describes the schedule; the gather/release rule is in ``engine_gather``)."""

from __future__ import annotations

from typing import Any

from zeroplan.runtime.engine_gather import Stage3Gather
from zeroplan.runtime.engine_hooks import GradHooks
from zeroplan.runtime.engine_strategy import StageStrategy
from zeroplan.runtime.engine_util import ceil_div, greedy_buckets


class Stage3Strategy(Stage3Gather, GradHooks, StageStrategy):
    """Stage 3: partitions, schedule and optimizer step; gathering and reduce-scatter in ``Stage3Gather``."""

    # stage3.py reduce_independent_p_g_buckets_and_remove_grads: a bucket is reduced in the hook of the
    # gradient that would overflow it, and the last one by the epilogue (independent_gradient_partition_
    # epilogue, from the engine's allreduce_gradients), before backward_epilogue releases what is still gathered
    flush_in_next_hook = True

    def setup(self) -> None:
        """Per-parameter partitions, fetch units, prefetch chunks, use-site hooks, buckets."""
        self._setup3_partitions()
        idx_of, unit_numel = self._setup3_units()
        self._setup3_prefetch(unit_numel)
        self._setup3_sites(idx_of)
        self._setup3_buckets()
        self._install_grad_hooks()

    def _setup3_partitions(self) -> None:
        """Persistence, the trainable and frozen flat partitions, optimizer states, gradient partition."""
        torch = self.torch
        n = self.n
        thr = self.zero.param_persistence_threshold
        cap = self.zero.model_persistence_threshold
        used = 0
        self.persistent = []
        for k in self.numels:
            pers = k <= thr and used + k <= cap
            if pers:
                used += k
            self.persistent.append(pers)
        self.chunk = [ceil_div(k, n) for k in self.numels]  # p̂/N per param
        # the trainable partitions are one flat buffer (fp16_partitioned_groups_flat, the optimizer's
        # view); frozen ones are separate ds_tensors in DeepSpeed, one flat buffer here
        self.train = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.part_n = sum(self.chunk[i] for i in self.train)
        self.part_offsets = [0] * len(self.params)
        off = foff = 0
        for i, c in enumerate(self.chunk):
            if self.params[i].requires_grad:
                self.part_offsets[i] = off
                off += c
            else:
                self.part_offsets[i] = foff
                foff += c
        self.lp = self._empty(self.part_n, "params", zero=True)
        self.lp_frozen = self._empty(foff, "params", zero=True) if foff else None
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                c = self.chunk[i]
                full = self._tag(torch.zeros(c * n, dtype=self.dtype, device=self.device), "params")
                full[:self.numels[i]].copy_(p.detach().reshape(-1))
                self._part(i).copy_(full[self.rank * c:(self.rank + 1) * c])
                if self.persistent[i]:  # kept whole, stored padded to p̂ (the post-step gather writes in place)
                    p.data = full[:self.numels[i]].view(self.shapes[i])
                else:
                    p.data = self._placeholder
                del full
        self.master, self.m, self.v = self._opt_state(self.lp)
        if self.offload:
            with self._host():
                self.grad32_host = self._tag(torch.zeros(self.part_n, dtype=torch.float32, device=self.host),
                                             "optimizer_states", host=True)
        # the bit16 gradient partition, persistent: on the host with optimizer offload
        self.grad_part = (self._host_grad_part() if self.offload
                          else self._empty(self.part_n, "gradients", zero=True))
        self.live = [bool(x) for x in self.persistent]

    def _setup3_units(self) -> tuple[dict[int, int], list[int]]:
        """Modules (fetch units) in forward order: (param index by id, numel per unit)."""
        # modules (units) in forward order; D(i) = 2·Σ_{j>i} numel_j over all params of later modules
        idx_of = {id(p): i for i, p in enumerate(self.params)}
        self.unit_params: list[list[int]] = []
        unit_numel: list[int] = []
        self.unit_of_param: dict[int, int] = {}
        for _name, _mod, ps in self.units:
            idx = [idx_of[id(p)] for _, p in ps]
            for i in idx:
                self.unit_of_param[i] = len(self.unit_params)
            self.unit_params.append([i for i in idx if not self.persistent[i]])
            unit_numel.append(sum(self.numels[i] for i in idx))
        return idx_of, unit_numel

    def _setup3_prefetch(self, unit_numel: list[int]) -> None:
        """The coordinator's knobs and state (DeepSpeed 0.19.8 ``PartitionedParameterCoordinator``;
        the rule itself runs in ``engine_gather``). ``paper``: no prefetch, and a parameter is kept
        only until its last read in the pass, so each is gathered once in forward and once in
        backward (a tied weight too)."""
        self.max_live = self.zero.max_live_parameters if self.ds else 0
        self.prefetch_bucket = self.zero.prefetch_bucket_size if self.ds else 0
        self.max_reuse = self.zero.max_reuse_distance if self.ds else 0
        self.trace: list[int] = []  # site per fetch, recorded in the first micro-step (record_module)
        self.trace_phases: list[str] = []  # forward / backward per trace entry (the paper's per-pass rule)
        self.trace_mode = "invalid"  # -> "record" at the first forward, "complete" at the second
        self.release_cache: dict[tuple[int, int], set[int]] = {}  # __params_to_release's lru_cache
        self.active: dict[int, set[int]] = {i: set() for i in range(len(self.params))}  # ds_active_sub_modules
        self.inflight: set[int] = set()  # prefetched, not yet waited on by a fetch
        self.backward_sites: dict[int, None] = {}  # fetched in backward, not yet released (in order)
        self.attributed: dict[int, set[int]] = {}  # frozen params a recomputation holds for a site
        self.queue: Any = None
        self.recent: dict[int, int] = {}  # __most_recent_step_id_param_fetched_for
        self.step_id = 0
        self.n_available = 0

    def _setup3_sites(self, idx_of: dict[int, int]) -> None:
        """Hooks on every module (its parameters: its own, and a tied one read through ``_source``):
        pre-forward fetch (and the post-backward release node on its inputs),
        post-forward release (and the pre-backward fetch node on its output); the model's own
        pre-forward hook starts each micro-step (``reset_step``)."""
        self._hooks.append(self.model.register_forward_pre_hook(lambda _m, _a: self._reset_step3()))
        self.sites: dict[int, int] = {}  # id(module) -> site index
        self.site_params: list[list[int]] = []
        self.site_names: list[str] = []
        for name, mod in self.model.named_modules():
            ps: list[int] = []
            owners = [mod] + ([mod._source] if getattr(mod, "_source", None) is not None else [])
            for o in owners:
                for p in o.parameters(recurse=False):
                    i = idx_of.get(id(p))
                    if i is not None and i not in ps:
                        ps.append(i)
            # every module is hooked, as parameter_offload.py _register_deepspeed_module does: a
            # called module without parameters (the model itself) is a trace entry too, and its
            # fetch is where a prefetch can start (the whole model in one call, before the embedding)
            self.sites[id(mod)] = len(self.site_params)
            self.site_params.append(sorted(ps))  # ds_id order (the engine's parameter order)
            self.site_names.append(name)
            self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(mod.register_forward_hook(self._post_forward))
        nu = len(self.unit_params)
        self.unit_seen = [0] * nu
        self.unit_pending = [0] * nu

    def _setup3_buckets(self) -> None:
        """Gradient buckets in gradient-ready order, flushed before a gradient that would overflow them
        (stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``: unpadded sizes); the ipg bucket,
        into which each gradient of a bucket that fits is copied, unpadded, at its offset."""
        order = self._ready_order()  # trainable only: frozen parameters get no gradient
        self.buckets = [(0, 0, [order[k] for k in idx])
                        for idx in greedy_buckets([self.numels[i] for i in order], self.rbs)]
        self.ipg = [self._empty(self.rbs, "buffers")] if self.contiguous else []
        self._bucket_total = [sum(self.numels[i] for i in ps) for _, _, ps in self.buckets]
        self._pos3 = {}
        for _, _, ps in self.buckets:
            pos = 0
            for i in ps:
                self._pos3[i] = pos
                pos += self.numels[i]

    def _part(self, i: int) -> Any:
        """Param i's stage-3 partition (p̂/N elements): in the trainable flat buffer or the frozen one."""
        src = self.lp if self.params[i].requires_grad else self.lp_frozen
        return src[self.part_offsets[i]:self.part_offsets[i] + self.chunk[i]]

    def before_forward(self) -> None:
        self.unit_seen = [0] * len(self.unit_params)

    def before_backward(self) -> None:
        self._begin_backward_hooks()
        self.unit_pending = [0] * len(self.unit_params)
        for i in self.train:
            self.unit_pending[self.unit_of_param[i]] += 1

    def after_backward(self) -> None:
        if self._ptr != len(self._order):
            raise RuntimeError("stage 3: some parameters received no gradient in backward")
        self._flush_last_bucket()
        self._release([i for i in range(len(self.params)) if self.live[i]])

    def step(self) -> None:
        """AdamW per sub-group, the persistent params re-gathered, the norm all-reduce."""
        torch = self.torch
        sgs = self.zero.sub_group_size
        groups = []
        start = cur = 0
        for c in (self.chunk[i] for i in self.train):
            cur += c
            if cur - start >= sgs:
                groups.append((start, cur))
                start = cur
        if cur > start:
            groups.append((start, cur))
        norm_sq = torch.zeros((), dtype=torch.float64)
        for a, b in groups:
            self._step_group(self.grad_part[a:b], self.master[a:b], self.m[a:b], self.v[a:b], self.lp[a:b], a)
            norm_sq = norm_sq + self._norm_sq.cpu()
        self.grad_part.zero_()
        # stage3.py _post_step: `self.persistent_parameters[0].all_gather(self.persistent_parameters)`
        # re-gathers EVERY persistent parameter, frozen ones too (step() released them all first:
        # _partition_all_parameters -> release_and_reset_all)
        for i, p in enumerate(self.params):
            if self.persistent[i]:  # in place into the padded whole copy
                c = self.chunk[i]
                full = self.torch.empty(0, dtype=self.dtype, device=self.device).set_(
                    p.data.untyped_storage(), 0, (c * self.n,))
                self.comm.all_gather(full, self._part(i))
                del full
        if self.ds:
            dt = torch.float32 if self.offload else torch.float64  # DeepSpeed 0.19.8: 4 B with offload
            norm = norm_sq.reshape(1).to(device=self.device, dtype=dt)
            self.comm.all_reduce(norm)
