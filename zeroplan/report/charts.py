"""Terminal charts (rich): per-GPU memory by category vs GPU capacity, and compute vs comm time.

Both charts are horizontal bars, one per evaluated (stage, offload) option, sized to
``console.width``. Units: GB = 10^9 bytes (never GiB), seconds. When the console has no
colour (``console.color_system is None``, e.g. output piped to a file or NO_COLOR) or cannot
encode box-drawing characters, the bars fall back to plain ASCII: one letter per category,
lower-case beyond the GPU's capacity, ``|`` at the capacity.

Both renderers accept an ``EstimateResult`` (anything with ``.stages``, a list of Plans) or a
plain list of Plans.

Lazy import: ``rich.text`` inside each renderer, so that importing this module (the HTML report
reads its category and colour tables) does not import rich.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from zeroplan._util import GB

__all__ = [
    "MEMORY_CATEGORIES",
    "TIME_PARTS",
    "time_parts",
    "render_memory_bars",
    "memory_at_peak",
    "render_time_bars",
    "stage_label",
    "use_ascii",
]


@dataclass(frozen=True)
class _Part:
    key: str  # attribute name (memory) or part name (time)
    label: str
    color: str  # hex fill in the HTML report
    term: str  # rich colour name for the terminal: one of the 16 standard colours, so that
    #            parts stay distinct on 8/16-colour terminals too (hex would collapse to grey)
    letter: str  # ASCII fallback glyph (upper case; lower case past the capacity)


# Order = stacking order, left to right. The HTML report uses the same hues.
MEMORY_CATEGORIES: tuple[_Part, ...] = (
    _Part("params", "parameters", "#4e79a7", "blue", "P"),
    _Part("gradients", "gradients", "#59a14f", "green", "G"),
    _Part("optimizer_states", "optimizer states", "#b07aa1", "magenta", "O"),
    _Part("buffers", "buffers", "#edc948", "yellow", "B"),
    _Part("activations", "activations", "#76b7b2", "cyan", "A"),
    _Part("overhead", "overhead", "#9c9c9c", "bright_black", "X"),
)

TIME_PARTS: tuple[_Part, ...] = (
    _Part("compute", "compute (with overlap slowdown)", "#59a14f", "green", "C"),
    _Part("exposed_comm", "exposed comm (schedule)", "#e15759", "red", "E"),
    _Part("gpu_optimizer", "GPU optimizer step", "#76b7b2", "cyan", "S"),
    _Part("pcie", "offload PCIe copies", "#4e79a7", "blue", "P"),
    _Part("cpu_optimizer", "CPU optimizer step", "#b07aa1", "magenta", "O"),
    _Part("nvme", "NVMe swap", "#9c755f", "bright_black", "N"),
    _Part("host_wait", "GPU waiting for DeepSpeed's stage-3 hooks (host-bound)", "#ff9da7", "bright_red", "H"),
    _Part("worst_extra", "extra exposed comm if nothing overlaps", "#f28e2b", "yellow", "w"),
)

# Axis of the memory chart: at most this many GPU capacities wide, so one huge ZeRO-0 bar does
# not squash the others; longer bars are cut at the axis end and marked.
_MAX_CAPACITIES_ON_AXIS = 4.0


def _plans(result_or_plans: Any) -> list[Any]:
    return list(getattr(result_or_plans, "stages", result_or_plans))


def memory_at_peak(p: Any) -> dict[str, int]:
    """Per-GPU bytes by category live in the peak phase, plus the overhead allowance; they add
    up to ``p.memory.peak``. (The Plan's top-level params/gradients/optimizer_states are the
    steady-state model states; e.g. ZeRO-1/2's gradient partition is not yet live at the start
    of backward, where the activation peak is.)"""
    m = p.memory
    phases = getattr(m, "phases", None)
    if phases and getattr(m, "peak_phase", None) in phases:
        cats = dict(phases[m.peak_phase].by_category)
    else:
        cats = {c.key: int(getattr(m, c.key)) for c in MEMORY_CATEGORIES if c.key != "overhead"}
    out = {c.key: int(cats.get(c.key, 0)) for c in MEMORY_CATEGORIES if c.key != "overhead"}
    out["overhead"] = int(m.overhead)
    return out


def stage_label(p: Any, ascii_only: bool = False) -> str:
    """'ZeRO-3', 'ZeRO-3 (opt→cpu, param→nvme)' — ASCII arrows (``->``) only when ``ascii_only``
    (a console that cannot show them); the terminal table, recommend and the HTML all use →."""
    arrow = "->" if ascii_only else "→"
    extra = []
    if p.offload_optimizer != "none":
        extra.append(f"opt{arrow}{p.offload_optimizer}")
    if p.offload_param != "none":
        extra.append(f"param{arrow}{p.offload_param}")
    return f"ZeRO-{p.stage}" + (f" ({', '.join(extra)})" if extra else "")


def use_ascii(con: Any) -> bool:
    """Plain ASCII when the console has no colour or its encoding cannot show block characters."""
    enc = (getattr(con, "encoding", "") or "").lower()
    return con.color_system is None or not enc.startswith("utf")


def _gb_text(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def _text_from_cells(prefix: str, cells: list[tuple[str, str]]) -> Any:
    """A rich Text from (glyph, style) cells, merging runs of one style (short ANSI output)."""
    from rich.text import Text

    line = Text(prefix)
    run, style = "", None
    for ch, st in cells:
        if st != style and run:
            line.append(run, style=style or "")
            run = ""
        run += ch
        style = st
    if run:
        line.append(run, style=style or "")
    return line


MAX_CHART_WIDTH = 400  # columns: a wider terminal (or COLUMNS=999999999) gets a 400-column chart


def _layout(con: Any, labels: Sequence[str], suffixes: Sequence[str]) -> tuple[int, int, bool]:
    """(label width, bar width, suffix on its own line?) for the console width."""
    width = min(max(40, int(con.width)), MAX_CHART_WIDTH)
    label_w = max(len(s) for s in labels) if labels else 6
    suffix_w = max(len(s) for s in suffixes) if suffixes else 0
    bar_w = width - label_w - 2 - suffix_w - 1
    if bar_w >= 24:
        return label_w, bar_w, False
    return label_w, max(10, width - label_w - 2), True


def _scale_cells(values: Sequence[float], axis_max: float, bar_w: int) -> list[int]:
    """Cumulative rounding so segments add up to the rounded total (no drift)."""
    cells, acc, prev = [], 0.0, 0
    for v in values:
        acc += max(0.0, v)
        end = int(round(min(acc, axis_max) / axis_max * bar_w)) if axis_max > 0 else 0
        cells.append(end - prev)
        prev = end
    return cells


def _axis_line(label_w: int, bar_w: int, axis_max: float, fmt, ascii_only: bool) -> list[str]:
    """A baseline with 5 ticks and their labels, aligned under the bars."""
    ticks = [i / 4 for i in range(5)]
    base = ["-" if ascii_only else "─"] * bar_w
    for t in ticks:
        pos = min(bar_w - 1, int(round(t * (bar_w - 1))))
        base[pos] = "+" if ascii_only else "┼"
    labels = [" "] * (bar_w + 12)
    for t in ticks:
        text = fmt(t * axis_max)
        pos = min(bar_w - 1, int(round(t * (bar_w - 1))))
        start = max(0, min(pos - len(text) // 2, bar_w + 12 - len(text)))
        if t == 0:
            start = 0
        if any(c != " " for c in labels[max(0, start - 1): start + len(text) + 1]):
            continue
        labels[start: start + len(text)] = list(text)
    pad = " " * (label_w + 2)
    return [pad + "".join(base), pad + "".join(labels).rstrip()]


def render_memory_bars(con: Any, result: Any, *, title: str | None = None) -> None:
    """Stacked bars of per-GPU peak memory by category for each stage, against the GPU capacity.

    Segments: parameters, gradients, optimizer states, buffers and activations live in the
    peak phase (``memory_at_peak``), and the framework overhead allowance; they add up to the
    peak. A marker shows the
    GPU's memory (``gpu_memory_bytes`` of the Plan); the part of a bar beyond it is drawn in a
    shaded glyph (lower-case letters in ASCII) and the row says by how much it is over.
    """
    from rich.text import Text

    plans = _plans(result)
    if not plans:
        return
    ascii_only = use_ascii(con)
    capacity = next((p.gpu_memory_bytes for p in plans if p.gpu_memory_bytes), None)
    peaks = [float(p.memory.peak) for p in plans]
    axis_max = max(peaks + [float(capacity or 0)])
    if capacity:
        axis_max = min(axis_max, _MAX_CAPACITIES_ON_AXIS * capacity)
        axis_max = max(axis_max, 1.15 * capacity)
    labels = [stage_label(p, ascii_only) for p in plans]
    suffixes = []
    for p in plans:
        s = _gb_text(p.memory.peak)
        if capacity:
            over = p.memory.peak - capacity
            s += f"  OVER by {_gb_text(over)}" if over > 0 else f"  fits, {_gb_text(-over)} free"
        suffixes.append(s)
    label_w, bar_w, wrap = _layout(con, labels, [s + " >>" for s in suffixes])
    cap_cell = int(round(capacity / axis_max * bar_w)) if capacity else None

    head = title or "Per-GPU peak memory by category (GB = 10^9 bytes)"
    con.print(Text(head, style="bold"))
    for p, label, suffix in zip(plans, labels, suffixes):
        at_peak = memory_at_peak(p)
        values = [float(at_peak[c.key]) for c in MEMORY_CATEGORIES]
        cells = _scale_cells(values, axis_max, bar_w)
        cells_out: list[tuple[str, str]] = []
        col = 0
        for cat, n in zip(MEMORY_CATEGORIES, cells):
            for _ in range(n):
                past = cap_cell is not None and col >= cap_cell
                if cap_cell is not None and col == cap_cell:
                    cells_out.append(("|" if ascii_only else "┃", "bold red"))
                elif ascii_only:
                    cells_out.append((cat.letter.lower() if past else cat.letter, ""))
                else:
                    cells_out.append(("▓", f"{cat.term} on dark_red") if past else ("█", cat.term))
                col += 1
        while col < bar_w:
            if cap_cell is not None and col == cap_cell:
                cells_out.append(("|" if ascii_only else "┃", "bold red"))
            else:
                cells_out.append((" ", ""))
            col += 1
        if sum(values) > axis_max * 1.0001:
            cells_out.append((">>" if ascii_only else "»", "bold red"))
        line = _text_from_cells(label.ljust(label_w) + "  ", cells_out)
        over = capacity is not None and p.memory.peak > capacity
        if wrap:
            con.print(line, no_wrap=True, overflow="crop")
            line = Text(" " * (label_w + 2))
        line.append(" " + suffix, style="bold red" if over else ("green" if capacity else ""))
        con.print(line, no_wrap=True, overflow="crop")
    for row in _axis_line(label_w, bar_w, axis_max, lambda v: f"{v / GB:,.0f}", ascii_only):
        con.print(Text(row, style="dim"), no_wrap=True, overflow="crop")

    legend = Text(" " * (label_w + 2))
    for cat in MEMORY_CATEGORIES:
        if ascii_only:
            legend.append(f"{cat.letter}={cat.label}  ")
        else:
            legend.append("█", style=cat.term)
            legend.append(f" {cat.label}  ")
    con.print(legend)
    notes = ["x axis: GB per GPU (10^9 bytes)"]
    if capacity:
        mark = "|" if ascii_only else "┃"
        shade = "lower case" if ascii_only else "▓ on red"
        notes.append(f"{mark} GPU memory {_gb_text(capacity)}; {shade} = beyond it")
    if any(pk > axis_max * 1.0001 for pk in peaks):
        notes.append(f"{'>>' if ascii_only else '»'} = bar cut at the axis end")
    con.print(Text(" " * (label_w + 2) + "; ".join(notes), style="dim"))


def time_parts(t: Any) -> list[float]:
    """Seconds per TIME_PARTS entry for a TimeEstimate: all but the last add up to the estimate
    (``step_time_s``); with the last (what no overlap at all adds) they add up to the worst case."""
    exp = t.exposed_time_s
    est = float(exp.get("estimate", (exp["best"] + exp["worst"]) / 2))
    slow = float(getattr(t, "overlap_slowdown_s", 0.0))
    host = float(getattr(t, "host_bound_s", 0.0))
    worst_extra = (float(t.step_time_worst_s) - float(t.step_time_s) if host else float(exp["worst"]) - est - slow)
    return [float(t.compute_time_s) + slow, est, float(getattr(t, "gpu_optimizer_time_s", 0.0)),
            float(getattr(t, "pcie_time_s", 0.0)),
            float(getattr(t, "cpu_optimizer_time_s", 0.0)), float(getattr(t, "nvme_time_s", 0.0)), host,
            max(0.0, worst_extra)]


def _time_values(p: Any) -> list[float] | None:
    t = getattr(p, "time", None)
    if t is None:
        return None
    return time_parts(t)


def _sec(t: float) -> str:
    if t == 0:
        return "0"
    if t < 1e-3:
        return f"{t * 1e6:,.0f} us"
    if t < 1:
        return f"{t * 1e3:,.1f} ms"
    return f"{t:,.2f} s"


def _time_suffix(p: Any) -> str:
    t = p.time
    span = "" if _sec(t.step_time_best_s) == _sec(t.step_time_worst_s) else \
        f" ({_sec(t.step_time_best_s)}-{_sec(t.step_time_worst_s)})"
    return f"{_sec(p.step_time_s)}{span}, comm {t.comm_share:.0%}"


def render_time_bars(con: Any, result: Any, *, title: str | None = None) -> None:
    """Stacked bars of one optimizer step per stage: compute, exposed comm as the overlap
    schedule leaves it, offload PCIe copies, the CPU optimizer step and NVMe swap (together the
    estimate, ``step_time_s``), then the extra exposed comm of the worst case (no overlap).
    Nothing is drawn without a hardware profile (no times)."""
    from rich.text import Text

    plans = _plans(result)
    rows = [(p, _time_values(p)) for p in plans]
    rows = [(p, v) for p, v in rows if v is not None]
    if not rows:
        con.print(Text("No step times: give --hardware to time compute and communication.", style="dim"))
        return
    ascii_only = use_ascii(con)
    axis_max = max(sum(v) for _, v in rows) or 1.0
    labels = [stage_label(p, ascii_only) for p, _ in rows]
    suffixes = [_time_suffix(p) for p, _ in rows]
    label_w, bar_w, wrap = _layout(con, labels, suffixes)
    con.print(Text(title or "Time per optimizer step: compute, exposed communication, the optimizer step, offload "
                   "(seconds)", style="bold"))
    for (p, values), label, suffix in zip(rows, labels, suffixes):
        cells = _scale_cells(values, axis_max, bar_w)
        line = Text(label.ljust(label_w) + "  ")
        for part, n in zip(TIME_PARTS, cells):
            if ascii_only:
                line.append(part.letter * n)
            else:
                line.append(("░" if part.key == "worst_extra" else "█") * n, style=part.term)
        line.append(" " * (bar_w - sum(cells)))
        if wrap:
            con.print(line, no_wrap=True, overflow="crop")
            line = Text(" " * (label_w + 2))
        line.append(" " + suffix)
        con.print(line, no_wrap=True, overflow="crop")
    for row in _axis_line(label_w, bar_w, axis_max, _sec, ascii_only):
        con.print(Text(row, style="dim"), no_wrap=True, overflow="crop")
    legend = Text(" " * (label_w + 2))
    used = [any(v[i] > 0 for _, v in rows) for i in range(len(TIME_PARTS))]
    for part, on in zip(TIME_PARTS, used):
        if not on:
            continue
        if ascii_only:
            legend.append(f"{part.letter}={part.label}  ")
        else:
            legend.append("░" if part.key == "worst_extra" else "█", style=part.term)
            legend.append(f" {part.label}  ")
    con.print(legend)
    con.print(Text(" " * (label_w + 2) + "x axis: seconds per optimizer step; printed: estimate (best-worst), "
                   "comm share of the estimate", style="dim"))
