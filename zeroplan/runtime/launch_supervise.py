"""The launcher's side of a ``spawn`` run (split out of ``runtime/launch.py``): waiting for the
ranks, turning a rank's result file or exit status into a ``RankFailure`` (the root cause first,
peers' connection errors after), asking hung ranks for their stack, and killing and reaping every
rank of the run (its process group, then each child)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from zeroplan.runtime.results import RankFailure

__all__ = ["RankError"]


class RankError(RuntimeError):
    """One or more ranks failed. ``failures`` lists them, the root cause first."""

    def __init__(self, failures: list[RankFailure], note: str = "") -> None:
        self.failures = list(failures)
        parts = [f"rank {f.rank} {f.message}" if i == 0 else f"rank {f.rank} {f.message[:120]}"
                 for i, f in enumerate(self.failures[:4])]
        if len(self.failures) > 4:
            parts.append(f"... and {len(self.failures) - 4} more")
        msg = "; ".join(parts) if parts else "ranks failed"
        super().__init__(msg + (f" ({note})" if note else ""))

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]


_PEER_ERROR_MARKERS = ("closed by peer", "reset by peer", "read error", "remote worker", "connection refused",
                       "communicator was aborted", "broken pipe")


def _is_consequence(failure: RankFailure) -> bool:
    """A rank that failed only because a peer died or raised (gloo/NCCL connection errors)."""
    text = failure.message.lower()
    return failure.kind == "error" and any(m in text for m in _PEER_ERROR_MARKERS)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _read_result(result_dir: str, rank: int) -> dict | None:
    path = Path(result_dir) / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _failure_of(rank: int, proc: Any, result_dir: str) -> RankFailure:
    res = _read_result(result_dir, rank)
    if res is not None and not res.get("ok", False):
        msg = f"{res.get('type', 'Exception')}: {res.get('message', '')}".rstrip(": ")
        verb = {"oom": "ran out of memory", "timeout": "timed out", "error": "raised"}[res.get("kind", "error")]
        return RankFailure(rank=rank, kind=res.get("kind", "error"), message=f"{verb} {msg}")
    code = proc.exitcode
    if code is not None and code < 0:
        sig = -code
        hint = " (killed; possibly by the out-of-memory killer)" if sig == signal.SIGKILL else ""
        return RankFailure(rank=rank, kind="died", message=f"died with {_signal_name(sig)}{hint}")
    return RankFailure(rank=rank, kind="died", message=f"died with exit code {code} without a result")


def _supervise(procs: list[Any], result_dir: str, timeout_s: float, mp_wait: Callable,
               on_poll: Callable[[], None] | None = None) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    pending = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            still = sorted(rank for rank, _ in pending.values())
            where = _stacks(procs, still, result_dir)
            names = ", ".join(str(r) for r in still)
            timeout_failures = [
                RankFailure(rank=r, kind="timeout",
                            message=f"still running after {timeout_s:g} s (killed)" + (f", in {where[r]}" if where.get(r) else ""))
                for r in still
            ]
            raise RankError(failures + timeout_failures,
                            note=f"rank{'s' if len(still) > 1 else ''} {names} did not finish within {timeout_s:g} s")
        ready = mp_wait(list(pending), timeout=min(remaining, 0.5))
        if on_poll is not None:
            on_poll()
        for sentinel in ready:
            rank, proc = pending.pop(sentinel)
            proc.join()
            res = _read_result(result_dir, rank)
            if proc.exitcode == 0 and res is not None and res.get("ok"):
                results[rank] = res["value"]
            else:
                failures.append(_failure_of(rank, proc, result_dir))
        if failures:
            # The group is broken: give the others a moment to report their own errors, then stop them.
            grace = time.monotonic() + 1.0
            while pending and time.monotonic() < grace:
                for sentinel in mp_wait(list(pending), timeout=max(0.0, grace - time.monotonic())):
                    rank, proc = pending.pop(sentinel)
                    proc.join()
                    res = _read_result(result_dir, rank)
                    if not (proc.exitcode == 0 and res is not None and res.get("ok")):
                        failures.append(_failure_of(rank, proc, result_dir))
            stopped = sorted(rank for rank, _ in pending.values())
            note = f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped" if stopped else ""
            failures.sort(key=_is_consequence)  # stable: the root cause first, peers' errors after
            raise RankError(failures, note=note)
    return [results[r] for r in range(len(procs))]


def _stacks(procs: list[Any], ranks: list[int], result_dir: str) -> dict[int, str]:
    """Ask hung ranks for their Python stack (SIGUSR1 -> faulthandler); innermost zeroplan/user frame."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
    time.sleep(0.3)
    out: dict[int, str] = {}
    for r in ranks:
        try:
            lines = (Path(result_dir) / f"rank{r}.stack").read_text().splitlines()
        except OSError:
            continue
        frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
        if frames:  # faulthandler prints the innermost frame first
            inner = frames[0]
            m = inner.replace('File "', "").replace('", line ', ":")
            out[r] = m
    return out


def _group_is_ours(procs: list[Any], pgid: int) -> bool:
    """True while one of our live children is still in ``pgid``: the kernel cannot reuse a pid
    that is still a process group's id, so killpg then reaches only this run."""
    for p in procs:
        if p.pid is None or p.exitcode is not None:  # exitcode polls: a finished child is reaped
            continue
        try:
            if os.getpgid(p.pid) == pgid:
                return True
        except OSError:
            continue
    return False


def _kill_all(procs: list[Any], pgid: int = 0) -> None:
    """SIGKILL the run's process group and every child still alive; reap them (no zombies, no orphans)."""
    if pgid and pgid != os.getpgrp() and _group_is_ours(procs, pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
