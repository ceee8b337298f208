"""Which communication hides behind compute, phase by phase, as the engines schedule it.

Per optimizer step, per phase (forward, backward, step), with ``C`` the phase's compute (the
recomputation of activation checkpointing is backward compute: it runs inside the backward pass,
core/compute.py) and the ledger's collectives of the phase timed one by one (core/nccl_model.py):
- forward (ZeRO-3 parameter gathers, ``overlap``): DeepSpeed's PartitionedParameterCoordinator
  prefetches the next modules' gathers while the current module computes
  (``fetch_sub_module`` / ``__prefetch_params``), so the FIRST gather of every micro-step is
  exposed and the rest hide behind compute as a pipeline: exposed = first + max(0, rest − C);
- backward: re-gathers are prefetched the same way; gradient buckets are reduced
  (reduce-scatter under stage 3, all-reduce/reduce under stages 1–2 with ``overlap_comm``)
  on a side stream while the next layers' backward runs, so the LAST bucket of every
  micro-step is exposed (nothing is left to compute behind it):
  exposed = first gather + last bucket + max(0, rest − C);
- collectives without ``overlap`` (stage 0/1/2 without ``overlap_comm``, the step's
  all-gather of updated parameters, norms, flags, persistent parameters) are all exposed;
- the comm that does hide slows the compute it runs beside: NCCL kernels take SMs and HBM
  bandwidth (``OVERLAP_SLOWDOWN`` of the hidden time is added to compute, or the profile's
  ``node.overlap_slowdown`` measured by ``zeroplan bench overlap``; 1 means nothing hides).

Best case: the same structure, no slowdown and the hidden part limited only by the total
compute of the phase. Worst case: nothing overlaps. The estimate is the schedule.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["OverlapResult", "PhaseComm", "schedule_overlap", "overlap_slowdown", "OVERLAP_SLOWDOWN",
           "OVERLAP_SLOWDOWN_SOURCE"]

# Compute slowdown while a collective runs beside it, as a fraction of the hidden comm time.
# Corroborated by Lee et al., 'Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning' (arXiv:2507.03114, 4x A100/H100/MI250/MI210, GPT and LLaMA): overlapped
# compute runs 18.9% longer on average (40% at most) than alone; with the collective spanning the
# compute that is 0.189 / 1.189 = 0.16 of the hidden time. Kernels sized to exactly one wave can lose
# far more (a GEMM of 132 blocks on an H100 pushed into a second wave by NCCL's 24: about 2x, NVIDIA
# developer forum thread 337991): a cluster's own figure comes from `zeroplan bench overlap`.
OVERLAP_SLOWDOWN = 0.15
OVERLAP_SLOWDOWN_SOURCE = (
    "GEMMs run 10-20% slower while an NCCL collective shares the GPU's SMs and HBM bandwidth "
    "(Pati et al., 'T3: Transparent Tracking & Triggering for Fine-grained Overlap of Compute & "
    "Collectives', ASPLOS 2024, arXiv:2401.16677, sec. 3: concurrent GEMM + reduce-scatter); 0.15 used")


def overlap_slowdown(hw: Any) -> tuple[float, str]:
    """The slowdown fraction to plan with and where it comes from: the profile's measured
    ``node.overlap_slowdown`` (``zeroplan bench overlap --save-profile``) when it has one, else
    ``OVERLAP_SLOWDOWN``. A cluster whose NCCL kernels serialise with compute measures 1."""
    value = getattr(getattr(hw, "node", None), "overlap_slowdown", None)
    if value is None:
        return OVERLAP_SLOWDOWN, OVERLAP_SLOWDOWN_SOURCE
    src = (getattr(hw, "sources", None) or {}).get("node.overlap_slowdown", "") or "the hardware profile"
    return float(value), f"node.overlap_slowdown of profile {getattr(hw, 'name', '?')}: {src}"


class PhaseComm(BaseModel):
    """Collective time of one phase, split by what the schedule can hide."""

    overlappable_s: float = 0.0
    first_s: float = 0.0  # exposed at the start of every micro-step (first gather)
    last_s: float = 0.0  # exposed at the end of every micro-step (last gradient bucket)
    serial_s: float = 0.0  # never overlaps


class OverlapResult(BaseModel):
    exposed_s: float  # the schedule's estimate
    best_s: float
    worst_s: float
    hidden_s: float  # comm that runs behind compute in the estimate
    slowdown_s: float  # compute lost to sharing the GPU with the hidden comm
    by_phase_exposed_s: dict[str, float]
    by_phase_best_s: dict[str, float] = Field(default_factory=dict)  # the best case's exposed comm per phase
    by_phase_hidden_s: dict[str, float] = Field(default_factory=dict)


def schedule_overlap(phases: dict[str, PhaseComm], compute_s: dict[str, float],
                     slowdown: float = OVERLAP_SLOWDOWN) -> OverlapResult:
    exposed = best = worst = hidden = 0.0
    by_phase: dict[str, float] = {}
    by_phase_best: dict[str, float] = {}
    by_phase_hidden: dict[str, float] = {}
    for name, pc in phases.items():
        c = compute_s.get(name, 0.0)
        total = pc.overlappable_s + pc.serial_s
        edge = min(pc.overlappable_s, pc.first_s + pc.last_s)
        rest = pc.overlappable_s - edge
        hid = min(rest, c)
        ex = pc.serial_s + edge + (rest - hid)
        b = pc.serial_s + max(0.0, pc.overlappable_s - c)
        by_phase[name] = ex
        by_phase_best[name] = min(b, ex)
        by_phase_hidden[name] = hid
        exposed += ex
        hidden += hid
        best += min(b, ex)
        worst += total
    return OverlapResult(exposed_s=exposed, best_s=best, worst_s=worst, hidden_s=hidden,
                         slowdown_s=slowdown * hidden, by_phase_exposed_s=by_phase,
                         by_phase_best_s=by_phase_best, by_phase_hidden_s=by_phase_hidden)
