"""``evaluate(...) -> Plan``: the one object recommend, check, report and bench all read.

A Plan is one (stage, offload) option for one model on one cluster: per-GPU memory by
category and phase, host RAM, fit against the hardware, the collective ledger, times and
DeepSpeed's own estimator numbers beside zeroplan's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from zeroplan.core.comm import CommLedger, LedgerEntry, PcieTransfer, build_ledger
from zeroplan.core.cublas_workspace import device_overhead
from zeroplan.core.finetune import FineTuneViews, backward_skips, ledger_layouts
from zeroplan.core.finetune_compute import matmul_work
from zeroplan.specs.finetune import FineTuneInventory
from zeroplan.core.ds_estimator import DeepSpeedEstimate, deepspeed_estimate_for, difference_from_peak
from zeroplan.core.host_time import stage3_host_time_s
from zeroplan.core.layout import zero_layout
from zeroplan.core.memory import MemoryBreakdown, memory_for_stage
from zeroplan.core.moe_leaf import largest_module_params, moe_leaf_note
from zeroplan.core.stage3_live import replay_inputs
from zeroplan.core.timing import DEFAULT_MFU, TimeEstimate, estimate_time
from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default
from zeroplan.specs.findings import Finding
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.training import TrainingSetup

__all__ = ["CommResult", "Plan", "evaluate"]


class CommResult(BaseModel):
    flavour: str
    bytes_per_gpu_per_step: int
    bytes_per_gpu_per_step_by_op: dict[str, int]
    inter_node_bytes_per_gpu_per_step: int
    collectives: list[LedgerEntry]
    pcie: list[PcieTransfer] = Field(default_factory=list)
    time_s: float | None = None
    exposed_time_s: dict[str, float] | None = None


class Plan(BaseModel):
    stage: int
    offload_optimizer: str
    offload_param: str
    n_gpus: int
    nodes: int
    gpus_per_node: int
    memory: MemoryBreakdown
    host_memory_per_node: int
    gpu_memory_bytes: int | None = None
    fits: bool | None = None  # None when no hardware profile is given; judged on memory.peak (reserved + context + NCCL)
    headroom_bytes: int | None = None
    host_ram_per_node_bytes: int | None = None
    host_fits: bool | None = None
    comm: CommResult
    time: TimeEstimate | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    deepspeed_estimator: DeepSpeedEstimate | None = None
    notes: list[str] = Field(default_factory=list)


def evaluate(
    *,
    model: ModelSpec,
    training: TrainingSetup,
    zero: ZeroConfig | None,
    n_gpus: int,
    gpus_per_node: int | None = None,
    hardware: Any = None,
    comm_model: str = "deepspeed",
    mfu: float | None = DEFAULT_MFU,
    finetune: FineTuneViews | None = None,
) -> Plan:
    """Evaluate one ZeRO configuration on ``n_gpus`` data-parallel GPUs (``zero``: a ZeroConfig;
    None: DeepSpeed's defaults, stage 0).

    ``finetune`` (core/finetune.py): trainable vs frozen parameters (LoRA, QLoRA, partial).
    """
    if gpus_per_node is None:
        gpus_per_node = hardware.node.gpus_per_node if hardware is not None else n_gpus
    gpus_per_node = max(1, min(gpus_per_node, n_gpus))
    nodes = -(-n_gpus // gpus_per_node)
    zero = zero_or_default(zero)
    stage = int(zero.stage)
    layout = zero_layout(model if finetune is None else finetune.full, n_gpus, zero)
    train_layout = None if finetune is None else zero_layout(finetune.trainable, n_gpus, zero)
    overhead = device_overhead(hardware) if hardware is not None else None
    mem = memory_for_stage(model, training, zero, n_gpus, gpus_per_node=gpus_per_node, overhead=overhead, layout=layout,
                           flavour=comm_model, finetune=finetune, train_layout=train_layout,
                           gpu_memory_bytes=int(hardware.gpu.memory_bytes) if hardware is not None else None)
    skips = backward_skips(finetune, training.checkpointing)  # modules stage 3 never fetches in backward
    led_layout, led_train = ledger_layouts(layout, train_layout, stage)
    ledger: CommLedger = build_ledger(led_layout, training, zero, gpus_per_node=gpus_per_node, comm_model=comm_model,
                                      train_layout=led_train,
                                      no_backward=skips)
    off_opt = zero.optimizer_offload_device
    off_par = zero.param_offload_device
    comm = CommResult(
        flavour=ledger.flavour,
        bytes_per_gpu_per_step=ledger.bytes_per_gpu_per_step,
        bytes_per_gpu_per_step_by_op=ledger.bytes_per_gpu_per_step_by_op,
        inter_node_bytes_per_gpu_per_step=ledger.inter_node_bytes_per_gpu_per_step,
        collectives=ledger.collectives,
        pcie=ledger.pcie,
    )
    plan = Plan(
        stage=stage, offload_optimizer=off_opt, offload_param=off_par, n_gpus=n_gpus, nodes=nodes,
        gpus_per_node=gpus_per_node, memory=mem, host_memory_per_node=mem.host.per_node_bytes, comm=comm,
        deepspeed_estimator=deepspeed_estimate_for(
            stage, total_params=model.params, largest_layer_params=largest_module_params(model),
            gpus_per_node=gpus_per_node, num_nodes=nodes, offload_optimizer=off_opt != "none",
            offload_param=off_par != "none",
        ),
        notes=list(mem.notes) + list(ledger.notes),
    )
    leaf = moe_leaf_note(model, zero, training.precision.param_bytes, training.precision.grad_bytes)
    if leaf is not None:
        plan.notes.append(leaf)
    if plan.deepspeed_estimator is not None:
        plan.deepspeed_estimator.vs_peak = difference_from_peak(plan.deepspeed_estimator, mem)
    if hardware is not None:
        plan.gpu_memory_bytes = int(hardware.gpu.memory_bytes)
        plan.headroom_bytes = plan.gpu_memory_bytes - mem.peak
        plan.fits = mem.peak <= plan.gpu_memory_bytes
        plan.host_ram_per_node_bytes = int(hardware.node.host_ram_bytes)
        plan.host_fits = mem.host.per_node_bytes <= plan.host_ram_per_node_bytes
        if mem.host.nvme_per_node_bytes and mem.host.nvme_per_node_bytes > hardware.node.nvme_capacity_bytes:
            plan.host_fits = False
            plan.notes.append("NVMe offload exceeds the node's NVMe capacity")
        host_s = None
        if stage == 3 and layout.units:  # the replay's inputs, as the ledger's (one interned object)
            inputs = replay_inputs(layout, train_layout or layout, skips)
            host_s = stage3_host_time_s(inputs, recompute_layers=training.checkpointing == "full",
                                        grad_accum=training.grad_accum)
        t = estimate_time(ledger, training, hardware, active_params=model.active_params, n_gpus=n_gpus,
                          gpus_per_node=gpus_per_node, mfu=mfu, model=model, work=matmul_work(model, finetune),
                          host_by_phase_s=host_s)
        plan.time = t
        plan.notes.extend(a for a in t.assumptions if a not in plan.notes)
        plan.comm.time_s = t.comm_time_s
        plan.comm.exposed_time_s = t.exposed_time_s
        plan.step_time_s = t.step_time_s
        plan.tokens_per_s = t.tokens_per_s
    return plan


class ModelSummary(BaseModel):
    name: str
    source: str
    model_type: str
    params: int
    largest_layer_params: int
    largest_layer_name: str
    active_params: int
    approximate: bool


class ClusterSummary(BaseModel):
    n_gpus: int
    nodes: int
    gpus_per_node: int
    hardware: str | None = None
    gpu: str | None = None
    gpu_memory_bytes: int | None = None


class EstimateResult(BaseModel):
    """What ``zeroplan estimate --json`` prints."""

    model: ModelSummary
    cluster: ClusterSummary
    training: dict[str, Any]
    comm_model: str
    assumptions: list[str]
    ds_config_findings: list[Finding] = Field(default_factory=list)  # from --ds-config (DS001..DS011)
    finetune: FineTuneInventory | None = None  # trainable / frozen / adapter counts (None: full training)
    stages: list[Plan]


def model_summary(spec: ModelSpec) -> ModelSummary:
    return ModelSummary(
        name=spec.name, source=spec.source, model_type=spec.model_type, params=spec.params,
        largest_layer_params=spec.largest_module_params, largest_layer_name=spec.largest_module_name,
        active_params=spec.active_params, approximate=spec.approximate,
    )


def training_summary(training: TrainingSetup) -> dict[str, Any]:
    return {
        "precision": training.precision.name,
        "precision_source": training.precision_source,
        "bytes_per_param": {
            "params": training.precision.param_bytes,
            "gradients": training.precision.grad_bytes,
            "optimizer_states": training.optimizer_bytes_per_param,  # the paper's K; see each plan's memory
        },
        "optimizer": training.optimizer.name,
        "optimizer_impl": training.optimizer_impl,
        "grad_accum_dtype": training.grad_accum_dtype or training.precision.name,
        "micro_batch": training.micro_batch,
        "seq_len": training.seq_len,
        "grad_accum": training.grad_accum,
        "checkpointing": training.checkpointing,
        "flash_attention": training.flash_attention,
        "activations": training.activation_impl,
        "kernels": training.kernels,
    }


__all__ += ["ModelSummary", "ClusterSummary", "EstimateResult", "model_summary", "training_summary"]
