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

DeepSpeed runs on CPU: ``DS_ACCELERATOR=cpu``, gloo, a plain ``torch.optim.AdamW`` with
``zero_force_ds_cpu_optimizer: false``. The shared-memory comm op DeepSpeed would otherwise
JIT-compile at ``init_distributed`` (60-70 s on first use, only used for inference
all-reduce) is switched off by marking it incompatible in ``deepspeed.ops.__compatible_ops__``
before the backend starts (see ``_disable_shm_comm_op``).

torch and deepspeed are imported inside functions only.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from typing import Any

from zeroplan._util import InputError

__all__ = [
    "DS_OPS",
    "run_deepspeed_steps",
    "run_deepspeed_jobs",
    "make_ds_config",
    "deepspeed_available",
    "summarize_step",
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

    seen_storages: set[tuple[int, int]] = set()
    seen_objs: set[int] = set()
    out: dict[str, dict] = {}

    def add_tensor(path: str, t) -> None:
        if t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except Exception:  # pragma: no cover
            return
        key = (st.data_ptr(), st.nbytes())
        if st.nbytes() > 0 and key not in seen_storages:
            seen_storages.add(key)
            out[path] = {"bytes": int(st.nbytes()), "dtype": _dtype_name(t), "numel": int(t.numel()),
                         "category": _categorize(path)}
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
    for name, p in engine.module.named_parameters():
        add_tensor(f"model.{name}", p)
    walk("optimizer", opt, 0)
    for name, root in (extra_roots or {}).items():
        walk(name, root, 0)
    return out


def _memory_by_category(storages: dict[str, dict]) -> dict[str, int]:
    cats = {c: 0 for c in MEMORY_CATEGORIES}
    for info in storages.values():
        cats[info["category"]] += info["bytes"]
    return cats


# --------------------------------------------------------------------------------------------
# A small Llama-shaped model, named as in Hugging Face (used until zeroplan.runtime.model lands)


def _build_model(spec, dtype_name: str):
    """``zeroplan.runtime.model.build_model`` when available, else a local Llama-shaped model."""
    import torch

    try:
        from zeroplan.runtime.model import build_model  # type: ignore[attr-defined]
    except ImportError:
        build_model = None
    if build_model is not None and spec is not None and not isinstance(spec, dict):
        return build_model(spec, torch.float32, "cpu")
    return _tiny_llama(spec if isinstance(spec, dict) else _DEFAULT_TINY)


_DEFAULT_TINY = {"vocab_size": 1201, "hidden_size": 90, "num_layers": 2, "num_attention_heads": 6,
                 "num_key_value_heads": 2, "intermediate_size": 250, "tie_word_embeddings": False}


def _tiny_llama(cfg: dict):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    hd = h // nh
    inter = cfg["intermediate_size"]

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            var = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(h, nh * hd, bias=False)
            self.k_proj = nn.Linear(h, nkv * hd, bias=False)
            self.v_proj = nn.Linear(h, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, h, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, nh, hd).transpose(1, 2)
            k = self.k_proj(x).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            v = self.v_proj(x).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, s, nh * hd))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(h, inter, bias=False)
            self.up_proj = nn.Linear(h, inter, bias=False)
            self.down_proj = nn.Linear(inter, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = Attn()
            self.post_attention_layernorm = RMSNorm()
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
            self.layers = nn.ModuleList([Layer() for _ in range(cfg["num_layers"])])
            self.norm = RMSNorm()

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    class LlamaForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)
            if cfg.get("tie_word_embeddings"):
                self.lm_head.weight = self.model.embed_tokens.weight

        def forward(self, ids):
            return self.lm_head(self.model(ids))

    return LlamaForCausalLM()


def _loss(model_out, ids):
    import torch.nn.functional as F

    logits = model_out[:, :-1, :].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


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
    precision = job["precision"]
    steps = job["steps"]
    gas = int(cfg.get("gradient_accumulation_steps", 1))
    mb = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    seq = job["seq_len"]

    torch.manual_seed(1234)
    rec.enabled = False
    rec.phase, rec.step, rec.micro = "init", -1, -1
    model = _build_model(job.get("spec"), precision)
    vocab = model.lm_head.weight.shape[0] if hasattr(model, "lm_head") else job.get("vocab_size", 256)
    tensors = []
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        tensors.append({"name": name, "shape": list(p.shape), "numel": int(p.numel()),
                        "tied": id(p) in seen})
        seen.add(id(p))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rec.enabled = True
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    init_records = rec.records
    opt_class = type(engine.optimizer).__name__
    rec.records = []

    from deepspeed.comm import comm as ds_comm

    logger_dicts: list[dict] = []
    memory_after: dict[int, dict] = {}
    backward_snap: dict[int, dict] = {}
    gen = torch.Generator().manual_seed(99 + rank)

    for step in range(steps):
        if getattr(ds_comm, "comms_logger", None) is not None:
            ds_comm.comms_logger.comms_dict.clear()
        for micro in range(gas):
            rec.step, rec.micro = step, micro
            ids = torch.randint(0, vocab, (mb, seq), generator=gen)
            rec.phase = "forward"
            out = engine(ids)
            loss = _loss(out, ids)
            rec.phase = "backward"
            hook = None
            if job.get("snapshot_backward") and step == 1 and micro == gas - 1:
                hook = _register_backward_snapshot(engine, backward_snap)
            engine.backward(loss)
            if hook is not None:
                hook.remove()
            rec.phase = "step"
            engine.step()
        rec.phase = "idle"
        if getattr(ds_comm, "comms_logger", None) is not None:
            logger_dicts.append({name: {str(size): vals[0] for size, vals in d.items()}
                                 for name, d in ds_comm.comms_logger.comms_dict.items()})
        if step in (1, steps - 1):
            storages = _collect_storages(engine)
            memory_after[step] = {"by_category": _memory_by_category(storages), "storages": storages}

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
        "tensors": tensors,
        "records": records,
        "init_collectives": len(init_records),
        "comms_logger": logger_dicts,
        "memory": {str(k): v for k, v in memory_after.items()},
        "backward_buffers": backward_snap,
    }


def _register_backward_snapshot(engine, out: dict):
    """Snapshot optimizer-held storages when the first parameter's gradient is accumulated.

    In backward the first tensor of the forward order is the last to get its gradient, so at
    that point every bucket buffer DeepSpeed allocates for the backward pass exists.
    """
    first = next(iter(engine.module.parameters()))

    def hook(_p):
        storages = _collect_storages(engine)
        out.update({k: v for k, v in storages.items() if v["category"] == "buffers"
                    or "ipg" in k.lower() or "grads_in_partition" in k})

    return first.register_post_accumulate_grad_hook(hook)


def _worker(rank: int, nproc: int, port: int, jobs: list[dict], out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
                       "DS_ACCELERATOR": "cpu"})
    import logging

    import torch

    torch.set_num_threads(1)
    rec = _Recorder()
    rec.install()  # before deepspeed binds all_gather_into_tensor / reduce_scatter_tensor
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.ERROR)
    _disable_shm_comm_op()
    from datetime import timedelta

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=180))
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
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed_jobs(jobs: list[dict], *, nproc: int, timeout_s: float = 900.0) -> list[list[dict]]:
    """Run many DeepSpeed jobs in ONE launch of ``nproc`` ranks (start-up costs ~10 s per launch).

    Each job: {"name", "ds_config", "precision", "steps", "seq_len", "spec"?, "snapshot_backward"?}.
    Returns per job a list of per-rank result dicts (see ``_run_job``).
    """
    import torch.multiprocessing as mp

    env_before = {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS")}
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix="zeroplan-ds-") as out_dir:
            ctx = mp.start_processes(_worker, args=(nproc, _free_port(), jobs, out_dir), nprocs=nproc,
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


def run_deepspeed_steps(spec, ds_config: dict, *, nproc: int, steps: int = 3, warmup: int = 2,
                        micro_batch: int = 1, seq_len: int = 16, grad_accum: int = 1,
                        precision: str = "bf16") -> list[dict]:
    """Train ``spec`` with the real DeepSpeed engine; per-rank raw results. (Completed in step 2.)"""
    cfg = dict(ds_config)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg.pop("train_batch_size", None)
    job = {"name": "run", "ds_config": cfg, "precision": precision, "steps": warmup + steps,
           "seq_len": seq_len, "spec": spec}
    return run_deepspeed_jobs([job], nproc=nproc)[0]
