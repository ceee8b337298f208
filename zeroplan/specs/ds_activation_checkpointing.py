"""The top-level ``activation_checkpointing`` block, read as DeepSpeed 0.19.8 reads it.

DeepSpeed reads each key with ``get_scalar_param`` (deepspeed/runtime/activation_checkpointing/
config.py ``DeepSpeedActivationCheckpointingConfig._initialize``): no type check, the value is used as
given (a truthy string switches a flag on), unknown keys are ignored. ``configure`` (checkpointing.py)
asserts that ``contiguous_memory_optimization`` comes with ``partition_activations``.
"""

from __future__ import annotations

from typing import Any

from zeroplan.specs.ds_findings import _fmt, _Reader
from zeroplan.specs.ds_schema import ActivationCheckpointingConfig

__all__ = ["read_activation_checkpointing"]

_KEY = "activation_checkpointing"
_FLAGS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
          "synchronize_checkpoint_boundary", "profile")


def read_activation_checkpointing(r: _Reader, raw: dict[str, Any]) -> ActivationCheckpointingConfig:
    """The block's values (DeepSpeed's defaults where absent), with a finding for each oddity."""
    block = raw.get(_KEY)
    if not isinstance(block, dict):  # absent, or a shape ds_shapes refused: DeepSpeed's defaults
        return ActivationCheckpointingConfig()
    known = (*_FLAGS, "number_checkpoints")
    values: dict[str, Any] = {}
    for k, v in block.items():
        if k not in known:
            r.unknown(f"{_KEY}.{k}", list(known), "warning", "DeepSpeed ignores it")
        elif k == "number_checkpoints":
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                r.add("DS003", "warning", f"{_KEY}.{k}", f"{_KEY}.{k} = {_fmt(v)}: expected a positive integer "
                      "(the number of checkpointed layers; deepspeed.checkpointing.configure sizes its buffers "
                      "with it); ignored", v)
            else:
                values[k] = v
        else:
            if not isinstance(v, bool):
                r.add("DS003", "warning", f"{_KEY}.{k}", f"{_KEY}.{k} = {_fmt(v)}: expected true or false; "
                      f"DeepSpeed uses the value as given (get_scalar_param), so it counts as {bool(v)}", v)
            values[k] = bool(v)
    cfg = ActivationCheckpointingConfig(**values)
    if cfg.contiguous_memory_optimization and not cfg.partition_activations:
        # a warning, not an error: the assertion fires only in deepspeed.checkpointing.configure, which a
        # Megatron-style script calls and transformers' checkpointing does not
        r.add("DS010", "warning", f"{_KEY}.contiguous_memory_optimization",
              f"{_KEY}.contiguous_memory_optimization without partition_activations: DeepSpeed asserts "
              "'Contiguous Checkpointing is only available with partitioned activations' when the script "
              "configures deepspeed.checkpointing", True)
    return cfg
