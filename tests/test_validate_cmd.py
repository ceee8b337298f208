"""`zeroplan validate` without a GPU: one line and exit 2; every measurement that means the
same on a CPU is run there; the JSON/markdown writer on synthetic measurements."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _synthetic():
    from zeroplan.bench.gpu_validate import row

    return {"environment": {"device": "cuda", "gpu": "H100", "torch": "2.13.0"},
            "inputs": {"model": "llama-2-7b", "gpus": 8},
            "rows": [row("optimizer foreach", "step temporaries per element", 4.0, 4.0, unit="bytes/element"),
                     row("activations", "one layer | saved", 1000, 1250),
                     row("context", "CUDA context", None, 512 * 2**20),
                     row("multi-gpu", "skipped", None, None, unit="", note="1 GPU(s)")],
            "command": "zeroplan validate --output out"}


# ------------------------------------------------------------------ the writer
def test_writer_json_and_markdown(tmp_path):
    from zeroplan.bench.validate_report import render_markdown, write_validation

    rep = _synthetic()
    js, md = write_validation(rep, str(tmp_path / "out"))
    assert json.loads(js.read_text()) == rep
    text = md.read_text()
    assert "```\nzeroplan validate --output out\n```" in text
    assert "| check | figure | predicted | measured | unit | error | note |" in text
    assert "| activations | one layer \\| saved | 1,000 | 1,250 | bytes | +25.0% |" in text
    assert "| context | CUDA context | - | 536,870,912 | bytes | - |" in text
    assert text == render_markdown(rep)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["validation.json", "validation.md"]


def test_writer_refuses_a_file_and_writes_nothing_for_a_bad_report(tmp_path):
    from zeroplan._util import InputError
    from zeroplan.bench.validate_report import write_validation

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        write_validation(_synthetic(), str(f))
    bad = _synthetic()
    bad["rows"][0]["measured"] = math.nan
    with pytest.raises(ValueError):
        write_validation(bad, str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_row_error():
    from zeroplan.bench.gpu_validate import row

    assert row("c", "f", 100, 110)["error"] == pytest.approx(0.1)
    assert row("c", "f", 0, 110)["error"] is None and row("c", "f", None, 1)["error"] is None


# ------------------------------------------------------------------ the command
def test_validate_without_cuda_is_one_line_exit_2(tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "zeroplan", "validate", "--output", str(tmp_path / "o")],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no CUDA device:" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind,needle", [
    ("file", "exists and is not a directory"),
    ("under-a-file", "is not a directory, so the directory cannot be created"),
    ("proc", "under /proc, a kernel pseudo-filesystem"),
    ("report-link", "a kernel pseudo-file under /proc"),
    ("dangling", "which does not exist (or loops)"),  # mkdir failed on the link after the measurements
    ("loop", "which does not exist (or loops)"),
])
def test_a_bad_output_is_refused_before_the_gpu_is_looked_for(kind, needle, tmp_path, monkeypatch):
    """--output is checked before torch or CUDA: on a GPU node a typo would otherwise surface only when
    the report is written, after the measurements."""
    from typer.testing import CliRunner

    from zeroplan.cli import app
    from zeroplan.commands import validate as cmd

    monkeypatch.setattr(cmd, "cuda_status", lambda: pytest.fail("looked for CUDA before checking --output"))
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "under-a-file": tmp_path / "f" / "sub", "proc": Path("/proc/self/zp-out"),
           "report-link": tmp_path / "d", "dangling": tmp_path / "d", "loop": tmp_path / "d"}[kind]
    if kind == "dangling":
        os.symlink(tmp_path / "nowhere", out)
    if kind == "loop":
        os.symlink(tmp_path / "d2", out)
        os.symlink(out, tmp_path / "d2")
    if kind == "report-link":
        out.mkdir()
        os.symlink("/proc/self/mem", out / "validation.json")
    r = CliRunner().invoke(app, ["validate", "--output", str(out)])
    assert r.exit_code == 2, r.output[-600:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.stderr
    expected = {"report-link": ["d", "f"], "dangling": ["d", "f"], "loop": ["d", "d2", "f"]}.get(kind, ["f"])
    assert sorted(p.name for p in tmp_path.iterdir()) == expected


def test_validate_bad_checks_is_bad_input(tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "zeroplan", "validate", "--output", str(tmp_path), "--checks", "gpu"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2 and "--checks 'gpu'" in r.stderr


def test_validate_with_cuda_writes_both_files(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.bench import gpu_validate
    from zeroplan.cli import app
    from zeroplan.commands import validate as cmd

    seen = {}

    def fake_run(device, **kw):
        seen.update(kw, device=device)
        return _synthetic()

    monkeypatch.setattr(cmd, "cuda_status", lambda: (True, "1 device(s)"))
    monkeypatch.setattr(gpu_validate, "run_validation", fake_run)
    r = CliRunner().invoke(app, ["validate", "--output", str(tmp_path / "v"), "--gpus", "16", "--checks",
                                 "optimizer,deepspeed"])
    assert r.exit_code == 0, r.output
    assert seen["device"] == "cuda" and seen["gpus"] == 16 and seen["checks"] == ("optimizer", "deepspeed")
    assert (tmp_path / "v" / "validation.json").exists() and (tmp_path / "v" / "validation.md").exists()


# ------------------------------------------------------------------ measurements on the CPU
def test_optimizer_temporaries_foreach_vs_fused_on_cpu():
    pytest.importorskip("torch")
    from zeroplan.bench.gpu_validate import measure_optimizer_temps

    rows = {r["check"]: r for r in measure_optimizer_temps("cpu", numel=1 << 14)}
    # torch AdamW foreach allocates one fp32 temporary of the tensor's size (4 B/element, torch/optim/adamw.py
    # _multi_tensor_adam: exp_avg_sq_sqrt); fused=True updates in place
    assert rows["optimizer foreach"]["measured"] == 4.0
    assert rows["optimizer fused"]["measured"] == 0.0
    assert rows["optimizer fused_adam"]["figure"] == "skipped"


def test_optimizer_step_time_rows_on_cpu():
    """The timed rows exist on CPU (their times mean nothing there and are not asserted); the predicted
    times are the plan's HBM passes at the profile's streaming rate."""
    pytest.importorskip("torch")
    from zeroplan.bench.gpu_validate import measure_optimizer_time
    from zeroplan.specs.hardware import load_profile

    hw = load_profile("dgx-h100")
    n = 1 << 12
    rows = {r["check"]: r for r in measure_optimizer_time("cpu", hw, numel=n, iters=1)}
    rate = hw.gpu.hbm_bandwidth_GBps * 1e9 * 0.8
    assert rows["optimizer foreach time"]["predicted"] == pytest.approx(80 * n / rate * 1e3)
    assert rows["optimizer fused time"]["predicted"] == pytest.approx(28 * n / rate * 1e3)
    assert rows["optimizer foreach time"]["measured"] > 0 and rows["optimizer foreach time"]["unit"] == "ms"
    assert rows["optimizer fused_adam time"]["figure"] == "skipped"
    assert measure_optimizer_time("cpu", None, numel=n, iters=1)[0]["predicted"] is None


def test_context_is_cuda_only():
    from zeroplan.bench.gpu_validate import measure_context

    assert measure_context("cpu")[0]["figure"] == "skipped"


def test_layer_activations_of_a_real_transformers_layer_on_cpu():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zeroplan.bench.gpu_validate import measure_layer_activations
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"), layers=1, hidden=64)
    b, s = 2, 16
    (r,) = measure_layer_activations("cpu", spec, seq_len=s, micro_batch=b, precision="bf16")
    h, ffn = spec.hidden_size, spec.intermediate_size
    # at least the bf16 input of each of q/k/v/o/gate/up/down's GEMMs: 2 norm outputs + attention output +
    # the gate/up outputs' product = 3·sbh + sb·ffn elements of 2 bytes
    assert r["measured"] >= 2 * (3 * b * s * h + b * s * ffn)
    assert r["predicted"] > 0 and "LlamaDecoderLayer" in r["figure"]


def test_engine_peak_on_cpu_has_no_reserved_row():
    pytest.importorskip("torch")
    from zeroplan.bench.gpu_validate import measure_engine_peak
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"))
    rows = measure_engine_peak("cpu", spec, ZeroConfig(stage=2, reduce_bucket_size=10000), precision="bf16",
                               micro_batch=1, seq_len=16)
    assert len(rows) == 1 and rows[0]["measured"] > 2 * spec.params and "planner" in rows[0]["note"]


def test_multi_gpu_checks_skip_on_one_gpu_and_compare_a_sweep():
    from zeroplan.bench.gpu_validate import multi_gpu_checks
    from zeroplan.specs.hardware import load_profile

    assert [r["figure"] for r in multi_gpu_checks(0)] == ["skipped"]
    sys.path.insert(0, str(Path(__file__).parent))
    from test_bench_ux import _report

    alpha, beta = 20e-6, 100e9
    fake = _report({s: alpha + s / beta for s in (1 << 20, 1 << 22, 1 << 24, 1 << 26)})
    from zeroplan.bench.overlap import OverlapConfig, aggregate_overlap

    one = {"hostname": "h", "local_rank": 0, "device": "H100", "gemms": 4, "gathered_bytes": 1 << 28,
           "settings": {"hidden": 4096, "tokens": 4096, "size_bytes": 1 << 28, "dtype": "bfloat16"},
           "compute_s": 0.010, "comm_s": 0.004, "both_s": 0.0112}
    ov = aggregate_overlap([{**one, "rank": 0}, {**one, "rank": 1}], OverlapConfig(), backend="nccl",
                           launcher="local")
    rows = multi_gpu_checks(2, load_profile(str(REPO / "hardware_profiles" / "dgx-h100.toml")),
                            run=lambda cfg, **kw: fake, run_overlap_fn=lambda cfg, **kw: ov)
    bw = [r for r in rows if "α–β bandwidth" in r["figure"]][0]
    assert bw["measured"] == pytest.approx(beta / 1e9, rel=1e-6) and bw["predicted"] > 0
    assert sum(r["figure"].endswith("busbw") for r in rows) == 4
    slow = [r for r in rows if r["figure"].startswith("overlap slowdown")][0]
    assert slow["predicted"] == 0.15 and slow["measured"] == pytest.approx(0.3) and slow["unit"] == "fraction"


def test_real_deepspeed_as_rank0_of_8_on_the_fake_group_cpu():
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    code = r"""
import json, os
os.environ["DS_ACCELERATOR"] = "cpu"
from zeroplan.bench.gpu_validate import measure_deepspeed_virtual
from zeroplan.bench.validate import _zero_config, predict, scaled_spec
from zeroplan.specs.model import load_model
spec = scaled_spec(load_model("llama-2-7b"), layers=2, hidden=64)
plan = predict(spec, _zero_config(2, None), precision="bf16", micro_batch=1, seq_len=16, grad_accum=1, n=8)
rows = measure_deepspeed_virtual("cpu", spec, n=8, stage=2, precision="bf16", micro_batch=1, seq_len=16, plan=plan)
print("RESULT" + json.dumps(rows))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row, peak = json.loads(r.stdout[r.stdout.index("RESULT") + 6:].splitlines()[0])
    # bf16 stage 2, rank 0 of 8: 2Ψ params + 12Ψ/8 optimizer states (padding aside) — DeepSpeed, not zeroplan
    psi = 164672
    assert row["measured"] == pytest.approx(2 * psi + 12 * psi / 8, rel=0.02)
    assert abs(row["error"]) < 0.1
    # on CPU the peak of every live tensor storage, beside the plan's allocated bytes
    assert peak["figure"] == "rank 0 of 8: peak live tensor bytes (stage 2)"
    assert peak["measured"] > row["measured"] and peak["predicted"] > row["predicted"]


def test_run_validation_keeps_going_when_one_check_fails(monkeypatch):
    pytest.importorskip("torch")
    from zeroplan.bench import gpu_validate as gv

    def broken(device):
        raise RuntimeError("cuBLAS failed to initialise")

    monkeypatch.setattr(gv, "measure_context", broken)
    rep = gv.run_validation("cpu", model="llama-2-7b", layers=1, hidden=64, seq_len=16,
                            checks=("context", "optimizer", "multi-gpu"))
    by = {r["check"]: r for r in rep["rows"]}
    assert by["context"]["figure"] == "failed" and "cuBLAS" in by["context"]["note"]
    assert by["optimizer foreach"]["measured"] == 4.0
    assert by["optimizer foreach"]["predicted"] == 4.0  # the planner's optimizer_temp / Ψ
    assert by["multi-gpu"]["figure"] == "skipped"
    assert rep["environment"]["device"] == "cpu" and rep["inputs"]["scaled"]["layers"] == 1


def test_one_gpu_runs_the_nccl_smoke_test_and_skips_the_rest():
    from zeroplan.bench.collectives import BenchConfig
    from zeroplan.bench.gpu_multi import multi_gpu_checks

    sys.path.insert(0, str(Path(__file__).parent))
    from test_bench_ux import _report

    seen = []

    def fake(cfg, **kw):
        seen.append((isinstance(cfg, BenchConfig), kw["nproc"], kw["backend"]))
        return _report({1 << 20: 30e-6, 1 << 24: 90e-6})

    rows = multi_gpu_checks(1, run=fake)
    assert seen == [(True, 1, "nccl")]
    smoke = [r for r in rows if r["figure"].startswith("NCCL smoke test (1 rank): ")]
    assert [r["measured"] for r in smoke] == [pytest.approx(30.0), pytest.approx(90.0)]  # µs
    assert all(r["predicted"] is None and r["unit"] == "µs" for r in smoke)
    assert rows[-1]["figure"] == "skipped" and "at least 2" in rows[-1]["note"]

    def broken(cfg, **kw):
        raise RuntimeError("NCCL error: unhandled system error")

    failed = multi_gpu_checks(1, run=broken)
    assert failed[0]["figure"] == "NCCL smoke test (1 rank) failed" and "unhandled system error" in failed[0]["note"]


def test_layer_matmul_shapes_are_the_models_own():
    from zeroplan.bench.gemm_check import layer_matmul_shapes
    from zeroplan.specs.model import load_model

    assert layer_matmul_shapes(load_model("llama-2-7b")) == [
        ("q_proj", 4096, 4096), ("k_proj", 4096, 4096), ("v_proj", 4096, 4096), ("o_proj", 4096, 4096),
        ("gate_proj", 4096, 11008), ("up_proj", 4096, 11008), ("down_proj", 11008, 4096), ("lm_head", 4096, 32000)]
    gqa = dict((n, (k, o)) for n, k, o in layer_matmul_shapes(load_model("llama-3-8b")))
    assert gqa["k_proj"] == (4096, 1024) and gqa["q_proj"] == (4096, 4096) and gqa["lm_head"] == (4096, 128256)


def test_gemm_rows_set_measured_tflops_beside_the_compute_models_rate():
    pytest.importorskip("torch")
    from zeroplan.bench.gemm_check import measure_layer_gemms
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.hardware import load_profile
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"), layers=1, hidden=64)
    hw = load_profile(str(REPO / "hardware_profiles" / "dgx-h100.toml"))
    rows = measure_layer_gemms("cpu", spec, seq_len=16, micro_batch=2, precision="fp32", hardware=hw, iters=2)
    assert [r["check"] for r in rows] == ["gemm"] * 9  # q k v o gate up down lm_head, then the layer
    m = 2 * 16
    shape = min(m, 64) / (min(m, 64) + 128)  # core/compute.py: m / (m + 128) for min(tokens, hidden)
    planned = hw.gpu.peak_flops["fp32"] * 0.56 * shape / 1e12  # fp32 peak (torch keeps TF32 off), Hopper 0.56
    assert all(r["predicted"] == pytest.approx(planned) and r["measured"] > 0 and r["unit"] == "TFLOP/s" for r in rows)
    assert rows[0]["figure"] == f"q_proj ({m} × 64) @ (64 × 64) forward + backward"
    assert rows[-1]["figure"] == f"one layer + LM head, m = {m} tokens" and "shape factor 0.200" in rows[-1]["note"]
    assert measure_layer_gemms("cpu", spec, seq_len=16, micro_batch=2, precision="fp32", iters=1)[0]["predicted"] is None


def test_two_gpus_time_both_overlaps_and_a_failed_one_keeps_the_other_rows():
    from zeroplan.bench.gpu_multi import multi_gpu_checks
    from zeroplan.bench.overlap import OverlapConfig, aggregate_overlap

    sys.path.insert(0, str(Path(__file__).parent))
    from test_bench_ux import _report

    one = {"hostname": "h", "local_rank": 0, "device": "H100", "gemms": 4, "gathered_bytes": 1 << 28,
           "settings": {"hidden": 4096, "tokens": 4096, "size_bytes": 1 << 28, "dtype": "bfloat16"},
           "compute_s": 0.010, "comm_s": 0.004, "both_s": 0.0112}
    ops = []

    def overlap(cfg, **kw):
        ops.append(cfg.op)
        if cfg.op == "reduce_scatter":
            raise RuntimeError("NCCL watchdog timeout")
        return aggregate_overlap([{**one, "rank": 0}, {**one, "rank": 1}], cfg, backend="nccl", launcher="local")

    rows = multi_gpu_checks(2, None, run=lambda cfg, **kw: _report({1 << 20: 30e-6, 1 << 24: 90e-6}),
                            run_overlap_fn=overlap)
    assert ops == ["all_gather", "reduce_scatter"]
    assert sum(r["figure"].endswith("busbw") for r in rows) == 2  # the sweep's rows stay
    ag = [r for r in rows if r["figure"].startswith("overlap slowdown: ")]
    assert len(ag) == 1 and "all-gather beside 4 matmuls" in ag[0]["figure"] and ag[0]["measured"] == pytest.approx(0.3)
    assert rows[-1]["figure"] == "overlap slowdown (reduce-scatter) failed" and "watchdog" in rows[-1]["note"]


def test_pcie_rows_time_one_gpu_and_then_all_at_once_in_both_directions():
    from zeroplan.bench.pcie_check import measure_pcie, pcie_rows

    calls = []

    def fake_round(devices, direction):  # 10 ms for one GPU, 20 ms when 4 share the host
        calls.append((tuple(devices), direction))
        return 0.010 if len(devices) == 1 else 0.020

    rows = pcie_rows(fake_round, 4, 63.0, size_bytes=500_000_000, iters=3)
    assert [r["figure"] for r in rows] == [
        "host to GPU, one GPU alone: GB/s per GPU", "GPU to host, one GPU alone: GB/s per GPU",
        "host to GPU, 4 GPUs at once: GB/s per GPU", "GPU to host, 4 GPUs at once: GB/s per GPU"]
    assert [r["measured"] for r in rows] == [pytest.approx(50.0)] * 2 + [pytest.approx(25.0)] * 2
    assert all(r["predicted"] == 63.0 and r["unit"] == "GB/s" for r in rows)
    assert rows[0]["error"] == pytest.approx(50 / 63 - 1)
    assert len(calls) == 4 * (1 + 3) and calls[0] == ((0,), "h2d")  # a warm-up round, then 3 timed
    assert len(pcie_rows(fake_round, 1, None, iters=1)) == 2  # one GPU: no "at once" rows
    assert measure_pcie("cpu")[0]["figure"] == "skipped"
