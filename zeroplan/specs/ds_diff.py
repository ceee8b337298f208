"""Differences between two DeepSpeed config dicts, key by key (``recommend`` shows what it changes)."""

from __future__ import annotations

from typing import Any

__all__ = ["ABSENT", "diff_ds_configs"]


class _Absent:
    """Marks a key missing on one side of a diff (distinct from JSON null)."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "(absent)"

    def __bool__(self) -> bool:
        return False


ABSENT = _Absent()


def diff_ds_configs(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Differences between two config dicts: ``(dotted key, old value, new value)``.

    Nested objects are walked; lists and scalars compare whole. A key missing on one side has
    the value ``ABSENT``. Keys are compared as written (no alias normalisation); ``2e8`` and
    ``200000000`` are equal (same number). Sorted by key.
    """
    out: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                key = f"{prefix}.{k}" if prefix else str(k)
                walk(key, a.get(k, ABSENT), b.get(k, ABSENT))
            return
        if type(a) is bool or type(b) is bool:
            same = type(a) is type(b) and a == b
        else:
            same = a == b
        if not same:
            out.append((prefix, a, b))

    walk("", old, new)
    return out
