"""The typed hardware profile (pydantic): a node's GPU, links, host and the source of every number.

Units and the sources rule are in the package overview, ``zeroplan/specs/hardware.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FLOP_DTYPES", "GPUSpec", "NodeSpec", "LinkSpec", "OverheadSpec", "HardwareProfile"]

FLOP_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TiB = 2**40


class _Strict(BaseModel):
    # strict: a TOML string "8" is not a number (no lax coercion); ints are accepted for floats
    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True)


class GPUSpec(_Strict):
    """One accelerator. ``memory_bytes`` is the device total the driver reports (bytes)."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # dense FLOP/s, keys among FLOP_DTYPES
    hbm_bandwidth_GBps: float  # device memory bandwidth, 1e9 B/s


class NodeSpec(_Strict):
    """One node (server / VM): GPU count, host memory, host<->GPU and NVMe bandwidth."""

    gpus_per_node: int
    host_ram_bytes: int
    pcie_bandwidth_GBps_per_gpu: float  # unidirectional host<->GPU, 1e9 B/s
    nvme_bandwidth_GBps: float  # aggregate local NVMe per node, 1e9 B/s (0 = none)
    nvme_capacity_bytes: int  # aggregate local NVMe per node (0 = none)
    cpu_cores: int | None = None  # physical cores per node
    # DeepSpeedCPUAdam parameters updated per second per physical core (AVX-512/AVX2 build);
    # the CPU-optimizer step time with optimizer offload = partition / (rate × cores per rank)
    cpu_adam_params_per_s_per_core: float | None = None
    # compute lost while communication runs hidden beside it, as a fraction of the hidden comm
    # time: 0 = hidden for free, 1 = nothing hides (serialised). Measured by `zeroplan bench
    # overlap`; None = the planner's default (core/overlap.py OVERLAP_SLOWDOWN)
    overlap_slowdown: float | None = None


class LinkSpec(_Strict):
    """A link tier (intra-node or inter-node) as seen by ONE GPU."""

    name: str  # "NVLink4", "NDR InfiniBand 8x400Gb/s", "100GbE"
    bandwidth_GBps_per_gpu: float  # unidirectional 1e9 B/s available per GPU on this tier
    latency_us: float  # per collective step (alpha)
    efficiency: float  # achievable fraction of bandwidth_GBps_per_gpu, 0.01 <= e <= 1 (hardware_checks)
    # NCCL algorithms this tier offers (core/nccl_model.py): "ring", "tree", "nvls" (NVLink
    # SHARP, NVSwitch gen 3+), "collnet" (IB SHARP); None = ring and tree
    algorithms: list[str] | None = None
    # full-mesh links (AMD xGMI): GB/s per direction of ONE GPU-to-GPU link; a group of k GPUs
    # inside the node gets (k - 1) links, not the whole-node figure
    mesh_link_GBps: float | None = None
    # network adapters per node on the inter-node tier (None = one per GPU); NICs shared by
    # several GPUs carry fewer NCCL channels each (core/nccl_model.py pipeline fill)
    nics_per_node: int | None = None

    @property
    def effective_GBps_per_gpu(self) -> float:
        """Achievable unidirectional GB/s per GPU: bandwidth x efficiency."""
        return self.bandwidth_GBps_per_gpu * self.efficiency


class OverheadSpec(_Strict):
    """Framework allowances per GPU, reported as their own memory category."""

    cuda_context_bytes: int  # CUDA/HIP context + library workspaces
    nccl_bytes: int  # NCCL buffers per communicator (core/allocator.py counts the communicators)
    fragmentation_fraction: float  # of the churned live bytes (caching-allocator split slack; core/allocator.py)


class HardwareProfile(_Strict):
    """A node type and its network, with a source for every number (see module doc)."""

    name: str
    description: str
    gpu: GPUSpec
    node: NodeSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    overhead: OverheadSpec
    sources: dict[str, str]  # dotted field path -> where the number comes from
    path: str | None = Field(default=None, exclude=True)  # file it was loaded from; not written

    @property
    def inter_node_GBps_per_node(self) -> float:
        """Inter-node bandwidth of the whole node, GB/s one direction: per-GPU x GPUs per node.

        A ring collective spanning nodes with every GPU of each node in it is bounded by this
        (NCCL spreads its channels over all the node's NICs), not by the per-GPU share."""
        return self.inter_node.bandwidth_GBps_per_gpu * self.node.gpus_per_node

    @property
    def inter_node_Gbps_per_node(self) -> float:
        """Inter-node bandwidth per node in Gb/s (1e9 bit/s): per-GPU GB/s x 8 bit x GPUs."""
        return self.inter_node.bandwidth_GBps_per_gpu * 8 * self.node.gpus_per_node
