"""Megatron-LM activations (core/activations_megatron.py) and DeepSpeed's activation_checkpointing block.

Expected values are written from the source, term by term, not read off the code under test:
DeepSpeedExamples Megatron-LM ``mpu/transformer.py`` (GPT2ParallelSelfAttention.forward,
GPT2ParallelMLP.forward, gelu_impl), ``mpu/cross_entropy.py`` (_VocabParallelCrossEntropy),
``pretrain_gpt2.py`` (forward_step: ``output.contiguous().float()``), apex FusedLayerNorm, and
DeepSpeed's checkpointing.py (``partition_activations``, ``CheckpointFunction.forward``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.activations import activation_memory
from zeroplan.core.ds_config_inputs import annotate_ds_config
from zeroplan.core.memory import memory_for_stage
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

MODELS = Path(__file__).parent / "data" / "published" / "models"
GPT2_1_5B = load_model(str(MODELS / "megatron-gpt2-1.5b.json"))  # 48 layers, h 1600, 16 heads, V 50304
GPT2_10B = load_model(str(MODELS / "megatron-gpt2-10b.json"))  # 50 layers, h 4096, 32 heads


def _setup(**kw) -> TrainingSetup:
    base = dict(precision=get_precision("fp16"), micro_batch=2, seq_len=1024, flash_attention=False,
                activation_impl="megatron")
    return TrainingSetup(**{**base, **kw})


def test_layer_is_korthikanti_plus_layernorm_statistics_and_the_gelu_tape():
    s, b, h, a = 1024, 2, 1600, 16
    act = activation_memory(GPT2_1_5B, _setup())
    korthikanti = 34 * s * b * h + 5 * a * s * s * b  # dropout 0.1 everywhere, ffn = 4h (§4.1)
    ln_stats = 2 * 2 * 4 * s * b  # two FusedLayerNorms, fp32 mean + invvar per row
    gelu_tape = 6 * 2 * s * b * 4 * h  # gelu_impl keeps 7 fp16 tensors of width 4h; Korthikanti count 1
    assert act.per_layer == korthikanti + ln_stats + gelu_tape
    assert act.source.startswith("megatron-lm")


def test_vocab_parallel_cross_entropy_keeps_fp32_softmax_and_peaks_at_fourteen_bytes_a_logit():
    # forward: fp16 logits (2) + output.float() (4) + clone (4) + exp -> softmax kept (4) bytes a logit;
    # backward writes into the softmax in place; .float()'s backward casts the gradient to fp16 (2)
    s, b, V = 1024, 10, 50304
    act = activation_memory(GPT2_10B, _setup(micro_batch=b, checkpointing="full", cpu_checkpointing=True))
    assert act.logits == 4 * s * b * V
    assert act.forward_peak == act.total + 10 * s * b * V  # the loss dominates the forward here
    assert act.backward_peak >= act.total + 2 * s * b * V


def test_cpu_checkpointing_moves_each_layer_checkpoint_to_the_host():
    s, b, h, L = 1024, 10, 4096, 50
    on_gpu = activation_memory(GPT2_10B, _setup(micro_batch=b, checkpointing="full", partition_activations=True))
    on_host = activation_memory(GPT2_10B, _setup(micro_batch=b, checkpointing="full", partition_activations=True,
                                                 cpu_checkpointing=True))
    # CheckpointFunction.forward with partition_activations: each argument cloned (hidden states and the
    # fp16 [1, 1, s, s] mask), on the host with cpu_checkpointing
    per_layer = 2 * s * b * h + 2 * s * s
    assert on_gpu.per_layer == per_layer and on_gpu.host_checkpoints == 0
    assert on_host.per_layer == 0 and on_host.host_checkpoints == L * per_layer
    assert on_gpu.total - on_host.total == L * per_layer
    # without partition_activations the mask is saved by reference (shared), only the hidden states per layer
    plain = activation_memory(GPT2_10B, _setup(micro_batch=b, checkpointing="full"))
    assert plain.per_layer == 2 * s * b * h


def test_host_memory_carries_the_cpu_checkpoints_as_pageable():
    ds = load_ds_config({"train_micro_batch_size_per_gpu": 10, "fp16": {"enabled": True},
                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}})
    ac = ds.activation_checkpointing
    tr = _setup(micro_batch=10, checkpointing="full", optimizer_impl="cpu-adam",
                cpu_checkpointing=ac.cpu_checkpointing, partition_activations=ac.partition_activations)
    m = memory_for_stage(GPT2_10B, tr, ds.zero, 1)
    assert m.host.detail["activation_checkpoints"] == 50 * (2 * 1024 * 10 * 4096 + 2 * 1024 * 1024)
    assert "activation_checkpoints" not in m.host.pinned


def test_transformers_activations_ignore_the_deepspeed_block():
    # transformers checkpoints with torch.utils.checkpoint: deepspeed.checkpointing's settings do not apply
    base = dict(precision=get_precision("fp16"), micro_batch=2, seq_len=1024, checkpointing="full")
    plain = activation_memory(GPT2_10B, TrainingSetup(**base))
    with_block = activation_memory(GPT2_10B, TrainingSetup(**base, cpu_checkpointing=True, partition_activations=True))
    assert plain == with_block and plain.host_checkpoints == 0


def test_reader_takes_the_block_as_deepspeed_does():
    ds = load_ds_config({"zero_optimization": {"stage": 2}, "activation_checkpointing": {
        "partition_activations": True, "contiguous_memory_optimization": True, "cpu_checkpointing": "yes",
        "number_checkpoints": 50, "cpu_checkpoints": True}})
    ac = ds.activation_checkpointing
    assert ac.partition_activations and ac.contiguous_memory_optimization and ac.number_checkpoints == 50
    assert ac.cpu_checkpointing  # get_scalar_param uses the value as given: a truthy string counts
    rules = {(f.rule_id, f.key) for f in ds.findings}
    assert ("DS003", "activation_checkpointing.cpu_checkpointing") in rules
    assert ("DS001", "activation_checkpointing.cpu_checkpoints") in rules  # unknown: ignored by DeepSpeed


def test_contiguous_checkpointing_without_partitioning_is_flagged():
    # checkpointing.py configure: assert PARTITION_ACTIVATIONS, "Contiguous Checkpointing is only available ..."
    # (only where the script calls deepspeed.checkpointing.configure: a warning, the config still plans)
    ds = load_ds_config({"zero_optimization": {"stage": 2},
                         "activation_checkpointing": {"contiguous_memory_optimization": True}})
    assert not ds.errors
    assert [(f.rule_id, f.severity) for f in ds.findings if f.key.startswith("activation_checkpointing")] == [
        ("DS010", "warning")]


@pytest.mark.parametrize("key", ["partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                 "synchronize_checkpoint_boundary"])
def test_written_block_holds_deepspeeds_defaults(key):
    # deepspeed/runtime/activation_checkpointing/config.py: every ACT_CHKPT_*_DEFAULT of these keys is False
    out = annotate_ds_config({}, seq_len=1024, checkpointing="full", flash_attention=True, model="m",
                             hardware=None, n_gpus=1)
    assert out["activation_checkpointing"][key] is False
    assert load_ds_config(out).activation_checkpointing.model_dump()[key] is False


def test_megatron_refuses_a_model_its_code_cannot_express():
    from zeroplan._util import InputError
    with pytest.raises(InputError, match="not that model"):
        activation_memory(load_model("llama-2-7b"), _setup())  # gated MLP: not Megatron-LM's GPT-2


def test_emitted_config_keeps_a_megatron_plan(tmp_path):
    # recommend --emit-config writes what it planned: a Megatron-LM plan must read back as Megatron-LM
    # (core/inputs.py _activation_code reads zeroplan.activations), a transformers plan writes no key
    import json

    from zeroplan.core.inputs import build_plan_inputs

    model = str(MODELS / "megatron-gpt2-1.5b.json")
    out = annotate_ds_config({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}},
                             seq_len=1024, checkpointing="full", flash_attention=False, model=model,
                             hardware=None, n_gpus=1, activations="megatron")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(out))
    assert build_plan_inputs(model=model, ds_config=str(path)).training.activation_impl == "megatron"
    plain = annotate_ds_config({}, seq_len=1024, checkpointing="none", flash_attention=True, model="m",
                               hardware=None, n_gpus=1, activations="transformers")
    assert "activations" not in plain["zeroplan"]


def test_activations_option_on_the_cli():
    # --activations megatron plans Megatron-LM's activations (smaller than transformers' eager GPT-2
    # with its fp32 loss, for the same shape); an unknown value and a model Megatron-LM's GPT-2 code
    # cannot express are one-line errors with exit 2
    import json

    from typer.testing import CliRunner

    from zeroplan.cli import app

    runner = CliRunner()
    model = str(MODELS / "megatron-gpt2-1.5b.json")
    base = ["estimate", "--model", model, "--gpus", "1", "--stage", "0", "--precision", "fp16", "--json",
            "--no-flash-attention", "--seq-len", "1024"]
    out = {}
    for impl in ("transformers", "megatron"):
        r = runner.invoke(app, base + ["--activations", impl])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert d["training"]["activations"] == impl
        out[impl] = d["stages"][0]["memory"]["activations_detail"]["total"]
    want = activation_memory(GPT2_1_5B, _setup(micro_batch=1)).total
    assert out["megatron"] == want and out["megatron"] != out["transformers"]
    for args in (["--activations", "foo"], ["--model", "llama-2-7b", "--activations", "megatron"]):
        r = runner.invoke(app, ["estimate", "--model", model, "--gpus", "1"] + args)
        assert r.exit_code == 2 and len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.output
