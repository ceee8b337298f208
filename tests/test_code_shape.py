"""The size rules of zeroplan/ARCHITECTURE.md, checked on the source (issue 14 §3): a module of one
concern stays readable, a function does one thing.

Every ``zeroplan/**/*.py`` is parsed with ``ast`` (nothing is imported or run). A module may have at
most ``MAX_MODULE_LINES`` lines, a function or method at most ``MAX_FUNCTION_LINES`` (``def`` line
to its last line, decorators not counted, nested functions counted within their parent and also on
their own). The working targets are lower (~400 and ~100); these are the hard limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeroplan"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100

# Known exceptions, each with why it is allowed and who removes it: "path/in/zeroplan.py" or
# "path/in/zeroplan.py:qualified.function" -> reason. A stale entry (the code now fits) fails too.
ALLOWED: dict[str, str] = {
}


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method, nested ones included."""
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, _lines(child)))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _measure() -> dict[str, int]:
    """"path" -> module lines and "path:function" -> function lines, for everything over a limit."""
    over: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            over[rel] = n
        for name, lines in _functions(ast.parse(text, filename=str(path))):
            if lines > MAX_FUNCTION_LINES:
                over[f"{rel}:{name}"] = lines
    return over


def test_no_module_or_function_over_the_limits():
    over = {k: v for k, v in _measure().items() if k not in ALLOWED}
    assert not over, ("over the size limits (module > %d lines, function > %d lines): split by concern, or add "
                      "an ALLOWED entry with the reason: %s" % (MAX_MODULE_LINES, MAX_FUNCTION_LINES, over))


def test_allow_list_has_no_stale_entries():
    over = _measure()
    stale = sorted(k for k in ALLOWED if k not in over)
    assert not stale, f"these now fit the limits; remove them from ALLOWED: {stale}"


@pytest.mark.parametrize("source, expected", [
    ("def f():\n" + "    x = 1\n" * 100, {"f": 101}),  # def line + 100 body lines
    ("class C:\n    def m(self):\n        pass\n", {"C.m": 2}),
    ("def outer():\n    def inner():\n        return 1\n    return inner\n", {"outer": 4, "outer.inner": 2}),
])
def test_the_counter_counts_def_to_last_line(source, expected):
    assert dict(_functions(ast.parse(source))) == expected
