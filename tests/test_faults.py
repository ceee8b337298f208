"""Bench faults through the CLI, as a user meets them: a rank killed mid-step, a rank that stalls,
the user's Ctrl-C, the launching shell killed, a busy port, a world too large.

tests/test_launch.py covers ``spawn`` itself (a rank that raises / dies / exits / stalls, library
level) and the torchrun port-in-use path of ``bench collectives``; tests/test_bench_collectives.py
covers the injected-delay straggler. Here the faults are real signals sent from outside to the
processes of a running ``zeroplan bench`` command (SIGKILL, SIGSTOP, SIGINT), and every test checks:

- the command ends within a bounded time with a clear one-line error naming the rank,
- no traceback,
- no output file (not even a partial or temporary one) is left behind,
- every process the command started has exited (checked by pid from /proc, zombies counted dead).

Linux only (/proc); torch needed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
if not Path("/proc/self/task").is_dir():  # pragma: no cover
    pytest.skip("needs Linux /proc", allow_module_level=True)

from typer.testing import CliRunner  # noqa: E402

from zeroplan.cli import app  # noqa: E402

pytestmark = pytest.mark.slow
runner = CliRunner()


# ------------------------------------------------------------------------------------- process helpers

def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out |= {int(x) for x in (task / "children").read_text().split()}
            except OSError:
                pass
    except OSError:
        pass
    return out


def descendants(pid: int) -> set[int]:
    seen: set[int] = set()
    todo = [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _as_a_foreground_job() -> None:
    """What an interactive shell does for a foreground job: SIGINT/SIGQUIT back to their defaults.

    The test process may have inherited them ignored (a job started with ``&`` or ``nohup`` by a
    non-interactive shell: bash sets SIGINT/SIGQUIT to SIG_IGN for it, and an ignored signal stays
    ignored across exec, so Python then installs no KeyboardInterrupt handler). A Ctrl-C test
    must not depend on how the test run itself was started.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class Command:
    """A zeroplan command in its own session; stdout/stderr to files (no pipe can fill up)."""

    def __init__(self, args: list[str], tmp: Path, env: dict | None = None):
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        self.seen: set[int] = set()
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "zeroplan", *args], stdout=o, stderr=e,
                                         env={**os.environ, **(env or {})}, start_new_session=True, cwd=tmp,
                                         preexec_fn=_as_a_foreground_job)

    def ranks(self, n: int, timeout: float = 300) -> list[int]:
        """Wait until the command has started ``n`` rank processes; return their pids."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = descendants(self.proc.pid)
            self.seen |= kids
            live = sorted(p for p in kids if alive(p))
            if len(live) >= n:
                return live
            if self.proc.poll() is not None:
                pytest.fail(f"command ended before starting {n} ranks:\n{self.err.read_text()[-2000:]}")
            time.sleep(0.05)
        pytest.fail(f"{n} ranks did not start within {timeout} s")

    def watch(self, seconds: float) -> None:
        """Record descendants for a while (ranks may start helpers)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            time.sleep(0.05)

    def wait(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"command still running after {timeout} s:\n{self.err.read_text()[-2000:]}")
        return rc, time.monotonic() - t0

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def assert_no_survivors(self, grace: float = 60.0) -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            left = [p for p in self.seen | {self.proc.pid} if alive(p)]
            if not left:
                return
            time.sleep(0.1)
        pytest.fail(f"processes still alive after the command ended: {left}")

    def cleanup(self) -> None:
        """Only our own session: SIGKILL what this test started, if anything is left."""
        for p in sorted(self.seen | {self.proc.pid}):
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def one_error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert "Traceback" not in text, text[-3000:]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


def no_files_but(d: Path, allowed: set[str]) -> None:
    assert {p.name for p in d.iterdir()} <= allowed, sorted(p.name for p in d.iterdir())


# Bounds on waiting, not assertions on speed. Measured on an idle 2-core machine, each command
# below ends 0.1-1.5 s after its fault (2-7 s with its timeout of 6 s) and each command starts its
# ranks within 3 s; under two CPU burners plus other users, 2-4x that. The bounds are >= 10x the
# loaded figures: a command that really hangs still fails the test, a slow machine does not.
HANG_S = 180

# A sweep that lasts tens of seconds unless interrupted: rank 0 completes 20 ms late per call.
LONG_SWEEP = ["bench", "collectives", "--backend", "gloo", "--nproc", "3", "--ops", "all_reduce,all_gather",
              "--min-bytes", "1K", "--max-bytes", "16M", "--warmup", "1", "--iters", "40", "--timeout", "120",
              "--output", "report.json", "--json"]
SLOW_ENV = {"ZEROPLAN_BENCH_DELAY": "0:0.02"}
LOGS = {"stdout.txt", "stderr.txt"}


# ------------------------------------------------------------------------------------- bench collectives

def test_collectives_rank_killed_mid_sweep(tmp_path):
    cmd = Command(LONG_SWEEP, tmp_path, SLOW_ENV)
    try:
        ranks = cmd.ranks(3)
        cmd.watch(1.5)  # inside the sweep
        os.kill(ranks[-1], signal.SIGKILL)
        rc, took = cmd.wait(HANG_S)
        err = one_error_line(cmd.stderr())
        assert rc == 1, err
        assert "died with SIGKILL" in err and "rank" in err
        assert cmd.stdout() == ""
        no_files_but(tmp_path, LOGS)  # no report.json, no temporary file
        cmd.assert_no_survivors()
    finally:
        cmd.cleanup()


def test_collectives_stalled_rank_hits_the_timeout(tmp_path):
    """A rank frozen by SIGSTOP (a stuck straggler: swapped out, a hung driver) -> --timeout."""
    args = ["bench", "collectives", "--backend", "gloo", "--nproc", "2", "--ops", "all_reduce", "--min-bytes",
            "1K", "--max-bytes", "4M", "--warmup", "1", "--iters", "200", "--timeout", "6",
            "--output", "report.json", "--json"]
    cmd = Command(args, tmp_path)
    try:
        ranks = cmd.ranks(2)
        os.kill(ranks[0], signal.SIGSTOP)
        rc, took = cmd.wait(HANG_S)
        err = one_error_line(cmd.stderr())
        assert rc == 1, err
        assert "rank" in err and "6 s" in err
        no_files_but(tmp_path, LOGS)
        cmd.assert_no_survivors()
    finally:
        cmd.cleanup()


def test_collectives_ctrl_c_stops_every_rank(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group."""
    cmd = Command(LONG_SWEEP, tmp_path, SLOW_ENV)
    try:
        cmd.ranks(3)
        cmd.watch(1.0)
        os.killpg(cmd.proc.pid, signal.SIGINT)  # our own session, started by this test
        rc, took = cmd.wait(HANG_S)
        assert rc == 130, cmd.stderr()[-2000:]  # 128 + SIGINT, the shell convention
        text = cmd.stderr()
        assert "Traceback" not in text, text[-2000:]
        assert [ln for ln in text.splitlines() if ln.strip()] == ["zeroplan: error: interrupted"], text[-2000:]
        assert cmd.stdout() == ""
        no_files_but(tmp_path, LOGS)
        cmd.assert_no_survivors()
    finally:
        cmd.cleanup()


def test_collectives_launcher_killed_leaves_no_orphan_ranks(tmp_path):
    """The shell or the job scheduler SIGKILLs zeroplan itself: its ranks must not live on."""
    cmd = Command(LONG_SWEEP, tmp_path, SLOW_ENV)
    try:
        cmd.ranks(3)
        cmd.watch(1.0)
        os.kill(cmd.proc.pid, signal.SIGKILL)
        cmd.wait(HANG_S)
        cmd.assert_no_survivors()
        no_files_but(tmp_path, LOGS)
    finally:
        cmd.cleanup()


# ------------------------------------------------------------------------------------- bench zero

ZERO_RUN = ["bench", "zero", "--model", "llama-2-7b", "--stage", "2", "--nproc", "2", "--backend", "gloo",
            "--steps", "5000", "--timeout", "120", "--output", "zero.json", "--json"]


def test_zero_rank_killed_mid_step(tmp_path):
    cmd = Command(ZERO_RUN, tmp_path)
    try:
        ranks = cmd.ranks(2)
        cmd.watch(3.0)  # model built, steps running
        os.kill(ranks[1], signal.SIGKILL)
        rc, took = cmd.wait(HANG_S)
        assert rc == 1, cmd.stderr()[-2000:]
        text = cmd.stderr() + cmd.stdout()
        assert "Traceback" not in text
        assert "SIGKILL" in text and "rank" in text
        assert not (tmp_path / "zero.json").exists() or json.loads((tmp_path / "zero.json").read_text())["failures"]
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        cmd.assert_no_survivors()
    finally:
        cmd.cleanup()


def test_zero_stalled_rank_hits_the_timeout(tmp_path):
    args = [a if a != "120" else "6" for a in ZERO_RUN]
    cmd = Command(args, tmp_path)
    try:
        ranks = cmd.ranks(2)
        cmd.watch(2.0)
        os.kill(ranks[0], signal.SIGSTOP)
        rc, took = cmd.wait(HANG_S)
        assert rc == 1, cmd.stderr()[-2000:]
        text = cmd.stderr() + cmd.stdout()
        assert "Traceback" not in text and "rank" in text and "6 s" in text
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        cmd.assert_no_survivors()
    finally:
        cmd.cleanup()


def test_zero_port_in_use_under_torchrun_environment(tmp_path):
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    cmd = Command(["bench", "zero", "--model", "llama-2-7b", "--stage", "1", "--steps", "1", "--backend", "gloo",
                   "--timeout", "20", "--output", "zero.json", "--json"], tmp_path, env)
    try:
        rc, took = cmd.wait(HANG_S)
    finally:
        holder.close()
        cmd.cleanup()
    err = one_error_line(cmd.stderr())
    assert rc == 2 and f"MASTER_PORT={port}" in err and "already in use" in err
    assert cmd.stdout() == ""
    no_files_but(tmp_path, LOGS)


@pytest.mark.parametrize("args", [
    ["bench", "zero", "--model", "llama-2-7b", "--backend", "gloo", "--nproc", str(4 * (os.cpu_count() or 1) + 1)],
    ["bench", "zero", "--model", "llama-2-7b", "--backend", "gloo", "--nproc", "0"],
    ["bench", "collectives", "--backend", "gloo", "--nproc", str(4 * (os.cpu_count() or 1) + 1)],
    ["bench", "collectives", "--backend", "gloo", "--nproc", "0"],
])
def test_world_larger_than_the_machine_is_refused_before_starting(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = descendants(os.getpid())
    r = runner.invoke(app, [*args, "--output", "out.json"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output[-1500:]
    assert "--nproc" in r.stderr and "Traceback" not in r.output
    assert descendants(os.getpid()) <= before  # nothing was started
    assert list(tmp_path.iterdir()) == []
