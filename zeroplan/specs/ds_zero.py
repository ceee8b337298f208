"""The ``zero_optimization`` section of a DeepSpeed 0.19.8 config, read and checked: every key with its
default, the ``stage3_*`` aliases, the offload blocks, HF Trainer's "auto" rules for the bucket keys,
the deprecated keys mapped to their replacements, the cross-field rules (DeepSpeed's validators and
runtime assertions, settings with no effect at the stage) and the hpZ group-size rule.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from zeroplan._util import data_kind
from zeroplan.specs.ds_findings import _field_spec, _fmt, _is_auto, _Reader
from zeroplan.specs.ds_keys import (
    _LEAF_MODULE_KEYS,
    _ZENFLOW_KEYS,
    _ZERO_ALIASES,
    _ZERO_DEPRECATED,
    _ZERO_REMOVED,
)
from zeroplan.specs.ds_schema import (
    DEEPSPEED_VERSION,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    _default_leaf_module,
)

__all__ = ["hpz_group_size"]


def _read_offload(r: _Reader, key: str, raw: Any, model: type[BaseModel]) -> BaseModel:
    """Read an offload_* block; None/absent -> device none."""
    if raw is None:
        return model()
    if not isinstance(raw, dict):
        r.add("DS003", "error", key,
              f"{key} = {_fmt(raw)}: expected an object such as {{\"device\": \"cpu\"}}, got "
              f"{data_kind(raw)}; DeepSpeed rejects it; using no offload", raw)
        return model()
    values: dict[str, Any] = {}
    fields = model.model_fields
    for k, v in raw.items():
        sub = f"{key}.{k}"
        if k not in fields:  # DeepSpeedZeroOffload{Optimizer,Param}Config: extra="forbid", "auto" dropped first
            r.extra_key(sub, v, list(fields), f"DeepSpeedZero{model.__name__}")
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


def _read_dict_block(r: _Reader, key: str, raw: Any, known: frozenset[str], model: str) -> dict[str, Any] | None:
    """A nested DeepSpeedConfigModel block (``model``): extra keys forbidden, "auto" values dropped."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.add("DS003", "error", key, f"{key} = {_fmt(raw)}: expected an object, got "
              f"{data_kind(raw)}; DeepSpeed rejects it; using the default", raw)
        return None
    out = {}
    for k, v in raw.items():
        if k not in known:
            r.extra_key(f"{key}.{k}", v, known, model)
            continue
        if _is_auto(v):
            continue
        out[k] = v
    return out


def _read_zero_bool(r: _Reader, raw_top: dict[str, Any], zero_raw: bool) -> ZeroConfig:
    """read_zero_config_deprecated: true -> stage 1 with allgather_size."""
    r.add("DS002", "warning", "zero_optimization",
          f"zero_optimization = {_fmt(zero_raw)}: the boolean form is deprecated; DeepSpeed "
          f"reads it as stage {1 if zero_raw else 0}; write {{\"stage\": "
          f"{1 if zero_raw else 0}}} instead", zero_raw)
    values: dict[str, Any] = {"stage": 1 if zero_raw else 0}
    if zero_raw:
        ann, meta, default = _field_spec(ZeroConfig, "allgather_bucket_size")
        ag = raw_top.get("allgather_size", default)  # DeepSpeed's ALLGATHER_SIZE_DEFAULT is the same 5e8
        values["allgather_bucket_size"] = r.value("allgather_size", ag, ann, meta, default)
    return ZeroConfig(**values)


def _read_stage(r: _Reader, zero_raw: dict[str, Any]) -> Any:
    """zero_optimization.stage, read first: HF's hidden-size rules for stage-3 keys depend on it."""
    stage_raw = zero_raw.get("stage", 0)
    if _is_auto(stage_raw):
        # the stage decides everything zeroplan computes: under --strict it is an error
        r.add("DS007", "error" if r.strict else "warning", "zero_optimization.stage",
              "zero_optimization.stage = \"auto\": zeroplan cannot know the stage Accelerate "
              "would fill in; DeepSpeed drops \"auto\" -> stage 0 (pass --stage to plan another)",
              stage_raw)
        r.auto["zero_optimization.stage"] = {"value": 0, "how": "unresolved; DeepSpeed drops \"auto\" -> 0"}
        return 0
    ann, meta, default = _field_spec(ZeroConfig, "stage")
    return r.value("zero_optimization.stage", stage_raw, ann, meta, default)


def _read_leaf_module(r: _Reader, key: str, v: Any) -> dict[str, Any]:
    """zero_optimization.leaf_module: DeepSpeed's default classes, overridden per list given."""
    block = _read_dict_block(r, key, v, _LEAF_MODULE_KEYS, "DeepSpeedZeroLeafModuleConfig")
    lm = _default_leaf_module()
    for lk, lv in (block or {}).items():
        if isinstance(lv, str):
            lv = [lv]
        if isinstance(lv, list) and all(isinstance(x, str) for x in lv):
            lm[lk] = list(dict.fromkeys(lv))
        else:
            r.add("DS003", "error", f"{key}.{lk}",
                  f"{key}.{lk} = {_fmt(lv)}: expected a list of strings; using the default", lv)
    return lm


def _read_zero(r: _Reader, raw_top: dict[str, Any], zero_raw: Any,
               hidden_size: int | None) -> ZeroConfig:
    if isinstance(zero_raw, bool):
        return _read_zero_bool(r, raw_top, zero_raw)
    if not isinstance(zero_raw, dict):  # absent: DeepSpeed's defaults; null or another shape: ds_shapes refused it
        return ZeroConfig()

    fields = ZeroConfig.model_fields
    known = set(fields) | set(_ZERO_ALIASES) | set(_ZERO_DEPRECATED) | set(_ZERO_REMOVED)
    stage = _read_stage(r, zero_raw)

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
            r.extra_key(key, v, sorted(known - set(_ZERO_REMOVED)), "DeepSpeedZeroConfig")
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
            values[canonical] = _read_dict_block(r, key, v, _ZENFLOW_KEYS, "ZenFlowConfig")
            continue
        if canonical == "leaf_module":
            values[canonical] = _read_leaf_module(r, key, v)
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


def hpz_group_size(partition_size: int, world_size: int) -> int:
    """Ranks in one hpZ secondary-partition group: min(zero_hpz_partition_size, world size).

    DeepSpeed 0.19.8 ``utils/groups.py::_create_zero_param_parallel_group`` builds groups of
    ``min(group_size, world_size)`` consecutive ranks and asserts (``_ensure_divisibility``) that
    the world size is divisible by it; ``runtime/zero/stage3.py`` only does so when the size is > 1.
    """
    return min(max(int(partition_size), 1), int(world_size))


def _check_hpz(r: "_Reader", zero: "ZeroConfig", world_size: int | None) -> None:
    hpz = int(zero.zero_hpz_partition_size or 1)
    if world_size is None or zero.stage != 3 or hpz <= 1:
        return
    group = hpz_group_size(hpz, world_size)
    if world_size % group:
        r.add("DS010", "error", "zero_optimization.zero_hpz_partition_size",
              f"zero_optimization.zero_hpz_partition_size = {hpz}: the world size {world_size} is not divisible "
              f"by min({hpz}, {world_size}) = {group}; DeepSpeed 0.19.8 asserts it "
              "(utils/groups.py::_create_zero_param_parallel_group → _ensure_divisibility)", hpz)
