"""Hardware profiles: what a cluster node is made of, with the source of every number.

A profile is a TOML file (bundled ones live in ``hardware_profiles/``, shipped as the
package ``zeroplan.hardware_profiles``; users pass a path to their own). Units, fixed:

- bytes are integers (``memory_bytes``, ``host_ram_bytes``, ...); GiB = 2**30, GB = 10**9;
- bandwidths are ``GBps`` = 10**9 bytes/s, **unidirectional**, and link bandwidths are
  **per GPU** (a 400 Gb/s NIC = 50 GB/s; one NIC shared by 8 GPUs gives each 1/8 of it);
- ``latency_us`` is microseconds per collective step (the alpha of an alpha-beta model);
- ``efficiency`` is the achievable fraction of ``bandwidth_GBps_per_gpu`` (0 < e <= 1);
- ``peak_flops`` are dense (no sparsity) FLOP/s per dtype.

Every numeric field needs an entry in ``sources`` keyed by its dotted path
(``"inter_node.bandwidth_GBps_per_gpu"``); a source for a parent path
(``"gpu.peak_flops"``) covers the fields below it. Sanity bounds catch unit mistakes
(Gb/s written for GB/s, per-node written for per-GPU, TB/s for GB/s) with a hint.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zeroplan._util import GB, GiB, InputError, atomic_write_text, read_text_file

__all__ = [
    "FLOP_DTYPES",
    "GPUSpec",
    "NodeSpec",
    "LinkSpec",
    "OverheadSpec",
    "HardwareProfile",
    "load_profile",
    "list_profiles",
    "profile_names",
    "parse_profile_toml",
    "profile_to_toml",
    "save_profile",
    "validate_profile",
    "numeric_field_paths",
    "source_for",
]

FLOP_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TiB = 2**40


class _Strict(BaseModel):
    # strict: a TOML string "8" is not a number (no lax coercion); ints are accepted for floats
    model_config = ConfigDict(extra="forbid", strict=True)


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


class LinkSpec(_Strict):
    """A link tier (intra-node or inter-node) as seen by ONE GPU."""

    name: str  # "NVLink4", "NDR InfiniBand 8x400Gb/s", "100GbE"
    bandwidth_GBps_per_gpu: float  # unidirectional 1e9 B/s available per GPU on this tier
    latency_us: float  # per collective step (alpha)
    efficiency: float  # achievable fraction of bandwidth_GBps_per_gpu, 0 < e <= 1
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
    fragmentation_fraction: float  # of the live peak (caching-allocator slack)


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


# ----------------------------------------------------------------------------------------
# Validation: sources and sanity bounds
# ----------------------------------------------------------------------------------------

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
    "node.cpu_adam_params_per_s_per_core": (1e5, 1e9, "1e5 to 1e9 parameters/s per core",
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
_FRACTIONS = {
    "intra_node.efficiency": (False, "a fraction in (0, 1], e.g. 0.8 for 80%"),
    "inter_node.efficiency": (False, "a fraction in (0, 1], e.g. 0.8 for 80%"),
    "overhead.fragmentation_fraction": (True, "a fraction in [0, 0.5], e.g. 0.1 for 10% of the peak"),
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
    if profile.intra_node.mesh_link_GBps is not None:
        values["intra_node.mesh_link_GBps"] = profile.intra_node.mesh_link_GBps
    if profile.inter_node.nics_per_node is not None:
        values["inter_node.nics_per_node"] = profile.inter_node.nics_per_node
    for tier in ("intra_node", "inter_node"):
        for algo in getattr(profile, tier).algorithms or []:
            if algo not in _NCCL_ALGORITHMS:
                raise InputError(f"{w}: key {tier}.algorithms = {algo!r} is not an NCCL algorithm; expected some of "
                                 + ", ".join(_NCCL_ALGORITHMS))
    for k, v in flops.items():
        values[f"gpu.peak_flops.{k}"] = v
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
            zero_ok, expected = _FRACTIONS[key]
            ok = (0 <= v <= 0.5) if zero_ok else (0 < v <= 1)
            if not ok:
                raise InputError(f"{w}: key {key} = {_fmt(v)} is out of range; expected {expected}")
    # NVMe: both zero or both set.
    if (profile.node.nvme_bandwidth_GBps == 0) != (profile.node.nvme_capacity_bytes == 0):
        raise InputError(
            f"{w}: keys node.nvme_bandwidth_GBps = {_fmt(profile.node.nvme_bandwidth_GBps)} and "
            f"node.nvme_capacity_bytes = {profile.node.nvme_capacity_bytes} disagree; expected both 0 "
            "(no local NVMe) or both positive"
        )
    # Sources: every numeric field has one; every source names a real field.
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
    return profile


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _translate(exc: ValidationError, where: str, data: dict[str, Any]) -> InputError:
    """One line for the first pydantic error: file, key path, value, expected."""
    err = exc.errors(include_url=False)[0]
    key = _loc(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = err["loc"][:-1]
        model: type[BaseModel] = HardwareProfile
        for part in parent:
            field = model.model_fields.get(str(part))
            ann = getattr(field, "annotation", None) if field else None
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                model = ann
            else:
                break
        allowed = [n for n in model.model_fields if n != "path"]
        close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return InputError(f"{where}: unknown key {key}{hint}; expected one of {', '.join(allowed)}")
    if kind == "missing":
        return InputError(f"{where}: missing key {key}; see hardware_profiles/README.md for the schema")
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a table"
    expected = {
        "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer (no fraction)",
        "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
        "dict_type": "a table", "model_type": "a table", "bool_type": "true or false",
    }.get(kind, err.get("msg", "a valid value"))
    return InputError(f"{where}: key {key} = {shown} is invalid; expected {expected}")


def _reject_bools(d: dict[str, Any], where: str, prefix: str = "") -> None:
    """No profile field is a boolean; pydantic would silently read true as 1."""
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            _reject_bools(v, where, path)
        elif isinstance(v, bool):
            raise InputError(f"{where}: key {path} = {str(v).lower()} is invalid; expected a number or a string")


def parse_profile_toml(text: str, where: str = "<toml>") -> HardwareProfile:
    """Parse and validate TOML text; ``where`` names the file in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where}: malformed TOML: {exc}") from None
    except RecursionError:
        raise InputError(f"{where}: malformed TOML: nested too deeply") from None
    if "path" in data:
        raise InputError(f"{where}: unknown key path; the file location is not stored in the file")
    _reject_bools(data, where)
    try:
        profile = HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise _translate(exc, where, data) from None
    profile.path = where
    return validate_profile(profile, where)


def _bundled_dir():
    from importlib.resources import files

    return files("zeroplan.hardware_profiles")


@functools.lru_cache(maxsize=None)
def _bundled_index() -> dict[str, Any]:
    """Lowercase profile name (file stem) -> resource."""
    out: dict[str, Any] = {}
    for entry in _bundled_dir().iterdir():
        if entry.name.endswith(".toml"):
            out[entry.name[: -len(".toml")].lower()] = entry
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=None)
def _load_bundled(key: str) -> HardwareProfile:
    res = _bundled_index()[key]
    profile = parse_profile_toml(res.read_text(encoding="utf-8"), where=str(res))
    return profile


def profile_names() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return list(_bundled_index())


def list_profiles() -> list[HardwareProfile]:
    """Every bundled profile, validated, sorted by name (fresh copies)."""
    return [_load_bundled(k).model_copy(deep=True) for k in _bundled_index()]


def _looks_like_path(ref: str) -> bool:
    return ref.endswith(".toml") or os.sep in ref or "/" in ref or Path(ref).is_file()


def load_profile(ref: str) -> HardwareProfile:
    """A bundled profile by name (case-insensitive) or a profile TOML file by path."""
    ref = str(ref).strip()
    if not ref:
        raise InputError("--hardware is empty; expected a profile name (zeroplan profiles list) or a .toml path")
    key = ref.lower()
    index = _bundled_index()
    if key in index and not Path(ref).is_file():
        return _load_bundled(key).model_copy(deep=True)
    if _looks_like_path(ref):
        p = Path(ref)
        text = read_text_file(p, "hardware profile")
        return parse_profile_toml(text, where=str(p))
    close = difflib.get_close_matches(key, list(index), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise InputError(
        f"hardware profile {ref!r} is unknown{hint} (expected one of the {len(index)} bundled names "
        "shown by 'zeroplan profiles list', or a path to a .toml file)"
    )


# ----------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _toml_str(k)


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_float(x: float) -> str:
    if not math.isfinite(x):
        raise InputError(f"cannot write non-finite number {x!r} to TOML")
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-4):
        for p in range(0, 17):  # shortest exponent form that reads back exactly
            s = f"{x:.{p}e}"
            if float(s) == x:
                return s
    r = repr(float(x))
    return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"


def _toml_int(n: int) -> str:
    s = str(abs(n))
    if len(s) > 4:
        groups = []
        while s:
            groups.append(s[-3:])
            s = s[:-3]
        s = "_".join(reversed(groups))
    return ("-" if n < 0 else "") + s


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return _toml_int(v)
    if isinstance(v, float):
        return _toml_float(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):  # e.g. the NCCL algorithms a link offers
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _unit_comment(key: str, v: Any) -> str:
    """A human-readable comment for byte and bandwidth fields (ignored when read back)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return ""
    if key.endswith("_bytes") and v:
        return f"  # {v / GiB:,.2f} GiB = {v / GB:,.2f} GB"
    if key == "bandwidth_GBps_per_gpu":
        return f"  # {v * 8:,.4g} Gb/s per GPU"
    if key in FLOP_DTYPES:
        return f"  # {v / 1e12:,.4g} TFLOP/s dense"
    return ""


def profile_to_toml(profile: HardwareProfile) -> str:
    """TOML text for a profile; ``tomllib.loads`` of it gives back exactly the same fields."""
    data = profile.model_dump(exclude={"path"}, exclude_none=True)
    lines = [
        "# zeroplan hardware profile. Units: bytes are integers, GiB = 2**30, GB = 1e9;",
        "# bandwidths are GB/s (1e9 bytes/s) unidirectional, links per GPU; latency in us.",
    ]

    def emit_table(header: str | None, table: dict[str, Any]) -> None:
        scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
        subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
        if header is not None:
            lines.append("")
            lines.append(f"[{header}]")
        for k, v in scalars:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}{_unit_comment(k, v)}")
        for k, v in subs:
            emit_table(f"{header}.{_toml_key(k)}" if header else _toml_key(k), v)

    emit_table(None, data)
    return "\n".join(lines) + "\n"


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> Path:
    """Validate and write a profile to ``path`` atomically; returns the path."""
    validate_profile(profile, str(path))
    return atomic_write_text(path, profile_to_toml(profile))
