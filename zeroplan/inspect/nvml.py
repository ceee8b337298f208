"""NVML queries, one GPU at a time: name, memory, PCI bus id, NVLink links and peers, PCIe link,
NUMA node and CPU affinity (``_gpu_info``), with pynvml's errors read by class or code.

``nvml`` is any module-like object with pynvml's API, so tests pass a fake. A query the GPU or
driver does not support leaves its field ``None``.

Lazy import: ``pynvml`` (the nvidia-ml-py package) is imported only when ``detect`` runs without a
given ``nvml``: it is an optional dependency, and planning never needs it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zeroplan.inspect.node_report import GpuInfo, NoNvidiaGPU

__all__: list[str] = []  # internal to detect


def _load_pynvml() -> Any:
    try:
        import pynvml  # the nvidia-ml-py package
    except ImportError as exc:
        raise NoNvidiaGPU(
            f"no NVIDIA driver found (pynvml not importable: {exc}); detect needs a machine with NVIDIA GPUs "
            "and the nvidia-ml-py package"
        ) from None
    return pynvml


def _err_is(nvml: Any, exc: BaseException, *names: str) -> bool:
    """Is ``exc`` one of NVML's errors ``NVMLError_<name>`` (by class, or by error code)?"""
    for name in names:
        cls = getattr(nvml, f"NVMLError_{name}", None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
        code = getattr(nvml, "NVML_ERROR_" + re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper(), None)
        if code is not None and getattr(exc, "value", None) == code:
            return True
    return False


def _nvml_error_type(nvml: Any) -> type[BaseException]:
    err = getattr(nvml, "NVMLError", None)
    return err if isinstance(err, type) and issubclass(err, BaseException) else Exception


def _text(v: Any) -> str:
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace").rstrip("\x00")
    return str(v)


def _optional(nvml: Any, fn_name: str, *args: Any) -> Any:
    """Call ``nvml.fn_name(*args)``; None when unsupported, missing or failing (tolerated)."""
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except _nvml_error_type(nvml):
        return None


def _cpu_list(masks: Any) -> str | None:
    """NVML CPU affinity (array of 64-bit masks, CPU 0 = bit 0 of word 0) → "0-3,8-11"."""
    cpus: list[int] = []
    for word_index, word in enumerate(list(masks)):
        word = int(word)
        for bit in range(64):
            if word >> bit & 1:
                cpus.append(word_index * 64 + bit)
    if not cpus:
        return None
    ranges: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [None]:  # type: ignore[list-item]
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev > start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def _sysfs_numa(bus_id: str | None, sysfs_root: str | None) -> int | None:
    """NUMA node of a PCI device from sysfs (NVML bus id "00000000:18:00.0" → "0000:18:00.0")."""
    if not bus_id or not sysfs_root:
        return None
    short = bus_id.lower()[-12:]
    try:
        v = int((Path(sysfs_root) / "bus" / "pci" / "devices" / short / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return v if v >= 0 else None


def _gpu_info(nvml: Any, index: int, cpu_count: int | None, sysfs_root: str | None) -> GpuInfo:
    nvml_error = _nvml_error_type(nvml)
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _optional(nvml, "nvmlDeviceGetName", handle)
    mem = _optional(nvml, "nvmlDeviceGetMemoryInfo", handle)
    pci = _optional(nvml, "nvmlDeviceGetPciInfo", handle)
    bus_id = _text(pci.busId) if pci is not None and getattr(pci, "busId", None) else None

    # NVLink: probe every link index; NotSupported / InvalidArgument ends the GPU's links.
    active = 0
    total: int | None = 0
    remotes: list[str] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml_error as exc:
            if _err_is(nvml, exc, "NotSupported", "InvalidArgument", "FunctionNotFound"):
                break
            if link == 0:
                total = None  # e.g. no permission: unknown rather than "no NVLink"
                break
            continue
        except AttributeError:
            total = None
            break
        total = (total or 0) + 1
        if int(state) == int(getattr(nvml, "NVML_FEATURE_ENABLED", 1)):
            active += 1
            remote = _optional(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            rid = _text(remote.busId) if remote is not None and getattr(remote, "busId", None) else None
            if rid and rid not in remotes:
                remotes.append(rid)

    numa = _optional(nvml, "nvmlDeviceGetNumaNodeId", handle)
    if numa is None or int(numa) < 0:
        numa = _sysfs_numa(bus_id, sysfs_root)
    affinity = None
    if cpu_count:
        masks = _optional(nvml, "nvmlDeviceGetCpuAffinity", handle, max(1, -(-cpu_count // 64)))
        affinity = _cpu_list(masks) if masks is not None else None

    def _int(v: Any) -> int | None:
        return int(v) if v is not None else None

    return GpuInfo(
        index=index,
        name=_text(name) if name is not None else "unknown NVIDIA GPU",
        memory_bytes=_int(getattr(mem, "total", None)) if mem is not None else None,
        pci_bus_id=bus_id,
        nvlink_active=active if total is not None else None,
        nvlink_total=total,
        nvlink_remote_bus_ids=remotes,
        pcie_gen_current=_int(_optional(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)),
        pcie_gen_max=_int(_optional(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle)),
        pcie_width_current=_int(_optional(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)),
        pcie_width_max=_int(_optional(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle)),
        numa_node=_int(numa),
        cpu_affinity=affinity,
    )


def _cuda_version(v: Any) -> str | None:
    """NVML's CUDA driver version integer (12040) → "12.4"."""
    if v is None:
        return None
    v = int(v)
    return f"{v // 1000}.{(v % 1000) // 10}"

