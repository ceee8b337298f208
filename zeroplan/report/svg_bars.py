"""The HTML report's bar charts at the chosen cluster: per-GPU peak memory by category against the
GPU memory (``memory_chart_svg``, also the file ``--svg`` writes) and one optimizer step's compute
against exposed communication (``time_chart_svg``).

Imports: module level only.
"""

from __future__ import annotations

from typing import Any, Sequence

from zeroplan._util import GB
from zeroplan.report.charts import MEMORY_CATEGORIES, TIME_PARTS
from zeroplan.report.svg import _gb, _legend, _linear_ticks, _num, _sec, _Svg

__all__ = ["memory_chart_svg", "time_chart_svg"]

_MAX_CAPACITIES_ON_AXIS = 1.5  # the axis ends at 1.5× the GPU memory; longer bars are cut (see memory_chart_svg)


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
        parts = t.get("parts") or {"compute": t["compute_s"], "exposed_comm": t["exposed_best_s"],
                                   "worst_extra": max(0.0, t["exposed_worst_s"] - t["exposed_best_s"])}
        values = [float(parts.get(part.key, 0.0)) for part in TIME_PARTS]
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

