"""Host (CPU) RAM and NVMe that ZeRO-Offload needs, per rank, split into pinned and pageable.

Pinned buffers come from PyTorch's caching host allocator, which rounds every block up to a
power of two (aten/src/ATen/core/CachingHostAllocator.h, ``allocate``: ``PowerOf2Ceil``); a
DeepSpeed buffer pinned with ``.pin_memory()`` (``get_accelerator().pin_memory``) goes through it.
DeepSpeedCPUAdam's ``exp_avg``/``exp_avg_sq`` are created with ``torch.zeros_like`` of the fp32
partition inside ``DeepSpeedCPUAdam.step`` (deepspeed/ops/adam/cpu_adam.py): pageable memory.
What stays pinned (``offload_optimizer.pin_memory``, default true):
- stages 1–2 (runtime/zero/stage_1_and_2.py ``__init__``): the fp32 master partition
  ``single_partition_of_fp32_groups``, its gradient ``single_grad_partition``, the 16-bit
  ``param_buffer_of_bit16_for_cpu_offload_groups``, ``temp_grad_buffer_for_cpu_offload``
  (largest parameter) and, with gradient accumulation in stage 2, ``accumulated_grads_in_cpu``;
- stage 3 (stage3.py ``_create_fp32_partitions`` / ``__init__``): the fp32 master partition, the
  gradient partition ``grad_partitions_flat_buffer`` and its fp32 copy, and with offload_param the
  16-bit parameter partition (partition_parameters.py ``_partition_param``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from zeroplan.core.layout import Layout
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.training import TrainingSetup

__all__ = ["HostMemory", "host_memory", "pinned_block"]


class HostMemory(BaseModel):
    """Host (CPU) RAM and NVMe that offload needs; nvidia-smi does not show these."""

    per_gpu_bytes: int = 0  # pinned (as the allocator rounds it) + pageable, per rank
    per_node_bytes: int = 0
    pinned_per_node_bytes: int = 0
    pageable_per_node_bytes: int = 0
    nvme_per_node_bytes: int = 0
    detail: dict[str, int] = Field(default_factory=dict)  # per GPU (rank), requested bytes
    pinned: list[str] = Field(default_factory=list)  # which detail entries are pinned


# DeepSpeed's defaults, read where a swap buffer count or size of 0 falls back to them
_DEFAULTS = ZeroConfig()


def pinned_block(n: int) -> int:
    """Bytes the caching host allocator reserves for a pinned request of ``n`` bytes."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def host_memory(layout: Layout, training: TrainingSetup, zero: ZeroConfig, stage: int, *, off_opt: str, off_par: str,
                gpus_per_node: int, master_bytes: int, grad_bytes: int, activation_host_bytes: int = 0) -> HostMemory:
    """Host RAM (pinned and pageable) and NVMe per rank and per node for the plan's offload.

    ``activation_host_bytes``: layer checkpoints DeepSpeed's ``cpu_checkpointing`` keeps on the host
    (core/activations_megatron.py), pageable: checkpointing.py ``partition_activations`` copies them
    with ``.cpu()`` or into buffers made by ``new_empty(device=cpu)``, neither pinned.
    """
    host = HostMemory()
    pinned: set[str] = set()
    pageable: set[str] = set()
    if activation_host_bytes:
        host.detail["activation_checkpoints"] = activation_host_bytes
        pageable.add("activation_checkpoints")
    b_g = grad_bytes
    part = layout.partition_12 if stage in (1, 2) else layout.partition_3
    opt_pin = bool(zero.offload_optimizer.pin_memory)
    if off_opt != "none":
        d = host.detail
        d["fp32_master_partition"] = master_bytes * part
        d["optimizer_states"] = int(training.optimizer.state_bytes * part)
        pageable.add("optimizer_states")
        d["fp32_gradient_partition"] = 4 * part
        if stage in (1, 2):
            d["bit16_gradient_buffer"] = b_g * part
            d["offload_temp_grad_buffer"] = b_g * layout.largest_tensor
            if stage == 2 and training.grad_accum > 1:
                d["accumulated_grads_in_cpu"] = b_g * layout.grad_partition_12_max
        else:
            d["bit16_gradient_partition"] = b_g * part
        if opt_pin:
            pinned |= set(d) - pageable
        if off_opt == "nvme":
            host.nvme_per_node_bytes = gpus_per_node * (d.pop("optimizer_states") + d.pop("fp32_master_partition")
                                                        + d.pop("fp32_gradient_partition"))
            pageable.discard("optimizer_states")
            bc = int(zero.offload_optimizer.buffer_count or _DEFAULTS.offload_optimizer.buffer_count)
            sub = max(layout.sub_groups_3(int(zero.sub_group_size))) if stage == 3 else part
            d["nvme_swap_buffers"] = bc * 4 * sub
            if opt_pin:
                pinned.add("nvme_swap_buffers")
    if off_par != "none":
        b_p = training.precision.param_bytes
        par_pin = bool(zero.offload_param.pin_memory)
        if off_par == "cpu":
            host.detail["param_partition"] = b_p * layout.partition_3
            if par_pin:
                pinned.add("param_partition")
        else:
            host.nvme_per_node_bytes += gpus_per_node * b_p * layout.partition_3
            bc = int(zero.offload_param.buffer_count or _DEFAULTS.offload_param.buffer_count)
            bs = int(zero.offload_param.buffer_size or _DEFAULTS.offload_param.buffer_size)
            host.detail["param_nvme_buffers"] = bc * bs * b_p
            if par_pin:
                pinned.add("param_nvme_buffers")
    pinned &= set(host.detail)
    pin = sum(pinned_block(host.detail[k]) for k in pinned)
    page = sum(v for k, v in host.detail.items() if k not in pinned)
    host.pinned = sorted(pinned)
    host.per_gpu_bytes = pin + page
    host.per_node_bytes = host.per_gpu_bytes * gpus_per_node
    host.pinned_per_node_bytes = pin * gpus_per_node
    host.pageable_per_node_bytes = page * gpus_per_node
    return host
