"""The layering rule of zeroplan/ARCHITECTURE.md, checked on the source (issue 14 §2):

    specs → core → advice / report → api → cli (commands);  runtime → bench;  inspect reads specs

Every module's imports are parsed with ``ast`` (module level, inside functions, under
TYPE_CHECKING alike) and each import of a zeroplan module is checked against the table below.
Nothing is imported or run: a lazy import inside a function counts the same as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeroplan"
SHARED = {"_util", "_version"}

# layer -> the layers it may import (besides itself and the shared modules)
MAY_IMPORT: dict[str, set[str]] = {
    "shared": set(),
    "specs": set(),
    "core": {"specs"},
    "advice": {"core", "specs"},
    "report": {"core", "specs", "advice"},  # advice: its result models only (see _report_reads_models)
    "inspect": {"specs"},
    "runtime": {"specs"},
    "bench": {"runtime", "core", "specs"},
    "api": {"specs", "core", "advice", "report", "inspect"},
    "commands": {"specs", "core", "advice", "report", "inspect", "runtime", "bench", "api"},
    "cli": {"specs", "core", "advice", "report", "inspect", "runtime", "bench", "api", "commands"},
}

# Library layers import zeroplan modules at module level, so the graph above is the real one. A lazy
# zeroplan import there needs an entry here with the heavy dependency it keeps off the planning path
# ("importing.module:imported.module" -> why). Besides rich, pynvml and torch (not zeroplan modules),
# the file readers are imported where a file is read: a plan from a catalog name compiles and runs
# none of them (issue 14: the cold start; measured in tests/bench/bench_startup.py).
LIBRARY = {"specs", "core", "advice", "report", "inspect"}
LAZY_ALLOWED: dict[str, str] = {
    "zeroplan.core.inputs:zeroplan.specs.ds_reader": "the DeepSpeed config reader, only with --ds-config",
    "zeroplan.core.inputs:zeroplan.specs.hardware_load": "the profile TOML reader and checks, only with --hardware",
    "zeroplan.core.finetune_inputs:zeroplan.specs.training_files": "the four training-file readers, only for a file",
}

# Known breaks in files owned by another change, each an xfail(strict=True): module -> why.
KNOWN_UPWARD: dict[str, str] = {}
KNOWN_LAZY: dict[str, str] = {}


def layer_of(module: str) -> str:
    """'zeroplan.core.memory' -> 'core'; the package face, zeroplan.api and zeroplan.options (the API's
    input models) are the api layer."""
    parts = module.split(".")
    assert parts[0] == "zeroplan", module
    if len(parts) == 1 or parts[1] in ("api", "options", "__init__"):
        return "api"
    head = parts[1]
    if head in SHARED:
        return "shared"
    if head in ("cli", "__main__"):
        return "cli"
    if head in MAY_IMPORT:
        return head
    raise AssertionError(f"{module}: no layer for '{head}'; add it to zeroplan/ARCHITECTURE.md and MAY_IMPORT")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def zeroplan_imports(path: Path) -> list[tuple[str, list[str], int, bool]]:
    """(imported module, names imported from it, line, inside a function) for each zeroplan import.

    ``from zeroplan import core`` names the submodule ``zeroplan.core``; ``from zeroplan import
    __version__`` names the package face itself."""
    module = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[str, list[str], int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "zeroplan" or alias.name.startswith("zeroplan."):
                        out.append((alias.name, [], child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(child, module, path.name == "__init__.py")
                if target == "zeroplan":
                    for alias in child.names:
                        sub = PACKAGE / alias.name
                        if sub.is_dir() or sub.with_suffix(".py").is_file():
                            out.append((f"zeroplan.{alias.name}", [], child.lineno, in_function))
                        else:
                            out.append(("zeroplan", [alias.name], child.lineno, in_function))
                elif target.startswith("zeroplan."):
                    out.append((target, [a.name for a in child.names], child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


def _report_reads_models(names: list[str]) -> bool:
    """report may take advice's result models (classes: CapWords), never a function that decides."""
    return bool(names) and all(n[:1].isupper() for n in names)


def violations(path: Path) -> list[str]:
    """Imports of ``path`` that break the layer table."""
    module = module_name(path)
    mine = layer_of(module)
    bad = []
    for target, names, line, _ in zeroplan_imports(path):
        theirs = layer_of(target)
        where = f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({mine}) imports {target} ({theirs})"
        if theirs != mine and theirs != "shared" and theirs not in MAY_IMPORT[mine]:
            bad.append(where + f"; {mine} may import only {sorted(MAY_IMPORT[mine]) or 'nothing else'}")
        elif mine == "report" and theirs == "advice" and not _report_reads_models(names):
            bad.append(where + "; report may read advice's result models (classes), not call advice")
    return bad


def lazy_imports(path: Path) -> list[str]:
    """zeroplan imports inside functions of a library module that LAZY_ALLOWED does not list."""
    module = module_name(path)
    if layer_of(module) not in LIBRARY:
        return []
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target} inside a function; import it "
            "at module level, or list it in LAZY_ALLOWED with the heavy dependency it keeps off the planning path"
            for target, _, line, in_function in zeroplan_imports(path)
            if in_function and f"{module}:{target}" not in LAZY_ALLOWED]


def _marked(known: dict[str, str]) -> list:
    return [pytest.param(p, id=module_name(p), marks=pytest.mark.xfail(strict=True, reason=known[module_name(p)]))
            if module_name(p) in known else pytest.param(p, id=module_name(p)) for p in MODULES]


@pytest.mark.parametrize("path", _marked(KNOWN_UPWARD))
def test_no_upward_import(path: Path) -> None:
    assert not violations(path), "\n".join(violations(path))


@pytest.mark.parametrize("path", _marked(KNOWN_LAZY))
def test_library_imports_zeroplan_at_module_level(path: Path) -> None:
    assert not lazy_imports(path), "\n".join(lazy_imports(path))


def test_every_module_has_a_layer() -> None:
    for p in MODULES:
        layer_of(module_name(p))


def test_advice_never_imports_renderers_or_commands() -> None:
    """Issue 14: advice builds structured reasons; the renderers (report) and the shell turn them into text."""
    bad = [f"{module_name(p)} -> {t}" for p in MODULES if layer_of(module_name(p)) == "advice"
           for t, _, _, _ in zeroplan_imports(p)
           if layer_of(t) in ("report", "commands", "cli", "api")]
    assert not bad, bad


def test_planning_layers_never_import_torch() -> None:
    """specs, core, advice, report, inspect and the api are torch-free (parsed, at any depth)."""
    bad = []
    for p in MODULES:
        if layer_of(module_name(p)) not in LIBRARY | {"api"}:
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{module_name(p)}: {n}" for n in names if n == "torch" or n.startswith(("torch.", "deepspeed"))]
    assert not bad, bad


@pytest.mark.parametrize("source, layer, expect", [
    ("from zeroplan.commands._common import x\n", "core", "may import only"),
    ("def f():\n    from zeroplan.report.render import gb\n", "advice", "may import only"),
    ("from zeroplan import __version__\n", "report", "may import only"),
    ("from ..core import memory\n", "specs", "may import only"),
    ("from zeroplan.advice.recommend import recommend\n", "report", "not call advice"),
])
def test_the_checker_catches_upward_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                                            layer: str, expect: str) -> None:
    """The rule can fail: a synthetic module in each layer with an import that breaks it."""
    pkg = tmp_path / "zeroplan"
    (pkg / layer).mkdir(parents=True)
    (pkg / "core").mkdir(exist_ok=True)
    (pkg / "core" / "memory.py").write_text("")
    f = pkg / layer / "probe.py"
    f.write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    found = violations(f)
    assert any(expect in v for v in found), found


def test_the_checker_catches_a_lazy_library_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "zeroplan"
    (pkg / "core").mkdir(parents=True)
    f = pkg / "core" / "probe.py"
    f.write_text("def f():\n    from zeroplan.specs.model import ModelSpec\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    assert not violations(f)
    assert any("inside a function" in v for v in lazy_imports(f))
