"""The key tables of a DeepSpeed 0.19.8 config (runtime/config.py, constants.py, zero/config.py):
the ``stage3_*`` aliases, deprecated and removed keys, the top-level keys DeepSpeed reads, the
fp16/bf16 fields with their defaults and constraints, and the keys of the optimizer, scheduler,
leaf_module and zenflow blocks. Data only; the readers in ds_*.py use them (the shape each value
must have is in ds_shapes.py).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import Field

__all__ = ["TOP_LEVEL_KEYS", "ZEROPLAN_KEY"]

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


class _Field(NamedTuple):
    """One fp16/bf16 field: its pydantic type and default, its constraints (``Field(...).metadata``), and
    whether a DeepSpeed before-validator refuses true/false (pydantic alone would coerce them to 1/0)."""

    type: type
    default: bool | int | float
    metadata: tuple[object, ...] = ()
    refuses_bool: bool = False


# fp16 / bf16 blocks (runtime/precision_config.py DeepSpeedFP16Config / DeepSpeedBF16Config).
# loss_scale: DeepSpeedFP16Config._validate_loss_scale (not a bool, finite, >= 0);
# loss_scale_window, min_loss_scale: _reject_non_integer_scale_params (not a bool); both > 0 with
# dynamic loss scaling: _validate_dynamic_loss_scale_params (checked by the precision reader).
_FP16_FIELDS: dict[str, _Field] = {
    "enabled": _Field(bool, False), "auto_cast": _Field(bool, False),
    "loss_scale": _Field(float, 0.0, tuple(Field(ge=0, allow_inf_nan=False).metadata),
                         refuses_bool=True),
    "initial_scale_power": _Field(int, 16), "loss_scale_window": _Field(int, 1000, refuses_bool=True),
    "hysteresis": _Field(int, 2), "consecutive_hysteresis": _Field(bool, False),
    "min_loss_scale": _Field(int, 1, refuses_bool=True), "fp16_master_weights_and_grads": _Field(bool, False),
}
_BF16_FIELDS: dict[str, _Field] = {
    "enabled": _Field(bool, False), "immediate_grad_update": _Field(bool, False),
    "check_grad_overflow": _Field(bool, True), "bf16_master_weights_and_grads": _Field(bool, False),
    "bf16_optimizer_states": _Field(bool, False),
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

# timers (utils/config.py get_timers_config): only timers.throughput is read, into
# DeepSpeedThroughputTimerConfig (pydantic, extra="forbid"; both fields bool, default true).
_TIMERS_KEYS = frozenset({"throughput"})
_THROUGHPUT_TIMER_KEYS = frozenset({"enabled", "synchronized"})
# data_types (runtime/config.py DeepSpeedConfig._initialize_params: data_types.get(...) for these four;
# any other key is never read).
_DATA_TYPES_KEYS = frozenset({"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"})
# runtime/config.py DtypeEnum: the strings DtypeEnum(value) takes (case-sensitive), by zeroplan's dtype name.
_DTYPE_ENUM: dict[str, str] = {
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), "fp16"),
    **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), "fp32"),
    **dict.fromkeys(("torch.int8", "int8"), "int8"),
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), "bf16"),
}
