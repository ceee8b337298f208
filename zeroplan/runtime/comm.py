"""Instrumented collectives: every collective of the runtime goes through here and is recorded.

``InstrumentedComm`` wraps a torch.distributed process group; ``LocalComm`` has the same API
and replaces each collective by a local copy, so one rank's shards of an N-way run can be
executed in a single process (``group_size`` in the records is then the virtual N). What both
share (checks, handle, records, timing) is ``_BaseComm`` in ``runtime/comm_base.py``.

Conventions (see ``zeroplan.specs.collectives``):
- Buffers are flat, contiguous 1-D tensors (this works on both gloo and NCCL). Shapes,
  dtypes and devices are validated BEFORE the collective is issued: a failed collective can
  desynchronise the whole group, so a mismatch raises ``ValueError`` and nothing is sent.
- ``buffer_bytes`` in a record is the FULL (unsharded) buffer in bytes: the output of an
  all-gather, the input of a reduce-scatter, the tensor of an all-reduce / broadcast /
  reduce, the input of an all-to-all.
- ``rank`` / ``world_size`` are this process's rank and the size of the WRAPPED group;
  ``src`` / ``dst`` arguments are ranks within that group. Records carry the global rank.
- ``duration_s`` is seconds from issue to completion (for async calls: to the return of
  ``wait()``). On gloo it is host wall-clock time. On NCCL a call returns when the kernel is
  ENQUEUED, so host time would be an enqueue time: on a CUDA device the call is bracketed by
  two CUDA events on the current stream (recorded before the issue and after completion —
  after ``wait()``, which makes the current stream wait for NCCL's stream) and the duration
  is ``start.elapsed_time(end)``, resolved lazily when ``records`` is read (that waits for the
  end event; nothing is serialised while the engine runs). ``cuda_sync_timing=True`` instead
  synchronises the device after each call and uses host time (bench collectives' sweep).
- Recording is cheap: a raw tuple is appended per call and the pydantic
  ``CollectiveRecord`` objects are built only when ``records`` is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroplan.runtime.comm_base import CommHandle, _BaseComm

if TYPE_CHECKING:  # torch is imported lazily: runtime users have it, planners never load it
    import torch

__all__ = ["InstrumentedComm", "LocalComm", "CommHandle", "all_gather_fn", "reduce_scatter_fn"]
# CommHandle, _BaseComm: comm_base.py


# torch >= 2.13 names the flat-tensor collectives *_single (the *_tensor names warn FutureWarning).
def all_gather_fn(dist: Any) -> Any:
    """torch.distributed's flat all-gather (output, input, group=, async_op=) for this torch."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_fn(dist: Any) -> Any:
    """torch.distributed's flat reduce-scatter (output, input, op=, group=, async_op=) for this torch."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(op: str) -> Any:
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    try:
        return ops[op]
    except KeyError:
        raise ValueError(f"reduce op {op!r}: expected one of {', '.join(ops)}") from None


class InstrumentedComm(_BaseComm):
    """Collectives over a torch.distributed process group, each one recorded.

    ``group=None`` wraps the default (world) group, which must be initialised.
    ``group_kind`` tags the records ("all", "intra-node", "inter-node").
    """

    def __init__(self, group: Any = None, *, group_kind: str = "all", cuda_sync_timing: bool = False) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("InstrumentedComm needs an initialised torch.distributed process group")
        self.group = group
        self._dist = dist
        size = dist.get_world_size(group)
        super().__init__(group_kind=group_kind, global_rank=dist.get_rank(), group_size=size)
        self._rank = dist.get_rank(group)
        self._cuda_sync = cuda_sync_timing
        self._is_cuda = dist.get_backend(group) == "nccl"
        self._gloo_thread = dist.get_backend(group) == "gloo"  # see _BaseComm._issue
        if self._is_cuda and not cuda_sync_timing:
            import torch

            self.use_cuda_events(torch.cuda.Event)
        self._rs = reduce_scatter_fn(dist)
        self._ag = all_gather_fn(dist)

    @property
    def rank(self) -> int:
        return self._rank

    def use_cuda_events(self, event_cls: Any) -> None:
        """Time every later call with ``event_cls`` (``torch.cuda.Event``; a stand-in in tests)."""
        self._event_cls = event_cls

    def _sync_device(self) -> None:
        if self._cuda_sync and self._is_cuda:
            import torch

            torch.cuda.synchronize()

    def barrier(self) -> None:
        """A barrier on the wrapped group (not recorded)."""
        self._dist.barrier(group=self.group)

    def all_reduce(self, t: "torch.Tensor", op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_all_reduce(t)
        rop = _reduce_op(op)
        d, g = self._dist, self.group
        return self._run("all_reduce", nbytes, t.dtype,
                         lambda a: d.all_reduce(t, op=rop, group=g, async_op=a), async_op, held=(t,))

    def reduce_scatter(self, out: "torch.Tensor", inp: "torch.Tensor", op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_reduce_scatter(out, inp)
        rop = _reduce_op(op)
        rs, g = self._rs, self.group
        return self._run("reduce_scatter", nbytes, inp.dtype,
                         lambda a: rs(out, inp, op=rop, group=g, async_op=a), async_op, held=(out, inp))

    def all_gather(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_gather(out, inp)
        ag, g = self._ag, self.group
        return self._run("all_gather", nbytes, inp.dtype,
                         lambda a: ag(out, inp, group=g, async_op=a), async_op, held=(out, inp))

    def broadcast(self, t: "torch.Tensor", src: int, *, async_op: bool = False):
        nbytes = self._v_root("broadcast", t, src, "src")
        d, g = self._dist, self.group
        return self._run("broadcast", nbytes, t.dtype,
                         lambda a: d.broadcast(t, group=g, async_op=a, group_src=src), async_op, held=(t,))

    def reduce(self, t: "torch.Tensor", dst: int, op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_root("reduce", t, dst, "dst")
        rop = _reduce_op(op)
        d, g = self._dist, self.group
        return self._run("reduce", nbytes, t.dtype,
                         lambda a: d.reduce(t, op=rop, group=g, async_op=a, group_dst=dst), async_op, held=(t,))

    def all_to_all(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_to_all(out, inp)
        d, g = self._dist, self.group
        return self._run("all_to_all", nbytes, inp.dtype,
                         lambda a: d.all_to_all_single(out, inp, group=g, async_op=a), async_op, held=(out, inp))


class LocalComm(_BaseComm):
    """The same API with every collective replaced by a local copy (no process group needed).

    ``world_size`` is a VIRTUAL group size: records carry it as ``group_size`` and buffer
    shapes are validated against it, so one rank's shards of an N-way run execute in one
    process and produce the same records as the real run. ``rank`` is the virtual rank played.

    Semantics (copies, never arithmetic): all_reduce / broadcast / reduce leave the tensor as
    it is; reduce_scatter copies this rank's slice of the input into the output; all_gather
    copies the shard into every slot of the output; all_to_all copies this rank's chunk of the
    input into every chunk of the output (as if every virtual rank held the same data).
    At world size 1 every operation is exactly what a real collective would compute.
    """

    def __init__(self, world_size: int = 1, rank: int = 0, *, group_kind: str = "all", global_rank: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size {world_size}: expected >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank}: expected 0 <= rank < world_size {world_size}")
        super().__init__(group_kind=group_kind, global_rank=rank if global_rank is None else global_rank,
                         group_size=world_size)
        self._rank = rank

    _local = True

    @property
    def rank(self) -> int:
        return self._rank

    def barrier(self) -> None:
        """Nothing to wait for."""

    def all_reduce(self, t: "torch.Tensor", op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_all_reduce(t)
        _reduce_op(op)
        return self._run("all_reduce", nbytes, t.dtype, lambda a: None, async_op)

    def reduce_scatter(self, out: "torch.Tensor", inp: "torch.Tensor", op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_reduce_scatter(out, inp)
        _reduce_op(op)
        n, r = out.numel(), self._rank
        return self._run("reduce_scatter", nbytes, inp.dtype,
                         lambda a: out.copy_(inp[r * n:(r + 1) * n]), async_op)

    def all_gather(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_gather(out, inp)
        w = self._group_size
        return self._run("all_gather", nbytes, inp.dtype,
                         lambda a: out.view(w, -1).copy_(inp.unsqueeze(0).expand(w, -1)) if inp.numel() else None,
                         async_op)

    def broadcast(self, t: "torch.Tensor", src: int, *, async_op: bool = False):
        nbytes = self._v_root("broadcast", t, src, "src")
        return self._run("broadcast", nbytes, t.dtype, lambda a: None, async_op)

    def reduce(self, t: "torch.Tensor", dst: int, op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_root("reduce", t, dst, "dst")
        _reduce_op(op)
        return self._run("reduce", nbytes, t.dtype, lambda a: None, async_op)

    def all_to_all(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_to_all(out, inp)
        w, r = self._group_size, self._rank

        def issue(a: bool) -> None:
            if inp.numel():
                c = inp.numel() // w
                out.view(w, c).copy_(inp[r * c:(r + 1) * c].unsqueeze(0).expand(w, c))

        return self._run("all_to_all", nbytes, inp.dtype, issue, async_op)
