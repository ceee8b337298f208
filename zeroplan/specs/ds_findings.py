"""What the DeepSpeed config reader reports and how it types a value: ``_Reader`` collects the
findings (rule ID, severity, dotted key; ``strict`` turns DS001/DS003/DS004 into errors and raises
on errors) and validates a value the way DeepSpeed's pydantic field would (lax coercion reported),
with the small helpers every section reader shares (``_fmt``, ``_is_auto``, ``_field_spec``; a value's
kind in JSON's words is ``_util.data_kind``).
"""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from zeroplan._util import InputError, data_kind
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION, OffloadDevice
from zeroplan.specs.findings import Finding


def _fmt(value: Any) -> str:
    try:
        s = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 80 else s[:77] + "..."


def _expected_text(annotation: Any, metadata: list[Any]) -> str:
    base = annotation
    text = "a value"
    if base is int:
        text = "an integer"
    elif base is bool:
        text = "true or false"
    elif base is float:
        text = "a number"
    elif base == (str | None):
        text = "a string path"
    elif base == OffloadDevice:
        text = 'one of "none", "cpu", "nvme"'
    bounds = []
    for m in metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{sym} {v}")
    if bounds:
        text += " " + " and ".join(bounds)
    return text


class _Reader:
    def __init__(self, where: str, file: str, strict: bool):
        self.where = where
        self.file = file
        self.strict = strict
        self.findings: list[Finding] = []
        self.auto: dict[str, Any] = {}

    # -- findings -------------------------------------------------------------------------
    def add(self, rule: str, severity: str, key: str, message: str, value: Any = None) -> None:
        if self.strict and rule in ("DS001", "DS003", "DS004"):
            severity = "error"
        self.findings.append(Finding(
            rule_id=rule, severity=severity, message=message, key=key, file=self.file,
            value=None if value is None else _fmt(value)))

    def raise_if_strict(self) -> None:
        if not self.strict:
            return
        errors = [f for f in self.findings if f.severity == "error"]
        if errors:
            more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
            raise InputError(f"{self.where}: {errors[0].rule_id} {errors[0].message}{more}")

    def unknown(self, key: str, known: frozenset[str] | list[str], severity: str, why: str,
                value: Any = ..., name_value: bool = True) -> None:
        """DS001 on ``key``. ``value``, when given, is the finding's value and (``name_value``) is named in the
        message: ``key = value: unknown key (why)``."""
        key = str(key)
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        named = f"{key} = {_fmt(value)}" if value is not ... and name_value else key
        self.add("DS001", severity, key, f"{named}: unknown key ({why}){hint}", None if value is ... else value)

    def extra_key(self, key: str, value: Any, known: frozenset[str] | list[str], model: str) -> None:
        """An unknown key inside a DeepSpeed pydantic model (``extra="forbid"``): DeepSpeed refuses it, unless
        it holds "auto": ``DeepSpeedConfigModel.__init__`` (runtime/config_utils.py) drops every "auto"
        value before pydantic validates, nested models included, so that key never reaches the extra-key
        check and DeepSpeed ignores it. Reported either way (unknown keys are never silently ignored)."""
        if _is_auto(value):
            self.unknown(key, known, "warning", f"DeepSpeed's {model} forbids extra keys, but "
                         "DeepSpeedConfigModel.__init__ drops \"auto\" values before it validates: "
                         f"DeepSpeed {DEEPSPEED_VERSION} ignores it", value)
        else:  # the message as README.md's `check` excerpt shows it; the value goes in the finding's value
            self.unknown(key, known, "error", f"DeepSpeed's {model} forbids extra keys and fails to start", value,
                         name_value=False)

    # -- typed values (pydantic lax mode, as DeepSpeed's models use) ------------------------
    def value(self, key: str, raw: Any, annotation: Any, metadata: list[Any], default: Any) -> Any:
        """Validate ``raw`` the way DeepSpeed's pydantic field would; findings on problems."""
        tp = Annotated[(annotation, *metadata)] if metadata else annotation
        ta = TypeAdapter(tp)
        try:
            return ta.validate_python(raw, strict=True)
        except ValidationError:
            pass
        expected = _expected_text(annotation, metadata)
        try:
            coerced = ta.validate_python(raw)
        except ValidationError as exc:
            err_type = exc.errors()[0]["type"]
            if err_type == "int_from_float":
                self.add("DS004", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected} (an element count), got a "
                         f"fractional number; DeepSpeed {DEEPSPEED_VERSION} rejects it "
                         f"(int_from_float); using the default {_fmt(default)}", raw)
            elif err_type in ("greater_than", "greater_than_equal", "less_than",
                              "less_than_equal", "literal_error") and (
                    err_type != "literal_error" or isinstance(raw, str)):
                self.add("DS010", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected}; DeepSpeed rejects it; "
                         f"using the default {_fmt(default)}", raw)
            else:
                self.add("DS003", "error", key,
                         f"{key} = {_fmt(raw)}: expected {expected}, got "
                         f"{data_kind(raw)}; DeepSpeed rejects it; using the default "
                         f"{_fmt(default)}", raw)
            return default
        # Accepted by lax mode only. Integral floats for int fields are DeepSpeed's documented
        # behaviour (2e8 -> 200000000) and not reported; other coercions are.
        if isinstance(raw, float) and not isinstance(raw, bool) and annotation is int:
            return coerced
        self.add("DS003", "warning", key,
                 f"{key} = {_fmt(raw)}: expected {expected}, got {data_kind(raw)}; DeepSpeed "
                 f"coerces it to {_fmt(coerced)}; write {_fmt(coerced)} instead", raw)
        return coerced


def _field_spec(model: type[BaseModel], name: str) -> tuple[Any, list[Any], Any]:
    f = model.model_fields[name]
    default = f.get_default(call_default_factory=True)
    return f.annotation, list(f.metadata), default


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v == "auto"
