"""Frozen weights and adapters in the memory model and the ledger (core/finetune.py)."""

from __future__ import annotations

import pytest

from zeroplan.core.finetune import finetune_views
from zeroplan.core.layout import build_layout
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.finetune import FineTune, LoraSpec, QuantSpec
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

N = 8
SPEC = load_model("llama-2-7b")
TR = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=2048, checkpointing="full")
LORA = FineTune(method="lora", lora=LoraSpec(r=16, targets=("q_proj", "v_proj")))


def _plan(stage: int, ft: FineTune | None, **zero):
    views = None if ft is None else finetune_views(SPEC, ft, compute_bytes=2)
    return evaluate(model=SPEC, training=TR, zero=ZeroConfig(stage=stage, overlap_comm=stage == 3, **zero), n_gpus=N,
                    gpus_per_node=N, finetune=views), views


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_keep_frozen_weights_whole_and_train_only_adapters(stage):
    p, v = _plan(stage, LORA)
    t = build_layout(v.trainable, N)
    adapters = 8_388_608
    assert t.params == adapters
    # stage_1_and_2.py: bit16_groups hold only requires_grad params; frozen stay whole in bf16
    assert p.memory.params == 2 * SPEC.params + 2 * t.flat_padded
    assert p.memory.optimizer_states == 12 * t.partition_12  # fp32 master + Adam m, v of adapters only
    grads = 2 * (t.flat_padded if stage == 1 else t.partition_12)
    assert p.memory.gradients == grads
    # nothing of the frozen 6.7B is reduced or gathered
    assert p.comm.bytes_per_gpu_per_step < 2 * 4 * t.flat_padded


def test_stage3_partitions_frozen_weights_and_gathers_them():
    p, v = _plan(3, LORA, param_persistence_threshold=0)
    full = build_layout(v.full, N)
    t = build_layout(v.trainable, N)
    assert p.memory.params == 2 * full.partition_3  # stage3: every module parameter partitioned
    assert p.memory.optimizer_states == 12 * t.partition_3
    gathers = sum(c.buffer_bytes * c.count for c in p.comm.collectives if c.op == "all_gather" and c.phase == "forward")
    assert gathers >= 2 * SPEC.params  # the frozen base is gathered every micro-step
    rs = sum(c.buffer_bytes * c.count for c in p.comm.collectives if c.op == "reduce_scatter")
    assert rs <= 2 * t.padded_total_3  # only adapter gradients are reduced


def test_full_fine_tuning_is_unchanged_by_the_views():
    full_ft = FineTune()
    a, _ = _plan(2, None)
    b, _ = _plan(2, full_ft)
    assert (a.memory.params, a.memory.gradients, a.memory.optimizer_states) == (
        b.memory.params, b.memory.gradients, b.memory.optimizer_states)
    assert a.comm.bytes_per_gpu_per_step == b.comm.bytes_per_gpu_per_step


def test_qlora_stores_frozen_linears_packed():
    q = FineTune(method="qlora", lora=LoraSpec(r=16, targets="all-linear"), quant=QuantSpec(bits=4, storage_dtype="bfloat16"))
    p2, v = _plan(2, q)
    lora2, _ = _plan(2, FineTune(method="lora", lora=LoraSpec(r=16, targets="all-linear")))
    # about 0.52 B instead of 2 B per quantised weight, held whole in stages 1/2
    saved = lora2.memory.params - p2.memory.params
    assert saved == 2 * v.quantized_params - (v.frozen_storage_bytes - 2 * (v.inventory.frozen_params - v.quantized_params))
    p3, _ = _plan(3, q, param_persistence_threshold=0)
    assert p3.memory.params < p2.memory.params / 4


def test_lora_70b_fits_on_8_a100_80gb_with_zero3_but_not_zero2():
    from zeroplan.specs.hardware import load_profile

    spec = load_model("llama-3-70b")
    hw = load_profile("dgx-a100-80gb")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=4096, checkpointing="full")
    v = finetune_views(spec, FineTune(method="lora", lora=LoraSpec(r=16, targets="all-linear")), 2)
    fits = {s: evaluate(model=spec, training=tr, zero=ZeroConfig(stage=s, overlap_comm=s == 3), n_gpus=8, gpus_per_node=8,
                        hardware=hw, finetune=v).fits for s in (2, 3)}
    assert fits == {2: False, 3: True}  # 2 x 70.6e9 bytes of frozen bf16 weights cannot sit on one 80 GB GPU
