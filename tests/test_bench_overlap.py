"""`zeroplan bench overlap` (bench/overlap.py): the slowdown fraction, the measurement on gloo,
the profile field it saves (node.overlap_slowdown) and the planner using that field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "hardware_profiles" / "dgx-h100.toml")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# ------------------------------------------------------------------ the fraction (pure)
@pytest.mark.parametrize("compute, comm, both, expected", [
    (10.0, 5.0, 10.0, 0.0),   # the all-gather hid entirely behind the matmuls
    (10.0, 5.0, 15.0, 1.0),   # serialised
    (10.0, 5.0, 12.5, 0.5),   # half of it lost
    (4.0, 8.0, 10.0, 0.5),    # the matmuls are the shorter activity
    (10.0, 5.0, 22.0, 1.0),   # slower than serial (noise): clamped
    (10.0, 5.0, 9.0, 0.0),    # faster than either alone (noise): clamped
    (0.0, 5.0, 5.0, 0.0),     # nothing to hide
])
def test_slowdown_fraction(compute, comm, both, expected):
    from zeroplan.bench.overlap import slowdown_fraction

    assert slowdown_fraction(compute, comm, both) == pytest.approx(expected)


def _rank(rank: int, compute: float, comm: float, both: float, size: int = 1 << 20) -> dict:
    return {"rank": rank, "hostname": "h", "local_rank": rank, "device": "cpu", "gemms": 3,
            "settings": {"hidden": 64, "tokens": 32, "size_bytes": size, "dtype": "float32"},
            "gathered_bytes": size, "compute_s": compute, "comm_s": comm, "both_s": both}


def test_aggregate_takes_the_slowest_rank_and_derives_rates():
    from zeroplan.bench.overlap import OverlapConfig, aggregate_overlap

    rep = aggregate_overlap([_rank(0, 0.010, 0.004, 0.011), _rank(1, 0.012, 0.005, 0.014)], OverlapConfig(),
                            backend="gloo", launcher="local")
    assert (rep.compute_s, rep.comm_s, rep.both_s) == (0.012, 0.005, 0.014)
    assert rep.slowdown == pytest.approx((0.014 - 0.012) / 0.005)
    assert rep.busbw_GBps == pytest.approx((1 << 20) * 0.5 / 0.005 / 1e9)  # all-gather busbw: (n-1)/n
    assert rep.compute_tflops == pytest.approx(2 * 32 * 64 * 256 * 3 / 0.012 / 1e12)
    assert rep.planner_default == 0.15 and rep.warnings == []


def test_aggregate_warns_on_one_rank_and_on_compute_shorter_than_the_gather():
    from zeroplan.bench.overlap import OverlapConfig, aggregate_overlap

    rep = aggregate_overlap([_rank(0, 0.002, 0.005, 0.006)], OverlapConfig(), backend="nccl", launcher="local")
    assert len(rep.warnings) == 2
    assert "one rank" in rep.warnings[0] and "shorter than the all-gather" in rep.warnings[1]


def test_resolve_config_defaults_by_device_and_rejects_bad_settings():
    from zeroplan._util import InputError
    from zeroplan.bench.overlap import OverlapConfig, resolve_config

    assert resolve_config(OverlapConfig(), "cuda") == {"hidden": 4096, "tokens": 4096, "size_bytes": 256 * 2**20,
                                                       "dtype": "bfloat16"}
    assert resolve_config(OverlapConfig(hidden=128), "cpu")["hidden"] == 128
    for bad, needle in ((OverlapConfig(hidden=0), "--hidden 0"), (OverlapConfig(dtype="int8"), "--dtype 'int8'"),
                        (OverlapConfig(iters=0), "--iters 0"), (OverlapConfig(op="broadcast"), "--op 'broadcast'")):
        with pytest.raises(InputError, match=needle):
            resolve_config(bad, "cpu")


# ------------------------------------------------------------------ a real run on gloo
def test_run_on_two_gloo_ranks_measures_every_figure():
    pytest.importorskip("torch")
    from zeroplan.bench.overlap import OverlapConfig, run_overlap

    rep = run_overlap(OverlapConfig(hidden=64, tokens=64, size_bytes=1 << 16, warmup=1, iters=2), nproc=2,
                      backend="gloo", timeout_s=120)
    assert rep.world_size == 2 and rep.backend == "gloo" and rep.device == "cpu" and len(rep.ranks) == 2
    assert rep.size_bytes == 1 << 16 and rep.gemms >= 1 and rep.dtype == "float32"
    assert rep.compute_s > 0 and rep.comm_s > 0 and rep.both_s > 0
    assert 0.0 <= rep.slowdown <= 1.0
    assert rep.gemm_flops == 2 * 64 * 64 * 256


def test_reduce_scatter_run_on_two_gloo_ranks_reports_its_own_bus_bandwidth(tmp_path):
    pytest.importorskip("torch")
    from zeroplan.bench.overlap import OverlapConfig, run_overlap, save_overlap_profile
    from zeroplan.specs.collectives import busbw_factor
    from zeroplan.specs.hardware import load_profile

    rep = run_overlap(OverlapConfig(op="reduce_scatter", hidden=64, tokens=64, size_bytes=1 << 16, warmup=1,
                                    iters=2), nproc=2, backend="gloo", timeout_s=120)
    assert rep.op == "reduce_scatter" and rep.size_bytes == 1 << 16 and 0.0 <= rep.slowdown <= 1.0
    assert rep.busbw_GBps == pytest.approx((1 << 16) * busbw_factor("reduce_scatter", 2) / rep.comm_s / 1e9)
    save_overlap_profile(rep, str(tmp_path / "p.toml"), PROFILE)
    assert "reduce-scatter of 65536 B" in load_profile(str(tmp_path / "p.toml")).sources["node.overlap_slowdown"]


# ------------------------------------------------------------------ the profile field
def _report(slowdown_both: float):
    from zeroplan.bench.overlap import OverlapConfig, aggregate_overlap

    return aggregate_overlap([_rank(0, 0.010, 0.005, slowdown_both), _rank(1, 0.010, 0.005, slowdown_both)],
                             OverlapConfig(), backend="nccl", launcher="torchrun")


def test_save_profile_writes_the_measured_slowdown_with_its_source(tmp_path):
    from zeroplan.bench.overlap import save_overlap_profile
    from zeroplan.specs.hardware import load_profile

    before = Path(PROFILE).read_bytes()
    out = tmp_path / "mine.toml"
    save_overlap_profile(_report(0.0135), str(out), PROFILE)
    prof = load_profile(str(out))
    assert prof.node.overlap_slowdown == pytest.approx(0.7)
    assert prof.name == "dgx-h100-measured"
    assert "bench overlap" in prof.sources["node.overlap_slowdown"]
    assert prof.gpu == load_profile(PROFILE).gpu and Path(PROFILE).read_bytes() == before
    save_overlap_profile(_report(0.0135), str(tmp_path / "again.toml"), str(out))
    assert load_profile(str(tmp_path / "again.toml")).name == "dgx-h100-measured"  # not -measured-measured


@pytest.mark.parametrize("value, needle", [
    ("1.5", "node.overlap_slowdown = 1.5 is out of range; expected a fraction in [0, 1]"),
    ("-0.1", "node.overlap_slowdown = -0.1 is out of range"),
])
def test_profile_rejects_a_slowdown_outside_0_1(tmp_path, value, needle):
    from zeroplan._util import InputError
    from zeroplan.specs.hardware import load_profile

    text = Path(PROFILE).read_text().replace("[node]\n", f"[node]\noverlap_slowdown = {value}\n", 1)
    text = text.replace("[sources]\n", '[sources]\n"node.overlap_slowdown" = "test"\n', 1)
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_profile(str(p))


def test_profile_slowdown_needs_a_source(tmp_path):
    from zeroplan._util import InputError
    from zeroplan.specs.hardware import load_profile

    p = tmp_path / "nosrc.toml"
    p.write_text(Path(PROFILE).read_text().replace("[node]\n", "[node]\noverlap_slowdown = 0.3\n", 1))
    with pytest.raises(InputError, match="node.overlap_slowdown has no source"):
        load_profile(str(p))


# ------------------------------------------------------------------ the planner uses it
def _plan(slowdown: float | None):
    from zeroplan.core.plan import evaluate
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.hardware import load_profile
    from zeroplan.specs.model import load_model
    from zeroplan.specs.training import TrainingSetup, get_precision

    hw = load_profile(PROFILE)
    if slowdown is not None:
        hw = hw.model_copy(update={"node": hw.node.model_copy(update={"overlap_slowdown": slowdown}),
                                   "sources": {**hw.sources, "node.overlap_slowdown": "measured on the test rig"}})
    # 8 x 2048 tokens per GPU: enough work per module that DeepSpeed's stage-3 hooks hide behind the GPU
    # (core/host_time.py), so the step is the GPU's alone
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=8, seq_len=2048, grad_accum=1)
    return evaluate(model=load_model("llama-2-7b"), training=tr, zero=ZeroConfig(stage=3), n_gpus=16,
                    hardware=hw).time


def test_planner_charges_the_profile_slowdown():
    default, none_hides, free = _plan(None), _plan(1.0), _plan(0.0)
    assert default.host_bound_s == none_hides.host_bound_s == free.host_bound_s == 0.0
    assert default.hidden_comm_s > 0 and default.overlap_slowdown == 0.15
    assert default.overlap_slowdown_s == pytest.approx(0.15 * default.hidden_comm_s)
    # 1 = nothing hides: the schedule's step is the no-overlap bracket
    assert none_hides.overlap_slowdown == 1.0
    assert none_hides.step_time_s == pytest.approx(none_hides.step_time_worst_s, rel=1e-12)
    # 0 = hidden for free: compute + what the schedule exposes
    assert free.step_time_s == pytest.approx(free.compute_time_s + free.exposed_time_s["estimate"]
                                             + free.gpu_optimizer_time_s, rel=1e-12)
    assert free.step_time_s < default.step_time_s < none_hides.step_time_s
    assert any("measured on the test rig" in a for a in none_hides.assumptions)
    assert any("T3" in a for a in default.assumptions)


# ------------------------------------------------------------------ the command
@pytest.mark.parametrize("args, needle", [
    (["--iters", "0"], "--iters 0"),
    (["--dtype", "int4"], "--dtype 'int4'"),
    (["--size", "lots"], "--size 'lots'"),
    (["--save-profile", "x.toml"], "--save-profile needs --hardware"),
    (["--hardware", "no-such-profile"], "no-such-profile"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "zeroplan", "bench", "overlap", *args], capture_output=True,
                       text=True, env=ENV, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.toml").exists()


def test_cli_json_and_save_profile(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "p.toml"
    r = subprocess.run([sys.executable, "-m", "zeroplan", "bench", "overlap", "--hidden", "64", "--tokens", "64",
                        "--size", "64K", "--iters", "2", "--warmup", "1", "--backend", "gloo", "--json",
                        "--save-profile", str(out), "--hardware", PROFILE], capture_output=True, text=True,
                       env=ENV, timeout=180)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["profile"] == str(out) and rep["size_bytes"] == 65536 and 0 <= rep["slowdown"] <= 1
    from zeroplan.specs.hardware import load_profile

    assert load_profile(str(out)).node.overlap_slowdown == pytest.approx(round(rep["slowdown"], 4))
