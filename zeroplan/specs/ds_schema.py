"""The DeepSpeed 0.19.8 config as typed data: ``zero_optimization`` and its offload blocks with
DeepSpeed's field names and every default written once, and ``DSConfig``, what the reader returns
(the config as DeepSpeed would see it, plus the findings). Also the version mirrored and the rule
table of the findings (the rule IDs are described in specs/deepspeed_config.py).

Units: every ``*_bucket_size``, ``sub_group_size``, ``max_live_parameters``,
``max_reuse_distance``, persistence thresholds, ``buffer_size`` and ``max_in_cpu`` are ELEMENT
counts, not bytes (multiply by the dtype size).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from zeroplan.specs.findings import Finding

__all__ = [
    "DEEPSPEED_VERSION",
    "RULES",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "ActivationCheckpointingConfig",
    "DSConfig",
    "zero_or_default",
]

DEEPSPEED_VERSION = "0.19.8"

RULES: dict[str, str] = {
    "DS001": "unknown key (inside zero_optimization/offload/fp16/bf16 DeepSpeed rejects it: error; elsewhere ignored: warning)",
    "DS002": "deprecated key mapped to its replacement (error when the replacement is given too)",
    "DS003": "wrong type (error: DeepSpeed rejects it, default used; warning: DeepSpeed coerces it)",
    "DS004": "fractional number for an integer field (pydantic int_from_float); default used",
    "DS005": "fp16 and bf16 both enabled",
    "DS006": "\"auto\" value resolved (HF Trainer rule, or DeepSpeed drops it and uses the default)",
    "DS007": "\"auto\" value that cannot be resolved without more input; DeepSpeed's default used",
    "DS008": "batch sizes missing, non-positive or inconsistent (train_batch_size = micro_batch x grad_accum x world_size)",
    "DS009": "key removed in DeepSpeed 0.19.8 (MiCS, LoCo, amp, elasticity, ...): DeepSpeed raises",
    "DS010": "invalid value (bounds, stage, offload ratio/nvme_path, alias conflict) or a setting with no effect",
    "DS011": "comments or trailing commas: DeepSpeed (hjson) accepts them, json.load-based readers do not",
}


OffloadDevice = Literal["none", "cpu", "nvme"]

# ZeRO-3 leaf modules DeepSpeed 0.19.8 treats as fetch units by default (leaf_module_config.py).
_DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


def _default_leaf_module() -> dict[str, list[str]]:
    return {"classes": list(_DEFAULT_LEAF_MODULE_CLASSES), "names": [], "name_suffixes": []}


class OffloadOptimizerConfig(BaseModel):
    """``zero_optimization.offload_optimizer`` (DeepSpeed ``DeepSpeedZeroOffloadOptimizerConfig``).

    ``device="none"`` means no offload (DeepSpeed's ``offload_optimizer: null``). ``pin_memory``
    defaults to True in 0.19.8 (False in 0.16.5). ``ratio`` is the fraction of optimizer
    sub-groups stepped on the CPU; < 1 is valid only for stage 3.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", validate_assignment=True)
    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: Annotated[int, Field(ge=0)] = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: Annotated[float, Field(ge=0.0, le=1.0)] = 0.8


class OffloadParamConfig(BaseModel):
    """``zero_optimization.offload_param`` (``DeepSpeedZeroOffloadParamConfig``); stage 3 only.

    ``buffer_size`` and ``max_in_cpu`` are element counts.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", validate_assignment=True)
    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: Annotated[int, Field(ge=0)] = 5
    buffer_size: Annotated[int, Field(ge=0)] = 100_000_000
    max_in_cpu: Annotated[int, Field(ge=0)] = 1_000_000_000
    pin_memory: bool = True


def _alias(name: str, alias: str) -> Any:
    return AliasChoices(name, alias)


class ZeroConfig(BaseModel):
    """``zero_optimization`` with DeepSpeed 0.19.8's field names and defaults, all resolved.

    Sizes are ELEMENT counts. ``overlap_comm`` left unset resolves to ``stage == 3`` (DeepSpeed's
    ``overlap_comm_valid``); it is resolved at construction, so ``model_copy(update={"stage": 3})``
    does not re-resolve it. Offload configs are always present (``device="none"`` = off). The
    ``stage3_*`` aliases are accepted as keyword arguments. Settings DeepSpeed ignores at the
    given stage are kept as written; use ``param_offload_device`` / ``optimizer_offload_device``
    for what DeepSpeed actually does.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", populate_by_name=True, validate_assignment=False)

    stage: Annotated[int, Field(ge=0, le=3)] = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Annotated[int, Field(gt=0)] = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: Annotated[int, Field(ge=0)] = 500_000_000
    overlap_comm: bool = False
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    zenflow: dict[str, Any] | None = None
    sub_group_size: Annotated[int, Field(ge=0)] = 1_000_000_000
    prefetch_bucket_size: Annotated[int, Field(ge=0)] = Field(
        50_000_000, validation_alias=_alias("prefetch_bucket_size", "stage3_prefetch_bucket_size"))
    param_persistence_threshold: Annotated[int, Field(ge=0)] = Field(
        100_000,
        validation_alias=_alias("param_persistence_threshold", "stage3_param_persistence_threshold"))
    model_persistence_threshold: Annotated[int, Field(ge=0)] = Field(
        sys.maxsize,
        validation_alias=_alias("model_persistence_threshold", "stage3_model_persistence_threshold"))
    max_live_parameters: Annotated[int, Field(ge=0)] = Field(
        1_000_000_000, validation_alias=_alias("max_live_parameters", "stage3_max_live_parameters"))
    max_reuse_distance: Annotated[int, Field(ge=0)] = Field(
        1_000_000_000, validation_alias=_alias("max_reuse_distance", "stage3_max_reuse_distance"))
    gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=_alias("gather_16bit_weights_on_model_save",
                                "stage3_gather_16bit_weights_on_model_save"))
    module_granularity_threshold: int = Field(
        0,
        validation_alias=_alias("module_granularity_threshold",
                                "stage3_module_granularity_threshold"))
    use_all_reduce_for_fetch_params: bool = Field(
        False,
        validation_alias=_alias("use_all_reduce_for_fetch_params",
                                "stage3_use_all_reduce_for_fetch_params"))
    allgather_sequential: bool = Field(
        False, validation_alias=_alias("allgather_sequential", "stage3_allgather_sequential"))
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: Annotated[int, Field(ge=0)] = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] = Field(default_factory=_default_leaf_module)

    @model_validator(mode="before")
    @classmethod
    def _resolve_overlap_comm(cls, data: Any) -> Any:
        # DeepSpeed's overlap_comm_valid: None -> (stage == 3).
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            data = dict(data)
            stage = data.get("stage", 0)
            try:
                data["overlap_comm"] = int(stage) == 3
            except (TypeError, ValueError):
                data["overlap_comm"] = False
        return data

    @property
    def param_offload_device(self) -> str:
        """Where DeepSpeed really keeps parameters: offload_param only acts in stage 3."""
        return self.offload_param.device if self.stage == 3 else "none"

    @property
    def optimizer_offload_device(self) -> str:
        """Where DeepSpeed really keeps optimizer states: offload_optimizer needs stage >= 1."""
        return self.offload_optimizer.device if self.stage >= 1 else "none"



def zero_or_default(zero: ZeroConfig | None) -> ZeroConfig:
    """``zero``, or DeepSpeed's defaults (``ZeroConfig()``, stage 0) when there is none: readers of a
    ZeRO config take typed fields, so no default is written twice."""
    return ZeroConfig() if zero is None else zero

class ActivationCheckpointingConfig(BaseModel):
    """The top-level ``activation_checkpointing`` block with DeepSpeed 0.19.8's defaults
    (deepspeed/runtime/activation_checkpointing/config.py ``ACT_CHKPT_*_DEFAULT``). It configures
    ``deepspeed.checkpointing.checkpoint`` (checkpointing.py ``CheckpointFunction``), which a training
    script must call itself (Megatron-LM's ``--deepspeed-activation-checkpointing`` does; transformers'
    gradient checkpointing uses torch.utils.checkpoint and ignores the block)."""

    model_config = ConfigDict(defer_build=True, extra="ignore")
    partition_activations: bool = False  # split each checkpoint across the model-parallel ranks
    contiguous_memory_optimization: bool = False  # copy checkpoints into per-layer preallocated buffers
    cpu_checkpointing: bool = False  # keep the checkpoints in host memory (with partition_activations)
    number_checkpoints: int | None = None  # how many preallocated buffers (contiguous_memory_optimization)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class DSConfig(BaseModel):
    """A DeepSpeed config as DeepSpeed 0.19.8 would see it, plus what zeroplan found in it.

    ``raw`` is the parsed JSON as written (before any "auto" resolution). Batch values are after
    DeepSpeed's fill-in rule (only applied when ``world_size`` is known); None = not determined.
    ``communication_data_type`` is the explicit top-level value (lower case) or None, which
    DeepSpeed resolves to the training precision (see ``resolved_communication_data_type``).
    ``auto_resolved`` maps a dotted key to ``{"value": ..., "how": "..."}``.
    """

    model_config = ConfigDict(defer_build=True)

    path: str | None = None
    label: str | None = None  # where a config that is not a file came from ("args.json: deepspeed")
    raw: dict[str, Any]
    zero: ZeroConfig
    precision: Literal["fp32", "bf16", "fp16"]
    precision_source: str
    optimizer_type: str | None = None
    optimizer_params: dict[str, Any] = Field(default_factory=dict)
    gradient_clipping: float = 1.0  # runtime/constants.py GRADIENT_CLIPPING_DEFAULT (DeepSpeed 0.19.8)
    train_batch_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    communication_data_type: str | None = None
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    auto_resolved: dict[str, Any] = Field(default_factory=dict)
    findings: list[Finding] = Field(default_factory=list)

    @property
    def resolved_communication_data_type(self) -> str:
        """DeepSpeed: None -> fp16 if fp16, bf16 if bf16, else fp32."""
        return self.communication_data_type or self.precision

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]
