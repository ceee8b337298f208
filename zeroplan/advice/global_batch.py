"""``recommend --global-batch``: a global batch target in tokens or samples → gradient accumulation.

Syntax (one value, the unit written out, no space needed): a positive number, an optional decimal
suffix ``K`` (10³), ``M`` (10⁶) or ``G`` (10⁹), then ``tokens`` (or ``tok``) or ``samples`` (or
``seqs``): ``4Mtokens``, ``4M tokens``, ``512samples``, ``1.5Ktok``. A bare number is refused: is
``512`` 512 sequences or 512 tokens? The scaled value must be a whole number.

Gradient accumulation (DeepSpeed's ``train_batch_size = micro_batch × gradient_accumulation_steps ×
world_size``, deepspeed/runtime/config.py ``_batch_assertion``) is the smallest that reaches the
target: ``ceil(samples / (micro_batch × data-parallel ranks))``, where samples = tokens / seq_len
rounded up for a token target. So the real global batch is the target or the next multiple of
micro_batch × ranks above it; ``GlobalBatch`` says which.

``fit_global_batch`` runs the search (a callable) until the micro-batch it picks and the
accumulation it implies agree: the micro-batch is searched with the accumulation the previous
pass implied, at most ``_PASSES`` times; then the micro-batch is fixed.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Literal

from pydantic import BaseModel

from zeroplan._util import InputError
from zeroplan.advice.reasons import Reason, qcount, reason
from zeroplan.core.inputs import MAX_OPTION_VALUES

__all__ = ["GlobalBatch", "parse_global_batch", "grad_accum_for", "max_micro_batch_for", "fit_global_batch",
           "GLOBAL_BATCH_SYNTAX"]

GLOBAL_BATCH_SYNTAX = "a number with an optional K/M/G (10³/10⁶/10⁹) and a unit: 4Mtokens, 512samples"
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
MAX_GLOBAL_BATCH = 10**12  # tokens or samples per optimizer step: 1e5 times today's largest (~16M tokens)
_UNITS = {"tokens": "tokens", "token": "tokens", "tok": "tokens", "samples": "samples", "sample": "samples",
          "seqs": "samples", "seq": "samples", "sequences": "samples"}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*([A-Za-z]*)\s*$", re.ASCII)  # ASCII digits, as -g
_PASSES = 3


class GlobalBatch(BaseModel):
    """The target, the accumulation chosen for it and the real global batch it gives."""

    target: int  # in ``unit``
    unit: Literal["tokens", "samples"]
    micro_batch: int
    data_parallel: int
    seq_len: int
    grad_accum: int  # ceil(target samples / (micro_batch × data_parallel))
    samples: int  # micro_batch × grad_accum × data_parallel (DeepSpeed's train_batch_size)
    tokens: int  # samples × seq_len
    reason: Reason
    sentence: str  # reason as text

    @property
    def reached(self) -> int:
        return self.tokens if self.unit == "tokens" else self.samples


def parse_global_batch(text: str) -> tuple[int, str]:
    """``"4Mtokens"`` → (4000000, "tokens"); InputError (exit 2) with the syntax otherwise."""
    m = _RE.match(str(text))
    unit = _UNITS.get(m.group(3).lower()) if m else None
    if m is None or unit is None:
        why = "give the unit" if m is not None and not m.group(3) else "cannot read it"
        raise InputError(f"--global-batch {text!r}: {why}; expected {GLOBAL_BATCH_SYNTAX}")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if value > MAX_GLOBAL_BATCH:  # inf too: float() of a 5,000-digit number
        said = f"{value:g} {unit}" if math.isfinite(value) else f"more {unit} than a float holds"
        raise InputError(f"--global-batch {text!r} is {said}; expected at most {MAX_GLOBAL_BATCH:.0e}")
    if value != int(value) or value < 1:
        raise InputError(f"--global-batch {text!r} is {value:g} {unit}; expected a whole number of at least 1")
    return int(value), unit


def grad_accum_for(target: int, unit: str, *, micro_batch: int, data_parallel: int, seq_len: int) -> GlobalBatch:
    """The smallest accumulation whose global batch reaches ``target`` (see the module docstring)."""
    samples_wanted = math.ceil(target / seq_len) if unit == "tokens" else target
    per_step = micro_batch * data_parallel
    ga = max(1, math.ceil(samples_wanted / per_step))
    if ga > MAX_OPTION_VALUES["--grad-accum"]:
        raise InputError(f"--global-batch {target:,} {unit} needs gradient accumulation {ga:,} at micro-batch "
                         f"{micro_batch} on {data_parallel} GPUs; zeroplan plans at most "
                         f"{MAX_OPTION_VALUES['--grad-accum']:,} (as --grad-accum)")
    samples = per_step * ga
    tokens = samples * seq_len
    reached = tokens if unit == "tokens" else samples
    how = "exactly" if reached == target else f"{reached / target - 1:+.1%} over the target"
    r = reason("--global-batch {target} {unit}: gradient accumulation {ga} = ceil({wanted} samples / (micro-batch "
               "{mb} × {dp} GPUs)) gives a global batch of {samples} samples = {tokens} tokens at sequence {seq} "
               "({how}).", target=qcount(target), unit=unit, ga=qcount(ga), wanted=qcount(samples_wanted),
               mb=qcount(micro_batch), dp=qcount(data_parallel), samples=qcount(samples), tokens=qcount(tokens),
               seq=qcount(seq_len), how=how)
    return GlobalBatch(target=target, unit=unit, micro_batch=micro_batch, data_parallel=data_parallel,
                       seq_len=seq_len, grad_accum=ga, samples=samples, tokens=tokens, reason=r, sentence=r.text())


def max_micro_batch_for(target: int, unit: str, *, data_parallel: int, seq_len: int) -> int:
    """The largest micro-batch that does not overshoot the target on its own (at least 1)."""
    samples_wanted = math.ceil(target / seq_len) if unit == "tokens" else target
    return max(1, samples_wanted // data_parallel)


def fit_global_batch(run: Callable[..., Any], target: int, unit: str, *, data_parallel: int, seq_len: int,
                     micro_batch: int | None, max_micro_batch: int | None) -> tuple[Any, GlobalBatch | None]:
    """Search (``run(grad_accum=, micro_batch=, max_micro_batch=)`` → a Recommendation) until the
    chosen micro-batch and the accumulation it implies agree; the last result and its GlobalBatch
    (None when nothing fits)."""
    cap = max_micro_batch_for(target, unit, data_parallel=data_parallel, seq_len=seq_len)
    cap = min(cap, max_micro_batch) if max_micro_batch is not None else cap
    mb_guess = micro_batch or 1
    ga = grad_accum_for(target, unit, micro_batch=mb_guess, data_parallel=data_parallel, seq_len=seq_len).grad_accum
    fixed = micro_batch
    for i in range(_PASSES + 1):
        rec = run(grad_accum=ga, micro_batch=fixed, max_micro_batch=None if fixed else cap)
        if rec.chosen is None:
            return rec, None
        gb = grad_accum_for(target, unit, micro_batch=rec.chosen.micro_batch, data_parallel=data_parallel,
                            seq_len=seq_len)
        if gb.grad_accum == ga:
            return rec, gb
        ga = gb.grad_accum
        if i == _PASSES - 1:
            fixed = rec.chosen.micro_batch  # last pass: keep this micro-batch, take its accumulation
    raise AssertionError("unreachable: the last pass fixes the micro-batch")  # pragma: no cover
