"""Join a torchrun job (``join_torchrun``) and build the intra-/inter-node subgroups.

Multi-node runs use torchrun, the existing launcher: ``join_torchrun`` checks torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT; ``check_torchrun_env``) and gives one line naming the bad variable instead of a
C++ traceback from c10d, then initialises the group from it; ``node_groups`` builds the
intra-node and inter-node subgroups from LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from zeroplan._util import InputError
from zeroplan.runtime.gpus import resolve_backend, visible_gpu_count

__all__ = [
    "join_torchrun",
    "under_torchrun",
    "check_torchrun_env",
    "check_timeout",
    "node_groups",
    "NodeGroups",
    "node_layout",
    "free_port",
]

MAX_TIMEOUT_S = 30 * 86400  # 30 days; datetime.timedelta (the process-group timeout) overflows far above
_WHOLE = re.compile(r"[0-9]{1,9}")  # ASCII digits only (str.isdigit accepts other scripts), bounded length


def check_timeout(timeout_s: float, what: str = "--timeout") -> float:
    """``timeout_s`` if it is a finite number of seconds in (0, 30 days]; else InputError."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise InputError(f"{what} {timeout_s!r}: expected seconds > 0") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise InputError(f"{what} {timeout_s!r}: expected a finite number of seconds > 0 and <= {MAX_TIMEOUT_S}")
    return value


def _env_int(name: str, minimum: int, required: bool = True) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        if required:
            raise InputError(f"environment {name} is not set: expected a whole number >= {minimum} (set by torchrun)")
        return None
    if not _WHOLE.fullmatch(raw.strip()) or int(raw) < minimum:
        too_long = raw.strip().isascii() and raw.strip().isdigit()  # digits, more than 9 of them
        raise InputError(f"environment {name}={raw!r}: expected a whole number >= {minimum}"
                         + (" of at most 9 digits" if too_long else ""))
    return int(raw)


def check_torchrun_env() -> dict[str, Any]:
    """Validate torchrun's environment before any c10d call; one InputError line per bad variable.

    Returns the parsed values: rank, world_size, local_rank, local_world_size, master_addr, master_port.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    assert world is not None and rank is not None
    if rank >= world:
        raise InputError(f"environment RANK={rank}: expected a rank below WORLD_SIZE={world}")
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, required=False)
    local_rank = _env_int("LOCAL_RANK", 0, required=False)
    if local_world is not None and local_world > world:
        raise InputError(f"environment LOCAL_WORLD_SIZE={local_world}: expected at most WORLD_SIZE={world}")
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise InputError(f"environment LOCAL_RANK={local_rank}: expected a rank below LOCAL_WORLD_SIZE={local_world}")
    _env_int("GROUP_RANK", 0, required=False)
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr.strip() or any(c.isspace() or not c.isprintable() for c in addr):
        raise InputError(f"environment MASTER_ADDR={addr!r}: expected a host name or address")
    port_raw = os.environ.get("MASTER_PORT", "")
    if not _WHOLE.fullmatch(port_raw.strip()) or not 1 <= int(port_raw) <= 65535:
        raise InputError(f"environment MASTER_PORT={port_raw!r}: expected a port number 1..65535")
    return {"rank": rank, "world_size": world, "local_rank": local_rank if local_rank is not None else 0,
            "local_world_size": local_world, "master_addr": addr, "master_port": int(port_raw)}


def check_local_gpu(local_rank: int) -> None:
    """NCCL: this local rank needs its own visible GPU (InputError otherwise; no modulo sharing)."""
    gpus = visible_gpu_count()
    if local_rank >= gpus:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
        raise InputError(
            f"environment LOCAL_RANK={local_rank}: this node has {gpus} visible GPU(s){where}; NCCL needs "
            f"one GPU per local rank — start at most {gpus} rank(s) per node (--nproc-per-node)"
        )


# ------------------------------------------------------------------ torchrun
def under_torchrun() -> bool:
    """True when launched by torchrun (RANK, WORLD_SIZE and MASTER_ADDR in the environment).

    Then the whole torchrun environment is checked at once (``check_torchrun_env``): callers
    parse WORLD_SIZE and friends right after asking, so a bad value is one InputError line here
    instead of a ValueError or a c10d traceback later.
    """
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return False
    check_torchrun_env()
    return True


def _init_from_env(backend: str, timeout_s: float, env: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr, port = env["master_addr"], env["master_port"]
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"])  # check_local_gpu made sure it exists: no modulo sharing
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
        first = " ".join(text.strip().splitlines()[:1])[:300] or type(exc).__name__
        raise InputError(f"environment MASTER_ADDR={addr} MASTER_PORT={port}: rendezvous failed: {first}") from None


def jsonable(value: Any) -> Any:
    """``value`` with pydantic models dumped to JSON-ready data (lists and dicts walked)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def _gather_json(value: Any, backend: str) -> list[Any]:
    """Every rank's JSON value, in rank order, via two all_gathers of byte tensors (no pickle)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    data = json.dumps(jsonable(value)).encode("utf-8")
    world = dist.get_world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.zeros(world, dtype=torch.int64, device=device)
    from zeroplan.runtime.comm import all_gather_fn

    ag = all_gather_fn(dist)
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
    env = check_torchrun_env()
    timeout_s = check_timeout(timeout_s)
    backend = resolve_backend(backend)
    if backend == "nccl":
        check_local_gpu(env["local_rank"])
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(threads) if _WHOLE.fullmatch(threads) and int(threads) > 0 else 1)
    owns = not dist.is_initialized()
    _init_from_env(backend, timeout_s, env)
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
