"""The batch keys and the precision blocks of a DeepSpeed 0.19.8 config.

Batch keys: ``_set_batch_related_parameters`` (integer floor division) and ``_batch_assertion``
``train_batch_size == micro_batch * grad_accum * world_size`` (data-parallel world size), with the
HF Trainer filling "auto" values from its training arguments. Precision: ``fp16`` / ``bf16``
(legacy alias ``bfloat16``) blocks; both enabled is DeepSpeed's assertion 'bfloat16 and fp16 modes
cannot be simultaneously enabled'; neither -> fp32 (``torch_autocast`` keeps fp32 model states); the
``data_types`` dtypes are then checked against that precision (ds_shapes.check_data_types).
"""

from __future__ import annotations

import math
from typing import Any

from zeroplan._util import data_kind
from zeroplan.specs.ds_findings import _fmt, _is_auto, _Reader
from zeroplan.specs.ds_keys import _BATCH_KEYS, _BF16_FIELDS, _FP16_FIELDS, _Field
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION
from zeroplan.specs.ds_shapes import check_data_types


def _read_int_key(r: _Reader, key: str, raw: Any) -> int | None:
    """Top-level integer (batch keys): DeepSpeed reads them raw (get_scalar_param); zeroplan wants clean ints."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        return _read_bool_batch_key(r, key, raw)
    if not isinstance(raw, (int, float)):
        r.add("DS003", "error", key, f"{key} = {_fmt(raw)}: expected a positive integer, got "
              f"{data_kind(raw)}", raw)
        return None
    if isinstance(raw, float):
        if not math.isfinite(raw) or raw != int(raw):
            r.add("DS004", "error", key, f"{key} = {_fmt(raw)}: expected a positive integer, got "
                  f"{data_kind(raw)}", raw)
            return None
        raw = int(raw)
    if raw <= 0:
        r.add("DS008", "error", key, f"{key} = {raw}: has to be greater than 0 (DeepSpeed "
              "asserts)", raw)
        return None
    return raw


def _read_bool_batch_key(r: _Reader, key: str, raw: bool) -> int | None:
    """A batch key written true/false. A bool is an int in Python and DeepSpeedConfig uses the value as
    given: ``_set_batch_related_parameters`` multiplies and floor-divides it, ``_batch_assertion`` checks
    ``> 0`` and ``train_batch == micro_batch * grad_acc * world_size``. So true is 1 (training runs), false is
    0 (the ``> 0`` assertion fails)."""
    if not raw:
        r.add("DS008", "error", key, f"{key} = false: expected a positive integer; DeepSpeed {DEEPSPEED_VERSION} "
              "takes false as 0 and asserts it is greater than 0 (DeepSpeedConfig._batch_assertion)", raw)
        return None
    loader = ""
    if key == "train_micro_batch_size_per_gpu":  # runtime/dataloader.py DeepSpeedDataLoader -> torch DataLoader
        loader = ("; but DeepSpeed's own data loader (deepspeed.initialize(training_data=...), "
                  "DeepSpeedEngine.deepspeed_io) fails when iterated: torch's BatchSampler refuses batch_size=True")
    r.add("DS003", "warning", key, f"{key} = true: expected a positive integer, got a boolean; DeepSpeed "
          f"{DEEPSPEED_VERSION} takes true as 1 (a bool is an int: DeepSpeedConfig._batch_assertion accepts "
          f"true > 0 and true == 1 in the batch product){loader}; write 1 instead", raw)
    return 1


_BATCH_FLAGS = {"train_micro_batch_size_per_gpu": "--micro-batch", "gradient_accumulation_steps": "--grad-accum"}


def _batch_values(r: _Reader, raw: dict[str, Any], given: dict[str, int | None],
                  world_size: int | None) -> dict[str, Any]:
    """The three batch keys as written, each "auto" resolved as the HF Trainer would (or None)."""
    vals: dict[str, Any] = {}
    explicit: dict[str, int | None] = {}
    flags = _BATCH_FLAGS
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
    return vals


def _read_batch(r: _Reader, raw: dict[str, Any], micro_batch: int | None,
                grad_accum: int | None, world_size: int | None) -> tuple[int | None, int | None, int | None]:
    given = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum}
    vals = _batch_values(r, raw, given, world_size)

    tb, mb, gas = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if tb is None and mb is None:
        # get_scalar_param: a null is read as the key's absence
        if raw.get("train_batch_size") is None and raw.get("train_micro_batch_size_per_gpu") is None:
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
    return _fill_batch(r, raw, given, tb, mb, gas, int(world_size))


def _fill_batch(r: _Reader, raw: dict[str, Any], given: dict[str, int | None], tb: int | None,
                mb: int | None, gas: int | None, ws: int) -> tuple[int | None, int | None, int | None]:
    """DeepSpeed's fill-in rule and batch assertion, with the data-parallel world size known."""
    flags = _BATCH_FLAGS
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


def _read_precision_block(r: _Reader, raw: dict[str, Any], block_key: str,
                          fields: dict[str, _Field]) -> tuple[bool | None, dict[str, Any]]:
    """One fp16/bf16 block: (enabled, None for "auto"; the other fields given, validated)."""
    block = raw.get(block_key)
    if not isinstance(block, dict):  # absent or null; any other shape: ds_shapes refused it
        return False, {}
    values: dict[str, Any] = {}
    for k, v in block.items():
        key = f"{block_key}.{k}"
        if k not in fields:
            model = "DeepSpeedFP16Config" if block_key == "fp16" else "DeepSpeedBF16Config"
            r.extra_key(key, v, frozenset(fields), model)  # extra="forbid"; an "auto" value is dropped first
        elif k != "enabled" and not _is_auto(v):  # "auto": DeepSpeedConfigModel drops it, the default is used
            f = fields[k]
            if f.refuses_bool and isinstance(v, bool):  # DeepSpeedFP16Config's before-validators
                r.add("DS003", "error", key, f"{key} = {_fmt(v)}: expected a number, not a boolean; DeepSpeed "
                      f"rejects it (DeepSpeedFP16Config); using the default {_fmt(f.default)}", v)
            else:
                values[k] = r.value(key, v, f.type, list(f.metadata), f.default)
    v = block.get("enabled", False)
    if _is_auto(v):
        return None, values
    return bool(r.value(f"{block_key}.enabled", v, bool, [], False)), values


def _check_dynamic_loss_scale(r: _Reader, values: dict[str, Any]) -> None:
    """DeepSpeedFP16Config._validate_dynamic_loss_scale_params: with fp16 enabled and loss_scale 0 (dynamic
    loss scaling), loss_scale_window and min_loss_scale must be > 0 (DynamicLossScaler divides by the one
    and floors the scale at the other)."""
    if values.get("loss_scale", _FP16_FIELDS["loss_scale"].default) != 0:
        return
    for k in ("loss_scale_window", "min_loss_scale"):
        v = values.get(k, _FP16_FIELDS[k].default)
        if v <= 0:
            r.add("DS010", "error", f"fp16.{k}",
                  f"fp16.{k} = {_fmt(v)}: expected an integer > 0 with dynamic loss scaling (fp16 enabled, "
                  "loss_scale 0); DeepSpeed rejects it (DeepSpeedFP16Config._validate_dynamic_loss_scale_params)", v)


def _resolve_auto_enabled(r: _Reader, name: str, precision: str | None) -> bool:
    """``fp16/bf16.enabled = "auto"``: what the HF Trainer fills in from its precision argument."""
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
    return value


def _read_precision(r: _Reader, raw: dict[str, Any], precision: str | None) -> tuple[str, str]:
    """The training precision and where it comes from; then the ``data_types`` dtypes DeepSpeed resolves
    against it at deepspeed.initialize (ds_shapes.check_data_types)."""
    prec, source = _precision(r, raw, precision)
    check_data_types(r, raw, prec)
    return prec, source


def _precision(r: _Reader, raw: dict[str, Any], precision: str | None) -> tuple[str, str]:
    fp16, fp16_values = _read_precision_block(r, raw, "fp16", _FP16_FIELDS)
    # DeepSpeed's get_bfloat16_config reads the legacy bfloat16 block when bf16 is absent or null
    bf_key = "bf16"
    if raw.get("bf16") is None and "bfloat16" in raw:
        bf_key = "bfloat16"
        r.add("DS002", "warning", "bfloat16",
              "bfloat16 is the legacy name of the bf16 block; DeepSpeed still reads it; rename it to bf16",
              None)
    elif "bf16" in raw and "bfloat16" in raw:
        r.add("DS010", "warning", "bfloat16",
              "both bf16 and the legacy bfloat16 block are given: DeepSpeed reads bf16 and ignores "
              "bfloat16", None)
    bf16, _ = _read_precision_block(r, raw, bf_key, _BF16_FIELDS)
    if fp16 is None:
        fp16 = _resolve_auto_enabled(r, "fp16", precision)
    if bf16 is None:
        bf16 = _resolve_auto_enabled(r, bf_key, precision)
    if fp16:
        _check_dynamic_loss_scale(r, fp16_values)

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
