"""`zeroplan report`: terminal charts, the self-contained HTML report, --svg, --json, errors.

Expected numbers come from the ZeRO paper's Table I / closed forms (model states per GPU),
from evaluate() called here for the same inputs (the report must show exactly those plans),
and from geometry (bar lengths proportional to the bytes they stand for).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

runner = CliRunner()

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
BASE = ["--model", "llama-2-7b", "--hardware", "dgx-a100-80gb", "--nodes", "2", "--precision", "bf16"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


class _Checker(HTMLParser):
    """Tag balance (every non-void element closed in order) and collection of table cells."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.cells: list[dict[str, str]] = []
        self.tags: dict[str, int] = {}
        self.table_stack: list[str] = []
        self.attrs_of: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.attrs_of.append((tag, a))
        if tag == "table":
            self.table_stack.append(a.get("id", ""))
        if tag == "td" and "data-value" in a:
            self.cells.append(dict(a, table=self.table_stack[-1] if self.table_stack else ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.attrs_of.append((tag, {k: (v or "") for k, v in attrs}))

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "table":
            self.table_stack.pop()


def _parse(html: str) -> _Checker:
    c = _Checker()
    c.feed(html)
    c.close()
    return c


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("rep")
    out, svg = d / "r.html", d / "mem.svg"
    r = run("report", *BASE, "--max-nodes", "4", "--html", out, "--svg", svg)
    assert r.exit_code == 0, r.output
    return SimpleNamespace(dir=d, html=out.read_text(encoding="utf-8"), svg=svg.read_text(encoding="utf-8"),
                           output=r.output)


def test_html_is_well_formed_and_self_contained(report):
    html = report.html
    assert html.startswith("<!DOCTYPE html>")
    c = _parse(html)
    assert not c.errors, c.errors[:5]
    assert c.stack == [], c.stack
    low = html.lower()
    for bad in ("http://", "https://", "//cdn", "<script", "<link", "@import", "url(http", "@font-face", "src="):
        assert bad not in low, bad
    # the only url(...) references are to patterns defined in the same document
    for ref in re.findall(r"url\(([^)]*)\)", html):
        assert ref.startswith("#") and f'id="{ref[1:]}"' in html, ref
    for section in ("Inputs and assumptions", "GB = 10", "llama-2-7b", "dgx-a100-80gb", "bf16", "precision"):
        assert section in html


def test_svg_parts_parse_as_xml_with_sizes_titles_axes_and_legends(report):
    svgs = re.findall(r"<svg\b.*?</svg>", report.html, re.S)
    ids = []
    for s in svgs:
        root = ET.fromstring(s)
        ids.append(root.get("id"))
        assert float(root.get("width")) > 0 and float(root.get("height")) > 0
        texts = " ".join(t.text or "" for t in root.iter("text"))
        assert root.find("title") is not None and root.find("title").text
        assert len(list(root.iter("line"))) >= 5  # axes and ticks
        if root.get("id") in ("chart-memory", "chart-memory-sweep"):
            assert "GB" in texts and "10^9 bytes" in texts
    assert ids == ["chart-memory", "chart-time", "chart-memory-sweep", "chart-time-sweep", "chart-comm-share"]
    # every non-zero memory category of every stage is drawn as a segment of non-zero width
    root = ET.fromstring(svgs[0])
    segs = [r for r in root.iter("rect") if r.get("class") == "seg"]
    assert {r.get("data-category") for r in segs} == {"params", "gradients", "optimizer_states", "buffers",
                                                      "activations", "overhead"}
    assert all(float(r.get("width")) > 0 and float(r.get("height")) > 0 for r in segs)
    legend = " ".join(t.text or "" for t in root.iter("text"))
    for label in ("parameters", "gradients", "optimizer states", "buffers", "activations", "overhead", "GPU memory"):
        assert label in legend


def test_memory_bars_are_proportional_to_bytes(report):
    """Within a bar, segment widths are in the ratio of the bytes in the table (segments cut at the
    axis end, marked data-clipped, are drawn only up to it)."""
    root = ET.fromstring(re.search(r"<svg\b.*?</svg>", report.html, re.S).group(0))
    c = _parse(report.html)
    by_stage: dict[str, dict[str, int]] = {}
    for cell in c.cells:
        if cell["table"] == "table-memory":
            by_stage.setdefault(cell["data-stage"], {})[cell["data-key"]] = int(cell["data-value"])
    segs = [r for r in root.iter("rect") if r.get("class") == "seg"]
    px_per_byte = []
    for r in segs:
        # segments appear stage by stage in plan order; match by tooltip text
        tip = r.find("title").text
        stage = re.match(r"ZeRO-(\d)", tip).group(1)
        v = by_stage[stage][r.get("data-category")]
        if v > 1e9 and r.get("data-clipped") is None:  # well above the 0.1 px rounding of the coordinates
            px_per_byte.append(float(r.get("width")) / v)
    assert px_per_byte and max(px_per_byte) / min(px_per_byte) < 1.02


def test_tables_equal_evaluate_for_the_same_inputs(report):
    from zeroplan.core.inputs import build_plan_inputs
    from zeroplan.core.plan import evaluate

    inp = build_plan_inputs(model="llama-2-7b", hardware="dgx-a100-80gb", nodes=2, precision="bf16")
    c = _parse(report.html)
    mem = [x for x in c.cells if x["table"] == "table-memory-sweep"]
    tim = [x for x in c.cells if x["table"] == "table-time-sweep"]
    assert {int(x["data-gpus"]) for x in mem} == {1, 2, 4, 8, 16, 32}  # up to 4 nodes × 8
    assert {int(x["data-nodes"]) for x in tim} == {1, 2, 4}
    assert len(mem) == 6 * 4 * 2 and len(tim) == 3 * 4 * 2
    for x in mem:
        g, s = int(x["data-gpus"]), int(x["data-stage"])
        p = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(s), n_gpus=g, gpus_per_node=min(8, g),
                     hardware=inp.hardware)
        assert int(x["data-value"]) == getattr(p.memory, x["data-key"]), (g, s, x["data-key"])
    for x in tim:
        n, s = int(x["data-nodes"]), int(x["data-stage"])
        p = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(s), n_gpus=8 * n, gpus_per_node=8,
                     hardware=inp.hardware)
        want = p.time.step_time_s if x["data-key"] == "step_time_s" else p.time.comm_share
        assert float(x["data-value"]) == want
    # the chosen cluster's table: 16 GPUs, the four stages
    at = {(x["data-stage"], x["data-key"]): int(x["data-value"]) for x in c.cells if x["table"] == "table-memory"
          and x["data-key"] != "fits"}
    cats = ("params", "gradients", "optimizer_states", "buffers", "activations")
    for s in range(4):
        p = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(s), n_gpus=16, gpus_per_node=8,
                     hardware=inp.hardware)
        assert at[(str(s), "peak")] == p.memory.peak
        assert at[(str(s), "model_states")] == p.memory.model_states
        live = p.memory.phases[p.memory.peak_phase].by_category
        for k in cats:
            assert at[(str(s), k)] == live[k], (s, k)
        assert at[(str(s), "overhead")] == p.memory.overhead
        # the stacked categories add up to the peak they are drawn against
        assert sum(at[(str(s), k)] for k in cats + ("overhead",)) == p.memory.peak


def test_standalone_svg_file(report):
    assert report.svg.startswith("<?xml")
    root = ET.fromstring(report.svg.split("\n", 1)[1])
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert float(root.get("width")) > 0 and float(root.get("height")) > 0
    assert "<script" not in report.svg


def test_atomic_write_leaves_no_temp_files(report):
    assert sorted(p.name for p in report.dir.iterdir()) == ["mem.svg", "r.html"]
    assert "wrote" in report.output


def test_json_sweep_matches_zero_paper_table_1():
    """Ψ = 7.5B, K = 12 (mixed precision): model states per GPU = 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
    (ZeRO paper, arXiv 1910.02054, Table I: 120 / 31.4 / 16.6 / 1.88 GB at N = 64)."""
    r = run("report", "--model", "7.5B", "--gpus-per-node", "8", "--precision", "bf16", "--max-nodes", "32", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)  # the whole output is one JSON object: no progress bar, no chatter
    sw = d["memory_sweep"]
    assert sw["gpus"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert d["time_sweep"] is None  # no hardware profile → no times
    psi = 7.5e9
    forms = {0: lambda n: 16 * psi, 1: lambda n: 4 * psi + 12 * psi / n, 2: lambda n: 2 * psi + 14 * psi / n,
             3: lambda n: 16 * psi / n}
    for s in sw["series"]:
        for n, v in zip(sw["gpus"], s["model_states"]):
            assert isinstance(v, int)
            assert v == pytest.approx(forms[s["stage"]](n), rel=2e-3), (s["stage"], n)
    table1 = {1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    i64 = sw["gpus"].index(64)
    for s in sw["series"]:
        if s["stage"] in table1:
            assert s["model_states"][i64] == pytest.approx(table1[s["stage"]], rel=0.01)


def test_json_time_sweep_with_hardware():
    r = run("report", *BASE, "--max-nodes", "6", "--json", "--stage", "3")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    ts = d["time_sweep"]
    assert ts["nodes"] == [1, 2, 4, 6] and ts["gpus"] == [8, 16, 32, 48]
    assert [s["stage"] for s in ts["series"]] == [0, 1, 2, 3]
    assert d["memory_sweep"]["gpus"][-1] == 48
    for s in ts["series"]:
        for best, est, worst, share in zip(s["step_time_best_s"], s["step_time_s"], s["step_time_worst_s"],
                                           s["comm_share"]):
            assert best <= est <= worst and 0 <= share <= 1
    assert [p["stage"] for p in d["plans"]] == [3]


def test_html_without_hardware(tmp_path):
    out = tmp_path / "r.html"
    r = run("report", "--model", "gpt2", "--gpus", "4", "--max-nodes", "2", "--html", out)
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert not _parse(html).errors
    assert "No times: no hardware profile was given." in html
    ids = [ET.fromstring(s).get("id") for s in re.findall(r"<svg\b.*?</svg>", html, re.S)]
    assert ids == ["chart-memory", "chart-memory-sweep"]


def test_terminal_charts_by_default():
    r = run("report", *BASE, "--max-nodes", "2")
    assert r.exit_code == 0, r.output
    for s in ("Per-GPU peak memory", "Time per optimizer step", "ZeRO-3", "GB", "peak memory vs GPUs"):
        assert s in r.output
    assert "evaluating plans" not in r.output  # not a TTY: no progress bar


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model", "--gpus", "8"], "no-such-model"),
    (BASE + ["--max-nodes", "0"], "--max-nodes"),
    (BASE + ["--max-nodes", "100000"], "--max-nodes"),
    (["--model", "7B", "--nodes", "0", "--gpus-per-node", "8"], "--nodes"),
    (BASE + ["--stage", "5"], "--stage"),
    (BASE + ["--comm-model", "magic"], "--comm-model"),
])
def test_bad_input_exit_2(args, needle):
    r = run("report", *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_missing_target_directory_exit_2(tmp_path):
    for opt in ("--html", "--svg"):
        target = tmp_path / "nope" / "x.out"
        r = run("report", *BASE, opt, target)
        assert r.exit_code == 2, r.output
        assert "does not exist" in r.output
        assert not (tmp_path / "nope").exists()
    r = run("report", *BASE, "--html", tmp_path)
    assert r.exit_code == 2 and "directory" in r.output
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- terminal charts on their own


def _plan(stage, gb_parts, capacity_gb=100.0, times=None):
    keys = ("params", "gradients", "optimizer_states", "buffers", "activations", "overhead")
    mem = {k: int(v * 1e9) for k, v in zip(keys, gb_parts)}
    mem["peak"] = sum(mem.values())
    t = None
    if times:
        c, b, w = times
        t = SimpleNamespace(compute_time_s=c, exposed_time_s={"best": b, "worst": w}, step_time_best_s=c + b,
                            step_time_worst_s=c + w, comm_share=(b + w) / 2 / (c + (b + w) / 2))
    return SimpleNamespace(stage=stage, offload_optimizer="none", offload_param="none",
                           memory=SimpleNamespace(**mem), gpu_memory_bytes=int(capacity_gb * 1e9), time=t,
                           step_time_s=(t.compute_time_s + (t.exposed_time_s["best"] + t.exposed_time_s["worst"]) / 2)
                           if t else None)


def _console(width, color):
    from rich.console import Console

    buf = io.StringIO()
    if color:
        return Console(file=buf, width=width, force_terminal=True, color_system="truecolor"), buf
    return Console(file=buf, width=width, color_system=None), buf


@pytest.mark.parametrize("width", [40, 60, 100, 160])
def test_ascii_memory_bars_proportional_and_width_aware(width):
    from zeroplan.report.charts import render_memory_bars

    plans = [_plan(3, (10, 10, 20, 10, 20, 10)), _plan(1, (40, 40, 30, 10, 20, 10))]  # 80 GB fits, 150 GB over
    con, buf = _console(width, color=False)
    render_memory_bars(con, plans)
    out = buf.getvalue()
    assert out.isascii()
    lines = out.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    bars = {}
    for line in lines:
        m = re.match(r"^(ZeRO-\d)\s+(\S[^ ]*)", line)
        if m:
            bars[m.group(1)] = line[line.index(m.group(2)):]
    fit, over = bars["ZeRO-3"], bars["ZeRO-1"]
    cap = fit.index("|")
    assert cap == over.index("|")
    # 10 GB of params against a 100 GB capacity: a tenth of the way to the marker (±1 cell of rounding)
    assert abs(fit.count("P") - cap / 10) <= 1.01
    assert abs(fit.count("A") - cap / 5) <= 1.01
    assert "OVER" not in fit.split("|", 1)[1] or "OVER" in over
    # the over bar: lower case beyond the marker, total ≈ 1.5 × the distance to the marker
    body = over.split(" ")[0]
    assert any(ch.islower() for ch in body[cap + 1:]) and not any(ch.islower() for ch in body[:cap])
    letters = sum(ch.isalpha() for ch in body) + 1  # + the marker cell
    assert abs(letters - 1.5 * cap) <= 2.01
    assert "OVER by 50.00 GB" in out and "fits, 20.00 GB free" in out
    assert "P=parameters" in out and "GB" in out


def test_colour_memory_bars_have_legend_and_capacity_marker():
    from zeroplan.report.charts import render_memory_bars

    con, buf = _console(100, color=True)
    render_memory_bars(con, [_plan(3, (10, 10, 20, 10, 20, 10)), _plan(0, (900, 900, 900, 0, 0, 100))])
    out = buf.getvalue()
    assert "\x1b[" in out and "┃" in out and "█" in out and "▓" in out and "»" in out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    for label in ("parameters", "gradients", "optimizer states", "buffers", "activations", "overhead",
                  "GPU memory 100.00 GB", "10^9 bytes"):
        assert label in plain
    assert all(len(line) <= 100 for line in plain.splitlines())


def test_time_bars_ascii():
    from zeroplan.report.charts import render_time_bars

    plans = [_plan(0, (1,) * 6, times=(2.0, 1.0, 1.0)), _plan(3, (1,) * 6, times=(2.0, 1.0, 3.0))]
    con, buf = _console(80, color=False)
    render_time_bars(con, plans)
    out = buf.getvalue()
    assert out.isascii()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(ZeRO-\d)\s+([CEw]+)", out, re.M)}
    # ZeRO-3's worst case (2 + 3 s) spans the whole axis: W cells = 5 s
    width = len(rows["ZeRO-3"])
    c0, e0 = rows["ZeRO-0"].count("C"), rows["ZeRO-0"].count("E")
    c3, e3, w3 = (rows["ZeRO-3"].count(x) for x in "CEw")
    assert c0 == c3 and abs(c0 - 2 / 5 * width) <= 0.5 and abs(e0 - width / 5) <= 1
    # E is the exposed-comm estimate (no "estimate" key here: the mean of best 1 and worst 3 = 2 s),
    # w what the worst case adds on top (1 s)
    assert abs(e3 - 2 / 5 * width) <= 1 and abs(w3 - width / 5) <= 1 and rows["ZeRO-0"].count("w") == 0
    assert "4.00 s (3.00 s-5.00 s)" in out  # estimate = compute 2 + mean of best 1 and worst 3
    assert "3.00 s, comm" in out  # best = worst: no range


def test_time_bars_without_hardware():
    from zeroplan.report.charts import render_time_bars

    con, buf = _console(80, color=False)
    render_time_bars(con, [_plan(0, (1,) * 6)])
    assert "--hardware" in buf.getvalue()


def test_report_modules_do_not_import_torch():
    code = ("import sys, zeroplan.commands.report, zeroplan.report.html, zeroplan.report.charts; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_progress_callback_counts_each_distinct_evaluation():
    from zeroplan.commands.estimate import run_estimate
    from zeroplan.commands.report import build_report_data

    result, inp = run_estimate(model="gpt2", hardware="dgx-a100-80gb", nodes=1, precision="bf16")
    steps = []
    data = build_report_data(result, inp, max_nodes=4, on_step=lambda: steps.append(1))
    # GPUs 1, 2, 4, 8, 16, 32 (memory sweep) ∪ 8, 16, 32 whole nodes (time sweep) → 6 distinct × 4 stages
    assert len(steps) == 24
    assert data["time_sweep"]["gpus"] == [8, 16, 32]


def test_memory_chart_labels_clear_of_the_capacity_line_and_axis_cut(report):
    """Value labels sit right of the plot (no line crosses them); the axis stops at 1.5 × the GPU
    memory rounded up to a tick, and bars past it carry a break mark; every option that does not fit
    has an OOM marker."""
    from zeroplan.report.html import _linear_ticks

    root = ET.fromstring(re.search(r"<svg\b.*?</svg>", report.html, re.S).group(0))
    data = json.loads(run("report", *BASE, "--max-nodes", "4", "--json").stdout)
    cap = data["cluster"]["gpu_memory_bytes"]
    lines = [ln for ln in root.iter("line") if ln.get("stroke") == "#d00000"]
    (cap_line,) = lines
    axis = [ln for ln in root.iter("line") if ln.get("stroke") == "#444"]
    plot_right = max(float(ln.get("x2")) for ln in axis)
    assert float(cap_line.get("x1")) < plot_right
    values = [t for t in root.iter("text") if re.match(r"[\d,.]+ GB, [\d,.]+ GB (over|free)", t.text or "")]
    assert len(values) == len(data["plans"])
    assert all(float(t.get("x")) > plot_right for t in values)
    ticks = [float(t.text.replace(",", "")) for t in root.iter("text") if re.fullmatch(r"[\d,]+", t.text or "")]
    assert max(ticks) == _linear_ticks(1.5 * cap / 1e9)[-1] or max(ticks) * 1e9 >= max(
        p["memory"]["peak"] for p in data["plans"])
    cut = [p for p in data["plans"] if p["memory"]["peak"] > max(ticks) * 1e9]
    assert len([x for x in root.iter("path") if x.get("class") == "break"]) == 2 * len(cut)
    oom = {int(g.get("data-stage")) for g in root.iter("g") if g.get("class") == "oom"}
    assert oom == {p["stage"] for p in data["plans"] if p["fits"] is False or p["host_fits"] is False}
