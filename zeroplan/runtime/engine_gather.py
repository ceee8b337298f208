"""Stage 3 at run time: DeepSpeed 0.19.8's parameter coordinator (partitioned_param_coordinator.py)
driven by hooks as parameter_offload.py drives it. The first micro-step records the trace (every
module fetch, forward then backward); from the second on, a module's fetch gathers its missing
parameters in one all-gather, pops its entries off the trace queue and prefetches the next ones in
one all-gather while their numel stays below min(max_live_parameters - available,
prefetch_bucket_size); a module releases its parameters after its forward and, from a node on its
inputs, after its backward, unless persistent, still used by another module, prefetched for a later
step, or read again within max_reuse_distance elements of the trace (decided once per module and
step id, as DeepSpeed's lru_cache does). A tied head reads the embedding's weight (``_source``), so
the weight is gathered for it as for the embedding. Under full checkpointing the recomputed layer
calls its modules again inside backward, so these hooks fetch, record and release for it as
DeepSpeed's do, and a frozen parameter it fetches is held for the backward site that is running
(``update_recompute_parameters``) (measured equal: tests/test_deepspeed_tied.py). Also gradient arrival and the bucketed reduce-scatter (a mixin of
``engine_stage3.Stage3Strategy``)."""

from __future__ import annotations

from collections import deque
from typing import Any

_NEVER = -(10**10)  # DeepSpeed's defaultdict(lambda: int(-1e10)) for a parameter never fetched


class Stage3Gather:
    """Stage 3 gather / release / reduce-scatter (a mixin of ``engine_stage3.Stage3Strategy``)."""

    # -- DeepSpeed 0.19.8's PartitionedParameterCoordinator (partitioned_param_coordinator.py), as
    # parameter_offload.py's hooks drive it: a trace recorded in the first micro-step, then
    # fetch = the module's missing parameters in one call + a prefetch from the trace queue,
    # release = unless persistent, still in use, prefetched for later, or reused within
    # max_reuse_distance elements of the trace.

    def _reset_step3(self) -> None:
        """``reset_step`` (the model's pre-forward hook): in-flight prefetches released, the trace
        frozen after the recording micro-step, queue and counters restarted."""
        for i in sorted(self.inflight):
            self.inflight.discard(i)
            self._release_param(i)
        if self.trace_mode == "record":
            self.trace_mode = "complete"
        elif self.trace_mode == "invalid":
            self.trace_mode = "record"
        if self.trace_mode == "complete":
            self.queue = deque((i, sid) for sid, site in enumerate(self.trace) for i in self.site_params[site])
        self.recent = {}
        self.step_id = 0
        self.n_available = 0

    def _pre_forward(self, mod: Any, args: Any) -> Any:
        site = self.sites[id(mod)]
        self._fetch(site)
        torch = self.torch
        if self.backward_sites and torch._C._current_graph_task_id() != -1:
            self._hold_for_backward(site)
        if not torch.is_grad_enabled():
            return None
        # parameter_offload.py _post_backward_module_hook: a node on every input that needs a
        # gradient; the release runs once all of them got theirs (never for token ids)
        wrapped = [a.requires_grad if isinstance(a, torch.Tensor) else False for a in args]
        if not any(wrapped):
            return None
        counter = [sum(wrapped)]
        return tuple(_PostBackward.apply(self, site, counter, a) if w else a for a, w in zip(args, wrapped))

    def _post_forward(self, mod: Any, args: Any, out: Any) -> Any:
        site = self.sites[id(mod)]
        self._release_site(site)
        torch = self.torch
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            return _PreBackward.apply(self, (site,), out)
        return out

    def _pre_backward(self, sites: tuple[int, ...]) -> None:
        with self.comm.in_phase("backward"):
            for site in sites:
                self.backward_sites.setdefault(site)  # __active_backward_submodules
                self._fetch(site)

    def _hold_for_backward(self, site: int) -> None:
        """A forward inside backward (full checkpointing's recomputation): the frozen parameters it
        fetched are held for the backward site that is running and released with it
        (``_fetch_sub_module_impl`` -> ``update_recompute_parameters``; torch saves a frozen
        parameter itself, not a detached copy, so releasing it after the recomputed forward would
        leave the backward an empty tensor)."""
        owner = next(reversed(self.backward_sites))
        for i in self.site_params[site]:
            if not self.params[i].requires_grad:
                self.attributed.setdefault(owner, set()).add(i)
                self.active[i].add(owner)

    def _fetch(self, site: int) -> None:
        """``fetch_sub_module``: the site's unavailable parameters in one all-gather, then (complete
        trace) its queue entries popped and the next ones prefetched in one all-gather."""
        if self.trace_mode == "record":
            self.trace.append(site)
            self.trace_phases.append(self.comm.phase)
        ps = self.site_params[site]
        todo = [i for i in ps if not self.live[i]]
        if todo:
            self._gather_params(todo)
            self.n_available += sum(self.numels[i] for i in todo)
        for i in ps:
            self.active[i].add(site)
            self.inflight.discard(i)
        if self.trace_mode == "complete":
            sid = self.step_id
            need = sum(1 for i in ps if self.recent.get(i, _NEVER) < sid)
            for _ in range(need):
                if not self.queue:
                    break
                i, at = self.queue.popleft()
                self.recent[i] = at
            if self.prefetch_bucket > 0:
                self._prefetch(min(self.max_live - self.n_available, self.prefetch_bucket))
        self.step_id += 1

    def _prefetch(self, room: int) -> None:
        """Queue entries popped while the prefetched numel is below ``room``; one all-gather."""
        chosen: list[int] = []
        numel = 0
        while self.queue and numel < room:
            i, at = self.queue.popleft()
            if not self.live[i] and i not in chosen:
                chosen.append(i)
                numel += self.numels[i]
            self.recent[i] = max(self.recent.get(i, _NEVER), at)
        if chosen:
            self._gather_params(chosen)
            self.n_available += numel
            self.inflight.update(chosen)

    def _to_release(self, site: int) -> set[int]:
        """``__params_to_release``: cached per (site, step id) like DeepSpeed's ``lru_cache``."""
        if self.trace_mode != "complete":
            return {i for i in self.site_params[site] if not self.persistent[i]}
        key = (site, self.step_id)
        if key not in self.release_cache:
            out = {i for i in self.site_params[site]
                   if not self.persistent[i] and self.recent.get(i, _NEVER) <= self.step_id}
            if not self.ds:  # the paper: each parameter gathered once a pass, released after its last read in it
                phase = self.comm.phase
                for sid in range(self.step_id, len(self.trace)):
                    if self.trace_phases[sid] == phase:
                        out.difference_update(self.site_params[self.trace[sid]])
            traversed = 0
            for later in self.trace[self.step_id:] if self.ds else ():
                if traversed >= self.max_reuse:
                    break
                for i in self.site_params[later]:
                    out.discard(i)
                    traversed += self.numels[i]
            self.release_cache[key] = out
        return self.release_cache[key]

    def _release_site(self, site: int, backward: bool = False) -> None:
        """``release_sub_module``; after a backward also the frozen parameters a recomputation
        attributed to the site, whatever the reuse distance."""
        rel = self._to_release(site)
        ps = set(self.site_params[site])
        if backward:
            self.backward_sites.pop(site, None)
            extra = self.attributed.pop(site, set())
            rel = rel | {i for i in extra if not self.persistent[i]}
            ps |= extra
        for i in sorted(ps):
            self.active[i].discard(site)
            if i in rel:
                self._release_param(i)

    def _release_param(self, i: int) -> None:
        """``__release_param``: a gathered parameter no site is using any more."""
        if self.live[i] and not self.persistent[i] and i not in self.inflight and not self.active[i]:
            self.params[i].data = self._placeholder
            self.live[i] = False
            self.n_available -= self.numels[i]

    def _gather_params(self, ps: list[int]) -> None:
        """One all-gather of the params ``ps`` (Σp̂ elements); each param becomes a full tensor.

        A ``MemoryError`` raised inside (a tracker's memory limit, a CUDA OOM) gets a ``where``
        attribute naming the gather and its size.
        """
        try:
            self._gather_params_inner(ps)
        except MemoryError as exc:
            names = sorted({self.names[i].rsplit(".", 1)[0] for i in ps})
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            exc.where = (f"stage-3 all-gather of {shown} ({sum(self.chunk[i] for i in ps) * self.n} elements, "
                         f"{self.comm.phase})")
            raise

    def _gather_params_inner(self, ps: list[int]) -> None:
        torch = self.torch
        n = self.n
        with torch.no_grad():
            if len(ps) == 1:  # the param is a view into its padded buffer
                i = ps[0]
                c = self.chunk[i]
                out = self._empty(c * n, "buffers")
                self.comm.all_gather(out, self._part(i))
                self.params[i].data = out[:self.numels[i]].view(self.shapes[i])
            else:  # coalesced: a flat buffer, then one copy per param (the ~2x transient)
                width = sum(self.chunk[i] for i in ps)
                inp = self._tag(torch.cat([self._part(i) for i in ps]), "buffers")
                out = self._empty(width * n, "buffers")
                self.comm.all_gather(out, inp)
                grid = out.view(n, width)
                col = 0
                for i in ps:
                    c = self.chunk[i]
                    full = self._tag(grid[:, col:col + c].reshape(-1), "buffers")  # a copy (non-contiguous)
                    self.params[i].data = full[:self.numels[i]].view(self.shapes[i])
                    col += c
                del inp, out, grid
        for i in ps:
            self.live[i] = True

    def _release(self, ps: list[int]) -> None:
        """Release ``ps`` whatever their state (the end of backward: ``release_backward_leftovers``;
        by then DeepSpeed has released every other gathered parameter)."""
        self.backward_sites.clear()
        self.attributed.clear()
        for i in ps:
            self.active[i].clear()
            self.inflight.discard(i)
            if not self.persistent[i]:
                self.params[i].data = self._placeholder
                self.live[i] = False

    def _arrived(self, j: int) -> None:
        """Gradient j is next in bucket order: copied into the ipg bucket at its offset and freed, where its
        bucket fits (``__add_grad_to_ipg_bucket``); a lone gradient larger than the bucket stays autograd's."""
        k = self._bucket_of[j]
        p = self.params[j]
        with self.torch.no_grad():
            if self.contiguous and self._bucket_total[k] <= self.rbs:
                pos = self._pos3[j]
                self.ipg[0][pos:pos + self.numels[j]].copy_(p.grad.reshape(-1))
                p.grad = None

    def _flush_bucket(self, k: int) -> None:
        """Bucket k reduced into the gradient partition (``__reduce_and_partition_ipg_grads``): with
        ``reduce_scatter`` off, a bucket in the ipg buffer is all-reduced there in place, then multiplied by
        ``gradient_predivide_factor`` out of place (``__avg_scatter_contiguous_grads``: ``buffer.mul(1.0)``
        whenever that factor is not the world size, so a copy of the bucket), and each rank takes its slices of
        the copy; otherwise reduce-scattered as
        ``reduce_scatter_coalesced`` does it."""
        _, _, ps = self.buckets[k]
        in_ipg = self.contiguous and self._bucket_total[k] <= self.rbs
        with self.torch.no_grad():
            grads = []
            pos = 0
            for i in ps:
                grads.append(self.ipg[0][pos:pos + self.numels[i]] if in_ipg else self.params[i].grad.reshape(-1))
                pos += self.numels[i]
            if in_ipg and not self.reduce_scatter_cfg:
                buf = self.ipg[0][:pos]
                buf.div_(self.n)
                self.comm.all_reduce(buf)
                if self.n > 1:  # postscale by gradient_predivide_factor (1.0 != N): out of place, a bucket-sized copy
                    buf = self._tag(buf.mul(1.0), "buffers")
                mine, at = [], 0
                for i in ps:
                    lo, hi = (min(r * self.chunk[i], self.numels[i]) for r in (self.rank, self.rank + 1))
                    mine.append(buf[at + lo:at + hi])
                    at += self.numels[i]
                del buf
            else:
                mine = self._reduce_scatter_coalesced(grads, ps)
            del grads
            for i in ps:
                self.params[i].grad = None
            for piece, i in zip(mine, ps):
                off = self.part_offsets[i]
                self.grad_part[off:off + piece.numel()].add_(piece.to(self.grad_part.device))
        # no release here: DeepSpeed releases a module's parameters after its backward
        # (release_sub_module from the post-backward node on its inputs), not when its gradients
        # are reduced

    def _reduce_scatter_coalesced(self, grads: list[Any], ps: list[int]) -> list[Any]:
        """DeepSpeed 0.19.8 ``comm/coalesced_collectives.py`` ``reduce_scatter_coalesced``: each gradient cut
        into N chunks of ceil(numel/N), interleaved rank by rank with padding in one copy (none for a lone
        gradient that divides evenly), divided by N and reduce-scattered in place (the output is this rank's
        chunk of that buffer); this rank's pieces are views of it."""
        torch, n = self.torch, self.n
        if len(grads) == 1 and self.numels[ps[0]] % n == 0:
            flat = grads[0]
        else:
            parts = []
            for r in range(n):
                for g, i in zip(grads, ps):
                    c = self.chunk[i]
                    piece = g[r * c:(r + 1) * c]
                    parts.append(piece)
                    if piece.numel() < c:  # zeros where DeepSpeed pads with torch.empty: the same bytes
                        parts.append(torch.zeros(c - piece.numel(), dtype=g.dtype, device=g.device))
            flat = self._tag(torch.cat(parts), "buffers")
            del parts
        flat.div_(n)
        width = flat.numel() // n
        out = flat[self.rank * width:(self.rank + 1) * width]  # in place: this rank's chunk of the input
        self.comm.reduce_scatter(out, flat)
        mine, col = [], 0
        for i in ps:
            mine.append(out[col:col + self.chunk[i]])
            col += self.chunk[i]
        return mine


def _make_post_backward():
    import torch

    class PostBackward(torch.autograd.Function):
        """Identity on a module input; in backward, once every wrapped input of that call got its
        gradient, releases the module (parameter_offload.py ``PostBackwardFunctionModule``)."""

        @staticmethod
        def forward(ctx, engine, site, counter, x):  # type: ignore[override]
            ctx.engine, ctx.site, ctx.counter = engine, site, counter
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.counter[0] -= 1
            if ctx.counter[0] == 0:
                ctx.engine._release_site(ctx.site, backward=True)
            return None, None, None, grad

    return PostBackward


def _make_pre_backward():
    import torch

    class PreBackward(torch.autograd.Function):
        """Identity in forward; in backward re-gathers the module's units before its gradients run."""

        @staticmethod
        def forward(ctx, engine, units, out):  # type: ignore[override]
            ctx.engine = engine
            ctx.units = units
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.engine._pre_backward(ctx.units)
            return None, None, grad

    return PreBackward


class _LazyFunction:
    """An autograd Function built on first use (torch is imported only when stage 3 runs)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._cls: Any = None

    def apply(self, *args: Any) -> Any:
        if self._cls is None:
            self._cls = self._make()
        return self._cls.apply(*args)


_PreBackward = _LazyFunction(_make_pre_backward)
_PostBackward = _LazyFunction(_make_post_backward)
