"""A DeepSpeed rank's raw results read into ``DeepSpeedRankResult`` and summarised per step (split out of
``bench/deepspeed_engine.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.runtime.results import CollectiveRecord, RankFailure
from zeroplan.specs.collectives import OPS


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
