"""Where a key sits in a DeepSpeed config file: dotted key path → 1-based line.

Config reading is a specs concern: ``check`` (advice) and the report writers both locate keys with
these, so they live below both. ``key_lines(text)`` maps each dotted key of a JSON(-with-comments)
file to the line it is on; ``find_key_line`` looks a key up with DeepSpeed's ``stage3_`` aliases.
"""

from __future__ import annotations

import json

__all__ = ["key_lines", "find_key_line"]


# keys deeper than this are not located (no real DeepSpeed key is; keeps hostile input linear)
_MAX_KEY_DEPTH = 32


def key_lines(text: str) -> dict[str, int]:
    """Dotted key path → 1-based line of its first occurrence, for JSON with ``//``/``/* */`` comments.

    Objects inside arrays contribute their keys under the array's path (no index). Tolerant of
    malformed input: it never raises, it just maps what it could read.
    """
    out: dict[str, int] = {}
    stack: list[str | None] = []  # key of each open container (None for an array element object)
    pending: str | None = None  # last key read at the current level, waiting for its value
    line = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == '"':
            j = i + 1
            buf = []
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    buf.append(text[j:j + 2])
                    j += 2
                    continue
                if text[j] == "\n":
                    break
                buf.append(text[j])
                j += 1
            raw = "".join(buf)
            try:
                s = json.loads(f'"{raw}"')
            except ValueError:
                s = raw
            k = j + 1
            while k < n and text[k] in " \t\r":
                k += 1
            if k < n and text[k] == ":" and (not stack or stack[-1] != "[") and len(stack) <= _MAX_KEY_DEPTH:
                path = ".".join([p for p in stack if p not in (None, "[")] + [s])
                out.setdefault(path, line)
                pending = s
            i = j + 1
        elif c == "/" and i + 1 < n and text[i + 1] == "/":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            line += text.count("\n", i, end)
            i = end
        elif c == "{":
            stack.append(pending)
            pending = None
            i += 1
        elif c == "[":
            stack.append(pending)
            stack.append("[")
            pending = None
            i += 1
        elif c == "}":
            if stack:
                stack.pop()
            pending = None
            i += 1
        elif c == "]":
            if stack and stack[-1] == "[":
                stack.pop()
            if stack:
                stack.pop()
            pending = None
            i += 1
        else:
            i += 1
    return out


def find_key_line(lines: dict[str, int], key: str) -> int | None:
    """The line of ``key`` (dotted), trying DeepSpeed's ``stage3_`` alias of the last part, then parents."""
    parts = key.split(".") if key else []
    while parts:
        last = parts[-1]
        variants = [last, f"stage3_{last}", last[len("stage3_"):] if last.startswith("stage3_") else None]
        for v in variants:
            if v and ".".join(parts[:-1] + [v]) in lines:
                return lines[".".join(parts[:-1] + [v])]
        parts = parts[:-1]
    return None
