"""Per-rank memory measurement by category and phase (bytes; never process RSS).

Categories (the same names as the planner's): ``params``, ``gradients``, ``optimizer_states``,
``buffers``, ``activations``, ``other``. Phases: ``forward``, ``backward``, ``step``.

``StorageTracker`` (CPU, and under FakeTensorMode) is a ``TorchDispatchMode`` that sees every
tensor an operator returns and keeps the set of live tensor *storages* (keyed by the storage
object, sized by ``nbytes()``), released through a weakref finalizer when the storage dies (a death on
another thread, such as gloo's worker, is applied by the tracker's own thread before its next record).
Views share their storage, so nothing is counted twice. The engine tags its own tensors
(``tag(t, "optimizer_states")`` ...); anything untagged that is allocated during ``forward`` is
``activations``, anything else untagged is ``other``. For every phase the tracker keeps the
peak of live bytes and the category breakdown at that peak. Tensors tagged ``host=True``
(offloaded optimizer states) are kept in a separate host ledger and never count toward the
device peak.

``memory_limit_bytes`` makes an allocation that would take live bytes above the limit raise
``SimulatedOutOfMemory`` (a ``MemoryError``) naming the phase and the live categories — the
way to reproduce "OOM during the gather" on a CPU.

``CudaMemoryMeter`` (``runtime/memory_cuda.py``, re-exported here): on CUDA, each phase starts with ``reset_peak_memory_stats`` and records
``max_memory_allocated`` and ``max_memory_reserved``; the engine's tags give the model-state
categories as they stood at the phase's highest sampled allocation, and the rest of the peak is
``activations`` (forward) or ``other``. A memory limit is enforced by the allocator.

Both expose the same API: ``phase`` (settable), ``tag``, ``phase_peaks() -> {phase:
{"peak": bytes, "by_category": {...}}}``, ``current_by_category()``, ``reset_peaks()``,
``host_bytes``, used as a context manager around the measured steps. The categories, phases and
the bookkeeping of live bytes and peaks are ``runtime/memory_ledger.py``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, Iterator

from zeroplan.runtime.memory_cuda import CudaMemoryMeter
from zeroplan.runtime.memory_ledger import CATEGORIES, PHASES, SimulatedOutOfMemory, _Ledger

__all__ = ["CATEGORIES", "PHASES", "StorageTracker", "CudaMemoryMeter", "SimulatedOutOfMemory", "make_meter",
           "NullMeter"]


def _dispatch_base():
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as exc:  # pragma: no cover - private API moved
        raise RuntimeError(
            "zeroplan's CPU memory tracker needs torch.utils._python_dispatch.TorchDispatchMode, "
            f"which this torch ({_torch_version()}) does not provide: {exc}"
        ) from exc
    return TorchDispatchMode


def _torch_version() -> str:
    import torch

    return torch.__version__


class StorageTracker:
    """Exact live-storage accounting via a TorchDispatchMode (CPU / fake tensors)."""

    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        import torch

        self._torch = torch
        self.ledger = _Ledger()
        self.memory_limit_bytes = memory_limit_bytes
        self._live: dict[int, list] = {}  # id(storage) -> [nbytes, category, host, weakref]
        # a storage can die on another thread (gloo's worker drops the last reference to a collective's
        # tensor: runtime/comm_base.py _issue): its release waits here for the tracker's own thread, which
        # applies it before anything else it records, so the ledger is only ever updated from one thread
        self._owner = threading.get_ident()
        self._pending: collections.deque[int] = collections.deque()
        self._mode = None
        self._host_depth = 0
        base = _dispatch_base()
        tracker = self

        class _Mode(base):  # type: ignore[misc, valid-type]
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(out)
                return out

        self._mode_cls = _Mode

    # ------------------------------------------------------------------ API
    @property
    def phase(self) -> str:
        return self.ledger.phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value not in PHASES:
            raise ValueError(f"phase {value!r}: expected one of {', '.join(PHASES)}")
        self._drain()
        self.ledger.phase = value

    @property
    def host_bytes(self) -> int:
        return self.ledger.host_bytes

    def __enter__(self) -> "StorageTracker":
        self._mode = self._mode_cls()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def tag(self, t: Any, category: str, *, host: bool = False) -> Any:
        """Attribute ``t``'s storage to ``category`` (registering it if it is not known yet)."""
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: expected one of {', '.join(CATEGORIES)}")
        self._drain()
        st = t.untyped_storage()
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            self._register(st, category, host)
            return t
        nbytes, old, old_host, _ = entry
        if old == category and old_host == host:
            return t
        led = self.ledger
        pk = led.peaks.get(led.phase)
        at_peak = pk is not None and pk["peak"] == led.total
        self._sub(old, old_host, nbytes)
        entry[1], entry[2] = category, host
        self._add(category, host, nbytes)
        if at_peak and pk["peak"] == led.total:  # the peak is this very moment: keep its breakdown current
            pk["by_category"] = dict(led.current)
        elif at_peak and host:  # moved off the device: the moment before had the peak, unchanged
            pass
        return t

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """Storages created inside are host memory (offloaded states), never device bytes."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def reset_peaks(self) -> None:
        self._drain()
        self.ledger.reset_peaks()

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        self._drain()
        return self.ledger.phase_peaks()

    def current_by_category(self) -> dict[str, int]:
        self._drain()
        return dict(self.ledger.current)

    @property
    def live_bytes(self) -> int:
        self._drain()
        return self.ledger.total

    # ------------------------------------------------------------------ internals
    def _default_category(self) -> str:
        return "activations" if self.ledger.phase == "forward" else "other"

    def _see(self, out: Any) -> None:
        self._drain()
        torch = self._torch
        if isinstance(out, torch.Tensor):
            self._see_tensor(out)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see_tensor(o)

    def _see_tensor(self, t: Any) -> None:
        if t.device.type == "meta":  # shape only, no memory (DeepSpeed keeps meta copies of its params' shapes)
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse / nested: not tracked
            return
        entry = self._live.get(id(st))
        if entry is None:
            self._register(st, self._default_category(), self._host_depth > 0)
        elif entry[3]() is st and st.nbytes() != entry[0]:  # resized in place
            delta = st.nbytes() - entry[0]
            entry[0] = st.nbytes()
            (self._sub if delta < 0 else self._add_checked)(entry[1], entry[2], abs(delta))

    def _register(self, st: Any, category: str, host: bool) -> None:
        nbytes = int(st.nbytes())
        key = id(st)
        if not host:
            self._check_limit(nbytes)
        ref = weakref.ref(st, lambda _r, k=key: self._release(k))
        self._live[key] = [nbytes, category, host, ref]
        self._add(category, host, nbytes)

    def _release(self, key: int) -> None:
        if threading.get_ident() != self._owner:
            self._pending.append(key)  # deque.append is atomic
            return
        self._drain()
        self._release_now(key)

    def _drain(self) -> None:
        """Apply the releases that happened on other threads (see ``__init__``)."""
        while self._pending:
            self._release_now(self._pending.popleft())

    def _release_now(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._sub(entry[1], entry[2], entry[0])

    def _check_limit(self, nbytes: int) -> None:
        lim = self.memory_limit_bytes
        if lim is not None and nbytes and self.ledger.total + nbytes > lim:
            cur = self.ledger.current
            detail = ", ".join(f"{c} {cur[c]}" for c in CATEGORIES if cur[c])
            raise SimulatedOutOfMemory(
                f"out of memory in {self.ledger.phase}: allocating {nbytes} bytes with {self.ledger.total} live "
                f"exceeds the limit of {lim} bytes (live: {detail})",
                phase=self.ledger.phase, requested_bytes=nbytes, live_bytes=self.ledger.total, limit_bytes=lim,
                by_category=cur,
            )

    def _add_checked(self, category: str, host: bool, nbytes: int) -> None:
        if not host:
            self._check_limit(nbytes)
        self._add(category, host, nbytes)

    def _add(self, category: str, host: bool, nbytes: int) -> None:
        if host:
            self.ledger.host_bytes += nbytes
        else:
            self.ledger.add(category, nbytes)

    def _sub(self, category: str, host: bool, nbytes: int) -> None:
        if host:
            self.ledger.host_bytes -= nbytes
        else:
            self.ledger.add(category, -nbytes)


class NullMeter:
    """No measurement (speed runs): the same API, nothing recorded."""

    phase = "forward"
    host_bytes = 0
    live_bytes = 0

    def __enter__(self) -> "NullMeter":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def tag(self, t: Any, category: str, *, host: bool = False) -> Any:
        return t

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        yield

    def reset_peaks(self) -> None:
        pass

    def phase_peaks(self) -> dict:
        return {}

    def current_by_category(self) -> dict[str, int]:
        return {c: 0 for c in CATEGORIES}


def make_meter(device: Any, memory_limit_bytes: int | None = None) -> Any:
    """``CudaMemoryMeter`` for a CUDA device, else ``StorageTracker``."""
    dev_type = getattr(device, "type", str(device).split(":")[0])
    if dev_type == "cuda":
        return CudaMemoryMeter(device, memory_limit_bytes)
    return StorageTracker(memory_limit_bytes)
