"""ZeRO stage 0 (DeepSpeed without ZeRO, bf16) against real DeepSpeed 0.19.8 replayed on CPU
(examples/validation/cpu-replay/peak-live-stage0-*.json: ``peak_live.py 0 ...``, a client torch AdamW with
``fused=True``, every storage over 1 MiB live at the peak).

- The wrapper: engine.py ``_configure_fp16_optimizer`` wraps DeepSpeed's FusedAdam in FP16_Optimizer and any
  other optimizer (the HF Trainer's torch AdamW when the config has no ``optimizer`` block) in
  FP16_UnfusedOptimizer, whose step casts every gradient into its fp32 copy's ``.grad`` while the 16-bit
  gradients stay (the plan had planned FP16_Optimizer's flat copy for both: 20% over the measured step).
- The backward: ``allreduce_no_retain`` flushes a bucket once it has gone over 5e8 elements, so its
  flatten copy holds the tensor that crossed the line (the plan had capped it at 5e8: 0.61% under).
- The bundled engine keeps autograd's per-parameter gradients as DeepSpeed does; it had attached one flat
  gradient buffer before the backward, which put every gradient beside the head's backward (6.0% over
  DeepSpeed's peak on the 64-wide model, where the head's backward is the peak)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.bench.validate import predict, scaled_spec
from zeroplan.core.grad_buckets import stage0_flatten_elements
from zeroplan.core.layout import Layout, Tensor
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.model import load_model

ROOT = Path(__file__).resolve().parents[1]
REPLAY = ROOT / "examples" / "validation" / "cpu-replay"


def _replay(name: str) -> tuple[dict, object, object]:
    rep = json.loads((REPLAY / name).read_text())
    inp = rep["inputs"]
    assert inp["stage"] == 0 and inp["precision"] == "bf16" and inp["grad_accum"] == 1
    model = str(ROOT / inp["model"]) if inp["model"].endswith(".json") else inp["model"]
    spec = scaled_spec(load_model(model), layers=inp["layers"], hidden=None, vocab=None, experts=None)
    zero = load_ds_config({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, world_size=inp["world"]).zero
    return rep, spec, zero


def _plan(rep: dict, spec, zero, impl: str = "torch-fused"):
    inp = rep["inputs"]
    return predict(spec, zero, precision="bf16", micro_batch=inp["micro_batch"], seq_len=inp["seq_len"],
                   n=inp["world"], grad_accum=1, optimizer_impl=impl)


def test_the_step_is_fp16_unfused_optimizers():
    rep, spec, zero = _replay("peak-live-stage0-b1-s512.json")
    assert rep["peak_phase"] == "step"
    live = rep["live_over_1_MiB"]
    big = sum(t.numel for t in spec.tensors if 2 * t.numel > 1 << 20)  # what the list holds (no norms)
    step_casts = [e["bytes"] for e in live if any("unfused_optimizer.py" in f and " step" in f for f in e["frames"])]
    bf16_grads = [e["bytes"] for e in live if e["allocated_in"] == "backward" and not e["parameter"]]
    assert sum(step_casts) == 4 * big and sum(bf16_grads) == 2 * big  # every fp32 cast beside its 16-bit gradient
    m = _plan(rep, spec, zero).memory
    assert m.optimizer_wrapper == "fp16_unfused_optimizer"
    assert m.buffers_detail["step_fp32_grad"] == 4 * spec.params
    assert 0 <= rep["peak_bytes"] - m.allocated < 8192  # tensors under a page, AdamW's step counters
    # DeepSpeed's FusedAdam (an optimizer block on CUDA) is wrapped in FP16_Optimizer instead, whose step
    # flattens the fp32 casts (fused_optimizer.py; not runnable on CPU): the casts and the flat copy
    fused = _plan(rep, spec, zero, "fused-adam").memory
    assert fused.optimizer_wrapper == "fp16_optimizer" and fused.buffers_detail["step_fp32_grad"] == 8 * spec.params


def test_the_backward_flattens_the_bucket_that_crossed_5e8():
    rep, spec, zero = _replay("peak-live-stage0-backward-b1-s512.json")
    flat = [e["bytes"] for e in rep["live_over_1_MiB"] if any("allreduce_bucket" in f for f in e["frames"])]
    # the embedding and both layers, in parameter order: 535,838,720 elements once layer 1's last norm is added
    assert flat == [2 * 535_838_720]
    m = _plan(rep, spec, zero).memory
    assert m.buffers_detail["allreduce_flatten"] == flat[0]
    assert 0 <= rep["peak_bytes"] - m.phases["backward"].peak < 8192


@pytest.mark.parametrize("name", ["peak-live-stage0-backward-b1-s512.json", "peak-live-stage0-llama-h64-w2-b4-s64.json"])
def test_the_bundled_stage0_engine_holds_what_deepspeed_held(name):
    """Simulated as the replay's rank under FakeTensorMode: 84 and 76 bytes under DeepSpeed's backward peaks
    (AdamW's step counters and tensors under a page). The plan: 4,188 bytes under and 0.18% over."""
    from zeroplan.runtime.simulate import simulate_rank

    rep, spec, zero = _replay(name)
    inp = rep["inputs"]
    got = simulate_rank(spec, zero, n=inp["world"], precision="bf16", micro_batch=inp["micro_batch"],
                        seq_len=inp["seq_len"], rank=inp["rank"])
    assert 0 <= rep["peak_bytes"] - got["phase_peaks"]["backward"]["peak"] <= 100
    assert abs(_plan(rep, spec, zero).memory.phases["backward"].peak / rep["peak_bytes"] - 1) < 0.002


def test_a_lone_tensor_bucket_is_reduced_in_place():
    """allreduce_no_retain adds, then flushes over the bucket size; a bucket of one tensor is flattened to a
    view (flatten_dense_tensors), so only buckets of two or more tensors are copied."""
    def lay(*sizes):
        return Layout(params=sum(sizes), n=1, tensors=[Tensor(f"t{i}", "m", k, 0) for i, k in enumerate(sizes)])

    assert stage0_flatten_elements(lay(40, 70, 30), 100) == 110  # 40 + 70 goes over: flushed with both
    assert stage0_flatten_elements(lay(150, 30, 20), 100) == 50  # 150 alone (a view), then 30 + 20 at the end
    assert stage0_flatten_elements(lay(150), 100) == 0
