"""`zeroplan validate`'s deepspeed check: REAL DeepSpeed as rank 0 of a virtual ``n``-GPU job.

torch's fake process group answers every collective, so rank 0 allocates on real tensors exactly
what it would in an ``n``-rank job; its model states, peak allocated and peak reserved are set
beside the plan for ``n`` GPUs, at ZeRO stages 2 and 3.
"""

from __future__ import annotations

import os
from typing import Any

from zeroplan.bench.validate_rows import op_build_failure, row
from zeroplan.bench.validate_rows import skip_row as _skip

__all__ = ["deepspeed_stages", "measure_deepspeed_virtual"]


def measure_deepspeed_virtual(device: str, spec: Any, *, n: int, stage: int, precision: str, micro_batch: int,
                              seq_len: int, plan: Any = None, steps: int = 3) -> list[dict[str, Any]]:
    """REAL DeepSpeed as rank 0 of ``n`` ranks on the fake process group (needs a process with
    no torch.distributed group yet; ``zeroplan validate`` is one)."""
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001
        return [_skip("deepspeed", f"DeepSpeed is not importable: {exc}"[:300])]
    import torch
    import torch.distributed as dist

    from zeroplan.bench.deepspeed_engine import (_collect_storages, _disable_shm_comm_op, _memory_by_category,
                                                  make_ds_config)
    from zeroplan.runtime.memory import NullMeter, StorageTracker
    from zeroplan.runtime.simulate import _private_apis

    _, FakeStore = _private_apis()
    if dist.is_initialized():
        return [_skip("deepspeed", "torch.distributed is already initialised in this process")]
    from deepspeed.utils import groups

    # DeepSpeed caches its groups in module globals (utils/groups.py: _WORLD_GROUP, _DATA_PARALLEL_GROUP,
    # ...); a second run after destroy_process_group would find the dead ones ("Group ... is not
    # registered"), so they go back to what they were before this run
    cached = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(groups).items()
              if k.startswith("_") and k[1:2].isupper()}
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # DeepSpeed's launcher contract
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _disable_shm_comm_op()
    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    try:
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
        cfg = make_ds_config(stage=stage, precision=precision, micro_batch=micro_batch, grad_accum=1,
                             comms_logger=False)
        # on CPU every tensor storage is counted as it lives and dies (runtime.memory.StorageTracker): the
        # peak a CUDA allocator would report, less the cuBLAS workspaces and the allocator's rounding
        tracker = StorageTracker() if device != "cuda" else NullMeter()
        with tracker:
            engine = _train(deepspeed, torch, spec, cfg, device, micro_batch, seq_len, steps, tracker)
        states = _memory_by_category(_collect_storages(engine))
        mem = getattr(plan, "memory", None)
        # after the step DeepSpeed has freed the gradient partition: compare what persists
        pred_states = None if mem is None else mem.params + mem.optimizer_states
        meas_states = sum(states.get(c, 0) for c in ("params", "optimizer_states"))
        rows = [row("deepspeed", f"rank 0 of {n}: params + optimizer states (stage {stage}, {precision})",
                    pred_states, meas_states,
                    note=f"real DeepSpeed {deepspeed.__version__} on the fake process group, {device}")]
        if device != "cuda":
            live_peak = max(v["peak"] for v in tracker.phase_peaks().values())
            rows.append(row("deepspeed", f"rank 0 of {n}: peak live tensor bytes (stage {stage})",
                            getattr(mem, "allocated", None), live_peak,
                            note="every tensor storage counted while it lives; a GPU adds the cuBLAS workspaces "
                                 "(core/cublas_workspace.py) and the allocator's 512-byte rounding"))
        if device == "cuda":  # the plan's allocated and reserved, not its peak (which adds context and NCCL)
            torch.cuda.synchronize()
            rows.append(row("deepspeed", f"rank 0 of {n}: peak allocated (stage {stage})", getattr(mem, "allocated", None),
                            int(torch.cuda.max_memory_allocated())))
            rows.append(row("deepspeed", f"rank 0 of {n}: peak reserved (stage {stage})", getattr(mem, "reserved", None),
                            int(torch.cuda.max_memory_reserved())))
        if hasattr(engine, "destroy"):
            engine.destroy()
        return rows
    finally:
        dist.destroy_process_group()
        for k, v in cached.items():
            setattr(groups, k, v)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train(deepspeed: Any, torch: Any, spec: Any, cfg: dict, device: str, micro_batch: int, seq_len: int,
           steps: int, tracker: Any) -> Any:
    """Build the model and DeepSpeed's engine, run ``steps`` steps; peaks are reset before the last one."""
    from zeroplan.runtime.model import build_model

    opt = None
    if device == "cuda":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}  # FusedAdam, as users run it
    model = build_model(spec, "fp32", "cpu", seed=0)
    if device != "cuda":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # no step temporaries, as FusedAdam
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for s in range(steps):
        last = s == steps - 1
        if last and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if last:
            tracker.reset_peaks()  # the CPU tracker's; a no-op on CUDA (NullMeter)
        ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len)).to(engine.device)
        tracker.phase = "forward"
        loss = engine(ids)
        tracker.phase = "backward"
        engine.backward(loss)
        tracker.phase = "step"
        engine.step()
    return engine


def deepspeed_stages(device: str, spec: Any, *, n: int, precision: str, micro_batch: int,
                      seq_len: int, hardware: Any = None) -> list[dict[str, Any]]:
    """Real DeepSpeed as rank 0 of ``n`` at stage 2 and stage 3, each against the plan for it (on
    ``hardware``: None plans the tensors alone, as a CPU run measures them); a failed stage is a row of
    its own."""
    from zeroplan.bench.validate import _zero_config, predict

    rows: list[dict[str, Any]] = []
    for stage in (2, 3):
        plan = predict(spec, _zero_config(stage, None), precision=precision, micro_batch=micro_batch,
                       seq_len=seq_len, grad_accum=1, n=n, hardware=hardware)
        try:
            rows += measure_deepspeed_virtual(device, spec, n=n, stage=stage, precision=precision,
                                              micro_batch=micro_batch, seq_len=seq_len, plan=plan)
        except Exception as exc:  # noqa: BLE001 - the other stage's rows stay
            rows.append(row("deepspeed", f"stage {stage} failed", None, None, unit="", note=op_build_failure(exc)))
    return rows
