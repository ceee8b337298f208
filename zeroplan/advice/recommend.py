"""``recommend``: search ZeRO stage × offload × micro-batch × checkpointing × buckets, rank, explain.

The decision frame (the seed article): **capacity first** — only configurations whose peak per
GPU, host RAM per node and NVMe per node fit are candidates — **then match the stage to the
network** — among those, rank by useful throughput, preferring the lower stage and no offload
when they are about as fast.

Search space (per ZeRO stage):

- optimizer offload ``none | cpu | nvme`` (stages 1–3) and parameter offload ``none | cpu | nvme``
  (stage 3 only, and only together with an optimizer offload at least as far away: parameters are
  2–4 bytes per element, optimizer states 12–16, so offloading parameters while keeping the
  optimizer on the GPU is never the better trade);
- micro-batch ``1, 2, 4, …`` up to the largest that fits (capped by ``max_micro_batch``), or the
  one the user fixed;
- activation checkpointing ``none | selective | full`` (``selective`` is skipped where it keeps
  the same bytes as ``none``, e.g. with flash attention);
- ``reduce_bucket_size`` 5e7, 2e8, 5e8 elements (plus the base config's value); stage 3 also
  ``stage3_prefetch_bucket_size`` (the base value and 1e7) and, on more than one node, hpZ
  (``zero_hpz_partition_size`` = GPUs per node).

Constraints: peak per GPU <= GPU memory × (1 − headroom); host RAM per node <= the profile's host
RAM × (1 − headroom); NVMe per node <= the profile's NVMe capacity.

**Useful throughput** (what is ranked): global training tokens per second of wall-clock time =
micro_batch × seq_len × grad_accum × n_gpus / step_time, with step_time = compute (6·Ψ_active
FLOPs per token, 8· with full recomputation, over peak FLOP/s × MFU) + exposed communication (the
mean of the best- and worst-case overlap, core/timing.py) + offload PCIe transfers. Recomputed
forward passes and offload traffic are cost, never work: a token counts once.

Ranking: (1) fit; (2) if some no-offload configuration reaches ≥ 50% of the best offload
configuration's useful throughput, offload configurations are dropped; (3) every remaining
configuration within 5% of the best useful throughput (the model's noise) is "as fast"; among
those the lowest stage wins, then no offload, then less checkpointing, then the higher throughput,
then the fewest changes from DeepSpeed's defaults (or the user's base config).

Speed: ``evaluate()`` rebuilds the parameter layout and the collective ledger on every call
(~60 ms for a 405B model on 512 GPUs). The sweep evaluates the same core functions but shares what
does not change: one layout per persistence setting, one ``memory_for_stage`` call per
(stage, offload, buckets, hpZ) with activations taken out (activations are exactly linear in the
micro-batch), one collective ledger per (stage, buckets, hpZ) (collectives do not depend on
offload; the PCIe transfers do not depend on buckets), and the α–β step time per micro-batch.
Micro-batches stop at the first that does not fit. The chosen configuration is then re-evaluated
with ``evaluate()``, whose numbers are the ones reported; tests check the sweep against
``evaluate()`` byte for byte.

Where each part lives (advice/): ``recommend_models`` (constants, ``Candidate``, ``StageSummary``,
``Recommendation``, ``candidate_zero``), ``recommend_sweep`` (the shared evaluation: ``_Family``,
``_Sweep``), ``recommend_search`` (the grid and the walk, ``nodes_needed``), ``recommend_rank``
(the ranking, the alternatives table, the per-stage summaries), ``recommend_explain`` (the
sentences); around one search, driven by the API: ``recommend_finetune`` (``--method any`` /
``--lora-ranks``: one search per method and rank, and the choice between them), ``global_batch``
(``--global-batch`` → gradient accumulation) and ``peft_settings`` (the PEFT / Trainer sidecar). This module validates the options, runs them in order and re-exports the models, so
``from zeroplan.advice.recommend import Recommendation, candidate_zero, recommend`` keeps working.

Imports: module level only; nothing here imports torch or rich.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from zeroplan._util import InputError
from zeroplan.advice.alternatives import AdviceContext, is_ethernet
from zeroplan.advice.recommend_explain import explain
from zeroplan.advice.recommend_models import (
    BUCKET_SIZES, CKPT_ORDER, NOISE, OFFLOAD_RATIO, PREFETCH_SMALL, USEFUL_THROUGHPUT, Candidate,
    Recommendation, StageSummary, candidate_zero,
)
from zeroplan.advice.recommend_rank import alternatives, choose, stage_summaries
from zeroplan.advice.recommend_search import (
    Limits, checkpointings, micro_batches, nodes_needed, search, search_grid,
)
from zeroplan.advice.recommend_sweep import _Sweep  # tests/bench/bench_recommend.py patches R._Sweep
from zeroplan.core.inputs import PlanInputs, zero_for_stage
from zeroplan.core.plan import ClusterSummary, Plan, evaluate, model_summary, training_summary
from zeroplan.specs.deepspeed_config import ABSENT, build_ds_config, diff_ds_configs

__all__ = [
    "Candidate",
    "StageSummary",
    "Recommendation",
    "recommend",
    "candidate_zero",
    "is_ethernet",
    "USEFUL_THROUGHPUT",
    "NOISE",
    "OFFLOAD_RATIO",
    "BUCKET_SIZES",
    "PREFETCH_SMALL",
]

def _validated_stages(inputs: Any, *, headroom: float, comm_model: str, mfu: float | None,
                      max_micro_batch: int | None, micro_batch: int | None, checkpointing: str | None,
                      stages: list[int] | None) -> list[int]:
    """The options checked (InputError: exit 2); the stages to search, sorted."""
    if inputs.hardware is None:
        raise InputError("recommend needs a hardware profile: pass --hardware NAME (see `zeroplan profiles list`) or a profile TOML path")
    if not (0 <= headroom < 1):
        raise InputError(f"--headroom {headroom} must be in [0, 1): the fraction of GPU memory and host RAM kept free")
    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {comm_model!r} is unknown; expected deepspeed or paper")
    if mfu is not None and not (1e-3 <= mfu <= 1):
        raise InputError(f"--mfu {mfu} must be in [0.001, 1]")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise InputError(f"--max-micro-batch {max_micro_batch} must be a positive integer")
    if micro_batch is not None and micro_batch < 1:
        raise InputError(f"--micro-batch {micro_batch} must be a positive integer")
    if checkpointing is not None and checkpointing not in CKPT_ORDER:
        raise InputError(f"--checkpointing {checkpointing!r} is unknown; expected none, selective or full")
    stages = sorted(set(stages)) if stages else [0, 1, 2, 3]
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise InputError(f"--stage {s} is not a ZeRO stage; expected 0, 1, 2 or 3")
    return stages


def recommend(
    inputs: Any,
    *,
    headroom: float = 0.10,
    comm_model: str = "deepspeed",
    mfu: float | None = None,
    max_micro_batch: int | None = None,
    micro_batch: int | None = None,
    checkpointing: str | None = None,
    stages: list[int] | None = None,
    allow_nvme: bool = True,
    top: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Recommendation:
    """Search, rank and explain (see module docstring). ``inputs`` is a core.inputs.PlanInputs.

    ``micro_batch`` fixes the micro-batch (else 1, 2, 4, … up to the largest that fits, at most
    ``max_micro_batch``, default 1024); ``checkpointing`` fixes the policy (else all three);
    ``stages`` restricts the stages (default 0–3). ``progress(done, total)`` is called after each
    (stage, offload, buckets, hpZ) point.
    """
    stages = _validated_stages(inputs, headroom=headroom, comm_model=comm_model, mfu=mfu,
                               max_micro_batch=max_micro_batch, micro_batch=micro_batch,
                               checkpointing=checkpointing, stages=stages)
    hw = inputs.hardware
    # The search decides offload itself: start from the base config without the user's offload override.
    inp = inputs
    if inp.offload_optimizer is not None or inp.offload_param is not None:
        inp = replace(inp, offload_optimizer=None, offload_param=None)
    base_zeros = {s: zero_for_stage(inp, s) for s in (0, 1, 2, 3)}
    sw = _Sweep(inp, comm_model=comm_model, mfu=mfu, base_zeros=base_zeros)
    gpu_mem = int(hw.gpu.memory_bytes)
    lim = Limits(gpu_mem=gpu_mem, usable_gpu=int(gpu_mem * (1 - headroom)),
                 usable_host=int(hw.node.host_ram_bytes * (1 - headroom)), nvme_cap=int(hw.node.nvme_capacity_bytes))
    nvme_ok = allow_nvme and lim.nvme_cap > 0

    # ---- search ----
    mbs = micro_batches(micro_batch, max_micro_batch)
    ckpts = checkpointings(sw, checkpointing)
    points = search_grid(sw, inp, stages, base_zeros, nvme_ok=nvme_ok)
    found = search(sw, points, mbs, ckpts, lim, progress)

    # ---- rank ----
    fit = [c for c, _ in found.cands]
    dev = {id(c): d for c, d in found.cands}
    chosen = choose(fit, dev)
    alts = alternatives(fit, dev, chosen, top)
    summaries = stage_summaries(sw, inp, stages, found, fit)

    # ---- the chosen plan, by evaluate() ----
    plan, ctx, ds_cfg, diff = _chosen_plan(inp, sw, base_zeros, chosen, comm_model=comm_model, mfu=mfu,
                                           headroom=headroom)
    rec = Recommendation(
        model=model_summary(inp.spec),
        cluster=ClusterSummary(n_gpus=inp.n_gpus, nodes=inp.nodes, gpus_per_node=inp.gpus_per_node,
                               hardware=hw.name, gpu=hw.gpu.name, gpu_memory_bytes=gpu_mem),
        training=training_summary(inp.training) | {"micro_batch": micro_batch or "searched",
                                                   "checkpointing": checkpointing or "searched"},
        comm_model=comm_model, mfu=mfu, headroom=headroom, usable_gpu_bytes=lim.usable_gpu,
        usable_host_bytes_per_node=lim.usable_host, nvme_capacity_bytes_per_node=lim.nvme_cap,
        searched=found.searched, chosen=chosen, plan=plan, alternatives=alts, stages=summaries,
        assumptions=list(inp.assumptions), ds_config=ds_cfg, ds_config_diff=diff,
    )
    lean_zero = None
    if chosen is None:
        for s in [x for x in (3, 2, 1) if x in stages]:
            rec.nodes_needed[f"ZeRO-{s}"] = nodes_needed(
                inp, base_zeros, s, usable_gpu=lim.usable_gpu, usable_host=lim.usable_host, min_mb=mbs[0],
                comm_model=comm_model)
        lean_zero = _leanest_zero(base_zeros, max(stages))

    # ---- explain ----
    explain(rec, inp, hw, micro_batch_fixed=micro_batch, ckpts=ckpts, ctx=ctx, lean_zero=lean_zero)
    return rec


def _chosen_plan(inp: PlanInputs, sw: _Sweep, base_zeros: dict[int, Any], chosen: Candidate | None, *,
                 comm_model: str, mfu: float | None, headroom: float,
                 ) -> tuple[Plan | None, AdviceContext | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
    """The chosen configuration re-evaluated by ``evaluate()`` (the reported numbers), its advice
    context, its DeepSpeed config and the diff against ``--ds-config`` (None when nothing fits)."""
    if chosen is None:
        return None, None, None, None
    zero = candidate_zero(base_zeros[chosen.stage], offload_optimizer=chosen.offload_optimizer,
                          offload_param=chosen.offload_param, reduce_bucket_size=chosen.reduce_bucket_size,
                          prefetch_bucket_size=chosen.prefetch_bucket_size,
                          hpz_partition_size=chosen.hpz_partition_size)
    ctx = AdviceContext(inp=inp, zero=zero, training=sw.training(chosen.micro_batch, chosen.checkpointing),
                        comm_model=comm_model, mfu=mfu, min_headroom=headroom)
    plan = evaluate(model=inp.spec, training=sw.training(chosen.micro_batch, chosen.checkpointing), zero=zero,
                    n_gpus=inp.n_gpus, gpus_per_node=inp.gpus_per_node, hardware=inp.hardware,
                    comm_model=comm_model, mfu=mfu, finetune=inp.finetune)
    opt_type = None if inp.ds is not None else (
        "Adam" if inp.training.optimizer.name == "adam" else
        "AdamW" if inp.training.optimizer.name == "adamw" else None)
    ds_cfg = build_ds_config(zero, precision=inp.training.precision.name, micro_batch=chosen.micro_batch,
                             grad_accum=inp.training.grad_accum, world_size=inp.n_gpus,
                             optimizer_type=opt_type, base=inp.ds.raw if inp.ds is not None else None)
    diff = None
    if inp.ds is not None:
        diff = [{"key": k, "old": _jsonable(a), "new": _jsonable(b)} for k, a, b in diff_ds_configs(inp.ds.raw, ds_cfg)]
    return plan, ctx, ds_cfg, diff


def _leanest_zero(base_zeros: dict[int, Any], top_s: int) -> Any:
    """The highest searched stage without offload, small buckets: what "nothing fits" evaluates."""
    return candidate_zero(base_zeros[top_s], offload_optimizer="none", offload_param="none",
                          reduce_bucket_size=BUCKET_SIZES[0],
                          prefetch_bucket_size=min(PREFETCH_SMALL, base_zeros[top_s].prefetch_bucket_size)
                          if top_s == 3 else None)


def _jsonable(v: Any) -> Any:
    return None if v is ABSENT else v
