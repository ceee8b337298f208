"""Launching DeepSpeed: the device choice, ONE launch of ``nproc`` spawned ranks for many jobs (with a
deadline) and the matrix / single-run entry points (split out of ``bench/deepspeed_engine.py``)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from zeroplan._util import InputError
from zeroplan.bench.ds_config_prep import prepare_ds_config
from zeroplan.bench.ds_results import DeepSpeedRankResult, _to_rank_result
from zeroplan.bench.ds_worker import _worker


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works (without starting anything)."""
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # pragma: no cover
        return False


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


def run_deepspeed_matrix(spec, runs: list[dict], *, nproc: int, steps: int = 2, warmup: int = 2,
                         seq_len: int = 16, timeout_s: float = 900.0,
                         device: str = "auto") -> list[list[DeepSpeedRankResult]]:
    """Several configurations in ONE launch (DeepSpeed start-up costs ~10 s per launch).

    ``runs``: [{"ds_config": path | JSON text | dict, "precision"?: str, "micro_batch"?: int,
    "grad_accum"?: int, "finetune"?: FineTune (LoRA adapters + frozen base, runtime/lora.py),
    "spec"?: a ModelSpec for this run instead of ``spec`` (several models in one launch),
    "checkpointing"?: "none" | "full" (the runtime model's layers under ``torch.utils.checkpoint``)},
    ...]; every config is validated before anything starts. Returns, per
    run, one ``DeepSpeedRankResult`` per rank (a failed run has ``failure`` set on its ranks).
    """
    if nproc < 1 or steps < 1 or warmup < 0:
        raise InputError(f"DeepSpeed run: nproc={nproc}, steps={steps}, warmup={warmup}: "
                         "expected nproc >= 1, steps >= 1, warmup >= 0")
    dev, _backend = select_device(nproc, device)
    jobs = []
    for i, run in enumerate(runs):  # zeroplan's own validation first: a bad config never reaches DeepSpeed
        run_spec = run.get("spec") or spec
        cfg, prec, adamw = prepare_ds_config(run["ds_config"], nproc=nproc, micro_batch=run.get("micro_batch"),
                                             grad_accum=run.get("grad_accum"), precision=run.get("precision"),
                                             hidden_size=getattr(run_spec, "hidden_size", None), device=dev)
        jobs.append({"name": f"run{i}", "ds_config": cfg, "precision": prec, "steps": warmup + steps,
                     "seq_len": seq_len, "spec": run_spec, "adamw": adamw, "memory_step": warmup + steps - 1,
                     "device": dev, "memory_from_step": warmup, "finetune": run.get("finetune"),
                     "checkpointing": run.get("checkpointing", "none")})
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
