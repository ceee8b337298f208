"""The bundled model catalog (``zeroplan/specs/catalog/<name>.json``: the published config.json of
each model, its Hugging Face repository and published parameter count), looked up by name or by
Hub id, each parsed once per process and handed out as copies.
"""

from __future__ import annotations

import copy
import difflib
import functools
from pathlib import Path

from zeroplan._util import InputError
from zeroplan.specs.model_hf_config import _parse_json
from zeroplan.specs.model_spec import ModelSpec, spec_from_config

__all__ = ["catalog_names", "catalog_entry"]

_CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


@functools.lru_cache(maxsize=1)
def _catalog_files() -> dict[str, Path]:
    return {p.stem.lower(): p for p in sorted(_CATALOG_DIR.glob("*.json"))}


def catalog_names() -> list[str]:
    """Names of the bundled catalog models, sorted."""
    return list(_catalog_files())


@functools.lru_cache(maxsize=None)
def _catalog_entry_cached(key: str) -> dict:
    path = _catalog_files()[key]
    entry = _parse_json(path)
    for k in ("name", "hf_repo", "published_params", "published_params_source", "config"):
        if k not in entry:
            raise InputError(f"{path}: catalog entry lacks key {k!r}")
    return entry


def catalog_entry(name: str) -> dict:
    """The raw catalog entry {name, hf_repo, published_params, published_params_source, config}."""
    key = name.strip().lower()
    if key not in _catalog_files():
        raise _unknown(name)
    return copy.deepcopy(_catalog_entry_cached(key))


@functools.lru_cache(maxsize=None)
def _catalog_spec_cached(key: str) -> ModelSpec:
    entry = _catalog_entry_cached(key)
    spec = spec_from_config(copy.deepcopy(entry["config"]), entry["name"], f"catalog:{entry['name']}")
    spec.hf_repo = entry["hf_repo"]
    spec.published_params = entry["published_params"]
    spec.published_params_source = entry["published_params_source"]
    return spec


def _fresh(spec: ModelSpec) -> ModelSpec:
    """A copy safe to mutate at the top level (tensors themselves are shared, treat as read-only)."""
    return spec.model_copy(update={"notes": list(spec.notes), "tensors": list(spec.tensors),
                                   "hf_config": copy.deepcopy(spec.hf_config)})


def _unknown(ref: str) -> InputError:
    names = catalog_names()
    close = difflib.get_close_matches(ref.strip().lower(), names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return InputError(
        f"model {ref!r} is not a file, a catalog name or a count such as 7B / 70e9{hint} "
        f"(catalog: {', '.join(names)})")


@functools.lru_cache(maxsize=1)
def _hub_index() -> dict[str, str]:
    """Lower-case Hub id (``hf_repo`` and ``hf_aliases`` of each catalog entry) -> catalog key."""
    out: dict[str, str] = {}
    for key in _catalog_files():
        entry = _catalog_entry_cached(key)
        for repo in [entry["hf_repo"], *entry.get("hf_aliases", [])]:
            out[str(repo).lower()] = key
    return out


def _hub_catalog_key(ref_lower: str) -> str | None:
    return _hub_index().get(ref_lower)
