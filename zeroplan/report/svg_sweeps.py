"""The HTML report's line charts over the sweeps: per-GPU memory vs GPUs (the shape of the ZeRO
paper's Figure 1), step time vs nodes with its best-to-worst overlap band, and the exposed
communication share vs nodes; one line per ZeRO stage.

Imports: module level only.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from zeroplan.report.svg import _e, _gb, _gb_tick, _legend, _linear_ticks, _log_ticks, _num, _Svg

__all__ = ["STAGE_COLORS", "memory_sweep_svg", "time_sweep_svg", "comm_share_sweep_svg"]

STAGE_COLORS = {0: "#e15759", 1: "#f28e2b", 2: "#4e79a7", 3: "#59a14f"}


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
    left, right, top = 90, 30, 46
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

