"""Per-rank memory measurement by category and phase (bytes; never process RSS).

Categories (the same names as the planner's): ``params``, ``gradients``, ``optimizer_states``,
``buffers``, ``activations``, ``other``. Phases: ``forward``, ``backward``, ``step``.

``StorageTracker`` (CPU, and under FakeTensorMode) is a ``TorchDispatchMode`` that sees every
tensor an operator returns and keeps the set of live tensor *storages* (keyed by the storage
object, sized by ``nbytes()``), released through a weakref finalizer when the storage dies.
Views share their storage, so nothing is counted twice. The engine tags its own tensors
(``tag(t, "optimizer_states")`` ...); anything untagged that is allocated during ``forward`` is
``activations``, anything else untagged is ``other``. For every phase the tracker keeps the
peak of live bytes and the category breakdown at that peak. Tensors tagged ``host=True``
(offloaded optimizer states) are kept in a separate host ledger and never count toward the
device peak.

``memory_limit_bytes`` makes an allocation that would take live bytes above the limit raise
``SimulatedOutOfMemory`` (a ``MemoryError``) naming the phase and the live categories — the
way to reproduce "OOM during the gather" on a CPU.

``CudaMemoryMeter``: on CUDA, each phase starts with ``reset_peak_memory_stats`` and records
``max_memory_allocated`` and ``max_memory_reserved``; the engine's tags give the model-state
categories as they stood at the phase's highest sampled allocation, and the rest of the peak is
``activations`` (forward) or ``other``. A memory limit is enforced by the allocator.

Both expose the same API: ``phase`` (settable), ``tag``, ``phase_peaks() -> {phase:
{"peak": bytes, "by_category": {...}}}``, ``current_by_category()``, ``reset_peaks()``,
``host_bytes``, used as a context manager around the measured steps.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

__all__ = ["CATEGORIES", "PHASES", "StorageTracker", "CudaMemoryMeter", "SimulatedOutOfMemory", "make_meter",
           "NullMeter"]

CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations", "other")
PHASES = ("forward", "backward", "step")


class SimulatedOutOfMemory(MemoryError):
    """A ``StorageTracker`` allocation went above ``memory_limit_bytes``."""

    def __init__(self, message: str, *, phase: str, requested_bytes: int, live_bytes: int, limit_bytes: int,
                 by_category: dict[str, int]):
        super().__init__(message)
        self.phase = phase
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.limit_bytes = limit_bytes
        self.by_category = dict(by_category)


class _Ledger:
    """Live bytes per category + per-phase peak with its breakdown (pure bookkeeping)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.current = {c: 0 for c in CATEGORIES}
        self.total = 0
        self.peaks: dict[str, dict[str, Any]] = {}
        self.host_bytes = 0

    def add(self, cat: str, nbytes: int) -> None:
        self.current[cat] += nbytes
        self.total += nbytes
        if nbytes > 0:
            pk = self.peaks.get(self.phase)
            if pk is None or self.total > pk["peak"]:
                self.peaks[self.phase] = {"peak": self.total, "by_category": dict(self.current)}

    def reset_peaks(self) -> None:
        self.peaks = {}

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        return {p: {"peak": v["peak"], "by_category": dict(v["by_category"])} for p, v in self.peaks.items()}


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
        self.ledger.reset_peaks()

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        return self.ledger.phase_peaks()

    def current_by_category(self) -> dict[str, int]:
        return dict(self.ledger.current)

    @property
    def live_bytes(self) -> int:
        return self.ledger.total

    # ------------------------------------------------------------------ internals
    def _default_category(self) -> str:
        return "activations" if self.ledger.phase == "forward" else "other"

    def _see(self, out: Any) -> None:
        torch = self._torch
        if isinstance(out, torch.Tensor):
            self._see_tensor(out)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see_tensor(o)

    def _see_tensor(self, t: Any) -> None:
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


class CudaMemoryMeter:
    """Phase peaks from the CUDA caching allocator's counters; categories from the engine's tags.

    Per phase (``reset_peak_memory_stats`` when the phase starts, read when it closes):
    ``peak`` = ``max_memory_allocated`` (what tensors held) and ``reserved_peak`` =
    ``max_memory_reserved`` (the allocator's segments, about what ``nvidia-smi`` shows less the
    CUDA context). The category breakdown is the engine's tags as they were at the highest
    ``memory_allocated`` sampled during the phase (sampled at every tag, i.e. at every buffer
    the engine allocates), not the tags left alive when the phase closes; the rest of the peak
    is ``activations`` (forward) or ``other``.

    ``memory_limit_bytes`` is enforced by the allocator itself
    (``torch.cuda.set_per_process_memory_fraction``: an allocation above it raises
    ``torch.OutOfMemoryError``), and the device's total memory
    (``get_device_properties(device).total_memory``) is kept as ``device_total_bytes``.
    ``cuda``: the ``torch.cuda`` module (a stand-in in tests).
    """

    def __init__(self, device: Any = None, memory_limit_bytes: int | None = None, *, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self.device = device
        self._phase = "forward"
        self._tags: dict[int, list] = {}
        self.peaks: dict[str, dict[str, Any]] = {}
        self.host_bytes = 0
        self.device_total_bytes = int(cuda.get_device_properties(device).total_memory)
        self.memory_limit_bytes = memory_limit_bytes
        self.limit_bytes = self.device_total_bytes if memory_limit_bytes is None else int(memory_limit_bytes)
        self._sample_max = -1
        self._sample_tags: dict[str, int] | None = None

    def __enter__(self) -> "CudaMemoryMeter":
        cuda = self._cuda
        if self.memory_limit_bytes is not None:
            cuda.set_per_process_memory_fraction(min(1.0, self.memory_limit_bytes / self.device_total_bytes),
                                                 self.device)
        cuda.synchronize(self.device)
        self._start_phase()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close_phase()
        if self.memory_limit_bytes is not None:
            self._cuda.set_per_process_memory_fraction(1.0, self.device)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value not in PHASES:
            raise ValueError(f"phase {value!r}: expected one of {', '.join(PHASES)}")
        self._close_phase()
        self._phase = value
        self._start_phase()

    def _start_phase(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)
        self._sample_max = -1
        self._sample_tags = None
        self._sample()

    def _sample(self) -> None:
        now = int(self._cuda.memory_allocated(self.device))
        if now > self._sample_max:
            self._sample_max = now
            self._sample_tags = self.current_by_category()

    def _close_phase(self) -> None:
        cuda = self._cuda
        cuda.synchronize(self.device)
        self._sample()
        peak = int(cuda.max_memory_allocated(self.device))
        reserved = int(cuda.max_memory_reserved(self.device))
        pk = self.peaks.get(self._phase)
        if pk is None or peak > pk["peak"]:
            tagged = dict(self._sample_tags or self.current_by_category())
            rest = max(0, peak - sum(tagged.values()))
            tagged["activations" if self._phase == "forward" else "other"] += rest
            self.peaks[self._phase] = {"peak": peak, "reserved_peak": reserved, "by_category": tagged}
        elif reserved > pk.get("reserved_peak", 0):
            pk["reserved_peak"] = reserved

    def tag(self, t: Any, category: str, *, host: bool = False) -> Any:
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: expected one of {', '.join(CATEGORIES)}")
        st = t.untyped_storage()
        key = id(st)
        if key in self._tags:
            self._tags[key][1] = category
            self._sample()
            return t
        entry = [int(st.nbytes()), category, host]
        if host or t.device.type == "cpu":  # not in the CUDA allocator
            entry[2] = True
            self.host_bytes += entry[0]

        def _gone(_r: Any, k: int = key) -> None:
            e = self._tags.pop(k, None)
            if e is not None and e[2]:
                self.host_bytes -= e[0]

        entry.append(weakref.ref(st, _gone))
        self._tags[key] = entry
        self._sample()
        return t

    def current_by_category(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for nbytes, cat, host, _ in list(self._tags.values()):
            if not host:
                out[cat] += nbytes
        return out

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """Host tensors never appear in the CUDA allocator's counters: nothing to do."""
        yield

    def reset_peaks(self) -> None:
        self.peaks = {}
        self._start_phase()

    def phase_peaks(self) -> dict[str, dict[str, Any]]:
        return {p: {"peak": v["peak"], "reserved_peak": v["reserved_peak"], "by_category": dict(v["by_category"])}
                for p, v in self.peaks.items()}

    def memory_info(self) -> dict[str, int]:
        """Device total, the enforced limit and the allocator's counters now (bytes)."""
        cuda = self._cuda
        return {"device_total_bytes": self.device_total_bytes, "limit_bytes": self.limit_bytes,
                "allocated_bytes": int(cuda.memory_allocated(self.device)),
                "reserved_bytes": int(cuda.memory_reserved(self.device))}

    @property
    def live_bytes(self) -> int:
        return int(self._cuda.memory_allocated(self.device))


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
