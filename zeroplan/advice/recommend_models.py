"""What ``recommend`` searches and returns: the search space's constants, one searched configuration
(``Candidate``), the per-stage summary and the ``Recommendation`` that ``zeroplan recommend --json``
prints, and ``candidate_zero`` (a configuration's ZeroConfig).

Imports: module level only (pydantic and zeroplan.core's plan summaries).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from zeroplan.advice.global_batch import GlobalBatch
from zeroplan.advice.reasons import Alternative, Reason
from zeroplan.core.plan import ClusterSummary, ModelSummary, Plan
from zeroplan.specs.finetune import FineTuneInventory

__all__ = [
    "Candidate",
    "StageSummary",
    "Recommendation",
    "candidate_zero",
    "USEFUL_THROUGHPUT",
    "NOISE",
    "OFFLOAD_RATIO",
    "BUCKET_SIZES",
    "PREFETCH_SMALL",
    "CKPT_ORDER",
    "NVME_PATH",
    "FineTuneVariant",
    "FineTuneSearch",
    "FINETUNE_RULE",
]

NOISE = 0.05  # configurations within 5% of the best useful throughput are "as fast"
OFFLOAD_RATIO = 0.5  # offload only when no-offload reaches < 50% of the best offload throughput
BUCKET_SIZES = (50_000_000, 200_000_000, 500_000_000)  # reduce_bucket_size, elements
PREFETCH_SMALL = 10_000_000  # stage3_prefetch_bucket_size for tight memory, elements
CKPT_ORDER = ("none", "selective", "full")
NVME_PATH = "/local_nvme"  # placeholder written into emitted configs; set it to the NVMe mount
USEFUL_THROUGHPUT = (
    "useful throughput = global training tokens per second = micro_batch × seq_len × grad_accum × "
    "n_gpus / step_time; step_time = compute (6 FLOPs per weight per token, 4 for frozen weights, + 2 per block "
    "weight with full recomputation, plus attention, at the GPU generation's achievable rate or --mfu) + the "
    "slowdown hidden communication costs compute + exposed communication (the overlap schedule) + offload PCIe, "
    "CPU optimizer and NVMe time. Recomputation and offload traffic are cost, not work."
)


class Candidate(BaseModel):
    """One searched configuration. Bytes are per GPU unless named per node; sizes in elements."""

    stage: int
    offload_optimizer: str
    offload_param: str
    micro_batch: int
    checkpointing: str
    reduce_bucket_size: int
    prefetch_bucket_size: int | None = None  # stage 3 only
    hpz_partition_size: int = 1
    peak_bytes: int
    gpu_memory_bytes: int
    headroom_bytes: int  # gpu_memory_bytes − peak_bytes
    host_per_node_bytes: int
    nvme_per_node_bytes: int
    fits: bool
    limit: str | None = None  # what does not fit: "gpu", "host", "nvme"
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # useful throughput (see USEFUL_THROUGHPUT)
    comm_share: float | None = None
    comm_bytes_per_gpu_per_step: int | None = None
    exposed_comm_s: float | None = None  # the overlap schedule's estimate (core/overlap.py)

    @property
    def offload(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"

    def offload_label(self) -> str:
        extra = []
        if self.offload_optimizer != "none":
            extra.append(f"optimizer→{self.offload_optimizer}")
        if self.offload_param != "none":
            extra.append(f"params→{self.offload_param}")
        return ", ".join(extra) or "no offload"

    def label(self) -> str:
        return f"ZeRO-{self.stage}" + (f" ({self.offload_label()})" if self.offload else "")


class StageSummary(BaseModel):
    stage: int
    fits: bool  # some configuration of this stage fits
    fits_without_offload: bool
    best: Candidate | None = None  # fastest fitting configuration of this stage
    leanest: Candidate  # smallest-peak configuration without offload
    leanest_dominant: str  # what dominates the leanest configuration's peak
    leanest_reason: str  # core's peak_reason for it


FINETUNE_RULE = (
    "the least approximate method that fits (full, else LoRA, else QLoRA); among its ranks the largest "
    f"within {NOISE:.0%} of the fastest fitting rank's useful throughput")


class FineTuneVariant(BaseModel):
    """One searched method (and rank): its best configuration, or its leanest when nothing fits."""

    label: str  # "full", "LoRA r=16", "QLoRA 4-bit r=16"
    method: str
    lora_r: int | None = None
    trainable_params: int
    fits: bool
    configuration: Candidate  # the chosen configuration, or the leanest without offload when nothing fits
    peak_bytes: int  # configuration.peak_bytes
    tokens_per_s: float | None = None  # useful throughput of the chosen configuration (None: nothing fits)
    grad_accum: int


class FineTuneSearch(BaseModel):
    """What ``--method any`` / ``--lora-ranks`` searched and chose (``Recommendation.finetune_search``)."""

    methods: list[str]
    lora_ranks: list[int] = Field(default_factory=list)
    rule: str = FINETUNE_RULE
    variants: list[FineTuneVariant] = Field(default_factory=list)
    chosen: str | None = None  # the chosen variant's label; the Recommendation around it is its search
    usable_gpu_bytes: int
    gpu_memory_bytes: int
    reasons: list[Reason] = Field(default_factory=list)
    explanation: list[str] = Field(default_factory=list)  # reasons as text
    notes: list[str] = Field(default_factory=list)


class Recommendation(BaseModel):
    """What ``zeroplan recommend --json`` prints. Bytes are ints; GB = 1e9 bytes."""

    model: ModelSummary
    cluster: ClusterSummary
    training: dict[str, Any]
    comm_model: str
    mfu: float | None  # None: the compute model (core/compute.py)
    headroom: float
    usable_gpu_bytes: int
    usable_host_bytes_per_node: int
    nvme_capacity_bytes_per_node: int
    useful_throughput: str = USEFUL_THROUGHPUT
    searched: int  # configurations whose fit was decided (micro-batch × checkpointing × state)
    chosen: Candidate | None = None
    plan: Plan | None = None  # evaluate() of the chosen configuration
    alternatives: list[Candidate] = Field(default_factory=list)
    stages: list[StageSummary] = Field(default_factory=list)
    explanation: list[str] = Field(default_factory=list)  # explanation_reasons as text
    warnings: list[str] = Field(default_factory=list)  # warning_reasons as text
    explanation_reasons: list[Reason] = Field(default_factory=list)
    warning_reasons: list[Reason] = Field(default_factory=list)
    suggestions: list[Alternative] = Field(default_factory=list)  # every alternative the advice evaluated
    nodes_needed: dict[str, int | None] = Field(default_factory=dict)  # "ZeRO-3" -> nodes (None: never)
    assumptions: list[str] = Field(default_factory=list)
    ds_config: dict[str, Any] | None = None  # the chosen DeepSpeed config (build_ds_config)
    ds_config_diff: list[dict[str, Any]] | None = None  # vs --ds-config: {key, old, new}
    finetune: FineTuneInventory | None = None  # trainable / frozen / adapter counts (None: full training)
    finetune_search: FineTuneSearch | None = None  # --method any / --lora-ranks: every variant searched
    global_batch: GlobalBatch | None = None  # --global-batch: the accumulation chosen for it
    peft: dict[str, Any] | None = None  # the PEFT / Trainer settings the plan assumes (--emit-config's sidecar)


def candidate_zero(base_zero: Any, *, offload_optimizer: str, offload_param: str, reduce_bucket_size: int,
                   prefetch_bucket_size: int | None = None, hpz_partition_size: int = 1) -> Any:
    """``base_zero`` (a ZeroConfig for the stage) with the searched keys replaced."""
    oo = base_zero.offload_optimizer.model_copy(update={"device": offload_optimizer})
    if offload_optimizer == "nvme" and not oo.nvme_path:
        oo = oo.model_copy(update={"nvme_path": NVME_PATH})
    op = base_zero.offload_param.model_copy(update={"device": offload_param})
    if offload_param == "nvme" and not op.nvme_path:
        op = op.model_copy(update={"nvme_path": NVME_PATH})
    upd: dict[str, Any] = {"offload_optimizer": oo, "offload_param": op, "reduce_bucket_size": int(reduce_bucket_size)}
    if base_zero.stage == 3:
        if prefetch_bucket_size is not None:
            upd["prefetch_bucket_size"] = int(prefetch_bucket_size)
        upd["zero_hpz_partition_size"] = int(hpz_partition_size)
    return base_zero.model_copy(update=upd)

