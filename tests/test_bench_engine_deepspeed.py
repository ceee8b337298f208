"""`zeroplan bench zero --engine deepspeed`: DeepSpeed's real engine vs the prediction, via the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

needs_ds = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")


def test_engine_deepspeed_needs_a_config():
    r = CliRunner().invoke(app, ["bench", "zero", "--engine", "deepspeed", "--model", "gpt2", "--nproc", "2"])
    assert r.exit_code == 2 and "--ds-config" in r.output


def test_unknown_engine_is_bad_input():
    r = CliRunner().invoke(app, ["bench", "zero", "--engine", "megatron", "--model", "gpt2"])
    assert r.exit_code == 2 and "--engine" in r.output


def test_bad_config_is_rejected_before_deepspeed_starts(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True},
                             "zero_optimization": {"stage": 2}}))
    r = CliRunner().invoke(app, ["bench", "zero", "--engine", "deepspeed", "--ds-config", str(p), "--model", "gpt2"])
    assert r.exit_code == 2 and "DS005" in r.output and "Traceback" not in r.output


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_stage2_bf16_matches_exactly(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                             "bf16": {"enabled": True},
                             "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000}}))
    # a real process: DeepSpeed's import-time log line and its ranks' output share the command's
    # stdout, and `--json` must still be the JSON document alone
    r = subprocess.run([sys.executable, "-m", "zeroplan", "bench", "zero", "--engine", "deepspeed",
                        "--ds-config", str(p), "--model", "llama-2-7b", "--nproc", "2", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    (st,) = report["stages"]
    rows = {x["name"]: x for x in st["rows"]}
    # every collective exact (count and bytes), model states within 1%
    assert all(x["error"] == 0 for x in st["rows"] if x["kind"] == "collective")
    # stage 2 all-reduces every gradient at every micro-step: 2 micro-steps × Ψ × 2 bytes (bf16)
    assert rows["all_reduce/backward bytes"]["measured"] == 2 * report["model"]["params"] * 2
    for cat in ("params", "gradients", "optimizer_states"):
        assert abs(rows[cat]["error"]) <= 0.01
