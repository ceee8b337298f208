"""The ``bench zero`` runs: the bundled engine on spawned or torchrun ranks, the real DeepSpeed engine,
and the simulated trace, each compared stage by stage into a JSON-able report (split out of
``bench/validate.py``)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from zeroplan._util import InputError
from zeroplan.bench.limits import check_rank_bytes, ranks_on_this_host
from zeroplan.bench.zero_compare import _row, compare, tolerances
from zeroplan.bench.zero_inputs import scale_buckets, user_zero_keys
from zeroplan.bench.zero_measure import _group, _preload_dispatch, _rank_entry
from zeroplan.bench.zero_predict import _zero_config, deepspeed_optimizer_impl, engine_optimizer_impl, predict


def run_bench_zero(spec: Any, stages: list[int], *, nproc: int, precision: str, ds: Any = None,
                   micro_batch: int = 2, seq_len: int = 32, grad_accum: int = 1, steps: int = 2, warmup: int = 2,
                   comm_model: str = "deepspeed", hardware: Any = None, backend: str = "gloo",
                   memory_limit_bytes: int | None = None, timeout_s: float = 300.0,
                   tolerance: dict[str, float] | None = None, zero_overrides: dict[str, Any] | None = None,
                   fault: dict[str, Any] | None = None, checkpointing: str = "none",
                   bucket_scale: float | None = None, scaled_from: Any = None, finetune: Any = None) -> dict:
    """Measure and compare every stage; returns the JSON-able report (``ok`` = all within tolerance).

    ``bucket_scale``: multiply the bucket sizes the config does not set by this factor
    (``zero_inputs.scale_buckets``); None keeps DeepSpeed's absolute defaults.
    ``scaled_from``: the full model spec the run was scaled from (named in the report).
    ``finetune``: a ``FineTune`` (LoRA adapters, frozen base) applied to the model and the plan.
    """
    from zeroplan.runtime.launch import RankError, join_torchrun, spawn, under_torchrun

    tol = tolerances(tolerance)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda" and not under_torchrun():
        import torch

        if nproc > torch.cuda.device_count():  # rank % device_count would put two ranks on one GPU
            raise InputError(f"--nproc {nproc}: NCCL needs one GPU per rank, this machine has "
                             f"{torch.cuda.device_count()}")
    common = {"precision": precision, "micro_batch": micro_batch, "seq_len": seq_len, "grad_accum": grad_accum,
              "steps": steps, "comm_model": comm_model, "memory_limit_bytes": memory_limit_bytes, "fault": fault,
              "checkpointing": checkpointing, "finetune": finetune}
    runs, buckets = _stage_runs(stages, ds, zero_overrides, bucket_scale, warmup, common)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc  # torchrun has checked the variables
    plans = [predict(spec, runs[k]["zero"], precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                     grad_accum=grad_accum, n=world, comm_model=comm_model, hardware=hardware,
                     checkpointing=checkpointing, finetune=finetune, optimizer_impl=engine_optimizer_impl(device))
             for k in range(len(stages))]
    check_rank_bytes(max(p.memory.peak for p in plans), device=device, ranks=ranks_on_this_host(nproc),
                     what=f"--micro-batch {micro_batch:,} × --seq-len {seq_len:,} on {spec.params:,} parameters: "
                          "the planner's peak for this run is", lower="--micro-batch, --seq-len, --layers or --hidden",
                     gpu_free=False)  # on a GPU an OOM is a result: the report compares it with the prediction
    failures = []
    _preload_dispatch()
    try:
        if under_torchrun():
            per_rank = join_torchrun(_rank_entry, args=(spec, runs, device), backend=backend, timeout_s=timeout_s)
            if per_rank is None:
                return {"ok": True, "rank": int(os.environ.get("RANK", "0")), "non_zero_rank": True}
        else:
            per_rank = spawn(_rank_entry, nproc, args=(spec, runs, device), backend=backend, timeout_s=timeout_s)
    except RankError as exc:
        failures = [f.model_dump() for f in exc.failures]
        per_rank = None
    report: dict[str, Any] = {
        "model": {"name": spec.name, "params": spec.params, "layers": spec.num_layers, "hidden": spec.hidden_size,
                  "vocab": spec.vocab_size, "model_type": spec.model_type},
        "world_size": world, "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len,
        "grad_accum": grad_accum, "steps": steps, "warmup": warmup, "comm_model": comm_model, "backend": backend,
        "device": device, "checkpointing": checkpointing, "buckets": buckets, "bucket_scale": bucket_scale,
        "scaled_from": None if scaled_from is None else {"name": scaled_from.name, "params": scaled_from.params},
        "finetune": _finetune_summary(spec, finetune),
        "tolerance": tol, "stages": [], "failures": failures, "findings": [],
    }
    ok = not failures
    for k, st in enumerate(stages):
        zero, plan = runs[k]["zero"], plans[k]
        entry: dict[str, Any] = {"stage": st, "zero": zero.model_dump(mode="json", include={
            "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "overlap_comm", "contiguous_gradients", "param_persistence_threshold",
            "max_reuse_distance", "sub_group_size", "use_multi_rank_bucket_allreduce"}),
            "predicted_peak_bytes": plan.memory.peak, "predicted_peak_phase": plan.memory.peak_phase}
        if per_rank is None:
            entry["rows"] = []
            report["stages"].append(entry)
            continue
        measured = [per_rank[r][k] for r in range(len(per_rank))]
        ooms = [m for m in measured if "oom" in m]
        if ooms:
            finding = _oom_finding(st, ooms, plan)
            report["findings"].append(finding)
            entry["oom"] = finding
            entry["rows"] = []
            ok = False
            report["stages"].append(entry)
            continue
        rows = compare(plan, measured, model_state_tol=tol["model_state"], phase_tol=tol["phase_peak"],
                       collective_tol=tol["collective"], device=device, hardware=hardware)
        entry["rows"] = rows
        entry["ok"] = all(r["ok"] for r in rows)
        entry["losses"] = measured[0].get("losses")
        entry["host_bytes"] = measured[0].get("host_bytes", 0)
        ok = ok and entry["ok"]
        report["stages"].append(entry)
    report["ok"] = ok
    return report


def _stage_runs(stages: list[int], ds: Any, zero_overrides: dict[str, Any] | None, bucket_scale: float | None,
                warmup: int, common: dict[str, Any]) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """One run per stage (its ZeRO config: ``ds``, then the overrides, then the scaled buckets the user did
    not set; stage 3 warms up at least 2 steps) and the buckets that were scaled."""
    runs = []
    buckets: dict[str, dict[str, int]] = {}
    for st in stages:
        zero = _zero_config(st, ds)
        if zero_overrides:
            zero = zero.model_copy(update=zero_overrides)
        if bucket_scale is not None and bucket_scale < 1:
            zero, scaled = scale_buckets(zero, bucket_scale, user_zero_keys(ds) | set(zero_overrides or {}))
            buckets.update(scaled)
        runs.append({"zero": zero, **common, "warmup": max(warmup, 2 if st == 3 else warmup)})
    return runs, buckets


def _oom_finding(st: int, ooms: list[dict], plan: Any) -> dict:
    """The BENCH-OOM finding of a stage whose ranks ``ooms`` ran out of memory, against the plan."""
    o = ooms[0]["oom"]
    return {
        "rule": "BENCH-OOM", "severity": "error", "stage": st, "ranks": [m["rank"] for m in ooms],
        "phase": o["phase"], "where": o.get("where"), "message": (
            f"stage {st}: out of memory in {o['phase']}{' during the ' + o['where'] if o.get('where') else ''} "
            f"on rank(s) {', '.join(str(m['rank']) for m in ooms)} "
            f"({o['live_bytes']} bytes live + {_fmt_req(o)} requested > limit {o['limit_bytes']}); "
            f"predicted {o['phase']} peak {plan.memory.phases[o['phase']].peak} bytes, "
            f"predicted peak {plan.memory.peak} bytes ({plan.memory.peak_phase}: {plan.memory.peak_reason})"),
        "live_by_category": o["by_category"],
        "predicted_phase_peak_bytes": plan.memory.phases[o["phase"]].peak,
        "predicted_peak_bytes": plan.memory.peak,
    }


def run_deepspeed_bench(spec: Any, ds_config: str, stages: list[int], *, nproc: int, precision: str,
                        micro_batch: int, seq_len: int, grad_accum: int, steps: int, warmup: int,
                        hardware: Any = None, tolerance: dict[str, float] | None = None,
                        timeout_s: float = 900.0, finetune: Any = None) -> dict:
    """``bench zero --engine deepspeed``: the same model through DeepSpeed's real engine.

    Collectives are recorded by wrapping torch.distributed in every rank; model states are the
    persistent storages reachable from DeepSpeed's engine and optimizer (on CPU, offloaded
    states are counted with the rest, so the prediction adds the host side). Activations and
    transients are not visible without a CUDA allocator: phase peaks are compared on GPUs only.
    """
    try:
        # DeepSpeed logs to stdout at import ("Setting accelerator to CPU"); its logger keeps the
        # stream it was made with, so make it while stdout is stderr: `--json` stays parseable
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        raise InputError(f"--engine deepspeed needs DeepSpeed: pip install 'zeroplan[deepspeed]' ({exc})") from None
    from zeroplan.bench.deepspeed_engine import run_deepspeed_steps, select_device, steps_identical
    from zeroplan.specs.deepspeed_config import load_ds_config

    tol = tolerances(tolerance)
    ds = load_ds_config(ds_config, strict=True, micro_batch=micro_batch, grad_accum=grad_accum, world_size=nproc)
    stage = ds.zero.stage
    if stages and stages != [stage]:
        raise InputError(f"{ds_config}: --engine deepspeed runs the config's stage {stage}; drop --stage")
    device, backend = select_device(nproc)
    results = run_deepspeed_steps(spec, ds_config, nproc=nproc, steps=steps, warmup=max(2, warmup),
                                  micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                                  precision=precision, timeout_s=timeout_s, device=device, finetune=finetune)
    failures = [r.failure.model_dump() for r in results if r.failure is not None]
    report: dict[str, Any] = {
        "engine": "deepspeed",
        "model": {"name": spec.name, "params": spec.params, "layers": spec.num_layers, "hidden": spec.hidden_size,
                  "vocab": spec.vocab_size, "model_type": spec.model_type},
        "world_size": nproc, "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len,
        "grad_accum": grad_accum, "steps": steps, "warmup": max(2, warmup), "comm_model": "deepspeed",
        "backend": backend, "device": device, "finetune": _finetune_summary(spec, finetune),
        "tolerance": tol, "stages": [], "failures": failures, "findings": [],
    }
    plan = predict(spec, ds.zero, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                   grad_accum=grad_accum, n=nproc, comm_model="deepspeed", hardware=hardware, finetune=finetune,
                   optimizer_impl=deepspeed_optimizer_impl(device, "optimizer" in ds.raw))
    entry: dict[str, Any] = {"stage": stage, "predicted_peak_bytes": plan.memory.peak,
                             "predicted_peak_phase": plan.memory.peak_phase, "rows": []}
    if not failures:
        measured = []
        for r in results:
            last = r.records_by_step[-1] if r.records_by_step else []
            before = r.memory_before_step
            grads = before.get("gradients", 0)
            if stage <= 1:  # stages 0/1 hold the full gradients until the boundary
                grads = max(grads, r.memory_in_backward.get("gradients", 0))
            measured.append({"rank": r.rank, "collectives": _group(last), "steady": steps_identical(r),
                             "model_states": {"params": before.get("params", 0), "gradients": grads,
                                              "optimizer_states": before.get("optimizer_states", 0)}})
        entry["rows"] = compare(plan, measured, model_state_tol=tol["model_state"], phase_tol=tol["phase_peak"],
                                collective_tol=tol["collective"], include_host=True, device=device,
                                hardware=hardware)
        if finetune is not None:  # DeepSpeed's own objects: frozen parameters carry no gradient, no state
            fc = [r.frozen_check for r in results]
            entry["rows"].append(_row("frozen", "frozen parameters in ZeRO / optimizer groups", 0,
                                      sum(len(c.get("frozen_in_groups", [])) for c in fc), 0.0))
            entry["rows"].append(_row("frozen", "frozen parameters holding a gradient", 0,
                                      sum(len(c.get("frozen_with_grad", [])) for c in fc), 0.0))
            entry["rows"].append(_row("frozen", "AdamW exp_avg + exp_avg_sq elements (max rank)",
                                      None, max(c.get("optimizer_state_numel", 0) for c in fc), None))
        cm = [r.cuda_memory for r in results if r.cuda_memory]
        if cm:  # CUDA: the allocator's peaks over the measured steps, max over ranks (shown, not gated)
            entry["rows"].append(_row("phase_peak", "peak allocated (max_memory_allocated)", plan.memory.peak,
                                      max(c["max_allocated_bytes"] for c in cm), None))
            entry["rows"].append(_row("phase_peak", "peak reserved (max_memory_reserved)",
                                      getattr(plan.memory, "reserved", None),
                                      max(c["max_reserved_bytes"] for c in cm), None))
        if stage == 0 and precision == "fp32":
            entry["note"] = ("DeepSpeed trains fp32 without ZeRO on the parameters themselves (no separate fp32 "
                             "master, 16 B/param); zeroplan keeps the 20-byte baseline: optimizer states differ "
                             "by 4 B/param by design")
            for row in entry["rows"]:
                if row["name"] in ("optimizer_states", "model_states"):
                    row["ok"] = True
                    row["tolerance"] = None
        entry["ok"] = all(r["ok"] for r in entry["rows"])
    report["stages"].append(entry)
    report["ok"] = not failures and entry.get("ok", False)
    return report


def run_simulated_bench(spec: Any, stages: list[int], *, n: int, precision: str, ds: Any = None,
                        micro_batch: int = 1, seq_len: int = 128, grad_accum: int = 1,
                        comm_model: str = "deepspeed", hardware: Any = None,
                        tolerance: dict[str, float] | None = None) -> dict:
    """``bench zero --simulate``: per stage, trace one rank at world size ``n`` and compare with the plan."""
    from zeroplan.runtime.simulate import simulate_rank

    tol = tolerances(tolerance)
    report: dict[str, Any] = {
        "simulated": True,
        "model": {"name": spec.name, "params": spec.params, "layers": spec.num_layers, "hidden": spec.hidden_size,
                  "vocab": spec.vocab_size, "model_type": spec.model_type},
        "world_size": n, "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len,
        "grad_accum": grad_accum, "steps": 1, "comm_model": comm_model, "backend": "fake",
        "tolerance": tol, "stages": [], "failures": [], "findings": [],
    }
    ok = True
    for st in stages:
        zero = _zero_config(st, ds)
        measured = simulate_rank(spec, zero, n=n, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                                 grad_accum=grad_accum, comm_model=comm_model, steps=3 if st == 3 else 2)
        plan = predict(spec, zero, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                       grad_accum=grad_accum, n=n, comm_model=comm_model, hardware=hardware,
                       optimizer_impl=engine_optimizer_impl("cpu"))  # simulated on the CPU mimic
        rows = [r for r in compare(plan, [measured], model_state_tol=tol["model_state"], phase_tol=tol["phase_peak"],
                                   collective_tol=tol["collective"]) if r["kind"] != "step_time"]
        entry = {"stage": st, "rows": rows, "ok": all(r["ok"] for r in rows),
                 "predicted_peak_bytes": plan.memory.peak, "predicted_peak_phase": plan.memory.peak_phase,
                 "host_bytes": measured["host_bytes"]}
        ok = ok and entry["ok"]
        report["stages"].append(entry)
    report["ok"] = ok
    return report


def _finetune_summary(spec: Any, ft: Any) -> dict | None:
    """Counts of the fine-tuned run for the report (specs/finetune.py finetune_inventory)."""
    if ft is None:
        return None
    from zeroplan.specs.finetune import finetune_inventory

    inv = finetune_inventory(spec, ft)
    return {"method": ft.method, "lora_r": ft.lora.r if ft.lora else None,
            "lora_targets": list(ft.lora.targets) if ft.lora and not isinstance(ft.lora.targets, str)
            else (ft.lora.targets if ft.lora else None),
            "trainable": list(ft.trainable), "trainable_params": inv.trainable_params,
            "frozen_params": inv.frozen_params, "adapter_params": inv.adapter_params}


def _fmt_req(oom: dict) -> str:
    req = oom.get("requested_bytes")
    if req is None:
        return "?"
    return f"~{req}" if oom.get("requested_is_approximate") else str(req)
