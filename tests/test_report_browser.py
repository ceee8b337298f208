"""The HTML report in a real headless Chromium: it loads with no errors and no network, the DOM
holds the charts, and the screenshot is a non-blank PNG of the window size with the chart colours.

Skipped when no ``chromium`` / ``chromium-browser`` binary is on PATH (.ci/run installs one).
Each browser run is bounded (60 s) and its whole process group is killed afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium / chromium-browser binary on PATH")

WIDTH, HEIGHT = 1200, 1600
TIMEOUT_S = 300  # a bound on hangs: chromium takes 1-3 s idle, several times that on a loaded 2-core machine
PARAMS_RGB = (0x4E, 0x79, 0xA7)  # the parameters colour of the memory chart (zeroplan.report.charts)


def _browser(profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
        f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish within {TIMEOUT_S} s")
    finally:
        try:  # helpers (zygote, GPU/network services) share the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Minimal decoder: 8-bit RGB/RGBA, non-interlaced. Returns width, height and unfiltered rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + length
    assert ihdr is not None
    width, height, depth, color, _, _, interlace = ihdr
    assert depth == 8 and color in (2, 6) and interlace == 0, ihdr
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    high = int.from_bytes(b"\x80" * stride, "big")
    low = int.from_bytes(b"\x7f" * stride, "big")
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 2:  # Up: bytewise (line + prev) mod 256, all lanes at once (no carry between bytes)
            a, b = int.from_bytes(line, "big"), int.from_bytes(prev, "big")
            line = bytearray((((a & low) + (b & low)) ^ ((a ^ b) & high)).to_bytes(stride, "big"))
            f = 0
        for i in range(stride if f else 0):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


@pytest.fixture(scope="module")
def html_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("browser") / "report.html"
    r = CliRunner().invoke(app, ["report", "--model", "llama-2-70b", "--hardware", "dgx-h100", "--nodes", "4",
                                 "--precision", "bf16", "--max-nodes", "16", "--html", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def offload_html_file(tmp_path_factory) -> Path:
    """Optimizer offload to CPU on 100 GbE: stages 0-2 do not fit, ZeRO-3 does; host RAM matters."""
    out = tmp_path_factory.mktemp("browser-offload") / "report.html"
    r = CliRunner().invoke(app, ["report", "--model", "llama-2-70b", "--hardware", "h100-8x-100gbe", "--nodes", "4",
                                 "--precision", "bf16", "--checkpointing", "full", "--offload-optimizer", "cpu",
                                 "--max-nodes", "4", "--html", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_dom_has_recommendation_host_ram_and_oom_markers(offload_html_file, tmp_path):
    r = _browser(tmp_path / "profile", "--dump-dom", offload_html_file.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    data = json.loads(CliRunner().invoke(app, [
        "report", "--model", "llama-2-70b", "--hardware", "h100-8x-100gbe", "--nodes", "4", "--precision", "bf16",
        "--checkpointing", "full", "--offload-optimizer", "cpu", "--max-nodes", "4", "--json"]).stdout)
    # the recommendation: the chosen configuration and its reasons, as recommend gives them
    chosen = data["recommendation"]["chosen"]
    assert 'id="recommendation"' in dom and 'id="table-recommendation"' in dom
    assert f"Recommended: <b>{chosen['label']}</b>" in dom
    reasons = dom.split('id="recommendation-reasons"')[1].split("</ul>")[0]
    assert reasons.count("<li>") == len(data["recommendation"]["explanation"]) - 1  # the first restates the choice
    # host RAM per node under offload: in the chart (per option) and the table (exact bytes)
    for p in data["plans"]:
        if p["offload_optimizer"] != "none":
            gb = f"{p['host_memory_per_node'] / 1e9:,.0f} GB"
            assert f"host RAM {gb} of" in dom, gb
            assert f'data-key="host_memory_per_node" data-stage="{p["stage"]}" data-value="{p["host_memory_per_node"]}"' in dom
    # an OOM marker on every option that does not fit, none on the others
    oom = {int(m) for m in re.findall(r'class="oom" data-stage="(\d)"', dom)}
    assert oom == {p["stage"] for p in data["plans"] if p["fits"] is False or p["host_fits"] is False}
    assert oom and oom != {p["stage"] for p in data["plans"]}
    # no literal markdown, the terminal's arrows
    assert "`" not in dom and "->" not in dom.replace("<!--", "").replace("-->", "")
    assert "opt→cpu" in dom


def test_dom_has_the_charts_and_no_errors(html_file, tmp_path):
    r = _browser(tmp_path / "profile", "--enable-logging=stderr", "--v=0", "--dump-dom", html_file.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    for ident in ("chart-memory", "chart-time", "chart-memory-sweep", "chart-time-sweep", "chart-comm-share",
                  "table-memory", "table-time", "table-memory-sweep", "table-time-sweep", "table-inputs",
                  "recommendation", "table-recommendation"):
        assert f'id="{ident}"' in dom, ident
    assert dom.count("<svg") == 5 and "<parsererror" not in dom
    log = r.stderr
    for bad in ("Uncaught", "net::ERR", "Failed to load resource", "Refused to"):
        assert bad not in log, [line for line in log.splitlines() if bad in line][:3]
    assert not [line for line in log.splitlines() if "CONSOLE" in line], log[-2000:]


def test_screenshot_is_the_window_size_and_shows_the_charts(html_file, tmp_path):
    png = tmp_path / "shot.png"
    r = _browser(tmp_path / "profile", f"--screenshot={png}", html_file.as_uri())
    assert r.returncode == 0 and png.exists(), r.stderr[-2000:]
    data = png.read_bytes()
    assert data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
    width, height, rows = _read_png(data)
    assert (width, height) == (WIDTH, HEIGHT)
    pixels = [row[i:i + 3] for row in rows[::2] for i in range(0, len(row), 6)]  # every other pixel and row
    distinct = set(pixels)
    non_white = sum(1 for p in pixels if p != b"\xff\xff\xff")
    assert len(distinct) > 50, len(distinct)
    assert non_white / len(pixels) > 0.03, non_white / len(pixels)
    # the memory chart (in the first screen) is painted: solid parameter-blue bar pixels
    assert sum(1 for p in pixels if tuple(p) == PARAMS_RGB) > 500
