"""What every training-file format shares: ``TrainingFile`` (what a file says about the run), the
file read as a mapping (size bound; YAML with ``yaml.SafeLoader``, JSON with ``json``, a key given twice
refused), ``_Reader``
(typed key access that remembers which keys were used, unknown keys and typos refused) and the
precision, storage-dtype and DeepSpeed-config-path readers the formats have in common.

The formats themselves live in specs/trainfile_*.py; specs/training_files.py is the entry point.
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from zeroplan._util import (DuplicateKeyError, InputError, data_kind, no_duplicate_keys, parse_error_text,
                            read_text_file)
from zeroplan.specs.finetune import FineTune

MAX_FILE_BYTES = 4 * 1024 * 1024


class TrainingFile(BaseModel):
    """What a training file says about the run; None = the file does not say."""

    model_config = ConfigDict(defer_build=True)

    source: str
    format: str
    model: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    precision: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    seq_len: int | None = None
    checkpointing: str | None = None
    optimizer: str | None = None
    ds_config: str | dict | None = None  # a path (resolved against the file's folder) or an inline config
    kernels: str | None = None  # how transformers' code runs its element-wise kernels (specs/training.py KERNELS)
    kernels_why: str = ""
    finetune: FineTune | None = None
    ignored_keys: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


@functools.lru_cache(maxsize=1)
def _yaml_loader() -> type:
    """``yaml.SafeLoader`` that refuses a mapping key given twice (SafeLoader keeps the last silently)."""
    import yaml

    class _UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    dup = key in seen
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark)
                if not isinstance(key, str):  # `1: x`, `true: x`, `null: x`, a date: every format's keys are names
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        (f"key {key_node.value!r} reads as {data_kind(key)}" if isinstance(key_node.value, str)
                         else f"a key that is {data_kind(key)}") + "; expected a name (quote it to mean the text)",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return _UniqueKeyLoader


def _load_mapping(path: str | Path, what: str) -> dict[str, Any]:
    text = read_text_file(path, what)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise InputError(f"{path}: {what} is larger than {MAX_FILE_BYTES // 2**20} MiB")
    if str(path).endswith(".json") or text.lstrip().startswith("{"):
        try:  # a key given twice is refused, as in a DeepSpeed config (the last one would win silently)
            data = json.loads(text, object_pairs_hook=no_duplicate_keys)
        except DuplicateKeyError as exc:
            raise InputError(f"{path}: not valid JSON (duplicate key {exc.args[0]!r})") from None
        except ValueError as exc:
            raise InputError(f"{path}: not valid JSON ({parse_error_text(exc)})") from None
        except RecursionError:
            raise InputError(f"{path}: nested too deeply") from None
    else:
        import yaml

        try:
            data = yaml.load(text, Loader=_yaml_loader())  # SafeLoader: plain data, no Python objects
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise InputError(f"{path}{at}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
        except RecursionError:
            raise InputError(f"{path}: nested too deeply") from None
        except ValueError as exc:  # yaml's int() of a number of over 4,300 digits
            raise InputError(f"{path}: not valid YAML ({parse_error_text(exc)})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of keys to values at the top level, got {data_kind(data)}")
    return data


class _Reader:
    """Typed access to one file's keys; remembers which keys were used."""

    def __init__(self, data: dict[str, Any], where: str):
        self.data = data
        self.where = where
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def int(self, key: str, lo: int = 1, hi: int = 1 << 40) -> int | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise InputError(f"{self.where}: {key} = {v!r}; expected an integer from {lo} to {hi}")
        return v

    def bool(self, key: str) -> bool | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no"):
            return v.lower() in ("true", "yes")
        if not isinstance(v, bool):
            raise InputError(f"{self.where}: {key} = {v!r}; expected true or false")
        return v

    def choice(self, key: str, allowed: tuple[str, ...]) -> str | None:
        v = self.raw(key)
        if v is None:
            return None
        s = str(v).lower()
        if s not in allowed:
            raise InputError(f"{self.where}: {key} = {v!r}; expected one of {', '.join(allowed)}")
        return s

    def str(self, key: str) -> str | None:
        v = self.raw(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"{self.where}: {key} = {v!r}; expected a non-empty string")
        return v

    def names(self, key: str) -> tuple[str, ...] | None:
        """A list of module names, or a comma-separated string of them."""
        v = self.raw(key)
        if v is None:
            return None
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
            raise InputError(f"{self.where}: {key} = {v!r}; expected a list of module names")
        return tuple(x.strip() for x in items)

    def ignored(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.used)

    def refuse_unknown(self, known: frozenset[str]) -> None:
        """Every key must be one the format defines (Accelerate's config is a closed set)."""
        for k in self.data:
            if k not in known:
                near = difflib.get_close_matches(str(k), sorted(known), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise InputError(f"{self.where}: unknown key {k!r}{hint}; expected one of the format's keys")

    def refuse_typos(self) -> None:
        """Open formats (axolotl, LLaMA-Factory, Trainer arguments) have hundreds of keys that do not
        change memory; those are listed as ignored. A key one typo away from a key that does is an
        error, so that ``micro_batch_sise: 64`` is not planned with the default."""
        for k in self.ignored():
            near = difflib.get_close_matches(str(k), sorted(self.used), n=1, cutoff=0.88)
            if near and near[0] not in self.data:
                raise InputError(f"{self.where}: unknown key {k!r}; did you mean {near[0]!r}?")


def _precision(r: _Reader, bf16_key: str = "bf16", fp16_key: str = "fp16") -> str | None:
    bf = r.raw(bf16_key)
    fp = r.raw(fp16_key)
    on = lambda v: v is True or (isinstance(v, str) and v.lower() in ("true", "auto"))  # noqa: E731
    if on(bf) and on(fp) and not (bf == "auto" and fp == "auto"):
        raise InputError(f"{r.where}: {bf16_key} and {fp16_key} are both enabled; expected at most one")
    if on(bf) and bf != "auto":
        return "bf16"
    if on(fp) and fp != "auto":
        return "fp16"
    if bf == "auto":  # axolotl: bf16: auto = bf16 where the GPU supports it
        return "bf16"
    return None


def _kernels(r: _Reader, out: TrainingFile, fusing_keys: tuple[str, ...]) -> None:
    """These formats run transformers' modeling code: op by op ("unfused", core/elementwise.py) unless a
    key switches on Liger's fused kernels or torch.compile (counted as "fused", also where Liger fuses only
    some of the ops)."""
    on = [k for k in fusing_keys if r.bool(k)]
    out.kernels = "fused" if on else "unfused"
    out.kernels_why = (f"{r.where}: {', '.join(on)}" if on else f"{r.where}: transformers' code, none of "
                       f"{', '.join(fusing_keys)} switched on")


def _storage(precision: str | None) -> str:
    return {"fp16": "float16", "fp32": "float32"}.get(precision or "bf16", "bfloat16")


def _ds_path(r: _Reader, key: str, base: Path) -> str | dict | None:
    v = r.raw(key)
    if v is None:
        return None
    if isinstance(v, dict):
        return v
    if not isinstance(v, str) or not v.strip():
        raise InputError(f"{r.where}: {key} = {v!r}; expected a path to a DeepSpeed JSON or an inline config")
    p = Path(v).expanduser()
    return str(p if p.is_absolute() else base / p)
