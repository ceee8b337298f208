"""Instrumented collectives: every collective of the runtime goes through here and is recorded.

``InstrumentedComm`` wraps a torch.distributed process group; ``LocalComm`` has the same API
and replaces each collective by a local copy, so one rank's shards of an N-way run can be
executed in a single process (``group_size`` in the records is then the virtual N).

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

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator

from zeroplan.runtime.results import CollectiveRecord, summarize_records

if TYPE_CHECKING:  # torch is imported lazily: runtime users have it, planners never load it
    import torch

__all__ = ["InstrumentedComm", "LocalComm", "CommHandle"]

_PHASES = ("forward", "backward", "step")
_GROUP_KINDS = ("all", "intra-node", "inter-node")
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _DTYPE_NAMES[dtype] = name
    return name


def _check_flat(t: "torch.Tensor", what: str) -> None:
    if t.dim() != 1:
        raise ValueError(f"{what}: expected a flat 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous tensor")


def _check_pair(op: str, out: "torch.Tensor", inp: "torch.Tensor") -> None:
    _check_flat(out, f"{op} output")
    _check_flat(inp, f"{op} input")
    if out.dtype != inp.dtype:
        raise ValueError(f"{op}: output dtype {out.dtype} != input dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{op}: output device {out.device} != input device {inp.device}")


class CommHandle:
    """Returned by async calls; ``wait()`` completes the collective and records its duration."""

    __slots__ = ("_work", "_comm", "_slot", "_t0", "_done", "_after")

    def __init__(self, work: Any, comm: "_BaseComm", slot: list, t0: float, after: Any = None) -> None:
        self._work = work
        self._comm = comm
        self._slot = slot
        self._t0 = t0
        self._done = False
        self._after = after

    def wait(self) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._after is not None:
                self._after()
            self._comm._stop(self._slot, self._t0)
            self._comm._dirty = True
            self._done = True
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._work is None or bool(self._work.is_completed())


class _BaseComm:
    """Recording, phases and validation shared by the real and the local communicator."""

    def __init__(self, *, group_kind: str = "all", global_rank: int = 0, group_size: int = 1) -> None:
        if group_kind not in _GROUP_KINDS:
            raise ValueError(f"group_kind {group_kind!r}: expected one of {', '.join(_GROUP_KINDS)}")
        self.group_kind = group_kind
        self._global_rank = global_rank
        self._group_size = group_size
        self._phase = "forward"
        self._raw: list[list] = []
        self._cache: list[CollectiveRecord] = []
        self._dirty = False
        self._cuda_sync = False
        self._event_cls: Any = None  # torch.cuda.Event when collectives are timed with CUDA events

    _local = False

    # ----------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return self._group_size

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value not in _PHASES:
            raise ValueError(f"phase {value!r}: expected one of {', '.join(_PHASES)}")
        self._phase = value

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator["_BaseComm"]:
        """``with comm.in_phase("backward"): ...`` tags the collectives issued inside."""
        previous = self._phase
        self.phase = phase
        try:
            yield self
        finally:
            self._phase = previous

    # ----------------------------------------------------------------- records
    @property
    def records(self) -> list[CollectiveRecord]:
        """All collectives recorded since construction / ``reset()``, in issue order."""
        if self._dirty or len(self._cache) != len(self._raw):
            for r in self._raw:
                if isinstance(r[6], tuple):  # (start, end) CUDA events: device time of the call
                    start, end = r[6]
                    end.synchronize()
                    r[6] = start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
            self._cache = [
                CollectiveRecord.model_construct(
                    op=r[0], phase=r[1], buffer_bytes=r[2], dtype=r[3], group_size=r[4], group=r[5],
                    duration_s=float(r[6]) if r[6] is not None else 0.0, rank=r[7],
                )
                for r in self._raw
            ]
            self._dirty = False
        return list(self._cache)

    def reset(self) -> None:
        """Forget all records (the phase is kept)."""
        self._raw = []
        self._cache = []
        self._dirty = False

    def summary(self) -> dict[str, dict[str, int]]:
        """op -> {"count": calls, "bytes": sum of full-buffer bytes}."""
        return summarize_records(self.records)

    def _sync_device(self) -> None:
        pass

    def _start(self) -> Any:
        """Host clock, or a recorded CUDA start event when timing with events."""
        if self._event_cls is not None:
            ev = self._event_cls(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop(self, slot: list, t0: Any) -> None:
        if self._event_cls is not None:
            end = self._event_cls(enable_timing=True)
            end.record()
            slot[6] = (t0, end)
            self._dirty = True
            return
        self._sync_device()
        slot[6] = time.perf_counter() - t0

    def _run(self, op: str, nbytes: int, dtype: Any, issue: Any, async_op: bool, after: Any = None):
        slot = [op, self._phase, nbytes, _dtype_name(dtype), self._group_size, self.group_kind, None,
                self._global_rank]
        self._raw.append(slot)
        t0 = self._start()
        work = issue(async_op)
        if self._local:
            work = None
        if async_op:
            return CommHandle(work, self, slot, t0, after)
        if after is not None:
            after()
        self._stop(slot, t0)
        return None

    # ----------------------------------------------------------------- validation
    def _v_all_reduce(self, t: "torch.Tensor") -> int:
        _check_flat(t, "all_reduce")
        return t.numel() * t.element_size()

    def _v_reduce_scatter(self, out: "torch.Tensor", inp: "torch.Tensor") -> int:
        _check_pair("reduce_scatter", out, inp)
        if inp.numel() != self._group_size * out.numel():
            raise ValueError(
                f"reduce_scatter: input has {inp.numel()} elements, expected world_size "
                f"{self._group_size} x output {out.numel()} = {self._group_size * out.numel()}"
            )
        return inp.numel() * inp.element_size()

    def _v_all_gather(self, out: "torch.Tensor", inp: "torch.Tensor") -> int:
        _check_pair("all_gather", out, inp)
        if out.numel() != self._group_size * inp.numel():
            raise ValueError(
                f"all_gather: output has {out.numel()} elements, expected world_size "
                f"{self._group_size} x input {inp.numel()} = {self._group_size * inp.numel()}"
            )
        return out.numel() * out.element_size()

    def _v_root(self, op: str, t: "torch.Tensor", root: int, what: str) -> int:
        _check_flat(t, op)
        if not isinstance(root, int) or not 0 <= root < self._group_size:
            raise ValueError(f"{op}: {what}={root!r} is not a rank of a group of size {self._group_size}")
        return t.numel() * t.element_size()

    def _v_all_to_all(self, out: "torch.Tensor", inp: "torch.Tensor") -> int:
        _check_pair("all_to_all", out, inp)
        if out.numel() != inp.numel():
            raise ValueError(f"all_to_all: output has {out.numel()} elements, input {inp.numel()}")
        if inp.numel() % self._group_size:
            raise ValueError(
                f"all_to_all: {inp.numel()} elements do not split evenly over {self._group_size} ranks"
            )
        return inp.numel() * inp.element_size()


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
        if self._is_cuda and not cuda_sync_timing:
            import torch

            self.use_cuda_events(torch.cuda.Event)
        # torch >= 2.13 names them *_single (the *_tensor names warn FutureWarning).
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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
                         lambda a: d.all_reduce(t, op=rop, group=g, async_op=a), async_op)

    def reduce_scatter(self, out: "torch.Tensor", inp: "torch.Tensor", op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_reduce_scatter(out, inp)
        rop = _reduce_op(op)
        rs, g = self._rs, self.group
        return self._run("reduce_scatter", nbytes, inp.dtype,
                         lambda a: rs(out, inp, op=rop, group=g, async_op=a), async_op)

    def all_gather(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_gather(out, inp)
        ag, g = self._ag, self.group
        return self._run("all_gather", nbytes, inp.dtype,
                         lambda a: ag(out, inp, group=g, async_op=a), async_op)

    def broadcast(self, t: "torch.Tensor", src: int, *, async_op: bool = False):
        nbytes = self._v_root("broadcast", t, src, "src")
        d, g = self._dist, self.group
        return self._run("broadcast", nbytes, t.dtype,
                         lambda a: d.broadcast(t, group=g, async_op=a, group_src=src), async_op)

    def reduce(self, t: "torch.Tensor", dst: int, op: str = "sum", *, async_op: bool = False):
        nbytes = self._v_root("reduce", t, dst, "dst")
        rop = _reduce_op(op)
        d, g = self._dist, self.group
        return self._run("reduce", nbytes, t.dtype,
                         lambda a: d.reduce(t, op=rop, group=g, async_op=a, group_dst=dst), async_op)

    def all_to_all(self, out: "torch.Tensor", inp: "torch.Tensor", *, async_op: bool = False):
        nbytes = self._v_all_to_all(out, inp)
        d, g = self._dist, self.group
        return self._run("all_to_all", nbytes, inp.dtype,
                         lambda a: d.all_to_all_single(out, inp, group=g, async_op=a), async_op)


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
