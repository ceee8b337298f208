"""The caching allocator under pressure (core/allocator.py ``required_bytes``, ``release_under_pressure``).

Mechanism: c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc`` — when no cached
block fits and ``alloc_block`` (cudaMalloc) fails, it calls ``release_available_cached_blocks`` and
then ``release_cached_blocks`` (every free segment no live block sits in, of every stream's pool)
and retries before raising OOM. Expected values are arithmetic on the inputs, not outputs of the
code under test.
"""

from __future__ import annotations

from zeroplan.core.allocator import MIB, release_under_pressure, required_bytes, reserved_bytes
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

from plan_moments import winner

GIB = 1 << 30
LIVE = {"forward": 20 * GIB, "backward": 24 * GIB, "step": 22 * GIB}
SIDE = {"reduction": {"backward": 2 * GIB}}


def test_required_is_the_worst_phase_with_its_slack_not_the_pools_stacked():
    # pools stacked: default pool (backward 22 GiB without the side 2 GiB) * 1.5 + step 3 GiB, + side 2 GiB
    _, reserved, _ = reserved_bytes(LIVE, SIDE, fragmentation_fraction=0.5, step_transient=3 * GIB)
    assert reserved == 22 * GIB * 3 // 2 + 3 * GIB + 2 * GIB
    # released and remapped: the backward's 24 GiB live bytes with their split-segment slack
    assert required_bytes(LIVE, SIDE, fragmentation_fraction=0.5, step_transient=3 * GIB) == 36 * GIB


def test_gradients_autograd_left_in_activation_segments_keep_the_step_stacked():
    # step_pinned (FP16_Optimizer, ZeRO-1): the default pool's backward maximum cannot be released,
    # so the step's new segments stack on it: 22 * 1.5 + 3 GiB = 36 GiB > the phase maximum 24 * 1.5
    got = required_bytes(LIVE, SIDE, fragmentation_fraction=0.5, step_transient=13 * GIB, step_pinned=True)
    assert got == 22 * GIB * 3 // 2 + 13 * GIB
    assert required_bytes(LIVE, SIDE, fragmentation_fraction=0.5, step_transient=13 * GIB) == 36 * GIB


def test_slack_only_on_churned_bytes():
    # CUDACachingAllocator.cpp get_free_block (best fit) / should_split / free_block (merges only within a
    # segment): bytes held from init (or re-requested at their own size) sit in exact segments; the
    # churned rest (live - held) takes the slack. Backward: 24 GiB live, 20 GiB held -> 4 GiB churned.
    held = {"forward": 20 * GIB, "backward": 20 * GIB, "step": 22 * GIB}
    assert required_bytes(LIVE, {}, fragmentation_fraction=0.5, held_by_phase=held) == 24 * GIB + 2 * GIB
    # reserved: the default pool excludes the side stream's 2 GiB before the slack: (22 - 20) * 0.5 = 1 GiB
    _, reserved, _ = reserved_bytes(LIVE, SIDE, fragmentation_fraction=0.5, held_by_phase=held)
    assert reserved == 22 * GIB + 1 * GIB + 2 * GIB
    # everything held: no slack at all, the pools as they are
    all_held = dict(LIVE)
    assert required_bytes(LIVE, {}, fragmentation_fraction=0.5, held_by_phase=all_held) == 24 * GIB
    # expandable segments: no slack whatever is churned
    assert required_bytes(LIVE, {}, fragmentation_fraction=0.5, held_by_phase=held, expandable_segments=True) == 24 * GIB


def test_required_comes_in_whole_segments():
    assert required_bytes({"step": 3 * MIB + 1}, {}, fragmentation_fraction=0.0) == 4 * MIB  # kRoundLarge 2 MiB


def test_cache_gives_way_only_when_the_card_is_full():
    card, outside = 32 * GIB, GIB
    assert release_under_pressure(30 * GIB, 25 * GIB, outside, card) == 30 * GIB  # room: cached as is
    assert release_under_pressure(34 * GIB, 25 * GIB, outside, card) == card - outside  # cache fills the card
    assert release_under_pressure(34 * GIB, 33 * GIB, outside, card) == 33 * GIB  # cannot release enough: OOM
    assert release_under_pressure(34 * GIB, 25 * GIB, outside, None) == 34 * GIB  # no card given


def test_a_plan_whose_cache_outgrows_the_card_fits_and_fills_it():
    # 10B GPT-2 shapes, ZeRO-2 on 32 GPUs, a 30 GiB card: cached pools (28.9 GiB + 1.25 GiB context and
    # NCCL) would overflow, the live bytes with their slack (27.4 GiB) fit
    spec = load_model("tests/data/published/models/megatron-gpt2-10b.json")
    ds = load_ds_config({"fp16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {}},
                         "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 500000000}})
    base = load_profile("hardware_profiles/dgx-a100-80gb.toml")
    card = 30 * GIB
    hw = base.model_copy(update={"gpu": base.gpu.model_copy(update={"memory_bytes": card})})
    tr = TrainingSetup(precision=get_precision("fp16"), micro_batch=1, seq_len=1024, checkpointing="full",
                       flash_attention=False)
    plan = evaluate(model=spec, training=tr, zero=ds.zero, n_gpus=32, gpus_per_node=16, hardware=hw)
    roomy = hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"memory_bytes": 2 * card})})
    cached = evaluate(model=spec, training=tr, zero=ds.zero, n_gpus=32, gpus_per_node=16, hardware=roomy).memory
    m = plan.memory
    outside = m.overhead_detail["cuda_context"] + m.overhead_detail["nccl"]
    assert cached.reserved + outside > card  # the pools stacked would not fit on the card ...
    assert m.required + outside <= card  # ... what cannot be released does
    assert cached.allocated == m.allocated and cached.required == m.required
    assert plan.fits and m.peak == card and m.reserved == card - outside
    assert any("frees cached segments" in n for n in m.notes)


def test_plans_tag_what_is_held_and_what_churns():
    # core/memory.held_bytes: parameters, optimizer states and DeepSpeed's own gradient buffers are held;
    # the step's transients are re-requested at their own size; autograd's p.grad (FP16_Optimizer,
    # stage 0) churns with the activations; torch's cuBLAS workspaces are held from the first step on.
    # Expected values are sums of the plan's own categories.
    spec = load_model("llama-2-7b")
    hw = load_profile("hardware_profiles/dgx-a100-80gb.toml")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=1024, checkpointing="full")
    z2 = load_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": False}}).zero
    plan = evaluate(model=spec, training=tr, zero=z2, n_gpus=8, gpus_per_node=8, hardware=hw)
    m = plan.memory
    st = m.phases["step"].by_category
    assert not m.gradients_churned
    ws = m.buffers_detail["cublas_workspaces"]
    assert ws == 2 * 8_519_680  # two handles (forward thread, autograd thread), A100: ":4096:2:16:8"
    assert m.held_bytes["step"] == st["params"] + st["optimizer_states"] + st["gradients"] + m.step_transient_bytes + ws
    b = m.phases["backward"].by_category
    # the backward peaks at a bucket flush, run in the hook of the gradient that overflows the bucket:
    # autograd's gradient (not yet copied in) churns
    held_grads = b["gradients"] - winner(plan).autograd
    assert winner(plan).autograd > 0
    assert m.held_bytes["backward"] == b["params"] + b["optimizer_states"] + held_grads + m.buffers_detail["ipg_bucket"] + ws
    fp16 = TrainingSetup(precision=get_precision("fp16"), micro_batch=1, seq_len=1024, checkpointing="full")
    z0 = load_ds_config({"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}).zero
    m0 = evaluate(model=load_model("1B"), training=fp16, zero=z0, n_gpus=8, gpus_per_node=8, hardware=hw).memory
    s0 = m0.phases["step"].by_category
    assert m0.gradients_churned and s0["gradients"] > 0
    assert m0.held_bytes["step"] == s0["params"] + s0["optimizer_states"] + m0.step_transient_bytes + ws
