"""Host time of DeepSpeed's stage-3 module hooks, and the part of it the GPU waits for.

Under stage 3 every module call runs Python on the host before and after its kernels:
DeepSpeed 0.19.8's ``parameter_offload.py`` registers forward pre/post hooks and backward
pre/post functions on every module (``_register_deepspeed_module``), and each of them drives the
``PartitionedParameterCoordinator`` (``fetch_sub_module``: trace bookkeeping, the coalesced
all-gather, the prefetch queue; ``release_sub_module``: the reuse-distance scan, partitioning).
That work does not shrink with the tensors: for a small model or a short micro-step the GPU
finishes a module's kernels before the host has issued the next ones, and waits.

The count of fetches is DeepSpeed's own (core/stage3_fetch.py ``micro_step_events``: one per call of
a module that owns parameters, the recomputed forward of full checkpointing included). The time per
fetch was measured on DeepSpeed itself on a GPU node (examples/validation/gpu/h200-2026-11-28/
stage3-host-cuda.json: one H200 and 16 cores of a Xeon VM; transformers Llama and GPT-2, stage 3 minus
stage 0, per layer, divided by the fetches per layer; the per-fetch figure folds in the hooks of the
layer's modules without parameters). There DeepSpeed's stream, event and allocation calls are real; the
same measurement on CPU (examples/validation/stage3-host/run*.json), where they are no-ops, gave 0.38-0.42x
of it. At world size 1 each fetch also synchronises the stream (``NoGatherHandle.wait``), a few tens
of microseconds of the figure that a multi-rank job does not pay.

A phase (forward, backward) then takes the longer of the GPU's time (compute + exposed
communication + the overlap slowdown) and the host's (``host_bound_s``: what the host adds beyond
the GPU). A count-only spec (``--model 7B``) has no modules to count and gets no host time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from zeroplan.core.stage3_fetch import FetchUnit, micro_step_events
from zeroplan.core.stage3_live import ReplayInputs

__all__ = ["STAGE3_FETCH_HOST_S", "STAGE3_FETCH_HOST_SOURCE", "stage3_fetches", "stage3_host_time_s",
           "host_bound_s"]

# Host seconds per fetch of a parameter-owning module, by phase (recomputed forwards count as
# backward: they run inside it). The mean over transformers' Llama and GPT-2, with and without
# checkpointing, of DeepSpeed 0.19.8 on one H200 (stage3-host-cuda.json ``per_fetch``;
# tests/test_host_time.py recomputes it). The four figures spread from 0.52 to 1.11 ms: GPT-2 has more
# modules without parameters per fetch.
STAGE3_FETCH_HOST_S = {"forward": 7.77e-4, "backward": 7.09e-4}
STAGE3_FETCH_HOST_SOURCE = (
    "0.78 ms per forward and 0.71 ms per backward fetch of a module (0.52-1.11 over the runs), DeepSpeed 0.19.8 "
    "measured on an H200 node (examples/validation/gpu/h200-2026-11-28/stage3-host-cuda.json)")


def stage3_fetches(units: Sequence[FetchUnit], recompute_layers: bool) -> dict[str, int]:
    """Fetches of parameter-owning modules per micro-step, by phase (the root has no parameters). A unit
    whose output needs no gradient carries ``backward=False`` (core/stage3_live.py ``replay_inputs``)."""
    out = {"forward": 0, "backward": 0}
    for kind, unit, phase, _recompute in micro_step_events(list(units), recompute_layers=recompute_layers):
        if kind == "fetch" and unit >= 0:
            out[phase] += 1
    return out


@lru_cache(maxsize=256)  # keyed by the replay's interned inputs, as the gather replays are
def _fetches(inputs: ReplayInputs, recompute_layers: bool) -> tuple[int, int]:
    n = stage3_fetches(inputs[3], recompute_layers)
    return n["forward"], n["backward"]


def stage3_host_time_s(inputs: ReplayInputs, *, recompute_layers: bool, grad_accum: int) -> dict[str, float]:
    """Host seconds per optimizer step that stage 3's hooks take, by phase. ``inputs``: the coordinator
    replay's (core/stage3_live.py ``replay_inputs``: the fetch units with their backward flags)."""
    fwd, bwd = _fetches(inputs, recompute_layers)
    gas = max(1, grad_accum)
    return {"forward": fwd * STAGE3_FETCH_HOST_S["forward"] * gas, "backward": bwd * STAGE3_FETCH_HOST_S["backward"] * gas}


def host_bound_s(host_by_phase_s: Mapping[str, float], gpu_by_phase_s: Mapping[str, float]) -> float:
    """Seconds the host adds beyond the GPU: a phase lasts max(GPU, host), summed over the phases."""
    return sum(max(0.0, h - gpu_by_phase_s.get(ph, 0.0)) for ph, h in host_by_phase_s.items())
