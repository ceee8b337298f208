"""Per-GPU memory: closed forms for model states, Korthikanti's activations, buffers, offload."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeroplan.core.activations import layer_activation_bytes
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision


def states(p):
    return p.memory.params, p.memory.gradients, p.memory.optimizer_states


def test_70b_fp32_twenty_bytes_and_eight_gpus():
    spec = load_model("70B")
    psi = 70 * 10**9
    tr = TrainingSetup(precision=get_precision("fp32"))
    p0 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=0), n_gpus=8, comm_model="paper")
    assert p0.memory.model_states == 1_400_000_000_000  # 70B × 20 bytes (ZeRO paper, Table I)
    # DeepSpeed without ZeRO in fp32 keeps no fp32 master (engine.py _do_optimizer_sanity_check
    # returns no wrapper): 4 + 4 + 8 = 16 bytes
    d0 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=0), n_gpus=8)
    assert d0.memory.model_states == 1_120_000_000_000
    p1 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=1), n_gpus=8)
    assert states(p1) == (4 * psi, 4 * psi, 12 * psi // 8)  # 4Ψ + 4Ψ + 12Ψ/N
    assert p1.memory.model_states == 665 * 10**9
    p2 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2), n_gpus=8)
    assert states(p2) == (4 * psi, 4 * psi // 8, 12 * psi // 8)
    assert p2.memory.model_states == 420 * 10**9
    p3 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3, param_persistence_threshold=0), n_gpus=8)
    # 20Ψ/N = 175 GB; stage 3 pads each tensor to a multiple of N: at most N-1 elements per tensor
    n_tensors = len(spec.tensors) + 1
    assert 175 * 10**9 <= p3.memory.model_states <= 175 * 10**9 + 20 * 8 * n_tensors


def test_mixed_precision_sixteen_bytes():
    spec = load_model("7.5B")
    tr = TrainingSetup(precision=get_precision("bf16"))
    for stage, expect in ((0, 120e9), (1, 4 * 7.5e9 + 12 * 7.5e9 / 64), (2, 2 * 7.5e9 + 14 * 7.5e9 / 64)):
        p = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=stage), n_gpus=64)
        assert p.memory.model_states == int(expect)


def _gpt_like(h=1024, a=16, layers=2, vocab=50304):
    # GPT-2 shapes: dense MLP 4h, dropout > 0, full multi-head attention
    return load_model("gpt2").scaled(num_layers=layers, hidden_size=h, num_attention_heads=a, num_key_value_heads=a,
                                     intermediate_size=4 * h, vocab_size=vocab)


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 1024, 16), (1024, 4, 2048, 32), (512, 2, 768, 12)])
def test_korthikanti_per_layer(s, b, h, a):
    spec = _gpt_like(h, a)
    got = layer_activation_bytes(spec, s, b, 2, flash_attention=False)
    assert got == s * b * h * 34 + 5 * a * s * s * b  # s·b·h·(34 + 5as/h)
    flash = layer_activation_bytes(spec, s, b, 2, flash_attention=True)
    assert flash == s * b * h * 34 + 4 * a * s * b  # the 5as²b term is gone (fp32 log-sum-exp remains)


def test_full_checkpointing_keeps_layer_inputs():
    spec = _gpt_like(layers=24)
    tr = TrainingSetup(precision=get_precision("bf16"), checkpointing="full", seq_len=1024, micro_batch=2)
    p = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2), n_gpus=8)
    act = p.memory.activations_detail
    assert act.per_layer == 2 * 1024 * 2 * 1024  # 2·s·b·h
    assert act.layers == 24 * act.per_layer
    assert act.logits == (2 + 4) * 1024 * 2 * spec.vocab_size


def test_buckets_and_overlap():
    spec = load_model("llama-2-7b")
    tr = TrainingSetup(precision=get_precision("bf16"))
    no = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2, overlap_comm=False, reduce_bucket_size=2e8), n_gpus=8)
    yes = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2, overlap_comm=True, reduce_bucket_size=2e8), n_gpus=8)
    assert no.memory.buffers_detail["ipg_bucket"] == 2 * 200_000_000
    assert yes.memory.buffers_detail["ipg_bucket"] == 2 * 2 * 200_000_000  # double buffer
    s3 = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3, reduce_bucket_size=2e8), n_gpus=8)
    assert s3.memory.buffers_detail["ipg_bucket"] == 2 * 200_000_000  # stage 3: one bucket, overlap or not


def test_stage3_gather_peak_names_a_module():
    spec = load_model("llama-2-70b")
    tr = TrainingSetup(precision=get_precision("bf16"))
    p = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3, max_reuse_distance=0, prefetch_bucket_size=0),
                 n_gpus=64)
    g = p.memory.gather
    assert g is not None
    # the largest single gathered module of llama-2-70b is the 32000×8192 embedding / lm_head
    assert g.module in ("model.embed_tokens", "lm_head") or g.module_bytes >= 2 * 8192 * 28672


def test_sub_group_size_bounds_the_step_transient():
    spec = load_model("llama-2-7b")
    tr = TrainingSetup(precision=get_precision("bf16"))
    big = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=2)
    small = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3, sub_group_size=10_000_000), n_gpus=2)
    assert small.memory.buffers_detail["step_fp32_grad"] < big.memory.buffers_detail["step_fp32_grad"]
    # largest sub-group is at most sub_group_size + one parameter's partition; 6 bytes per element (bf16 + fp32)
    largest_part = max(-(-t.numel // 2) for t in spec.tensors)
    assert small.memory.buffers_detail["step_fp32_grad"] <= 6 * (10_000_000 + largest_part)


def test_offload_moves_states_to_host():
    spec = load_model("llama-2-13b")
    tr = TrainingSetup(precision=get_precision("bf16"))
    z = ZeroConfig(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    p = evaluate(model=spec, training=tr, zero=z, n_gpus=8, gpus_per_node=8)
    assert p.memory.optimizer_states == 0
    part = sum(-(-t.numel // 8) for t in spec.tensors if t.tied_to is None)
    # per rank on the host: master 4 + Adam 8 + fp32 grads 4 + bf16 grads 2 + bf16 params 2 = 20 bytes/element
    host = p.memory.host
    assert sum(host.detail.values()) == 20 * part
    # DeepSpeedCPUAdam.step's exp_avg/exp_avg_sq (zeros_like) are pageable; the rest is pinned, and
    # the caching host allocator (CachingHostAllocator) rounds each pinned block up to a power of two
    assert host.detail["optimizer_states"] == 8 * part and "optimizer_states" not in host.pinned
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    pinned = pow2(4 * part) * 2 + pow2(2 * part) * 2  # fp32 master, fp32 grads, bf16 grads, bf16 params
    assert host.pinned_per_node_bytes == 8 * pinned
    assert host.pageable_per_node_bytes == 8 * 8 * part
    assert host.per_gpu_bytes == pinned + 8 * part
    assert p.host_memory_per_node == 8 * host.per_gpu_bytes


def test_estimate_json_imports_no_torch():
    code = (
        "import sys, io, contextlib\n"
        "from zeroplan.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        "        main(['estimate', '--model', 'llama-2-70b', '--gpus', '64', '--json'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(buf.getvalue())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["params"] == 68_976_648_192
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    for s in data["stages"]:
        m = s["memory"]
        assert m["model_states"] == m["params"] + m["gradients"] + m["optimizer_states"]
        assert all(isinstance(m[k], int) for k in ("params", "gradients", "optimizer_states", "buffers", "peak"))
        assert isinstance(s["comm"]["bytes_per_gpu_per_step"], int)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 64])
def test_stage2_whole_param_gradient_buffer(n):
    """DeepSpeed sizes a rank's stage-2 gradient buffer by the whole params overlapping its slice
    (measured on DeepSpeed 0.19.8); the fast maximum equals a walk over every rank, written here."""
    from zeroplan.core.layout import build_layout

    spec = load_model("llama-2-7b").scaled(num_layers=2, hidden_size=72, intermediate_size=200, vocab_size=1001,
                                           num_attention_heads=4, num_key_value_heads=4)
    numels = [t.numel for t in spec.tensors if t.tied_to is None]
    part = -(-sum(numels) // (2 * n)) * 2
    widest = 0
    for r in range(n):
        lo, hi = r * part, (r + 1) * part
        a, b, off = lo, hi, 0
        for k in numels:
            if off < hi and off + k > lo:
                a, b = min(a, off), max(b, off + k)
            off += k
        widest = max(widest, b - a)
    assert build_layout(spec, n).grad_partition_12_max == widest
    p = evaluate(model=spec, training=TrainingSetup(precision=get_precision("bf16")), zero=ZeroConfig(stage=2), n_gpus=n)
    assert p.memory.buffers_detail.get("gradient_partition_whole_params", 0) == 2 * (widest - part)
