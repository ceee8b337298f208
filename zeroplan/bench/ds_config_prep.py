"""DeepSpeed configs for the bench: ``make_ds_config`` (CPU training with a client torch AdamW) and
``prepare_ds_config`` (a user's config validated by zeroplan's strict reader and made runnable)
(split out of ``bench/deepspeed_engine.py``)."""

from __future__ import annotations

import json
from typing import Any

from zeroplan._util import InputError


def make_ds_config(*, stage: int, precision: str, micro_batch: int, grad_accum: int,
                   zero: dict | None = None, comms_logger: bool = True) -> dict:
    """A DeepSpeed config for CPU training with a client torch AdamW (no DeepSpeed CPU Adam)."""
    zo = {"stage": stage}
    zo.update(zero or {})
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": zo,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision != "fp32":
        raise InputError(f"precision {precision!r} is unknown; expected fp32, bf16 or fp16")
    if comms_logger:
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return cfg


def prepare_ds_config(ds_config: str | dict, *, nproc: int, micro_batch: int | None, grad_accum: int | None,
                      precision: str | None, hidden_size: int | None = None,
                      device: str = "cpu") -> tuple[dict, str, dict]:
    """Validate a DeepSpeed config with zeroplan's reader (strict) and make it runnable on CPU.

    Returns (config dict for ``deepspeed.initialize``, precision, AdamW kwargs). The config's own
    optimizer/scheduler blocks are replaced by a client ``torch.optim.AdamW`` with the same
    lr / betas / eps / weight_decay (DeepSpeed's fused and CPU Adam need compiled ops);
    batch keys are set from ``micro_batch`` / ``grad_accum`` (or the config's). On ``device``
    "cuda" the config's optimizer block and ``zero_force_ds_cpu_optimizer`` are kept: DeepSpeed
    builds FusedAdam (or DeepSpeedCPUAdam under offload) as it would for the user. Raises
    ``InputError`` (one line: file, key, value, expectation) before anything starts.
    """
    from zeroplan.specs.deepspeed_config import load_ds_config

    dsc = load_ds_config(ds_config, strict=True, hidden_size=hidden_size, micro_batch=micro_batch,
                         grad_accum=grad_accum, world_size=nproc, precision=precision)
    prec = precision or dsc.precision
    if prec not in ("fp32", "bf16", "fp16"):  # pragma: no cover - the reader guarantees it
        raise InputError(f"{dsc.path or '<config>'}: precision {prec!r}: expected fp32, bf16 or fp16")
    raw = json.loads(json.dumps(dsc.raw))  # plain copy
    mb = int(micro_batch or dsc.micro_batch or 1)
    gas = int(grad_accum or dsc.grad_accum or 1)
    optimizer_block = raw.get("optimizer")
    for key in ("train_batch_size", "optimizer", "scheduler", "comms_logger", "fp16", "bf16", "bfloat16", "amp"):
        raw.pop(key, None)
    raw["train_micro_batch_size_per_gpu"] = mb
    raw["gradient_accumulation_steps"] = gas
    # "auto" values: the value zeroplan's reader resolved (HF Trainer rules), else DeepSpeed's default
    for dotted, info in dsc.auto_resolved.items():
        *parents, leaf = str(dotted).split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(leaf) != "auto":
            continue
        value = info.get("value") if isinstance(info, dict) else None
        if value is None or value == "auto":
            node.pop(leaf)
        else:
            node[leaf] = value
    _drop_auto(raw)
    base = make_ds_config(stage=int(dsc.zero.stage), precision=prec, micro_batch=mb, grad_accum=gas)
    for k, v in base.items():
        if k != "zero_optimization":
            raw.setdefault(k, v)
    if device == "cuda" and isinstance(optimizer_block, dict):
        raw["optimizer"] = optimizer_block
        _drop_auto(raw["optimizer"])
        if "zero_force_ds_cpu_optimizer" in dsc.raw:
            raw["zero_force_ds_cpu_optimizer"] = dsc.raw["zero_force_ds_cpu_optimizer"]
        else:
            raw.pop("zero_force_ds_cpu_optimizer", None)
    else:
        raw["zero_force_ds_cpu_optimizer"] = False
    raw["zero_allow_untested_optimizer"] = True
    raw["comms_logger"] = base["comms_logger"]
    raw.setdefault("zero_optimization", {"stage": int(dsc.zero.stage)})
    op = {k: v for k, v in (dsc.optimizer_params or {}).items() if v != "auto"}  # "auto": torch's default
    adamw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.0}
    try:
        for key in ("lr", "weight_decay", "eps"):
            if key in op:
                adamw[key] = float(op[key])
        if "betas" in op:
            adamw["betas"] = tuple(float(b) for b in op["betas"])
    except (TypeError, ValueError):
        raise InputError(f"{dsc.path or '<config>'}: optimizer.params = {json.dumps(op)}: expected numbers "
                         "for lr / weight_decay / eps and two numbers for betas") from None
    return raw, prec, adamw


def _drop_auto(node: Any) -> None:
    """Remove any "auto" left (DeepSpeed itself drops them and uses its default)."""
    if isinstance(node, dict):
        for k in [k for k, v in node.items() if v == "auto"]:
            node.pop(k)
        for v in node.values():
            _drop_auto(v)
