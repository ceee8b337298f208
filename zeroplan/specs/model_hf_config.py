"""Reading a Hugging Face ``config.json``: typed reads of its keys (``_Cfg``, errors name the file
and the key, sizes bounded far beyond any real model), the JSON file itself, and where the local
Hugging Face Hub cache keeps a repository's config.json (never the network).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from zeroplan._util import InputError, parse_error_text, read_text_file

__all__ = ["hf_hub_cache_dir", "hf_cache_config"]

# sanity bounds on config.json sizes: far beyond any real model, small enough to stay fast
_MAX_DIM = 10**8  # hidden / intermediate / vocab / positions / heads
# Layers and experts each make tensors (and ledger entries) of their own, so their bounds also keep a
# plan to seconds: 4,096 layers (DeepNet trained 1,000) and 8,192 experts (Switch-C has 2,048).
MAX_LAYERS = 4_096
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers"}
_MAX_EXPERTS = 8_192
_EXPERT_KEYS = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"}


class _Cfg:
    """Typed reads from a config.json dict; errors name the file and the key."""

    def __init__(self, cfg: dict, where: str):
        self.cfg = cfg
        self.where = where

    def has(self, *keys: str) -> bool:
        return any(self.cfg.get(k) is not None for k in keys)

    def int(self, *keys: str, default: Any = ..., positive: bool = True) -> int:
        for k in keys:
            v = self.cfg.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                isinstance(v, float) and (not math.isfinite(v) or v != int(v))
            ):
                raise InputError(f"{self.where}: key {k!r} = {v!r}, expected an integer")
            v = int(v)
            if positive and v <= 0:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected a positive integer")
            limit = MAX_LAYERS if k in _LAYER_KEYS else _MAX_EXPERTS if k in _EXPERT_KEYS else _MAX_DIM
            if v > limit:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected at most {limit:,} (a real model size)")
            if not positive and v < 0:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected a non-negative integer")
            return v
        if default is ...:
            raise InputError(f"{self.where}: missing required key {keys[0]!r}"
                             + (f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""))
        return default

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise InputError(f"{self.where}: key {key!r} = {v!r}, expected true or false")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InputError(f"{self.where}: key {key!r} = {v!r}, expected a positive number")
        return float(v)


def _parse_json(path: Path) -> Any:
    text = read_text_file(path, "model config")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InputError(f"{path}: invalid JSON: nested too deeply for a config.json") from None
    except ValueError as exc:
        raise InputError(f"{path}: invalid JSON: {parse_error_text(exc)}") from None


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def hf_hub_cache_dir() -> Path:
    """The Hugging Face Hub cache, resolved as huggingface_hub.constants does: HF_HUB_CACHE
    (or the older HUGGINGFACE_HUB_CACHE), else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hf_cache_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local Hub cache, or None. Never touches the network.

    Layout (huggingface_hub file_download): ``models--ORG--NAME/refs/main`` holds the commit
    hash of ``snapshots/<hash>/``; without a usable ref, the newest snapshot holding a config.json.
    """
    repo_dir = hf_hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        return _snapshot_config(repo_dir)
    except (OSError, ValueError):  # a cache path the OS cannot look up (over PATH_MAX, a NUL): no entry
        return None


def _snapshot_config(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    try:
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
    except (OSError, UnicodeDecodeError):
        commit = ""
    if commit and "/" not in commit and commit not in (".", ".."):
        cfg = snapshots / commit / "config.json"
        try:
            if cfg.is_file():
                return cfg
        except (OSError, ValueError):  # a ref the OS cannot look up (over NAME_MAX, a NUL): list instead
            pass
    found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    if not found:
        return None
    return max(found, key=lambda c: c.stat().st_mtime)
