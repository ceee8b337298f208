"""Start ranks on one machine (``spawn``) or join a torchrun job (``join_torchrun``).

``spawn`` forks ``nproc`` processes (fork start method: ~0.1 s per rank instead of 7-11 s for
spawn), each calling ``torch.set_num_threads(1)`` first (fork after multi-threaded math can
deadlock otherwise). Rendezvous goes through a FileStore in a fresh temporary directory: no
port is involved (nothing can collide) and the parent runs no server thread (forking while a
parent-owned TCPStore thread held a lock deadlocked children now and then). Each rank initialises the process group
with a short ``timeout=`` and runs ``fn(rank, world_size, *args)``; its return value must be
JSON-serialisable (pydantic models are dumped) and comes back in rank order.

Faults: a rank that raises, dies (signal / non-zero exit) or is still running after
``timeout_s`` makes ``spawn`` kill every rank and raise ``RankError`` naming the rank(s) and
the cause. Children are always killed and reaped in ``finally``, so no orphan survives:

- each rank's first act is ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux: the kernel kills it
  when the launcher dies), then it compares ``getppid()`` with the launcher's pid and exits if
  the launcher died before the prctl (the first milliseconds after fork);
- all ranks of one run share one process group (rank 0's pid), so the cleanup's ``killpg``
  also reaches anything a rank started.

NCCL: ``backend="auto"`` counts GPUs through NVML (``runtime/gpus.py``), never through
``torch.cuda`` in the parent (a parent that initialised CUDA breaks every forked child), and
``spawn`` refuses more ranks than visible GPUs before starting any (one GPU per rank).

Multi-node runs use torchrun: ``join_torchrun`` and ``node_groups`` live in
``runtime/torchrun.py`` and are re-exported here. The parent's supervision (waiting, failures,
stacks of hung ranks, the kill) is ``runtime/launch_supervise.py``; ``RankError`` is re-exported.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from zeroplan._util import InputError, atomic_write_text
from zeroplan.runtime.gpus import resolve_backend, visible_gpu_count
from zeroplan.runtime.launch_supervise import RankError, _kill_all, _supervise
from zeroplan.runtime.torchrun import (
    NodeGroups,
    check_timeout,
    check_torchrun_env,
    free_port,
    join_torchrun,
    jsonable,
    node_groups,
    node_layout,
    under_torchrun,
)

__all__ = [
    "RankError",
    "mem_available_bytes",
    "spawn",
    "refuse_cuda_parent",
    "join_torchrun",
    "under_torchrun",
    "node_groups",
    "NodeGroups",
    "node_layout",
    "resolve_backend",
    "check_world_size",
    "check_gpus_for",
    "check_timeout",
    "check_torchrun_env",
    "free_port",
]

_BYTES_PER_RANK_ESTIMATE = 200 * 2**20  # resident bytes a forked torch rank needs beyond the parent, roughly


# ------------------------------------------------------------------ helpers
def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_world_size(nproc: int) -> None:
    """InputError when ``nproc`` local ranks cannot run on this machine (before starting any)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise InputError(f"--nproc {nproc!r}: expected a whole number >= 1")
    cpus = os.cpu_count() or 1
    if nproc > 4 * cpus:
        raise InputError(
            f"--nproc {nproc}: this machine has {cpus} CPU cores; at most {4 * cpus} local ranks "
            f"(4 per core) can run — use torchrun across nodes for larger worlds"
        )
    avail = mem_available_bytes()
    if avail is not None and nproc * _BYTES_PER_RANK_ESTIMATE > avail:
        raise InputError(
            f"--nproc {nproc}: needs about {nproc * _BYTES_PER_RANK_ESTIMATE / 2**30:.1f} GiB of memory "
            f"({_BYTES_PER_RANK_ESTIMATE // 2**20} MiB per rank), {avail / 2**30:.1f} GiB available"
        )


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int) -> None:
    """In a fresh child: be SIGKILLed when the launcher dies; exit now if it already has.

    PR_SET_PDEATHSIG only covers a parent that dies AFTER the prctl; one SIGKILLed between fork
    and prctl has already re-parented this child (to init or a subreaper), which the getppid
    check sees. Linux only; elsewhere the getppid check still runs.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _join_group(pgid: int) -> None:
    """Join the run's process group (``pgid`` 0: start it, as rank 0 does)."""
    try:
        os.setpgid(0, pgid)
    except OSError:  # the group's last member is gone already: the per-pid cleanup still works
        pass


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, MemoryError) or type(exc).__name__ in ("OutOfMemoryError", "OOMError"):
        return "oom"
    if "timed out" in str(exc).lower() or isinstance(exc, TimeoutError):
        return "timeout"
    return "error"


# ------------------------------------------------------------------ the child
def _child_main(fn: Callable, rank: int, world_size: int, args: tuple, backend: str, store_path: str,
                pg_timeout_s: float, env: dict[str, str] | None, result_dir: str, parent_pid: int,
                pgid: int) -> None:
    """Runs in the forked rank; never returns (os._exit), so no parent cleanup code runs twice."""
    code = 0
    out = Path(result_dir) / f"rank{rank}.json"
    try:
        _die_with_parent(parent_pid)
        _join_group(pgid)
        import faulthandler

        stack_file = open(Path(result_dir) / f"rank{rank}.stack", "w")  # noqa: SIM115 - lives until os._exit
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
        if env:
            os.environ.update({str(k): str(v) for k, v in env.items()})
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world_size)})
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)  # spawn checked rank < visible GPUs: one GPU per rank
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        # Every rank is connected before any rank can finish: gloo's init returns on a rank once
        # ITS pairs are up, so a rank whose fn returns at once would otherwise tear its sockets
        # down while a slower peer is still in connectFullMesh ("Connection closed by peer").
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
            payload = {"ok": True, "value": jsonable(value)}
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may already be broken
                pass
        atomic_write_text(out, json.dumps(payload))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        code = 1
        try:
            atomic_write_text(out, json.dumps({
                "ok": False, "kind": _failure_kind(exc), "type": type(exc).__name__,
                "message": str(exc).strip().splitlines()[0][:500] if str(exc).strip() else "",
                "traceback": traceback.format_exc()[-4000:],
            }))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


# ------------------------------------------------------------------ the parent
def spawn(fn: Callable[..., Any], nproc: int, *, args: tuple = (), backend: str = "gloo",
          timeout_s: float = 120, env: dict[str, str] | None = None,
          on_poll: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` forked ranks; return their results in rank order.

    ``timeout_s`` bounds the whole run (seconds); the process-group timeout is the same.
    Raises ``RankError`` when a rank raises, dies or hangs; ``InputError`` when ``nproc`` ranks
    cannot run on this machine. ``fn`` need not be picklable: with fork it is inherited.
    ``on_poll`` (optional) is called in the parent about twice a second while ranks run
    (e.g. to refresh a progress bar).
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait as mp_wait

    check_world_size(nproc)
    timeout_s = check_timeout(timeout_s)
    backend = resolve_backend(backend)
    if backend == "nccl":
        refuse_cuda_parent()
        check_gpus_for(nproc)
    # Loaded once here and shared by every forked rank (copy-on-write), not imported by each rank
    # inside its --timeout: 3-15 s per rank on a busy 2-core machine. Importing starts no thread.
    import torch.distributed  # noqa: F401

    ctx = mp.get_context("fork")
    procs: list[Any] = []
    me = os.getpid()
    pgid = 0  # rank 0 starts the run's process group; the others join it
    with tempfile.TemporaryDirectory(prefix="zeroplan-spawn-") as result_dir:
        try:
            for rank in range(nproc):
                p = ctx.Process(target=_child_main, name=f"zeroplan-rank{rank}", daemon=False,
                                args=(fn, rank, nproc, tuple(args), backend, str(Path(result_dir) / "store"),
                                      timeout_s, env, result_dir, me, pgid))
                p.start()
                procs.append(p)
                try:  # the parent sets it too (as shells do), so neither order of the race matters
                    os.setpgid(p.pid, pgid or p.pid)
                except OSError:  # the child exited already, or set it itself
                    pass
                pgid = pgid or p.pid
            return _supervise(procs, result_dir, timeout_s, mp_wait, on_poll)
        finally:
            _kill_all(procs, pgid)


def refuse_cuda_parent() -> None:
    """NCCL ranks forked from a process that has started CUDA cannot use it ("Cannot re-initialize
    CUDA in forked subprocess"; on an H200 under `zeroplan validate` some hung instead): a clear error
    before any rank starts."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised in this process, so NCCL ranks forked from it cannot use "
                           "CUDA; start the ranks before anything here touches CUDA")


def check_gpus_for(nproc: int) -> None:
    """NCCL needs one visible GPU per local rank: InputError before any rank starts."""
    gpus = visible_gpu_count()
    if nproc > gpus:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
        raise InputError(
            f"--nproc {nproc}: the nccl backend needs one GPU per rank and this machine has {gpus} visible "
            f"GPU(s){where}; use --nproc {gpus} or --backend gloo" if gpus else
            f"--nproc {nproc}: the nccl backend needs one GPU per rank and this machine has no visible GPU"
            f"{where}; use --backend gloo"
        )
