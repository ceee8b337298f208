"""`zeroplan bench cpu-adam` (bench/cpu_adam.py): the node's CPU-optimizer rate, how the ranks'
steps are combined, the profile field it saves (node.cpu_adam_params_per_s_per_core) and the
command's errors. Nothing here asserts on speed: only on how the figures derive from the times."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "hardware_profiles" / "dgx-h100.toml")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _rank(spans):
    return {"rank": 0, "spans_s": spans, "finite": True}


# ------------------------------------------------------------------ combining the ranks (pure)
def test_ranks_that_overlap_count_once_and_ranks_that_take_turns_add_up():
    from zeroplan.bench.cpu_adam import CpuAdamConfig, aggregate_cpu_adam

    cfg = CpuAdamConfig(params=1000, iters=3)
    kw = dict(threads=1, cores=2, version="v", simd="AVX2", planner_default=8e7)
    together = aggregate_cpu_adam([_rank([(0, 1), (10, 11), (20, 21)]), _rank([(0, 1), (10, 11.5), (20, 21)])],
                                  cfg, **kw)
    assert together.step_s == 1.0  # median of 1, 1.5, 1
    assert together.params_per_s_per_rank == 1000.0 and together.params_per_s_total == 2000.0
    assert together.params_per_s_per_core == 1000.0 and together.cores_used == 2
    assert together.memory_GBps == pytest.approx(28 * 2000 / 1e9)
    # the second rank starts when the first ends (they shared one core): each alone took 1 s, the node 2 s
    turns = aggregate_cpu_adam([_rank([(0, 1), (10, 11), (20, 21)]), _rank([(1, 2), (11, 12), (21, 22)])], cfg, **kw)
    assert turns.step_s == 2.0 and turns.step_s_by_rank == [1.0, 1.0]
    assert turns.params_per_s_total == 1000.0


@pytest.mark.parametrize("nproc, threads, cores, needle", [
    (4, 1, 2, "oversubscribe the 2 physical core(s)"),
    (1, 1, 8, "1 of 8 physical cores were busy"),
])
def test_core_use_other_than_all_cores_is_warned(nproc, threads, cores, needle):
    from zeroplan.bench.cpu_adam import CpuAdamConfig, aggregate_cpu_adam

    rep = aggregate_cpu_adam([_rank([(0, 1)]) for _ in range(nproc)], CpuAdamConfig(params=10, iters=1),
                             threads=threads, cores=cores, version="v", simd="", planner_default=8e7)
    assert any(needle in w for w in rep.warnings), rep.warnings
    assert rep.cores_used == min(cores, nproc * threads)


def test_uneven_ranks_and_non_finite_parameters_are_warned():
    from zeroplan.bench.cpu_adam import CpuAdamConfig, aggregate_cpu_adam

    bad = {"rank": 1, "spans_s": [(0, 3)], "finite": False}
    rep = aggregate_cpu_adam([_rank([(0, 1)]), bad], CpuAdamConfig(params=10, iters=1), threads=1, cores=2,
                             version="v", simd="", planner_default=8e7)
    assert any("non-finite" in w for w in rep.warnings) and any("ranks differ" in w for w in rep.warnings)


# ------------------------------------------------------------------ the host's cores
CPUINFO_2x2x2 = "".join(  # 2 sockets x 2 cores x 2 hyper-threads; CPUs 0-3 on socket 0
    f"processor\t: {p}\nmodel name\t: Test CPU 9000\nphysical id\t: {p // 4}\ncore id\t\t: {p % 2}\n\n"
    for p in range(8))


def test_hyper_threads_count_once_and_bound_ranks_get_whole_cores(tmp_path, monkeypatch):
    from zeroplan.bench import cpu_adam

    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO_2x2x2)
    monkeypatch.setattr(cpu_adam, "CPUINFO", str(info))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_adam.core_cpus() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cpu_adam.physical_cores() == 4 and cpu_adam.cpu_model() == "Test CPU 9000"
    assert cpu_adam.rank_cpus(2, 2) == [[0, 1], [4, 5]]
    assert cpu_adam.rank_cpus(3, 2) == [[0, 1], [4, 5], [0, 1]]  # more threads than cores: wraps round
    assert cpu_adam.plan_threads(cpu_adam.CpuAdamConfig(), 2, 4) == 2
    assert cpu_adam.plan_threads(cpu_adam.CpuAdamConfig(), 8, 4) == 1
    assert cpu_adam.plan_threads(cpu_adam.CpuAdamConfig(threads=3), 8, 4) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # one socket allowed
    assert cpu_adam.physical_cores() == 2


def test_unreadable_topology_falls_back_to_one_core_per_cpu(tmp_path, monkeypatch):
    from zeroplan.bench import cpu_adam

    monkeypatch.setattr(cpu_adam, "CPUINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpu_adam.core_cpus() == [[0], [1], [2]]


@pytest.mark.parametrize("kwargs, nproc, needle", [
    ({"optimizer": "sgd"}, 1, "--optimizer 'sgd'"),
    ({"params": 0}, 1, "--params 0"),
    ({"threads": 0}, 1, "--threads 0"),
    ({"iters": 0}, 1, "--iters 0"),
    ({"params": 10**9}, 4, "more than 80% of the 1.0 GiB available"),
])
def test_settings_that_cannot_run_are_input_errors(kwargs, nproc, needle, monkeypatch):
    from zeroplan._util import InputError
    from zeroplan.bench.cpu_adam import CpuAdamConfig, check_config
    from zeroplan.runtime import launch

    monkeypatch.setattr(launch, "mem_available_bytes", lambda: 2**30)
    with pytest.raises(InputError) as exc:
        check_config(CpuAdamConfig(**kwargs), nproc)
    assert needle in str(exc.value)


# ------------------------------------------------------------------ the profile
def _report(**kw):
    from zeroplan.bench.cpu_adam import CpuAdamConfig, aggregate_cpu_adam

    rep = aggregate_cpu_adam([_rank([(0, 0.5)]) for _ in range(kw.pop("nproc", 8))],
                             CpuAdamConfig(params=10**8, iters=1, **kw), threads=14, cores=112,
                             version="deepspeed 0.19.8", simd="AVX512", planner_default=8e7)
    rep.physical_cores = kw.get("cores", 112)
    return rep


def test_save_profile_writes_the_per_core_rate_with_its_source(tmp_path):
    from zeroplan.bench.cpu_adam import save_cpu_adam_profile
    from zeroplan.specs.hardware import load_profile

    rep = _report()  # 8 ranks x 1e8 parameters in 0.5 s on 112 cores
    out = tmp_path / "m.toml"
    saved = save_cpu_adam_profile(rep, str(out), PROFILE)
    back = load_profile(str(out))
    assert back.node.cpu_adam_params_per_s_per_core == pytest.approx(8 * 1e8 / 0.5 / 112, rel=1e-3)
    assert back.name == "dgx-h100-measured" == saved.name
    src = back.sources["node.cpu_adam_params_per_s_per_core"]
    assert "bench cpu-adam" in src and "DeepSpeedCPUAdam (AVX512)" in src and "8 rank(s) x 14 thread(s)" in src
    assert rep.warnings == []  # 8 ranks per node and 112 cores, as the profile says


def test_save_profile_warns_when_the_run_differs_from_the_profile_and_refuses_torch(tmp_path):
    from zeroplan._util import InputError
    from zeroplan.bench.cpu_adam import save_cpu_adam_profile
    from zeroplan.specs.hardware import load_profile

    rep = _report(nproc=2)
    rep.physical_cores = 16
    save_cpu_adam_profile(rep, str(tmp_path / "m.toml"), PROFILE)
    src = load_profile(str(tmp_path / "m.toml")).sources["node.cpu_adam_params_per_s_per_core"]
    assert "runs 8 ranks per node, this ran 2" in src and "node.cpu_cores = 112, this host 16" in src
    rep.optimizer = "torch"
    with pytest.raises(InputError, match="only DeepSpeedCPUAdam"):
        save_cpu_adam_profile(rep, str(tmp_path / "t.toml"), PROFILE)
    assert not (tmp_path / "t.toml").exists()


def test_planner_times_the_cpu_step_with_the_measured_rate_and_says_where_it_came_from(tmp_path):
    from zeroplan.bench.cpu_adam import save_cpu_adam_profile
    from zeroplan.core.timing import cpu_adam_rate
    from zeroplan.specs.hardware import load_profile

    rate, src = cpu_adam_rate(load_profile(PROFILE), 8)
    assert rate == pytest.approx(8e7 * 112 / 8)
    assert src.endswith("profile dgx-h100 node.cpu_adam_params_per_s_per_core (bandwidth-bound estimate, not "
                        "measured on this hardware; zeroplan bench cpu-adam measures it)")
    save_cpu_adam_profile(_report(), str(tmp_path / "m.toml"), PROFILE)  # 8 x 1e8 in 0.5 s on 112 cores
    rate, src = cpu_adam_rate(load_profile(str(tmp_path / "m.toml")), 8)
    assert rate == pytest.approx(8 * 1e8 / 0.5 / 8, rel=1e-3)  # per core x 14 cores = one rank's share
    assert src.endswith(f"dgx-h100-measured node.cpu_adam_params_per_s_per_core (measured by zeroplan bench "
                        f"cpu-adam on {date.today().isoformat()})")


@pytest.mark.parametrize("value, ok", [(2e9, True), (5e9, True), (2e10, False)])
def test_profile_bound_admits_one_fast_core_and_rejects_a_node_figure(tmp_path, value, ok):
    from zeroplan._util import InputError
    from zeroplan.specs.hardware import load_profile

    text = Path(PROFILE).read_text().replace("cpu_adam_params_per_s_per_core = 8.0e7",
                                             f"cpu_adam_params_per_s_per_core = {value:g}")
    (tmp_path / "p.toml").write_text(text)
    if ok:
        assert load_profile(str(tmp_path / "p.toml")).node.cpu_adam_params_per_s_per_core == value
    else:
        with pytest.raises(InputError, match="1e10"):
            load_profile(str(tmp_path / "p.toml"))


# ------------------------------------------------------------------ the command
def _cli(args, tmp_path, timeout=180):
    return subprocess.run([sys.executable, "-m", "zeroplan", "bench", "cpu-adam", *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, cwd=tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--params", "lots"], "--params 'lots'"),
    (["--optimizer", "sgd"], "--optimizer 'sgd'"),
    (["--nproc", "0"], "--nproc 0"),
    (["--save-profile", "x.toml"], "--save-profile needs --hardware"),
    (["--save-profile", "x.toml", "--hardware", PROFILE, "--optimizer", "torch"], "only DeepSpeedCPUAdam"),
    (["--hardware", "no-such-profile"], "no-such-profile"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, needle, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "cpu-adam", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)  # an exit, not an escaped error
    assert not (tmp_path / "x.toml").exists()


def test_cli_bad_input_in_a_real_process_prints_no_traceback(tmp_path):
    r = _cli(["--params", "lots"], tmp_path, timeout=120)
    assert r.returncode == 2 and "--params 'lots'" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_cli_json_on_two_ranks_is_one_object_whose_figures_agree(tmp_path):
    pytest.importorskip("torch")
    r = _cli(["--optimizer", "torch", "--nproc", "2", "--threads", "1", "--params", "200K", "--iters", "3",
              "--warmup", "1", "--json", "--output", str(tmp_path / "r.json")], tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep == json.loads((tmp_path / "r.json").read_text())
    assert (rep["nproc"], rep["threads"], rep["params"], rep["iters"]) == (2, 1, 200_000, 3)
    assert rep["optimizer"] == "torch" and rep["optimizer_version"].startswith("torch ")
    assert rep["params_per_s_total"] == pytest.approx(2 * 200_000 / rep["step_s"], rel=1e-9)
    assert rep["params_per_s_per_core"] == pytest.approx(rep["params_per_s_total"] / rep["cores_used"], rel=1e-9)
    assert len(rep["step_s_by_rank"]) == 2 and rep["planner_default"] == 8e7


@pytest.mark.opbuild
def test_deepspeed_cpu_adam_runs_and_saves_a_profile(tmp_path):
    """The real op: DeepSpeed builds cpu_adam on first use (about a minute on 2 cores), so this runs
    in .ci/run's second pass (-m 'stress or opbuild'), not in the 6-minute suite."""
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: DeepSpeed cannot build its cpu_adam op")
    out = tmp_path / "m.toml"
    r = _cli(["--nproc", "2", "--params", "1M", "--iters", "2", "--warmup", "1", "--json", "--hardware", PROFILE,
              "--save-profile", str(out)], tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)  # DeepSpeed's own log lines went to stderr
    assert rep["optimizer"] == "deepspeed" and rep["optimizer_version"].startswith("deepspeed ")
    from zeroplan.specs.hardware import load_profile

    prof = load_profile(str(out))
    assert prof.node.cpu_adam_params_per_s_per_core == pytest.approx(rep["params_per_s_per_core"], rel=1e-3)
    assert "DeepSpeedCPUAdam" in prof.sources["node.cpu_adam_params_per_s_per_core"]


# ------------------------------------------------------------------ zeroplan validate's check
def test_validate_row_sets_the_measured_per_core_rate_beside_the_profile():
    from zeroplan.bench.cpu_adam import validation_rows
    from zeroplan.specs.hardware import load_profile

    calls = []

    def fake_run(cfg, *, nproc, timeout_s):
        calls.append((cfg.optimizer, nproc))
        return _report()  # 8 ranks x 1e8 parameters in 0.5 s on 112 cores

    (r,) = validation_rows(8, load_profile(PROFILE), run=fake_run)
    assert calls == [("deepspeed", 8)]
    assert r["check"] == "cpu-adam" and r["unit"] == "parameters/s" and r["predicted"] == 8e7
    assert r["measured"] == pytest.approx(8 * 1e8 / 0.5 / 112)
    assert r["error"] == pytest.approx(r["measured"] / 8e7 - 1)
    assert "8 rank(s) x 14 thread(s)" in r["figure"] and "bench cpu-adam" in r["note"]


def test_validate_row_is_skipped_with_the_reason_when_deepspeed_cannot_run():
    from zeroplan._util import InputError
    from zeroplan.bench.cpu_adam import validation_rows

    def no_deepspeed(cfg, *, nproc, timeout_s):
        raise InputError("bench cpu-adam needs DeepSpeed (ModuleNotFoundError: No module named 'deepspeed')")

    (r,) = validation_rows(1, None, run=no_deepspeed)
    assert r["figure"] == "skipped" and "needs DeepSpeed" in r["note"]
