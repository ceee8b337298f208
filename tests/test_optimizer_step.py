"""The optimizer step's HBM traffic on the GPU (core/optimizer_step.py) against the ops real code runs.

examples/validation/cpu-replay/step_traffic.py traces real DeepSpeed 0.19.8's ``engine.step()`` on CPU
(rank 0 of 8 on torch's fake process group) and charges every ATen op the bytes it reads and writes.
The plan's passes must add up to the same bytes, wrapper by wrapper; torch's own AdamW implementations
are traced here the same way. What the trace cannot see on a CPU: DeepSpeed's CUDA FusedAdam (its
kernel, multi_tensor_adam.cu, reads p, g, m, v and writes p, m, v: the same 28 bytes as torch's fused
AdamW traced below) and fp16, which DeepSpeed refuses on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.bench.zero_predict import scaled_spec
from zeroplan.core.compute import HBM_EFFICIENCY
from zeroplan.core.layout import build_layout
from zeroplan.core.optimizer_step import inner_step_passes, optimizer_traffic
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_optimizer, get_precision

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "validation" / "cpu-replay" / "step_traffic.py"
REPLAY = ROOT / "examples" / "validation" / "cpu-replay"
TRACED = [REPLAY / "step-traffic-llama-2-7b-w8-zero.json", REPLAY / "step-traffic-llama-2-7b-w8-stage0.json"]


def _plan_for(report: dict, run: dict):
    i = report["inputs"]
    spec = scaled_spec(load_model(i["model"]), layers=i["layers"], hidden=i["hidden"], vocab=i["vocab"], experts=None)
    acc = None if run["grad_accum_dtype"] == run["precision"] else run["grad_accum_dtype"]
    tr = TrainingSetup(precision=get_precision(run["precision"]), optimizer_impl="torch-fused", grad_accum_dtype=acc)
    zero = ZeroConfig(stage=run["stage"])
    pt = int(zero.param_persistence_threshold) if run["stage"] == 3 else 0
    lay = build_layout(spec, i["world"], persistence_threshold=pt)
    return optimizer_traffic(lay, tr, zero, rank=i["rank"])  # the traced rank


def _check(report: dict) -> None:
    wrappers = {"DeepSpeedZeroOptimizer": "zero", "DeepSpeedZeroOptimizer_Stage3": "zero",
                "BF16_Optimizer": "bf16_optimizer", "FP16_UnfusedOptimizer": "fp16_unfused_optimizer"}
    for run in report["runs"]:
        t = _plan_for(report, run)
        err = t.total_bytes / run["total_bytes"] - 1
        print(f"{run['precision']} stage {run['stage']} ({run['wrapper']}): DeepSpeed {run['total_bytes']:,} B, "
              f"plan {t.total_bytes:,} B ({err:+.4%}) over {t.elements:,} elements")
        assert t.wrapper == wrappers[run["wrapper"]]
        assert t.elements == run["partition_elements"]  # exact: the same partition
        # the rest is the scalar ops (per-tensor norms, the clip coefficient): a few hundred bytes
        assert abs(err) < 1e-3, run


def test_plan_matches_the_committed_trace_of_real_deepspeed():
    """2 layers of Llama-2-7B at full width, rank 0 of 8: ZeRO-1, 2 and 3, BF16_Optimizer and ZeRO-0."""
    runs = set()
    for path in TRACED:
        report = json.loads(path.read_text())
        assert report["environment"]["deepspeed"] == "0.19.8" and report["inputs"]["world"] == 8
        assert report["inputs"]["hidden"] is None and report["inputs"]["vocab"] is None  # full width
        runs |= {(r["precision"], r["stage"], r["grad_accum_dtype"]) for r in report["runs"]}
        _check(report)
    assert runs == {("bf16", 1, "bf16"), ("bf16", 2, "bf16"), ("bf16", 3, "bf16"), ("bf16", 1, "fp32"),
                    ("bf16", 0, "bf16"), ("fp32", 2, "fp32")}


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_plan_matches_a_live_trace_of_real_deepspeed(tmp_path):
    """The same trace run now, on a narrow model (hidden 256, vocabulary 1,024): seconds on a CPU."""
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "llama-2-7b", "--hidden", "256", "--vocab", "1024",
                           "--runs", "bf16:1,bf16:3,bf16-fp32acc:1,bf16:0,fp32:2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(out.read_text()))


def _traced_bytes_per_element(make_optimizer) -> float:
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("step_traffic", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # the script imports deepspeed-free parts of zeroplan.bench only
        pytest.skip(str(exc))
    n = 1 << 18
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.full_like(p, 1e-3)
    opt = make_optimizer([p])
    opt.step()  # creates the states
    mode = mod.Traffic()
    with mode:
        opt.step()
    return sum(b for _, b in mode.ops.values()) / n


@pytest.mark.parametrize("name,impl,kwargs", [
    ("adamw", "torch-foreach", {"foreach": True}),
    ("adamw", "torch-single", {"foreach": False}),
    ("adamw", "torch-fused", {"fused": True}),
    ("adam", "torch-foreach", {"foreach": True}),
    ("adam", "torch-single", {"foreach": False}),
])
def test_torch_adam_passes_are_torchs(name, impl, kwargs):
    """torch.optim.AdamW's weight decay defaults to 0.01 (one more pass), Adam's to 0."""
    torch = pytest.importorskip("torch")
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    traced = _traced_bytes_per_element(lambda ps: cls(ps, lr=1e-3, **kwargs))
    planned = sum(b for _, b in inner_step_passes(TrainingSetup(optimizer=get_optimizer(name), optimizer_impl=impl)))
    assert traced == pytest.approx(planned, abs=0.01), (traced, planned)


def test_the_one_pass_rule_is_deepspeeds_fusedadam_kernel():
    """multi_tensor_adam.cu AdamFunctor loads g, p, m, v and stores p, m, v: 7 fp32 tensors, 28 bytes."""
    tr = TrainingSetup(optimizer=get_optimizer("adamw"), optimizer_impl="fused-adam")
    assert inner_step_passes(tr) == [("adamw (fused-adam, one pass)", 28)]
    sgd = TrainingSetup(optimizer=get_optimizer("sgd-momentum"), optimizer_impl="torch-foreach")
    assert sum(b for _, b in inner_step_passes(sgd)) == 12 + 2 * 4


def _spec():
    return load_model("llama-2-7b")


def test_offloaded_optimizers_leave_the_gpu_nothing_to_step():
    tr = TrainingSetup(precision=get_precision("bf16"))
    lay = build_layout(_spec(), 8)
    assert optimizer_traffic(lay, tr, ZeroConfig(stage=2, offload_optimizer={"device": "cpu"})).passes == []
    assert optimizer_traffic(lay, tr, ZeroConfig(stage=2)).elements == lay.partition_12
    assert optimizer_traffic(lay, tr, ZeroConfig(stage=0)).elements == lay.params
    # offload ignored at stage 0 (DeepSpeed steps on the GPU there), and a cpu-adam impl without offload is not
    # a reason to drop the step from the time
    assert optimizer_traffic(lay, tr, ZeroConfig(stage=0, offload_optimizer={"device": "cpu"})).passes
    cpu_impl = TrainingSetup(precision=get_precision("bf16"), optimizer_impl="cpu-adam")
    assert optimizer_traffic(lay, cpu_impl, ZeroConfig(stage=2)).total_bytes == \
        optimizer_traffic(lay, tr, ZeroConfig(stage=2)).total_bytes


def test_the_step_time_charges_the_traffic_at_the_streaming_rate():
    hw = load_profile("dgx-h100")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=2048)
    p = evaluate(model=_spec(), training=tr, zero=ZeroConfig(stage=3), n_gpus=8, hardware=hw)
    t = p.time
    lay = build_layout(_spec(), 8, persistence_threshold=int(ZeroConfig(stage=3).param_persistence_threshold))
    traffic = optimizer_traffic(lay, tr, ZeroConfig(stage=3))
    # bf16 ZeRO-3 with FusedAdam: norm 18, flatten 4, cast 6, unscale 8, Adam 28, copy back 6
    assert traffic.total_bytes == 70 * lay.partition_3
    assert t.gpu_optimizer_bytes == traffic.total_bytes
    assert t.gpu_optimizer_time_s == pytest.approx(traffic.total_bytes / (hw.gpu.hbm_bandwidth_GBps * 1e9
                                                                          * HBM_EFFICIENCY))
    # nothing hides it: it is in the estimate and in both brackets
    others = (t.compute_time_s + t.overlap_slowdown_s + t.exposed_time_s["estimate"] + t.pcie_time_s + t.offload_time_s
              + t.host_bound_s)  # this small model is host-bound under stage 3 (core/host_time.py)
    assert t.host_bound_s > 0
    assert t.step_time_s == pytest.approx(others + t.gpu_optimizer_time_s)
    assert t.step_time_best_s >= t.compute_time_s + t.gpu_optimizer_time_s
    assert any(a.startswith("GPU optimizer step") and "norm in fp64 18" in a for a in p.notes)


def test_lora_steps_only_the_adapters():
    from zeroplan.core.finetune import finetune_views
    from zeroplan.specs.finetune import FineTune, LoraSpec

    hw = load_profile("dgx-h100")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=2048)
    ft = finetune_views(_spec(), FineTune(method="lora", lora=LoraSpec(r=16, targets=("q_proj", "v_proj"))),
                        compute_bytes=2)
    full = evaluate(model=_spec(), training=tr, zero=ZeroConfig(stage=2), n_gpus=8, hardware=hw).time
    lora = evaluate(model=_spec(), training=tr, zero=ZeroConfig(stage=2), n_gpus=8, hardware=hw, finetune=ft).time
    assert 0 < lora.gpu_optimizer_bytes < full.gpu_optimizer_bytes / 100


def _cli_json(*args):
    from typer.testing import CliRunner

    from zeroplan.cli import app

    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_recommend_times_the_optimizer_estimate_does_for_lora():
    """recommend's sweep charged a LoRA run's CPU optimizer for every weight of the model (15 s steps for
    llama-2-7b on 8 A100s where estimate plans 0.6 s): it built the step's costs on the full layout."""
    common = ["--model", "llama-2-7b", "--hardware", "dgx-a100-80gb", "--gpus", "8", "--precision", "bf16",
              "--method", "lora"]
    rec = _cli_json("recommend", *common)
    offloaded = [a for a in rec["alternatives"] if a["offload_optimizer"] == "cpu" and a["stage"] == 2]
    assert offloaded
    a = offloaded[0]
    est = _cli_json("estimate", *common, "--stage", "2", "--offload-optimizer", "cpu", "--micro-batch",
                    str(a["micro_batch"]), "--checkpointing", a["checkpointing"])
    t = est["stages"][0]["time"]
    assert a["step_time_s"] == pytest.approx(t["step_time_s"], rel=1e-6)
    assert 0 < t["cpu_optimizer_time_s"] < 0.01 and t["gpu_optimizer_time_s"] == 0
    plain = _cli_json("estimate", *common, "--stage", "2")["stages"][0]["time"]
    assert 0 < plain["gpu_optimizer_time_s"] < 0.001 and plain["gpu_optimizer_bytes"] > 0
