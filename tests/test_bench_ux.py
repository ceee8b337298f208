"""`bench` as a new user meets it (issue 11 §2.9-2.10): a missing extra is one line, bench zero
says what it runs, compares like with like, scales its buckets, checkpoints; bench
collectives predicts each row and --save-profile warns on a poor fit and names the link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "hardware_profiles" / "dgx-h100.toml")


def _run_without_torch(args: list[str]) -> subprocess.CompletedProcess:
    code = ("import sys; sys.modules['torch'] = None; from zeroplan.cli import main; "
            f"main({args!r})")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("args", [
    ["bench", "zero", "--model", "gpt2"],
    ["bench", "collectives", "--ops", "all_reduce"],
    ["validate", "--output", "out"],
])
def test_without_torch_one_line_names_the_extra(args):
    r = _run_without_torch(args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "pip install 'zeroplan[bench]'" in lines[0]
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ pure helpers (no torch)
def test_scale_buckets_scales_only_what_the_config_leaves_default():
    from zeroplan.bench.zero_inputs import scale_buckets
    from zeroplan.specs.deepspeed_config import ZeroConfig

    z = ZeroConfig(stage=2, reduce_bucket_size=777)
    out, changed = scale_buckets(z, 1e-4, {"reduce_bucket_size"})
    assert out.reduce_bucket_size == 777  # the user's value is never scaled
    assert out.allgather_bucket_size == 50_000 and out.allgather_bucket_size % 2 == 0
    assert out.prefetch_bucket_size == round(z.prefetch_bucket_size * 1e-4)
    assert set(changed) == {"allgather_bucket_size", "prefetch_bucket_size"}
    assert changed["allgather_bucket_size"] == {"default": 500_000_000, "scaled": 50_000}
    with pytest.raises(ValueError):
        scale_buckets(z, 0, set())


def test_step_time_is_not_compared_across_devices():
    from zeroplan.bench.zero_inputs import step_time_row

    cpu = step_time_row(6e-5, 0.35, device="cpu", hardware_name="dgx-h100", gpu_name="H100")
    assert cpu["ok"] and not cpu["comparable"] and cpu["error"] is None
    assert "not comparable" in cpu["note"] and "cpu" in cpu["note"]
    gpu = step_time_row(0.5, 0.6, device="cuda", hardware_name="dgx-h100", gpu_name="H100")
    assert gpu["comparable"] and gpu["error"] == pytest.approx(0.2)
    assert "--hardware" in step_time_row(None, 0.3, device="cpu", hardware_name=None, gpu_name=None)["note"]


def test_header_names_every_input():
    from zeroplan.bench.zero_inputs import header_lines

    rep = {"model": {"name": "llama-2-7b (scaled)", "params": 164672, "layers": 2, "hidden": 64, "vocab": 512},
           "scaled_from": {"name": "llama-2-7b", "params": 6738415616}, "world_size": 2, "device": "cpu",
           "backend": "gloo", "precision": "bf16", "micro_batch": 2, "seq_len": 32, "grad_accum": 1,
           "checkpointing": "full", "warmup": 2, "steps": 2, "comm_model": "deepspeed",
           "buckets": {"reduce_bucket_size": {"default": 500000000, "scaled": 12219}}, "bucket_scale": 2.44e-5}
    text = "\n".join(header_lines(rep))
    for want in ("164,672 parameters", "micro-batch 2", "sequence 32", "grad-accum 1", "checkpointing full",
                 "6,738,415,616", "reduce_bucket_size 12,219 (default 500,000,000)", "2 warm-up + 2 measured"):
        assert want in text, want


def test_bench_zero_help_shows_the_defaults():
    from typer.testing import CliRunner

    from zeroplan.cli import app

    out = CliRunner().invoke(app, ["bench", "zero", "--help"], terminal_width=200).output
    for want in ("micro-batch", "default 32", "164,672", "--checkpointing", "--keep-buckets", "hidden 64"):
        assert want in out, want


# ------------------------------------------------------------------ collectives: predictions, profile
def _report(times: dict[int, float], *, r2_noise: bool = False):
    from zeroplan.bench.collectives import CollectivesReport, SizeResult

    results = []
    for size, t in times.items():
        results.append(SizeResult(op="all_reduce", size_bytes=size, count=size // 4, dtype="float32", group="all",
                                  group_size=2, time_s=t, algbw_GBps=size / t / 1e9, busbw_GBps=size / t / 1e9,
                                  busbw_factor=1.0, rank_time_s=[t, t], min_s=t, median_s=t, max_s=t, stragglers=[],
                                  records={"count": 1, "buffer_bytes": size}))
    return CollectivesReport(world_size=2, backend="gloo", launcher="local", dtype="float32", group="all",
                             gpus_per_node=2, nodes=1, warmup=1, iters=1, straggler_threshold=1.5,
                             ranks=[{"rank": 0, "node": 0, "local_rank": 0, "hostname": "box"},
                                    {"rank": 1, "node": 0, "local_rank": 1, "hostname": "box"}],
                             groups={}, results=results, stragglers=[])


def test_collectives_predicted_column_is_the_alpha_beta_time_on_the_profile():
    from zeroplan.bench.collectives import add_predictions
    from zeroplan.specs.hardware import load_profile

    hw = load_profile(PROFILE)
    rep = _report({1 << 20: 1e-3, 1 << 24: 1e-2})
    add_predictions(rep, hw)
    from zeroplan.core.comm import LedgerEntry
    from zeroplan.core.timing import collective_time_s

    for r in rep.results:
        # the planner's own time for one all-reduce of this full buffer over the 2 GPUs of one node
        e = LedgerEntry(op="all_reduce", phase="backward", what="x", buffer_bytes=r.size_bytes, count=3,
                        dtype="float32", group="all", group_size=2, overlap=True, sent_bytes_per_call=1,
                        sent_bytes=3)
        want = collective_time_s(e, hw, 2, 2)
        assert want > 0 and r.predicted_time_s == pytest.approx(want, rel=1e-12)
        assert r.predicted_busbw_GBps == pytest.approx(r.size_bytes / want / 1e9)
    small, big = rep.results
    assert big.predicted_time_s > small.predicted_time_s
    assert rep.hardware == hw.name


def test_save_profile_warns_on_a_poor_fit_and_names_the_measured_link(tmp_path):
    from zeroplan.bench.collectives import R2_WARN_BELOW, save_profile_from_report

    alpha, beta = 50e-6, 20e9  # a clean α–β link
    good = _report({s: alpha + s / beta for s in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)})
    fit = save_profile_from_report(good, str(tmp_path / "good.toml"), PROFILE)["intra_node"]
    assert fit["r2"] > R2_WARN_BELOW and fit["warning"] is None
    prof = tomllib.loads((tmp_path / "good.toml").read_text())
    assert prof["intra_node"]["name"] == "measured gloo all, 1 node(s) x 2 on box"
    assert prof["intra_node"]["name"] != "NVLink4"

    noisy = _report({1 << 16: 2e-3, 1 << 18: 0.2e-3, 1 << 20: 3e-3, 1 << 22: 0.5e-3, 1 << 24: 2.2e-3})
    fit = save_profile_from_report(noisy, str(tmp_path / "bad.toml"), PROFILE)["intra_node"]
    assert fit["r2"] < R2_WARN_BELOW and "poor alpha-beta fit" in fit["warning"]
    assert "WARNING poor alpha-beta fit" in (tmp_path / "bad.toml").read_text()


# ------------------------------------------------------------------ bench zero end to end (2 gloo ranks)
@pytest.fixture(scope="module")
def zero_report(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("bz") / "r.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "zeroplan", "bench", "zero", "--model", "llama-2-7b", "--stage", "2",
                        "--precision", "bf16", "--hardware", PROFILE, "--checkpointing", "full",
                        "--output", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(out.read_text()), r.stdout


def test_bench_zero_report_states_inputs_scaled_buckets_and_step_time(zero_report):
    rep, text = zero_report
    assert (rep["micro_batch"], rep["seq_len"], rep["checkpointing"], rep["device"]) == (2, 32, "full", "cpu")
    assert rep["scaled_from"]["params"] > 1000 * rep["model"]["params"]
    rbs = rep["buckets"]["reduce_bucket_size"]["scaled"]
    assert rbs == round(500_000_000 * rep["model"]["params"] / rep["scaled_from"]["params"])
    assert rep["stages"][0]["zero"]["reduce_bucket_size"] == rbs
    step = [r for r in rep["stages"][0]["rows"] if r["kind"] == "step_time"][0]
    assert not step["comparable"] and step["error"] is None and step["ok"]
    assert "micro-batch 2, sequence 32" in text and "not comparable" in text


def test_bench_zero_backward_peak_is_the_model_not_a_fixed_bucket(zero_report):
    rep, _ = zero_report
    rows = {r["name"]: r for r in rep["stages"][0]["rows"]}
    peak = rows["backward peak"]["measured"]
    buffers = rows.get("backward: buffers", {"measured": 0})["measured"]
    states = rows["model_states"]["measured"]
    # with DeepSpeed's absolute 5e8-element bucket the buffers were ~1 GB, >99 % of the peak
    assert buffers < 0.25 * peak and states > 0.4 * peak


def test_checkpointing_keeps_fewer_activations_and_trains_the_same():
    torch = pytest.importorskip("torch")
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.runtime.comm import LocalComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.memory import StorageTracker
    from zeroplan.runtime.model import build_model
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"), layers=3)
    got = {}
    for ck in ("none", "full"):
        meter = StorageTracker()
        with meter:
            model = build_model(spec, "fp32", "cpu", seed=0, checkpointing=ck)
            eng = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=4096), comm=LocalComm(1), meter=meter)
            gen = torch.Generator().manual_seed(0)
            losses = [eng.train_step([torch.randint(0, spec.vocab_size, (2, 32), generator=gen)])["loss"]
                      for _ in range(2)]
            eng.close()
        got[ck] = (losses, meter.phase_peaks()["forward"]["by_category"]["activations"])
    assert got["none"][0] == got["full"][0]
    assert got["full"][1] < 0.7 * got["none"][1]


def test_checkpointing_selective_is_refused_in_one_line():
    r = subprocess.run([sys.executable, "-m", "zeroplan", "bench", "zero", "--model", "gpt2",
                        "--checkpointing", "selective"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 2 and "--checkpointing 'selective'" in r.stderr and "Traceback" not in r.stderr
