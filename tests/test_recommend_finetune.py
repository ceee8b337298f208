"""Fine-tuning in ``recommend`` (issue 15 §3) and LoRA's compute: frozen weights skip the
weight-gradient GEMM (core/finetune_compute.py). Deterministic; no GPU."""

from __future__ import annotations

import pytest

import zeroplan
from zeroplan.core.finetune_compute import FULL_TRAINING, matmul_work
from zeroplan.core.inputs import build_plan_inputs

H100 = dict(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", stage=2, micro_batch=1)


def _compute(**kw):
    return zeroplan.estimate(**{**H100, **kw}).stages[0].time.compute


# ------------------------------------------------------------------ LoRA compute
def test_full_finetuning_flops_are_unchanged_6_psi():
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16")
    assert matmul_work(inp.spec, inp.finetune) == FULL_TRAINING
    c = _compute()
    # 6 FLOPs per matmul weight per token + attention 3 × forward, as before the change
    from zeroplan.core.compute import flops_per_token

    f = flops_per_token(inp.spec, 2048)
    assert c.model_flops == pytest.approx(3 * (f["matmul"] + f["attention"]) * 2048)


def test_lora_flops_are_about_two_thirds_of_full():
    full = _compute().model_flops
    lora = _compute(method="lora", lora_r=16).model_flops
    assert 0.67 <= lora / full <= 0.70  # 4Ψ of 6Ψ on the weights; attention core unchanged (3 × forward)


def test_lora_all_linear_adds_adapter_flops_and_recompute_adds_a_forward():
    base = _compute(method="lora", lora_r=16, lora_targets="all-linear")
    small = _compute(method="lora", lora_r=16)
    assert base.model_flops > small.model_flops  # more adapters, 6 FLOPs each
    ck = _compute(method="lora", lora_r=16, lora_targets="all-linear", checkpointing="full")
    assert ck.model_flops == pytest.approx(base.model_flops)
    # full recomputation runs the forward again: hardware − model = one forward = model / (1 + 1 + 0) minus
    # the attention's share; with frozen weights the forward is more than a third of the work
    assert 0.40 < (ck.hardware_flops - ck.model_flops) / ck.model_flops < 0.52
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16", method="lora", lora_r=16, lora_targets="all-linear")
    w = matmul_work(inp.spec, inp.finetune)
    assert w.trainable_share == 0.0 and w.adapter_params_per_token == inp.finetune.inventory.adapter_params


def test_lora_step_is_faster_than_full():
    full = zeroplan.estimate(**H100).stages[0]
    lora = zeroplan.estimate(**H100, method="lora", lora_r=16).stages[0]
    assert lora.time.compute_time_s < 0.75 * full.time.compute_time_s


def test_modules_to_save_and_partial_training_count_their_weight_gradients():
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16", method="lora", modules_to_save="lm_head")
    w = matmul_work(inp.spec, inp.finetune)
    head = inp.spec.hidden_size * inp.spec.vocab_size
    assert 0 < w.trainable_share < 0.05 and w.trainable_share * 6.6e9 == pytest.approx(head, rel=0.1)
    part = build_plan_inputs(model="llama-2-7b", precision="bf16", trainable="last:4")
    share = matmul_work(part.spec, part.finetune).trainable_share
    assert 4 / 32 * 0.9 < share < 4 / 32 + 0.05
