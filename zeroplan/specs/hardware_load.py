"""Finding a hardware profile: the bundled ones (``hardware_profiles/``, shipped as the package
``zeroplan.hardware_profiles``) by name, case-insensitive, each parsed once per process and
handed out as copies, or a profile TOML file by path.
"""

from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path
from typing import Any

from zeroplan._util import InputError, read_text_file
from zeroplan.specs.hardware_schema import HardwareProfile
from zeroplan.specs.hardware_toml import parse_profile_toml

__all__ = ["load_profile", "list_profiles", "profile_names"]

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


def _is_file(ref: str) -> bool:
    """``Path.is_file`` that says no rather than raising for a name the OS cannot look up (over
    NAME_MAX: ENAMETOOLONG, which pathlib does not swallow; an embedded NUL: ValueError)."""
    try:
        return Path(ref).is_file()
    except (OSError, ValueError):
        return False


def _looks_like_path(ref: str) -> bool:
    return ref.endswith(".toml") or os.sep in ref or "/" in ref or _is_file(ref)


def load_profile(ref: str) -> HardwareProfile:
    """A bundled profile by name (case-insensitive) or a profile TOML file by path."""
    ref = str(ref).strip()
    if not ref:
        raise InputError("--hardware is empty; expected a profile name (zeroplan profiles list) or a .toml path")
    key = ref.lower()
    index = _bundled_index()
    if key in index and not _is_file(ref):
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
