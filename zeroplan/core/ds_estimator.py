"""DeepSpeed's own model-state estimators, reproduced exactly without importing DeepSpeed.

Source: deepspeed/runtime/zero/stage_1_and_2.py ``estimate_zero2_model_states_mem_needs``
and deepspeed/runtime/zero/stage3.py ``estimate_zero3_model_states_mem_needs`` (identical in
0.16.5 and 0.19.8). Both return bytes as ints; GPU numbers are per GPU, CPU numbers per node.
DeepSpeed prints them as ``bytes / 2**30`` labelled "GB": they are GiB.

Quirks kept on purpose (they are what DeepSpeed computes):
- ZeRO-2 with offload: cpu = P·max(4·T, 16)·f uses T = total GPUs, not GPUs per node.
- ZeRO-2 without offload: gpu = 2P + int(18P/T) since v0.14.3 (PR #5099); before it was
  4P + int(16P/T) (``legacy=True``).
- ZeRO-3 ignores ``cpu_offload_params`` when the optimizer is not offloaded, and
  ``additional_buffer_factor`` multiplies CPU numbers only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = [
    "estimate_zero2",
    "estimate_zero3",
    "DeepSpeedEstimate",
    "EstimatorDifference",
    "deepspeed_estimate_for",
    "difference_from_peak",
]


def estimate_zero2(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
    legacy: bool = False,
) -> tuple[int, int]:
    """Return ``(cpu_mem, gpu_mem)`` bytes — CPU first, as DeepSpeed does."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        if legacy:
            gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        else:
            gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """Return ``(cpu_mem, gpu_mem, largest_layer_memory)`` bytes."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        # 18 = 16 + the 16-bit params when they are offloaded too, else 16 (the docs' table)
        per_param = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, per_param * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


class EstimatorDifference(BaseModel):
    """zeroplan's peak per GPU − DeepSpeed's GPU estimate, split into named parts that add up to
    ``difference_bytes`` exactly (bytes per GPU; a part may be negative).

    ``model_states_bytes``: zeroplan's parameters + gradients + optimizer states live in the peak
    phase minus DeepSpeed's whole GPU figure (which counts model states only, plus the largest
    layer for ZeRO-3); ``buffers_bytes``, ``activations_bytes`` (live in the peak phase) and
    ``overhead_bytes`` (CUDA context, NCCL, fragmentation) are not in DeepSpeed's estimate at all.
    """

    difference_bytes: int
    model_states_bytes: int
    buffers_bytes: int
    activations_bytes: int
    overhead_bytes: int


class DeepSpeedEstimate(BaseModel):
    """DeepSpeed's estimator numbers for one evaluated stage / offload option."""

    function: str  # which DeepSpeed function and arguments
    estimator: str = ""  # the DeepSpeed function's name (ZeRO-1 has none: ZeRO-2's is shown)
    gpu_bytes_per_gpu: int
    cpu_bytes_per_node: int
    largest_layer_bytes: int | None = None
    note: str
    vs_peak: EstimatorDifference | None = None  # filled by core.plan.evaluate


def difference_from_peak(est: DeepSpeedEstimate, mem: Any) -> EstimatorDifference:
    """Decompose ``mem.peak − est.gpu_bytes_per_gpu`` (``mem``: a core.memory.MemoryBreakdown).

    The peak is the live bytes of the peak phase (by category) plus the overhead allowance, so the
    parts below add up to the difference by construction; the assertion keeps it so."""
    cats = mem.phases[mem.peak_phase].by_category
    states = int(cats["params"]) + int(cats["gradients"]) + int(cats["optimizer_states"])
    d = EstimatorDifference(
        difference_bytes=int(mem.peak) - int(est.gpu_bytes_per_gpu),
        model_states_bytes=states - int(est.gpu_bytes_per_gpu),
        buffers_bytes=int(cats["buffers"]), activations_bytes=int(cats["activations"]),
        overhead_bytes=int(mem.overhead),
    )
    assert d.model_states_bytes + d.buffers_bytes + d.activations_bytes + d.overhead_bytes == d.difference_bytes
    return d


def deepspeed_estimate_for(
    stage: int,
    *,
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int,
    num_nodes: int,
    offload_optimizer: bool,
    offload_param: bool,
    additional_buffer_factor: float = 1.5,
) -> DeepSpeedEstimate | None:
    """DeepSpeed defines estimators for ZeRO-2 (also used for stage 1) and ZeRO-3 only."""
    common = (
        "DeepSpeed's estimator counts model states only (no activations, buffers or "
        "CUDA context) and assumes mixed precision (2-byte params)"
    )
    if stage in (1, 2):
        cpu, gpu = estimate_zero2(
            total_params, gpus_per_node, num_nodes, cpu_offload=offload_optimizer,
            additional_buffer_factor=additional_buffer_factor,
        )
        return DeepSpeedEstimate(
            function=(
                f"estimate_zero2_model_states_mem_needs(total_params={total_params}, "
                f"num_gpus_per_node={gpus_per_node}, num_nodes={num_nodes}, "
                f"cpu_offload={offload_optimizer}, additional_buffer_factor={additional_buffer_factor})"
            ),
            estimator="estimate_zero2_model_states_mem_needs",
            gpu_bytes_per_gpu=gpu,
            cpu_bytes_per_node=cpu,
            note=common + ("; DeepSpeed has no ZeRO-1 estimator, ZeRO-2's is shown" if stage == 1 else ""),
        )
    if stage == 3:
        cpu, gpu, largest = estimate_zero3(
            total_params, largest_layer_params, gpus_per_node, num_nodes,
            cpu_offload=offload_optimizer, cpu_offload_params=offload_param, zero_init=True,
            additional_buffer_factor=additional_buffer_factor,
        )
        return DeepSpeedEstimate(
            function=(
                f"estimate_zero3_model_states_mem_needs(total_params={total_params}, "
                f"largest_layer_params={largest_layer_params}, num_gpus_per_node={gpus_per_node}, "
                f"num_nodes={num_nodes}, cpu_offload={offload_optimizer}, "
                f"cpu_offload_params={offload_param}, zero_init=True, "
                f"additional_buffer_factor={additional_buffer_factor})"
            ),
            estimator="estimate_zero3_model_states_mem_needs",
            gpu_bytes_per_gpu=gpu,
            cpu_bytes_per_node=cpu,
            largest_layer_bytes=largest,
            note=common + "; adds 4 bytes per parameter of the largest layer for the stage-3 gather",
        )
    return None
