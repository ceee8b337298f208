"""The SVG canvas the HTML report's charts draw on: ``_Svg`` (elements, title, white background),
``_legend``, axis ticks (linear and log), and the escaping and number formats the charts and the
tables share (GB = 10^9 bytes).

Imports: module level only (the standard library and zeroplan._util).
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Sequence

from zeroplan._util import GB, fmt_gb

__all__: list[str] = []  # internal to the HTML report

_FONT = "font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"


def _e(s: Any) -> str:
    return escape(str(s), quote=True)


def _gb(n: float | None, digits: int = 2) -> str:
    return "—" if n is None else fmt_gb(n, digits)


def _sec(t: float | None) -> str:
    if t is None:
        return "—"
    if t == 0:
        return "0 s"
    if t < 1e-3:
        return f"{t * 1e6:,.1f} µs"
    if t < 1:
        return f"{t * 1e3:,.1f} ms"
    return f"{t:,.2f} s"


def _num(x: float) -> str:
    """Compact SVG coordinate."""
    return f"{x:.1f}".rstrip("0").rstrip(".")


# ---------------------------------------------------------------- axes and ticks


def _nice_step(span: float, target: int = 5) -> float:
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _linear_ticks(hi: float, target: int = 5) -> list[float]:
    if hi <= 0:
        return [0.0, 1.0]
    step = _nice_step(hi, target)
    n = int(math.ceil(hi / step - 1e-9))
    return [i * step for i in range(n + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten covering [lo, hi] (and 2, 5 × when fewer than three decades)."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if b == a:
        b = a + 1
    ticks = [10.0**k for k in range(a, b + 1)]
    if b - a <= 2:
        ticks = sorted(t * m for t in ticks for m in (1, 2, 5) if 10.0**a <= t * m <= 10.0**b)
    return ticks


def _gb_tick(v: float) -> str:
    g = v / GB
    if g >= 1:
        return f"{g:,.0f}"
    return f"{g:.3g}"


class _Svg:
    """Collects SVG elements; ``text()`` closes the document."""

    def __init__(self, width: int, height: int, title: str, ident: str) -> None:
        self.width, self.height, self.ident = width, height, ident
        self.parts = [
            f'<svg id="{_e(ident)}" class="chart" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}" '
            f'style="{_FONT}">',
            f"<title>{_e(title)}</title>",
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
            f'<text x="{width / 2:.0f}" y="22" text-anchor="middle" font-size="16" font-weight="bold" '
            f'fill="#222">{_e(title)}</text>',
        ]

    def add(self, s: str) -> None:
        self.parts.append(s)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#444", width: float = 1,
             dash: str | None = None, extra: str = "") -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" stroke="{stroke}" '
                 f'stroke-width="{width}"{d}{extra}/>')

    def label(self, x: float, y: float, s: str, size: int = 12, anchor: str = "start", fill: str = "#222",
              weight: str = "normal", rotate: float | None = None) -> None:
        rot = f' transform="rotate({rotate} {_num(x)} {_num(y)})"' if rotate is not None else ""
        self.add(f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
                 f'font-weight="{weight}"{rot}>{_e(s)}</text>')

    def rect(self, x: float, y: float, w: float, h: float, fill: str, tip: str | None = None, extra: str = "") -> None:
        t = f"<title>{_e(tip)}</title>" if tip else ""
        self.add(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0))}" height="{_num(max(h, 0))}" '
                 f'fill="{fill}"{extra}>{t}</rect>')

    def text(self) -> str:
        return "\n".join(self.parts + ["</svg>"])


def _legend(svg: _Svg, items: Sequence[tuple[str, str, str]], x0: float, y0: float, max_w: float) -> float:
    """items: (label, colour, kind) with kind 'box', 'line', 'dash', 'hatch:<pattern id>'. Returns the y after it."""
    x, y = x0, y0
    for label, color, kind in items:
        w = 26 + 7.0 * len(label) + 18
        if x + w > x0 + max_w and x > x0:
            x, y = x0, y + 20
        if kind == "box":
            svg.rect(x, y - 10, 14, 12, color)
        elif kind.startswith("hatch:"):
            svg.rect(x, y - 10, 14, 12, color)
            svg.rect(x, y - 10, 14, 12, f"url(#{kind[6:]})")
        else:
            svg.line(x, y - 4, x + 20, y - 4, stroke=color, width=2.5 if kind == "line" else 2,
                     dash="6 4" if kind == "dash" else None)
        svg.label(x + (26 if kind in ("line", "dash") else 20), y, label, size=12)
        x += w
    return y + 20

