"""A self-contained HTML report with inline SVG charts (no scripts, no network, no web fonts).

Input: the report data dict built by ``zeroplan report`` (the same object ``--json`` prints;
schema in ``zeroplan.commands.report``). Byte values in it are integers; charts and tables show
GB = 10^9 bytes, labelled so. Every chart has a title, axes with units and ticks, and a legend;
every chart is followed by a table of the numbers behind it. Table cells carry the exact
value in ``data-value`` (bytes, seconds or a fraction) so tools can read them back.

The SVG fragments are well-formed XML; inline in HTML they need no namespace (so the page holds
no URL at all); ``memory_chart_svg(data, standalone=True)`` is the file ``--svg`` writes.
"""

from __future__ import annotations

import math
import re
from html import escape
from typing import Any, Callable, Sequence

from zeroplan._util import GB, fmt_gb
from zeroplan.report.charts import MEMORY_CATEGORIES, TIME_PARTS

__all__ = [
    "STAGE_COLORS",
    "memory_chart_svg",
    "time_chart_svg",
    "memory_sweep_svg",
    "time_sweep_svg",
    "comm_share_sweep_svg",
    "render_report_html",
]

STAGE_COLORS = {0: "#e15759", 1: "#f28e2b", 2: "#4e79a7", 3: "#59a14f"}
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
_MAX_CAPACITIES_ON_AXIS = 1.5  # the axis ends at 1.5× the GPU memory; longer bars are cut (see memory_chart_svg)


def _e(s: Any) -> str:
    return escape(str(s), quote=True)


_CODE = re.compile(r"`([^`\n]+)`")


def _prose(s: Any) -> str:
    """Escaped text whose `code` spans (the advice names modules in backticks, as in the terminal)
    become <code> elements: no literal markdown in the page."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", _e(s))


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


# ---------------------------------------------------------------- bar charts at the chosen cluster


def _memory_axis_max(peaks: Sequence[float], capacity: float | None) -> float:
    """The axis end (bytes): every peak when none is far past the GPU memory, else clipped at
    ``_MAX_CAPACITIES_ON_AXIS`` × the GPU memory, rounded up to a tick."""
    hi = max(list(peaks) + [capacity or 0]) or 1
    if capacity:
        hi = max(min(hi, _MAX_CAPACITIES_ON_AXIS * capacity), 1.15 * capacity)
    return _linear_ticks(hi / GB)[-1] * GB


def memory_chart_svg(data: dict[str, Any], width: int = 960, standalone: bool = False) -> str:
    """Stacked horizontal bars: per-GPU peak memory by category for each evaluated option,
    with the GPU capacity as a red line; the part of a bar beyond it is hatched.

    The axis is linear (the bars are stacked: a log axis would misstate the share of each
    category) and clipped at 1.5 × the GPU memory, so that the bars that fit or nearly fit keep
    their resolution; a bar that goes past the end is cut with a break mark (//) and labelled
    with its true value. Values sit in a column right of the plot, where no line can cross them;
    an option that does not fit carries a red OOM badge there, and under offload its host RAM
    per node against the node's.

    ``standalone``: an SVG file of its own (XML declaration and the SVG namespace, which an
    SVG file needs and HTML does not; the namespace is an identifier, nothing is fetched)."""
    plans = data["plans"]
    capacity = data["cluster"].get("gpu_memory_bytes")
    axis_max = _memory_axis_max([p["memory"]["peak"] for p in plans], capacity)
    ticks = _linear_ticks(axis_max / GB)
    left, right, top, row_h, bar_h = 190, 290, 50, 50, 28
    plot_w = width - left - right
    height = top + row_h * len(plans) + 60 + 90
    svg = _Svg(width, height, "Per-GPU peak memory by category vs GPU memory", "chart-memory")
    svg.add('<defs><pattern id="hatch-over" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="none"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#7a0000" stroke-width="3"/></pattern></defs>')
    sx = lambda v: left + min(v, axis_max) / axis_max * plot_w  # noqa: E731
    bottom = top + row_h * len(plans)
    for t in ticks:
        x = sx(t * GB)
        svg.line(x, top - 6, x, bottom, stroke="#e3e3e3")
        svg.line(x, bottom, x, bottom + 5)
        svg.label(x, bottom + 19, f"{t:,.0f}", anchor="middle")
    svg.line(left, bottom, left + plot_w, bottom)
    svg.line(left, top - 6, left, bottom)
    svg.label(left + plot_w / 2, bottom + 40, "per-GPU memory at the peak phase, GB (1 GB = 10^9 bytes)",
              anchor="middle", size=13)
    if any(p["memory"]["peak"] > axis_max for p in plans):
        svg.label(left + plot_w / 2, bottom + 58, f"axis cut at {axis_max / GB:,.0f} GB: longer bars are broken (//) "
                  "and labelled with their value", anchor="middle", size=12, fill="#555")
    vx = left + plot_w + 14  # the value column
    for i, p in enumerate(plans):
        y = top + i * row_h + (row_h - bar_h) / 2
        svg.label(left - 10, y + bar_h / 2 + 5, p["label"], anchor="end", size=13, weight="bold")
        acc = 0.0
        for cat in MEMORY_CATEGORIES:
            v = float(p["memory_at_peak"][cat.key])
            if v <= 0:
                continue
            x0, x1 = sx(acc), sx(acc + v)
            if x1 > x0:  # a segment wholly past the axis cut is not drawn (its value is in the table)
                cut = ' data-clipped="1"' if acc + v > axis_max else ""  # drawn up to the axis cut only
                svg.rect(x0, y, x1 - x0, bar_h, cat.color, tip=f"{p['label']} {cat.label}: {_gb(v)}",
                         extra=f' class="seg" data-category="{cat.key}"{cut}')
            acc += v
        peak = p["memory"]["peak"]
        over = bool(capacity and peak > capacity)
        if over:
            svg.rect(sx(capacity), y, sx(peak) - sx(capacity), bar_h, "url(#hatch-over)",
                     tip=f"{p['label']}: {_gb(peak - capacity)} over the GPU memory")
        if peak > axis_max * 1.0001:  # break mark: two white slashes across the bar's end
            xe = sx(axis_max)
            for dx in (-16, -9):
                svg.add(f'<path class="break" d="M{_num(xe + dx)},{_num(y + bar_h + 3)} l6,{-bar_h - 6}" '
                        f'stroke="#ffffff" stroke-width="3.5" fill="none"/>')
        host_over = p.get("host_fits") is False
        tx = vx
        if over or host_over:
            svg.add(f'<g class="oom" data-stage="{p["stage"]}"><rect x="{_num(vx)}" y="{_num(y + 1)}" width="40" '
                    f'height="16" rx="3" fill="#c00000"/><text x="{_num(vx + 20)}" y="{_num(y + 13)}" font-size="11" '
                    f'font-weight="bold" text-anchor="middle" fill="#ffffff">OOM</text></g>')
            tx += 46
        status = ""
        if capacity:
            status = f", {_gb(peak - capacity, 1)} over" if over else f", {_gb(capacity - peak, 1)} free"
        svg.label(tx, y + 13, f"{_gb(peak, 1)}{status}", size=12, fill="#b00000" if over else "#222")
        host = p.get("host_memory_per_node") or 0
        if host and (p["offload_optimizer"] != "none" or p["offload_param"] != "none"):
            ram = p.get("host_ram_per_node_bytes")
            txt = f"host RAM {_gb(host, 0)} of {_gb(ram, 0)} per node" if ram else f"host RAM {_gb(host, 0)} per node"
            svg.label(vx, y + 29, txt + (" (host OOM)" if host_over else ""), size=11,
                      fill="#b00000" if host_over else "#555")
    if capacity:
        x = sx(capacity)
        svg.line(x, top - 14, x, bottom + 2, stroke="#d00000", width=2.5, dash="7 4")
        svg.label(x + 4, top - 16, f"GPU memory {_gb(capacity)}", size=12, fill="#d00000", weight="bold")
    items = [(c.label, c.color, "box") for c in MEMORY_CATEGORIES]
    if capacity:
        items.append(("beyond the GPU memory", "#ffffff", "hatch:hatch-over"))
    _legend(svg, items, left, bottom + 84, plot_w + right - 20)
    text = svg.text()
    if standalone:
        text = ('<?xml version="1.0" encoding="UTF-8"?>\n'
                + text.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1) + "\n")
    return text


def time_chart_svg(data: dict[str, Any], width: int = 960) -> str | None:
    """Stacked horizontal bars of one optimizer step per option: compute, exposed comm (best case),
    extra exposed comm in the worst case. None without times (no hardware profile)."""
    plans = [p for p in data["plans"] if p.get("time")]
    if not plans:
        return None
    totals = [p["time"]["compute_s"] + p["time"]["exposed_worst_s"] for p in plans]
    ticks = _linear_ticks(max(totals) or 1.0)
    axis_max = ticks[-1]
    left, right, top, row_h, bar_h = 190, 250, 50, 46, 28
    plot_w = width - left - right
    height = top + row_h * len(plans) + 60 + 50
    svg = _Svg(width, height, "Time per optimizer step: compute vs exposed communication", "chart-time")
    svg.add('<defs><pattern id="hatch-worst" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f28e2b"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#ffffff" stroke-width="2"/></pattern></defs>')
    sx = lambda v: left + v / axis_max * plot_w  # noqa: E731
    bottom = top + row_h * len(plans)
    for t in ticks:
        x = sx(t)
        svg.line(x, top - 6, x, bottom, stroke="#e3e3e3")
        svg.line(x, bottom, x, bottom + 5)
        svg.label(x, bottom + 19, f"{t:g}", anchor="middle")
    svg.line(left, bottom, left + plot_w, bottom)
    svg.line(left, top - 6, left, bottom)
    svg.label(left + plot_w / 2, bottom + 40, "seconds per optimizer step", anchor="middle", size=13)
    for i, p in enumerate(plans):
        t = p["time"]
        y = top + i * row_h + (row_h - bar_h) / 2
        svg.label(left - 10, y + bar_h / 2 + 5, p["label"], anchor="end", size=13, weight="bold")
        values = t.get("parts") or [t["compute_s"], t["exposed_best_s"], 0.0, 0.0, 0.0,
                                    max(0.0, t["exposed_worst_s"] - t["exposed_best_s"])]
        acc = 0.0
        for part, v in zip(TIME_PARTS, values):
            if v <= 0:
                continue
            fill = "url(#hatch-worst)" if part.key == "worst_extra" else part.color
            svg.rect(sx(acc), y, sx(acc + v) - sx(acc), bar_h, fill, tip=f"{p['label']} {part.label}: {_sec(v)}",
                     extra=f' class="seg" data-part="{part.key}"')
            acc += v
        xm = sx(t["step_time_s"])
        svg.line(xm, y - 4, xm, y + bar_h + 4, stroke="#111", width=2)
        svg.label(sx(acc) + 6, y + bar_h / 2 + 5,
                  f"{_sec(t['step_time_s'])} estimate, comm share {t['comm_share']:.0%}", size=12)
    items = [(part.label, part.color, "hatch:hatch-worst" if part.key == "worst_extra" else "box")
             for part in TIME_PARTS]
    items.append(("estimate (overlap schedule)", "#111", "line"))
    _legend(svg, items, left, bottom + 66, plot_w + right - 20)
    return svg.text()


# ---------------------------------------------------------------- line charts over the sweeps


def _coinciding(series: Sequence[dict[str, Any]], rel_tol: float = 1e-3) -> dict[str, str]:
    """{name: name of a later series drawn on top of it} for series whose values are all equal
    within ``rel_tol``; the hidden one is drawn wider so both stay visible."""
    out: dict[str, str] = {}
    for i, a in enumerate(series):
        for b in series[i + 1:]:
            if bool(a.get("dash")) != bool(b.get("dash")):
                continue
            pairs = list(zip(a["values"], b["values"]))
            if pairs and all(x is not None and y is not None and abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-30)
                             for x, y in pairs):
                out[a["name"]] = b["name"]
                break
    return out


def _line_chart(
    *,
    ident: str,
    title: str,
    xs: Sequence[float],
    series: Sequence[dict[str, Any]],
    x_label: str,
    y_label: str,
    log_y: bool,
    y_fmt: Callable[[float], str],
    hline: tuple[float, str] | None = None,
    y_max: float | None = None,
    width: int = 960,
    height: int = 520,
) -> str:
    """series: {name, color, dash (bool), values (list, None = missing), band (optional (lo, hi) lists)}.
    x is always log2-spaced (1, 2, 4, ...)."""
    left, right, top, bottom_pad = 90, 30, 46, 0
    legend_rows = 1 + (len(series) + (1 if hline else 0)) // 4
    plot_h = height - top - 70 - 22 * legend_rows
    plot_w = width - left - right
    x_lo, x_hi = math.log2(xs[0]), math.log2(xs[-1])
    if x_hi == x_lo:
        x_hi = x_lo + 1
    sx = lambda x: left + (math.log2(x) - x_lo) / (x_hi - x_lo) * plot_w  # noqa: E731
    vals = [v for s in series for v in s["values"] if v is not None and v > 0]
    for s in series:
        if s.get("band"):
            vals += [v for v in s["band"][1] if v is not None and v > 0]
    if hline:
        vals.append(hline[0])
    if log_y:
        lo, hi = min(vals), max(vals)
        ticks = _log_ticks(lo, hi)
        y_lo, y_hi = math.log10(ticks[0]), math.log10(ticks[-1])
        sy = lambda v: top + plot_h - (math.log10(max(v, ticks[0])) - y_lo) / (y_hi - y_lo) * plot_h  # noqa: E731
    else:
        ticks = _linear_ticks(y_max if y_max is not None else (max(vals) if vals else 1.0))
        hi = ticks[-1]
        sy = lambda v: top + plot_h - v / hi * plot_h  # noqa: E731
    svg = _Svg(width, height, title, ident)
    bottom = top + plot_h
    for t in ticks:
        y = sy(t)
        svg.line(left, y, left + plot_w, y, stroke="#e6e6e6")
        svg.line(left - 5, y, left, y)
        svg.label(left - 8, y + 4, y_fmt(t), anchor="end")
    for x in xs:
        px = sx(x)
        svg.line(px, top, px, bottom, stroke="#f0f0f0")
        svg.line(px, bottom, px, bottom + 5)
        svg.label(px, bottom + 19, f"{x:,}", anchor="middle")
    svg.line(left, bottom, left + plot_w, bottom)
    svg.line(left, top, left, bottom)
    svg.label(left + plot_w / 2, bottom + 40, x_label, anchor="middle", size=13)
    svg.label(20, top + plot_h / 2, y_label, anchor="middle", size=13, rotate=-90)
    for s in series:
        band = s.get("band")
        if band:
            pts_hi = [(sx(x), sy(h)) for x, h in zip(xs, band[1]) if h is not None]
            pts_lo = [(sx(x), sy(lo_)) for x, lo_ in zip(xs, band[0]) if lo_ is not None]
            if pts_hi and pts_lo:
                pts = pts_hi + pts_lo[::-1]
                svg.add(f'<polygon points="{" ".join(f"{_num(a)},{_num(b)}" for a, b in pts)}" fill="{s["color"]}" '
                        f'fill-opacity="0.15" stroke="none"/>')
    if hline:
        y = sy(hline[0])
        svg.line(left, y, left + plot_w, y, stroke="#111111", width=2, dash="12 4 2 4")
        svg.label(left + plot_w - 4, y - 6, hline[1], anchor="end", fill="#111111", weight="bold")
    same = _coinciding(series)
    for s in series:
        pts = [(sx(x), sy(v), x, v) for x, v in zip(xs, s["values"]) if v is not None and (v > 0 or not log_y)]
        if not pts:
            continue
        dash = ' stroke-dasharray="7 5"' if s.get("dash") else ""
        svg.add(f'<polyline class="series" data-series="{_e(s["name"])}" points="'
                + " ".join(f"{_num(a)},{_num(b)}" for a, b, _, _ in pts)
                + f'" fill="none" stroke="{s["color"]}" stroke-width="{6.5 if s["name"] in same else 2.5}"{dash}/>')
        for a, b, x, v in pts:
            fill = "#ffffff" if s.get("dash") else s["color"]
            svg.add(f'<circle cx="{_num(a)}" cy="{_num(b)}" r="3.5" fill="{fill}" stroke="{s["color"]}" '
                    f'stroke-width="1.5"><title>{_e(s["name"])} at {x:,}: {_e(y_fmt(v))}</title></circle>')
    items = [(s["name"] + (f" (= {same[s['name']]})" if s["name"] in same else ""), s["color"],
              "dash" if s.get("dash") else "line") for s in series]
    if hline:
        items.append((hline[1], "#111111", "dash"))
    _legend(svg, items, left, bottom + 66, plot_w)
    return svg.text()


def memory_sweep_svg(data: dict[str, Any]) -> str:
    """Per-GPU model states (solid) and peak (dashed) vs number of GPUs for each stage, log-log,
    with the GPU capacity line — the shape of the ZeRO paper's Figure 1."""
    sw = data["memory_sweep"]
    series = []
    for s in sw["series"]:
        color = STAGE_COLORS.get(s["stage"], "#333")
        series.append({"name": f"{s['label']} model states", "color": color, "dash": False, "values": s["model_states"]})
        series.append({"name": f"{s['label']} peak", "color": color, "dash": True, "values": s["peak"]})
    cap = data["cluster"].get("gpu_memory_bytes")
    return _line_chart(
        ident="chart-memory-sweep", title="Per-GPU memory vs number of data-parallel GPUs",
        xs=sw["gpus"], series=series,
        x_label=f"data-parallel GPUs (log scale; {sw['gpus_per_node']} per node)",
        y_label="GB per GPU (10^9 bytes), log scale", log_y=True, y_fmt=_gb_tick,
        hline=(cap, f"GPU memory {_gb(cap)}") if cap else None,
    )


def time_sweep_svg(data: dict[str, Any]) -> str | None:
    """Estimated step time vs nodes for each stage; the shaded band spans best to worst overlap."""
    sw = data.get("time_sweep")
    if not sw:
        return None
    series = [{"name": s["label"], "color": STAGE_COLORS.get(s["stage"], "#333"), "dash": False,
               "values": s["step_time_s"], "band": (s["step_time_best_s"], s["step_time_worst_s"])}
              for s in sw["series"]]
    return _line_chart(
        ident="chart-time-sweep", title="Step time vs number of nodes (band: best to worst overlap)",
        xs=sw["nodes"], series=series,
        x_label=f"nodes (log scale; {sw['gpus_per_node']} GPUs each, micro-batch per GPU fixed)",
        y_label="seconds per optimizer step", log_y=False, y_fmt=lambda v: f"{v:g}",
    )


def comm_share_sweep_svg(data: dict[str, Any]) -> str | None:
    """Share of the estimated step time spent in exposed communication vs nodes, per stage."""
    sw = data.get("time_sweep")
    if not sw:
        return None
    series = [{"name": s["label"], "color": STAGE_COLORS.get(s["stage"], "#333"), "dash": False,
               "values": [v * 100 for v in s["comm_share"]]} for s in sw["series"]]
    return _line_chart(
        ident="chart-comm-share", title="Exposed communication share of the step vs number of nodes",
        xs=sw["nodes"], series=series, x_label=f"nodes (log scale; {sw['gpus_per_node']} GPUs each)",
        y_label="comm share of step time, %", log_y=False, y_fmt=lambda v: f"{v:g}%", y_max=100.0, height=440,
    )


# ---------------------------------------------------------------- tables and page


def _td(text: str, value: Any = None, **attrs: Any) -> str:
    a = "".join(f' data-{k.replace("_", "-")}="{_e(v)}"' for k, v in attrs.items())
    if value is not None:
        a += f' data-value="{_e(value)}"'
    return f"<td{a}>{_e(text)}</td>"


def _table(ident: str, caption: str, head: Sequence[str], rows: Sequence[str]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return (f'<table id="{ident}"><caption>{_e(caption)}</caption><thead><tr>{th}</tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def _memory_table(data: dict[str, Any]) -> str:
    cats = [c for c in MEMORY_CATEGORIES]
    ram = next((p.get("host_ram_per_node_bytes") for p in data["plans"] if p.get("host_ram_per_node_bytes")), None)
    ram_of = f", of {ram / GB:,.0f}" if ram else ""
    head = (["option"] + [f"{c.label} at peak (GB)" for c in cats]
            + ["peak (GB)", "peak phase", "fits", "model states, steady (GB)", "host RAM per node (GB)" + ram_of,
               "host RAM fits"])
    rows = []
    for p in data["plans"]:
        m = p["memory_at_peak"]
        cells = [f"<th>{_e(p['label'])}</th>"]
        cells += [_td(f"{m[c.key] / GB:,.2f}", m[c.key], key=c.key, stage=p["stage"]) for c in cats]
        cells.append(_td(f"{m['peak'] / GB:,.2f}", m["peak"], key="peak", stage=p["stage"]))
        cells.append(_td(p["peak_phase"]))
        fits = p.get("fits")
        cells.append(_td("—" if fits is None else ("yes" if fits else "NO"), None if fits is None else int(fits),
                         key="fits", stage=p["stage"]))
        ms = p["memory"]["model_states"]
        cells.append(_td(f"{ms / GB:,.2f}", ms, key="model_states", stage=p["stage"]))
        host = p.get("host_memory_per_node")
        cells.append(_td("—" if host is None else f"{host / GB:,.2f}", host, key="host_memory_per_node",
                         stage=p["stage"]))
        hf = p.get("host_fits")
        cells.append(_td("—" if hf is None else ("yes" if hf else "NO"), None if hf is None else int(hf),
                         key="host_fits", stage=p["stage"]))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-memory", "Per-GPU memory live in the peak phase, by category (GB = 10^9 bytes; data-value: bytes). Model states "
                  "(steady state: parameters + gradients + optimizer states, as the ZeRO paper counts them) for comparison", head, rows)


def _time_table(data: dict[str, Any]) -> str:
    head = ["option", "compute (s)", "exposed comm best (s)", "exposed comm worst (s)", "comm serial (s)",
            "step estimate (s)", "comm share", "tokens/s (cluster)", "sent per GPU per step (GB)"]
    rows = []
    for p in data["plans"]:
        t = p.get("time")
        if not t:
            continue
        st = p["stage"]
        rows.append("<tr>" + f"<th>{_e(p['label'])}</th>" + "".join([
            _td(f"{t['compute_s']:.4g}", t["compute_s"], key="compute_s", stage=st),
            _td(f"{t['exposed_best_s']:.4g}", t["exposed_best_s"], key="exposed_best_s", stage=st),
            _td(f"{t['exposed_worst_s']:.4g}", t["exposed_worst_s"], key="exposed_worst_s", stage=st),
            _td(f"{t['comm_s']:.4g}", t["comm_s"], key="comm_s", stage=st),
            _td(f"{t['step_time_s']:.4g}", t["step_time_s"], key="step_time_s", stage=st),
            _td(f"{t['comm_share']:.1%}", t["comm_share"], key="comm_share", stage=st),
            _td(f"{t['tokens_per_s']:,.0f}", t["tokens_per_s"], key="tokens_per_s", stage=st),
            _td(f"{p['comm_bytes_per_gpu_per_step'] / GB:,.2f}", p["comm_bytes_per_gpu_per_step"],
                key="comm_bytes_per_gpu_per_step", stage=st),
        ]) + "</tr>")
    return _table("table-time", "Time per optimizer step (seconds; comm share = exposed comm / step estimate)",
                  head, rows)


def _memory_sweep_table(data: dict[str, Any]) -> str:
    sw = data["memory_sweep"]
    head = ["GPUs"]
    for s in sw["series"]:
        head += [f"{s['label']} model states (GB)", f"{s['label']} peak (GB)"]
    rows = []
    for i, g in enumerate(sw["gpus"]):
        cells = [f'<th data-gpus="{g}">{g:,}</th>']
        for s in sw["series"]:
            ms, pk = s["model_states"][i], s["peak"][i]
            cells.append(_td(f"{ms / GB:,.2f}", ms, key="model_states", stage=s["stage"], gpus=g))
            cells.append(_td(f"{pk / GB:,.2f}", pk, key="peak", stage=s["stage"], gpus=g))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-memory-sweep", "Per-GPU memory vs GPUs (GB = 10^9 bytes; data-value: bytes)", head, rows)


def _time_sweep_table(data: dict[str, Any]) -> str:
    sw = data["time_sweep"]
    head = ["nodes", "GPUs"]
    for s in sw["series"]:
        head += [f"{s['label']} step (s)", f"{s['label']} comm share"]
    rows = []
    for i, (n, g) in enumerate(zip(sw["nodes"], sw["gpus"])):
        cells = [f'<th data-nodes="{n}">{n:,}</th>', f"<td>{g:,}</td>"]
        for s in sw["series"]:
            t, c = s["step_time_s"][i], s["comm_share"][i]
            cells.append(_td(f"{t:.4g}", t, key="step_time_s", stage=s["stage"], nodes=n))
            cells.append(_td(f"{c:.1%}", c, key="comm_share", stage=s["stage"], nodes=n))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-time-sweep", "Step time and exposed-comm share vs nodes", head, rows)


def _inputs_section(data: dict[str, Any]) -> str:
    m, c, t = data["model"], data["cluster"], data["training"]
    bpp = t["bytes_per_param"]
    pairs = [
        ("model", f"{m['name']} ({m['model_type']}; source {m['source']})"),
        ("parameters", f"{m['params']:,}" + (" (approximate shape)" if m.get("approximate") else "")),
        ("largest module", f"{m['largest_layer_name']}: {m['largest_layer_params']:,} parameters"),
        ("hardware", c.get("hardware") or "none given (no capacity line, no times)"),
        ("GPU", f"{c['gpu']}, {_gb(c['gpu_memory_bytes'])} ({c['gpu_memory_bytes'] / 2**30:,.2f} GiB)"
         if c.get("gpu") else "—"),
        ("cluster", f"{c['n_gpus']:,} GPUs = {c['nodes']:,} node(s) × {c['gpus_per_node']}"),
        ("precision", f"{t['precision']} ({t['precision_source']})"),
        ("bytes per parameter", f"params {bpp['params']}, gradients {bpp['gradients']}, optimizer states "
                                f"{bpp['optimizer_states']:g}"),
        ("optimizer", t["optimizer"]),
        ("batch", f"micro-batch {t['micro_batch']} × {t['seq_len']:,} tokens, gradient accumulation {t['grad_accum']}"),
        ("activations", f"checkpointing {t['checkpointing']}, flash attention {'on' if t['flash_attention'] else 'off'}"),
        ("comm model", data["comm_model"]),
        ("MFU", f"{data['mfu']:g} (--mfu)" if data.get("mfu") is not None else "compute model (core/compute.py)"),
        ("sweep", f"memory: 1 … {data['memory_sweep']['gpus'][-1]:,} GPUs; time: 1 … {data['max_nodes']:,} nodes"),
    ]
    for k, v in data.get("inputs", {}).items():
        if k in ("ds_config", "offload_optimizer", "offload_param", "stage") and v is not None:
            pairs.append((f"--{k.replace('_', '-')}", str(v)))
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)
    notes = list(dict.fromkeys(data.get("assumptions", []) + data.get("notes", [])))
    items = "".join(f"<li>{_prose(n)}</li>" for n in notes) or "<li>none</li>"
    reasons = "".join(f"<li><b>{_e(p['label'])}</b>: {_prose(p['peak_reason'])}</li>" for p in data["plans"])
    return (f'<section id="inputs"><h2>Inputs and assumptions</h2><table id="table-inputs">{rows}</table>'
            f"<h3>Assumptions and notes</h3><ul>{items}</ul><h3>What sets each peak</h3><ul>{reasons}</ul></section>")


def _recommendation_section(data: dict[str, Any]) -> str:
    """What ``zeroplan recommend`` chooses for the same inputs, and why (its explanation sentences)."""
    rec = data.get("recommendation")
    if not rec:
        return ('<section id="recommendation"><h2>Recommendation</h2><p>No recommendation: it needs a hardware '
                "profile (--hardware).</p></section>")
    c = rec.get("chosen")
    out = ['<section id="recommendation"><h2>Recommendation</h2>']
    if c is None:
        out.append('<p class="chosen"><b>Nothing fits</b> on this cluster with the searched settings.</p>')
    else:
        pairs = [
            ("configuration", c["label"]),
            ("micro-batch per GPU", f"{c['micro_batch']:,}"),
            ("activation checkpointing", c["checkpointing"]),
            ("reduce_bucket_size", f"{c['reduce_bucket_size']:,} elements"),
        ]
        if c["stage"] == 3:
            pairs.append(("stage3_prefetch_bucket_size", f"{c['prefetch_bucket_size']:,} elements"))
            if c.get("hpz_partition_size", 1) > 1:
                pairs.append(("zero_hpz_partition_size (hpZ)", f"{c['hpz_partition_size']}"))
        pairs += [
            ("peak per GPU", f"{_gb(c['peak_bytes'])} of {_gb(c['gpu_memory_bytes'])} ({_gb(c['headroom_bytes'])} free)"),
            ("host RAM per node", _gb(c["host_per_node_bytes"])),
            ("step time", _sec(c.get("step_time_s"))),
            ("useful throughput", f"{c['tokens_per_s']:,.0f} tokens/s (cluster)" if c.get("tokens_per_s") else "—"),
        ]
        rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)
        out.append(f'<p class="chosen">Recommended: <b>{_e(c["label"])}</b>, micro-batch {c["micro_batch"]}, '
                   f"checkpointing {_e(c['checkpointing'])}.</p>")
        out.append(f'<table id="table-recommendation">{rows}</table>')
    # the first sentence restates the choice shown above
    sentences = [x for x in rec.get("explanation", []) if not (c is not None and x.startswith("Recommended:"))]
    why = "".join(f"<li>{_prose(x.strip())}</li>" for x in sentences)
    out.append(f'<h3>Why</h3><ul id="recommendation-reasons">{why}</ul>')
    if rec.get("warnings"):
        warn = "".join(f"<li>{_prose(x)}</li>" for x in rec["warnings"])
        out.append(f'<h3>Warnings</h3><ul id="recommendation-warnings" class="warn">{warn}</ul>')
    out.append("</section>")
    return "".join(out)


_CSS = """
body{%s;margin:24px auto;max-width:1000px;color:#222;background:#fff;line-height:1.4}
h1{font-size:24px;margin-bottom:4px}h2{margin-top:36px;border-bottom:1px solid #ccc;padding-bottom:4px}
.sub{color:#555;margin-top:0}
table{border-collapse:collapse;margin:12px 0;font-size:13px}
caption{text-align:left;font-weight:bold;padding:4px 0}
th,td{border:1px solid #ddd;padding:3px 8px}td{text-align:right;font-variant-numeric:tabular-nums}
#table-inputs td,#table-recommendation td{text-align:left}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:90%%;background:#f4f4f4;padding:0 3px}
.chosen{font-size:16px}.warn li{color:#8a4b00}thead th{background:#f4f4f4}tbody th{text-align:left;background:#fafafa}
.figure{overflow-x:auto}svg.chart{display:block;max-width:100%%;height:auto;border:1px solid #eee;margin:8px 0}
.units{color:#555;font-size:13px}
""" % _FONT


def render_report_html(data: dict[str, Any]) -> str:
    """The whole self-contained HTML page (UTF-8 text) for the report data dict."""
    from zeroplan import __version__ as version  # type: ignore[attr-defined]

    m, c = data["model"], data["cluster"]
    title = f"zeroplan report: {m['name']} on {c.get('hardware') or 'no hardware profile'}, {c['n_gpus']:,} GPUs"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"/>',
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">Generated by zeroplan {_e(version)}. Units: GB = 10<sup>9</sup> bytes, GiB = '
        f"2<sup>30</sup> bytes; times in seconds per optimizer step. Everything in this file is inline: it "
        f"needs no network.</p>",
        _recommendation_section(data),
        '<section id="memory"><h2>Per-GPU memory at the chosen cluster</h2>',
        '<p class="units">Each bar is the peak over forward, backward and optimizer step, split into what is '
        "live in that phase (e.g. ZeRO-1/2's gradient partition is not yet allocated at the start of backward, "
        "where the activations peak), plus the profile's overhead allowance (CUDA context, NCCL, "
        "fragmentation).</p>",
        f'<div class="figure">{memory_chart_svg(data)}</div>',
        _memory_table(data),
        "</section>",
        _inputs_section(data),
    ]
    tsvg = time_chart_svg(data)
    parts.append('<section id="time"><h2>Compute vs communication per step</h2>')
    if tsvg:
        parts += ['<p class="units">Best case: overlappable collectives hide behind the compute of their phase; '
                  "worst case: nothing overlaps. The estimate is the mean of the two.</p>",
                  f'<div class="figure">{tsvg}</div>', _time_table(data)]
    else:
        parts.append("<p>No times: no hardware profile was given.</p>")
    parts.append("</section>")
    parts += [
        '<section id="memory-sweep"><h2>Per-GPU memory vs number of GPUs</h2>',
        '<p class="units">Solid: model states (parameters + gradients + optimizer states, as the ZeRO paper counts '
        "them); dashed: zeroplan's peak (with buffers, activations and overhead). GPUs fill nodes of "
        f"{data['memory_sweep']['gpus_per_node']}.</p>",
        f'<div class="figure">{memory_sweep_svg(data)}</div>',
        _memory_sweep_table(data),
        "</section>",
    ]
    parts.append('<section id="time-sweep"><h2>Step time and communication share vs number of nodes</h2>')
    if data.get("time_sweep"):
        parts += [f'<div class="figure">{time_sweep_svg(data)}</div>',
                  f'<div class="figure">{comm_share_sweep_svg(data)}</div>', _time_sweep_table(data)]
    else:
        parts.append("<p>No times: no hardware profile was given.</p>")
    parts += ["</section>", "</body></html>", ""]
    return "\n".join(parts)
