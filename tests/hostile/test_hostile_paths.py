"""Issue 17 §1-§2: hostile output and input paths.

An output that is a symlink, a FIFO, a character device or the same file as an input leaves the
file system exactly as it was except the intended target (checked with os.lstat before and
after); inputs that are FIFOs, devices or huge never hang and are one line; paths are literal.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from zeroplan._util import (
    CONFIG_MAX_BYTES,
    InputError,
    atomic_write_text,
    read_text_file,
    validate_output_path,
)
from zeroplan.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 2}}


def snapshot(d: Path) -> dict[str, tuple]:
    """(mode, inode, size, link target) of every entry under d, not following links."""
    out = {}
    for p in sorted(d.rglob("*")):
        s = os.lstat(p)
        out[str(p.relative_to(d))] = (s.st_mode, s.st_ino, s.st_size if stat.S_ISREG(s.st_mode) else 0,
                                      os.readlink(p) if stat.S_ISLNK(s.st_mode) else None)
    return out


def one_line_exit_2(r) -> str:
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.exception, r.output[-600:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.stderr
    return lines[0]


def _ds(tmp: Path) -> Path:
    p = tmp / "ds.json"
    p.write_text(json.dumps(DS))
    return p


# Commands that write, each with the input it reads: (argv builder(out, ds_config), option name)
WRITERS = {
    "check --output": lambda out, ds: ["check", str(ds), "--model", "llama-2-7b", "--hardware", "dgx-h100",
                                       "--gpus", "8", "--format", "json", "--output", str(out)],
    "report --html": lambda out, ds: ["report", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", str(ds),
                                      "--max-nodes", "1", "--html", str(out)],
    "report --svg": lambda out, ds: ["report", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", str(ds),
                                     "--max-nodes", "1", "--svg", str(out)],
    "recommend --emit-config": lambda out, ds: ["recommend", "--model", "llama-2-7b", "--hardware", "dgx-h100",
                                                "--gpus", "8", "--ds-config", str(ds), "--emit-config", str(out)],
}


@pytest.mark.parametrize("how", ["same-path", "dot-slash", "symlink", "hardlink"])
@pytest.mark.parametrize("cmd", list(WRITERS))
def test_output_that_is_an_input_is_refused_before_work(cmd, how, tmp_path, monkeypatch):
    ds = _ds(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = {"same-path": ds, "dot-slash": Path(".") / ds.name, "symlink": tmp_path / "link.json",
           "hardlink": tmp_path / "hard.json"}[how]
    if how == "symlink":
        os.symlink(ds, out)
    if how == "hardlink":
        os.link(ds, out)
    before, content = snapshot(tmp_path), ds.read_bytes()
    import importlib

    import zeroplan.core.plan as plan

    def no_work(*a, **k):
        raise AssertionError("planning ran before the output path was validated")

    for name in ("zeroplan.advice.check", "zeroplan.advice.recommend", "zeroplan.commands.report"):
        importlib.import_module(name)
    real, patched = plan.evaluate, []
    for mod in [m for n, m in sys.modules.items() if n.startswith("zeroplan")]:
        if getattr(mod, "evaluate", None) is real:  # modules that imported it by name too
            monkeypatch.setattr(mod, "evaluate", no_work)
            patched.append(mod)
    try:
        msg = one_line_exit_2(runner.invoke(app, WRITERS[cmd](out, ds)))
    finally:  # a module first imported during the run bound the stub from core.plan: give it the real one
        for mod in [m for n, m in sys.modules.items() if n.startswith("zeroplan")]:
            if getattr(mod, "evaluate", None) is no_work and mod not in patched:
                mod.evaluate = real
    assert "same file as" in msg
    assert snapshot(tmp_path) == before and ds.read_bytes() == content


def _training_inputs(tmp: Path) -> dict[str, Path]:
    ds = _ds(tmp)
    hf = tmp / "hf.json"
    hf.write_text(json.dumps({"per_device_train_batch_size": 1, "bf16": True, "deepspeed": str(ds)}))
    model = tmp / "mdir"
    model.mkdir()
    (model / "config.json").write_text((REPO / "tests" / "data" / "published" / "models" /
                                        sorted(os.listdir(REPO / "tests" / "data" / "published" / "models"))[0]).read_text())
    return {"ds": ds, "hf": hf, "model": model}


# an output over a file the command reads though no option names it as the output's rival: the training
# file (refused before any work), the DeepSpeed config that training file names (refused when the write
# comes: only reading the training file finds it), a model directory's config.json (before any work)
INDIRECT = {
    "report --html over --hf-args": (lambda f: ["report", "--model", "llama-2-7b", "--gpus", "8", "--max-nodes", "1",
                                                "--hf-args", str(f["hf"]), "--html", str(f["hf"])], "hf", "--hf-args"),
    "check --output over --hf-args": (lambda f: ["check", str(f["ds"]), "--model", "llama-2-7b", "--hardware", "dgx-h100",
                                                 "--gpus", "8", "--hf-args", str(f["hf"]), "--output", str(f["hf"])],
                                      "hf", "--hf-args"),
    "report --html over the config --hf-args names": (
        lambda f: ["report", "--model", "llama-2-7b", "--gpus", "8", "--max-nodes", "1", "--hf-args", str(f["hf"]),
                   "--html", str(f["ds"])], "ds", "this command read"),
    "recommend --emit-config over the config --hf-args names": (
        lambda f: ["recommend", "--model", "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8", "--hf-args",
                   str(f["hf"]), "--emit-config", str(f["ds"])], "ds", "this command read"),
    "recommend --emit-config over a model directory's config.json": (
        lambda f: ["recommend", "--model", str(f["model"]), "--hardware", "dgx-h100", "--gpus", "8",
                   "--emit-config", str(f["model"] / "config.json")], "model", "--model"),
}


@pytest.mark.parametrize("case", list(INDIRECT))
def test_an_output_never_replaces_a_file_the_command_read(case, tmp_path):
    args, which, named = INDIRECT[case]
    files = _training_inputs(tmp_path)
    before = snapshot(tmp_path)
    msg = one_line_exit_2(runner.invoke(app, args(files)))
    assert "same file as the input" in msg and named in msg
    assert snapshot(tmp_path) == before  # nothing replaced, no temp file left


def test_the_guard_is_the_cli_commands_own(tmp_path):
    """Outside a CLI command the library writes where it is asked, a file read earlier included (an API user
    regenerating a config in place); inside one, a file read by that command is refused at the write."""
    from zeroplan._util import input_guard

    p = tmp_path / "c.json"
    p.write_text("{}")
    read_text_file(p, "config")
    atomic_write_text(p, '{"a": 1}')
    with input_guard():
        read_text_file(p, "config")
        with pytest.raises(InputError, match="same file as the input .* this command read"):
            atomic_write_text(p, '{"b": 2}')
    assert p.read_text() == '{"a": 1}'
    atomic_write_text(p, '{"c": 3}')  # the guard ended with the command


def test_save_profile_naming_the_hardware_file_is_refused(tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text((REPO / "hardware_profiles" / "dgx-h100.toml").read_text())
    with pytest.raises(InputError, match="same file as the input --hardware"):
        validate_output_path(prof, option="--save-profile", inputs={"--hardware": str(prof)})
    r = runner.invoke(app, ["bench", "collectives", "--hardware", str(prof), "--save-profile", str(prof)])
    assert "same file" in one_line_exit_2(r)


@pytest.mark.parametrize("cmd", list(WRITERS))
def test_symlinked_output_writes_its_target_and_keeps_the_link(cmd, tmp_path):
    ds = _ds(tmp_path)
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "out.file"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.out"
    os.symlink(target, link)
    link_before = os.lstat(link)
    r = runner.invoke(app, WRITERS[cmd](link, ds))
    assert r.exit_code in (0, 1), r.output[-800:]
    after = os.lstat(link)
    assert stat.S_ISLNK(after.st_mode) and after.st_ino == link_before.st_ino and os.readlink(link) == str(target)
    assert target.read_text() != "old" and stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert sorted(p.name for p in real_dir.iterdir()) == ["out.file"]


def test_dangling_symlink_creates_its_target(tmp_path):
    target = tmp_path / "sub" / "new.txt"
    target.parent.mkdir()
    os.symlink(target, tmp_path / "link")
    atomic_write_text(tmp_path / "link", "x")
    assert target.read_text() == "x" and (tmp_path / "link").is_symlink()


def test_fifo_output_without_reader_is_one_line_and_untouched(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    before = snapshot(tmp_path)
    msg = one_line_exit_2(runner.invoke(app, WRITERS["check --output"](fifo, _ds(tmp_path))))
    assert "FIFO" in msg and "no reader" in msg
    after = snapshot(tmp_path)
    after.pop("ds.json")
    assert after == before


def test_fifo_output_with_reader_is_written_in_place(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))  # noqa: SIM115
    reader.start()
    time.sleep(0.2)  # let the reader open its end (the writer would otherwise report "no reader")
    ino = os.lstat(fifo).st_ino
    atomic_write_text(fifo, "hello through the pipe")
    reader.join(10)
    assert got == [b"hello through the pipe"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.lstat(fifo).st_ino == ino
    assert [p.name for p in tmp_path.iterdir()] == ["out.fifo"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_char_device_output_is_written_in_place_never_replaced(tmp_path):
    dev = tmp_path / "null"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null node, never the real one
    before = snapshot(tmp_path)
    r = runner.invoke(app, WRITERS["check --output"](dev, _ds(tmp_path)))
    assert r.exit_code in (0, 1), r.output[-600:]
    after = snapshot(tmp_path)
    after.pop("ds.json")
    assert after == before and stat.S_ISCHR(os.lstat(dev).st_mode)


@pytest.mark.parametrize("cmd", list(WRITERS))
@pytest.mark.parametrize("how", ["direct", "symlink"])
def test_kernel_pseudo_files_are_refused_before_work(cmd, how, tmp_path):
    """/proc and /sys files stat as regular files of size 0: refused by name before any work (the
    temporary file could not be created beside them anyway), also through a symlink."""
    ds = _ds(tmp_path)
    out = Path("/proc/self/mem")
    if how == "symlink":
        out = tmp_path / "report.out"
        os.symlink("/proc/self/environ", out)
    before = snapshot(tmp_path)
    line = one_line_exit_2(runner.invoke(app, WRITERS[cmd](out, ds)))
    assert "kernel pseudo-file under /proc" in line and str(out) in line
    assert snapshot(tmp_path) == before


def test_an_output_that_is_a_pipe_through_proc_suggests_stdout():
    """`--html /dev/stdout | cat`: /dev/stdout resolves to /proc/<pid>/fd/pipe:[N]."""
    r, w = os.pipe()
    try:
        with pytest.raises(InputError, match="an open pipe or socket, not a file; write to stdout with '-'"):
            validate_output_path(f"/proc/self/fd/{w}", option="--html")
    finally:
        os.close(r)
        os.close(w)


def test_report_counts_the_bytes_it_wrote_to_a_character_device(tmp_path):
    """'wrote PATH (N bytes)' counts what was written: /dev/null has no size to stat afterwards."""
    r = runner.invoke(app, WRITERS["report --html"]("/dev/null", _ds(tmp_path)))
    assert r.exit_code == 0, r.output[-600:]
    html = runner.invoke(app, WRITERS["report --html"]("-", _ds(tmp_path))).stdout
    assert f"wrote /dev/null ({len(html.encode()):,} bytes)" in r.stdout and len(html) > 1000


@pytest.mark.parametrize("path_kind", ["directory", "trailing-slash", "socket"])
def test_unwritable_kinds_are_refused(path_kind, tmp_path):
    import socket

    if path_kind == "directory":
        (tmp_path / "d").mkdir()
        out = str(tmp_path / "d")
    elif path_kind == "trailing-slash":
        out = str(tmp_path / "newdir") + "/"
    else:
        out = str(tmp_path / "s.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(out)
    before = snapshot(tmp_path)
    with pytest.raises(InputError):
        validate_output_path(out, option="--output")
    msg = one_line_exit_2(runner.invoke(app, WRITERS["report --html"](out, _ds(tmp_path))))
    assert "--html" in msg
    after = snapshot(tmp_path)
    after.pop("ds.json")
    assert after == before


def test_long_file_name_keeps_temp_within_255_bytes(tmp_path):
    name = "é" * 127  # 254 bytes: the longest legal name; the temp name must not exceed NAME_MAX
    atomic_write_text(tmp_path / name, "x")
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_mode_follows_the_existing_target(tmp_path):
    p = tmp_path / "f"
    p.write_text("old")
    os.chmod(p, 0o600)
    atomic_write_text(p, "new")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and p.read_text() == "new"


_NAME = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_NAME, kind=st.sampled_from(["absent", "file", "symlink", "fifo", "dir"]))
def test_property_output_kinds(tmp_path_factory, name, kind):
    """Over random names and file kinds: the write lands on the intended target or is one InputError,
    and nothing else in the directory changes."""
    if name in (".", ".."):
        return
    d = tmp_path_factory.mktemp("w")
    (d / "keep").write_text("k")
    p = d / name
    if kind == "file":
        p.write_text("old")
    elif kind == "symlink":
        os.symlink(d / "keep", p)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    before = snapshot(d)
    try:
        atomic_write_text(p, "new")
    except InputError as exc:
        assert "\n" not in str(exc)
        assert snapshot(d) == before
        return
    assert kind in ("absent", "file", "symlink")
    written = d / "keep" if kind == "symlink" else p
    assert written.read_text() == "new"
    after = snapshot(d)
    changed = {k for k in after if after[k] != before.get(k)} | (set(before) - set(after))
    assert changed <= {written.name}


# ----------------------------------------------------------------------------------- §2 reading

def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _zero_link(p: Path) -> None:
    os.symlink("/dev/zero", p)


def _huge(p: Path) -> None:
    with open(p, "wb") as fh:
        fh.truncate(CONFIG_MAX_BYTES + 10)  # sparse: no disk used


@pytest.mark.parametrize("maker,needle", [(_fifo, "FIFO"), (_zero_link, "character device"), (_huge, "over")],
                         ids=["fifo", "symlink-to-dev-zero", "over-cap"])
@pytest.mark.parametrize("role", ["--ds-config", "--model", "--hardware", "check", "nccl-log"])
def test_hostile_input_files_never_hang(maker, needle, role, tmp_path):
    p = tmp_path / "input.json"
    maker(p)
    args = {"--ds-config": ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", str(p)],
            "--model": ["estimate", "--model", str(p), "--gpus", "8"],
            "--hardware": ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--hardware", str(p)],
            "check": ["check", str(p), "--model", "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8"],
            "nccl-log": ["nccl-log", str(p)]}[role]
    if role == "nccl-log" and maker is _huge:
        pytest.skip("the NCCL log cap is larger (LOG_MAX_BYTES); covered by the library test below")
    r = runner.invoke(app, args)
    if role == "check" and maker is _huge:  # a regular but unreadable config is check's ZP000 finding
        assert r.exit_code == 1 and "ZP000" in r.stdout and "over" in r.stdout, r.output[-600:]
        return
    msg = one_line_exit_2(r)
    assert needle in msg, msg


def test_read_cap_is_enforced_whatever_the_file_claims(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b"{" + b" " * 2000 + b"}")
    with pytest.raises(InputError, match="over"):
        read_text_file(p, "DeepSpeed config", max_bytes=1000)


def test_check_paths_are_literal_and_glob_is_explicit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds[1].json").write_text(json.dumps(DS))
    (tmp_path / "ds1.json").write_text(json.dumps(DS))
    base = ["--model", "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8", "--format", "json"]
    r = runner.invoke(app, ["check", "ds[1].json", *base])
    assert r.exit_code in (0, 1), r.output[-600:]
    assert [f["path"] for f in json.loads(r.stdout)["files"]] == ["ds[1].json"]
    r = runner.invoke(app, ["check", "--glob", "ds[1].json", *base])
    assert [f["path"] for f in json.loads(r.stdout)["files"]] == ["ds1.json"]  # [1] is a character class
    r = runner.invoke(app, ["check", "--glob", "ds*.json", *base])
    assert sorted(f["path"] for f in json.loads(r.stdout)["files"]) == ["ds1.json", "ds[1].json"]
    assert "--glob" in one_line_exit_2(runner.invoke(app, ["check", "nomatch*.json", *base]))


def _tree(root: Path) -> None:
    """configs/a.json, configs/sub/b.json, configs/.hidden/c.json, a loop configs/sub/up -> configs, a
    symlink configs/link.json -> a.json and a hard link configs/hard.json to sub/b.json."""
    (root / "configs" / "sub").mkdir(parents=True)
    (root / "configs" / ".hidden").mkdir()
    for rel in ("configs/a.json", "configs/sub/b.json", "configs/.hidden/c.json"):
        (root / rel).write_text(json.dumps(DS))
    os.symlink("..", root / "configs" / "sub" / "up")
    os.symlink("a.json", root / "configs" / "link.json")
    os.link(root / "configs" / "sub" / "b.json", root / "configs" / "hard.json")


def test_check_glob_enters_no_symlinked_directory_and_checks_each_file_once(tmp_path, monkeypatch):
    """glob.glob(recursive=True) follows a link to a parent directory: one loop listed the same file once
    per level (41 times), and /proc/** (/proc/self/root is /) walked for ever."""
    from zeroplan.advice.config_paths import expand_config_paths

    monkeypatch.chdir(tmp_path)
    _tree(tmp_path)
    assert expand_config_paths(["configs/**/*.json"], expand_globs=True) == ["configs/a.json", "configs/hard.json"]
    assert expand_config_paths([str(tmp_path / "configs/**/b.json")], expand_globs=True) == [
        str(tmp_path / "configs/sub/b.json")]
    assert expand_config_paths(["configs/**/.hidden/*.json"], expand_globs=True) == ["configs/.hidden/c.json"]
    assert expand_config_paths(["configs/**"], expand_globs=True) == ["configs/a.json", "configs/hard.json"]
    # as glob: a component before a trailing ** is a directory (a.json/** lists nothing); a trailing slash
    # lists directories only, so no config
    assert expand_config_paths(["configs/*/**"], expand_globs=True) == ["configs/sub/b.json"]
    for pattern in ("configs/*.json/**", "configs/**/"):
        with pytest.raises(InputError, match="the glob matches no file"):
            expand_config_paths([pattern], expand_globs=True)
    with pytest.raises(InputError, match="DeepSpeed config path is empty"):
        expand_config_paths([""])
    with pytest.raises(InputError, match="--glob pattern is empty"):
        expand_config_paths([""], expand_globs=True)
    # the same file by two names, a symlink or a hard link: once, under the first name given
    assert expand_config_paths(["configs/a.json", "./configs/a.json", "configs/link.json"]) == ["configs/a.json"]
    assert expand_config_paths(["configs/sub/b.json", "configs/hard.json"]) == ["configs/sub/b.json"]
    with pytest.raises(InputError, match="the glob matches no file"):
        expand_config_paths(["/proc/**/*.zeroplan-none"], expand_globs=True)


def test_check_glob_matching_is_linear_in_a_pattern_of_many_double_stars():
    """Matching is memoised on (pattern, path) positions: 16 ``**`` against 40 directories would branch
    into billions of ways without it."""
    from zeroplan.advice.config_paths import _matches

    deep = ["d"] * 40
    assert not _matches(["**", "*"] * 16 + ["x.json"], deep + ["y.json"])
    assert _matches(["**", "*"] * 16 + ["*.json"], deep + ["y.json"])
    assert not _matches(["**", "*.json"], [".hidden", "y.json"]) and _matches(["**", ".hidden", "*.json"],
                                                                             ["a", ".hidden", "y.json"])


def test_check_glob_stops_after_its_directory_bound(tmp_path, monkeypatch):
    import zeroplan.advice.config_paths as cp

    for i in range(5):
        (tmp_path / f"d{i}").mkdir()
    monkeypatch.setattr(cp, "MAX_GLOB_DIRS", 3)
    with pytest.raises(InputError, match="walked over 3 directories"):
        cp.expand_config_paths([str(tmp_path / "**/*.json")], expand_globs=True)


def test_tilde_expands(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    r = runner.invoke(app, ["check", "~/ds.json", "--model", "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8"])
    assert r.exit_code in (0, 1), r.output[-600:]
    r = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", "~/ds.json", "--json"])
    assert r.exit_code == 0, r.output[-600:]
    import pwd

    from zeroplan._util import expand_path

    me = pwd.getpwuid(os.getuid())
    assert expand_path(f"~{me.pw_name}/ds.json") == os.path.join(me.pw_dir, "ds.json")


@pytest.mark.parametrize("name", ["a" * 300, "x" * 250 + "/" + "y" * 300, "caf\udce9.json", "ansi\x1b[31m.json",
                                  "[bold]markup[/bold].json"])
def test_odd_names_are_reported_not_tracebacks(name, tmp_path):
    p = str(tmp_path / name)
    msg = one_line_exit_2(runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", p]))
    assert "\x1b" not in msg and "\udce9" not in msg
    if "markup" in name:
        assert "[bold]markup[/bold]" in msg  # printed literally, not interpreted as rich markup


# ----------------------------------------------------------------------------------- signals and stdout

def _zeroplan(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "zeroplan", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _stuck_writer(out: Path, ignore_hup: bool = False) -> subprocess.Popen:
    """``report --html out`` stuck between write and rename (fsync sleeps), once its temp file exists."""
    code = ("import os, time, sys, signal\n"
            + ("signal.signal(signal.SIGHUP, signal.SIG_IGN)\n" if ignore_hup else "")
            + "os.fsync = lambda fd: time.sleep(60)\nfrom zeroplan.cli import main\n"
            "main(['report', '--model', 'llama-2-7b', '--gpus', '8', '--max-nodes', '1', '--html', sys.argv[1]])\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.endswith(".tmp") for p in out.parent.iterdir()):
        time.sleep(0.05)
    assert any(p.name.endswith(".tmp") for p in out.parent.iterdir()), "the writer never started"
    time.sleep(0.3)  # any moment works (the temp is registered under a signal mask); this one is mid-write
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_exit_with_one_line_and_no_temp_left(signum, code, tmp_path):
    """SIGHUP (the terminal or SSH session closed) is handled as SIGTERM is: before, its default action
    killed the process without removing a temp file being written."""
    out = tmp_path / "report.html"
    out.write_text("old")
    proc = _stuck_writer(out)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err.decode()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert len(lines) == 1 and f"terminated ({signal.Signals(signum).name})" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"] and out.read_text() == "old"


@pytest.mark.slow
def test_an_ignored_sighup_stays_ignored(tmp_path):
    """`nohup zeroplan …` starts with SIGHUP ignored: zeroplan leaves it so and keeps running."""
    out = tmp_path / "report.html"
    proc = _stuck_writer(out, ignore_hup=True)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()[1].decode()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143


@pytest.mark.slow
@pytest.mark.parametrize("env_over,target", [({}, "/dev/full"), ({"LC_ALL": "C", "PYTHONIOENCODING": "ascii"}, None)])
def test_stdout_that_cannot_take_the_output(env_over, target):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_over)
    args = [sys.executable, "-m", "zeroplan", "models", "show", "llama-2-7b"]
    if target:
        with open(target, "w") as fh:
            r = subprocess.run(args, cwd=REPO, env=env, stdout=fh, stderr=subprocess.PIPE, timeout=60)
        assert r.returncode == 2 and len(r.stderr.decode().strip().splitlines()) == 1, r.stderr.decode()
    else:
        r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, timeout=60)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()


@pytest.mark.slow
def test_closed_pipe_exits_quietly():
    proc = _zeroplan(["models", "list"])
    proc.stdout.close()  # the reader went away before zeroplan wrote
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and proc.returncode in (0, 1, 141), (proc.returncode, err)


def test_bench_output_naming_the_save_profile_calls_it_an_output(tmp_path):
    """It called --save-profile 'the input --save-profile'; both are files the command writes."""
    p = tmp_path / "same.json"
    msg = one_line_exit_2(runner.invoke(app, ["bench", "collectives", "--save-profile", str(p), "--output", str(p)]))
    assert "is the same file as the --save-profile output" in msg and "input" not in msg
    assert not p.exists()
