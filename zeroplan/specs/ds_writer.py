"""Writing a DeepSpeed config: ``build_ds_config`` turns a ``ZeroConfig`` plus precision and batch
sizes into a config dict (non-default zero keys, stage-3 keys under their ``stage3_*`` names,
batch keys that satisfy DeepSpeed's assertion); ``write_ds_config`` writes it as pretty JSON,
atomically.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from zeroplan._util import InputError, atomic_write_text
from zeroplan.specs.ds_keys import _ZERO_CANONICAL_TO_ALIAS
from zeroplan.specs.ds_schema import ZeroConfig

__all__ = ["build_ds_config", "write_ds_config"]


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


def ds_config_text(path: str | Path, config: dict[str, Any]) -> str:
    """``config`` as pretty JSON (2-space indent, trailing newline); InputError naming ``path``."""
    try:
        return json.dumps(config, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: cannot write DeepSpeed config as JSON: {exc}") from None


def write_ds_config(path: str | Path, config: dict[str, Any]) -> None:
    """Write ``config`` as pretty JSON (2-space indent, trailing newline), atomically."""
    atomic_write_text(path, ds_config_text(path, config))
