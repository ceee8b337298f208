"""What the PyTorch CUDA caching allocator reserves for a plan, and what the device shows.

Two figures per GPU:
- **allocated**: live tensor bytes at the peak (``torch.cuda.max_memory_allocated``), each
  block rounded up to 512 B (c10/cuda/CUDACachingAllocator.cpp ``round_size``, kMinBlockSize).
- **reserved**: the allocator's cached segments (``torch.cuda.max_memory_reserved``). Blocks are
  pooled per CUDA stream: memory freed on one stream is reused only by allocations on that
  stream (``BlockPool`` lookups match ``stream``). DeepSpeed allocates some buffers on side
  streams — stage 3's gathered parameters on the all-gather stream
  (runtime/zero/partitioned_param_coordinator.py ``__all_gather_params`` under
  ``__allgather_stream``), the reduce-scatter/all-reduce outputs on ``reduction_stream`` with
  ``overlap_comm`` (stage_1_and_2.py ``reduce_ipg_grads``/``average_tensor``; stage3.py
  ``__reduce_and_partition_ipg_grads``) — so each pool reaches its own maximum and the sum of
  the pools' maxima, not the maximum of the sum, is cached. Large blocks (> 1 MiB) come from
  segments rounded up to 2 MiB (kRoundLarge; ``get_allocation_size``).
- **Split-segment slack** comes only from churn. ``get_free_block`` hands a request the smallest
  cached free block of its pool that is large enough (best fit), and ``should_split`` cuts the
  remainder off when it is above kSmallSize (1 MiB) for large blocks; a freed block merges
  (``free_block``/``try_merge_blocks``) only with free neighbours of its own segment, and a segment
  is returned to CUDA only when none of its blocks is live. So a buffer allocated once and held
  (DeepSpeed's flat fp16/fp32 partitions, the optimizer states, the contiguous gradient buffer,
  the ipg bucket) sits in a segment of its own size, and a block freed and re-requested at the
  same size every step (the step's transients) gets its own block back: neither leaves slack.
  Slack arises where blocks are freed and re-requested at other sizes — activations, their
  gradients, stage 3's gathered parameters, per-layer temporaries, autograd's ``p.grad`` — whose
  remainders are stranded in partly used segments. It is modelled as the profile's
  ``fragmentation_fraction`` of those **churned** bytes (the phase's default-stream live bytes less
  the ``held`` ones), not of the whole pool; ``expandable_segments:True`` maps pages into one
  growing segment per stream and removes it (modelled as no slack).
- The device total adds the CUDA context and NCCL's buffers, one set per communicator
  (``nvidia-smi`` shows that sum).
- Under pressure the cache gives way: when ``cudaMalloc`` fails, ``DeviceCachingAllocator::malloc``
  frees cached blocks (``release_available_cached_blocks``, then ``release_cached_blocks``: every
  free segment no live block sits in, of every stream's pool) and retries; only then does it raise
  OOM. So the pools' maxima and the step's new segments stack only while the card has room: a run
  fits when what it cannot release — the live bytes of its worst phase with their split-segment
  slack (``required_bytes``) — fits beside the context and NCCL, and its cache then fills the card
  (``release_under_pressure``).

NCCL communicators a DeepSpeed data-parallel job creates (each rank is in one of each):
the world group, and ZeRO's clone of it (deepspeed/utils/groups.py ``_clone_world_group``,
used as the data-parallel group); ZeRO++ hpZ adds its intra-node parameter group
(``_create_zero_param_parallel_group``); quantized gradients (hierarchical all-to-all) add the
local and the cross-node all-to-all groups (``_get_local_all_to_all_group``).
"""

from __future__ import annotations

from zeroplan.specs.ds_schema import ZeroConfig

__all__ = ["MIB", "STAGE3_CACHE_NOTE", "communicators", "release_under_pressure", "required_bytes", "reserved_bytes",
           "round_block", "round_segment"]

MIB = 1 << 20
# Published ZeRO-3 runs cached more than this model plans (tests/data/published/memory.json): the ZeRO++
# tutorial's two Megatron memory reports show max_memory_reserved at 2.27x and 2.00x the allocated peak,
# 1.81x and 1.63x the reserved planned here, and LLaMA-Factory #5977's nvidia-smi is 2.0x the planned
# device total; the allocated peaks of the first two are planned within 3%. Not modelled until a mechanism
# explains it (README 'Against published measurements').
STAGE3_CACHE_NOTE = ("stage 3: published ZeRO-3 runs cached 1.6-2.0x the reserved memory this model plans "
                     "(2.0-2.3x their allocated peak), so nvidia-smi may show more than planned; the fits verdict "
                     "rests on the bytes the allocator cannot release")
_MIN_BLOCK = 512  # kMinBlockSize
_ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_block(n: int) -> int:
    """A tensor's block: rounded up to 512 B."""
    return -(-n // _MIN_BLOCK) * _MIN_BLOCK if n > 0 else 0


def round_segment(n: int) -> int:
    """A pool's cached bytes: rounded up to whole 2 MiB large-segment units."""
    return -(-n // _ROUND_LARGE) * _ROUND_LARGE if n > 0 else 0


def communicators(zero: ZeroConfig, stage: int, n_gpus: int = 2) -> int:
    """NCCL communicators one rank of a DeepSpeed ZeRO data-parallel job creates (a one-rank
    job creates communicators without peers: no channel buffers, counted as none)."""
    if n_gpus <= 1:
        return 0
    n = 2  # world + ZeRO's cloned world group (groups._clone_world_group)
    if stage == 3 and int(zero.zero_hpz_partition_size) > 1:
        n += 1
    if stage == 3 and bool(zero.zero_quantized_gradients):
        n += 2
    return n


def _slack_bytes(live_by_phase: dict[str, int], side_pools: dict[str, dict[str, int]],
                 held_by_phase: dict[str, int] | None, slack: float) -> dict[str, int]:
    """Per phase, the split-segment slack: ``slack`` of the default stream's churned bytes (its live
    bytes less the side pools' and the ``held`` ones; every byte is churned where ``held_by_phase``
    is None)."""
    held = held_by_phase or {}
    out = {}
    for p, live in live_by_phase.items():
        default = live - sum(pool.get(p, 0) for pool in side_pools.values())
        out[p] = int(max(0, default - held.get(p, 0)) * slack)
    return out


def _default_pool(live_by_phase: dict[str, int], side_pools: dict[str, dict[str, int]], slack: float,
                  step_transient: int, held_by_phase: dict[str, int] | None = None) -> int:
    """The default stream's pool: its forward/backward maximum with the split-segment slack, and the
    step's large new blocks (``step_transient``: the flat fp32 gradient, its casts, the optimizer's
    temporaries, each one block of up to GBs) mapped in new segments on top: they are bigger than any
    freed activation block, so the best-fit lookup (``get_free_block``) finds none (``alloc_block``)."""
    extra = _slack_bytes(live_by_phase, side_pools, held_by_phase, slack)
    pool = {p: live - sum(s.get(p, 0) for s in side_pools.values()) + extra[p] for p, live in live_by_phase.items()}
    before_step = max((v for p, v in pool.items() if p != "step"), default=0)
    return max(before_step + step_transient, pool.get("step", 0))


def reserved_bytes(live_by_phase: dict[str, int], side_pools: dict[str, dict[str, int]], *,
                   fragmentation_fraction: float, expandable_segments: bool = False,
                   step_transient: int = 0,
                   held_by_phase: dict[str, int] | None = None) -> tuple[int, int, dict[str, int]]:
    """(allocated, reserved, {side pool: its maximum}) from the live bytes per phase and, per side
    stream, the part of them allocated on it; ``held_by_phase``: the default-stream bytes per phase
    in segments that fit them exactly (no slack; None: every byte is churned).

    reserved = the default-stream pool (``_default_pool``) + each side pool at its own maximum, in
    2 MiB units, while nothing forces the allocator to release cached segments.
    """
    allocated = max(live_by_phase.values())
    side = {name: max(pool.values(), default=0) for name, pool in side_pools.items()}
    slack = 0.0 if expandable_segments else fragmentation_fraction
    default_pool = _default_pool(live_by_phase, side_pools, slack, 0 if expandable_segments else step_transient,
                                 held_by_phase)
    reserved = round_segment(default_pool) + sum(round_segment(v) for v in side.values())
    return allocated, max(reserved, round_segment(allocated)), side


def required_bytes(live_by_phase: dict[str, int], side_pools: dict[str, dict[str, int]], *,
                   fragmentation_fraction: float, expandable_segments: bool = False, step_transient: int = 0,
                   step_pinned: bool = False, held_by_phase: dict[str, int] | None = None) -> int:
    """What the allocator holds at the worst moment once every free cached segment is released: the
    largest phase's live bytes plus the split-segment slack on its churned bytes, in 2 MiB units —
    no per-stream pool maxima and, where the activation segments are free by the step, no step
    segments stacked on them.

    ``step_pinned``: the gradients the step reads were allocated by autograd during backward
    (``AccumulateGrad``: ``p.grad`` kept to the step, as FP16_Optimizer and ZeRO stage 1 do), so
    best-fit placed them in freed activation blocks and those segments stay split, not releasable:
    the step's new segments then stack on the default pool as in ``reserved_bytes``. Stages 2–3 copy
    each gradient into buffers allocated outside the activations (the ipg bucket at init, the
    partition's whole-size buffer) and free ``p.grad``, so the activation segments empty.
    """
    slack = 0.0 if expandable_segments else fragmentation_fraction
    # every stream's churned bytes are split alike once no pool's maximum is kept
    extra = _slack_bytes(live_by_phase, {}, held_by_phase, slack)
    need = max(live + extra[p] for p, live in live_by_phase.items())
    if step_pinned and not expandable_segments:
        need = max(need, _default_pool(live_by_phase, side_pools, slack, step_transient, held_by_phase))
    return round_segment(need)


def release_under_pressure(reserved: int, required: int, outside_bytes: int, capacity_bytes: int | None) -> int:
    """The reserved bytes on a card of ``capacity_bytes`` with ``outside_bytes`` held outside PyTorch
    (CUDA context, NCCL): the cached figure while it fits; else the allocator frees cached segments on
    a failed cudaMalloc and retries (CUDACachingAllocator.cpp ``malloc``), so its cache tops out at
    the card's free memory and only ``required`` beyond it is an OOM."""
    if capacity_bytes is None or reserved + outside_bytes <= capacity_bytes:
        return reserved
    return max(required, capacity_bytes - outside_bytes)
