"""Bounds on what a bench allocates, checked before any rank starts (InputError: one line, exit 2).

- ``parse_size``: a size option (``--min-bytes``, ``--max-bytes``, ``--size``) in bytes, binary
  suffixes as nccl-tests' -b/-e; finite, at least 1 byte and at most ``MAX_BUFFER_BYTES``.
- ``MAX_BUFFER_BYTES`` = 2^40 bytes (1 TiB, ``1024G``): more than one GPU (141 GB on an H200, 192 GB
  on a B200) or a typical host holds; a fixed cap, so a typo such as ``99999999999999G`` is refused
  instead of running for minutes. The same cap bounds what one rank of a bench may allocate in all.
- ``check_rank_bytes``: a rank's allocation against that cap, and on CPU (gloo: every local rank
  shares the host's memory) against ``HOST_MEMORY_FRACTION`` of the host's MemAvailable; on CUDA
  against ``GPU_MEMORY_FRACTION`` of the free memory NVML reports (the CUDA runtime is not asked:
  that would initialise CUDA in the parent of forked ranks). ``bench zero`` skips the GPU check:
  its runs compare a predicted OOM with a measured one.

- ``check_repeats``: a bench's repetition counts (``--iters``/``--warmup``, bench zero's ``--steps``)
  within ``MAX_REPEATS``.

Imports nothing of torch: the command modules read the bounds for their ``--help``.
"""

from __future__ import annotations

import math
import os

from zeroplan._util import InputError, fmt_bytes

__all__ = ["MAX_BUFFER_BYTES", "MAX_BUFFER_TEXT", "MAX_REPEATS", "check_repeats",
           "HOST_MEMORY_FRACTION", "GPU_MEMORY_FRACTION", "SWEEP_BUFFERS_PER_RANK",
           "parse_size", "check_rank_bytes", "ranks_on_this_host"]

MAX_BUFFER_BYTES = 2**40
MAX_BUFFER_TEXT = "1024G (2^40 bytes = 1 TiB)"
HOST_MEMORY_FRACTION = 0.8  # of MemAvailable (every bench, cpu-adam too): the OS and the launcher need the rest
# of a GPU's free memory (NVML): the rank's CUDA context (~0.5 GiB), NCCL's buffers and the caching
# allocator's rounding take the rest
GPU_MEMORY_FRACTION = 0.9
# bench collectives, per rank at the sweep's largest size: the full buffer, an output buffer of the same
# size and the shard (at most one more); the previous size's buffers are freed as the next are made.
SWEEP_BUFFERS_PER_RANK = 3

# Repetitions per measurement (bench collectives, overlap, cpu-adam: --warmup untimed, then --iters timed;
# bench zero: --warmup and --steps training steps). nccl-tests times 20 calls after 5 warm-up ones (its -n
# and -w); a count with a few zeros too many would run until --timeout and end as "rank still running",
# so a count above this is refused as a typo.
MAX_REPEATS = 100_000

_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
               "G": 2**30, "GB": 2**30, "GIB": 2**30}
_SIZE_EXAMPLES = "1024, 1K, 64M or 1G"


def parse_size(text: str | int, what: str) -> int:
    """'8', '1K', '64M', '1G' -> bytes (binary suffixes, as nccl-tests' -b/-e); InputError naming
    ``what`` unless it is a finite number of bytes in [1, MAX_BUFFER_BYTES]."""
    value: int | float
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().upper().replace(" ", "")
        num = s.rstrip("KMGIB")
        unit = s[len(num):]
        if not num or unit not in _SIZE_UNITS:
            raise InputError(f"{what} {text!r}: expected bytes such as {_SIZE_EXAMPLES}")
        try:
            value = float(num) * _SIZE_UNITS[unit]
        except ValueError:
            raise InputError(f"{what} {text!r}: expected bytes such as {_SIZE_EXAMPLES}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{what} {text!r}: expected a finite number of bytes such as {_SIZE_EXAMPLES}")
    if value > MAX_BUFFER_BYTES:
        raise InputError(f"{what} {text!r}: expected at most {MAX_BUFFER_TEXT}, more than one GPU or host holds")
    if value < 1:
        raise InputError(f"{what} {text!r}: expected at least 1 byte")
    return int(value)


def ranks_on_this_host(nproc: int) -> int:
    """Ranks that share this host's memory: torchrun's LOCAL_WORLD_SIZE under torchrun, else ``nproc``."""
    from zeroplan.runtime.launch import under_torchrun

    if not under_torchrun():  # under torchrun it has checked the variables (one InputError line if bad)
        return nproc
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])


def check_rank_bytes(need_bytes: int, *, device: str, ranks: int, what: str, lower: str,
                     gpu_free: bool = True) -> None:
    """InputError when one rank would allocate ``need_bytes``: over ``MAX_BUFFER_BYTES`` anywhere, on
    CPU over ``HOST_MEMORY_FRACTION`` of MemAvailable for ``ranks`` such ranks on this host, and on
    CUDA (``gpu_free``) when fewer than ``ranks`` visible GPUs have it within ``GPU_MEMORY_FRACTION`` of
    their free memory as NVML reports it (NVML silent: no check).

    ``what`` names the options and the values and says what needs the bytes ("… need"); ``lower`` the
    options to lower.
    """
    if need_bytes > MAX_BUFFER_BYTES:
        raise InputError(f"{what} {fmt_bytes(need_bytes)} per rank, over the fixed cap of {MAX_BUFFER_TEXT} "
                         f"one rank may allocate; lower {lower}")
    if device == "cuda":
        if gpu_free:
            _check_gpu_free(need_bytes, ranks, what, lower)
        return
    from zeroplan.runtime.launch import mem_available_bytes

    avail = mem_available_bytes()
    if avail is not None and need_bytes * ranks > HOST_MEMORY_FRACTION * avail:
        raise InputError(f"{what} {fmt_bytes(need_bytes)} per rank × {ranks} rank(s) on this host, more than "
                         f"{HOST_MEMORY_FRACTION:.0%} of the {fmt_bytes(avail)} of memory available here; "
                         f"lower {lower}")


def _check_gpu_free(need_bytes: int, ranks: int, what: str, lower: str) -> None:
    from zeroplan.runtime.gpus import visible_gpu_free_bytes  # NVML only: CUDA stays uninitialised

    free = visible_gpu_free_bytes()
    if not free or len(free) < ranks:  # NVML silent, or too few GPUs (the launcher says so)
        return
    roomy = sum(need_bytes <= GPU_MEMORY_FRACTION * f for f in free)
    if roomy < ranks:  # no assignment of GPUs to ranks fits, whatever order CUDA numbers them in
        raise InputError(f"{what} {fmt_bytes(need_bytes)} per rank, and {roomy} of the {len(free)} visible GPUs "
                         f"have that within {GPU_MEMORY_FRACTION:.0%} of their free memory (NVML; the most free: "
                         f"{fmt_bytes(max(free))}) for {ranks} rank(s); lower {lower}")


def check_repeats(iters: int, warmup: int, *, iters_flag: str = "--iters") -> None:
    """InputError unless 1 <= iters <= MAX_REPEATS and 0 <= warmup <= MAX_REPEATS (before any rank starts)."""
    for flag, value, low in ((iters_flag, iters, 1), ("--warmup", warmup, 0)):
        if not low <= value <= MAX_REPEATS:
            why = " (refused as a likely typo: the run would outlast --timeout)" if value > MAX_REPEATS else ""
            raise InputError(f"{flag} {value:,}: expected a whole number from {low} to {MAX_REPEATS:,}{why}")
