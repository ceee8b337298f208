"""What ``zeroplan detect`` reports about a node: its GPUs (``GpuInfo``), the closest bundled
profile (``ProfileMatch``) and the whole ``NodeReport``; ``NoNvidiaGPU`` when there is nothing to
inspect. Units: bytes; PCIe generation and width as NVML reports them.

Imports: module level only.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from zeroplan._util import InputError

__all__ = ["NoNvidiaGPU", "GpuInfo", "ProfileMatch", "NodeReport"]


class NoNvidiaGPU(InputError):
    """No NVIDIA driver / library / GPU on this machine."""


class GpuInfo(BaseModel):
    index: int
    name: str
    memory_bytes: int | None = None  # NVML total framebuffer, bytes
    pci_bus_id: str | None = None  # e.g. "00000000:18:00.0"
    nvlink_active: int | None = None  # links up (None: could not be read)
    nvlink_total: int | None = None  # links the GPU has (0: no NVLink)
    nvlink_remote_bus_ids: list[str] = Field(default_factory=list)  # distinct peers (GPUs or NVSwitches)
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None  # CPU list, e.g. "0-55,112-167"


class ProfileMatch(BaseModel):
    name: str
    score: float  # 0..100: GPU model 50, memory 20, GPU count 15, NVLink presence 10, host RAM 5
    reason: str
    ties: list[str] = Field(default_factory=list)  # other profiles with the same score


class NodeReport(BaseModel):
    hostname: str
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.4" (from NVML's 12040)
    gpu_count: int
    gpus: list[GpuInfo]
    nvlink: bool  # any active NVLink on any GPU
    host_ram_bytes: int | None = None
    cpu_count: int | None = None  # logical CPUs (os.cpu_count)
    cpu_cores: int | None = None  # physical cores (from /proc/cpuinfo), when readable
    match: ProfileMatch | None = None
    candidates: list[ProfileMatch] = Field(default_factory=list)  # best first, up to 5
    notes: list[str] = Field(default_factory=list)

