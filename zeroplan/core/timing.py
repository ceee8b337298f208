"""Step time of one optimizer step: compute, collectives, overlap, and offload, each its own row.

- Compute: core/compute.py (FLOPs from the architecture at an achievable rate per GPU
  generation and shape; ``--mfu`` overrides the rate).
- Collectives: one call is timed as NCCL's tuner would run it (core/nccl_model.py: ring,
  tree, NVLS, NVLSTree, CollNet × LL, LL128, Simple; the fastest wins), over the call's group
  (a subgroup inside a node, the whole node, or nodes).
- Overlap: core/overlap.py schedules each phase (prefetched gathers, gradient buckets behind
  the next layers' backward, the step's collectives never hidden) and returns the exposed
  time, with best (all that the phases allow hides, no slowdown) and worst (nothing hides) as a
  bracket. Exposed communication never exceeds communication.
- Offload is not communication. Its rows are apart: PCIe traffic between host and GPU at
  the profile's per-GPU PCIe bandwidth; the CPU optimizer step (DeepSpeedCPUAdam) at the
  profile's ``node.cpu_adam_params_per_s_per_core`` × the physical cores one rank gets
  (cores per node / GPUs per node); NVMe swap traffic at the node's NVMe bandwidth shared by
  its GPUs. All three are exposed (DeepSpeed runs the CPU step after the backward and before
  the next forward; the swap and the copies sit on that path).

``step_time_s`` = compute + overlap slowdown + exposed comm + PCIe + CPU optimizer + NVMe.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from zeroplan._util import InputError
from zeroplan.core.comm import CommLedger, LedgerEntry
from zeroplan.core.compute import HBM_EFFICIENCY, ComputeEstimate, estimate_compute, hbm_stream_time_s, peak_flops
from zeroplan.core.finetune_compute import FULL_TRAINING, MatmulWork
from zeroplan.core.host_time import STAGE3_FETCH_HOST_SOURCE, host_bound_s
from zeroplan.core.nccl_model import AlgoChoice, collective_choice
from zeroplan.core.overlap import OVERLAP_SLOWDOWN, PhaseComm, overlap_slowdown, schedule_overlap
from zeroplan.specs.collectives import busbw_factor
from zeroplan.specs.training import TrainingSetup

__all__ = ["TimeEstimate", "collective_time_s", "estimate_time", "algbw_busbw", "DEFAULT_MFU",
           "CPU_ADAM_PARAMS_PER_S_PER_CORE", "cpu_adam_rate"]

DEFAULT_MFU: float | None = None  # None: the compute model (core/compute.py) sets the rate
# DeepSpeedCPUAdam throughput per physical core when the profile gives none. The update moves 28 B of
# fp32 per parameter (ops/adam cpu_adam: reads parameter, gradient, exp_avg, exp_avg_sq; writes three
# back), so with every rank stepping at once a node is bound by its memory bandwidth, not its cores:
# ~300 GB/s sustained (75% of a two-socket DDR4-3200 host's 409.6 GB/s) / 28 B / 128 cores = 8e7.
# One core alone runs ~1.6e9, ~1e9 each with two busy (bench cpu-adam, AVX-512 EPYC VM:
# examples/validation/cpu-adam/).
CPU_ADAM_PARAMS_PER_S_PER_CORE = 8.0e7
CPU_ADAM_SOURCE = ("bandwidth-bound estimate: 28 B of fp32 per parameter and step at ~300 GB/s of host memory "
                   "bandwidth over 128 cores = 8e7 parameters/s per core when every rank steps at once; not "
                   "measured on this hardware: zeroplan bench cpu-adam --nproc <GPUs per node> --save-profile")


def algbw_busbw(op: str, size_bytes: int, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s as nccl-tests reports them: algbw = S/t, busbw = algbw × factor."""
    algbw = size_bytes / time_s
    return algbw, algbw * busbw_factor(op, n)


def _group_shape(e: LedgerEntry, n_gpus: int, gpus_per_node: int) -> tuple[int, int, int]:
    """(ranks, nodes, ranks per node) of the call's group."""
    n = e.group_size
    if e.group == "intra-node" or n_gpus <= gpus_per_node:
        return n, 1, n
    if e.group == "inter-node":
        return n, n, 1
    nodes = -(-n // gpus_per_node)
    return n, nodes, min(n, gpus_per_node)


def _entry_choice(e: LedgerEntry, hw: Any, n_gpus: int, gpus_per_node: int) -> AlgoChoice | None:
    """NCCL's algorithm × protocol for ONE call of a ledger entry (None for a group of one rank)."""
    n, nodes, per = _group_shape(e, n_gpus, gpus_per_node)
    if n <= 1:
        return None
    return collective_choice(e.op, e.buffer_bytes, n, nodes, per, hw, all_gpus_per_node=gpus_per_node)


def collective_time_s(e: LedgerEntry, hw: Any, n_gpus: int, gpus_per_node: int) -> float:
    """Seconds for ONE call of a ledger entry on profile ``hw`` (a HardwareProfile)."""
    ch = _entry_choice(e, hw, n_gpus, gpus_per_node)
    return 0.0 if ch is None else ch.time_s


def cpu_adam_rate(hw: Any, gpus_per_node: int) -> tuple[float, str]:
    """(parameters/s one rank's CPU optimizer updates, where the figure comes from)."""
    per_core = getattr(hw.node, "cpu_adam_params_per_s_per_core", None)
    # the profile's source, up to its first colon: "measured by zeroplan bench cpu-adam on <date>" or
    # the bundled profiles' "bandwidth-bound estimate, not measured on this hardware"
    note = str((getattr(hw, "sources", None) or {}).get("node.cpu_adam_params_per_s_per_core", "")).split(":")[0]
    note = note.strip() + ("" if not note.strip() or note.startswith("measured") else
                           "; zeroplan bench cpu-adam measures it")
    src = f"profile {getattr(hw, 'name', '?')} node.cpu_adam_params_per_s_per_core" + (f" ({note})" if note else "")
    if not per_core:
        per_core, src = CPU_ADAM_PARAMS_PER_S_PER_CORE, CPU_ADAM_SOURCE
    cores = hw.node.cpu_cores or 2 * max(1, hw.node.gpus_per_node)
    per_rank = max(1.0, cores / max(1, gpus_per_node))
    return per_core * per_rank, (f"CPU-Adam {per_core:.3g} params/s per core × {per_rank:g} cores per rank "
                                 f"({cores} cores / {gpus_per_node} GPUs) = {per_core * per_rank:.3g} params/s per rank; {src}")


class TimeEstimate(BaseModel):
    compute_time_s: float  # compute alone (no overlap slowdown)
    comm_time_s: float  # all collectives, serialised
    exposed_time_s: dict[str, float]  # collectives only: {"best", "worst", "estimate"}; each <= comm_time_s
    pcie_time_s: float  # offload copies between host and GPU (exposed)
    cpu_optimizer_time_s: float = 0.0  # CPU optimizer step with optimizer offload (exposed)
    gpu_optimizer_time_s: float = 0.0  # the optimizer step's HBM passes on the GPU (exposed; core/optimizer_step.py)
    gpu_optimizer_bytes: int = 0  # the HBM bytes those passes read and write
    nvme_time_s: float = 0.0  # NVMe swap (exposed)
    offload_time_s: float  # CPU optimizer + NVMe (exposed; 0 without offload)
    overlap_slowdown_s: float = 0.0  # compute lost while hidden comm shares the GPU
    host_time_s: float = 0.0  # DeepSpeed's stage-3 module hooks on the host (core/host_time.py)
    host_bound_s: float = 0.0  # what the host adds beyond the GPU's time (the GPU waits for the hooks)
    host_by_phase_s: dict[str, float] = Field(default_factory=dict)
    overlap_slowdown: float = OVERLAP_SLOWDOWN  # that loss as a fraction of the hidden comm time (core/overlap.py)
    hidden_comm_s: float = 0.0  # comm that runs behind compute in the estimate
    exposed_by_phase_s: dict[str, float] = Field(default_factory=dict)
    step_time_s: float
    step_time_best_s: float
    step_time_worst_s: float
    comm_share: float  # exposed comm (estimate) / step time
    offload_share: float = 0.0  # PCIe + CPU optimizer + NVMe / step time
    tokens_per_s: float  # global tokens per second
    mfu: float  # model FLOPs / (compute time × peak): the compute model's rate (or --mfu)
    mfu_source: str = ""
    achieved_mfu: float = 0.0  # model FLOPs / (step time × peak), communication included
    flops_per_step_per_gpu: float  # model FLOPs (no recomputation)
    compute: ComputeEstimate | None = None
    time_by_phase_s: dict[str, float]  # collective time per phase
    algorithms: dict[str, str] = Field(default_factory=dict)  # op -> "ring/Simple" for the largest call
    cpu_adam_params_per_s: float | None = None
    assumptions: list[str] = Field(default_factory=list)


def _legacy_compute(active_params: int, training: TrainingSetup, hw: Any, mfu: float | None,
                    work: MatmulWork = FULL_TRAINING) -> ComputeEstimate:
    """Without an architecture: 6·Ψ·tokens (8· with full recomputation) at ``mfu`` (0.4 if none);
    frozen weights 4·Ψ (no weight-gradient GEMM, core/finetune_compute.py)."""
    tokens = training.micro_batch * training.seq_len * training.grad_accum
    per_param = 4.0 + 2.0 * work.trainable_share
    model = per_param * active_params * tokens
    hard = model + (2.0 * active_params * tokens if training.checkpointing == "full" else 0.0)
    peak = peak_flops(hw, training)
    rate = 0.4 if mfu is None else mfu
    t = model / (peak * rate)
    # the forward is 2Ψ per token; recomputation (full checkpointing) runs inside the backward
    hard_per = per_param + (2.0 if training.checkpointing == "full" else 0.0)
    return ComputeEstimate(time_s=t, model_flops=model, hardware_flops=hard, attention_share=0.0, peak_flops=peak,
                           mfu=rate, source=f"{per_param:g}Ψ per token at MFU {rate:g} (no architecture given)",
                           generation="unknown", forward_time_s=t * 2.0 / hard_per,
                           backward_time_s=t * (hard_per - 2.0) / hard_per)


def _nvme_time_s(ledger: CommLedger, hw: Any, ranks_per_node: int) -> float:
    """NVMe swap per step: the ledger's NVMe bytes at the node's NVMe bandwidth shared by its ranks."""
    nvme_bytes = ledger.nvme_bytes_per_gpu_per_step + sum(p.bytes_per_step for p in ledger.pcie if p.source == "nvme")
    if not nvme_bytes:
        return 0.0
    if not hw.node.nvme_bandwidth_GBps > 0:
        raise InputError(f"hardware profile {getattr(hw, 'name', '?')}: node.nvme_bandwidth_GBps = "
                         f"{hw.node.nvme_bandwidth_GBps} (no NVMe) but the plan offloads to NVMe")
    nvme_bw = hw.node.nvme_bandwidth_GBps * 1e9 / max(1, ranks_per_node)
    return nvme_bytes / nvme_bw if nvme_bw > 0 else 0.0


def _gpu_optimizer_time_s(ledger: CommLedger, hw: Any, assumptions: list[str]) -> tuple[float, int]:
    """(seconds, HBM bytes) of the optimizer step's passes on the GPU at the streaming rate
    (core/optimizer_step.py)."""
    traffic = ledger.optimizer
    total_bytes = traffic.total_bytes
    if not total_bytes:
        return 0.0, 0
    t = hbm_stream_time_s(total_bytes, hw)
    assumptions.append(f"GPU optimizer step {t * 1e3:,.1f} ms: {total_bytes / 1e9:,.2f} GB of HBM traffic at "
                       f"{HBM_EFFICIENCY:.0%} of {hw.gpu.hbm_bandwidth_GBps:,.0f} GB/s, not overlapped; "
                       f"{traffic.describe()}")
    return t, total_bytes


def _phase_comm(ledger: CommLedger, hw: Any, n_gpus: int, gpus_per_node: int, gas: int
                ) -> tuple[float, dict[str, float], dict[str, PhaseComm], dict[str, tuple[int, str]]]:
    """Each collective timed (core/nccl_model.py) and filed by phase and by what the schedule can
    hide: (serial total, seconds by phase, PhaseComm by phase, the largest call's algorithm by op)."""
    phases = {"forward": PhaseComm(), "backward": PhaseComm(), "step": PhaseComm()}
    by_phase = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    algos: dict[str, tuple[int, str]] = {}
    comm = 0.0
    first_gather = {"forward": None, "backward": None}
    last_bucket = 0.0
    for e in ledger.collectives:
        ch = _entry_choice(e, hw, n_gpus, gpus_per_node)
        one = 0.0 if ch is None else ch.time_s
        t = e.count * one
        comm += t
        by_phase[e.phase] += t
        pc = phases[e.phase]
        if e.overlap and e.phase != "step":
            pc.overlappable_s += t
            if e.op == "all_gather" and first_gather[e.phase] is None:
                first_gather[e.phase] = one
            if e.op != "all_gather":
                last_bucket = one  # the ledger lists buckets in issue order
        else:
            pc.serial_s += t
        if ch is not None and (e.op not in algos or e.buffer_bytes > algos[e.op][0]):
            algos[e.op] = (e.buffer_bytes, f"{ch.algorithm}/{ch.protocol}")
    per_micro = 1 / max(1, gas)
    for ph in ("forward", "backward"):
        if first_gather[ph] is not None:
            phases[ph].first_s = min(phases[ph].overlappable_s * per_micro, first_gather[ph]) * gas
    phases["backward"].last_s = min(phases["backward"].overlappable_s * per_micro, last_bucket) * gas
    return comm, by_phase, phases, algos


def _host_note(host_by_phase_s: dict[str, float], bound_s: float) -> str:
    """Said only when the host binds: the GPU waits for DeepSpeed's hooks."""
    return (f"host-bound: DeepSpeed's stage-3 module hooks take {sum(host_by_phase_s.values()) * 1e3:,.1f} ms per "
            f"step on the host and the GPU waits {bound_s * 1e3:,.1f} ms for them; a bigger micro-batch, or ZeRO-2, "
            f"gives the GPU more work per hook ({STAGE3_FETCH_HOST_SOURCE})")


def estimate_time(
    ledger: CommLedger,
    training: TrainingSetup,
    hw: Any,
    *,
    active_params: int,
    n_gpus: int,
    gpus_per_node: int,
    mfu: float | None = DEFAULT_MFU,
    model: Any = None,
    work: MatmulWork = FULL_TRAINING,
    host_by_phase_s: dict[str, float] | None = None,
) -> TimeEstimate:
    """``work``: which matmul weights train (core/finetune_compute.py; default: all of them).
    ``host_by_phase_s``: host time a phase needs whatever the GPU does (core/host_time.py); a phase
    lasts the longer of the two."""
    comp = estimate_compute(model, training, hw, mfu=mfu, work=work) if model is not None else \
        _legacy_compute(active_params, training, hw, mfu, work)
    compute = comp.time_s
    comm, by_phase, phases, algos = _phase_comm(ledger, hw, n_gpus, gpus_per_node, training.grad_accum)
    slowdown, slowdown_src = overlap_slowdown(hw)
    ov = schedule_overlap(phases, {"forward": comp.forward_time_s, "backward": comp.backward_time_s},
                          slowdown=slowdown)

    pcie_bw = hw.node.pcie_bandwidth_GBps_per_gpu * 1e9
    pcie = sum(p.bytes_per_step for p in ledger.pcie) / pcie_bw if ledger.pcie else 0.0
    cpu_opt = 0.0
    rate = None
    assumptions = [f"compute: {comp.source}"]
    if ledger.cpu_optimizer_params_per_gpu:
        rate, rate_src = cpu_adam_rate(hw, min(gpus_per_node, n_gpus))
        cpu_opt = ledger.cpu_optimizer_params_per_gpu / rate
        assumptions.append(rate_src)
    nvme = _nvme_time_s(ledger, hw, min(gpus_per_node, n_gpus))
    gpu_opt, gpu_opt_bytes = _gpu_optimizer_time_s(ledger, hw, assumptions)
    if ov.hidden_s:
        assumptions.append(f"overlap: hidden communication slows compute by {slowdown:.0%} of its time "
                           f"({slowdown_src})")
    off = pcie + cpu_opt + nvme
    host = host_by_phase_s or {}
    gpu_s = {"forward": comp.forward_time_s, "backward": comp.backward_time_s}
    host_est = host_bound_s(host, {ph: gpu_s[ph] + ov.by_phase_exposed_s.get(ph, 0.0)
                                   + slowdown * ov.by_phase_hidden_s.get(ph, 0.0) for ph in gpu_s})
    host_best = host_bound_s(host, {ph: gpu_s[ph] + ov.by_phase_best_s.get(ph, 0.0) for ph in gpu_s})
    host_worst = host_bound_s(host, {ph: gpu_s[ph] + by_phase[ph] for ph in gpu_s})
    if host_est > 0:
        assumptions.append(_host_note(host, host_est))
    step = compute + ov.slowdown_s + ov.exposed_s + off + gpu_opt + host_est
    # each phase lasts max(GPU, host), monotone in the GPU's time: best <= estimate <= worst (min/max: float rounding)
    step_best = min(step, compute + ov.best_s + off + gpu_opt + host_best)
    step_worst = max(step, compute + ov.worst_s + off + gpu_opt + host_worst)
    tokens = training.micro_batch * training.seq_len * training.grad_accum
    return TimeEstimate(
        compute_time_s=compute,
        comm_time_s=comm,
        exposed_time_s={"best": ov.best_s, "worst": ov.worst_s, "estimate": ov.exposed_s},
        pcie_time_s=pcie,
        cpu_optimizer_time_s=cpu_opt,
        gpu_optimizer_time_s=gpu_opt,
        gpu_optimizer_bytes=gpu_opt_bytes,
        nvme_time_s=nvme,
        offload_time_s=cpu_opt + nvme,
        overlap_slowdown_s=ov.slowdown_s,
        overlap_slowdown=slowdown,
        host_time_s=sum(host.values()),
        host_bound_s=host_est,
        host_by_phase_s=dict(host),
        hidden_comm_s=ov.hidden_s,
        exposed_by_phase_s=ov.by_phase_exposed_s,
        step_time_s=step,
        step_time_best_s=step_best,
        step_time_worst_s=step_worst,
        comm_share=ov.exposed_s / step if step > 0 else 0.0,
        offload_share=off / step if step > 0 else 0.0,
        tokens_per_s=tokens * n_gpus / step if step > 0 else 0.0,
        mfu=comp.mfu,
        mfu_source=comp.source,
        achieved_mfu=comp.model_flops / (step * comp.peak_flops) if step > 0 else 0.0,
        flops_per_step_per_gpu=comp.model_flops,
        compute=comp,
        time_by_phase_s=by_phase,
        algorithms={k: v[1] for k, v in algos.items()},
        cpu_adam_params_per_s=rate,
        assumptions=assumptions,
    )
