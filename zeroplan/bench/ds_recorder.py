"""Recording torch.distributed calls in a DeepSpeed rank: each collective's op, FULL buffer bytes,
dtype, group size and phase (split out of ``bench/deepspeed_engine.py``; conventions there)."""

from __future__ import annotations

import time
from typing import Any


# torch.distributed function name -> ledger op name (zeroplan.specs.collectives.Op).
DS_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
}

# Object collectives (pickled Python objects) are recorded under their own name, never as ledger ops.
_OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def _nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


class _Recorder:
    """Wraps torch.distributed collectives; the training loop sets ``phase``/``step``/``micro``."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.phase = "init"
        self.step = -1
        self.micro = -1
        self.enabled = True
        self._depth = 0
        self._coalesce_id = None
        self._next_coalesce = 0
        self._originals: dict[tuple[Any, str], Any] = {}

    # the full-buffer size and dtype of one call, by the function's argument convention
    @staticmethod
    def _measure(name: str, args: tuple, kwargs: dict) -> tuple[int, str]:
        def arg(i: int, *keys: str):
            for k in keys:
                if k in kwargs:
                    return kwargs[k]
            return args[i] if len(args) > i else None

        if name in ("all_reduce", "reduce", "broadcast"):
            t = arg(0, "tensor")
            return _nbytes(t), _dtype_name(t)
        if name == "all_reduce_coalesced":
            ts = arg(0, "tensors")
            return sum(_nbytes(t) for t in ts), _dtype_name(ts[0])
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
            t = arg(1, "input", "input_tensor")
            return _nbytes(t), _dtype_name(t)
        if name == "reduce_scatter":
            ts = arg(1, "input_list")
            return sum(_nbytes(t) for t in ts), _dtype_name(ts[0])
        if name in ("all_gather_into_tensor", "_all_gather_base"):
            t = arg(0, "output_tensor")
            return _nbytes(t), _dtype_name(t)
        if name == "all_gather":
            ts = arg(0, "tensor_list")
            return sum(_nbytes(t) for t in ts), _dtype_name(ts[0])
        if name == "all_to_all_single":
            t = arg(1, "input")
            return _nbytes(t), _dtype_name(t)
        if name == "all_to_all":
            ts = arg(1, "input_tensor_list")
            return sum(_nbytes(t) for t in ts), _dtype_name(ts[0])
        return 0, "object"

    def _wrap(self, name: str, fn):
        import torch.distributed as dist

        rec = self

        def wrapper(*args, **kwargs):
            if not rec.enabled or rec._depth > 0:
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                pos = {"all_reduce": 2, "reduce": 3, "broadcast": 2, "all_reduce_coalesced": 2,
                       "reduce_scatter_tensor": 3, "_reduce_scatter_base": 3, "reduce_scatter": 3,
                       "all_gather_into_tensor": 2, "_all_gather_base": 2, "all_gather": 2,
                       "all_to_all_single": 4, "all_to_all": 2}.get(name)
                if pos is not None and len(args) > pos and not isinstance(args[pos], (int, bool)):
                    group = args[pos]
            try:
                size, dtype = rec._measure(name, args, kwargs)
            except Exception:  # pragma: no cover - unexpected signature
                size, dtype = -1, "unknown"
            try:
                gsize = dist.get_world_size(group)
            except Exception:  # pragma: no cover
                gsize = -1
            async_op = bool(kwargs.get("async_op", False))
            rec._depth += 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                rec._depth -= 1
            rec.records.append({
                "fn": name,
                "op": DS_OPS.get(name, name),
                "bytes": size,
                "dtype": dtype,
                "group_size": gsize,
                "phase": rec.phase,
                "step": rec.step,
                "micro": rec.micro,
                "async": async_op,
                "coalesced": rec._coalesce_id,
                "duration_s": time.perf_counter() - t0,
            })
            return out

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> None:
        import contextlib

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in list(DS_OPS) + list(_OBJECT_OPS):
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or hasattr(fn, "__wrapped__") and (mod, name) in self._originals:
                    continue
                self._originals[(mod, name)] = fn
                setattr(mod, name, self._wrap(name, fn))
        cm = getattr(c10d, "_coalescing_manager", None)
        if cm is not None:
            rec = self

            @contextlib.contextmanager
            def coalescing(*a, **k):
                rec._coalesce_id = rec._next_coalesce
                rec._next_coalesce += 1
                try:
                    with cm(*a, **k) as h:
                        yield h
                finally:
                    rec._coalesce_id = None

            self._originals[(c10d, "_coalescing_manager")] = cm
            c10d._coalescing_manager = coalescing
