"""The ``optimizer``, ``scheduler`` and ``gradient_clipping`` keys of a DeepSpeed 0.19.8 config: the
optimizer type and params (numbers in the ranges torch.optim accepts, "auto" left for the launcher),
unknown keys DeepSpeed ignores, and clipping (absent -> DeepSpeed's default 1.0, ``"auto"`` -> the HF
Trainer's 1.0, a value the engine cannot compare with 0 -> an error naming where training fails).
"""

from __future__ import annotations

import math
from typing import Any

from zeroplan._util import data_kind
from zeroplan.specs.ds_findings import _fmt, _is_auto, _Reader
from zeroplan.specs.ds_keys import _DS_OPTIMIZERS, _OPTIMIZER_KEYS, _SCHEDULER_KEYS
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION, DSConfig


def _check_optimizer_numbers(r: _Reader, params: dict[str, Any]) -> None:
    """lr, eps, weight_decay and betas: finite numbers in the ranges torch.optim.Adam/AdamW's
    ``__init__`` (PyTorch 2.13) accepts; DeepSpeed passes them through unchanged. An infinite lr
    passes torch's ``0.0 <= lr`` but is no plan anyone means: refused too."""
    def bad(key: str, v: Any, want: str) -> None:
        r.add("DS010", "error", f"optimizer.params.{key}", f"optimizer.params.{key} = {_fmt(v)}: expected {want}", v)

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in ("lr", "eps", "weight_decay"):
        v = params.get(key)
        if v is None or _is_auto(v):
            continue
        if not number(v) or v < 0:
            bad(key, v, "a finite number >= 0 (torch.optim raises 'Invalid ...' otherwise)")
    betas = params.get("betas")
    if betas is not None and not _is_auto(betas):
        if not isinstance(betas, list) or len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
            bad("betas", betas, "two finite numbers in [0, 1) (torch.optim raises 'Invalid beta parameter')")


def _read_optimizer(r: _Reader, raw: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    opt = raw.get("optimizer")
    if not isinstance(opt, dict):  # absent, or a shape ds_shapes refused
        return None, {}
    for k in opt:
        if k not in _OPTIMIZER_KEYS:
            r.unknown(f"optimizer.{k}", _OPTIMIZER_KEYS, "warning", "DeepSpeed ignores it")
    typ = opt.get("type")
    if typ is not None and not isinstance(typ, str):
        r.add("DS003", "error", "optimizer.type", f"optimizer.type = {_fmt(typ)}: expected a string "
              "such as \"AdamW\"", typ)
        typ = None
    if isinstance(typ, str) and typ.lower() in _DS_OPTIMIZERS:
        typ = typ.lower()
    params = opt.get("params") if typ is not None else None
    if params is None:
        params = {}
    if not isinstance(params, dict):
        r.add("DS003", "error", "optimizer.params", f"optimizer.params = {_fmt(params)}: expected an "
              "object", params)
        params = {}
    autos = sorted(k for k, v in params.items() if _is_auto(v))
    if autos:
        for k in autos:
            r.auto[f"optimizer.params.{k}"] = {"value": None, "how": "left for the launcher (HF Trainer "
                                                "fills it from its training arguments); no effect on the plan"}
        r.add("DS006", "info", "optimizer.params",
              f"optimizer.params {', '.join(autos)} = \"auto\": filled by the HF Trainer from its "
              "training arguments; they do not change memory or communication", None)
    _check_optimizer_numbers(r, params)
    mgn = params.get("max_grad_norm")
    if isinstance(mgn, (int, float)) and not isinstance(mgn, bool) and mgn > 0:
        r.add("DS010", "warning", "optimizer.params.max_grad_norm",
              f"optimizer.params.max_grad_norm = {mgn} is not supported as an optimizer parameter; "
              "DeepSpeed asks for the top-level gradient_clipping instead", mgn)
    sched = raw.get("scheduler")
    if isinstance(sched, dict):  # any other shape: ds_shapes refused it
        for k in sched:
            if k not in _SCHEDULER_KEYS:
                r.unknown(f"scheduler.{k}", _SCHEDULER_KEYS, "warning", "DeepSpeed ignores it")
    return typ, dict(params)


# DeepSpeed clips at runtime/constants.py GRADIENT_CLIPPING_DEFAULT when the key is absent (ds_schema)
_CLIPPING_DEFAULT: float = DSConfig.model_fields["gradient_clipping"].default
# where DeepSpeed uses the value: each optimizer step compares it with 0
_CLIP_USE = "DeepSpeedEngine._take_model_step and the ZeRO/BF16/FP16 optimizers compare it with > 0.0"


def _read_clipping(r: _Reader, raw: dict[str, Any]) -> float:
    """``gradient_clipping``. DeepSpeedConfig takes it as given (``get_gradient_clipping``: get_scalar_param, no
    type check); the engine compares it with 0 on every step (``_CLIP_USE``). So a number is used as
    written (<= 0: off), true/false are 1/0, and anything else (null, a string, a list, an object) passes
    DeepSpeedConfig and deepspeed.initialize but raises TypeError at the first ``engine.step()``."""
    v = raw.get("gradient_clipping", _CLIPPING_DEFAULT)
    if _is_auto(v):
        how = "HF Trainer fills it from max_grad_norm (default 1.0); assumed 1.0"
        r.auto["gradient_clipping"] = {"value": 1.0, "how": how}
        r.add("DS006", "info", "gradient_clipping", f"gradient_clipping = \"auto\" -> 1.0 ({how})", v)
        return 1.0
    if isinstance(v, bool):
        r.add("DS003", "warning", "gradient_clipping",
              f"gradient_clipping = {_fmt(v)}: expected a number (0 = off), got a boolean; DeepSpeed "
              f"{DEEPSPEED_VERSION} takes {_fmt(v)} as {int(v)} (a bool is an int; {_CLIP_USE}), so it "
              f"{'clips at 1.0' if v else 'does not clip'}; write {1.0 if v else 0} instead", v)
        return float(v)
    if isinstance(v, float) and not math.isfinite(v):  # only from a dict: a file's NaN/Infinity fails to parse
        r.add("DS003", "error", "gradient_clipping",
              f"gradient_clipping = {_fmt(v)}: expected a finite number >= 0 (0 = off); using 0", v)
        return 0.0
    if not isinstance(v, (int, float)):
        r.add("DS003", "error", "gradient_clipping",
              f"gradient_clipping = {_fmt(v)}: expected a number >= 0 (0 = off), got {data_kind(v)}; "
              f"DeepSpeedConfig and deepspeed.initialize ({DEEPSPEED_VERSION}) accept it (get_gradient_clipping "
              "keeps it as given), but training fails at the first engine.step(): "
              "DeepSpeedEngine._take_model_step compares it with > 0.0 (TypeError); zeroplan plans with 0 (off)", v)
        return 0.0
    if v < 0:
        r.add("DS010", "warning", "gradient_clipping",
              f"gradient_clipping = {_fmt(v)}: expected a number >= 0 (0 = off); DeepSpeed {DEEPSPEED_VERSION} "
              f"clips only when it is > 0 ({_CLIP_USE}), so {_fmt(v)} turns clipping off; write 0 instead", v)
        return 0.0
    return float(v)
