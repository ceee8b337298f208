"""One DeepSpeed rank: the process set-up (recorder installed before DeepSpeed binds the collectives,
FileStore rendezvous, shm comm op off) and each job's training loop with its memory snapshots; the
per-rank results are written as JSON in the run's temp dir (split out of
``bench/deepspeed_engine.py``)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from zeroplan.bench.ds_frozen import _frozen_check
from zeroplan.bench.ds_memory import _collect_storages, _memory_by_category
from zeroplan.bench.ds_recorder import _Recorder


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


def _build_model(spec, finetune=None, checkpointing="none"):
    """``zeroplan.runtime.model.build_model`` in fp32 on CPU (DeepSpeed casts to bf16/fp16 itself),
    with ``finetune``'s LoRA adapters and frozen base (``zeroplan.runtime.lora.apply_finetune``:
    PEFT's adapter names and ``requires_grad``) when one is given; ``checkpointing`` "full": every
    layer recomputed in backward by ``torch.utils.checkpoint`` as transformers does it
    (runtime/model_forward.py), not by ``deepspeed.checkpointing``."""
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.model import build_model

    return apply_finetune(build_model(spec, "fp32", "cpu", seed=0, checkpointing=checkpointing), spec, finetune)


def _start_engine(job: dict, rec: _Recorder, cfg: dict) -> tuple:
    """The model (with ``finetune``'s adapters), the client AdamW and ``deepspeed.initialize``; the
    collectives DeepSpeed issues at start-up are recorded apart. Returns (model, tensors, cuda,
    optimizer, engine, device, init records, optimizer class name)."""
    import deepspeed
    import torch

    torch.manual_seed(1234)
    rec.enabled = False
    rec.phase, rec.step, rec.micro = "init", -1, -1
    model = _build_model(job["spec"], job.get("finetune"), job.get("checkpointing", "none"))
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
    return model, tensors, cuda, opt, engine, dev, init_records, opt_class


def _run_job(job: dict, rec: _Recorder, rank: int) -> dict:
    import torch

    cfg = job["ds_config"]
    steps = job["steps"]
    gas = int(cfg.get("gradient_accumulation_steps", 1))
    mb = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    seq = job["seq_len"]
    vocab = int(job["spec"].vocab_size)

    model, tensors, cuda, opt, engine, dev, init_records, opt_class = _start_engine(job, rec, cfg)

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
    # A rank reports through files in out_dir, never on stdout: DeepSpeed's logger and its
    # accelerator warning print to stdout, which is the parent's and may carry `--json`. Send
    # everything this rank prints to stderr instead (file descriptor 1 -> 2, and Python's view).
    os.dup2(2, 1)
    sys.stdout = sys.stderr
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
    import gc

    results = []
    for job in jobs:
        # DeepSpeed's stage-3 __init__ calls gc.collect() (zero/utils.py defragment), which would traverse
        # every object torch, DeepSpeed and the earlier jobs left alive: 0.26 s a call, a quarter of a small
        # job. Collect the earlier job's garbage, then freeze what is alive now; the job's own objects are
        # collected as before.
        gc.collect()
        gc.freeze()
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
