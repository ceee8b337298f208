"""The recording core every communicator shares (split out of ``runtime/comm.py``, whose docstring
states the conventions): buffer checks made before anything is sent, the async ``CommHandle``, and
``_BaseComm`` — phases, group kinds, the raw per-call record and its lazy conversion to
``CollectiveRecord``, the timing of a call (host clock or CUDA events)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator

from zeroplan.runtime.results import CollectiveRecord, summarize_records

if TYPE_CHECKING:  # torch is imported lazily: runtime users have it, planners never load it
    import torch

__all__ = ["CommHandle"]

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

    __slots__ = ("_work", "_comm", "_slot", "_t0", "_done", "_after", "_settle")

    def __init__(self, work: Any, comm: "_BaseComm", slot: list, t0: float, after: Any = None,
                 settle: Any = None) -> None:
        self._work = work
        self._comm = comm
        self._slot = slot
        self._t0 = t0
        self._done = False
        self._after = after
        self._settle = settle  # _BaseComm._settler

    def wait(self) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._after is not None:
                self._after()
            self._comm._stop(self._slot, self._t0)
            self._comm._dirty = True
            self._done = True
            self._work = None
            if self._settle is not None:
                self._settle()
                self._settle = None
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

    # gloo runs a collective on a worker thread that keeps references to its tensors for a moment after the
    # collective has completed (ProcessGroupGloo::runLoop drops its work item only after execute returns),
    # and under the memory tracker's TorchDispatchMode (runtime/memory.py) a reduce-scatter hands it more.
    # Measured on torch 2.13, one sync all-reduce or reduce-scatter in five to eight then had its tensor
    # freed on that thread when the caller dropped it at once: a gradient or a flatten copy stayed counted
    # in the next phase now and then, and the tracker's ledger was updated from two threads. A real
    # communicator that says so issues its collectives with the dispatch modes set aside (they write into
    # buffers the caller made, which the tracker already counts) and, once a collective is complete, waits
    # until its tensors and their storages are back to the references they had before it (``_settler``).
    _gloo_thread = False
    _SETTLE_DEADLINE_S = 1.0

    def _issue(self, issue: Any, async_op: bool) -> Any:
        if not self._gloo_thread:
            return issue(async_op)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return issue(async_op)

    def _settler(self, held: tuple, python_refs: bool) -> Any:
        """A callable that waits until the tensors in ``held`` have no more references than now: C++ ones
        to the tensor and to its storage (gloo keeps the tensors, and views such as an all-gather output's
        chunks) and, for a synchronous call (``python_refs``: the caller cannot add any before it returns),
        Python ones too (measured: about one sync all-reduce in 300 still had one more when it returned);
        None where nothing needs it."""
        if not (self._gloo_thread and held):
            return None
        import torch

        def refs(i: int) -> tuple[int, ...]:
            t = held[i]
            out = (t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))
            return out + (sys.getrefcount(t),) if python_refs else out

        counts = [refs(i) for i in range(len(held))]

        def settle() -> None:
            end = time.perf_counter() + self._SETTLE_DEADLINE_S
            for i, before in enumerate(counts):
                while time.perf_counter() < end and any(n > c for n, c in zip(refs(i), before)):
                    time.sleep(0)

        return settle

    def _run(self, op: str, nbytes: int, dtype: Any, issue: Any, async_op: bool, after: Any = None,
             held: tuple = ()):
        slot = [op, self._phase, nbytes, _dtype_name(dtype), self._group_size, self.group_kind, None,
                self._global_rank]
        self._raw.append(slot)
        settle = self._settler(held, python_refs=not async_op)
        t0 = self._start()
        work = self._issue(issue, async_op)
        if self._local:
            work = None
        if async_op:
            return CommHandle(work, self, slot, t0, after, settle)
        if after is not None:
            after()
        self._stop(slot, t0)
        if settle is not None:
            del work
            settle()
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
