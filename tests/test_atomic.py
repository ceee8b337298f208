"""Every file zeroplan writes goes to a temporary file in the same directory and is renamed over
the target: an interrupted write never leaves a truncated file, and a failed one leaves the old
file as it was and no temporary file behind.

Two checks:
1. static: no module writes a file except through zeroplan._util.atomic_write_* (an AST scan of
   the package for open(..., "w"), Path.write_text/write_bytes, os.open, shutil copies, json.dump);
   the two internal exceptions are listed with the reason;
2. behavioural: each writer — emitted configs (recommend --emit-config, write_ds_config), profiles
   (save_profile, bench collectives --save-profile), reports (report --html / --svg, check
   --output, bench collectives --output, bench zero --output) — is interrupted between writing
   and renaming (the rename raises) and while writing (fsync raises ENOSPC): the old file is
   intact byte for byte and no temporary file is left.
"""

from __future__ import annotations

import ast
import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "zeroplan"
runner = CliRunner()
OLD = b"previous contents \xe2\x9c\x93 (must survive a failed write)\n"

# Internal files that are not user output; each is written in a private temporary directory.
ALLOWED = {
    ("runtime/launch.py", "open"): "faulthandler needs a live file object for a rank's stack dump (temp dir)",
    ("bench/ds_worker.py", "open"): "per-rank JSON in the run's temp dir, written to .tmp then os.replace",
    ("bench/ds_worker.py", "json.dump"): "same file as above (tmp + os.replace)",
    ("cli.py", "os.open"): "opens /dev/null (read-write, never created) to silence a broken stdout",
}


# ------------------------------------------------------------------------------------- 1. static scan

def _writes(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if name == "open" and owner in ("", "io", "builtins"):
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                found.append(("open", node.lineno))
            elif mode is not None and not isinstance(mode, ast.Constant):
                found.append(("open", node.lineno))  # a computed mode: count it as a write
        elif name in ("write_text", "write_bytes"):
            found.append((name, node.lineno))
        elif owner == "os" and name in ("open", "rename", "link", "symlink", "truncate", "ftruncate"):
            found.append((f"os.{name}", node.lineno))
        elif owner == "shutil" and name in ("copy", "copy2", "copyfile", "move", "copytree"):
            found.append((f"shutil.{name}", node.lineno))
        elif owner == "json" and name == "dump":
            found.append(("json.dump", node.lineno))
        elif owner == "tempfile" and name in ("mkstemp", "NamedTemporaryFile") and "_util.py" not in "":
            found.append((f"tempfile.{name}", node.lineno))
    return found


def test_every_file_write_goes_through_atomic_write():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "_util.py":
            continue  # the atomic writer itself
        for what, line in _writes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (rel, what) not in ALLOWED:
                offenders.append(f"zeroplan/{rel}:{line}: {what}")
    assert offenders == [], "write through zeroplan._util.atomic_write_text/bytes instead:\n" + "\n".join(offenders)


def test_the_scan_would_catch_a_direct_write():
    code = ("import json, os\nopen(p, 'w')\nPath(p).write_text('x')\nos.rename(a, b)\njson.dump(d, fh)\n"
            "open(p)\nopen(p, 'rb')\n")
    assert [w for w, _ in _writes(ast.parse(code))] == ["open", "write_text", "os.rename", "json.dump"]


# ------------------------------------------------------------------------------------- 2. interruptions

class Interrupt:
    """Make the atomic writer fail for files in ``root``: at the rename, or in the middle of the write."""

    def __init__(self, monkeypatch, root: Path, where: str):
        self.root, self.where, self.hits = root.resolve(), where, 0
        real_replace, real_fsync = os.replace, os.fsync

        def replace(src, dst, *a, **k):
            if Path(dst).resolve().parent == self.root and self.where == "rename":
                self.hits += 1
                raise KeyboardInterrupt  # the user's Ctrl-C between write and rename
            return real_replace(src, dst, *a, **k)

        def fsync(fd):
            target = os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").exists() else ""
            if self.where == "write" and Path(target).parent == self.root:
                self.hits += 1
                os.ftruncate(fd, max(0, os.fstat(fd).st_size // 2))  # half the data reached the disk
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "fsync", fsync)


def _call(fn):
    from zeroplan._util import InputError

    try:
        fn()
    except (KeyboardInterrupt, OSError, SystemExit, InputError):
        pass


def _cli(args):
    return lambda: runner.invoke(app, args, catch_exceptions=True)


def _lib_save_profile(target):
    from zeroplan.specs.hardware import load_profile, save_profile

    return lambda: save_profile(load_profile("dgx-h100"), target)


def _lib_write_ds_config(target):
    from zeroplan.specs.deepspeed_config import ZeroConfig, build_ds_config, write_ds_config

    cfg = build_ds_config(ZeroConfig(stage=3), precision="bf16", micro_batch=1, grad_accum=1, world_size=8)
    return lambda: write_ds_config(target, cfg)


WRITERS = {
    "report --html": lambda t: _cli(["report", "--model", "llama-2-7b", "--gpus", "8", "--html", str(t)]),
    "report --svg": lambda t: _cli(["report", "--model", "llama-2-7b", "--gpus", "8", "--svg", str(t)]),
    "recommend --emit-config": lambda t: _cli(["recommend", "--model", "llama-2-7b", "--hardware", "dgx-h100",
                                               "--gpus", "8", "--emit-config", str(t)]),
    "check --output": lambda t: _cli(["check", str(REPO / "examples" / "configs" / "zero2-bf16.json"), "--model",
                                      "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8", "--format", "junit",
                                      "--output", str(t)]),
    "save_profile": _lib_save_profile,
    "write_ds_config": _lib_write_ds_config,
}


# files a writer writes beside its target (written after it, so an interrupted target leaves none)
SIDECARS = {"recommend --emit-config": ["result.file.peft.json"]}  # the PEFT / Trainer settings


@pytest.mark.parametrize("where", ["rename", "write"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_interrupted_write_keeps_the_old_file(writer, where, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "result.file"
    target.write_bytes(OLD)
    run = WRITERS[writer](target)
    # control: without interruption the writer does replace the file (else the test proves nothing)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "result.file").write_bytes(OLD)
    _call(WRITERS[writer](ctl / "result.file"))
    assert (ctl / "result.file").read_bytes() != OLD, f"{writer} did not write its file"
    full = (ctl / "result.file").read_bytes()

    trap = Interrupt(monkeypatch, out, where)
    _call(run)
    assert trap.hits >= 1, f"{writer} wrote {target} without zeroplan._util.atomic_write_*"
    assert target.read_bytes() == OLD  # old file intact, byte for byte
    assert sorted(p.name for p in out.iterdir()) == ["result.file"]  # no temporary file left
    monkeypatch.undo()
    _call(run)
    assert target.read_bytes() == full and sorted(p.name for p in out.iterdir()) == ["result.file", *SIDECARS.get(writer, [])]


@pytest.mark.slow
def test_bench_collectives_outputs_are_atomic(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    report, profile = out / "report.json", out / "profile.toml"
    report.write_bytes(OLD)
    profile.write_bytes(OLD)
    # sizes large enough that time grows with size (the alpha-beta fit refuses a flat sweep)
    args = ["bench", "collectives", "--backend", "gloo", "--nproc", "2", "--ops", "all_reduce", "--min-bytes", "256K",
            "--max-bytes", "8M", "--factor", "2", "--warmup", "1", "--iters", "3", "--timeout", "300",
            "--hardware", "dgx-h100", "--save-profile", str(profile), "--output", str(report), "--json"]
    trap = Interrupt(monkeypatch, out, "rename")
    r = runner.invoke(app, args)
    assert trap.hits >= 1, r.output[-1500:]
    assert report.read_bytes() == OLD and profile.read_bytes() == OLD
    assert sorted(p.name for p in out.iterdir()) == ["profile.toml", "report.json"]


@pytest.mark.slow
def test_bench_zero_output_is_atomic(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    report = out / "zero.json"
    report.write_bytes(OLD)
    args = ["bench", "zero", "--model", "llama-2-7b", "--stage", "1", "--nproc", "2", "--backend", "gloo",
            "--steps", "1", "--timeout", "300", "--output", str(report), "--json"]
    trap = Interrupt(monkeypatch, out, "write")
    _call(_cli(args))
    assert trap.hits >= 1
    assert report.read_bytes() == OLD
    assert [p.name for p in out.iterdir()] == ["zero.json"]
    monkeypatch.undo()
    r = runner.invoke(app, args)
    assert r.exit_code in (0, 1), r.output[-1500:]
    assert json.loads(report.read_text())["stages"]


def test_written_files_follow_the_umask(tmp_path):
    """mkstemp creates 0600 files; the writer must give reports and configs the usual 0666 & ~umask."""
    from zeroplan._util import atomic_write_text

    old = os.umask(0o022)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        atomic = atomic_write_text(tmp_path / "atomic.txt", "x")
    finally:
        os.umask(old)
    assert (atomic.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777) == 0o644


def test_writing_over_an_existing_file_keeps_no_temporary(tmp_path):
    from zeroplan._util import atomic_write_bytes

    target = tmp_path / "a.json"
    for i in range(3):
        atomic_write_bytes(target, b"x" * (10 ** i))
    assert target.read_bytes() == b"x" * 100 and [p.name for p in tmp_path.iterdir()] == ["a.json"]
