"""The shape DeepSpeed 0.19.8 needs of a config value before it can use it, one table for the whole config.

``DeepSpeedConfig.__init__`` (runtime/config.py) reads most sections by dereferencing them:
``DeepSpeedFP16Config(**param_dict["fp16"])``, ``param_dict["scheduler"].keys()``,
``param_dict.get("checkpoint", {}).get(...)``. A present key holding ``null``, a list, a string or a
number is then a TypeError or AttributeError at start-up, not the default: ``.get(key, {})`` returns
the ``null`` as given. A few scalars fail the same way: ``wall_clock_breakdown`` is or-ed with a
bool, ``communication_data_type`` is lower-cased and looked up. ``SECTIONS`` (top-level keys) and
``SCALARS`` (dotted paths, checked only where their parent is an object) say, for each such key,
what DeepSpeed accepts and which of its functions uses the value; ``check_shapes`` reports every
other value as an error. The section readers then take a refused value as absent.

Each shape was read from DeepSpeed's source and checked by building ``DeepSpeedConfig`` on a dict
with that key set to null, "auto", "", "x", [], {}, true, false, -1, 0, 1, 1.5 and 1e20.

``SUBKEYS`` lists the keys DeepSpeed reads inside ``timers``, ``timers.throughput`` and ``data_types``;
any other is reported (DS001) as ``ds_keys``' tables are elsewhere. ``AT_INITIALIZE`` holds the
``data_types`` dtypes, which ``DeepSpeedConfig`` keeps as given and the engine resolves with
``DtypeEnum`` during ``deepspeed.initialize``; ``check_data_types`` checks them once the precision is
known (``param_dtype`` must match it; ``buffer_dtype`` is read only under fp16/bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import TypeAdapter, ValidationError

from zeroplan._util import data_kind
from zeroplan.specs.ds_findings import _fmt, _is_auto, _Reader
from zeroplan.specs.ds_keys import _DATA_TYPES_KEYS, _DTYPE_ENUM, _THROUGHPUT_TIMER_KEYS, _TIMERS_KEYS
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION

__all__ = ["AT_INITIALIZE", "SCALARS", "SECTIONS", "SUBKEYS", "Shape", "check_data_types", "check_shapes"]

Kind = Literal["object", "null", "boolean", "integer", "number", "string", "list", "auto", "falsy", "strings",
               "no_throughput"]

_KIND_TESTS: dict[Kind, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "auto": lambda v: v == "auto",  # dropped by DeepSpeedConfigModel.__init__ (the default is used)
    "falsy": lambda v: not v,
    "strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    # get_timers_config: `"throughput" in timers`, then timers["throughput"] (TypeError on a str or list)
    "no_throughput": lambda v: isinstance(v, (str, list)) and "throughput" not in v,
}


@dataclass(frozen=True)
class Shape:
    """What DeepSpeed accepts for one key: values of these JSON ``kinds``, or, for a string, one of
    ``choices`` (compared case-insensitively: DeepSpeed lower()s or upper()s it first; ``fold_case=False``:
    compared as written), or, with ``pydantic``, what a pydantic field of that type takes in lax mode (the
    value is then coerced; ``check_shapes`` reports the coercion as a warning).
    ``deepspeed`` names the DeepSpeed 0.19.8 function that uses the value and how.
    ``only_without``: DeepSpeed reads this key only when that other key is absent or null."""

    kinds: frozenset[Kind]
    expected: str
    deepspeed: str
    choices: tuple[str, ...] = ()
    only_without: str | None = None
    fold_case: bool = True
    pydantic: Any = None

    def accepts(self, value: Any) -> bool:
        if self.choices and isinstance(value, str):
            return (value.lower() if self.fold_case else value) in self.choices
        if any(_KIND_TESTS[k](value) for k in self.kinds):
            return True
        return self.pydantic is not None and self.coerced(value) is not None

    def coerced(self, value: Any) -> tuple[Any] | None:
        """``(value as pydantic's lax mode makes it,)``, or None where the field refuses it."""
        try:
            return (TypeAdapter(self.pydantic).validate_python(value),)
        except ValidationError:
            return None


def _section(deepspeed: str, *also: Kind, expected: str = "an object", only_without: str | None = None) -> Shape:
    return Shape(frozenset(("object", *also)), expected, deepspeed, only_without=only_without)


_MONITOR = "monitor/config.py::get_monitor_config: DeepSpeedMonitorConfig(**sections), \"auto\" dropped"

# Top-level sections: an object, unless the entry says what else DeepSpeed takes.
SECTIONS: dict[str, Shape] = {
    "zero_optimization": _section(
        "runtime/zero/config.py::get_zero_config: DeepSpeedZeroConfig(**zero_optimization)", "boolean",
        expected='an object such as {"stage": 2} (or the deprecated true/false)'),
    "fp16": _section("runtime/precision_config.py::get_float16_config: DeepSpeedFP16Config(**fp16)",
                     expected='an object such as {"enabled": true}'),
    "bf16": _section("runtime/precision_config.py::get_bfloat16_config: DeepSpeedBF16Config(**bf16); "
                     "null falls back to the legacy bfloat16 block", "null",
                     expected='an object such as {"enabled": true}, or null'),
    "bfloat16": _section("runtime/precision_config.py::get_bfloat16_config: DeepSpeedBF16Config(**bfloat16)",
                         expected='an object such as {"enabled": true}', only_without="bf16"),
    "optimizer": _section("runtime/config.py::get_optimizer_name: param_dict['optimizer'].keys()",
                          expected='an object such as {"type": "AdamW", "params": {...}}'),
    "scheduler": _section("runtime/config.py::get_scheduler_name: param_dict['scheduler'].keys()",
                          expected='an object such as {"type": "WarmupLR", "params": {...}}'),
    "activation_checkpointing": _section(
        "runtime/activation_checkpointing/config.py::DeepSpeedActivationCheckpointingConfig: get_scalar_param "
        "on the block (.get)"),
    "checkpoint": _section("runtime/config.py::get_checkpoint_tag_validation_mode: checkpoint.get(...)"),
    "data_types": _section("runtime/config.py::DeepSpeedConfig._initialize_params: data_types.get(...)"),
    "pipeline": _section("runtime/config.py::get_pipeline_config: pipeline.items()"),
    "hybrid_engine": _section("runtime/config.py::get_hybrid_engine_config: HybridEngineConfig(**hybrid_engine)"),
    "compile": _section("runtime/config.py::DeepSpeedConfig._initialize_params: CompileConfig(**compile)"),
    "weight_quantization": _section(
        "runtime/config.py::DeepSpeedConfig._initialize_params: WeightQuantConfig(**weight_quantization)"),
    "torch_autocast": _section("runtime/config.py::get_torch_autocast_enabled: get_scalar_param(torch_autocast)"),
    "comms_logger": _section("comm/config.py::DeepSpeedCommsConfig: CommsLoggerConfig(**comms_logger)"),
    "tensorboard": _section(_MONITOR, "auto"),
    "wandb": _section(_MONITOR, "auto"),
    "csv_monitor": _section(_MONITOR, "auto"),
    "comet": _section(_MONITOR, "auto"),
    "flops_profiler": _section("profiling/config.py::DeepSpeedFlopsProfilerConfig: get_scalar_param(flops_profiler)"),
    "autotuning": _section("autotuning/config.py::DeepSpeedAutotuningConfig: get_scalar_param(autotuning)"),
    "aio": _section("runtime/swap_tensor/aio_config.py::get_aio_config: get_scalar_param(aio); null = defaults",
                    "null", expected="an object, or null"),
    "data_efficiency": _section(
        "runtime/data_pipeline/config.py::get_data_efficiency_enabled: get_scalar_param(data_efficiency)"),
    "tensor_parallel": _section(
        "runtime/tensor_parallel/config.py::get_tensor_parallel_config: TPTrainingConfig(**tensor_parallel)"),
    "expert_parallel": _section(
        "module_inject/auto_ep_config.py::parse_autoep_config: expert_parallel.get(...); an empty value = defaults",
        "falsy", expected="an object (or an empty value)"),
    # get_timers_config tests `"throughput" in timers` first, so a string or a list without it passes too
    "timers": _section("utils/config.py::get_timers_config: 'throughput' in timers, then timers['throughput']",
                       "no_throughput", expected='an object such as {"throughput": {"enabled": true}}'),
}

_COMM_DTYPE = "runtime/config.py::get_communication_data_type: value.lower() in fp16/bf16/fp32, else ValueError"
_OR_BOOL = ("runtime/config.py::DeepSpeedConfig._initialize_params: "
            "get_wall_clock_breakdown(...) | flops_profiler.enabled")

# Scalars, by dotted path (checked where the parent is an object).
SCALARS: dict[str, Shape] = {
    "wall_clock_breakdown": Shape(frozenset(("boolean", "integer")), "true or false", _OR_BOOL),
    "flops_profiler.enabled": Shape(frozenset(("boolean", "integer")), "true or false", _OR_BOOL),
    "communication_data_type": Shape(frozenset(("null",)), '"fp16", "bf16" or "fp32" (or null)', _COMM_DTYPE,
                                     choices=("fp16", "bf16", "fp32")),
    "seq_parallel_communication_data_type": Shape(frozenset(("null",)), '"fp16", "bf16" or "fp32" (or null)',
                                                  _COMM_DTYPE, choices=("fp16", "bf16", "fp32")),
    "gradient_allreduce_op": Shape(frozenset(), '"mean" or "sum"',
                                   "runtime/config.py::get_gradient_allreduce_op: value.lower() in mean/sum, "
                                   "else ValueError", choices=("mean", "sum")),
    "checkpoint.tag_validation": Shape(frozenset(), '"Warn", "Ignore" or "Fail"',
                                       "runtime/config.py::get_checkpoint_tag_validation_mode: value.upper() in "
                                       "WARN/IGNORE/FAIL, else DeepSpeedConfigError",
                                       choices=("warn", "ignore", "fail")),
    "vocabulary_size": Shape(frozenset(("number", "boolean", "falsy")), "an integer",
                             "runtime/config.py::DeepSpeedConfig._do_warning_check: vocabulary_size % 8"),
    "timers.throughput": Shape(frozenset(("object",)), 'an object such as {"enabled": true}',
                               "utils/config.py::get_timers_config: DeepSpeedThroughputTimerConfig(**throughput)"),
    **{f"timers.throughput.{k}": Shape(frozenset(("auto",)), "true or false",
                                       f"utils/config.py::DeepSpeedThroughputTimerConfig.{k}: bool (pydantic, lax; "
                                       "\"auto\" dropped)", pydantic=bool) for k in sorted(_THROUGHPUT_TIMER_KEYS)},
    "data_types.keep_in_fp32_modules": Shape(
        frozenset(("strings",)), '"auto" or a list of module-name patterns (strings)',
        "runtime/config.py::DeepSpeedConfig._initialize_params: keep_in_fp32_modules must be \"auto\" or a list "
        "of str, else DeepSpeedConfigError", choices=("auto",), fold_case=False),
}

# Keys DeepSpeed reads inside a block: block path -> (keys, the pydantic model that forbids others, or None
# where DeepSpeed never reads the others, and the function that reads the block).
SUBKEYS: dict[str, tuple[frozenset[str], str | None, str]] = {
    "timers": (_TIMERS_KEYS, None, "utils/config.py::get_timers_config reads timers.throughput only"),
    "timers.throughput": (_THROUGHPUT_TIMER_KEYS, "DeepSpeedThroughputTimerConfig",
                          "utils/config.py::DeepSpeedThroughputTimerConfig: extra=\"forbid\""),
    "data_types": (_DATA_TYPES_KEYS, None,
                   "runtime/config.py::DeepSpeedConfig._initialize_params reads data_types.get(...) for "
                   + ", ".join(sorted(_DATA_TYPES_KEYS))),
}

_DTYPES = tuple(_DTYPE_ENUM)
_DTYPE_TEXT = '"fp32", "bf16" or "fp16" (lower case; DtypeEnum also takes "float32", "bfloat16", "half", ...), or null'
# DeepSpeedConfig keeps these as given; deepspeed.initialize resolves them with runtime/config.py::DtypeEnum.
AT_INITIALIZE: dict[str, Shape] = {
    "data_types.grad_accum_dtype": Shape(frozenset(("null",)), _DTYPE_TEXT,
                                         "runtime/engine.py::DeepSpeedEngine.get_data_types: DtypeEnum(value), "
                                         "ValueError", choices=_DTYPES, fold_case=False),
    "data_types.param_dtype": Shape(frozenset(("null",)), _DTYPE_TEXT,
                                    "runtime/engine.py::DeepSpeedEngine._assert_valid_mixed_precision_config: "
                                    "DtypeEnum(value), ValueError", choices=_DTYPES, fold_case=False),
    "data_types.buffer_dtype": Shape(frozenset(("null",)), _DTYPE_TEXT,
                                     "runtime/engine.py::DeepSpeedEngine._mixed_precision_dtypes (fp16/bf16 only): "
                                     "DtypeEnum(value), ValueError", choices=_DTYPES, fold_case=False),
}


def _report(r: _Reader, key: str, value: Any, shape: Shape, at_initialize: bool = False) -> None:
    rule = "DS010" if shape.choices and isinstance(value, str) else "DS003"
    got = "" if rule == "DS010" else f", got {data_kind(value)}"
    if at_initialize:
        fails = (f"DeepSpeedConfig keeps it as given, but deepspeed.initialize ({DEEPSPEED_VERSION}) fails on it "
                 f"({shape.deepspeed})")
    else:
        fails = (f"DeepSpeed {DEEPSPEED_VERSION} fails on it ({shape.deepspeed}); zeroplan plans as if the key "
                 "were absent")
    r.add(rule, "error", key, f"{key} = {_fmt(value)}: expected {shape.expected}{got}; {fails}", value)


def _block(raw: dict[str, Any], parents: list[str]) -> Any:
    block: Any = raw
    for p in parents:
        block = block.get(p) if isinstance(block, dict) else None
    return block


def _check_value(r: _Reader, path: str, value: Any, shape: Shape) -> None:
    if not shape.accepts(value):
        _report(r, path, value, shape)
    elif shape.pydantic is not None and not _is_auto(value) and not any(_KIND_TESTS[k](value) for k in shape.kinds):
        try:
            TypeAdapter(shape.pydantic).validate_python(value, strict=True)
        except ValidationError:  # accepted by pydantic's lax mode only: DeepSpeed coerces it
            (new,) = shape.coerced(value) or (value,)
            r.add("DS003", "warning", path, f"{path} = {_fmt(value)}: expected {shape.expected}, got "
                  f"{data_kind(value)}; DeepSpeed coerces it to {_fmt(new)} ({shape.deepspeed}); write "
                  f"{_fmt(new)} instead", value)


def check_shapes(r: _Reader, raw: dict[str, Any]) -> None:
    """An error finding for every value in ``SECTIONS`` / ``SCALARS`` that DeepSpeed cannot use, and a DS001
    finding for every key ``SUBKEYS`` does not list."""
    for key, shape in SECTIONS.items():
        if key not in raw or (shape.only_without and raw.get(shape.only_without) is not None):
            continue
        if not shape.accepts(raw[key]):
            _report(r, key, raw[key], shape)
    for path, shape in SCALARS.items():
        *parents, leaf = path.split(".")
        block = _block(raw, parents)
        if isinstance(block, dict) and leaf in block:
            _check_value(r, path, block[leaf], shape)
    for path, (known, model, deepspeed) in SUBKEYS.items():
        block = _block(raw, path.split("."))
        if not isinstance(block, dict):  # absent, or a shape reported above
            continue
        for k, v in block.items():
            if k in known:
                continue
            if model is not None:
                r.extra_key(f"{path}.{k}", v, known, model)
            else:
                r.unknown(f"{path}.{k}", known, "warning", f"DeepSpeed ignores it: {deepspeed}", v)


def check_data_types(r: _Reader, raw: dict[str, Any], precision: str) -> None:
    """The ``AT_INITIALIZE`` dtypes, as ``deepspeed.initialize`` reads them with the model dtype of
    ``precision`` (what fp16/bf16 ``enabled`` give; fp32 otherwise)."""
    block = raw.get("data_types")
    if not isinstance(block, dict):
        return
    for path, shape in AT_INITIALIZE.items():
        leaf = path.split(".")[-1]
        if leaf not in block or (leaf == "buffer_dtype" and precision not in ("fp16", "bf16")):
            continue  # _mixed_precision_dtypes runs only under fp16/bf16: DeepSpeed never reads it otherwise
        value = block[leaf]
        if not shape.accepts(value):
            _report(r, path, value, shape, at_initialize=True)
        elif leaf == "param_dtype" and value is not None and _DTYPE_ENUM[value] != precision:
            same = ", ".join(f'"{n}"' for n, d in _DTYPE_ENUM.items() if d == precision)
            r.add("DS010", "error", path,
                  f"{path} = {_fmt(value)}: expected the model dtype of this config ({precision}: {same}) or null; "
                  f"DeepSpeed {DEEPSPEED_VERSION} asserts they match at deepspeed.initialize "
                  "(runtime/engine.py::DeepSpeedEngine._assert_valid_mixed_precision_config); set the fp16/bf16 "
                  "'enabled' flag to match or drop param_dtype", value)
