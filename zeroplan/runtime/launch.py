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
the cause. Children are always killed and reaped in ``finally`` and are tied to the parent's
life (PR_SET_PDEATHSIG on Linux), so no orphan process survives.

Multi-node runs use torchrun, the existing launcher: ``join_torchrun`` initialises the group
from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and ``node_groups`` builds the intra-node
and inter-node subgroups from LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from zeroplan._util import InputError, atomic_write_text
from zeroplan.runtime.results import RankFailure

__all__ = [
    "RankError",
    "spawn",
    "join_torchrun",
    "under_torchrun",
    "node_groups",
    "NodeGroups",
    "node_layout",
    "resolve_backend",
    "check_world_size",
]

_BYTES_PER_RANK_ESTIMATE = 200 * 2**20  # resident bytes a forked torch rank needs beyond the parent, roughly


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


# ------------------------------------------------------------------ helpers
def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> 'nccl' when CUDA is available, else 'gloo'."""
    if backend == "auto":
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InputError(f"--backend {backend!r}: expected auto, gloo or nccl")
    return backend


def _mem_available_bytes() -> int | None:
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
    avail = _mem_available_bytes()
    if avail is not None and nproc * _BYTES_PER_RANK_ESTIMATE > avail:
        raise InputError(
            f"--nproc {nproc}: needs about {nproc * _BYTES_PER_RANK_ESTIMATE / 2**30:.1f} GiB of memory "
            f"({_BYTES_PER_RANK_ESTIMATE // 2**20} MiB per rank), {avail / 2**30:.1f} GiB available"
        )


def _set_pdeathsig() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, MemoryError) or type(exc).__name__ in ("OutOfMemoryError", "OOMError"):
        return "oom"
    if "timed out" in str(exc).lower() or isinstance(exc, TimeoutError):
        return "timeout"
    return "error"


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


# ------------------------------------------------------------------ the child
def _child_main(fn: Callable, rank: int, world_size: int, args: tuple, backend: str, store_path: str,
                pg_timeout_s: float, env: dict[str, str] | None, result_dir: str) -> None:
    """Runs in the forked rank; never returns (os._exit), so no parent cleanup code runs twice."""
    code = 0
    out = Path(result_dir) / f"rank{rank}.json"
    try:
        _set_pdeathsig()
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
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        try:
            value = fn(rank, world_size, *args)
            payload = {"ok": True, "value": _jsonable(value)}
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
    backend = resolve_backend(backend)
    if timeout_s <= 0:
        raise InputError(f"timeout {timeout_s!r}: expected seconds > 0")
    ctx = mp.get_context("fork")
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="zeroplan-spawn-") as result_dir:
        try:
            for rank in range(nproc):
                p = ctx.Process(target=_child_main, name=f"zeroplan-rank{rank}", daemon=False,
                                args=(fn, rank, nproc, tuple(args), backend, str(Path(result_dir) / "store"),
                                      timeout_s, env, result_dir))
                p.start()
                procs.append(p)
            return _supervise(procs, result_dir, timeout_s, mp_wait, on_poll)
        finally:
            _kill_all(procs)


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


def _kill_all(procs: list[Any]) -> None:
    """SIGKILL every child still alive and reap it (no zombies, no orphans)."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


# ------------------------------------------------------------------ torchrun
def under_torchrun() -> bool:
    """True when launched by torchrun (RANK, WORLD_SIZE and MASTER_ADDR in the environment)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _init_from_env(backend: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    if not port.isdigit():
        raise InputError(f"environment MASTER_PORT={port!r}: expected a port number")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - translate rendezvous failures into one clear line
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise InputError(
                f"environment MASTER_PORT={port}: port already in use on {addr}; pick a free "
                f"--master-port for torchrun"
            ) from None
        if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
            raise InputError(
                f"environment MASTER_ADDR={addr} MASTER_PORT={port}: rendezvous timed out after "
                f"{timeout_s:g} s; are all {os.environ.get('WORLD_SIZE')} ranks started?"
            ) from None
        raise


def _gather_json(value: Any, backend: str) -> list[Any]:
    """Every rank's JSON value, in rank order, via two all_gathers of byte tensors (no pickle)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    data = json.dumps(_jsonable(value)).encode("utf-8")
    world = dist.get_world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.zeros(world, dtype=torch.int64, device=device)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag(lengths, length)
    longest = int(lengths.max().item())
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    ag(gathered, buf)
    host = gathered.cpu().view(world, longest)
    return [json.loads(bytes(host[r, : int(lengths[r])].tolist()).decode("utf-8")) for r in range(world)]


def join_torchrun(fn: Callable[..., Any], *, args: tuple = (), backend: str = "auto",
                  timeout_s: float = 120) -> list[Any] | None:
    """Under torchrun: init the group from the environment, run ``fn(rank, world_size, *args)``
    for this rank, and gather every rank's JSON result.

    Returns the results in rank order on rank 0 and ``None`` on every other rank (rank 0
    reports). Process-group timeout ``timeout_s`` seconds; the group is destroyed before
    returning when this call created it.
    """
    import torch
    import torch.distributed as dist

    if not under_torchrun():
        raise InputError("join_torchrun: RANK, WORLD_SIZE and MASTER_ADDR are not set; launch with torchrun")
    backend = resolve_backend(backend)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    owns = not dist.is_initialized()
    _init_from_env(backend, timeout_s)
    try:
        value = fn(dist.get_rank(), dist.get_world_size(), *args)
        results = _gather_json(value, backend)
        return results if dist.get_rank() == 0 else None
    finally:
        if owns:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


# ------------------------------------------------------------------ node groups
def node_layout(world_size: int, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node rank lists, inter-node rank lists) for contiguous rank placement.

    Node k holds ranks [k·g, (k+1)·g); the inter-node groups link ranks with the same local
    rank: [l, l+g, l+2g, ...]. Pure Python (no torch).
    """
    if gpus_per_node < 1 or world_size < 1:
        raise InputError(f"gpus per node {gpus_per_node} / world size {world_size}: expected >= 1")
    if world_size % gpus_per_node:
        raise InputError(
            f"world size {world_size} is not a multiple of {gpus_per_node} GPUs per node"
        )
    nodes = world_size // gpus_per_node
    intra = [list(range(k * gpus_per_node, (k + 1) * gpus_per_node)) for k in range(nodes)]
    inter = [list(range(local, world_size, gpus_per_node)) for local in range(gpus_per_node)]
    return intra, inter


@dataclass
class NodeGroups:
    """This rank's intra-node and inter-node subgroups and their member ranks (global ranks)."""

    intra: Any
    inter: Any
    intra_ranks: list[int] = field(default_factory=list)
    inter_ranks: list[int] = field(default_factory=list)
    gpus_per_node: int = 1
    nodes: int = 1


def node_groups(world_size: int, gpus_per_node: int | None = None) -> NodeGroups:
    """Create the intra-node and inter-node subgroups (collective: every rank must call it).

    ``gpus_per_node`` defaults to LOCAL_WORLD_SIZE (set by torchrun), else the whole world is
    one node. Tag collectives on them with ``InstrumentedComm(g.intra, group_kind="intra-node")``.
    """
    import torch.distributed as dist

    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    intra, inter = node_layout(world_size, gpus_per_node)
    me = dist.get_rank()
    mine_intra = mine_inter = None
    intra_ranks: list[int] = []
    inter_ranks: list[int] = []
    for ranks in intra:  # every rank creates every group, in the same order
        g = dist.new_group(ranks)
        if me in ranks:
            mine_intra, intra_ranks = g, ranks
    for ranks in inter:
        g = dist.new_group(ranks)
        if me in ranks:
            mine_inter, inter_ranks = g, ranks
    return NodeGroups(intra=mine_intra, inter=mine_inter, intra_ranks=intra_ranks, inter_ranks=inter_ranks,
                      gpus_per_node=gpus_per_node, nodes=world_size // gpus_per_node)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for tests and examples)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
