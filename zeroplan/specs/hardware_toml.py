"""Hardware profiles as TOML text, both ways: ``parse_profile_toml`` reads and validates it (errors
name the file, the key, the value and what was expected); ``profile_to_toml`` writes it back
(``tomllib.loads`` of it gives the same fields; bytes and bandwidths get a unit comment) and
``save_profile`` writes a file atomically.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from zeroplan._util import GB, GiB, InputError, atomic_write_text, parse_error_text
from zeroplan.specs.hardware_checks import validate_profile
from zeroplan.specs.hardware_schema import FLOP_DTYPES, HardwareProfile

__all__ = ["parse_profile_toml", "profile_to_toml", "save_profile"]

def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _expected_from_msg(msg: str) -> str:
    """pydantic's message as what was expected: "Input should be a valid list" -> "a valid list";
    "Value error, ..." -> what follows the comma."""
    for lead in ("Input should be ", "Value error, "):
        if msg.startswith(lead):
            return msg[len(lead):]
    return msg or "a valid value"


def _translate(exc: ValidationError, where: str, data: dict[str, Any]) -> InputError:
    """One line for the first pydantic error: file, key path, value, expected."""
    err = exc.errors(include_url=False)[0]
    key = _loc(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = err["loc"][:-1]
        model: type[BaseModel] = HardwareProfile
        for part in parent:
            field = model.model_fields.get(str(part))
            ann = getattr(field, "annotation", None) if field else None
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                model = ann
            else:
                break
        allowed = [n for n in model.model_fields if n != "path"]
        close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return InputError(f"{where}: unknown key {key}{hint}; expected one of {', '.join(allowed)}")
    if kind == "missing":
        return InputError(f"{where}: missing key {key}; see hardware_profiles/README.md for the schema")
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a table"
    expected = {
        "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer (no fraction)",
        "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
        "dict_type": "a table", "model_type": "a table", "bool_type": "true or false", "list_type": "a list",
    }.get(kind) or _expected_from_msg(str(err.get("msg", "")))
    return InputError(f"{where}: key {key} = {shown} is invalid; expected {expected}")


def _reject_bools(d: dict[str, Any], where: str, prefix: str = "") -> None:
    """No profile field is a boolean; pydantic would silently read true as 1."""
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            _reject_bools(v, where, path)
        elif isinstance(v, bool):
            raise InputError(f"{where}: key {path} = {str(v).lower()} is invalid; expected a number or a string")


def parse_profile_toml(text: str, where: str = "<toml>") -> HardwareProfile:
    """Parse and validate TOML text; ``where`` names the file in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where}: malformed TOML: {exc}") from None
    except RecursionError:
        raise InputError(f"{where}: malformed TOML: nested too deeply") from None
    except ValueError as exc:
        raise InputError(f"{where}: malformed TOML: {parse_error_text(exc)}") from None
    if "path" in data:
        raise InputError(f"{where}: unknown key path; the file location is not stored in the file")
    _reject_bools(data, where)
    try:
        profile = HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise _translate(exc, where, data) from None
    profile.path = where
    return validate_profile(profile, where)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _toml_str(k)


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_float(x: float) -> str:
    if not math.isfinite(x):
        raise InputError(f"cannot write non-finite number {x!r} to TOML")
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-4):
        for p in range(0, 17):  # shortest exponent form that reads back exactly
            s = f"{x:.{p}e}"
            if float(s) == x:
                return s
    r = repr(float(x))
    return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"


def _toml_int(n: int) -> str:
    s = str(abs(n))
    if len(s) > 4:
        groups = []
        while s:
            groups.append(s[-3:])
            s = s[:-3]
        s = "_".join(reversed(groups))
    return ("-" if n < 0 else "") + s


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return _toml_int(v)
    if isinstance(v, float):
        return _toml_float(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):  # e.g. the NCCL algorithms a link offers
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _unit_comment(key: str, v: Any) -> str:
    """A human-readable comment for byte and bandwidth fields (ignored when read back)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return ""
    if key.endswith("_bytes") and v:
        return f"  # {v / GiB:,.2f} GiB = {v / GB:,.2f} GB"
    if key == "bandwidth_GBps_per_gpu":
        return f"  # {v * 8:,.4g} Gb/s per GPU"
    if key in FLOP_DTYPES:
        return f"  # {v / 1e12:,.4g} TFLOP/s dense"
    return ""


def profile_to_toml(profile: HardwareProfile) -> str:
    """TOML text for a profile; ``tomllib.loads`` of it gives back exactly the same fields."""
    data = profile.model_dump(exclude={"path"}, exclude_none=True)
    lines = [
        "# zeroplan hardware profile. Units: bytes are integers, GiB = 2**30, GB = 1e9;",
        "# bandwidths are GB/s (1e9 bytes/s) unidirectional, links per GPU; latency in us.",
    ]

    def emit_table(header: str | None, table: dict[str, Any]) -> None:
        scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
        subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
        if header is not None:
            lines.append("")
            lines.append(f"[{header}]")
        for k, v in scalars:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}{_unit_comment(k, v)}")
        for k, v in subs:
            emit_table(f"{header}.{_toml_key(k)}" if header else _toml_key(k), v)

    emit_table(None, data)
    return "\n".join(lines) + "\n"


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> Path:
    """Validate and write a profile to ``path`` atomically; returns the path."""
    validate_profile(profile, str(path))
    return atomic_write_text(path, profile_to_toml(profile))
