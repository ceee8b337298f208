"""`zeroplan bench zero` end to end: CLI, JSON, tolerance gate, OOM findings, rank faults.

Figures are checked against the planner (the bench's own comparison is only arithmetic) and
against closed forms written here; ranks are forked on gloo.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")
from typer.testing import CliRunner  # noqa: E402

from zeroplan.cli import app  # noqa: E402

runner = CliRunner()


def _invoke(args):
    return runner.invoke(app, args, catch_exceptions=False)


def _json(result):
    text = result.stdout if hasattr(result, "stdout") else result.output
    return json.loads(text[text.index("{"):])


def test_cli_json_all_stages_gpt2_bf16(tmp_path):
    out = tmp_path / "bench.json"
    r = _invoke(["bench", "zero", "--model", "gpt2", "--stage", "0,1,2,3", "--nproc", "2", "--precision", "bf16",
                 "--grad-accum", "2", "--json", "--output", str(out)])
    assert r.exit_code == 0, r.output
    rep = _json(r)
    assert rep["ok"] and rep["world_size"] == 2 and [s["stage"] for s in rep["stages"]] == [0, 1, 2, 3]
    assert json.loads(out.read_text()) == rep
    psi = rep["model"]["params"]
    for st in rep["stages"]:
        rows = {r["name"]: r for r in st["rows"]}
        assert all(r["error"] == 0 for r in st["rows"] if r["kind"] == "collective")
        # closed forms: bf16 gradient volume per step
        if st["stage"] == 0:
            assert rows["all_reduce/backward bytes"]["measured"] == 2 * psi
        if st["stage"] in (1, 2):
            flat = math.ceil(psi / 4) * 4
            assert rows["all_gather/step bytes"]["measured"] == 2 * flat
            g = 1 if st["stage"] == 1 else 2
            assert rows["all_reduce/backward bytes"]["measured"] == g * 2 * psi
        for cat in ("params", "gradients", "optimizer_states"):
            assert abs(rows[cat]["error"]) <= 0.01


def test_cli_table_paper_flavour_and_simulate(tmp_path):
    path = tmp_path / "ds.json"  # a tiny model: only params <= 64 elements stay whole
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64}}))
    r = _invoke(["bench", "zero", "--model", "llama-2-7b", "--ds-config", str(path), "--nproc", "2",
                 "--comm-model", "paper"])
    assert r.exit_code == 0, r.output
    assert "all_gather/backward" in r.output and "all figures within tolerance" in r.output
    r = _invoke(["bench", "zero", "--simulate", "--model", "llama-2-7b", "--gpus", "16", "--stage", "3",
                 "--layers", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = _json(r)
    assert rep["simulated"] and rep["world_size"] == 16 and rep["ok"]


@pytest.mark.parametrize("args", [["--stage", "7"], ["--comm-model", "ring"], ["--precision", "fp8"],
                                  ["--micro-batch", "0"], ["--memory-limit", "lots"], ["--gpus", "4"]])
def test_cli_bad_input_exit_2(args):
    r = _invoke(["bench", "zero", "--model", "gpt2", "--nproc", "2", *args])  # --gpus without --simulate was ignored
    assert r.exit_code == 2, r.output


def test_oom_during_stage3_gather_is_a_finding_with_the_prediction(tmp_path):
    from zeroplan.bench.validate import predict, scaled_spec
    from zeroplan.specs.deepspeed_config import load_ds_config
    from zeroplan.specs.model import load_model

    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 0,
                                 "stage3_param_persistence_threshold": 64}, "bf16": {"enabled": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    spec = scaled_spec(load_model("llama-2-7b"))
    ds = load_ds_config(str(path))
    plan = predict(spec, ds.zero, precision="bf16", micro_batch=2, seq_len=32, grad_accum=1, n=2)
    states = plan.memory.params + plan.memory.gradients + plan.memory.optimizer_states
    # room for the states and the buckets, not for the embedding's gather on top of them
    limit = states + 3000 * 2 + 2 * 2**10
    r = _invoke(["bench", "zero", "--model", "llama-2-7b", "--ds-config", str(path), "--nproc", "2",
                 "--memory-limit", str(limit), "--json"])
    assert r.exit_code == 1, r.output
    rep = _json(r)
    (finding,) = rep["findings"]
    assert finding["rule"] == "BENCH-OOM" and finding["phase"] == "forward"
    assert "all-gather of model.embed_tokens" in finding["where"]
    assert finding["predicted_phase_peak_bytes"] == plan.memory.phases["forward"].peak
    assert str(plan.memory.peak) in finding["message"]


@pytest.mark.parametrize("kind,expect", [("hang", "timeout"), ("die", "died"), ("raise", "error")])
def test_rank_faults_name_the_rank(kind, expect):
    from zeroplan.bench.validate import run_bench_zero, scaled_spec
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"))
    rep = run_bench_zero(spec, [1], nproc=2, precision="fp32", steps=1, warmup=1,
                         fault={"rank": 1, "kind": kind, "step": 1}, timeout_s=8 if kind == "hang" else 300)
    assert not rep["ok"]
    kinds = {f["rank"]: f["kind"] for f in rep["failures"]}
    assert kinds.get(1) == expect, rep["failures"]
