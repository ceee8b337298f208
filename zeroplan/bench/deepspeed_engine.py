"""Run the REAL DeepSpeed engine on a zeroplan model and record what it issues.

This is the external witness for zeroplan's ledger (``zeroplan.core.comm``) and memory model:
the same model is trained by ``deepspeed.initialize`` / ``engine.backward`` / ``engine.step``
on CPU over gloo, and every collective DeepSpeed issues is recorded by wrapping the
``torch.distributed`` functions in each rank (op, FULL buffer bytes, dtype, group size,
phase), with DeepSpeed's own comms logger as a second witness. Persistent memory per rank
is read from the optimizer object after the steps (tensor storages, deduplicated).

Conventions:
- ``buffer_bytes`` follows ``zeroplan.specs.collectives``: the output of an all-gather, the
  input of a reduce-scatter, the tensor of an all-reduce / broadcast / reduce (bytes of the
  dtype actually sent).
- A "step" is one optimizer step = ``grad_accum`` micro-steps. Phases: ``forward`` (the
  module call), ``backward`` (``engine.backward``), ``step`` (``engine.step``).
- Memory values are bytes per rank (CPU tensor storages, each storage counted once).

Device (``select_device``): CUDA with NCCL when CUDA is available and has at least ``nproc``
GPUs (``DS_ACCELERATOR=cuda``, rank r on ``cuda:r``; the config's ``optimizer`` block is kept,
so DeepSpeed builds its FusedAdam as it would for the user; without one, a client torch
AdamW); else CPU: ``DS_ACCELERATOR=cpu``, gloo, a plain ``torch.optim.AdamW`` with
``zero_force_ds_cpu_optimizer: false``. On CUDA every rank also reports
``max_memory_allocated`` / ``max_memory_reserved`` over the measured steps. The shared-memory comm op DeepSpeed would otherwise
JIT-compile at ``init_distributed`` (60-70 s on first use, only used for inference
all-reduce) is switched off by marking it incompatible in ``deepspeed.ops.__compatible_ops__``
before the backend starts (see ``_disable_shm_comm_op``).

torch and deepspeed are imported inside functions only.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from zeroplan._util import InputError
from zeroplan.runtime.results import CollectiveRecord, RankFailure
from zeroplan.specs.collectives import OPS

__all__ = [
    "DS_OPS",
    "DeepSpeedRankResult",
    "run_deepspeed_steps",
    "run_deepspeed_matrix",
    "run_deepspeed_jobs",
    "prepare_ds_config",
    "make_ds_config",
    "deepspeed_available",
    "summarize_step",
    "per_step_summary",
    "steps_identical",
]

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

MEMORY_CATEGORIES = ("params", "gradients", "optimizer_states", "buffers", "activations", "other")


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works (without starting anything)."""
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # pragma: no cover
        return False


# --------------------------------------------------------------------------------------------
# Recording torch.distributed calls


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


def _disable_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op (60-70 s, inference only).

    ``deepspeed.comm.torch.build_shm_op`` returns None when the op is not marked compatible in
    ``deepspeed.ops.__compatible_ops__``; the dict is cached on the module, so the edit holds
    for the process. (Alternatives: install with ``DS_BUILD_SHM_COMM=1`` so it is prebuilt, or
    keep ``~/.cache/torch_extensions`` warm: only the first launch on a machine compiles.)
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__["deepspeed_ccl_comm"] = False


# --------------------------------------------------------------------------------------------
# Memory: tensor storages reachable from the engine's optimizer


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


# --------------------------------------------------------------------------------------------
# The model: the bundled runtime's builder, so DeepSpeed trains exactly the spec's tensors


def select_device(nproc: int, device: str = "auto", *, cuda: Any = None) -> tuple[str, str]:
    """(device type, process-group backend) for a DeepSpeed run of ``nproc`` local ranks.

    "auto": ("cuda", "nccl") when CUDA is available with at least ``nproc`` devices (one GPU
    per rank, never shared); ("cpu", "gloo") when no CUDA device is visible; CUDA with fewer
    GPUs than ranks (or "cuda" without CUDA) is an ``InputError``. ``cuda``: the ``torch.cuda`` module (a stand-in in tests). The launch uses
    the spawn start method, so probing CUDA here cannot poison the ranks.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected auto, cpu or cuda")
    if device == "cpu":
        return "cpu", "gloo"
    if cuda is None:
        import torch

        cuda = torch.cuda
    count = int(cuda.device_count()) if cuda.is_available() else 0
    if count >= nproc:
        return "cuda", "nccl"
    if count or device == "cuda":  # never two ranks on one GPU
        raise InputError(f"--nproc {nproc}: DeepSpeed on CUDA needs one GPU per rank, this machine has {count}")
    return "cpu", "gloo"


def _build_model(spec, finetune=None):
    """``zeroplan.runtime.model.build_model`` in fp32 on CPU (DeepSpeed casts to bf16/fp16 itself),
    with ``finetune``'s LoRA adapters and frozen base (``zeroplan.runtime.lora.apply_finetune``:
    PEFT's adapter names and ``requires_grad``) when one is given."""
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.model import build_model

    return apply_finetune(build_model(spec, "fp32", "cpu", seed=0), spec, finetune)


def _numel_of_tensors(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.numel())
    if isinstance(obj, (list, tuple)):
        return sum(_numel_of_tensors(x) for x in obj)
    return 0


def _frozen_check(engine, model) -> dict:
    """What DeepSpeed did with the frozen (``requires_grad=False``) parameters, read from its objects.

    - ``trainable_numel`` / ``frozen_numel``: the model's parameters by ``requires_grad``;
    - ``optimizer_numel``: elements the innermost torch optimizer steps (its param groups: the
      fp32 partitions under ZeRO 1-2, ``fp32_partitioned_groups_flat`` at stage 3, the fp32 copies
      of FP16_UnfusedOptimizer at bf16 stage 0, the parameters themselves at fp32 stage 0);
    - ``optimizer_state_numel``: elements of its state tensors (AdamW exp_avg + exp_avg_sq; the
      0-dim ``step`` counters excluded);
    - ``zero_group_numel``: elements of the bit16 parameters ZeRO put in its groups
      (stage_1_and_2.py ``bit16_groups``, bf16_optimizer.py ``bf16_groups``, stage3.py
      ``fp16_groups``), and ``frozen_in_groups``: frozen parameters found in any of them or in the
      optimizer's param groups (expected: none);
    - ``frozen_with_grad``: frozen parameters holding a ``.grad`` after the steps (expected: none).
    """
    import torch

    frozen = {id(p): n for n, p in model.named_parameters() if not p.requires_grad}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    groups_params = [p for g in getattr(inner, "param_groups", []) for p in g["params"]]
    if isinstance(getattr(opt, "fp32_partitioned_groups_flat", None), list):
        # stage3.py _optimizer_step puts a sub-group's fp32 partition into the param group only
        # while it steps (`param_groups[...]['params'] = [fp32_param]`, then `[]`): read the partitions
        groups_params = list(opt.fp32_partitioned_groups_flat)
    state_numel = 0
    for st in getattr(inner, "state", {}).values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state_numel += int(v.numel())
    zero_groups = []
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        got = getattr(opt, attr, None)
        if isinstance(got, list) and got:
            zero_groups = [p for grp in got for p in grp]
            break
    in_groups = sorted({frozen[id(p)] for p in zero_groups + groups_params if id(p) in frozen})
    return {
        "trainable_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel())
                               for p in model.parameters() if p.requires_grad),
        "frozen_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel())
                            for p in model.parameters() if not p.requires_grad),
        "trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad),
        "frozen_tensors": len(frozen),
        "optimizer_numel": _numel_of_tensors(groups_params),
        "optimizer_state_numel": state_numel,
        "zero_group_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for p in zero_groups),
        "frozen_in_groups": in_groups,
        "frozen_with_grad": sorted(n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None),
    }


# --------------------------------------------------------------------------------------------
# DeepSpeed config


def make_ds_config(*, stage: int, precision: str, micro_batch: int, grad_accum: int,
                   zero: dict | None = None, comms_logger: bool = True) -> dict:
    """A DeepSpeed config for CPU training with a client torch AdamW (no DeepSpeed CPU Adam)."""
    zo = {"stage": stage}
    zo.update(zero or {})
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": zo,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision != "fp32":
        raise InputError(f"precision {precision!r} is unknown; expected fp32, bf16 or fp16")
    if comms_logger:
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return cfg


# --------------------------------------------------------------------------------------------
# One job in one rank


def _run_job(job: dict, rec: _Recorder, rank: int) -> dict:
    import deepspeed
    import torch

    cfg = job["ds_config"]
    steps = job["steps"]
    gas = int(cfg.get("gradient_accumulation_steps", 1))
    mb = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    seq = job["seq_len"]

    torch.manual_seed(1234)
    rec.enabled = False
    rec.phase, rec.step, rec.micro = "init", -1, -1
    model = _build_model(job["spec"], job.get("finetune"))
    vocab = int(job["spec"].vocab_size)
    tensors = []
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        tensors.append({"name": name, "shape": list(p.shape), "numel": int(p.numel()),
                        "tied": id(p) in seen})
        seen.add(id(p))
    cuda = job.get("device") == "cuda"
    if cuda and "optimizer" in cfg:  # DeepSpeed builds the config's optimizer (FusedAdam on CUDA)
        opt = None
    else:
        # the trainable parameters only, as HF Trainer / PEFT users build it (a frozen parameter
        # gets no gradient, so torch's AdamW would keep no state for it either)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                **job.get("adamw", {"lr": 1e-3, "weight_decay": 0.0}))
    rec.enabled = True
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    dev = engine.device if cuda else torch.device("cpu")
    init_records = rec.records
    opt_class = type(engine.optimizer).__name__
    rec.records = []

    from deepspeed.comm import comm as ds_comm

    logger_dicts: list[dict] = []
    memory_after: dict[int, dict] = {}
    backward_snap: dict[int, dict] = {}  # step -> {"by_category", "storages"}
    gen = torch.Generator().manual_seed(99 + rank)
    snap_steps = {1, steps - 1}
    if job.get("memory_step") is not None:
        snap_steps.add(job["memory_step"])
    before_step: dict[int, dict] = {}
    inner_step = engine.optimizer.step

    def step_with_snapshot(*args, **kwargs):
        # the optimizer step at the accumulation boundary: gradients are reduced and partitioned
        if rec.step in snap_steps and rec.step not in before_step:
            st = _collect_storages(engine)
            before_step[rec.step] = {"by_category": _memory_by_category(st), "storages": st}
        return inner_step(*args, **kwargs)

    engine.optimizer.step = step_with_snapshot

    for step in range(steps):
        if cuda and step == job.get("memory_from_step", 0):
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if getattr(ds_comm, "comms_logger", None) is not None:
            ds_comm.comms_logger.comms_dict.clear()
        for micro in range(gas):
            rec.step, rec.micro = step, micro
            ids = torch.randint(0, vocab, (mb, seq), generator=gen).to(dev)
            rec.phase = "forward"
            loss = engine(ids)  # the runtime model returns the mean causal-LM loss
            rec.phase = "backward"
            hook = None
            if step in snap_steps and micro == gas - 1:
                backward_snap[step] = {}
                hook = _register_backward_snapshot(engine, backward_snap[step])
            engine.backward(loss)
            if hook is not None:
                hook.remove()
            rec.phase = "step"
            engine.step()
        rec.phase = "idle"
        if getattr(ds_comm, "comms_logger", None) is not None:
            logger_dicts.append({name: {str(size): vals[0] for size, vals in d.items()}
                                 for name, d in ds_comm.comms_logger.comms_dict.items()})
        if step in snap_steps:
            storages = _collect_storages(engine)
            memory_after[step] = {"by_category": _memory_by_category(storages), "storages": storages}

    frozen_check = _frozen_check(engine, model)
    cuda_memory = None
    if cuda:
        torch.cuda.synchronize(dev)
        cuda_memory = {"max_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
                       "max_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
                       "device_total_bytes": int(torch.cuda.get_device_properties(dev).total_memory)}
    records = rec.records
    rec.records = []
    if hasattr(engine, "destroy"):
        try:
            engine.destroy()
        except Exception:  # pragma: no cover
            pass
    del engine, opt, model
    return {
        "optimizer_class": opt_class,
        "frozen_check": frozen_check,
        "cuda_memory": cuda_memory,
        "tensors": tensors,
        "records": records,
        "init_collectives": len(init_records),
        "comms_logger": logger_dicts,
        "memory": {str(k): v for k, v in memory_after.items()},
        "memory_before_step": {str(k): v for k, v in before_step.items()},
        "memory_in_backward": {str(k): v for k, v in backward_snap.items() if v},
    }


def _register_backward_snapshot(engine, out: dict):
    """Snapshot the reachable storages when the first parameter's gradient is accumulated.

    In backward the first trainable tensor of the forward order is the last to get its gradient, so at
    that point every gradient and bucket buffer DeepSpeed holds for the backward pass exists.
    """
    # (trainable only: a frozen parameter gets no gradient, and torch refuses a hook on it)
    first = next(p for p in engine.module.parameters() if p.requires_grad)

    def hook(_p):
        if not out:
            storages = _collect_storages(engine)
            out.update({"by_category": _memory_by_category(storages), "storages": storages})

    return first.register_post_accumulate_grad_hook(hook)


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the launching process dies (no orphaned ranks)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _worker(rank: int, nproc: int, jobs: list[dict], out_dir: str, device: str = "cpu") -> None:
    _die_with_parent()
    # MASTER_* are set for code that reads them, but the rendezvous is a FileStore in out_dir (below):
    # no TCP port is picked, so parallel launches (pytest-xdist workers) can never collide on one.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": str(rank),
                       "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
                       "DS_ACCELERATOR": device})
    import logging

    import torch

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank (select_device checked the count)
    rec = _Recorder()
    rec.install()  # before deepspeed binds all_gather_into_tensor / reduce_scatter_tensor
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.ERROR)
    _disable_shm_comm_op()
    from datetime import timedelta

    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(out_dir, "rendezvous"), nproc)
    dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=180))
    # deepspeed.comm.init_distributed: "the user initialized torch.dist themselves" -> it wraps the
    # existing group in its TorchBackend instead of creating one (DeepSpeed 0.19.8, comm/comm.py)
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=180))
    results = []
    for job in jobs:
        t0 = time.perf_counter()
        try:
            res = _run_job(job, rec, rank)
            res["error"] = None
        except Exception as exc:  # one bad config must not lose the others
            res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        res["wall_s"] = time.perf_counter() - t0
        res["name"] = job["name"]
        results.append(res)
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(results, fh)
        os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


def run_deepspeed_jobs(jobs: list[dict], *, nproc: int, timeout_s: float = 900.0,
                       device: str = "cpu") -> list[list[dict]]:
    """Run many DeepSpeed jobs in ONE launch of ``nproc`` ranks (start-up costs ~10 s per launch).

    Each job: {"name", "ds_config" (ready for ``deepspeed.initialize``), "precision", "steps",
    "seq_len", "spec" (ModelSpec), "adamw"? (AdamW kwargs), "memory_step"? (extra snapshot step)}.
    Returns per job a list of per-rank result dicts (see ``_run_job``).
    """
    import torch.multiprocessing as mp

    env_before = {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS")}
    os.environ["DS_ACCELERATOR"] = device
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix="zeroplan-ds-") as out_dir:
            ctx = mp.start_processes(_worker, args=(nproc, jobs, out_dir, device), nprocs=nproc,
                                     join=False, start_method="spawn")
            deadline = time.monotonic() + timeout_s
            error = None
            try:
                while not ctx.join(timeout=5):
                    if time.monotonic() > deadline:
                        error = f"DeepSpeed ranks did not finish within {timeout_s:.0f} s"
                        break
            except Exception as exc:  # a rank died
                error = f"a DeepSpeed rank failed: {exc}"
            if error is not None:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
            per_rank = []
            for r in range(nproc):
                path = os.path.join(out_dir, f"rank{r}.json")
                per_rank.append(json.load(open(path)) if os.path.exists(path) else [])
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = []
    for i, job in enumerate(jobs):
        ranks = []
        for r in range(nproc):
            if i < len(per_rank[r]):
                ranks.append(per_rank[r][i])
            else:
                ranks.append({"name": job["name"], "error": error or "rank produced no result"})
        out.append(ranks)
    return out


# --------------------------------------------------------------------------------------------
# Summaries


def summarize_step(records: list[dict], step: int) -> dict:
    """Collectives of one optimizer step grouped by (op, phase): count, total bytes, per-call sizes."""
    groups: dict[str, dict] = {}
    for r in records:
        if r["step"] != step:
            continue
        key = f"{r['op']}|{r['phase']}"
        g = groups.setdefault(key, {"op": r["op"], "phase": r["phase"], "count": 0, "bytes": 0,
                                    "dtypes": [], "group_size": r["group_size"], "sizes": [],
                                    "coalesced_calls": 0, "fns": []})
        g["count"] += 1
        g["bytes"] += r["bytes"]
        g["sizes"].append(r["bytes"])
        if r["dtype"] not in g["dtypes"]:
            g["dtypes"].append(r["dtype"])
        if r["fn"] not in g["fns"]:
            g["fns"].append(r["fn"])
        if r.get("coalesced") is not None:
            g["coalesced_calls"] += 1
    return dict(sorted(groups.items()))


class DeepSpeedRankResult(BaseModel):
    """What one rank of the real DeepSpeed engine did in the measured steps (after warm-up).

    ``records`` / ``records_by_step`` use the bundled runtime's ``CollectiveRecord`` (FULL
    buffer bytes, dtype sent, phase). ``memory`` is bytes per rank by zeroplan category
    (params, gradients, optimizer_states, buffers, activations, other) of the persistent
    tensor storages reachable from the model and ``engine.optimizer`` after the last step;
    ``memory_storages`` names each storage by its attribute path. Activations and transient
    buffers are not visible this way (CPU, no allocator hooks): they read 0.
    """

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=0)
    failure: RankFailure | None = None
    steps: int = Field(0, ge=0, description="measured optimizer steps")
    records: list[CollectiveRecord] = Field(default_factory=list)
    records_by_step: list[list[CollectiveRecord]] = Field(default_factory=list)
    memory: dict[str, int] = Field(default_factory=dict)
    memory_storages: dict[str, int] = Field(default_factory=dict)
    memory_before_step: dict[str, int] = Field(
        default_factory=dict, description="by category, when the last optimizer step starts (gradients reduced)")
    memory_before_step_storages: dict[str, int] = Field(default_factory=dict)
    memory_in_backward: dict[str, int] = Field(
        default_factory=dict, description="by category, when the last gradient of the last micro-step is accumulated")
    backward_buffers: dict[str, int] = Field(default_factory=dict, description="buffers alive then, by attribute path")
    cuda_memory: dict[str, int] | None = Field(
        None, description="CUDA only: max_allocated_bytes / max_reserved_bytes over the measured steps, "
                          "device_total_bytes")
    comms_logger: list[dict[str, dict[str, int]]] = Field(
        default_factory=list, description="DeepSpeed comms_logger per measured step: op -> {logged msg bytes: calls}")
    optimizer_class: str = ""
    frozen_check: dict[str, Any] = Field(
        default_factory=dict, description="what DeepSpeed did with frozen parameters (see _frozen_check)")
    wall_s: float = 0.0


def _to_rank_result(rank: int, raw: dict, warmup: int, steps: int) -> DeepSpeedRankResult:
    if raw.get("error"):
        return DeepSpeedRankResult(rank=rank, failure=RankFailure(rank=rank, kind="error", message=raw["error"]))
    by_step: list[list[CollectiveRecord]] = [[] for _ in range(steps)]
    for r in raw["records"]:
        idx = r["step"] - warmup
        if not 0 <= idx < steps or r["op"] not in OPS or r["phase"] not in ("forward", "backward", "step"):
            continue
        by_step[idx].append(CollectiveRecord(
            op=r["op"], phase=r["phase"], buffer_bytes=r["bytes"], dtype=r["dtype"], group_size=r["group_size"],
            duration_s=max(0.0, r["duration_s"]), rank=rank))
    last = raw["memory"][str(warmup + steps - 1)]
    bwd = raw.get("memory_in_backward", {}).get(str(warmup + steps - 1), {})
    pre = raw.get("memory_before_step", {}).get(str(warmup + steps - 1), {"by_category": {}, "storages": {}})
    return DeepSpeedRankResult(
        rank=rank, steps=steps, records=[x for st in by_step for x in st], records_by_step=by_step,
        memory=last["by_category"], memory_storages={k: v["bytes"] for k, v in last["storages"].items()},
        memory_before_step=pre["by_category"],
        memory_before_step_storages={k: v["bytes"] for k, v in pre["storages"].items()},
        memory_in_backward=bwd.get("by_category", {}),
        backward_buffers={k: v["bytes"] for k, v in bwd.get("storages", {}).items() if v["category"] == "buffers"},
        comms_logger=raw["comms_logger"][warmup:warmup + steps], optimizer_class=raw.get("optimizer_class", ""),
        frozen_check=raw.get("frozen_check", {}),
        cuda_memory=raw.get("cuda_memory"),
        wall_s=raw.get("wall_s", 0.0))


def prepare_ds_config(ds_config: str | dict, *, nproc: int, micro_batch: int | None, grad_accum: int | None,
                      precision: str | None, hidden_size: int | None = None,
                      device: str = "cpu") -> tuple[dict, str, dict]:
    """Validate a DeepSpeed config with zeroplan's reader (strict) and make it runnable on CPU.

    Returns (config dict for ``deepspeed.initialize``, precision, AdamW kwargs). The config's own
    optimizer/scheduler blocks are replaced by a client ``torch.optim.AdamW`` with the same
    lr / betas / eps / weight_decay (DeepSpeed's fused and CPU Adam need compiled ops);
    batch keys are set from ``micro_batch`` / ``grad_accum`` (or the config's). On ``device``
    "cuda" the config's optimizer block and ``zero_force_ds_cpu_optimizer`` are kept: DeepSpeed
    builds FusedAdam (or DeepSpeedCPUAdam under offload) as it would for the user. Raises
    ``InputError`` (one line: file, key, value, expectation) before anything starts.
    """
    from zeroplan.specs.deepspeed_config import load_ds_config

    dsc = load_ds_config(ds_config, strict=True, hidden_size=hidden_size, micro_batch=micro_batch,
                         grad_accum=grad_accum, world_size=nproc, precision=precision)
    prec = precision or dsc.precision
    if prec not in ("fp32", "bf16", "fp16"):  # pragma: no cover - the reader guarantees it
        raise InputError(f"{dsc.path or '<config>'}: precision {prec!r}: expected fp32, bf16 or fp16")
    raw = json.loads(json.dumps(dsc.raw))  # plain copy
    mb = int(micro_batch or dsc.micro_batch or 1)
    gas = int(grad_accum or dsc.grad_accum or 1)
    optimizer_block = raw.get("optimizer")
    for key in ("train_batch_size", "optimizer", "scheduler", "comms_logger", "fp16", "bf16", "bfloat16", "amp"):
        raw.pop(key, None)
    raw["train_micro_batch_size_per_gpu"] = mb
    raw["gradient_accumulation_steps"] = gas
    # "auto" values: the value zeroplan's reader resolved (HF Trainer rules), else DeepSpeed's default
    for dotted, info in dsc.auto_resolved.items():
        *parents, leaf = str(dotted).split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(leaf) != "auto":
            continue
        value = info.get("value") if isinstance(info, dict) else None
        if value is None or value == "auto":
            node.pop(leaf)
        else:
            node[leaf] = value
    _drop_auto(raw)
    base = make_ds_config(stage=int(dsc.zero.stage), precision=prec, micro_batch=mb, grad_accum=gas)
    for k, v in base.items():
        if k != "zero_optimization":
            raw.setdefault(k, v)
    if device == "cuda" and isinstance(optimizer_block, dict):
        raw["optimizer"] = optimizer_block
        _drop_auto(raw["optimizer"])
        if "zero_force_ds_cpu_optimizer" in dsc.raw:
            raw["zero_force_ds_cpu_optimizer"] = dsc.raw["zero_force_ds_cpu_optimizer"]
        else:
            raw.pop("zero_force_ds_cpu_optimizer", None)
    else:
        raw["zero_force_ds_cpu_optimizer"] = False
    raw["zero_allow_untested_optimizer"] = True
    raw["comms_logger"] = base["comms_logger"]
    raw.setdefault("zero_optimization", {"stage": int(dsc.zero.stage)})
    op = {k: v for k, v in (dsc.optimizer_params or {}).items() if v != "auto"}  # "auto": torch's default
    adamw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.0}
    try:
        for key in ("lr", "weight_decay", "eps"):
            if key in op:
                adamw[key] = float(op[key])
        if "betas" in op:
            adamw["betas"] = tuple(float(b) for b in op["betas"])
    except (TypeError, ValueError):
        raise InputError(f"{dsc.path or '<config>'}: optimizer.params = {json.dumps(op)}: expected numbers "
                         "for lr / weight_decay / eps and two numbers for betas") from None
    return raw, prec, adamw


def _drop_auto(node: Any) -> None:
    """Remove any "auto" left (DeepSpeed itself drops them and uses its default)."""
    if isinstance(node, dict):
        for k in [k for k, v in node.items() if v == "auto"]:
            node.pop(k)
        for v in node.values():
            _drop_auto(v)


def run_deepspeed_matrix(spec, runs: list[dict], *, nproc: int, steps: int = 2, warmup: int = 2,
                         seq_len: int = 16, timeout_s: float = 900.0,
                         device: str = "auto") -> list[list[DeepSpeedRankResult]]:
    """Several configurations in ONE launch (DeepSpeed start-up costs ~10 s per launch).

    ``runs``: [{"ds_config": path | JSON text | dict, "precision"?: str, "micro_batch"?: int,
    "grad_accum"?: int, "finetune"?: FineTune (LoRA adapters + frozen base, runtime/lora.py)},
    ...]; every config is validated before anything starts. Returns, per
    run, one ``DeepSpeedRankResult`` per rank (a failed run has ``failure`` set on its ranks).
    """
    if nproc < 1 or steps < 1 or warmup < 0:
        raise InputError(f"DeepSpeed run: nproc={nproc}, steps={steps}, warmup={warmup}: "
                         "expected nproc >= 1, steps >= 1, warmup >= 0")
    hidden = getattr(spec, "hidden_size", None)
    dev, _backend = select_device(nproc, device)
    jobs = []
    for i, run in enumerate(runs):  # zeroplan's own validation first: a bad config never reaches DeepSpeed
        cfg, prec, adamw = prepare_ds_config(run["ds_config"], nproc=nproc, micro_batch=run.get("micro_batch"),
                                             grad_accum=run.get("grad_accum"), precision=run.get("precision"),
                                             hidden_size=hidden, device=dev)
        jobs.append({"name": f"run{i}", "ds_config": cfg, "precision": prec, "steps": warmup + steps,
                     "seq_len": seq_len, "spec": spec, "adamw": adamw, "memory_step": warmup + steps - 1,
                     "device": dev, "memory_from_step": warmup, "finetune": run.get("finetune")})
    if not deepspeed_available():
        raise InputError("--engine deepspeed: DeepSpeed is not installed; install it with "
                         "DS_BUILD_OPS=0 pip install 'zeroplan[deepspeed]'")
    out = run_deepspeed_jobs(jobs, nproc=nproc, timeout_s=timeout_s, device=dev)
    return [[_to_rank_result(r, raw, warmup, steps) for r, raw in enumerate(ranks)] for ranks in out]


def run_deepspeed_steps(spec, ds_config: str | dict, *, nproc: int, steps: int = 2, warmup: int = 2,
                        micro_batch: int | None = 1, seq_len: int = 16, grad_accum: int | None = None,
                        precision: str | None = None, timeout_s: float = 900.0,
                        device: str = "auto", finetune: Any = None) -> list[DeepSpeedRankResult]:
    """Train ``spec`` (a ModelSpec) with the REAL DeepSpeed engine on ``nproc`` CPU ranks (gloo).

    ``ds_config``: path, JSON text or dict; validated strictly by zeroplan first (bad configs
    raise ``InputError`` before DeepSpeed starts). ``warmup`` steps are run and not measured
    (stage 3 needs 2: trace recording), then ``steps`` measured optimizer steps of
    ``grad_accum`` micro-steps of ``micro_batch`` × ``seq_len`` tokens. ``precision``
    (fp32/bf16/fp16) overrides the config's. Returns one ``DeepSpeedRankResult`` per rank.
    """
    run = {"ds_config": ds_config, "precision": precision, "micro_batch": micro_batch, "grad_accum": grad_accum,
           "finetune": finetune}
    return run_deepspeed_matrix(spec, [run], nproc=nproc, steps=steps, warmup=warmup, seq_len=seq_len,
                                timeout_s=timeout_s, device=device)[0]


def per_step_summary(result: DeepSpeedRankResult) -> dict[tuple[str, str], dict[str, int]]:
    """(op, phase) -> {"count", "bytes"} per optimizer step (averaged over the measured steps, exact
    when the steps are identical, which ``steps_identical`` checks)."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for rec in result.records:
        e = out.setdefault((rec.op, rec.phase), {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += rec.buffer_bytes
    n = max(1, result.steps)
    return {k: {"count": v["count"] // n, "bytes": v["bytes"] // n} for k, v in sorted(out.items())}


def steps_identical(result: DeepSpeedRankResult) -> bool:
    """True when every measured step issued the same (op, phase, bytes, dtype) sequence."""
    seqs = [[(r.op, r.phase, r.buffer_bytes, r.dtype) for r in st] for st in result.records_by_step]
    return all(s == seqs[0] for s in seqs)
