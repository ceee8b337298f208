"""`zeroplan validate --checks compute` on the CPU: the rows exist, the model it times is the spec's
own architecture, and each prediction is the compute model's figure for that work (the times
themselves mean something on a GPU only, and are never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _hw():
    from zeroplan.specs.hardware import load_profile

    return load_profile(str(REPO / "hardware_profiles" / "hgx-h200.toml"))


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "gpt2"])
def test_the_timed_model_is_the_specs_own_architecture(name):
    import torch

    from zeroplan.bench.compute_check import _build_model
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model(name), layers=1, hidden=64)
    model = _build_model(spec, "cpu", torch.float32)
    # tied heads share one storage; the spec counts shared tensors once, as DeepSpeed does
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert model.training and model.config.use_cache is False


def test_compute_rows_set_each_time_beside_the_compute_model():
    from zeroplan.bench.compute_check import measure_compute
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.core.compute import estimate_compute
    from zeroplan.specs.model import load_model
    from zeroplan.specs.training import PRECISIONS, TrainingSetup

    hw = _hw()
    spec = scaled_spec(load_model("llama-2-7b"), layers=1, hidden=64)
    rows = measure_compute("cpu", spec, seq_len=16, micro_batch=2, precision="fp32", hardware=hw, iters=1,
                           copy_bytes=1 << 16)
    assert [r["check"] for r in rows] == ["compute"] * 4 and all(r["measured"] > 0 for r in rows)
    copy, attention, step, step_ck = rows
    assert copy["unit"] == "GB/s" and copy["predicted"] == pytest.approx(4800.0 * 0.8)  # H200 HBM3e × 0.8
    assert copy["figure"] == "device copy of 65,536 bytes (read + write)"
    # heads 4 × head_dim 16 at s = 16, b = 2: 3 passes × 4 · 64 · 16 FLOPs per token × 32 tokens, at the
    # fp32 (TF32) peak × Hopper's attention fraction 0.36
    flops = 3 * 4 * 64 * 16 * 32
    assert attention["unit"] == "ms"
    assert attention["predicted"] == pytest.approx(flops / (hw.gpu.peak_flops["fp32"] * 0.36) * 1e3)
    for r, ck in ((step, "none"), (step_ck, "full")):
        assert r["figure"].endswith(f"(1 layers, b=2, s=16, fp32, checkpointing {ck})")
        setup = TrainingSetup(precision=PRECISIONS["fp32"], micro_batch=2, seq_len=16, checkpointing=ck,
                              kernels="unfused")
        assert r["predicted"] == pytest.approx(estimate_compute(spec, setup, hw).time_s * 1e3)
        fused = estimate_compute(spec, setup.model_copy(update={"kernels": "fused"}), hw).time_s * 1e3
        assert r["predicted"] > fused  # transformers' code runs op by op: the unfused count
    assert step_ck["predicted"] > step["predicted"]


def test_without_a_profile_nothing_is_predicted():
    from zeroplan.bench.compute_check import measure_compute
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("gpt2"), layers=1, hidden=64)
    rows = measure_compute("cpu", spec, seq_len=8, micro_batch=1, precision="fp32", iters=1, copy_bytes=1 << 12)
    assert len(rows) == 4 and all(r["predicted"] is None and r["error"] is None for r in rows)


def test_run_validation_runs_the_compute_check_after_gemm():
    from zeroplan.bench import gpu_validate as gv

    assert gv.CHECKS.index("compute") == gv.CHECKS.index("gemm") + 1
    rep = gv.run_validation("cpu", model="llama-2-7b", layers=1, hidden=64, seq_len=8, hardware=_hw(),
                            checks=("compute",))
    assert [r["check"] for r in rep["rows"]] == ["compute"] * 4
    assert all(r["predicted"] is not None for r in rep["rows"])


def test_checks_that_fork_run_first_whatever_order_they_are_asked_in():
    from zeroplan.bench import gpu_validate as gv

    seen = []
    rep = gv.run_validation("cpu", model="llama-2-7b", layers=1, hidden=64, seq_len=8,
                            checks=("context", "multi-gpu"), progress=lambda name, partial: seen.append(name))
    assert seen == ["multi-gpu", "context"] and gv.CHECKS[:2] == ("multi-gpu", "cpu-adam")
    assert rep["environment"]["device"] == "cpu" and "torch" in rep["environment"]  # filled in at the end


def test_the_command_writes_the_report_before_each_check(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from zeroplan.bench import gpu_validate
    from zeroplan.cli import app
    from zeroplan.commands import validate as cmd

    out = tmp_path / "v"
    on_disk = []

    def fake_run(device, progress=None, **kw):
        rep = {"environment": {"device": device}, "inputs": {}, "rows": []}
        progress("optimizer", rep)
        on_disk.append(json.loads((out / "validation.json").read_text()))
        rep["rows"].append(gpu_validate.row("optimizer foreach", "step temporaries per element", 4.0, 4.0,
                                            unit="bytes/element"))
        return rep

    monkeypatch.setattr(cmd, "cuda_status", lambda: (True, "1 device(s)"))
    monkeypatch.setattr(gpu_validate, "run_validation", fake_run)
    r = CliRunner().invoke(app, ["validate", "--output", str(out), "--checks", "optimizer"])
    assert r.exit_code == 0, r.output
    assert on_disk[0]["incomplete"] == "stopped before or during optimizer" and on_disk[0]["rows"] == []
    final = json.loads((out / "validation.json").read_text())
    assert "incomplete" not in final and len(final["rows"]) == 1


def test_deepspeeds_arch_suffix_failure_names_the_fix(monkeypatch):
    from zeroplan.bench.validate_rows import op_build_failure

    exc = ValueError("invalid literal for int() with base 10: '0a'")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert "set it without one, e.g. TORCH_CUDA_ARCH_LIST=9.0" in op_build_failure(exc)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert op_build_failure(exc) == "ValueError: invalid literal for int() with base 10: '0a'"


def test_real_deepspeed_runs_stage_3_after_stage_2_in_one_process():
    pytest.importorskip("deepspeed")
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.bench.validate_deepspeed import deepspeed_stages
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"), layers=1, hidden=64)
    rows = deepspeed_stages("cpu", spec, n=8, precision="bf16", micro_batch=1, seq_len=16)
    # before the cached groups were restored, stage 3 failed with "Group ... is not registered"
    assert [r["figure"] for r in rows] == ["rank 0 of 8: params + optimizer states (stage 2, bf16)",
                                           "rank 0 of 8: peak live tensor bytes (stage 2)",
                                           "rank 0 of 8: params + optimizer states (stage 3, bf16)",
                                           "rank 0 of 8: peak live tensor bytes (stage 3)"]
    states = [r for r in rows if "optimizer states" in r["figure"]]
    # exact but for torch AdamW's 4-byte step counter (DeepSpeed's FusedAdam, on a GPU, keeps an int)
    assert all(r["measured"] - r["predicted"] == 4 for r in states)
    # on CPU the peak is every live tensor storage (runtime.memory.StorageTracker): a real figure, above the
    # model states it contains
    peaks = [r for r in rows if "peak live" in r["figure"]]
    assert all(r["measured"] > s["measured"] for r, s in zip(peaks, states))
