"""Hardware profiles: what a cluster node is made of, with the source of every number.

A profile is a TOML file (bundled ones live in ``hardware_profiles/``, shipped as the
package ``zeroplan.hardware_profiles``; users pass a path to their own). Units, fixed:

- bytes are integers (``memory_bytes``, ``host_ram_bytes``, ...); GiB = 2**30, GB = 10**9;
- bandwidths are ``GBps`` = 10**9 bytes/s, **unidirectional**, and link bandwidths are
  **per GPU** (a 400 Gb/s NIC = 50 GB/s; one NIC shared by 8 GPUs gives each 1/8 of it);
- ``latency_us`` is microseconds per collective step (the alpha of an alpha-beta model);
- ``efficiency`` is the achievable fraction of ``bandwidth_GBps_per_gpu`` (0.01 <= e <= 1);
- ``peak_flops`` are dense (no sparsity) FLOP/s per dtype.

Every numeric field needs an entry in ``sources`` keyed by its dotted path
(``"inter_node.bandwidth_GBps_per_gpu"``); a source for a parent path
(``"gpu.peak_flops"``) covers the fields below it. Sanity bounds catch unit mistakes
(Gb/s written for GB/s, per-node written for per-GPU, TB/s for GB/s) with a hint.

Where each part lives (specs/): ``hardware_schema`` (the pydantic models, ``FLOP_DTYPES``),
``hardware_checks`` (sources and sanity bounds: ``validate_profile``), ``hardware_toml`` (TOML
text both ways, ``save_profile``) and ``hardware_load`` (bundled profiles by name, files by
path). This module re-exports their names, public and private, so
``from zeroplan.specs.hardware import ...`` keeps working.
"""

from __future__ import annotations

from zeroplan._util import GB, GiB, InputError, atomic_write_text, read_text_file  # noqa: F401
from zeroplan.specs.hardware_checks import (  # noqa: F401
    _BOUNDS,
    _FRACTIONS,
    _NCCL_ALGORITHMS,
    _UNIT_HINT,
    _all_field_paths,
    _fmt,
    numeric_field_paths,
    source_for,
    validate_profile,
)
from zeroplan.specs.hardware_load import (  # noqa: F401
    _bundled_dir,
    _bundled_index,
    _load_bundled,
    _looks_like_path,
    list_profiles,
    load_profile,
    profile_names,
)
from zeroplan.specs.hardware_schema import (  # noqa: F401
    FLOP_DTYPES,
    GPUSpec,
    HardwareProfile,
    LinkSpec,
    NodeSpec,
    OverheadSpec,
    TiB,
    _Strict,
)
from zeroplan.specs.hardware_toml import (  # noqa: F401
    _BARE_KEY,
    _loc,
    _reject_bools,
    _toml_float,
    _toml_int,
    _toml_key,
    _toml_str,
    _toml_value,
    _translate,
    _unit_comment,
    parse_profile_toml,
    profile_to_toml,
    save_profile,
)

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
