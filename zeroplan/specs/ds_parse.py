"""Parsing a DeepSpeed config file as DeepSpeed 0.19.8 does: ``hjson`` with a duplicate-key hook,
every number in range, and errors that name the file, line and column (the key, for a number).

DeepSpeed loads config files with ``hjson`` and rejects duplicate keys, so comments, unquoted keys
and trailing commas are accepted; ``parse_ds_json`` also says whether the text used any of them
(plain ``json.load`` readers would reject it: the reader's DS011). ``hjson`` is imported inside
``parse_ds_json`` (DeepSpeed's own dependency) to keep ``import zeroplan`` light.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from typing import Any

from zeroplan._util import DuplicateKeyError, InputError, data_kind, no_duplicate_keys
from zeroplan.specs.config_lines import find_key_line, key_lines

__all__ = ["parse_ds_json"]


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


_NONFINITE = re.compile(r"(?<![\w\"])-?(?:NaN|Infinity)\b")  # literals only: linear


class _OutOfRange:
    """A number literal no Python number holds: beyond the float range (``1e400``) or an integer of more
    digits than ``int()`` parses. hjson's ``scantfnns`` does ``int(res) == res`` on every float it parses,
    which raises OverflowError on ``float('inf')`` with no key, line or column (DeepSpeed's own
    ``hjson.load`` fails the same way); ``parse_ds_json`` hands hjson number hooks that return this
    instead, so ``_check_number_range`` can name the key and its line."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __int__(self) -> int:  # hjson: int(res) == res is then False and the value is kept as it is
        return 0

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


def _parse_float(text: str) -> float | _OutOfRange:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(text)


def _parse_int(text: str) -> int | _OutOfRange:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return _OutOfRange(text)


def _strict_json(text: str) -> bool:
    """True when the text is plain JSON (no comments, trailing commas, unquoted keys...)."""
    def no_constant(name: str) -> Any:
        raise ValueError(name)
    try:
        json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return False
    return True


def _key_position(text: str, key: str) -> str:
    """' line L column C:' of the second occurrence of ``key`` written as a key, or ''."""
    for needle in (json.dumps(key), key):
        first = text.find(needle)
        second = text.find(needle, first + 1) if first >= 0 else -1
        if second >= 0:
            line, col = _line_col(text, second)
            return f" line {line} column {col}:"
    return ""


_CULPRIT_TRIES = 4  # literals tried one by one (each a re-parse): a file of 100,000 NaN stays linear


def _culprit_constant(text: str, hjson: Any) -> re.Match[str] | None:
    """The first NaN/Infinity literal whose replacement by ``null`` makes ``text`` parse (or the first of
    them when only replacing all does): the cause of hjson's error. A NaN in a comment or a string, or a
    file with another error too, gives None."""
    found = list(itertools.islice(_NONFINITE.finditer(text), _CULPRIT_TRIES))
    for m in found:
        try:
            hjson.loads(text[:m.start()] + "null" + text[m.end():])
        except Exception:  # noqa: BLE001 - any failure: this literal is not the only cause
            continue
        return m
    try:  # several on one line ({"a": NaN, "b": Infinity}): the first, when all of them are the cause
        hjson.loads(_NONFINITE.sub("null", text))
    except Exception:  # noqa: BLE001
        return None
    return found[0] if found else None


def parse_ds_json(text: str, where: str = "<config>") -> tuple[dict[str, Any], bool]:
    """Parse a DeepSpeed config as DeepSpeed does; returns (dict, used_hjson_extensions).

    DeepSpeed 0.19.8 (``runtime/config.py::DeepSpeedConfig.__init__``) reads a config file with
    ``hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)``, so ``#`` and ``//``
    comments, unquoted keys and trailing commas are accepted and duplicate keys rejected; this
    reader calls the same library the same way (its number hooks change only how a literal beyond
    the float range, on which hjson itself raises OverflowError, is reported). Raises InputError
    naming ``where``, line and column for malformed input, duplicate keys, or a top level that is
    not an object, and ``where``, line and key for a number out of range.
    """
    import hjson  # DeepSpeed's own dependency; imported here to keep `import zeroplan` light

    try:
        data = hjson.loads(text, object_pairs_hook=no_duplicate_keys, parse_float=_parse_float,
                           parse_int=_parse_int)
    except DuplicateKeyError as exc:
        key = str(exc)
        raise InputError(
            f"{where}:{_key_position(text, key)} duplicate key {key!r} in a JSON object "
            "(DeepSpeed rejects duplicate keys)") from None
    except hjson.HjsonDecodeError as exc:
        const = _culprit_constant(text, hjson)
        if const:  # hjson reads an unquoted NaN to the end of its line as a string: the error lands later
            line, col = _line_col(text, const.start())
            raise InputError(
                f"{where}: line {line} column {col}: {const.group()} is not a JSON number (hjson, as DeepSpeed "
                f"reads it, takes the rest of that line as a string and then fails at line {exc.lineno} "
                f"column {exc.colno}: {exc.msg}); write a number, or null where the key allows it") from None
        raise InputError(
            f"{where}: line {exc.lineno} column {exc.colno}: not valid JSON/hjson ({exc.msg})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except IndexError:  # hjson 3.1 runs off the end of an unterminated /* comment
        raise InputError(f"{where}: unterminated /* comment or string at the end of the file") from None
    except (ValueError, OverflowError) as exc:  # the hooks keep numbers out of here; anything hjson still raises
        raise InputError(f"{where}: a number is out of range: {exc}") from None
    _check_number_range(data, where, text)
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: top level is {data_kind(data)}, expected an object "
            "such as {\"zero_optimization\": {...}}")
    return data, not _strict_json(text)


_INT64_MAX = 2**63 - 1  # DeepSpeed hands counts to torch, which holds them as int64


def _number_problem(v: object) -> tuple[str, str] | None:
    """(the literal as written, why it is out of range) for a parsed number out of range; None otherwise."""
    if isinstance(v, _OutOfRange) and v.text.lstrip("-").isdigit():  # parse_int's: too many digits for int()
        return v.text, f"an integer of {len(v.text.lstrip('-'))} digits: beyond int64 (|value| <= {_INT64_MAX})"
    if isinstance(v, _OutOfRange):  # parse_float's: 1e400
        shown = v.text if len(v.text) <= 40 else f"{v.text[:20]}...{v.text[-10:]}"
        return v.text, (f"{shown}: beyond the float range (|value| <= {sys.float_info.max:.4g}); DeepSpeed's "
                        "hjson reader fails on it (OverflowError)")
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and abs(v) > _INT64_MAX:
        return str(v), f"an integer of {len(str(abs(v)))} digits: beyond int64 (|value| <= {_INT64_MAX})"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v), f"{v}: expected a finite number"
    return None


def _literal_position(text: str, key: str, literal: str) -> str:
    """' line L column C:' of ``literal`` at or after the line of ``key`` in ``text`` (key_lines reads quoted
    keys only: for an unquoted hjson key, the literal's only occurrence in the file); ' line L:' or ''."""
    line = find_key_line(key_lines(text), re.sub(r"\[\d+\]", "", key))
    start = 0
    for _ in range((line or 1) - 1):
        start = text.index("\n", start) + 1
    pos = text.find(literal, start)
    if line is None and (pos < 0 or text.find(literal, pos + 1) >= 0):
        return ""
    if pos < 0:
        return f" line {line}:"
    found_line, col = _line_col(text, pos)
    return f" line {found_line} column {col}:"


def _check_number_range(data: Any, where: str, text: str | None = None) -> None:
    """Every number in the file: an integer within int64, a finite float (iterative walk). The error names
    the key and, given the file's ``text``, the line and column of the number."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{key}[{i}]", x) for i, x in enumerate(v))
        else:
            problem = _number_problem(v)
            if problem is None:
                continue
            literal, why = problem
            at = _literal_position(text, key, literal) if text and key else ""
            raise InputError(f"{where}:{at} {key or 'the top level'} = {why}")
