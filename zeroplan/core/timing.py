"""Step time: α–β collective times per link tier, compute time, explicit overlap.

Collective time for one call (nccl-tests doc/PERFORMANCE.md conventions):
    t = α_steps + buffer_bytes × busbw_factor(op, n) / (bandwidth_per_gpu × efficiency)
with busbw factors all-reduce 2(n−1)/n, all-gather / reduce-scatter / all-to-all (n−1)/n,
broadcast / reduce 1. The latency term counts ring steps: (n−1) for one-pass collectives
and 2(n−1) for all-reduce; when the group spans nodes the intra-node hops use the intra
link's α and the (nodes−1) inter-node hops the inter link's α. Bandwidth: a group inside one
node uses the intra-node link; a group spanning nodes is bottlenecked by the slower of the
two tiers: NVLink per GPU, or the node's NICs together (NCCL runs one ring per NIC, so a
ring over all GPUs crosses each node boundary once per ring: per-GPU NIC share × GPUs per
node); an all-to-all is limited by each GPU's own NIC share.

Compute: 6·Ψ_active·tokens FLOPs per step (8· with full recomputation), tokens = micro
batch × sequence × gradient-accumulation steps per GPU, over peak FLOP/s(dtype) × MFU.

Overlap: collectives marked ``overlap`` can hide behind the compute of their phase
(forward = 1/3, backward = 2/3 of the compute, +1/3 recompute with full checkpointing).
best case: exposed = non-overlappable + max(0, overlappable − compute of that phase);
worst case: everything exposed. ``step_time_s`` = compute + the mean of the two
(``step_time_best_s`` / ``step_time_worst_s`` bracket it). Offload costs are exposed: PCIe
traffic at the profile's per-GPU PCIe bandwidth, the CPU optimizer step at
``CPU_ADAM_PARAMS_PER_S`` parameters per second per rank (an assumption), and NVMe swap traffic
at the node's NVMe bandwidth shared by its GPUs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from zeroplan._util import InputError
from zeroplan.core.comm import CommLedger, LedgerEntry
from zeroplan.specs.collectives import busbw_factor
from zeroplan.specs.training import TrainingSetup

__all__ = ["TimeEstimate", "collective_time_s", "estimate_time", "algbw_busbw", "DEFAULT_MFU"]

DEFAULT_MFU = 0.4
# CPU optimizer throughput per GPU rank (DeepSpeedCPUAdam, parameters updated per second).
# An assumption, stated in the output: DeepSpeed reports CPU-Adam updating ~1e9 params/s on
# a server's cores; with one rank per GPU sharing the host, 1e9 per rank is optimistic.
CPU_ADAM_PARAMS_PER_S = 1.0e9


def algbw_busbw(op: str, size_bytes: int, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s as nccl-tests reports them: algbw = S/t, busbw = algbw × factor."""
    algbw = size_bytes / time_s
    return algbw, algbw * busbw_factor(op, n)


def _steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def collective_time_s(e: LedgerEntry, hw: Any, n_gpus: int, gpus_per_node: int) -> float:
    """Seconds for ONE call of a ledger entry on profile ``hw`` (a HardwareProfile)."""
    intra, inter = hw.intra_node, hw.inter_node
    bw_intra = intra.bandwidth_GBps_per_gpu * 1e9 * intra.efficiency
    bw_inter = inter.bandwidth_GBps_per_gpu * 1e9 * inter.efficiency
    n = e.group_size
    if e.group == "intra-node" or n_gpus <= gpus_per_node:
        bw, lat = bw_intra, _steps(e.op, n) * intra.latency_us * 1e-6
    elif e.group == "inter-node":
        bw, lat = bw_inter, _steps(e.op, n) * inter.latency_us * 1e-6
    else:
        nodes = -(-n // gpus_per_node)
        # NCCL spreads its rings over every NIC of a node: a ring over all GPUs is limited by
        # the node's whole NIC bandwidth (per-GPU share × GPUs per node) or NVLink, whichever
        # is slower. An all-to-all sends each GPU's own share through the NICs: per-GPU.
        per_node = bw_inter * (1 if e.op == "all_to_all" else gpus_per_node)
        bw = min(bw_intra, per_node)
        mult = 2 if e.op == "all_reduce" else 1
        lat = mult * ((gpus_per_node - 1) * intra.latency_us + (nodes - 1) * inter.latency_us) * 1e-6
    return lat + e.buffer_bytes * busbw_factor(e.op, n) / bw


class TimeEstimate(BaseModel):
    compute_time_s: float
    comm_time_s: float  # all collectives, serialised
    exposed_time_s: dict[str, float]  # {"best": .., "worst": ..}
    pcie_time_s: float
    offload_time_s: float  # CPU optimizer step + NVMe swap (exposed; 0 without offload)
    step_time_s: float
    step_time_best_s: float
    step_time_worst_s: float
    comm_share: float  # exposed comm (mean of best/worst) / step time
    tokens_per_s: float  # global tokens per second
    mfu: float
    flops_per_step_per_gpu: float
    time_by_phase_s: dict[str, float]  # collective time per phase


def _peak_flops(hw: Any, training: TrainingSetup) -> float:
    flops = hw.gpu.peak_flops
    want = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[training.precision.name]
    # Same-width fallbacks only (bf16 and fp16 run at one tensor-core rate on NVIDIA GPUs; fp32
    # matmuls run as tf32 under PyTorch's default allow_tf32 for cuDNN). Never the fp8/int8 figure.
    fallback = {"bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16"), "fp32": ("fp32", "tf32")}[want]
    for k in fallback:
        if k in flops and flops[k] > 0:
            return float(flops[k])
    raise InputError(f"hardware profile {getattr(hw, 'name', '?')}: gpu.peak_flops has no {' or '.join(fallback)} "
                     f"figure for {want} training (has {', '.join(sorted(flops)) or 'none'})")


def estimate_time(
    ledger: CommLedger,
    training: TrainingSetup,
    hw: Any,
    *,
    active_params: int,
    n_gpus: int,
    gpus_per_node: int,
    mfu: float = DEFAULT_MFU,
) -> TimeEstimate:
    tokens = training.micro_batch * training.seq_len * training.grad_accum
    factor = 8 if training.checkpointing == "full" else 6
    flops = factor * active_params * tokens
    compute = flops / (_peak_flops(hw, training) * mfu)
    fwd_c = compute * 2 / factor
    bwd_c = compute - fwd_c

    by_phase = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    over = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    comm = 0.0
    for e in ledger.collectives:
        t = e.count * collective_time_s(e, hw, n_gpus, gpus_per_node)
        comm += t
        by_phase[e.phase] += t
        if e.overlap:
            over[e.phase] += t
    non_over = comm - sum(over.values())
    best = non_over + max(0.0, over["forward"] - fwd_c) + max(0.0, over["backward"] - bwd_c) + over["step"]
    worst = comm
    pcie_bw = hw.node.pcie_bandwidth_GBps_per_gpu * 1e9
    pcie = sum(p.bytes_per_step for p in ledger.pcie) / pcie_bw if ledger.pcie else 0.0
    offload = 0.0
    if ledger.cpu_optimizer_params_per_gpu:
        offload += ledger.cpu_optimizer_params_per_gpu / CPU_ADAM_PARAMS_PER_S
    nvme = ledger.nvme_bytes_per_gpu_per_step + sum(p.bytes_per_step for p in ledger.pcie if p.source == "nvme")
    if nvme:
        if not hw.node.nvme_bandwidth_GBps > 0:
            raise InputError(f"hardware profile {getattr(hw, 'name', '?')}: node.nvme_bandwidth_GBps = "
                             f"{hw.node.nvme_bandwidth_GBps} (no NVMe) but the plan offloads to NVMe")
        nvme_bw = hw.node.nvme_bandwidth_GBps * 1e9 / max(1, min(gpus_per_node, n_gpus))
        offload += nvme / nvme_bw
    best += pcie + offload
    worst += pcie + offload
    step_best = compute + best
    step_worst = compute + worst
    step = compute + (best + worst) / 2
    exposed_mean = (best + worst) / 2
    return TimeEstimate(
        compute_time_s=compute,
        comm_time_s=comm,
        exposed_time_s={"best": best, "worst": worst},
        pcie_time_s=pcie,
        offload_time_s=offload,
        step_time_s=step,
        step_time_best_s=step_best,
        step_time_worst_s=step_worst,
        comm_share=exposed_mean / step if step > 0 else 0.0,
        tokens_per_s=tokens * n_gpus / step if step > 0 else 0.0,
        mfu=mfu,
        flops_per_step_per_gpu=float(flops),
        time_by_phase_s=by_phase,
    )
