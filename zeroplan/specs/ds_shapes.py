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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from zeroplan.specs.ds_findings import _fmt, _json_type, _Reader
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION

__all__ = ["SCALARS", "SECTIONS", "Shape", "check_shapes"]

Kind = Literal["object", "null", "boolean", "integer", "number", "string", "list", "auto", "falsy"]

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
}


@dataclass(frozen=True)
class Shape:
    """What DeepSpeed accepts for one key: values of these JSON ``kinds``, or, for a string, one of
    ``choices`` (compared case-insensitively: DeepSpeed lower()s or upper()s it first).
    ``deepspeed`` names the DeepSpeed 0.19.8 function that uses the value and how.
    ``only_without``: DeepSpeed reads this key only when that other key is absent or null."""

    kinds: frozenset[Kind]
    expected: str
    deepspeed: str
    choices: tuple[str, ...] = ()
    only_without: str | None = None

    def accepts(self, value: Any) -> bool:
        if self.choices and isinstance(value, str):
            return value.lower() in self.choices
        return any(_KIND_TESTS[k](value) for k in self.kinds)


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
    # get_timers_config only tests `"throughput" in timers` first, so a string or a list passes there too
    "timers": _section("utils/config.py::get_timers_config: 'throughput' in timers", "string", "list",
                       expected='an object such as {"throughput": {"enabled": true}}'),
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
}


def _report(r: _Reader, key: str, value: Any, shape: Shape) -> None:
    rule = "DS010" if shape.choices and isinstance(value, str) else "DS003"
    got = "" if rule == "DS010" else f", got {_json_type(value)}"
    r.add(rule, "error", key,
          f"{key} = {_fmt(value)}: expected {shape.expected}{got}; DeepSpeed {DEEPSPEED_VERSION} fails on it "
          f"({shape.deepspeed}); zeroplan plans as if the key were absent", value)


def check_shapes(r: _Reader, raw: dict[str, Any]) -> None:
    """An error finding for every value in ``SECTIONS`` / ``SCALARS`` that DeepSpeed cannot use."""
    for key, shape in SECTIONS.items():
        if key not in raw or (shape.only_without and raw.get(shape.only_without) is not None):
            continue
        if not shape.accepts(raw[key]):
            _report(r, key, raw[key], shape)
    for path, shape in SCALARS.items():
        *parents, leaf = path.split(".")
        block: Any = raw
        for p in parents:
            block = block.get(p) if isinstance(block, dict) else None
        if isinstance(block, dict) and leaf in block and not shape.accepts(block[leaf]):
            _report(r, path, block[leaf], shape)
