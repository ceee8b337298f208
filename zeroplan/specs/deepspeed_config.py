"""Read and write DeepSpeed JSON configs the way DeepSpeed 0.19.8 reads them.

zeroplan never imports DeepSpeed; this package of modules is its own reader. What it mirrors (read from
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

Rule IDs of the findings the reader emits (severity in brackets is the usual one; ``strict=True``
turns every error, and every DS001/DS003/DS004 finding, into an ``InputError``):

| rule  | severity         | meaning |
|-------|------------------|---------|
| DS001 | warning / error  | unknown key. Top level, optimizer/scheduler blocks, ``timers`` and ``data_types``: DeepSpeed ignores it (warning). Inside ``zero_optimization``, ``offload_*``, ``fp16``, ``bf16``, ``timers.throughput``: DeepSpeed's pydantic ``extra="forbid"`` rejects it (error), unless it holds ``"auto"``, which ``DeepSpeedConfigModel.__init__`` drops first (warning). |
| DS002 | warning / error  | deprecated key mapped to its replacement (``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory`` (value not transferred), ``stage3_gather_fp16_weights_on_model_save``, legacy ``bfloat16`` block, boolean ``zero_optimization``). Error when the replacement key is given too (DeepSpeed asserts). |
| DS003 | error / warning  | wrong type. Error: DeepSpeed rejects it, the default is used; this includes a present section that is not an object (``"scheduler": null``, ``"fp16": []``) and a scalar DeepSpeed cannot use (``"wall_clock_breakdown": "1"``), per ``ds_shapes``. Warning: DeepSpeed's lax coercion accepts it (``"true"`` for a bool, ``"8"`` for an int); the coerced value is used. |
| DS004 | error            | fractional number for an integer field (pydantic ``int_from_float``); the default is used. |
| DS005 | error            | fp16 and bf16 both enabled (DeepSpeed: 'bfloat16 and fp16 modes cannot be simultaneously enabled'); zeroplan plans with bf16. |
| DS006 | info             | an ``"auto"`` value resolved (HF Trainer rule or DeepSpeed dropping it); see ``DSConfig.auto_resolved``. |
| DS007 | warning          | an ``"auto"`` value zeroplan cannot resolve (no hidden size / batch numbers / precision given, ``stage: "auto"``); DeepSpeed's own behaviour (default) is used. |
| DS008 | error / warning  | batch sizes: ``train_batch_size != micro_batch * grad_accum * world_size``, a non-positive value (error), neither ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` given, or a value that differs from what the caller passed (warning). |
| DS009 | error            | a key DeepSpeed 0.19.8 removed and now rejects (MiCS ``mics_shard_size``, ``mics_hierarchical_params_gather``, LoCo ``zeropp_loco_param``; top-level ``amp``, ``elasticity``, ``sparse_attention``, ...). |
| DS010 | error / warning  | invalid value: out of bounds (``reduce_bucket_size <= 0``, negative sizes, stage not in 0..3, ``ratio`` outside [0, 1]), partial offload ``ratio < 1`` below stage 3, ``nvme`` without ``nvme_path``, odd ``allgather_bucket_size`` at stage 1/2, ``compute_grad_norm=false`` outside stage 1/2, unknown ``communication_data_type`` / ``seq_parallel_communication_data_type`` / ``gradient_allreduce_op`` / ``checkpoint.tag_validation``, ``gradient_allreduce_op: "sum"`` with ZeRO-3, ZenFlow or DeepCompile, ``fp16.loss_scale < 0``, ``fp16.loss_scale_window`` / ``min_loss_scale`` <= 0 with dynamic loss scaling, a key given under both its name and its alias (errors); settings with no effect at this stage (``offload_param`` below stage 3, ZeRO++ keys below stage 3, ``offload_optimizer`` at stage 0) and ``optimizer.params.max_grad_norm`` (warnings). |
| DS011 | warning          | the file uses comments or trailing commas: DeepSpeed (hjson) accepts them, ``json.load``-based readers (Accelerate's ``HfDeepSpeedConfig``) do not. |

Where each part lives (specs/): ``ds_schema`` (the pydantic models with DeepSpeed's defaults,
``RULES``, ``DEEPSPEED_VERSION``), ``ds_keys`` (the key tables: aliases, deprecated and removed
keys, top-level keys, fp16/bf16 fields), ``ds_shapes`` (what DeepSpeed needs of each section and
dereferenced scalar: an object, a bool, one of some strings), ``ds_parse`` (hjson with the duplicate-key
hook, line and column in errors), ``ds_findings`` (the findings collector and value typing), ``ds_zero``
(``zero_optimization`` and hpZ), ``ds_batch_precision`` (batch keys, fp16/bf16), ``ds_optimizer``
(optimizer, scheduler, clipping), ``ds_reader`` (``load_ds_config``), ``ds_writer``
(``build_ds_config``, ``write_ds_config``) and ``ds_diff`` (``diff_ds_configs``). This module
re-exports their names, public and private, so ``from zeroplan.specs.deepspeed_config import ...``
keeps working.
"""

from __future__ import annotations

from zeroplan._util import InputError, atomic_write_text, read_text_file  # noqa: F401 - re-exported
from zeroplan.specs.ds_batch_precision import _read_batch, _read_int_key, _read_precision  # noqa: F401
from zeroplan.specs.ds_diff import ABSENT, _Absent, diff_ds_configs  # noqa: F401
from zeroplan.specs.ds_findings import (  # noqa: F401
    _expected_text,
    _field_spec,
    _fmt,
    _is_auto,
    _Reader,
)
from zeroplan.specs.ds_keys import (  # noqa: F401
    _BATCH_KEYS,
    _BF16_FIELDS,
    _BF16_KEYS,
    _DS_OPTIMIZERS,
    _FP16_FIELDS,
    _FP16_KEYS,
    _LEAF_MODULE_KEYS,
    _OPTIMIZER_KEYS,
    _SCHEDULER_KEYS,
    _TOP_REMOVED,
    _ZENFLOW_KEYS,
    _ZERO_ALIASES,
    _ZERO_CANONICAL_TO_ALIAS,
    _ZERO_DEPRECATED,
    _ZERO_REMOVED,
    TOP_LEVEL_KEYS,
    ZEROPLAN_KEY,
)
from zeroplan.specs.ds_optimizer import _check_optimizer_numbers, _read_clipping, _read_optimizer  # noqa: F401
from zeroplan.specs.ds_parse import (  # noqa: F401
    _INT64_MAX,
    _NONFINITE,
    _check_number_range,
    _key_position,
    _line_col,
    _strict_json,
    parse_ds_json,
)
from zeroplan.specs.ds_reader import _read_comm_dtype, _read_top_level, load_ds_config  # noqa: F401
from zeroplan.specs.ds_schema import (  # noqa: F401
    _DEFAULT_LEAF_MODULE_CLASSES,
    DEEPSPEED_VERSION,
    RULES,
    DSConfig,
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    _alias,
    _default_leaf_module,
    zero_or_default,
)
from zeroplan.specs.ds_shapes import SCALARS, SECTIONS, Shape, check_shapes  # noqa: F401
from zeroplan.specs.ds_writer import _ALWAYS_SHOWN, _zero_to_dict, build_ds_config, write_ds_config  # noqa: F401
from zeroplan.specs.ds_zero import (  # noqa: F401
    _apply_deprecated,
    _check_hpz,
    _check_zero,
    _plain,
    _read_dict_block,
    _read_offload,
    _read_zero,
    _zero_auto,
    hpz_group_size,
)
from zeroplan.specs.findings import Finding  # noqa: F401 - re-exported

__all__ = [
    "DEEPSPEED_VERSION",
    "RULES",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "zero_or_default",
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
