"""The detected node against the bundled hardware profiles: ``score_profile`` / ``match_profile``
(which profile describes this node best, and why) and ``profile_from_report`` (the profile that
``zeroplan detect --save-profile`` writes: the matched profile with the detected values in it and
the inter-node link marked UNMEASURED).

Imports: module level only.
"""

from __future__ import annotations

import re
from typing import Any

from zeroplan._util import GiB
from zeroplan.inspect.node_report import NodeReport, ProfileMatch
from zeroplan.specs.hardware import HardwareProfile

__all__ = ["UNMEASURED_SOURCE", "score_profile", "match_profile", "profile_from_report"]

UNMEASURED_SOURCE = "unmeasured: run `zeroplan bench collectives --save-profile` across nodes to fill"


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
