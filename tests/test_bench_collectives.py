"""`zeroplan bench collectives` on gloo (2 and 4 local ranks) and the alpha-beta fit."""

from __future__ import annotations

import json
import math
import os
import tomllib

import pytest
from typer.testing import CliRunner

from zeroplan._util import InputError
from zeroplan.bench.fit import fit_alpha_beta
from zeroplan.cli import app

runner = CliRunner()

# nccl-tests doc/PERFORMANCE.md, written out here independently of zeroplan.specs
BUSBW = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


# A bound on hangs, not on speed: these sweeps take 1-4 s on an idle 2-core machine.
HANG_S = "300"


def _run_json(*args: str, env: dict | None = None) -> dict:
    result = runner.invoke(app, ["bench", "collectives", "--json", "--backend", "gloo", "--warmup", "1",
                                 "--iters", "3", "--timeout", HANG_S, *args], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _synthetic_times(monkeypatch, alpha_s: float, beta_Bps: float) -> None:
    """Replace gloo's measured per-rank means by an exact alpha-beta line before aggregation.

    The ranks, the instrumented layer, aggregation, the fit and the profile writer all run for
    real; only the timings (which a loaded machine makes noisy, even non-monotonic) are fixed.
    Rank r gets (1 + r/1000) x the line so that the slowest rank (what the report keeps) is known.
    """
    import zeroplan.bench.collectives as coll

    real = coll.aggregate

    def aggregate(per_rank, cfg, **kw):
        for r, pr in enumerate(per_rank):
            for res in pr["results"]:
                busbw_bytes = res["size_bytes"] * BUSBW[res["op"]](res["group_size"])
                res["time_s"] = (alpha_s + busbw_bytes / beta_Bps) * (1 + r / 1000)
        return real(per_rank, cfg, **kw)

    monkeypatch.setattr(coll, "aggregate", aggregate)


def _expected_sizes(min_b: int, max_b: int, factor: int, elem: int, n: int) -> list[int]:
    sizes, s = [], min_b
    while s <= max_b:
        count = max(n, (max(1, s // elem) // n) * n)
        sizes.append(count * elem)
        s *= factor
    return sizes


# ------------------------------------------------------------------ fit (torch-free)
def test_fit_recovers_known_alpha_beta_exactly():
    alpha, beta = 25e-6, 12.5e9  # 25 us, 12.5 GB/s
    pts = [(x, alpha + x / beta) for x in (2**k for k in range(10, 28))]
    for weighting in ("relative", "absolute"):
        f = fit_alpha_beta(pts, weighting=weighting)
        assert math.isclose(f.latency_us, 25.0, rel_tol=1e-9)
        assert math.isclose(f.bandwidth_GBps, 12.5, rel_tol=1e-9)
        assert f.r2 > 0.999999 and f.points == 18


def test_fit_with_noise_stays_close():
    import random

    rng = random.Random(7)
    alpha, beta = 8e-6, 300e9
    pts = [(x, (alpha + x / beta) * (1 + rng.uniform(-0.03, 0.03))) for x in (2**k for k in range(8, 30))]
    f = fit_alpha_beta(pts)
    assert abs(f.latency_us - 8.0) / 8.0 < 0.1
    assert abs(f.bandwidth_GBps - 300.0) / 300.0 < 0.1


def test_fit_rejects_degenerate_sweeps():
    with pytest.raises(InputError, match="two distinct"):
        fit_alpha_beta([(1024, 1e-5), (1024, 2e-5)])
    with pytest.raises(InputError, match="does not grow"):
        fit_alpha_beta([(1024, 2e-3), (2**20, 1e-3)])
    with pytest.raises(InputError, match="> 0"):
        fit_alpha_beta([(1024, 0.0), (2048, 1e-3)])
    # negative intercept -> alpha clamped to 0, fit through the origin
    f = fit_alpha_beta([(1e6, 0.9e-3), (2e6, 2e-3), (4e6, 4.1e-3)])
    assert f.alpha_s == 0.0 and f.beta_Bps > 0


# ------------------------------------------------------------------ the sweep on gloo
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_sweep_busbw_follows_formulas_and_records_are_exact(nproc):
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce"]
    data = _run_json("--nproc", str(nproc), "--ops", ",".join(ops), "--min-bytes", "1000", "--max-bytes", "64K",
                     "--factor", "8", "--dtype", "bfloat16")
    assert data["world_size"] == nproc and data["backend"] == "gloo" and data["dtype"] == "bfloat16"
    assert data["nodes"] == 1 and data["groups"]["intra-node"] == [list(range(nproc))]
    sizes = _expected_sizes(1000, 64 * 1024, 8, 2, nproc)
    assert [(r["op"], r["size_bytes"]) for r in data["results"]] == [(op, s) for op in ops for s in sizes]
    for r in data["results"]:
        n = r["group_size"]
        assert n == nproc
        assert len(r["rank_time_s"]) == nproc
        # time = slowest rank's mean; algbw = size / time; busbw = algbw x nccl-tests factor
        assert r["time_s"] == max(r["rank_time_s"]) == r["max_s"]
        assert r["min_s"] == min(r["rank_time_s"])
        assert math.isclose(r["algbw_GBps"], r["size_bytes"] / r["time_s"] / 1e9, rel_tol=1e-12)
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * BUSBW[r["op"]](n), rel_tol=1e-12)
        # the instrumented layer recorded every timed call with the exact full-buffer bytes
        assert r["records"] == {"count": 3, "buffer_bytes": r["size_bytes"], "consistent": 1}
        assert r["count"] * 2 == r["size_bytes"]


def test_straggler_rule_on_given_times():
    """The straggler rule itself, on exact times: time > threshold x median of the ranks."""
    from zeroplan.bench.collectives import BenchConfig, aggregate

    def rank(r: int, t: float) -> dict:
        return {"rank": r, "node": 0, "local_rank": r, "hostname": "h", "gpus_per_node": 4,
                "intra_ranks": [0, 1, 2, 3], "inter_ranks": [r],
                "results": [{"op": "all_reduce", "size_bytes": 4096, "count": 1024, "group_size": 4, "time_s": t,
                             "records": {"count": 3, "buffer_bytes": 4096, "consistent": 1}}]}

    cfg = BenchConfig(ops=["all_reduce"], min_bytes=4096, max_bytes=4096, straggler_threshold=1.5)
    rep = aggregate([rank(0, 1e-3), rank(1, 1.2e-3), rank(2, 1.6e-3), rank(3, 1.7e-3)], cfg,
                    backend="gloo", launcher="local")
    # median 1.4 ms: 1.6 and 1.7 ms are below 1.5 x 1.4 = 2.1 ms -> nobody
    assert rep.results[0].stragglers == [] and rep.stragglers == []
    rep = aggregate([rank(0, 1e-3), rank(1, 1.2e-3), rank(2, 2.2e-3), rank(3, 1.1e-3)], cfg,
                    backend="gloo", launcher="local")
    # median 1.15 ms x 1.5 = 1.725 ms < 2.2 ms -> rank 2 only
    assert rep.results[0].stragglers == [2]
    assert [(s["rank"], s["ratio"]) for s in rep.stragglers] == [(2, pytest.approx(2.2 / 1.15))]


@pytest.mark.slow
def test_straggler_is_flagged():
    # Rank 2 completes 0.5 s late per call (ZEROPLAN_BENCH_DELAY sleeps after its timed calls). The
    # others' 1-4 KiB calls take ~0.1-1 ms idle; they would have to take > 0.33 s each for rank 2
    # not to exceed 1.5x the median, so the flag does not depend on how busy the machine is.
    env = dict(os.environ, ZEROPLAN_BENCH_DELAY="2:0.5")
    data = _run_json("--nproc", "4", "--ops", "all_reduce", "--min-bytes", "1K", "--max-bytes", "4K",
                     "--factor", "4", "--iters", "1", "--warmup", "0", env=env)
    assert len(data["results"]) == 2
    for r in data["results"]:
        assert r["rank_time_s"][2] >= 0.5  # the injected delay is in the measured time
        assert 2 in r["stragglers"]
    assert {s["rank"] for s in data["stragglers"]} >= {2}


@pytest.mark.slow
def test_intra_and_inter_groups_on_a_simulated_two_node_layout():
    for group, members, kind in (("intra", [[0, 1], [2, 3]], "intra-node"), ("inter", [[0, 2], [1, 3]], "inter-node")):
        data = _run_json("--nproc", "4", "--gpus-per-node", "2", "--group", group, "--ops", "all_reduce",
                         "--min-bytes", "4K", "--max-bytes", "4K")
        assert data["nodes"] == 2 and data["gpus_per_node"] == 2
        assert data["groups"]["intra-node"] == [[0, 1], [2, 3]]
        assert data["groups"]["inter-node"] == [[0, 2], [1, 3]]
        assert [r["node"] for r in data["ranks"]] == [0, 0, 1, 1]
        (r,) = data["results"]
        assert r["group"] == kind and r["group_size"] == 2
        assert math.isclose(r["busbw_GBps"], r["size_bytes"] / r["time_s"] / 1e9 * 1.0, rel_tol=1e-12)
        assert members  # layout checked above


_BASE_PROFILE = """
name = "test-node"
description = "a test node"

[gpu]
name = "TestGPU"
memory_bytes = 85899345920
peak_flops = { bf16 = 989e12 }
hbm_bandwidth_GBps = 3350.0

[node]
gpus_per_node = 2
host_ram_bytes = 2199023255552
pcie_bandwidth_GBps_per_gpu = 64.0
nvme_bandwidth_GBps = 0.0
nvme_capacity_bytes = 0

[intra_node]
name = "NVLink4"
bandwidth_GBps_per_gpu = 450.0
latency_us = 3.0
efficiency = 0.8

[inter_node]
name = "IB"
bandwidth_GBps_per_gpu = 50.0
latency_us = 8.0
efficiency = 0.8

[overhead]
cuda_context_bytes = 1073741824
nccl_bytes = 536870912
fragmentation_fraction = 0.1

[sources]
gpu = "test"
node = "test"
intra_node = "test"
inter_node = "test"
overhead = "test"
"""


@pytest.mark.slow
def test_save_profile_writes_measured_link_and_output_json(tmp_path, monkeypatch):
    """The whole CLI path on real gloo ranks, with the timings replaced by an exact line
    (15 us + busbw bytes / 2.5 GB/s): the fit must recover it and the profile must store it."""
    _synthetic_times(monkeypatch, 15e-6, 2.5e9)
    base = tmp_path / "base.toml"
    base.write_text(_BASE_PROFILE)
    prof = tmp_path / "measured.toml"
    out = tmp_path / "sweep.json"
    data = _run_json("--nproc", "2", "--ops", "all_reduce,all_gather", "--min-bytes", "4K", "--max-bytes", "1M",
                     "--factor", "4", "--save-profile", str(prof), "--hardware", str(base), "--output", str(out))
    assert json.loads(out.read_text()) == data
    assert data["profile"] == str(prof)
    saved = tomllib.loads(prof.read_text())
    link = saved["intra_node"]  # one node -> the sweep measured the intra-node tier
    assert link["efficiency"] == 1.0
    fit = data["fit"]["intra_node"]
    # slowest rank = rank 1 = 1.001 x the line: alpha and 1/beta both scale by 1.001
    assert math.isclose(fit["latency_us"], 15.0 * 1.001, rel_tol=1e-6)
    assert math.isclose(fit["bandwidth_GBps"], 2.5 / 1.001, rel_tol=1e-6)
    assert fit["r2"] > 0.999999
    assert math.isclose(link["bandwidth_GBps_per_gpu"], fit["bandwidth_GBps"], rel_tol=1e-6)
    assert math.isclose(link["latency_us"], fit["latency_us"], rel_tol=1e-6)
    assert saved["inter_node"]["bandwidth_GBps_per_gpu"] == 50.0  # untouched tier
    assert saved["gpu"]["memory_bytes"] == 85899345920
    assert saved["name"] == "test-node-measured"
    assert "measured by zeroplan bench collectives on" in saved["sources"]["intra_node.bandwidth_GBps_per_gpu"]
    # the fitted line reproduces the measured times it was fitted on, within the fit's stated error
    for r in data["results"]:
        pred = fit["latency_us"] * 1e-6 + r["size_bytes"] * r["busbw_factor"] / (fit["bandwidth_GBps"] * 1e9)
        assert abs(pred - r["time_s"]) / r["time_s"] <= fit["max_rel_error"] + 1e-9


@pytest.mark.slow
def test_save_profile_on_times_that_do_not_grow_warns_and_writes_no_profile(tmp_path, monkeypatch):
    """A loaded machine can make small messages slower than large ones: the sweep is still
    reported (exit 0, JSON and --output), the profile is not written, and one warning says why."""
    import zeroplan.bench.collectives as coll

    real = coll.aggregate

    def shrinking(per_rank, cfg, **kw):
        for pr in per_rank:
            for res in pr["results"]:
                res["time_s"] = 1.0 / res["size_bytes"]  # time falls as the size grows
        return real(per_rank, cfg, **kw)

    monkeypatch.setattr(coll, "aggregate", shrinking)
    base = tmp_path / "base.toml"
    base.write_text(_BASE_PROFILE)
    prof, out = tmp_path / "measured.toml", tmp_path / "sweep.json"
    result = runner.invoke(app, ["bench", "collectives", "--json", "--backend", "gloo", "--nproc", "2", "--ops",
                                 "all_reduce", "--min-bytes", "4K", "--max-bytes", "64K", "--factor", "4", "--warmup",
                                 "0", "--iters", "1", "--timeout", HANG_S, "--save-profile", str(prof), "--hardware",
                                 str(base), "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fit"] == {} and data["profile"] is None
    assert json.loads(out.read_text()) == data
    assert not prof.exists()
    warnings = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --save-profile:"), result.stderr
    assert "does not grow" in warnings[0] and "no profile written" in warnings[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.toml", "sweep.json"]  # no temporary file


@pytest.mark.parametrize("args, needle", [
    (["--ops", "all_reduce,bogus"], "--ops"),
    (["--dtype", "int8"], "--dtype"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes"),
    (["--min-bytes", "lots"], "--min-bytes 'lots'"),
    (["--factor", "1"], "--factor"),
    (["--group", "rack"], "--group"),
    (["--group", "inter"], "--group inter"),
    (["--nproc", "4", "--gpus-per-node", "3"], "--gpus-per-node 3"),
    (["--nproc", "100000"], "--nproc 100000"),
    (["--save-profile", "x.toml"], "--hardware"),
    (["--straggler-threshold", "0.5"], "--straggler-threshold"),
    (["--straggler-threshold", "inf"], "'--straggler-threshold': 'inf' is not a finite number"),  # was exit 1 in every rank
])
def test_bad_input_exits_2_with_one_line(args, needle):
    result = runner.invoke(app, ["bench", "collectives", "--backend", "gloo", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_rank_failure_exits_1_naming_the_rank(monkeypatch):
    """A rank that raises (here rank 1, through the forked ranks' copy of the module) fails the run."""
    import zeroplan.bench.collectives as collectives

    real = collectives.bench_rank

    def rank_1_raises(rank, *args, **kwargs):
        if rank == 1:
            raise ValueError("injected in rank 1")
        return real(rank, *args, **kwargs)

    monkeypatch.setattr(collectives, "bench_rank", rank_1_raises)
    result = runner.invoke(app, ["bench", "collectives", "--backend", "gloo", "--nproc", "2", "--max-bytes", "1K",
                                 "--timeout", HANG_S])
    assert result.exit_code == 1, result.output
    assert "rank 1 raised ValueError: injected in rank 1" in result.output


@pytest.mark.slow
def test_table_output():
    result = runner.invoke(app, ["bench", "collectives", "--backend", "gloo", "--nproc", "2", "--ops", "all_reduce",
                                 "--min-bytes", "1K", "--max-bytes", "2K", "--iters", "2", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert "busbw GB/s" in result.output and "all_reduce" in result.output and "1 KiB" in result.output


def test_save_profile_across_nodes_stores_the_per_gpu_share(tmp_path):
    """A ring over all GPUs of several nodes measures the nodes' NICs together; the profile
    stores the per-GPU share (the planner multiplies it back by GPUs per node)."""
    from zeroplan.bench.collectives import CollectivesReport, save_profile_from_report

    base = tmp_path / "base.toml"
    base.write_text(_BASE_PROFILE)
    data = _run_json("--nproc", "4", "--gpus-per-node", "2", "--group", "all", "--ops", "all_reduce",
                     "--min-bytes", "64K", "--max-bytes", "1M", "--factor", "4")
    # replace gloo's noisy times by an exact alpha-beta line: 20 us + busbw bytes / 3 GB/s
    for r in data["results"]:
        r["time_s"] = 20e-6 + r["size_bytes"] * r["busbw_factor"] / 3e9
    report = CollectivesReport.model_validate(data)
    prof = tmp_path / "measured.toml"
    fits = save_profile_from_report(report, str(prof), str(base))
    saved = tomllib.loads(prof.read_text())
    assert math.isclose(saved["inter_node"]["bandwidth_GBps_per_gpu"], 3.0 / 2, rel_tol=1e-6)
    assert math.isclose(saved["inter_node"]["latency_us"], 20.0, rel_tol=1e-6)
    assert fits["inter_node"]["bandwidth_GBps"] == saved["inter_node"]["bandwidth_GBps_per_gpu"]
    assert "/ 2 GPUs per node" in saved["sources"]["inter_node.bandwidth_GBps_per_gpu"]
