"""`zeroplan estimate` through the CLI runner: output, JSON schema, bad input → exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_estimate_human_output_has_units_and_stages():
    r = run("estimate", "--model", "llama-2-7b", "--gpus", "8", "--precision", "bf16")
    assert r.exit_code == 0, r.output
    for s in ("ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "GB", "GiB", "peak per GPU", "DeepSpeed's own estimator"):
        assert s in r.output


def test_estimate_json_schema():
    r = run("estimate", "--model", "llama-2-7b", "--gpus", "16", "--gpus-per-node", "8", "--precision", "bf16",
            "--json", "--stage", "3")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["cluster"] == {"n_gpus": 16, "nodes": 2, "gpus_per_node": 8, "hardware": None, "gpu": None,
                            "gpu_memory_bytes": None}
    (s,) = d["stages"]
    assert s["stage"] == 3 and s["offload_optimizer"] == "none" and s["offload_param"] == "none"
    for k in ("params", "gradients", "optimizer_states", "model_states", "buffers", "activations", "overhead", "peak"):
        assert isinstance(s["memory"][k], int)
    assert s["fits"] is None  # no hardware profile
    assert s["comm"]["collectives"] and s["comm"]["bytes_per_gpu_per_step"] == sum(
        e["sent_bytes"] for e in s["comm"]["collectives"])
    assert s["deepspeed_estimator"]["gpu_bytes_per_gpu"] > 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "llama-2-7x", "--gpus", "8"], "llama-2-7b"),  # suggestion
        (["--model", "7B", "--gpus", "0"], "--gpus"),
        (["--model", "7B", "--gpus", "-8"], "--gpus"),
        (["--model", "7B", "--gpus", "12", "--gpus-per-node", "8"], "divisible"),
        (["--model", "7B", "--gpus", "8", "--precision", "fp8"], "--precision"),
        (["--model", "7B", "--gpus", "8", "--stage", "4"], "--stage"),
        (["--model", "abcB", "--gpus", "8"], "abcB"),
        (["--model", "7B", "--gpus", "8", "--offload-optimizer", "disk"], "--offload-optimizer"),
        (["--model", "7B", "--nodes", "2"], "--gpus-per-node"),
    ],
)
def test_bad_input_exit_2_one_line(args, needle):
    r = run("estimate", *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096,\n  "num_hidden_layers": }')
    r = run("estimate", "--model", str(bad), "--gpus", "8")
    assert r.exit_code == 2
    assert str(bad) in r.output and "line 2" in r.output
