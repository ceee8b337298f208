"""Checking a hardware profile: every numeric field has a source (its own or a parent's), every
source names a real field, and every number lies within sanity bounds that catch unit mistakes
(Gb/s written for GB/s, per-node written for per-GPU, TB/s for GB/s) with a hint.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from zeroplan._util import GB, GiB, InputError
from zeroplan.specs.hardware_schema import FLOP_DTYPES, TiB, HardwareProfile

__all__ = ["validate_profile", "numeric_field_paths", "source_for"]

_UNIT_HINT = (
    "Gb/s vs GB/s or per-node vs per-GPU? (bandwidths are GB/s = 1e9 bytes/s per GPU, "
    "unidirectional: a 400 Gb/s NIC is 50 GB/s, and one NIC shared by 8 GPUs gives each 1/8)"
)

# path -> (low, high, readable range, hint, allow_zero)
_BOUNDS: dict[str, tuple[float, float, str, str, bool]] = {
    "gpu.memory_bytes": (GiB, TiB, "1 GiB to 1 TiB, in bytes", "bytes, not GB or GiB?", False),
    "gpu.peak_flops": (1e12, 1e16, "1e12 to 1e16 FLOP/s", "FLOP/s, not TFLOP/s? 989 TFLOP/s = 989e12", False),
    "gpu.hbm_bandwidth_GBps": (50, 20000, "50 to 20000 GB/s", "GB/s, not TB/s? 3.35 TB/s = 3350 GB/s", False),
    "node.gpus_per_node": (1, 72, "1 to 72 GPUs", "", False),
    "node.host_ram_bytes": (4 * GiB, 64 * TiB, "4 GiB to 64 TiB, in bytes", "bytes, not KiB, GB or GiB?", False),
    "node.pcie_bandwidth_GBps_per_gpu": (1, 1000, "1 to 1000 GB/s per GPU",
                                         "GB/s unidirectional per GPU; PCIe 4.0 x16 = ~32 GB/s", False),
    "node.nvme_bandwidth_GBps": (0.1, 1000, "0.1 to 1000 GB/s per node, or 0 for no NVMe", "GB/s, not MB/s?", True),
    "node.nvme_capacity_bytes": (GB, 10**16, "1 GB to 10 PB per node in bytes, or 0 for no NVMe",
                                 "bytes, not GB or TB?", True),
    "node.cpu_cores": (1, 10000, "1 to 10000 physical cores", "", False),
    # One AVX-512 core alone streams DeepSpeedCPUAdam at about 1.6e9 parameters/s (44 GB/s of fp32
    # traffic; bench cpu-adam, examples/validation/cpu-adam/); 1e10 rejects a per-node figure.
    "node.cpu_adam_params_per_s_per_core": (1e5, 1e10, "1e5 to 1e10 parameters/s per core",
                                            "parameters per second per core, not per node?", False),
    "intra_node.mesh_link_GBps": (0.1, 1000, "0.1 to 1000 GB/s per link", _UNIT_HINT, False),
    "inter_node.nics_per_node": (1, 64, "1 to 64 network adapters per node", "", False),
    "intra_node.bandwidth_GBps_per_gpu": (0.01, 2000, "0.01 to 2000 GB/s per GPU", _UNIT_HINT, False),
    # The fastest NICs today are 800 Gb/s = 100 GB/s per GPU; 200 leaves headroom and
    # rejects a per-node or Gb/s figure written as per-GPU GB/s (400, 1600, 3200).
    "inter_node.bandwidth_GBps_per_gpu": (0.01, 200, "0.01 to 200 GB/s per GPU", _UNIT_HINT, False),
    # Real fabrics are 1-100 us per step; the 10 ms ceiling leaves room for profiles calibrated
    # with gloo on busy CPUs (bench collectives) and still rejects nanoseconds written as us.
    "intra_node.latency_us": (0.1, 10000, "0.1 to 10000 microseconds", "microseconds, not seconds, ms or ns?", False),
    "inter_node.latency_us": (0.1, 10000, "0.1 to 10000 microseconds", "microseconds, not seconds, ms or ns?", False),
    "overhead.cuda_context_bytes": (0, 16 * GiB, "0 to 16 GiB, in bytes", "bytes, not MiB or GiB?", True),
    "overhead.nccl_bytes": (0, 16 * GiB, "0 to 16 GiB, in bytes", "bytes, not MiB or GiB?", True),
}
_NCCL_ALGORITHMS = ("ring", "tree", "nvls", "collnet")
# path -> (lowest, highest, expected). An efficiency is at least 0.01: below, a link moves under 1% of its
# rate (a typo: 0.008 for 0.8), and 1e-308 made every collective time inf, which JSON cannot carry.
# Profiles that bench collectives calibrates write 1.0 (their bandwidth is the measured bus bandwidth).
_FRACTIONS = {
    "intra_node.efficiency": (0.01, 1.0, "a fraction in [0.01, 1], e.g. 0.8 for 80%"),
    "inter_node.efficiency": (0.01, 1.0, "a fraction in [0.01, 1], e.g. 0.8 for 80%"),
    "overhead.fragmentation_fraction": (0.0, 0.5, "a fraction in [0, 0.5] of the churned bytes, e.g. 0.36 for 36%"),
    "node.overlap_slowdown": (0.0, 1.0, "a fraction in [0, 1] of the hidden communication time (0 = hidden for "
                                        "free, 1 = nothing hides), e.g. 0.15"),
}


def numeric_field_paths(profile: HardwareProfile) -> list[str]:
    """Dotted paths of every numeric field that is set (each needs a source)."""
    out: list[str] = []
    data = profile.model_dump(exclude={"sources"})

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            out.append(prefix)

    walk("", data)
    return out


def _all_field_paths(profile: HardwareProfile) -> set[str]:
    """Every dotted path a source may name: fields, sections and peak_flops keys."""
    paths: set[str] = set()
    data = profile.model_dump(exclude={"sources"})

    def walk(prefix: str, obj: Any) -> None:
        if prefix:
            paths.add(prefix)
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)

    walk("", data)
    return paths


def source_for(profile: HardwareProfile, path: str) -> str | None:
    """The source of a dotted field path: its own entry, else the nearest parent's."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in profile.sources and profile.sources[key].strip():
            return profile.sources[key]
    return None


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else (f"{v:g}" if isinstance(v, float) else str(v))


def _numeric_values(profile: HardwareProfile, w: str) -> dict[str, float]:
    """Every bounded number of the profile by dotted path (unset optional fields left out);
    an unknown NCCL algorithm is refused on the way."""
    values: dict[str, float] = {
        "gpu.memory_bytes": profile.gpu.memory_bytes,
        "gpu.hbm_bandwidth_GBps": profile.gpu.hbm_bandwidth_GBps,
        "node.gpus_per_node": profile.node.gpus_per_node,
        "node.host_ram_bytes": profile.node.host_ram_bytes,
        "node.pcie_bandwidth_GBps_per_gpu": profile.node.pcie_bandwidth_GBps_per_gpu,
        "node.nvme_bandwidth_GBps": profile.node.nvme_bandwidth_GBps,
        "node.nvme_capacity_bytes": profile.node.nvme_capacity_bytes,
        "intra_node.bandwidth_GBps_per_gpu": profile.intra_node.bandwidth_GBps_per_gpu,
        "inter_node.bandwidth_GBps_per_gpu": profile.inter_node.bandwidth_GBps_per_gpu,
        "intra_node.latency_us": profile.intra_node.latency_us,
        "inter_node.latency_us": profile.inter_node.latency_us,
        "overhead.cuda_context_bytes": profile.overhead.cuda_context_bytes,
        "overhead.nccl_bytes": profile.overhead.nccl_bytes,
        "intra_node.efficiency": profile.intra_node.efficiency,
        "inter_node.efficiency": profile.inter_node.efficiency,
        "overhead.fragmentation_fraction": profile.overhead.fragmentation_fraction,
    }
    if profile.node.cpu_cores is not None:
        values["node.cpu_cores"] = profile.node.cpu_cores
    if profile.node.cpu_adam_params_per_s_per_core is not None:
        values["node.cpu_adam_params_per_s_per_core"] = profile.node.cpu_adam_params_per_s_per_core
    if profile.node.overlap_slowdown is not None:
        values["node.overlap_slowdown"] = profile.node.overlap_slowdown
    if profile.intra_node.mesh_link_GBps is not None:
        values["intra_node.mesh_link_GBps"] = profile.intra_node.mesh_link_GBps
    if profile.inter_node.nics_per_node is not None:
        values["inter_node.nics_per_node"] = profile.inter_node.nics_per_node
    for tier in ("intra_node", "inter_node"):
        for algo in getattr(profile, tier).algorithms or []:
            if algo not in _NCCL_ALGORITHMS:
                raise InputError(f"{w}: key {tier}.algorithms = {algo!r} is not an NCCL algorithm; expected some of "
                                 + ", ".join(_NCCL_ALGORITHMS))
    for k, v in profile.gpu.peak_flops.items():
        values[f"gpu.peak_flops.{k}"] = v
    return values


def _check_sources(profile: HardwareProfile, w: str) -> None:
    """Every numeric field has a source; every source names a real field."""
    known = _all_field_paths(profile)
    for key, text in profile.sources.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InputError(
                f"{w}: key sources.{key!r} names no field of the profile{hint}; "
                "expected a dotted field path such as 'gpu.memory_bytes'"
            )
        if not str(text).strip():
            raise InputError(f"{w}: key sources.{key!r} is empty; expected where the number comes from")
    for path in numeric_field_paths(profile):
        if source_for(profile, path) is None:
            raise InputError(
                f"{w}: key {path} has no source; expected an entry \"{path}\" = \"<datasheet URL and "
                "title, a measurement, or a stated rule>\" in [sources]"
            )


def validate_profile(profile: HardwareProfile, where: str | None = None) -> HardwareProfile:
    """Check sources and sanity bounds; raise InputError naming file, key, value, expected."""
    w = where or profile.path or f"hardware profile {profile.name!r}"
    if not profile.name.strip():
        raise InputError(f"{w}: key name is empty; expected a short profile name such as 'dgx-h100'")
    flops = profile.gpu.peak_flops
    if not flops:
        raise InputError(f"{w}: key gpu.peak_flops is empty; expected at least one of {', '.join(FLOP_DTYPES)}")
    for k in flops:
        if k not in FLOP_DTYPES:
            raise InputError(
                f"{w}: key gpu.peak_flops.{k} is not a known dtype; expected keys among {', '.join(FLOP_DTYPES)}"
            )
    values = _numeric_values(profile, w)
    for key, v in values.items():
        if not math.isfinite(float(v)):
            raise InputError(f"{w}: key {key} = {_fmt(v)} is not a finite number")
        bound_key = "gpu.peak_flops" if key.startswith("gpu.peak_flops.") else key
        if bound_key in _BOUNDS:
            lo, hi, span, hint, allow_zero = _BOUNDS[bound_key]
            if allow_zero and v == 0:
                continue
            if not (lo <= v <= hi):
                msg = f"{w}: key {key} = {_fmt(v)} is outside the plausible range {span}"
                raise InputError(msg + (f"; {hint}" if hint else ""))
        elif key in _FRACTIONS:
            low, high, expected = _FRACTIONS[key]
            if not low <= v <= high:
                raise InputError(f"{w}: key {key} = {_fmt(v)} is out of range; expected {expected}")
    # NVMe: both zero or both set.
    if (profile.node.nvme_bandwidth_GBps == 0) != (profile.node.nvme_capacity_bytes == 0):
        raise InputError(
            f"{w}: keys node.nvme_bandwidth_GBps = {_fmt(profile.node.nvme_bandwidth_GBps)} and "
            f"node.nvme_capacity_bytes = {profile.node.nvme_capacity_bytes} disagree; expected both 0 "
            "(no local NVMe) or both positive"
        )
    _check_sources(profile, w)
    return profile
