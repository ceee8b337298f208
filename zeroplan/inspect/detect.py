"""What this node has: NVIDIA GPUs through NVML (pynvml), host RAM and CPUs, and the closest
bundled hardware profile.

``detect_node(nvml=None) -> NodeReport``. ``nvml`` is any module-like object with pynvml's API
(the default imports the real ``pynvml`` from the ``nvidia-ml-py`` package), so tests pass a
fake. NVML calls used: nvmlInit/nvmlShutdown, nvmlSystemGetDriverVersion,
nvmlSystemGetCudaDriverVersion_v2, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
nvmlDeviceGetName, nvmlDeviceGetMemoryInfo (``.total``, bytes), nvmlDeviceGetPciInfo
(``.busId``), nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkRemotePciInfo for links
0..NVML_NVLINK_MAX_LINKS-1, nvmlDeviceGetCurr/MaxPcieLinkGeneration/Width,
nvmlDeviceGetNumaNodeId and nvmlDeviceGetCpuAffinity.

A query the GPU or driver does not support (NVMLError_NotSupported, or a function missing from
an older pynvml) leaves its field ``None``; NVLink queries that are not supported mean the GPU
has no NVLink (0 links). Without a driver, ``nvmlInit`` raises NVMLError_LibraryNotFound /
DriverNotLoaded and ``detect_node`` raises :class:`NoNvidiaGPU` (an InputError: one line, exit 2).

Units: ``memory_bytes`` / ``host_ram_bytes`` are bytes (NVML's total framebuffer, the kernel's
MemTotal × 1024). PCIe generation/width are the link's current and maximum; the current
generation drops at idle on most GPUs (power saving), so read the maximum for capability.

Where the parts live (inspect/): ``node_report`` (the models), ``nvml`` (the per-GPU NVML
queries), ``node_profile`` (matching to a bundled profile, and the profile ``--save-profile``
writes); this module reads the host and assembles the report.

Lazy imports: none here; ``inspect/nvml.py`` imports ``pynvml`` only when it runs.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from zeroplan.inspect.node_profile import UNMEASURED_SOURCE, match_profile, profile_from_report, score_profile
from zeroplan.inspect.node_report import GpuInfo, NodeReport, NoNvidiaGPU, ProfileMatch
from zeroplan.inspect.nvml import _cpu_list as _cpu_list  # re-exported: tests/test_detect.py
from zeroplan.inspect.nvml import _cuda_version, _gpu_info, _load_pynvml, _nvml_error_type, _optional, _text
from zeroplan.specs.hardware import list_profiles

__all__ = [
    "GpuInfo",
    "ProfileMatch",
    "NodeReport",
    "NoNvidiaGPU",
    "detect_node",
    "match_profile",
    "score_profile",
    "profile_from_report",
    "UNMEASURED_SOURCE",
]

MEMINFO_PATH = "/proc/meminfo"
CPUINFO_PATH = "/proc/cpuinfo"
SYSFS_ROOT = "/sys"


# --------------------------------------------------------------------------- host


def _host_ram_bytes(path: str) -> int | None:
    """MemTotal from /proc/meminfo (the kernel writes kB meaning KiB) in bytes."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def _physical_cores(path: str) -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; None if not listed."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    cores: set[tuple[str, str]] = set()
    for block in text.split("\n\n"):
        phys = re.search(r"^physical id\s*:\s*(\d+)", block, re.M)
        core = re.search(r"^core id\s*:\s*(\d+)", block, re.M)
        if phys and core:
            cores.add((phys.group(1), core.group(1)))
    return len(cores) or None


# --------------------------------------------------------------------------- detect


def detect_node(
    nvml: Any = None,
    *,
    meminfo_path: str | None = None,
    cpuinfo_path: str | None = None,
    sysfs_root: str | None = None,
    profiles: list[Any] | None = None,
    hostname: str | None = None,
) -> NodeReport:
    """Inspect this node through NVML and match it to a bundled hardware profile.

    Raises NoNvidiaGPU (an InputError) when there is no driver, no library or no GPU.
    ``profiles`` defaults to zeroplan.specs.hardware.list_profiles().
    """
    nvml = nvml if nvml is not None else _load_pynvml()
    nvml_error = _nvml_error_type(nvml)
    try:
        nvml.nvmlInit()
    except nvml_error as exc:
        raise NoNvidiaGPU(
            f"no NVIDIA driver found (NVML: {exc}); detect needs a machine with NVIDIA GPUs"
        ) from None
    try:
        driver = _optional(nvml, "nvmlSystemGetDriverVersion")
        cuda = _optional(nvml, "nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = _optional(nvml, "nvmlSystemGetCudaDriverVersion")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml_error as exc:
            raise NoNvidiaGPU(f"no NVIDIA GPU found (NVML: {exc}); detect needs a machine with NVIDIA GPUs") from None
        if count == 0:
            raise NoNvidiaGPU("no NVIDIA GPU found (NVML reports 0 devices); detect needs a machine with NVIDIA GPUs")
        cpu_count = os.cpu_count()
        sysfs = SYSFS_ROOT if sysfs_root is None else sysfs_root
        gpus = []
        for i in range(count):
            try:
                gpus.append(_gpu_info(nvml, i, cpu_count, sysfs))
            except nvml_error as exc:  # e.g. a GPU that fell off the bus: report, keep going
                gpus.append(GpuInfo(index=i, name=f"unreadable GPU (NVML: {exc})"))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down must never mask the result
            pass

    report = NodeReport(
        hostname=hostname or socket.gethostname(),
        driver_version=_text(driver) if driver is not None else None,
        cuda_driver_version=_cuda_version(cuda),
        gpu_count=count,
        gpus=gpus,
        nvlink=any((g.nvlink_active or 0) > 0 for g in gpus),
        host_ram_bytes=_host_ram_bytes(meminfo_path or MEMINFO_PATH),
        cpu_count=cpu_count,
        cpu_cores=_physical_cores(cpuinfo_path or CPUINFO_PATH),
    )
    names = {g.name for g in gpus}
    if len(names) > 1:
        report.notes.append(f"mixed GPU models on this node: {', '.join(sorted(names))}; matched on GPU 0")
    if any(g.pcie_gen_current and g.pcie_gen_max and g.pcie_gen_current < g.pcie_gen_max for g in gpus):
        report.notes.append("some GPUs run their PCIe link below its maximum generation now (normal at idle)")
    if profiles is None:
        profiles = list_profiles()
    ranked = match_profile(report, profiles)
    report.candidates = ranked[:5]
    report.match = ranked[0] if ranked else None
    return report

