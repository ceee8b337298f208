"""Read and write DeepSpeed JSON configs the way DeepSpeed 0.19.8 reads them.

zeroplan never imports DeepSpeed; this module is its own reader. What it mirrors (read from
DeepSpeed's source and checked against ``DeepSpeedZeroConfig`` 0.19.8, see
shared/reference/deepspeed-internals.md §3):

- Parsing: DeepSpeed loads config files with ``hjson`` and rejects duplicate keys. zeroplan accepts
  strict JSON plus ``//`` and ``/* */`` comments and trailing commas (a string-aware pre-pass that
  keeps every line and column where it was); anything else is an ``InputError`` with file, line
  and column.
- ``zero_optimization``: every key with its 0.19.8 default, the ``stage3_*`` aliases, pydantic's
  lax coercion (``2e8`` -> 200000000; ``"true"`` -> True, reported), ``int_from_float`` rejection of
  fractional element counts, the field bounds (``reduce_bucket_size > 0``, others ``>= 0``),
  ``extra="forbid"`` (an unknown key is an error in DeepSpeed), deprecated keys, and the keys
  DeepSpeed 0.19.8 removed (MiCS, LoCo) which make it raise.
- ``"auto"``: DeepSpeed drops every ``"auto"`` value inside its pydantic models (the default is
  used); the HF Trainer fills some of them first (``reduce_bucket_size = h*h``, ZeRO-3
  ``stage3_prefetch_bucket_size = int(0.9*h*h)``, ``stage3_param_persistence_threshold = 10*h``,
  batch keys from the training arguments). zeroplan applies the HF rules where it is given the
  numbers and records each resolution.
- Batch keys: ``_set_batch_related_parameters`` (integer floor division) and ``_batch_assertion``
  ``train_batch_size == micro_batch * grad_accum * world_size`` (data-parallel world size).
- Precision: ``fp16`` / ``bf16`` (legacy alias ``bfloat16``) blocks; both enabled is DeepSpeed's
  assertion 'bfloat16 and fp16 modes cannot be simultaneously enabled'; neither -> fp32.

Units: every ``*_bucket_size``, ``sub_group_size``, ``max_live_parameters``,
``max_reuse_distance``, persistence thresholds, ``buffer_size`` and ``max_in_cpu`` are ELEMENT
counts, not bytes (multiply by the dtype size).

Rule IDs of the findings this module emits (severity in brackets is the usual one; ``strict=True``
turns every error, and every DS001/DS003/DS004 finding, into an ``InputError``):

| rule  | severity         | meaning |
|-------|------------------|---------|
| DS001 | warning / error  | unknown key. Top level and optimizer/scheduler blocks: DeepSpeed ignores it (warning). Inside ``zero_optimization``, ``offload_*``, ``fp16``, ``bf16``: DeepSpeed's pydantic ``extra="forbid"`` rejects it (error). |
| DS002 | warning / error  | deprecated key mapped to its replacement (``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory`` (value not transferred), ``stage3_gather_fp16_weights_on_model_save``, legacy ``bfloat16`` block, boolean ``zero_optimization``). Error when the replacement key is given too (DeepSpeed asserts). |
| DS003 | error / warning  | wrong type. Error: DeepSpeed rejects it, the default is used. Warning: DeepSpeed's lax coercion accepts it (``"true"`` for a bool, ``"8"`` for an int); the coerced value is used. |
| DS004 | error            | fractional number for an integer field (pydantic ``int_from_float``); the default is used. |
| DS005 | error            | fp16 and bf16 both enabled (DeepSpeed: 'bfloat16 and fp16 modes cannot be simultaneously enabled'); zeroplan plans with bf16. |
| DS006 | info             | an ``"auto"`` value resolved (HF Trainer rule or DeepSpeed dropping it); see ``DSConfig.auto_resolved``. |
| DS007 | warning          | an ``"auto"`` value zeroplan cannot resolve (no hidden size / batch numbers / precision given, ``stage: "auto"``); DeepSpeed's own behaviour (default) is used. |
| DS008 | error / warning  | batch sizes: ``train_batch_size != micro_batch * grad_accum * world_size``, a non-positive value (error), neither ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` given, or a value that differs from what the caller passed (warning). |
| DS009 | error            | a key DeepSpeed 0.19.8 removed and now rejects (MiCS ``mics_shard_size``, ``mics_hierarchical_params_gather``, LoCo ``zeropp_loco_param``; top-level ``amp``, ``elasticity``, ``sparse_attention``, ...). |
| DS010 | error / warning  | invalid value: out of bounds (``reduce_bucket_size <= 0``, negative sizes, stage not in 0..3, ``ratio`` outside [0, 1]), partial offload ``ratio < 1`` below stage 3, ``nvme`` without ``nvme_path``, odd ``allgather_bucket_size`` at stage 1/2, ``compute_grad_norm=false`` outside stage 1/2, unknown ``communication_data_type``, a key given under both its name and its alias (errors); settings with no effect at this stage (``offload_param`` below stage 3, ZeRO++ keys below stage 3, ``offload_optimizer`` at stage 0) and ``optimizer.params.max_grad_norm`` (warnings). |
| DS011 | warning          | the file uses comments or trailing commas: DeepSpeed (hjson) accepts them, ``json.load``-based readers (Accelerate's ``HfDeepSpeedConfig``) do not. |
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from zeroplan._util import InputError, atomic_write_text, read_text_file
from zeroplan.specs.findings import Finding

__all__ = [
    "DEEPSPEED_VERSION",
    "RULES",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "DSConfig",
    "ABSENT",
    "TOP_LEVEL_KEYS",
    "ZEROPLAN_KEY",
    "load_ds_config",
    "parse_ds_json",
    "build_ds_config",
    "write_ds_config",
    "diff_ds_configs",
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


# --------------------------------------------------------------------------------------------
# The models: canonical DeepSpeed field names, every default resolved (DeepSpeed 0.19.8).
# --------------------------------------------------------------------------------------------

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

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
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

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
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

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=False)

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


class DSConfig(BaseModel):
    """A DeepSpeed config as DeepSpeed 0.19.8 would see it, plus what zeroplan found in it.

    ``raw`` is the parsed JSON as written (before any "auto" resolution). Batch values are after
    DeepSpeed's fill-in rule (only applied when ``world_size`` is known); None = not determined.
    ``communication_data_type`` is the explicit top-level value (lower case) or None, which
    DeepSpeed resolves to the training precision (see ``resolved_communication_data_type``).
    ``auto_resolved`` maps a dotted key to ``{"value": ..., "how": "..."}``.
    """

    path: str | None = None
    raw: dict[str, Any]
    zero: ZeroConfig
    precision: Literal["fp32", "bf16", "fp16"]
    precision_source: str
    optimizer_type: str | None = None
    optimizer_params: dict[str, Any] = Field(default_factory=dict)
    gradient_clipping: float = 0.0
    train_batch_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    communication_data_type: str | None = None
    auto_resolved: dict[str, Any] = Field(default_factory=dict)
    findings: list[Finding] = Field(default_factory=list)

    @property
    def resolved_communication_data_type(self) -> str:
        """DeepSpeed: None -> fp16 if fp16, bf16 if bf16, else fp32."""
        return self.communication_data_type or self.precision

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]


# --------------------------------------------------------------------------------------------
# Key tables (DeepSpeed 0.19.8: runtime/config.py, constants.py, zero/config.py)
# --------------------------------------------------------------------------------------------

# alias -> canonical field name (DeepSpeedZeroConfig aliases)
_ZERO_ALIASES: dict[str, str] = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
_ZERO_CANONICAL_TO_ALIAS = {v: k for k, v in _ZERO_ALIASES.items()}

_ZERO_DEPRECATED = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
                    "stage3_gather_fp16_weights_on_model_save")

# Keys DeepSpeed 0.19.8 rejects with DeepSpeedConfigError (_REMOVED_ZERO_CONFIG_KEYS).
_ZERO_REMOVED: dict[str, str] = {
    "mics_shard_size": "MiCS ZeRO-3 sharding was removed",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed (standard ZeRO++ quantized gradients still work)",
}

# Top-level keys DeepSpeed 0.19.8 rejects (_REMOVED_TOP_LEVEL_CONFIG_KEYS).
_TOP_REMOVED: dict[str, str] = {
    "nebula": "Nebula checkpointing was removed",
    "compression_training": "the DeepSpeed compression library was removed",
    "amp": "NVIDIA Apex AMP integration was removed; use fp16, bf16 or torch_autocast",
    "quantize_training": "Mixture-of-Quantization (quantize_training) was removed",
    "sparse_gradients": "sparse embedding-gradient compression was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "DeepSpeed Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch keys directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "top-level curriculum_learning was removed; use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}

# zeroplan's own planning metadata (sequence length, checkpointing, ...; core/inputs.py). DeepSpeed
# 0.19.8 ignores unknown top-level keys, so the reader does not report it (no DS001).
ZEROPLAN_KEY = "zeroplan"

# Top-level keys DeepSpeed 0.19.8 reads (DeepSpeedConfig._initialize_params and the configs
# it builds, deepspeed.initialize). Anything else is ignored by DeepSpeed -> DS001 warning.
TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc",
    "disable_allgather", "communication_data_type", "seq_parallel_communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
    "zero_optimization", "allgather_size", "activation_checkpointing", "comms_logger",
    "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16",
    "bfloat16", "torch_autocast", "optimizer", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "scheduler", "flops_profiler", "wall_clock_breakdown",
    "memory_breakdown", "autotuning", "use_data_before_expert_parallelism", "hybrid_engine",
    "pipeline", "data_efficiency", "checkpoint", "data_types", "aio", "dataloader_drop_last",
    "log_level", "datastates_ckpt", "weight_quantization", "compile", "timers",
    "tensor_parallel", "expert_parallel", "vocabulary_size", "sequence_parallel_size",
    "data_parallel_size",
})

# fp16 / bf16 blocks (DeepSpeedFP16Config / DeepSpeedBF16Config): field -> (type, default).
_FP16_FIELDS: dict[str, tuple[Any, Any]] = {
    "enabled": (bool, False), "auto_cast": (bool, False), "loss_scale": (float, 0.0),
    "initial_scale_power": (int, 16), "loss_scale_window": (int, 1000), "hysteresis": (int, 2),
    "consecutive_hysteresis": (bool, False), "min_loss_scale": (int, 1),
    "fp16_master_weights_and_grads": (bool, False),
}
_BF16_FIELDS: dict[str, tuple[Any, Any]] = {
    "enabled": (bool, False), "immediate_grad_update": (bool, False),
    "check_grad_overflow": (bool, True), "bf16_master_weights_and_grads": (bool, False),
    "bf16_optimizer_states": (bool, False),
}
_FP16_KEYS = frozenset(_FP16_FIELDS)
_BF16_KEYS = frozenset(_BF16_FIELDS)
_OPTIMIZER_KEYS = frozenset({"type", "params", "legacy_fusion"})
_SCHEDULER_KEYS = frozenset({"type", "params"})
_LEAF_MODULE_KEYS = frozenset({"classes", "names", "name_suffixes"})
_ZENFLOW_KEYS = frozenset({"topk_ratio", "select_strategy", "select_interval", "update_interval",
                           "overlap_step", "offload", "auto_ratio", "full_warm_up_rounds",
                           "pt_reserved_cores_perc", "steps_per_epoch"})

# DeepSpeed's built-in optimizer names (lower-cased by DeepSpeed when matched).
_DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# --------------------------------------------------------------------------------------------
# JSON with comments and trailing commas
# --------------------------------------------------------------------------------------------

def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def _strip_jsonc(text: str, where: str) -> tuple[str, bool]:
    """Blank out comments and trailing commas, keeping every other character in place.

    Returns (clean_text, used_extensions). Strings (with escapes) are left untouched, so
    ``"http://x"`` stays a string. Newlines inside block comments are kept so JSON error
    positions still point at the original line and column.
    """
    out = list(text)
    n = len(text)
    i = 0
    used = False
    in_string = False
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
            i += 1
            continue
        if c == '"':
            in_string = True
            i += 1
            continue
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            used = True
            while i < n and text[i] != "\n":
                out[i] = " "
                i += 1
            continue
        if c == "/" and i + 1 < n and text[i + 1] == "*":
            end = text.find("*/", i + 2)
            if end < 0:
                line, col = _line_col(text, i)
                raise InputError(f"{where}: line {line} column {col}: unterminated /* comment")
            used = True
            for j in range(i, end + 2):
                if out[j] != "\n":
                    out[j] = " "
            i = end + 2
            continue
        i += 1
    # Second pass over the comment-free text: drop commas followed only by whitespace and } or ].
    # A comma only counts as trailing after a value (not after "{", "[", ":" or another ",").
    clean = "".join(out)
    in_string = False
    last = ""  # last significant character outside strings
    i = 0
    while i < n:
        c = clean[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
                last = '"'
        elif c == '"':
            in_string = True
        elif c == ",":
            j = i + 1
            while j < n and clean[j] in " \t\r\n":
                j += 1
            if j < n and clean[j] in "}]" and last not in ("", "{", "[", ":", ","):
                out[i] = " "
                used = True
            else:
                last = c
        elif c not in " \t\r\n":
            last = c
        i += 1
    return "".join(out), used


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_ds_json(text: str, where: str = "<config>") -> tuple[dict[str, Any], bool]:
    """Parse a DeepSpeed JSON config; returns (dict, used_comments_or_trailing_commas).

    Raises InputError naming ``where``, line and column for malformed input, duplicate keys
    (DeepSpeed rejects them), NaN/Infinity, or a top level that is not an object.
    """
    clean, used = _strip_jsonc(text, where)
    try:
        data = json.loads(clean, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg})") from None
    except _DuplicateKey as exc:
        key = str(exc)
        pos = clean.find(json.dumps(key))
        pos2 = clean.find(json.dumps(key), pos + 1) if pos >= 0 else -1
        loc = ""
        if pos2 >= 0:
            line, col = _line_col(clean, pos2)
            loc = f" line {line} column {col}:"
        raise InputError(
            f"{where}:{loc} duplicate key {key!r} in a JSON object "
            "(DeepSpeed rejects duplicate keys)") from None
    except ValueError as exc:  # NaN / Infinity
        raise InputError(f"{where}: not valid JSON: {exc} (DeepSpeed's hjson rejects it)") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: top level is a JSON {type(data).__name__}, expected an object "
            "such as {\"zero_optimization\": {...}}")
    return data, used


# --------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    try:
        s = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 80 else s[:77] + "..."


def _expected_text(annotation: Any, metadata: list[Any]) -> str:
    base = annotation
    text = "a value"
    if base is int:
        text = "an integer"
    elif base is bool:
        text = "true or false"
    elif base is float:
        text = "a number"
    elif base == (str | None):
        text = "a string path"
    elif base == OffloadDevice:
        text = 'one of "none", "cpu", "nvme"'
    bounds = []
    for m in metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{sym} {v}")
    if bounds:
        text += " " + " and ".join(bounds)
    return text


class _Reader:
    def __init__(self, where: str, file: str, strict: bool):
        self.where = where
        self.file = file
        self.strict = strict
        self.findings: list[Finding] = []
        self.auto: dict[str, Any] = {}

    # -- findings -------------------------------------------------------------------------
    def add(self, rule: str, severity: str, key: str, message: str, value: Any = None) -> None:
        if self.strict and rule in ("DS001", "DS003", "DS004"):
            severity = "error"
        self.findings.append(Finding(
            rule_id=rule, severity=severity, message=message, key=key, file=self.file,
            value=None if value is None else _fmt(value)))

    def raise_if_strict(self) -> None:
        if not self.strict:
            return
        errors = [f for f in self.findings if f.severity == "error"]
        if errors:
            more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
            raise InputError(f"{self.where}: {errors[0].rule_id} {errors[0].message}{more}")

    def unknown(self, key: str, known: frozenset[str] | list[str], severity: str, why: str) -> None:
        key = str(key)
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        self.add("DS001", severity, key, f"{key}: unknown key ({why}){hint}", None)

    # -- typed values (pydantic lax mode, as DeepSpeed's models use) ------------------------
    def value(self, key: str, raw: Any, annotation: Any, metadata: list[Any], default: Any) -> Any:
        """Validate ``raw`` the way DeepSpeed's pydantic field would; findings on problems."""
        tp = Annotated[(annotation, *metadata)] if metadata else annotation
        ta = TypeAdapter(tp)
        try:
            return ta.validate_python(raw, strict=True)
        except ValidationError:
            pass
        expected = _expected_text(annotation, metadata)
        try:
            coerced = ta.validate_python(raw)
        except ValidationError as exc:
            err_type = exc.errors()[0]["type"]
            if err_type == "int_from_float":
                self.add("DS004", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected} (an element count), got a "
                         f"fractional number; DeepSpeed {DEEPSPEED_VERSION} rejects it "
                         f"(int_from_float); using the default {_fmt(default)}", raw)
            elif err_type in ("greater_than", "greater_than_equal", "less_than",
                              "less_than_equal", "literal_error") and (
                    err_type != "literal_error" or isinstance(raw, str)):
                self.add("DS010", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected}; DeepSpeed rejects it; "
                         f"using the default {_fmt(default)}", raw)
            else:
                self.add("DS003", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected}, got "
                         f"{_json_type(raw)}; DeepSpeed rejects it; using the default "
                         f"{_fmt(default)}", raw)
            return default
        # Accepted by lax mode only. Integral floats for int fields are DeepSpeed's documented
        # behaviour (2e8 -> 200000000) and not reported; other coercions are.
        if isinstance(raw, float) and not isinstance(raw, bool) and annotation is int:
            return coerced
        self.add("DS003", "warning", key,
                 f"{key} = {_fmt(raw)}: expected {expected}, got {_json_type(raw)}; DeepSpeed "
                 f"coerces it to {_fmt(coerced)}; write {_fmt(coerced)} instead", raw)
        return coerced


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a fractional number" if math.isfinite(v) and v != int(v) else "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _field_spec(model: type[BaseModel], name: str) -> tuple[Any, list[Any], Any]:
    f = model.model_fields[name]
    default = f.get_default(call_default_factory=True)
    return f.annotation, list(f.metadata), default


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v == "auto"


def _read_offload(r: _Reader, key: str, raw: Any, model: type[BaseModel]) -> BaseModel:
    """Read an offload_* block; None/absent -> device none."""
    if raw is None:
        return model()
    if not isinstance(raw, dict):
        r.add("DS003", "error", key,
              f"{key} = {_fmt(raw)}: expected an object such as {{\"device\": \"cpu\"}}, got "
              f"{_json_type(raw)}; DeepSpeed rejects it; using no offload", raw)
        return model()
    values: dict[str, Any] = {}
    fields = model.model_fields
    for k, v in raw.items():
        sub = f"{key}.{k}"
        if k not in fields:
            r.unknown(sub, list(fields), "error",
                      f"DeepSpeed's {model.__name__.replace('Config', '')} forbids extra keys")
            continue
        ann, meta, default = _field_spec(model, k)
        if _is_auto(v):
            if k == "device":
                how = "DeepSpeed drops \"auto\" -> \"none\" (no offload); Accelerate fills it from its plugin"
            else:
                how = f"DeepSpeed drops \"auto\" -> default {_fmt(default)}"
            r.auto[sub] = {"value": default, "how": how}
            r.add("DS006", "info", sub, f"{sub} = \"auto\": {how}", v)
            continue
        values[k] = r.value(sub, v, ann, meta, default)
    return model(**values)


def _read_dict_block(r: _Reader, key: str, raw: Any, known: frozenset[str]) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.add("DS003", "error", key, f"{key} = {_fmt(raw)}: expected an object, got "
              f"{_json_type(raw)}; DeepSpeed rejects it; using the default", raw)
        return None
    out = {}
    for k, v in raw.items():
        if k not in known:
            r.unknown(f"{key}.{k}", known, "error", "DeepSpeed forbids extra keys here")
            continue
        if _is_auto(v):
            continue
        out[k] = v
    return out


def _read_zero(r: _Reader, raw_top: dict[str, Any], zero_raw: Any,
               hidden_size: int | None) -> ZeroConfig:
    if zero_raw is None:
        return ZeroConfig()
    if isinstance(zero_raw, bool):
        # read_zero_config_deprecated: true -> stage 1 with allgather_size.
        r.add("DS002", "warning", "zero_optimization",
              f"zero_optimization = {_fmt(zero_raw)}: the boolean form is deprecated; DeepSpeed "
              f"reads it as stage {1 if zero_raw else 0}; write {{\"stage\": "
              f"{1 if zero_raw else 0}}} instead", zero_raw)
        values: dict[str, Any] = {"stage": 1 if zero_raw else 0}
        if zero_raw:
            ag = raw_top.get("allgather_size", 500_000_000)
            ann, meta, default = _field_spec(ZeroConfig, "allgather_bucket_size")
            values["allgather_bucket_size"] = r.value("allgather_size", ag, ann, meta, default)
        return ZeroConfig(**values)
    if not isinstance(zero_raw, dict):
        r.add("DS003", "error", "zero_optimization",
              f"zero_optimization = {_fmt(zero_raw)}: expected an object, got "
              f"{_json_type(zero_raw)}; using ZeRO defaults (stage 0)", zero_raw)
        return ZeroConfig()

    fields = ZeroConfig.model_fields
    known = set(fields) | set(_ZERO_ALIASES) | set(_ZERO_DEPRECATED) | set(_ZERO_REMOVED)

    # Stage first: HF's hidden-size rules for stage-3 keys depend on it.
    stage_raw = zero_raw.get("stage", 0)
    if _is_auto(stage_raw):
        # the stage decides everything zeroplan computes: under --strict it is an error
        r.add("DS007", "error" if r.strict else "warning", "zero_optimization.stage",
              "zero_optimization.stage = \"auto\": zeroplan cannot know the stage Accelerate "
              "would fill in; DeepSpeed drops \"auto\" -> stage 0 (pass --stage to plan another)",
              stage_raw)
        r.auto["zero_optimization.stage"] = {"value": 0, "how": "unresolved; DeepSpeed drops \"auto\" -> 0"}
        stage = 0
    else:
        ann, meta, default = _field_spec(ZeroConfig, "stage")
        stage = r.value("zero_optimization.stage", stage_raw, ann, meta, default)

    values: dict[str, Any] = {"stage": stage}
    given_as: dict[str, str] = {}  # canonical -> key as written
    deprecated: dict[str, Any] = {}

    for k, v in zero_raw.items():
        key = f"zero_optimization.{k}"
        if k == "stage":
            continue
        if k in _ZERO_REMOVED:
            r.add("DS009", "error", key,
                  f"{key}: {_ZERO_REMOVED[k]} in DeepSpeed {DEEPSPEED_VERSION}, which raises "
                  "DeepSpeedConfigError for this key; remove it", v)
            continue
        if k not in known:
            r.unknown(key, sorted(known - set(_ZERO_REMOVED)), "error",
                      "DeepSpeed's DeepSpeedZeroConfig forbids extra keys and fails to start")
            continue
        if k in _ZERO_DEPRECATED:
            deprecated[k] = v
            continue
        canonical = _ZERO_ALIASES.get(k, k)
        ann, meta, default = _field_spec(ZeroConfig, canonical)
        if _is_auto(v):
            v = _zero_auto(r, key, k, canonical, stage, hidden_size, default)
            if v is None:  # dropped, as DeepSpeed drops "auto": the key is not there
                continue
        if canonical in given_as:
            other = given_as[canonical]
            r.add("DS010", "error", key,
                  f"{key}: given together with zero_optimization.{other} (the same setting); "
                  f"DeepSpeed rejects the pair; using {other}", v)
            continue
        given_as[canonical] = k
        if canonical == "overlap_comm" and v is None:
            continue  # null = "resolve from stage", as DeepSpeed's Optional[bool]
        if canonical in ("offload_optimizer", "offload_param"):
            model = OffloadOptimizerConfig if canonical == "offload_optimizer" else OffloadParamConfig
            values[canonical] = _read_offload(r, key, v, model)
            continue
        if canonical == "zenflow":
            values[canonical] = _read_dict_block(r, key, v, _ZENFLOW_KEYS)
            continue
        if canonical == "leaf_module":
            block = _read_dict_block(r, key, v, _LEAF_MODULE_KEYS)
            lm = _default_leaf_module()
            for lk, lv in (block or {}).items():
                if isinstance(lv, str):
                    lv = [lv]
                if isinstance(lv, list) and all(isinstance(x, str) for x in lv):
                    lm[lk] = list(dict.fromkeys(lv))
                else:
                    r.add("DS003", "error", f"{key}.{lk}",
                          f"{key}.{lk} = {_fmt(lv)}: expected a list of strings; using the default", lv)
            values[canonical] = lm
            continue
        values[canonical] = r.value(key, v, ann, meta, default)

    _apply_deprecated(r, deprecated, given_as, values)
    zero = ZeroConfig(**values)
    _check_zero(r, zero, given_as)
    return zero


def _zero_auto(r: _Reader, key: str, written: str, canonical: str, stage: int,
               hidden_size: int | None, default: Any) -> Any:
    """HF Trainer "auto" rules for zero keys; returns the value or None (= default)."""
    hf_rule = None
    if written == "reduce_bucket_size":
        hf_rule = ("hidden_size*hidden_size", lambda h: h * h)
    elif written == "stage3_prefetch_bucket_size" and stage == 3:
        hf_rule = ("int(0.9*hidden_size*hidden_size)", lambda h: int(0.9 * h * h))
    elif written == "stage3_param_persistence_threshold" and stage == 3:
        hf_rule = ("10*hidden_size", lambda h: 10 * h)
    if hf_rule is not None:
        if hidden_size is not None:
            value = hf_rule[1](int(hidden_size))
            how = f"HF Trainer rule {hf_rule[0]} with hidden_size={hidden_size}"
            r.auto[key] = {"value": value, "how": how}
            r.add("DS006", "info", key, f"{key} = \"auto\" -> {value} ({how})", "auto")
            if canonical == "reduce_bucket_size" and value <= 0:
                r.add("DS010", "error", key, f"{key}: resolved to {value}, must be > 0", value)
                return None
            return value
        how = (f"HF Trainer would set {hf_rule[0]} but no hidden size is known (pass a model); "
               f"DeepSpeed drops \"auto\" -> default {default}")
        r.auto[key] = {"value": default, "how": how}
        r.add("DS007", "warning", key, f"{key} = \"auto\": {how}", "auto")
        return None
    if canonical == "overlap_comm":
        how = f"DeepSpeed drops \"auto\" -> stage-dependent default ({stage == 3})"
        value: Any = stage == 3
    else:
        how = f"DeepSpeed drops \"auto\" -> default {_fmt(_plain(default))}"
        value = _plain(default)
        if written == "stage3_gather_16bit_weights_on_model_save":
            how += " (Accelerate fills it from its plugin)"
    r.auto[key] = {"value": value, "how": how}
    r.add("DS006", "info", key, f"{key} = \"auto\": {how}", "auto")
    return None


def _plain(v: Any) -> Any:
    return v.model_dump() if isinstance(v, BaseModel) else v


def _apply_deprecated(r: _Reader, deprecated: dict[str, Any], given_as: dict[str, str],
                      values: dict[str, Any]) -> None:
    """DeepSpeedConfigModel._process_deprecated_field for the four deprecated zero keys."""
    mapping = {
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    }
    for k, v in deprecated.items():
        key = f"zero_optimization.{k}"
        if _is_auto(v):
            r.auto[key] = {"value": None, "how": "DeepSpeed drops \"auto\" (deprecated key ignored)"}
            r.add("DS006", "info", key, f"{key} = \"auto\": DeepSpeed drops it", v)
            continue
        if k == "cpu_offload_use_pin_memory":
            r.value(key, v, bool | None, [], None)
            r.add("DS002", "warning", key,
                  f"{key} is deprecated and its value is NOT transferred; set "
                  "offload_optimizer.pin_memory / offload_param.pin_memory instead (both default "
                  "to true in DeepSpeed 0.19.8)", v)
            continue
        new = mapping[k]
        if new in given_as:
            r.add("DS002", "error", key,
                  f"{key} is deprecated and zero_optimization.{given_as[new]} is given too; "
                  f"DeepSpeed asserts 'Cannot provide deprecated parameter {k!r} and replacing "
                  f"parameter {new!r} together'; using {given_as[new]}", v)
            continue
        if k == "stage3_gather_fp16_weights_on_model_save":
            flag = r.value(key, v, bool, [], False)
            values[new] = flag
            r.add("DS002", "warning", key,
                  f"{key} is deprecated: DeepSpeed copies it to "
                  f"gather_16bit_weights_on_model_save = {_fmt(flag)}; rename the key", v)
            continue
        flag = r.value(key, v, bool | None, [], None)
        model = OffloadOptimizerConfig if new == "offload_optimizer" else OffloadParamConfig
        if flag:
            values[new] = model(device="cpu")
            msg = (f"{key} is deprecated: DeepSpeed maps it to {new} = {{\"device\": \"cpu\"}} "
                   f"(pin_memory true); write \"{new}\": {{\"device\": \"cpu\"}} instead")
        else:
            msg = f"{key} is deprecated (value {_fmt(v)} means no offload); remove it"
        r.add("DS002", "warning", key, msg, v)


def _check_zero(r: _Reader, z: ZeroConfig, given_as: dict[str, str]) -> None:
    """Cross-field rules: DeepSpeed validators and runtime assertions, plus no-effect settings."""
    def k(name: str) -> str:
        return f"zero_optimization.{given_as.get(name, name)}"

    oo, op = z.offload_optimizer, z.offload_param
    if oo.ratio < 1.0 and z.stage != 3:
        r.add("DS010", "error", k("offload_optimizer") + ".ratio",
              f"{k('offload_optimizer')}.ratio = {oo.ratio}: partial offloading (ratio < 1) is "
              f"supported only for ZeRO stage 3 (DeepSpeed asserts); stage is {z.stage}; "
              "planning with ratio 1.0", oo.ratio)
        z.offload_optimizer.ratio = 1.0
    if not z.compute_grad_norm and z.stage not in (1, 2):
        r.add("DS010", "error", k("compute_grad_norm"),
              f"{k('compute_grad_norm')} = false is supported only with ZeRO stage 1 or 2 "
              f"(DeepSpeed raises); stage is {z.stage}", False)
    for name, block in (("offload_optimizer", oo), ("offload_param", op)):
        if block.device == "nvme" and not block.nvme_path:
            r.add("DS010", "error", f"{k(name)}.nvme_path",
                  f"{k(name)}.device = \"nvme\" needs {name}.nvme_path (a directory on the NVMe "
                  "drive); DeepSpeed fails when it sets up swapping", None)
    if op.device != "none" and z.stage != 3:
        r.add("DS010", "warning", k("offload_param") + ".device",
              f"{k('offload_param')}.device = \"{op.device}\" has no effect at stage {z.stage}: "
              "DeepSpeed offloads parameters only in stage 3; zeroplan plans without it", op.device)
    if oo.device != "none" and z.stage == 0:
        r.add("DS010", "warning", k("offload_optimizer") + ".device",
              f"{k('offload_optimizer')}.device = \"{oo.device}\" has no effect at stage 0: "
              "optimizer offload needs ZeRO stage 1, 2 or 3", oo.device)
    if z.stage in (1, 2) and z.allgather_bucket_size % 2 != 0:
        r.add("DS010", "error", k("allgather_bucket_size"),
              f"{k('allgather_bucket_size')} = {z.allgather_bucket_size}: stage 1/2 asserts it is "
              "a multiple of 2 (nccl_start_alignment_factor)", z.allgather_bucket_size)
    if z.stage != 3:
        for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                     "zero_quantized_gradients", "zero_hpz_partition_size"):
            value = getattr(z, name)
            if value is True or (name == "zero_hpz_partition_size" and value > 1):
                r.add("DS010", "warning", k(name),
                      f"{k(name)} = {_fmt(value)} has no effect at stage {z.stage}: ZeRO++ "
                      "(qwZ, hpZ, qgZ) is implemented in the stage-3 optimizer only", value)


def _read_int_key(r: _Reader, key: str, raw: Any) -> int | None:
    """Top-level integer (batch keys): DeepSpeed reads them raw; zeroplan wants clean ints."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        r.add("DS003", "error", key, f"{key} = {_fmt(raw)}: expected a positive integer, got "
              f"{_json_type(raw)}", raw)
        return None
    if isinstance(raw, float):
        if not math.isfinite(raw) or raw != int(raw):
            r.add("DS004", "error", key, f"{key} = {_fmt(raw)}: expected a positive integer, got "
                  f"{_json_type(raw)}", raw)
            return None
        raw = int(raw)
    if raw <= 0:
        r.add("DS008", "error", key, f"{key} = {raw}: has to be greater than 0 (DeepSpeed "
              "asserts)", raw)
        return None
    return raw


def _read_batch(r: _Reader, raw: dict[str, Any], micro_batch: int | None,
                grad_accum: int | None, world_size: int | None) -> tuple[int | None, int | None, int | None]:
    vals: dict[str, Any] = {}
    explicit: dict[str, int | None] = {}
    given = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum}
    flags = {"train_micro_batch_size_per_gpu": "--micro-batch", "gradient_accumulation_steps": "--grad-accum"}
    for key in _BATCH_KEYS:
        v = raw.get(key)
        if _is_auto(v):
            vals[key] = "auto"
        else:
            explicit[key] = _read_int_key(r, key, v)
            vals[key] = explicit[key]
    # HF fill_match for the two per-GPU keys.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if vals[key] == "auto":
            if given[key] is not None:
                vals[key] = int(given[key])
                how = f"HF Trainer fills it from the training arguments ({flags[key]} {given[key]})"
                r.auto[key] = {"value": vals[key], "how": how}
                r.add("DS006", "info", key, f"{key} = \"auto\" -> {vals[key]} ({how})", "auto")
            else:
                vals[key] = None
                how = f"HF Trainer fills it from its training arguments; pass {flags[key]}"
                r.auto[key] = {"value": None, "how": "unresolved: " + how}
                r.add("DS007", "warning", key, f"{key} = \"auto\" cannot be resolved: {how}", "auto")
        elif given[key] is not None and vals[key] is not None and vals[key] != given[key]:
            r.add("DS008", "warning", key,
                  f"{key} = {vals[key]} in the config but {flags[key]} {given[key]} was given; "
                  "the config's value is used (HF Trainer would raise a mismatch)", vals[key])
    if vals["train_batch_size"] == "auto":
        mb, gas = vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
        if None not in (mb, gas, world_size):
            tb = world_size * mb * gas
            how = f"HF Trainer rule world_size*micro_batch*grad_accum = {world_size}*{mb}*{gas}"
            vals["train_batch_size"] = tb
            r.auto["train_batch_size"] = {"value": tb, "how": how}
            r.add("DS006", "info", "train_batch_size", f"train_batch_size = \"auto\" -> {tb} ({how})", "auto")
        else:
            vals["train_batch_size"] = None
            how = "needs world size, micro batch and gradient accumulation"
            r.auto["train_batch_size"] = {"value": None, "how": "unresolved: " + how}
            r.add("DS007", "warning", "train_batch_size",
                  f"train_batch_size = \"auto\" cannot be resolved yet ({how}); DeepSpeed's fill-in "
                  "rule derives it when the other two are known", "auto")

    tb, mb, gas = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if tb is None and mb is None:
        if "train_batch_size" not in raw and "train_micro_batch_size_per_gpu" not in raw:
            r.add("DS008", "warning", "train_micro_batch_size_per_gpu",
                  "neither train_batch_size nor train_micro_batch_size_per_gpu is set: "
                  "deepspeed.initialize asserts 'Either train_batch_size or "
                  "train_micro_batch_size_per_gpu needs to be provided' unless a launcher "
                  "(HF Trainer, Accelerate) fills them", None)
        return tb, mb, gas
    if world_size is None:
        if tb is not None and mb is not None and gas is not None and tb % (mb * gas) != 0:
            r.add("DS008", "error", "train_batch_size",
                  f"batch sizes are inconsistent for every world size: train_batch_size={tb} is "
                  f"not a multiple of train_micro_batch_size_per_gpu={mb} * "
                  f"gradient_accumulation_steps={gas} (= {mb * gas}); DeepSpeed asserts "
                  "train_batch_size == micro_batch * grad_accum * world_size", tb)
        return tb, mb, gas
    ws = int(world_size)
    # DeepSpeedConfig._set_batch_related_parameters (integer floor division).
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // ws
    elif tb is not None and gas is not None:
        mb = tb // ws // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
    elif tb is not None:
        gas, mb = 1, tb // ws
    elif mb is not None:
        tb, gas = mb * ws, 1
    for key, final in (("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", gas)):
        if raw.get(key) is None and given[key] is not None and final is not None and final != given[key]:
            r.add("DS008", "warning", key,
                  f"{key} is not in the config; DeepSpeed's fill-in rule gives {final} "
                  f"(train_batch_size={tb}, world_size={ws}) but {flags[key]} {given[key]} was "
                  "given; the fill-in value is used", final)
    # DeepSpeedConfig._batch_assertion
    if mb is not None and mb <= 0 or gas is not None and gas <= 0:
        r.add("DS008", "error", "train_batch_size",
              f"batch sizes: train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, "
              f"gradient_accumulation_steps={gas} with world_size={ws}: DeepSpeed's fill-in "
              "gives a value that is not > 0 (train_batch_size too small for the world size)", tb)
    elif tb != mb * gas * ws:
        r.add("DS008", "error", "train_batch_size",
              f"batch sizes are inconsistent: train_batch_size={tb} != "
              f"train_micro_batch_size_per_gpu={mb} * gradient_accumulation_steps={gas} * "
              f"world_size={ws} (= {mb * gas * ws}); DeepSpeed asserts", tb)
    return tb, mb, gas


def _read_precision(r: _Reader, raw: dict[str, Any], precision: str | None) -> tuple[str, str]:
    def enabled_of(block_key: str, keys: frozenset[str]) -> bool | None:
        block = raw.get(block_key)
        if block is None:
            return False
        if not isinstance(block, dict):
            r.add("DS003", "error", block_key, f"{block_key} = {_fmt(block)}: expected an object "
                  f"such as {{\"enabled\": true}}, got {_json_type(block)}; treated as disabled", block)
            return False
        fields = _FP16_FIELDS if keys is _FP16_KEYS else _BF16_FIELDS
        for k, v in block.items():
            if k not in keys:
                r.unknown(f"{block_key}.{k}", keys, "error",
                          f"DeepSpeed's {block_key} config forbids extra keys")
            elif k != "enabled" and not _is_auto(v):
                typ, default = fields[k]
                if typ is float and isinstance(v, bool):  # fp16.loss_scale rejects bools
                    r.add("DS003", "error", f"{block_key}.{k}", f"{block_key}.{k} = {_fmt(v)}: "
                          "expected a number, not a boolean; DeepSpeed rejects it", v)
                else:
                    r.value(f"{block_key}.{k}", v, typ, [], default)
        v = block.get("enabled", False)
        if _is_auto(v):
            return None
        return bool(r.value(f"{block_key}.enabled", v, bool, [], False))

    fp16 = enabled_of("fp16", _FP16_KEYS)
    bf_key = "bf16"
    if "bf16" not in raw and "bfloat16" in raw:
        bf_key = "bfloat16"
        r.add("DS002", "warning", "bfloat16",
              "bfloat16 is the legacy name of the bf16 block; DeepSpeed still reads it; rename it to bf16",
              None)
    elif "bf16" in raw and "bfloat16" in raw:
        r.add("DS010", "warning", "bfloat16",
              "both bf16 and the legacy bfloat16 block are given: DeepSpeed reads bf16 and ignores "
              "bfloat16", None)
    bf16 = enabled_of(bf_key, _BF16_KEYS)

    for name, state in (("fp16", fp16), (bf_key, bf16)):
        if state is None:
            short = "fp16" if name == "fp16" else "bf16"
            if precision == short:
                how = f"HF Trainer fills it from --{short}; precision {short} was given"
                value = True
            else:
                how = ("HF Trainer fills it from its training arguments; no precision was given, "
                       "so not enabled" if precision is None else
                       f"precision {precision} was given, so not enabled")
                value = False
            r.auto[f"{name}.enabled"] = {"value": value, "how": how}
            r.add("DS006", "info", f"{name}.enabled", f"{name}.enabled = \"auto\" -> {_fmt(value)} ({how})", "auto")
            if name == "fp16":
                fp16 = value
            else:
                bf16 = value

    if fp16 and bf16:
        r.add("DS005", "error", "fp16.enabled",
              "fp16 and bf16 are both enabled: DeepSpeed asserts 'bfloat16 and fp16 modes cannot be "
              "simultaneously enabled'; zeroplan plans with bf16", True)
        return "bf16", f"{bf_key}.enabled and fp16.enabled are both true (invalid); assuming bf16"
    if bf16:
        return "bf16", f"{bf_key}.enabled = true"
    if fp16:
        return "fp16", "fp16.enabled = true"
    ta = raw.get("torch_autocast")
    if isinstance(ta, dict) and ta.get("enabled") is True:
        r.add("DS010", "info", "torch_autocast",
              "torch_autocast is enabled: parameters, gradients and optimizer states stay fp32 "
              "(compute autocasts); zeroplan plans fp32 model states", None)
        return "fp32", "torch_autocast enabled, no fp16/bf16 block: fp32 model states"
    if "fp16" in raw or bf_key in raw:
        return "fp32", "fp16/bf16 blocks present but not enabled: fp32 (DeepSpeed default)"
    return "fp32", "no fp16/bf16 block: fp32 (DeepSpeed default)"


def _read_top_level(r: _Reader, raw: dict[str, Any]) -> None:
    for k in raw:
        if k in _TOP_REMOVED:
            r.add("DS009", "error", k, f"{k}: {_TOP_REMOVED[k]} in DeepSpeed {DEEPSPEED_VERSION}, "
                  "which raises DeepSpeedConfigError for this key; remove it", None)
        elif k not in TOP_LEVEL_KEYS and k != ZEROPLAN_KEY:
            r.unknown(k, TOP_LEVEL_KEYS, "warning", "DeepSpeed ignores it")


def _read_optimizer(r: _Reader, raw: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    opt = raw.get("optimizer")
    if opt is None:
        return None, {}
    if not isinstance(opt, dict):
        r.add("DS003", "error", "optimizer", f"optimizer = {_fmt(opt)}: expected an object such as "
              "{\"type\": \"AdamW\", \"params\": {...}}", opt)
        return None, {}
    for k in opt:
        if k not in _OPTIMIZER_KEYS:
            r.unknown(f"optimizer.{k}", _OPTIMIZER_KEYS, "warning", "DeepSpeed ignores it")
    typ = opt.get("type")
    if typ is not None and not isinstance(typ, str):
        r.add("DS003", "error", "optimizer.type", f"optimizer.type = {_fmt(typ)}: expected a string "
              "such as \"AdamW\"", typ)
        typ = None
    if isinstance(typ, str) and typ.lower() in _DS_OPTIMIZERS:
        typ = typ.lower()
    params = opt.get("params") if typ is not None else None
    if params is None:
        params = {}
    if not isinstance(params, dict):
        r.add("DS003", "error", "optimizer.params", f"optimizer.params = {_fmt(params)}: expected an "
              "object", params)
        params = {}
    autos = sorted(k for k, v in params.items() if _is_auto(v))
    if autos:
        for k in autos:
            r.auto[f"optimizer.params.{k}"] = {"value": None, "how": "left for the launcher (HF Trainer "
                                                "fills it from its training arguments); no effect on the plan"}
        r.add("DS006", "info", "optimizer.params",
              f"optimizer.params {', '.join(autos)} = \"auto\": filled by the HF Trainer from its "
              "training arguments; they do not change memory or communication", None)
    mgn = params.get("max_grad_norm")
    if isinstance(mgn, (int, float)) and not isinstance(mgn, bool) and mgn > 0:
        r.add("DS010", "warning", "optimizer.params.max_grad_norm",
              f"optimizer.params.max_grad_norm = {mgn} is not supported as an optimizer parameter; "
              "DeepSpeed asks for the top-level gradient_clipping instead", mgn)
    sched = raw.get("scheduler")
    if isinstance(sched, dict):
        for k in sched:
            if k not in _SCHEDULER_KEYS:
                r.unknown(f"scheduler.{k}", _SCHEDULER_KEYS, "warning", "DeepSpeed ignores it")
    elif sched is not None:
        r.add("DS003", "error", "scheduler", f"scheduler = {_fmt(sched)}: expected an object", sched)
    return typ, dict(params)


def _read_clipping(r: _Reader, raw: dict[str, Any]) -> float:
    v = raw.get("gradient_clipping", 0.0)
    if _is_auto(v):
        how = "HF Trainer fills it from max_grad_norm (default 1.0); assumed 1.0"
        r.auto["gradient_clipping"] = {"value": 1.0, "how": how}
        r.add("DS006", "info", "gradient_clipping", f"gradient_clipping = \"auto\" -> 1.0 ({how})", v)
        return 1.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        r.add("DS003", "error", "gradient_clipping",
              f"gradient_clipping = {_fmt(v)}: expected a number >= 0 (0 = off); using 0", v)
        return 0.0
    return float(v)


def _read_comm_dtype(r: _Reader, raw: dict[str, Any]) -> str | None:
    v = raw.get("communication_data_type")
    if v is None:
        return None
    if isinstance(v, str) and v.lower() in ("fp16", "bf16", "fp32"):
        return v.lower()
    r.add("DS010", "error", "communication_data_type",
          f"communication_data_type = {_fmt(v)}: DeepSpeed supports 'fp16', 'bf16', 'fp32' "
          "(raises ValueError otherwise); using the training precision", v)
    return None


def load_ds_config(source: str | Path | dict, *, strict: bool = False,
                   hidden_size: int | None = None, micro_batch: int | None = None,
                   grad_accum: int | None = None, world_size: int | None = None,
                   precision: str | None = None) -> DSConfig:
    """Read a DeepSpeed config (path, JSON text starting with ``{``, or a dict).

    ``hidden_size`` resolves the HF "auto" bucket keys; ``micro_batch`` / ``grad_accum`` /
    ``world_size`` (data-parallel GPUs) resolve "auto" batch keys and enable DeepSpeed's batch
    fill-in and consistency check; ``precision`` ("fp16"/"bf16"/"fp32") resolves
    ``fp16/bf16.enabled: "auto"``. Non-strict: every problem is a Finding and unusable values
    fall back to DeepSpeed's default. Strict: errors (and DS001/DS003/DS004) raise InputError.
    Malformed JSON always raises InputError with file, line and column.
    """
    path: str | None = None
    used_ext = False
    if isinstance(source, dict):
        where = "<config dict>"
        try:  # a deep copy that also makes it JSON-shaped (string keys, lists), as a file would be
            raw = json.loads(json.dumps(source, allow_nan=True))
        except (TypeError, ValueError, RecursionError) as exc:
            raise InputError(f"{where}: not JSON-serialisable: {exc}") from None
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        where = "<config text>"
        raw, used_ext = parse_ds_json(source, where)
    elif isinstance(source, (str, Path)):
        path = str(source)
        where = path
        text = read_text_file(source, "DeepSpeed config")
        raw, used_ext = parse_ds_json(text, where)
    else:
        raise InputError(f"DeepSpeed config: expected a path, JSON text or dict, got {type(source).__name__}")
    for name, val in (("hidden_size", hidden_size), ("micro_batch", micro_batch),
                      ("grad_accum", grad_accum), ("world_size", world_size)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
            raise InputError(f"{where}: {name} = {val!r}: expected a positive integer")
    if precision is not None and precision not in ("fp32", "bf16", "fp16"):
        raise InputError(f"{where}: precision = {precision!r}: expected fp32, bf16 or fp16")

    r = _Reader(where, path or "", strict)
    if used_ext:
        r.add("DS011", "warning", "",
              "the file uses comments or trailing commas: DeepSpeed (hjson) accepts them, but "
              "json.load-based readers such as Accelerate's HfDeepSpeedConfig reject the file", None)
    _read_top_level(r, raw)
    zero = _read_zero(r, raw, raw.get("zero_optimization"), hidden_size)
    prec, prec_source = _read_precision(r, raw, precision)
    opt_type, opt_params = _read_optimizer(r, raw)
    clipping = _read_clipping(r, raw)
    comm = _read_comm_dtype(r, raw)
    tb, mb, gas = _read_batch(r, raw, micro_batch, grad_accum, world_size)
    r.raise_if_strict()
    return DSConfig(
        path=path, raw=raw, zero=zero, precision=prec, precision_source=prec_source,
        optimizer_type=opt_type, optimizer_params=opt_params, gradient_clipping=clipping,
        train_batch_size=tb, micro_batch=mb, grad_accum=gas, communication_data_type=comm,
        auto_resolved=r.auto, findings=r.findings,
    )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

# Keys shown even at their default, because users look for them in a ZeRO config.
_ALWAYS_SHOWN = {
    1: ("stage", "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size"),
    2: ("stage", "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size"),
    3: ("stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size",
        "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "sub_group_size", "gather_16bit_weights_on_model_save"),
    0: ("stage",),
}


def _zero_to_dict(zero: ZeroConfig) -> dict[str, Any]:
    defaults = ZeroConfig(stage=zero.stage)
    shown = _ALWAYS_SHOWN[zero.stage]
    out: dict[str, Any] = {}
    for name in ZeroConfig.model_fields:
        value = getattr(zero, name)
        if name in ("offload_optimizer", "offload_param"):
            if value.device == "none":
                continue
            d = {"device": value.device}
            dflt = type(value)()
            for sub in type(value).model_fields:
                if sub == "device":
                    continue
                sv = getattr(value, sub)
                if sub == "pin_memory" or sv != getattr(dflt, sub):
                    d[sub] = sv
            out[name] = d
            continue
        if name not in shown and value == getattr(defaults, name):
            continue
        out[_ZERO_CANONICAL_TO_ALIAS.get(name, name)] = copy.deepcopy(value)
    return out


def build_ds_config(zero: ZeroConfig, *, precision: str, micro_batch: int, grad_accum: int,
                    world_size: int, optimizer_type: str | None = "AdamW",
                    base: dict | None = None) -> dict[str, Any]:
    """A DeepSpeed config dict for ``zero`` (replacing any zero block in ``base``).

    Only non-default zero keys plus the ones users expect to see are written (stage-3 keys under
    their ``stage3_*`` names, as DeepSpeed's docs show them). Batch keys satisfy DeepSpeed's
    ``train_batch_size = micro_batch * grad_accum * world_size``. ``optimizer_type=None`` keeps
    ``base``'s optimizer block as is.
    """
    if precision not in ("fp32", "bf16", "fp16"):
        raise InputError(f"precision {precision!r}: expected fp32, bf16 or fp16")
    for name, val in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise InputError(f"{name} = {val!r}: expected a positive integer")
    cfg: dict[str, Any] = copy.deepcopy(base) if base else {}
    if "bfloat16" in cfg:  # legacy name of the bf16 block: fold it in
        legacy = cfg.pop("bfloat16")
        if "bf16" not in cfg:
            cfg["bf16"] = legacy
    cfg["train_batch_size"] = micro_batch * grad_accum * world_size
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    for block in ("fp16", "bf16"):
        current = cfg.get(block)
        if block == precision:
            cfg[block] = dict(current if isinstance(current, dict) else {}, enabled=True)
        elif isinstance(current, dict):
            cfg[block] = dict(current, enabled=False)
        elif block in cfg:
            del cfg[block]
    if optimizer_type is not None:
        opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else {}
        params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
        cfg["optimizer"] = {"type": optimizer_type, "params": dict(params)}
    cfg["zero_optimization"] = _zero_to_dict(zero)
    return cfg


def write_ds_config(path: str | Path, config: dict[str, Any]) -> None:
    """Write ``config`` as pretty JSON (2-space indent, trailing newline), atomically."""
    try:
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: cannot write DeepSpeed config as JSON: {exc}") from None
    atomic_write_text(path, text)


# --------------------------------------------------------------------------------------------
# Diffing
# --------------------------------------------------------------------------------------------

class _Absent:
    """Marks a key missing on one side of a diff (distinct from JSON null)."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "(absent)"

    def __bool__(self) -> bool:
        return False


ABSENT = _Absent()


def diff_ds_configs(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Differences between two config dicts: ``(dotted key, old value, new value)``.

    Nested objects are walked; lists and scalars compare whole. A key missing on one side has
    the value ``ABSENT``. Keys are compared as written (no alias normalisation); ``2e8`` and
    ``200000000`` are equal (same number). Sorted by key.
    """
    out: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                key = f"{prefix}.{k}" if prefix else str(k)
                walk(key, a.get(k, ABSENT), b.get(k, ABSENT))
            return
        if type(a) is bool or type(b) is bool:
            same = type(a) is type(b) and a == b
        else:
            same = a == b
        if not same:
            out.append((prefix, a, b))

    walk("", old, new)
    return out
