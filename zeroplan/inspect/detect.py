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
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from zeroplan._util import GiB, InputError

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

UNMEASURED_SOURCE = "unmeasured: run `zeroplan bench collectives --save-profile` across nodes to fill"


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


# --------------------------------------------------------------------------- NVML helpers


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
        from zeroplan.specs.hardware import list_profiles

        profiles = list_profiles()
    ranked = match_profile(report, profiles)
    report.candidates = ranked[:5]
    report.match = ranked[0] if ranked else None
    return report


# --------------------------------------------------------------------------- matching

_NOT_MODEL = re.compile(r"^(\d+gb|sxm\d*|pcie\d*|hbm\d*e?|nvl\d*|gen\d+|x\d+)$")


def _model_tokens(name: str) -> list[str]:
    """GPU model tokens of a name: "NVIDIA H100 80GB HBM3" → ["h100"]; "RTX 4090" → ["4090"]."""
    toks = re.findall(r"[a-z]*\d+[a-z]*", name.lower())
    return [t for t in toks if not _NOT_MODEL.match(t)]


def _has_nvlink(profile: Any) -> bool:
    n = profile.intra_node.name.lower()
    return "nvlink" in n and "no nvlink" not in n


def score_profile(report: NodeReport, profile: Any) -> tuple[float, str]:
    """Score (0..100) and reason for how well ``profile`` describes the detected node.

    GPU model token 50 (25 if it only appears as a secondary token), memory 20 (linear to 0 at
    15% off), GPU count vs gpus_per_node 15 (× min/max), NVLink presence 10, host RAM 5
    (linear to 0 at 50% off).
    """
    gpu = report.gpus[0]
    parts: list[str] = []
    score = 0.0
    mine = _model_tokens(gpu.name)
    theirs = _model_tokens(profile.gpu.name)
    if mine and theirs and mine[0] == theirs[0]:
        score += 50
        parts.append(f"GPU model {mine[0].upper()} = {profile.gpu.name!r}")
    elif mine and mine[0] in theirs:
        score += 25
        parts.append(f"GPU model {mine[0].upper()} appears in {profile.gpu.name!r}")
    else:
        parts.append(f"GPU {gpu.name!r} ≠ {profile.gpu.name!r}")
    if gpu.memory_bytes:
        rel = abs(gpu.memory_bytes - profile.gpu.memory_bytes) / profile.gpu.memory_bytes
        score += 20 * max(0.0, 1 - rel / 0.15)
        parts.append(f"memory {gpu.memory_bytes / GiB:.2f} GiB vs {profile.gpu.memory_bytes / GiB:.2f} GiB "
                     f"({rel:.1%} off)")
    n, m = report.gpu_count, profile.node.gpus_per_node
    score += 15 * min(n, m) / max(n, m)
    parts.append(f"{n} GPU(s) vs {m} per node")
    if gpu.nvlink_total is not None:
        if report.nvlink == _has_nvlink(profile):
            score += 10
        links = f"{gpu.nvlink_active}/{gpu.nvlink_total} NVLinks active" if report.nvlink else "no NVLink"
        parts.append(f"{links} vs intra-node {profile.intra_node.name!r}")
    if report.host_ram_bytes:
        rel = abs(report.host_ram_bytes - profile.node.host_ram_bytes) / profile.node.host_ram_bytes
        score += 5 * max(0.0, 1 - rel / 0.5)
        parts.append(f"host RAM {report.host_ram_bytes / GiB:,.0f} GiB vs {profile.node.host_ram_bytes / GiB:,.0f} GiB")
    return round(score, 2), "; ".join(parts)


def match_profile(report: NodeReport, profiles: list[Any]) -> list[ProfileMatch]:
    """Every profile scored against the node, best first (ties by name); ties listed."""
    if not report.gpus:
        return []
    by_name = {p.name: p for p in profiles}

    def tie_break(name: str) -> tuple[float, int, str]:
        # Same score: closest physical core count (when both are known), then the vendor's
        # reference systems (DGX/HGX) before cloud instances, then the name.
        p = by_name[name]
        cores = abs(p.node.cpu_cores - report.cpu_cores) if p.node.cpu_cores and report.cpu_cores else 0
        return (cores, 0 if name.startswith(("dgx-", "hgx-")) else 1, name)

    scored = sorted(
        ((*score_profile(report, p), p.name) for p in profiles), key=lambda t: (-t[0], *tie_break(t[2]))
    )
    out: list[ProfileMatch] = []
    for s, reason, name in scored:
        ties = [n for s2, _, n in scored if s2 == s and n != name]
        if ties and not out:
            reason += ("; equally good: " + ", ".join(ties)
                       + " (they differ in what one node cannot show, e.g. the inter-node fabric)")
        out.append(ProfileMatch(name=name, score=s, reason=reason, ties=ties))
    return out


# --------------------------------------------------------------------------- save-profile


def _pcie_GBps(gen: int | None, width: int | None) -> float | None:
    """Theoretical unidirectional PCIe bandwidth, GB/s: GT/s × lanes × encoding / 8 (PCI-SIG)."""
    rates = {1: (2.5, 8 / 10), 2: (5.0, 8 / 10), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130),
             5: (32.0, 128 / 130), 6: (64.0, 242 / 256)}
    if not gen or not width or gen not in rates:
        return None
    gt, enc = rates[gen]
    return gt * width * enc / 8


def profile_from_report(report: NodeReport, base: Any, name: str | None = None) -> Any:
    """A HardwareProfile for this node: ``base`` (the matched profile) with detected values
    replacing its own, and inter-node link fields marked UNMEASURED in ``sources``."""
    from zeroplan.specs.hardware import HardwareProfile

    data = base.model_dump(exclude={"path"})
    sources: dict[str, str] = dict(data["sources"])
    gpu = report.gpus[0]
    where = f"detected by `zeroplan detect` on {report.hostname}"
    data["name"] = name or _profile_name(report.hostname)
    data["gpu"]["name"] = gpu.name
    if gpu.memory_bytes:
        data["gpu"]["memory_bytes"] = gpu.memory_bytes
        sources["gpu.memory_bytes"] = f"{where} (NVML nvmlDeviceGetMemoryInfo total, GPU 0)"
    for k in list(sources):
        if k.startswith("gpu.") and k != "gpu.memory_bytes":
            sources[k] = f"from bundled profile {base.name} (same GPU model; not measured here): {sources[k]}"
    data["node"]["gpus_per_node"] = report.gpu_count
    sources["node.gpus_per_node"] = f"{where} (NVML nvmlDeviceGetCount)"
    if report.host_ram_bytes:
        data["node"]["host_ram_bytes"] = report.host_ram_bytes
        sources["node.host_ram_bytes"] = f"{where} (/proc/meminfo MemTotal)"
    if report.cpu_cores:
        data["node"]["cpu_cores"] = report.cpu_cores
        sources["node.cpu_cores"] = f"{where} (/proc/cpuinfo physical cores)"
    link = _pcie_GBps(gpu.pcie_gen_max, gpu.pcie_width_max)
    if link is not None and "node.pcie_bandwidth_GBps_per_gpu" in sources:
        sources["node.pcie_bandwidth_GBps_per_gpu"] = (
            f"from bundled profile {base.name}: {sources['node.pcie_bandwidth_GBps_per_gpu']}; this node's GPU 0 "
            f"links at PCIe Gen{gpu.pcie_gen_max} x{gpu.pcie_width_max} = {link:.1f} GB/s theoretical per direction"
        )
    intra_note = f"from bundled profile {base.name}, not measured on this node"
    if report.nvlink != _has_nvlink(base):
        seen = "NVLink active" if report.nvlink else "no active NVLink"
        intra_note = f"UNVERIFIED: profile {base.name} assumes {base.intra_node.name!r} but this node has {seen}"
    for k in ("bandwidth_GBps_per_gpu", "latency_us", "efficiency"):
        prev = sources.get(f"intra_node.{k}") or sources.get("intra_node", "")
        sources[f"intra_node.{k}"] = (
            f"{intra_note}; calibrate with `zeroplan bench collectives --save-profile`" + (f" (was: {prev})" if prev else "")
        )
        sources[f"inter_node.{k}"] = f"{UNMEASURED_SOURCE} (placeholder from bundled profile {base.name})"
    for k in list(sources):
        if k == "inter_node" or (k.startswith("inter_node.") and k.split(".", 1)[1] not in
                                 ("bandwidth_GBps_per_gpu", "latency_us", "efficiency")):
            sources[k] = f"{UNMEASURED_SOURCE} (placeholder from bundled profile {base.name})"
    data["inter_node"]["name"] = f"UNMEASURED (assumed as in {base.name}): {base.inter_node.name}"
    data["sources"] = sources
    driver = f"driver {report.driver_version}, CUDA {report.cuda_driver_version}" if report.driver_version else ""
    data["description"] = (
        f"Detected on {report.hostname} by zeroplan detect ({driver}): {report.gpu_count}x {gpu.name}"
        + (f", NVLink {gpu.nvlink_active}/{gpu.nvlink_total} links per GPU" if report.nvlink else ", no NVLink")
        + f". Started from bundled profile {base.name}; inter-node link values are UNMEASURED placeholders."
    )
    return HardwareProfile.model_validate(data)


def _profile_name(hostname: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", hostname.lower()).strip("-") or "this-node"
    return f"{base}-detected"
