"""``load_ds_config``: read a DeepSpeed config (path, JSON text or dict) the way DeepSpeed 0.19.8 does,
section by section, into a ``DSConfig`` with its findings.

It parses (ds_parse), checks the top-level keys (unknown ones DeepSpeed ignores, removed ones it
rejects), the shape of every value DeepSpeed dereferences (ds_shapes: a section that is not an object,
a wrong-typed scalar), ``communication_data_type`` and ``gradient_allreduce_op`` here, and reads the
other sections with their own modules:
``zero_optimization`` (ds_zero), precision and batch keys (ds_batch_precision), optimizer,
scheduler and clipping (ds_optimizer). Findings are collected by ``_Reader`` (ds_findings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from zeroplan._util import InputError, read_text_file
from zeroplan.specs.ds_activation_checkpointing import read_activation_checkpointing
from zeroplan.specs.ds_batch_precision import _read_batch, _read_precision
from zeroplan.specs.ds_findings import _fmt, _Reader
from zeroplan.specs.ds_keys import _TOP_REMOVED, TOP_LEVEL_KEYS, ZEROPLAN_KEY
from zeroplan.specs.ds_optimizer import _read_clipping, _read_optimizer
from zeroplan.specs.ds_parse import parse_ds_json
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION, DSConfig, ZeroConfig
from zeroplan.specs.ds_shapes import check_shapes
from zeroplan.specs.ds_zero import _check_hpz, _read_zero

__all__ = ["load_ds_config"]


def _read_top_level(r: _Reader, raw: dict[str, Any]) -> None:
    for k in raw:
        if k in _TOP_REMOVED:
            r.add("DS009", "error", k, f"{k}: {_TOP_REMOVED[k]} in DeepSpeed {DEEPSPEED_VERSION}, "
                  "which raises DeepSpeedConfigError for this key; remove it", None)
        elif k not in TOP_LEVEL_KEYS and k != ZEROPLAN_KEY:
            r.unknown(k, TOP_LEVEL_KEYS, "warning", "DeepSpeed ignores it")


def _read_comm_dtype(raw: dict[str, Any]) -> str | None:
    """The explicit communication_data_type, lower case; None when absent or unusable (ds_shapes reports it)."""
    v = raw.get("communication_data_type")
    if isinstance(v, str) and v.lower() in ("fp16", "bf16", "fp32"):
        return v.lower()
    return None


def _lax_true(value: Any) -> bool:
    """True where a pydantic ``bool`` field (lax mode, as DeepSpeed's CompileConfig) reads ``value`` as true."""
    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValidationError:
        return False


def _check_allreduce_op(r: _Reader, raw: dict[str, Any], zero: ZeroConfig) -> None:
    """DeepSpeedConfig._do_error_check: gradient_allreduce_op "sum" with ZeRO-3, ZenFlow or DeepCompile raises."""
    op = raw.get("gradient_allreduce_op")
    if not (isinstance(op, str) and op.lower() == "sum"):
        return
    compile_cfg = raw.get("compile")
    deepcompile = isinstance(compile_cfg, dict) and _lax_true(compile_cfg.get("deepcompile"))
    for clash, present in (("ZeRO stage 3", zero.stage == 3), ("ZenFlow", zero.zenflow is not None),
                           ("DeepCompile", deepcompile)):
        if present:
            r.add("DS010", "error", "gradient_allreduce_op",
                  f"gradient_allreduce_op = {_fmt(op)}: expected \"mean\" with {clash}; DeepSpeed "
                  f"{DEEPSPEED_VERSION} raises ValueError 'not supported with {clash}' "
                  "(DeepSpeedConfig._do_error_check)", op)
            return


def load_ds_config(source: str | Path | dict, *, strict: bool = False,
                   hidden_size: int | None = None, micro_batch: int | None = None,
                   grad_accum: int | None = None, world_size: int | None = None,
                   precision: str | None = None, label: str | None = None) -> DSConfig:
    """Read a DeepSpeed config (path, JSON text starting with ``{``, or a dict).

    ``hidden_size`` resolves the HF "auto" bucket keys; ``micro_batch`` / ``grad_accum`` /
    ``world_size`` (data-parallel GPUs) resolve "auto" batch keys and enable DeepSpeed's batch
    fill-in and consistency check; ``precision`` ("fp16"/"bf16"/"fp32") resolves
    ``fp16/bf16.enabled: "auto"``. Non-strict: every problem is a Finding and unusable values
    fall back to DeepSpeed's default. Strict: errors (and DS001/DS003/DS004) raise InputError.
    Malformed JSON always raises InputError with file, line and column. ``label`` names a config that is
    not a file in messages (an inline ``deepspeed`` object of a training file).
    """
    path: str | None = None
    used_ext = False
    if isinstance(source, dict):
        where = label or "<config dict>"
        try:  # a deep copy that also makes it JSON-shaped (string keys, lists), as a file would be
            raw = json.loads(json.dumps(source, allow_nan=True))
        except (TypeError, ValueError, RecursionError) as exc:
            raise InputError(f"{where}: not JSON-serialisable: {exc}") from None
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        where = label or "<config text>"
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
              "the file uses hjson syntax (comments, trailing commas, unquoted keys or strings): DeepSpeed "
              "accepts it, but "
              "json.load-based readers such as Accelerate's HfDeepSpeedConfig reject the file", None)
    _read_top_level(r, raw)
    check_shapes(r, raw)
    zero = _read_zero(r, raw, raw.get("zero_optimization"), hidden_size)
    prec, prec_source = _read_precision(r, raw, precision)
    opt_type, opt_params = _read_optimizer(r, raw)
    clipping = _read_clipping(r, raw)
    comm = _read_comm_dtype(raw)
    _check_allreduce_op(r, raw, zero)
    tb, mb, gas = _read_batch(r, raw, micro_batch, grad_accum, world_size)
    act_ckpt = read_activation_checkpointing(r, raw)
    _check_hpz(r, zero, world_size)
    r.raise_if_strict()
    return DSConfig(
        path=path, label=None if path else where, raw=raw, zero=zero, precision=prec, precision_source=prec_source,
        optimizer_type=opt_type, optimizer_params=opt_params, gradient_clipping=clipping,
        train_batch_size=tb, micro_batch=mb, grad_accum=gas, communication_data_type=comm,
        activation_checkpointing=act_ckpt, auto_resolved=r.auto, findings=r.findings,
    )
