"""Issue 17 §3: numbers and names at the boundary — one line (exit 2) or a correct answer, never a
traceback, a hang or a silently wrong figure."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from zeroplan._util import InputError, parse_count, safe_text
from zeroplan.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
GOOD_TOML = (REPO / "hardware_profiles" / "dgx-h100.toml").read_text(encoding="utf-8")


def one_line_exit_2(r, usage_error_ok: bool = False) -> str:
    """Exit 2, no traceback, one stderr line. ``usage_error_ok``: a value click/typer refuses before
    zeroplan sees it (helper `cli` makes those one line too; until then the box is accepted)."""
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.exception, r.output[-600:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.output, r.output
    if usage_error_ok and "Usage:" in r.stderr:
        return r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("args", [
    ["--gpus", str(2**62)],
    ["--gpus", "9" * 60],
    ["--gpus", "9" * 5000],
    ["--gpus", "8.5"],
    ["--gpus", "nan"],
    ["--gpus", "-8"],
    ["--nodes", str(2**40)],
    ["--micro-batch", "1e400"],
    ["--seq-len", "0.5"],
    ["--mfu", "inf"],
    ["--mfu", "5e-324"],
    ["--mfu", "nan"],
])
def test_numeric_options(args):
    base = ["estimate", "--model", "llama-2-7b", "--hardware", "dgx-h100", "--json"]
    if "--gpus" not in args and "--nodes" not in args:
        base += ["--gpus", "8"]
    one_line_exit_2(runner.invoke(app, base + args), usage_error_ok=True)


@pytest.mark.parametrize("value", ["0.4", "5e-324", "1e400", "nan", "inf", "-7B", "1" * 5000, "7" * 70 + "B"])
def test_model_counts(value):
    one_line_exit_2(runner.invoke(app, ["estimate", "--model", value, "--gpus", "8", "--json"]))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(max_size=80))
def test_property_parse_count_is_int_or_one_line(text):
    try:
        n = parse_count(text, "--model")
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(n, int) and 1 <= n <= 10**16


@pytest.mark.parametrize("opt", [
    {"lr": "inf"}, {"lr": "NaN"}, {"lr": -1e-4}, {"betas": [0.9, "Infinity"]}, {"betas": [0.9, 1.0]},
    {"betas": [0.9]}, {"eps": -1}, {"weight_decay": "nan"},
])
def test_optimizer_numbers_in_a_deepspeed_config(opt, tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, **opt}}}))
    msg = one_line_exit_2(runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8",
                                              "--ds-config", str(p), "--strict", "--json"]))
    assert f"optimizer.params.{next(iter(opt))}" in msg


@pytest.mark.parametrize("cfg", [
    {"train_micro_batch_size_per_gpu": 1.5},
    {"train_micro_batch_size_per_gpu": -1},
    {"gradient_accumulation_steps": 10**400},
    {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
    {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e400}},
])
def test_counts_in_a_deepspeed_config(cfg, tmp_path):
    p = tmp_path / "ds.json"
    text = json.dumps({"train_micro_batch_size_per_gpu": 1, **cfg}).replace("Infinity", "1e400")
    p.write_text(text)
    one_line_exit_2(runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--ds-config", str(p),
                                        "--strict", "--json"]))


def _profile(tmp_path: Path, text: str) -> str:
    p = tmp_path / "hw.toml"
    p.write_text(text)
    return str(p)


def test_nvme_offload_on_a_profile_without_nvme_is_one_line(tmp_path):
    text = re.sub(r"nvme_bandwidth_GBps = [0-9.]+", "nvme_bandwidth_GBps = 0", GOOD_TOML)
    text = re.sub(r"nvme_capacity_bytes = [0-9_]+", "nvme_capacity_bytes = 0", text)
    prof = _profile(tmp_path, text)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}))
    for cmd in (["check", str(ds)], ["estimate", "--ds-config", str(ds)]):
        r = runner.invoke(app, [*cmd, "--model", "llama-2-7b", "--hardware", prof, "--gpus", "8"])
        assert "ZeroDivisionError" not in repr(r.exception) and "Traceback" not in r.output
        msg = one_line_exit_2(r) if r.exit_code == 2 else r.stdout
        assert "nvme" in msg.lower(), msg


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.replace("bandwidth_GBps_per_gpu = 450", "bandwidth_GBps_per_gpu = 3600"), "bandwidth"),  # Gb/s
    (lambda t: re.sub(r"host_ram_bytes = [0-9_]+", "host_ram_bytes = 2_113_929_216", t), "host_ram"),  # KiB
])
def test_profiles_with_impossible_units_are_refused(edit, needle, tmp_path):
    new = edit(GOOD_TOML)
    assert new != GOOD_TOML, "the mutation did not apply"
    msg = one_line_exit_2(runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8",
                                              "--hardware", _profile(tmp_path, new), "--json"]))
    assert needle in msg


def test_profile_without_the_dtype_peak_is_refused_not_the_fp8_figure(tmp_path):
    lines = [ln for ln in GOOD_TOML.splitlines() if not re.match(r"^(bf16|fp16)\s*=", ln)]
    text = "\n".join(lines) + "\n"
    assert "fp8" in text and not re.search(r"^bf16\s*=", text, re.M)
    msg = one_line_exit_2(runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--precision",
                                              "bf16", "--hardware", _profile(tmp_path, text), "--json"]))
    assert "peak_flops" in msg and "bf16" in msg


@pytest.mark.parametrize("name", ["[bold]x[/bold]", "\x1b[31mred\x1b[0m", "lone\udcff", "tab\tbell\x07"])
def test_names_are_escaped(name):
    out = safe_text(name)
    assert "\x1b" not in out and "\x07" not in out and not re.search(r"[\ud800-\udfff]", out)
    out.encode("utf-8")  # printable


def test_model_name_with_markup_and_ansi_in_output(tmp_path):
    cfg = json.loads((REPO / "examples" / "models" / "tinyllama-1.1b" / "config.json").read_text())
    d = tmp_path / "[bold]evil\x1b[31m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["estimate", "--model", str(d), "--gpus", "8"])
    assert r.exit_code == 0, r.output[-600:]
    assert "\x1b[31m" not in r.stdout


def test_junit_xml_stays_valid_with_forbidden_characters(tmp_path):
    p = tmp_path / "ds\x01\x1b.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                             "bad\x02key": 1}))
    r = runner.invoke(app, ["check", str(p), "--model", "llama-2-7b", "--hardware", "dgx-h100", "--gpus", "8",
                            "--format", "junit"])
    assert r.exit_code in (0, 1), r.output[-600:]
    ET.fromstring(r.stdout.encode("utf-8"))  # raises on characters XML 1.0 forbids
