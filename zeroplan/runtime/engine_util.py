"""The engine's torch-free helpers: mimic names, bucket splitting, the stage-1/2 gradient span, the
step result (split out of ``runtime/engine.py``; re-exported there)."""

from __future__ import annotations

from typing import Any

MIMICS = ("planner", "deepspeed-cuda")
# deepspeed/ops/adam/fused_adam.py (0.19.8): multi_tensor_applier = MultiTensorApply(2048 * 32)
FUSED_ADAM_CHUNK = 2048 * 32


def resolve_mimic(mimic: str, device_type: str) -> str:
    """"auto" -> "deepspeed-cuda" on a CUDA device, else "planner"."""
    if mimic == "auto":
        return "deepspeed-cuda" if device_type == "cuda" else "planner"
    if mimic not in MIMICS:
        raise ValueError(f"mimic {mimic!r}: expected auto, {' or '.join(MIMICS)}")
    return mimic


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def greedy_buckets(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Indices (into ``sizes``) per bucket: flush before adding when the bucket would overflow."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_n = 0
    for i, n in enumerate(sizes):
        if cur and cur_n + n > bucket_elems:
            out.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        out.append(cur)
    return out


def greedy_buckets_after(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Indices per bucket: add, then flush once the running size exceeds the bucket."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_n = 0
    for i, n in enumerate(sizes):
        cur.append(i)
        cur_n += n
        if cur_n > bucket_elems:
            out.append(cur)
            cur, cur_n = [], 0
    if cur:
        out.append(cur)
    return out


STAGE0_BUCKET_ELEMS = 500_000_000  # DeepSpeed's stage-0 all-reduce bucket, independent of reduce_bucket_size


class StepResult(dict):
    """``{"loss": float, "model_states": {category: bytes}}`` for one optimizer step."""



def grad_span(numels: list[int], p_lo: int, p_hi: int) -> tuple[int, int]:
    """[lo, hi) of the flat buffer covered by the WHOLE params overlapping [p_lo, p_hi): the size
    DeepSpeed gives a rank's stage-1/2 gradient partition buffer (copy_grads_in_partition)."""
    lo, hi, off = p_lo, p_hi, 0
    for n in numels:
        if off < p_hi and off + n > p_lo:
            lo, hi = min(lo, off), max(hi, off + n)
        off += n
    return lo, hi


def _scalar(t: Any) -> float:
    """float(t), or NaN for a fake tensor (simulated runs have no values)."""
    try:
        return float(t.detach())
    except Exception:  # noqa: BLE001 - FakeTensor has no data
        return float("nan")
