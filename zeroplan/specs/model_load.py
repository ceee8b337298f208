"""``load_model(ref)``: a model reference to a ModelSpec. It accepts, decided in this order:

1. an existing path: an HF ``config.json`` or a directory containing one;
2. a catalog name (case-insensitive), e.g. ``llama-2-7b`` — the bundled catalog in
   ``zeroplan/specs/catalog/<name>.json`` ships the published config.json of each model
   and its published parameter count;
3. a Hugging Face Hub id: the catalog entry whose ``hf_repo``/``hf_aliases`` match, else the
   config.json in the local Hub cache (never the network);
4. a count such as ``7B``, ``70e9``, ``1.3T``, ``125M``;
5. otherwise an InputError that suggests close catalog names.
"""

from __future__ import annotations

import re
from pathlib import Path

from zeroplan._util import InputError, display_path, parse_count, safe_text
from zeroplan.specs.model_catalog import _catalog_files, _catalog_spec_cached, _fresh, _hub_catalog_key, _unknown
from zeroplan.specs.model_count import spec_from_count
from zeroplan.specs.model_hf_config import _HUB_ID, _parse_json, hf_cache_config, hf_hub_cache_dir
from zeroplan.specs.model_spec import ModelSpec, spec_from_config

__all__ = ["load_model"]

def _load_path(p: Path) -> ModelSpec:
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InputError(f"{p}: directory has no config.json")
        p = p / "config.json"
    cfg = _parse_json(p)
    if not isinstance(cfg, dict):
        raise InputError(f"{p}: expected a JSON object (an HF config.json), got {type(cfg).__name__}")
    name = cfg.get("_name_or_path") if isinstance(cfg.get("_name_or_path"), str) and cfg.get("_name_or_path") else None
    # names reach the terminal through rich: no ANSI escapes, control characters or lone surrogates
    name = safe_text(name or (p.parent.name if p.name == "config.json" else p.stem))
    return spec_from_config(cfg, name, f"config:{display_path(p)}")


def load_model(ref: str) -> ModelSpec:
    """Catalog name, path to an HF config.json (or its directory), a Hugging Face Hub id (the catalog
    entry whose ``hf_repo``/``hf_aliases`` match, else the config.json in the local Hub cache), or a
    count such as 7B / 70e9 / 1.3T. Never uses the network.

    Catalog specs are parsed once per process and cached; each call returns a copy whose
    lists/dicts may be mutated, but whose ParamTensor objects are shared (treat as read-only).
    """
    if not isinstance(ref, str) or not ref.strip():
        raise InputError("model: empty reference, expected a catalog name, a config.json path or a count such as 7B")
    p = Path(ref).expanduser()
    try:
        exists = p.exists()
    except (OSError, ValueError) as exc:  # a name over NAME_MAX, an embedded NUL
        raise InputError(f"{display_path(ref)}: cannot read model config: {getattr(exc, 'strerror', None) or exc}") from None
    if exists:
        return _load_path(p)
    key = ref.strip().lower()
    if key in _catalog_files():
        return _fresh(_catalog_spec_cached(key))
    hub = _hub_catalog_key(key)
    if hub is not None:
        return _fresh(_catalog_spec_cached(hub))
    if _HUB_ID.match(ref.strip()):
        cached = hf_cache_config(ref.strip())
        if cached is not None:
            spec = _load_path(cached)
            spec.hf_repo = ref.strip()
            spec.name = ref.strip()  # the Hub id, not the snapshot hash or the uploader's _name_or_path
            return spec
    try:
        parse_count(ref)
    except InputError:
        if _HUB_ID.match(ref.strip()) and not ref.strip().lower().endswith(".json"):
            raise InputError(
                f"model {ref!r}: not a file, not a Hub id in the catalog, and not in the local Hugging Face "
                f"cache ({hf_hub_cache_dir()}); zeroplan never downloads: pass the path to its config.json "
                "(or `huggingface-cli download " + ref.strip() + " config.json` first)") from None
        if ref.strip().lower().endswith(".json") or "/" in ref:
            raise InputError(f"{ref}: model config not found") from None
        if re.match(r"^\s*[-+]?[0-9.]+(?:[eE][+-]?[0-9]+)?\s*[KMBGTkmbgt]?\s*$", ref):
            raise  # a number that is out of range: parse_count says why
        raise _unknown(ref) from None
    return spec_from_count(ref)
