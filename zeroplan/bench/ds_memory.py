"""Persistent memory of a DeepSpeed rank: the tensor storages reachable from the model and the engine's
optimizer, one entry per distinct storage, named by attribute path and put in zeroplan's categories
(split out of ``bench/deepspeed_engine.py``)."""

from __future__ import annotations

from typing import Any

from zeroplan.bench.ds_recorder import _dtype_name


MEMORY_CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations", "other")


_CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    # (substring of the attribute path, category) — first match wins
    ("global_grad_norm", "other"),
    ("inf_or_nan", "other"),
    ("param_buffer_of_bit16", "buffers"),
    ("ipg", "buffers"),
    ("temp_grad", "buffers"),
    ("accumulated_grads_in_cpu", "buffers"),
    ("subgroup_gradient_buffer", "gradients"),
    (".state[", "optimizer_states"),
    ("single_partition_of_fp32_groups", "optimizer_states"),
    ("fp32_partitioned_groups_flat", "optimizer_states"),
    ("fp32_groups_flat_partition", "optimizer_states"),
    ("fp32_groups_flat", "optimizer_states"),
    ("fp32_groups", "optimizer_states"),
    ("fp32_params", "optimizer_states"),
    ("grad", "gradients"),
    ("bit16_groups_flat", "params"),
    ("bf16_groups_flat", "params"),
    ("fp16_partitioned_groups_flat", "params"),
    ("lp_param_buffer", "params"),
    ("fp16_groups_flat", "params"),
    ("bf16_groups", "params"),
    ("bit16_groups", "params"),
    ("fp16_groups", "params"),
    ("persistent_param", "params"),
    ("model.", "params"),
    ("ds_tensor", "params"),
)


def _categorize(path: str) -> str:
    low = path.lower()
    # gradients of fp32 master partitions (offload) are gradients, not optimizer state
    if low.endswith(".grad") and ("fp32" in low or "single_partition" in low):
        return "gradients"
    for key, cat in _CATEGORY_RULES:
        if key in low:
            return cat
    return "other"


def _collect_storages(engine, extra_roots: dict[str, Any] | None = None, max_depth: int = 4) -> dict[str, dict]:
    """Walk the model parameters and the optimizer object; one entry per distinct storage.

    Returns {path: {"bytes": storage bytes, "dtype": ..., "numel": tensor numel, "category": ...}}.
    """
    import torch

    seen_objs: set[int] = set()
    # storage key -> (rank, path, info); the lowest rank wins, then the first seen. A ".grad" that
    # is a view into a larger storage (a gradient bucket, a flat partition) ranks last, so the
    # owner of the buffer names it.
    claims: dict[tuple[int, int], tuple[int, str, dict]] = {}

    def add_tensor(path: str, t) -> None:
        if t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except Exception:  # pragma: no cover
            return
        nbytes = int(st.nbytes())
        if nbytes > 0:
            key = (st.data_ptr(), nbytes)
            view = t.numel() * t.element_size() < nbytes
            rank = 2 if (view and path.endswith(".grad")) else 1 if view else 0
            category = _categorize(path)
            if hasattr(t, "ds_tensor") and hasattr(t, "ds_status"):
                # a ZeRO-3 parameter's full data: kept whole if persistent, else a gathered copy
                category = "params" if getattr(t, "ds_persist", False) else "buffers"
            if key not in claims or rank < claims[key][0]:
                claims[key] = (rank, path, {"bytes": nbytes, "dtype": _dtype_name(t), "numel": int(t.numel()),
                                            "category": category})
        for attr in ("ds_tensor", "grad"):
            sub = getattr(t, attr, None) if attr != "grad" else (t.grad if t.is_leaf else None)
            if isinstance(sub, torch.Tensor):
                add_tensor(f"{path}.{attr}", sub)

    def walk(path: str, obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add_tensor(path, obj)
            return
        if depth > max_depth or id(obj) in seen_objs:
            return
        if isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen_objs.add(id(obj))
        if isinstance(obj, dict):
            for i, (k, v) in enumerate(list(obj.items())):
                kname = k if isinstance(k, (str, int)) else type(k).__name__
                if isinstance(k, torch.Tensor):
                    kname = f"param{i}{list(k.shape)}"
                walk(f"{path}[{kname}]", v, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{path}[{i}]", v, depth + 1)
            return
        if isinstance(obj, torch.nn.Module):
            return  # the model is walked separately
        d = getattr(obj, "__dict__", None)
        if d is None:
            return
        mod = type(obj).__module__ or ""
        if not (mod.startswith("deepspeed") or mod.startswith("torch.optim")) and depth > 0:
            return
        for k, v in list(d.items()):
            if k in ("param_groups",):
                continue  # the same tensors as the groups below, under a less telling name
            walk(f"{path}.{k}", v, depth + 1)

    opt = engine.optimizer
    # the innermost torch optimizer first, so Adam state is named ".state[...]"
    inner = getattr(opt, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        walk("optimizer.optimizer.state", inner.state, 1)
    # the optimizer before the model: a parameter's data / .grad may be a view into a flat buffer
    # or gradient bucket the optimizer owns, and that buffer's name says what the storage is
    walk("optimizer", opt, 0)
    for name, p in engine.module.named_parameters():
        add_tensor(f"model.{name}", p)
    for name, root in (extra_roots or {}).items():
        walk(name, root, 0)
    return {path: info for _, path, info in claims.values()}


def _memory_by_category(storages: dict[str, dict]) -> dict[str, int]:
    cats = {c: 0 for c in MEMORY_CATEGORIES}
    for info in storages.values():
        cats[info["category"]] += info["bytes"]
    return cats
