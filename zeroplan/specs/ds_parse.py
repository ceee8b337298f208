"""Parsing a DeepSpeed config file as DeepSpeed 0.19.8 does: ``hjson`` with a duplicate-key hook,
every number in range, and errors that name the file, line and column.

DeepSpeed loads config files with ``hjson`` and rejects duplicate keys, so comments, unquoted keys
and trailing commas are accepted; ``parse_ds_json`` also says whether the text used any of them
(plain ``json.load`` readers would reject it: the reader's DS011). ``hjson`` is imported inside
``parse_ds_json`` (DeepSpeed's own dependency) to keep ``import zeroplan`` light.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from zeroplan._util import InputError

__all__ = ["parse_ds_json"]


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


class _DuplicateKey(ValueError):
    pass


_NONFINITE = re.compile(r"(?<![\w\"])-?(?:NaN|Infinity)\b")  # literals only: linear


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a duplicate key is an error, as DeepSpeed 0.19.8's
    ``runtime/config_utils.py::dict_raise_error_on_duplicate_keys`` makes it."""
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


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


def parse_ds_json(text: str, where: str = "<config>") -> tuple[dict[str, Any], bool]:
    """Parse a DeepSpeed config as DeepSpeed does; returns (dict, used_hjson_extensions).

    DeepSpeed 0.19.8 (``runtime/config.py::DeepSpeedConfig.__init__``) reads a config file with
    ``hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)``, so ``#`` and ``//``
    comments, unquoted keys and trailing commas are accepted and duplicate keys rejected; this
    reader calls the same library the same way. Raises InputError naming ``where``, line and
    column for malformed input, duplicate keys, a number out of range, or a top level that is
    not an object.
    """
    import hjson  # DeepSpeed's own dependency; imported here to keep `import zeroplan` light

    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        key = str(exc)
        raise InputError(
            f"{where}:{_key_position(text, key)} duplicate key {key!r} in a JSON object "
            "(DeepSpeed rejects duplicate keys)") from None
    except hjson.HjsonDecodeError as exc:
        const = _NONFINITE.search(text)
        hint = f"; {const.group()} is not a JSON number" if const else ""
        raise InputError(
            f"{where}: line {exc.lineno} column {exc.colno}: not valid JSON/hjson ({exc.msg}{hint})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except IndexError:  # hjson 3.1 runs off the end of an unterminated /* comment
        raise InputError(f"{where}: unterminated /* comment or string at the end of the file") from None
    except (ValueError, OverflowError) as exc:  # 1e400 (hjson's OverflowError), a 5,000-digit integer
        raise InputError(f"{where}: a number is out of range: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: top level is a JSON {type(data).__name__}, expected an object "
            "such as {\"zero_optimization\": {...}}")
    _check_number_range(data, where)
    return data, not _strict_json(text)


_INT64_MAX = 2**63 - 1  # DeepSpeed hands counts to torch, which holds them as int64


def _check_number_range(data: Any, where: str) -> None:
    """Every number in the file: an integer within int64, a finite float (iterative walk)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{key}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int) and abs(v) > _INT64_MAX:
            raise InputError(f"{where}: {key} = an integer of {len(str(abs(v)))} digits: beyond int64 "
                             f"(|value| <= {_INT64_MAX})")
        elif isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"{where}: {key} = {v}: expected a finite number")
