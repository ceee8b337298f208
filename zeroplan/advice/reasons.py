"""Structured advice: numbers with units, sentences built from them, and evaluated alternatives.

Advice (``check``'s findings, ``recommend``'s explanation) is data first:

- ``Quantity``: a number and its unit (``bytes``, ``s``, ``fraction``, ``tokens/s``, ``count``,
  ``elements``, ``GB/s``). Bytes stay integers.
- ``Reason``: a sentence template with named ``{slots}`` and the quantities that fill them.
  ``Reason.text()`` is the plain-text rendering every output uses for its ``message`` string
  (GB = 10^9 bytes; ``bytes_gib`` quantities also show GiB); a renderer that wants other
  formatting (HTML, a table) reads ``template`` and ``quantities`` instead.
- ``Alternative``: a change the advice suggests (a larger micro-batch, more gradient
  accumulation, a lower stage, hpZ, no offload, a larger bucket...) together with the plan that
  change gives, evaluated with the same ``core.plan.evaluate``: which metric it is claimed to move,
  in which direction, and the numbers before and after. Advice only words a suggestion whose
  Alternative ``holds``; tests re-evaluate every Alternative independently.

Formatting here uses ``zeroplan._util`` only: advice never imports the renderers (report/).
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, Field

from zeroplan._util import fmt_gb, fmt_gib

__all__ = ["Unit", "Quantity", "Reason", "Alternative", "Metric", "Claim", "reason", "join_reasons", "fmt_seconds",
           "fmt_elements", "MEANINGFUL", "qbytes", "qbytes_gib", "qseconds", "qfraction", "qtokens", "qcount",
           "qelements"]

Unit = Literal["bytes", "bytes_gib", "s", "fraction", "tokens/s", "count", "elements", "GB/s"]
Metric = Literal["comm_share", "tokens_per_s", "peak_bytes", "bucket_latency_share", "comm_bytes_per_gpu_per_step"]
Claim = Literal["lower", "higher", "not_lower"]  # not_lower: within MEANINGFUL below, or above

# An alternative is said to "amortise", "reduce", "speed up" only when it moves its metric by at
# least this relative amount: the model's own noise (recommend ranks within the same 5%).
MEANINGFUL = 0.05


def fmt_seconds(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:,.1f} µs"
    if t < 1:
        return f"{t * 1e3:,.1f} ms"
    return f"{t:,.2f} s"


def fmt_elements(n: int) -> str:
    """5e8-style element counts for bucket sizes (exact integers print with commas when not round)."""
    s = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")
    return s if float(s) == n else f"{n:,}"


class Quantity(BaseModel):
    """A number with its unit. ``fraction`` is 0–1 (shown as a percentage)."""

    value: float | int
    unit: Unit
    digits: int | None = None  # display precision override (fraction: decimals of the %)

    def text(self) -> str:
        v, u = self.value, self.unit
        if u == "bytes":
            return fmt_gb(v, 2 if self.digits is None else self.digits)
        if u == "bytes_gib":
            return f"{fmt_gb(v)} ({fmt_gib(v)})"
        if u == "s":
            return fmt_seconds(float(v))
        if u == "fraction":
            return f"{float(v) * 100:.{0 if self.digits is None else self.digits}f}%"
        if u == "tokens/s":
            return f"{float(v):,.0f} tokens/s"
        if u == "count":
            return f"{int(v):,}"
        if u == "elements":
            return fmt_elements(int(v))
        return f"{float(v):g} GB/s"


class Reason(BaseModel):
    """A sentence: ``template`` with ``{name}`` slots filled from ``quantities`` (or ``words``)."""

    template: str
    quantities: dict[str, Quantity] = Field(default_factory=dict)
    words: dict[str, str] = Field(default_factory=dict)  # non-numeric slots (names of modules, links)

    def text(self) -> str:
        slots = {k: q.text() for k, q in self.quantities.items()} | dict(self.words)
        return string.Formatter().vformat(self.template, (), slots)


def reason(template: str, **slots: Quantity | str) -> Reason:
    """``reason("peak {peak}", peak=Quantity(value=…, unit="bytes"))``; str slots are words."""
    return Reason(template=template, quantities={k: v for k, v in slots.items() if isinstance(v, Quantity)},
                  words={k: v for k, v in slots.items() if isinstance(v, str)})


def join_reasons(parts: list[Reason], sep: str = "; ") -> Reason:
    """One Reason from several: templates joined with ``sep``, slots renamed apart."""
    tpl: list[str] = []
    q: dict[str, Quantity] = {}
    w: dict[str, str] = {}
    for i, r in enumerate(parts):
        ren = {k: f"{k}_{i}" for k in list(r.quantities) + list(r.words)}
        tpl.append(string.Formatter().vformat(r.template, (), {k: "{" + v + "}" for k, v in ren.items()}))
        q |= {ren[k]: v for k, v in r.quantities.items()}
        w |= {ren[k]: v for k, v in r.words.items()}
    return Reason(template=sep.join(tpl), quantities=q, words=w)


def qbytes(n: int) -> Quantity:
    return Quantity(value=int(n), unit="bytes")


def qbytes_gib(n: int) -> Quantity:
    return Quantity(value=int(n), unit="bytes_gib")


def qseconds(t: float) -> Quantity:
    return Quantity(value=float(t), unit="s")


def qfraction(x: float, digits: int = 0) -> Quantity:
    return Quantity(value=float(x), unit="fraction", digits=digits)


def qtokens(x: float | None) -> Quantity:
    return Quantity(value=float(x or 0.0), unit="tokens/s")


def qcount(n: int) -> Quantity:
    return Quantity(value=int(n), unit="count")


def qelements(n: int) -> Quantity:
    return Quantity(value=int(n), unit="elements")


class Alternative(BaseModel):
    """A suggested change and what the model says it does.

    ``change`` keys: ``micro_batch``, ``grad_accum``, ``checkpointing`` (training), ``stage``, ``hpz_partition_size``,
    ``reduce_bucket_size``, ``reduce_scatter``, ``prefetch_bucket_size``, ``offload_optimizer``/``offload_param``
    (ZeRO config), ``inter_node_GBps_per_gpu`` (the hardware's inter-node link bandwidth).
    ``before``/``after``: ``metric`` on the current plan and on the changed one. ``fits``: the
    changed plan's peak fits GPU memory with the headroom, and host RAM fits.
    """

    change: dict[str, bool | int | float | str]
    metric: Metric
    claim: Claim
    before: float
    after: float
    fits: bool
    after_peak_bytes: int

    @property
    def holds(self) -> bool:
        """The claimed effect is there (by at least MEANINGFUL, relative) and the alternative fits."""
        if not self.fits:
            return False
        if self.claim == "lower":
            return self.after <= (1 - MEANINGFUL) * self.before
        if self.claim == "not_lower":
            return self.after >= (1 - MEANINGFUL) * self.before
        return self.after >= (1 + MEANINGFUL) * self.before
