"""The report's data: plans at the chosen cluster, sweeps over GPUs and nodes, the recommendation.

:class:`ReportData` is what ``zeroplan report --json`` prints (``model_dump(mode="json")``) and
what the HTML and terminal charts are drawn from. Its fields:

- ``model``, ``cluster``, ``training``, ``comm_model``, ``mfu``, ``assumptions``, ``notes``,
  ``inputs`` (the options as given), ``max_nodes``: as in ``zeroplan estimate --json``;
- ``plans``: one entry per evaluated option at the chosen cluster: ``label``, ``stage``,
  ``offload_optimizer``, ``offload_param``, ``memory`` (per-GPU bytes: ``params``, ``gradients``,
  ``optimizer_states``, ``model_states``, ``buffers``, ``activations``, ``overhead``, ``peak``: the
  Plan's, model states in steady state), ``memory_at_peak`` (per-GPU bytes by category live in
  the peak phase, plus ``overhead``; they add up to ``peak``: what the bars show), ``peak_phase``, ``peak_reason``, ``fits``, ``headroom_bytes``, ``comm_bytes_per_gpu_per_step``,
  ``time`` (seconds: ``compute_s``, ``comm_s``, ``exposed_best_s``, ``exposed_worst_s``, ``exposed_s``,
  ``pcie_s``, ``cpu_optimizer_s``, ``gpu_optimizer_s``, ``nvme_s``, ``step_time_s``, ``step_time_best_s``,
  ``step_time_worst_s``; ``parts``: the time chart's segments by key (``compute``, ``exposed_comm``,
  ``gpu_optimizer``, ``pcie``, ``cpu_optimizer``, ``nvme`` add up to the estimate, ``worst_extra`` to the
  no-overlap bracket); ``comm_share`` (0–1), ``tokens_per_s``) or null without a hardware profile;
- ``memory_sweep``: ``gpus_per_node``, ``gpus`` (1, 2, 4, … up to max_nodes × GPUs per node),
  ``series``: per stage 0–3 ``stage``, ``label``, ``offload_optimizer``, ``offload_param``,
  ``model_states``, ``peak`` (per-GPU bytes, one per entry of ``gpus``), ``fits``;
- ``time_sweep`` (null without a hardware profile): ``gpus_per_node``, ``nodes`` (1, 2, 4, …
  max_nodes), ``gpus``, ``series``: per stage ``stage``, ``label``, ``step_time_s``,
  ``step_time_best_s``, ``step_time_worst_s``, ``compute_time_s``, ``comm_share``,
  ``tokens_per_s`` (one per entry of ``nodes``);
- ``recommendation`` (null without a hardware profile): what ``zeroplan recommend`` chooses for
  the same inputs: ``chosen`` (its Candidate with a ``label``, or null when nothing fits),
  ``explanation``, ``warnings`` (sentences) and ``explanation_reasons``, ``warning_reasons`` (the
  same as templates with their quantities and units).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pydantic import BaseModel, PrivateAttr

from zeroplan._util import InputError
from zeroplan.core.inputs import PlanInputs
from zeroplan.core.plan import ClusterSummary, EstimateResult, ModelSummary, Plan, evaluate
from zeroplan.report.charts import TIME_PARTS, memory_at_peak, stage_label, time_parts

__all__ = ["ReportData", "build_report_data", "recommendation_summary", "sweep_evaluations", "powers_of_two",
           "SWEEP_STAGES", "MAX_SWEEP_NODES"]

SWEEP_STAGES = (0, 1, 2, 3)
MAX_SWEEP_NODES = 4096


class ReportData(BaseModel):
    """The report (module docstring). ``estimate`` is the EstimateResult it was built from (not dumped)."""

    model: ModelSummary
    cluster: ClusterSummary
    training: dict[str, Any]
    comm_model: str
    mfu: Optional[float]
    assumptions: list[str]
    notes: list[str]
    inputs: dict[str, Any]
    max_nodes: int
    plans: list[dict[str, Any]]
    memory_sweep: dict[str, Any]
    time_sweep: Optional[dict[str, Any]]
    recommendation: Optional[dict[str, Any]]
    _estimate: Optional[EstimateResult] = PrivateAttr(default=None)

    @property
    def estimate(self) -> EstimateResult | None:
        """The EstimateResult at the chosen cluster (its Plans draw the terminal charts)."""
        return self._estimate


def recommendation_summary(rec: Any) -> dict[str, Any]:
    """The ``recommendation`` entry of the report: the chosen Candidate (with its label), the
    explanation and warnings as sentences and as reasons."""
    return {
        "chosen": None if rec.chosen is None else {"label": rec.chosen.label(), **rec.chosen.model_dump(mode="json")},
        "explanation": list(rec.explanation), "warnings": list(rec.warnings),
        "explanation_reasons": [r.model_dump(mode="json") for r in rec.explanation_reasons],
        "warning_reasons": [r.model_dump(mode="json") for r in rec.warning_reasons],
    }


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … ≤ limit, plus ``limit`` itself when it is not a power of two."""
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    if out[-1] != limit:
        out.append(limit)
    return out


def _plan_summary(p: Plan) -> dict[str, Any]:
    m = p.memory
    t = p.time
    return {
        "label": stage_label(p),
        "stage": p.stage,
        "offload_optimizer": p.offload_optimizer,
        "offload_param": p.offload_param,
        "memory": {k: int(getattr(m, k)) for k in ("params", "gradients", "optimizer_states", "model_states",
                                                     "buffers", "activations", "overhead", "peak")},
        "memory_at_peak": {**memory_at_peak(p), "peak": int(m.peak)},
        "peak_phase": m.peak_phase,
        "peak_reason": m.peak_reason,
        "fits": p.fits,
        "headroom_bytes": p.headroom_bytes,
        "host_memory_per_node": int(p.host_memory_per_node),
        "host_ram_per_node_bytes": p.host_ram_per_node_bytes,
        "host_fits": p.host_fits,
        "comm_bytes_per_gpu_per_step": int(p.comm.bytes_per_gpu_per_step),
        "time": None if t is None else {
            "compute_s": t.compute_time_s,
            "comm_s": t.comm_time_s,
            "exposed_best_s": t.exposed_time_s["best"],
            "exposed_worst_s": t.exposed_time_s["worst"],
            "exposed_s": t.exposed_time_s.get("estimate", t.exposed_time_s["worst"]),
            "pcie_s": t.pcie_time_s,
            "cpu_optimizer_s": t.cpu_optimizer_time_s,
            "gpu_optimizer_s": t.gpu_optimizer_time_s,
            "nvme_s": t.nvme_time_s,
            "host_bound_s": t.host_bound_s,
            "parts": {part.key: v for part, v in zip(TIME_PARTS, time_parts(t))},  # seconds by TIME_PARTS key
            "step_time_s": t.step_time_s,
            "step_time_best_s": t.step_time_best_s,
            "step_time_worst_s": t.step_time_worst_s,
            "comm_share": t.comm_share,
            "tokens_per_s": t.tokens_per_s,
        },
    }


def build_report_data(
    result: EstimateResult,
    inp: PlanInputs,
    *,
    max_nodes: int,
    comm_model: str,
    mfu: float | None,
    inputs: dict[str, Any],
    recommendation: dict[str, Any] | None,
    on_step: Callable[[], None] | None = None,
) -> ReportData:
    """The report data for an estimate ``result`` and its PlanInputs.

    Evaluates every stage 0–3 (with the run's offload / DeepSpeed settings) at 1, 2, 4, … up to
    ``max_nodes`` × GPUs per node GPUs, and, with a hardware profile, at 1, 2, 4, … ``max_nodes``
    whole nodes. ``recommendation`` is :func:`recommendation_summary` of the recommendation for the
    same inputs (None without hardware). ``on_step`` is called after each evaluation (progress bars).
    """
    if not 1 <= max_nodes <= MAX_SWEEP_NODES:
        raise InputError(f"--max-nodes {max_nodes} must be between 1 and {MAX_SWEEP_NODES}")
    gpn = int(inp.gpus_per_node)
    gpus = powers_of_two(max_nodes * gpn)
    nodes = powers_of_two(max_nodes) if inp.hardware is not None else []
    cache: dict[tuple[int, int, int], Plan] = {}

    def plan(stage: int, n_gpus: int, per_node: int) -> Plan:
        key = (stage, n_gpus, per_node)
        if key not in cache:
            cache[key] = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(stage), n_gpus=n_gpus, finetune=inp.finetune,
                                  gpus_per_node=per_node, hardware=inp.hardware, comm_model=comm_model, mfu=mfu)
            if on_step is not None:
                on_step()
        return cache[key]

    mem_series = []
    for s in SWEEP_STAGES:
        plans = [plan(s, g, min(gpn, g)) for g in gpus]
        mem_series.append({
            "stage": s, "label": stage_label(plans[0]), "offload_optimizer": plans[0].offload_optimizer,
            "offload_param": plans[0].offload_param,
            "model_states": [int(p.memory.model_states) for p in plans],
            "peak": [int(p.memory.peak) for p in plans],
            "fits": [p.fits for p in plans],
        })
    time_sweep = None
    if nodes:
        t_series = []
        for s in SWEEP_STAGES:
            plans = [plan(s, n * gpn, gpn) for n in nodes]
            t_series.append({
                "stage": s, "label": stage_label(plans[0]),
                "step_time_s": [p.time.step_time_s for p in plans],
                "step_time_best_s": [p.time.step_time_best_s for p in plans],
                "step_time_worst_s": [p.time.step_time_worst_s for p in plans],
                "compute_time_s": [p.time.compute_time_s for p in plans],
                "comm_share": [p.time.comm_share for p in plans],
                "tokens_per_s": [p.tokens_per_s for p in plans],
            })
        time_sweep = {"gpus_per_node": gpn, "nodes": nodes, "gpus": [n * gpn for n in nodes], "series": t_series}
    notes = list(dict.fromkeys(n for p in result.stages for n in p.notes))
    data = ReportData(
        model=result.model, cluster=result.cluster, training=result.training, comm_model=result.comm_model,
        mfu=mfu, assumptions=list(result.assumptions), notes=notes, inputs=dict(inputs), max_nodes=max_nodes,
        plans=[_plan_summary(p) for p in result.stages],
        memory_sweep={"gpus_per_node": gpn, "gpus": gpus, "series": mem_series},
        time_sweep=time_sweep, recommendation=recommendation,
    )
    data._estimate = result
    return data


def sweep_evaluations(inp: PlanInputs, max_nodes: int) -> int:
    gpn = int(inp.gpus_per_node)
    keys = {(g, min(gpn, g)) for g in powers_of_two(max_nodes * gpn)}
    if inp.hardware is not None:
        keys |= {(n * gpn, gpn) for n in powers_of_two(max_nodes)}
    return len(keys) * len(SWEEP_STAGES)
