"""What DeepSpeed 0.19.8 allocates on CUDA (issue 12 §1, §3): one test per mechanism, each
naming the DeepSpeed / PyTorch function it follows. Expected values are closed forms written
from those functions, not outputs of the code under test."""

from __future__ import annotations

import pytest

from zeroplan.core.allocator import communicators, reserved_bytes, round_segment
from zeroplan.core.host_memory import pinned_block
from zeroplan.core.inputs import (
    grad_accum_dtype_from_config,
    optimizer_impl_from_config,
)
from zeroplan.core.layout import build_layout
from zeroplan.core.stage3_schedule import stage3_schedule
from zeroplan.core.memory_buffers import stage3_gather
from zeroplan.core.memory_states import state_plan
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig, load_ds_config
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

SPEC = load_model("llama-2-7b")
N = 8


def plan(stage=2, precision="bf16", impl="fused-adam", acc=None, flavour="deepspeed", **zero):
    tr = TrainingSetup(precision=get_precision(precision), optimizer_impl=impl, grad_accum_dtype=acc,
                       checkpointing="full")
    return evaluate(model=SPEC, training=tr, zero=ZeroConfig(stage=stage, **zero), n_gpus=N, comm_model=flavour)


# ---- optimizer temporaries (engine.py _configure_basic_optimizer / get_optimizer_configuration) ----

def test_fused_adam_step_allocates_no_temporaries():
    """deepspeed/ops/adam/fused_adam.py FusedAdam.step: multi_tensor_apply in chunks."""
    m = plan(impl="fused-adam").memory
    assert m.buffers_detail["optimizer_temp"] == 0


def test_torch_foreach_adamw_four_bytes_per_element():
    """torch/optim/adamw.py _multi_tensor_adamw: torch._foreach_sqrt(exp_avg_sqs) copies the group."""
    lay = build_layout(SPEC, N)
    assert plan(impl="torch-foreach").memory.buffers_detail["optimizer_temp"] == 4 * lay.partition_12
    assert plan(impl="torch-fused").memory.buffers_detail["optimizer_temp"] == 0


def test_torch_single_tensor_adamw_eight_bytes_per_element():
    """torch/optim/adamw.py _single_tensor_adamw: (exp_avg_sq.sqrt() / bias_correction2_sqrt) holds two temps."""
    lay = build_layout(SPEC, N)
    assert plan(impl="torch-single").memory.buffers_detail["optimizer_temp"] == 8 * lay.partition_12


def test_config_chooses_the_optimizer_impl():
    """engine.py get_optimizer_configuration: torch_adam -> torch.optim; offload -> DeepSpeedCPUAdam; else FusedAdam."""
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    assert optimizer_impl_from_config(load_ds_config({**base, "optimizer": {"type": "AdamW", "params": {}}}))[0] == "fused-adam"
    assert optimizer_impl_from_config(load_ds_config(
        {**base, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}))[0] == "torch-foreach"
    assert optimizer_impl_from_config(load_ds_config(base))[0] == "torch-foreach"  # client optimizer
    off = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert optimizer_impl_from_config(load_ds_config(off))[0] == "cpu-adam"


# ---- stages 1/2 at the step (stage_1_and_2.py DeepSpeedZeroOptimizer.step) ----

@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_step_frees_16bit_grads_before_the_optimizer(stage):
    """stage_1_and_2.py step: free_grad_in_param_list(params_not_in_partition), flatten + .to(fp32),
    del flat_grad_partition, free_grad_in_param_list(params_in_partition), then _optimizer_step."""
    lay = build_layout(SPEC, N)
    part, whole = lay.partition_12, lay.grad_partition_12_max
    m = plan(stage=stage, impl="torch-foreach").memory
    step = m.phases["step"].by_category
    states = 2 * lay.flat_padded + 12 * part
    cast = 2 * whole + (2 + 4) * part  # grads_in_partition + flat copy + fp32 cast
    during = 4 * part + 4 * part  # fp32 gradient + foreach temporaries, 16-bit grads gone
    assert step["params"] + step["optimizer_states"] == states
    assert m.phases["step"].peak == states + max(cast, during)


def test_stage1_boundary_backward_keeps_the_full_gradients():
    """stage_1_and_2.py reduce_ipg_grads (stage 1): only the partition's grads are copied into
    grads_in_partition; the others stay until step() frees them (free_grad_in_param_list). reduce_gradients
    runs in parameter order, moves each gradient no larger than the bucket into it (freeing autograd's) and
    allocates a rank's grads_in_partition (the whole parameters overlapping its partition) at the first flush
    holding one of them: written out here rank by rank for Llama-2-7B on 8 GPUs and 5e8-element buckets."""
    lay = build_layout(SPEC, N)
    m = plan(stage=1).memory
    assert m.gradients == 2 * lay.flat_padded
    sizes = [t.numel for t in lay.tensors]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    buckets, cur = [], []  # tensor indices per bucket, flushed before the one that would overflow 5e8
    for i, k in enumerate(sizes):
        if cur and sum(sizes[j] for j in cur) + k > 500_000_000:
            buckets.append(cur)
            cur = []
        cur.append(i)
    buckets.append(cur)
    part, extra = lay.flat_padded // N, 0
    for r in range(N):
        owned = [i for i, (a, k) in enumerate(zip(starts, sizes)) if a < (r + 1) * part and a + k > r * part]
        first = next(b for b, ids in enumerate(buckets) if owned[0] in ids)
        moved = sum(sizes[i] for ids in buckets[:first + 1] for i in ids if sizes[i] <= 500_000_000)
        extra = max(extra, sum(sizes[i] for i in owned) - moved)
    assert extra > 0  # 8 partitions of 842M elements against a first flush of under 500M
    assert m.phases["backward"].by_category["gradients"] in (0, 2 * lay.flat_padded, 2 * (lay.flat_padded + extra))


# ---- data_types.grad_accum_dtype (engine.py _do_optimizer_sanity_check) ----

@pytest.mark.parametrize("precision,stage,acc,wrapper,grad_bytes,master", [
    ("bf16", 1, "fp32", "bf16_optimizer", 4, 4),  # BF16_Optimizer: whole-model fp32 gradients
    ("bf16", 2, "fp32", "zero", 4, 4),  # stage_1_and_2 _build_compact_grad_partition_buffer (fp32)
    ("bf16", 3, "fp32", "zero", 4, 4),  # stage3 grad_partitions_flat_buffer in gradient_accumulation_dtype
    ("bf16", 1, None, "zero", 2, 4),
    ("fp16", 1, "fp32", "zero", 4, 4),  # stage 1 + fp16 + fp32 accumulation: grad_accum attribute
    ("fp16", 0, None, "fp16_optimizer", 2, 4),  # FP16 -> FP16_Optimizer
    ("bf16", 0, None, "fp16_optimizer", 2, 4),  # DDP_BFLOAT16 -> FP16_Optimizer(bf16)
    ("fp32", 0, None, "basic", 4, 0),  # no wrapper: no fp32 master
    ("fp32", 1, None, "zero", 4, 4),
    ("bf16", 0, "fp32", "unsupported", 2, 4),  # NotImplementedError in DeepSpeed
])
def test_grad_accum_dtype_paths(precision, stage, acc, wrapper, grad_bytes, master):
    tr = TrainingSetup(precision=get_precision(precision), grad_accum_dtype=acc)
    sp = state_plan(tr, stage)
    assert (sp.wrapper, sp.grad_bytes, sp.master_bytes) == (wrapper, grad_bytes, master)


def test_bf16_optimizer_keeps_whole_model_fp32_gradient():
    """bf16_optimizer.py BF16_Optimizer.__init__: fp32_groups_gradients_flat spans the whole model (+4Ψ vs 2Ψ)."""
    lay = build_layout(SPEC, N)
    with_fp32 = plan(stage=1, acc="fp32").memory
    plain = plan(stage=1).memory
    assert with_fp32.gradients == 4 * lay.flat_padded
    assert with_fp32.gradients - plain.gradients == 2 * lay.flat_padded


def test_grad_accum_dtype_read_from_config():
    ds = load_ds_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                         "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}})
    assert grad_accum_dtype_from_config(ds) == "fp32"


@pytest.mark.parametrize("value,planned", [("torch.float32", "fp32"), ("float", "fp32"), ("bfloat16", "bf16"),
                                           ("half", "fp16"), ("FP32", None), ("int8", None)])
def test_grad_accum_dtype_is_spelled_as_deepspeeds_dtype_enum(value, planned):
    """DtypeEnum is case-sensitive: "FP32" is refused by deepspeed.initialize (the reader says so) and
    planned as absent; "torch.float32" is DeepSpeed's own spelling and was an InputError here."""
    ds = load_ds_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                         "data_types": {"grad_accum_dtype": value}, "zero_optimization": {"stage": 1}},
                        strict=False)  # errors become findings (what --lenient plans on)
    assert grad_accum_dtype_from_config(ds) == planned


# ---- stage 0 fp32 and the two flavours ----

def test_stage0_fp32_sixteen_bytes_deepspeed_twenty_paper():
    """engine.py _do_optimizer_sanity_check returns no wrapper for fp32 without ZeRO."""
    psi = SPEC.params
    assert plan(stage=0, precision="fp32").memory.model_states == 16 * psi
    assert plan(stage=0, precision="fp32", flavour="paper").memory.model_states == 20 * psi


def test_stage0_fp16_optimizer_step_casts_and_flat_copy_coexist():
    """fp16/fused_optimizer.py FP16_Optimizer.step: _flatten_dense_tensors([p.grad.to(fp32) ...])."""
    psi = SPEC.params
    m = plan(stage=0, precision="fp16").memory
    assert m.phases["step"].peak == 2 * psi + 2 * psi + 12 * psi + 8 * psi


# ---- offload host memory ----

def test_pinned_host_allocator_rounds_to_power_of_two():
    """aten CachingHostAllocator: allocation sizes rounded with PowerOf2Ceil."""
    assert pinned_block(3 * 2**30) == 4 * 2**30
    assert pinned_block(2**30) == 2**30


def test_cpu_adam_states_are_pageable():
    """ops/adam/cpu_adam.py DeepSpeedCPUAdam.step: exp_avg/exp_avg_sq = torch.zeros_like(p.data)."""
    lay = build_layout(SPEC, N)
    m = plan(stage=2, offload_optimizer={"device": "cpu"}).memory
    assert "optimizer_states" not in m.host.pinned
    assert m.host.pageable_per_node_bytes == N * 8 * lay.partition_12  # gpus_per_node = N here
    assert "fp32_master_partition" in m.host.pinned


# ---- communicators (utils/groups.py _clone_world_group) ----

def test_communicators_counted():
    assert communicators(ZeroConfig(stage=2), 2, 8) == 2  # world + ZeRO's cloned world group
    assert communicators(ZeroConfig(stage=3, zero_hpz_partition_size=8), 3, 16) == 3  # + hpZ group
    assert communicators(ZeroConfig(stage=2), 2, 1) == 0
    m = plan(stage=3).memory
    assert m.communicators == 2


# ---- stage-3 prefetch (partitioned_param_coordinator.py fetch_sub_module) ----

def test_stage3_prefetch_in_flight():
    """The gather peaks stacked on the activations count the prefetches in flight beside the module in use
    (memory_buffers.stage3_gather); the forward itself is planned moment by moment from the coordinator replay
    (core/memory.py forward_moments: at the loss everything within stage3_max_reuse_distance of its next use,
    1e9 elements, is still gathered), and the reported gather is the larger phase's."""
    zero = ZeroConfig(stage=3)
    lay = build_layout(SPEC, N, persistence_threshold=int(zero.param_persistence_threshold),
                       model_persistence_threshold=zero.model_persistence_threshold)
    sched = stage3_schedule(lay, max_live=int(zero.max_live_parameters), prefetch_bucket=int(zero.prefetch_bucket_size),
                            max_reuse=int(zero.max_reuse_distance))
    forward, backward = stage3_gather(lay, sched, 2, int(zero.max_live_parameters))
    assert forward.prefetch_bytes > 0
    for g in (forward, backward):
        assert g.total_bytes == g.kept_bytes + g.transient_bytes + g.prefetch_bytes
    m = evaluate(model=SPEC, training=TrainingSetup(precision=get_precision("bf16")), zero=zero, n_gpus=N).memory
    assert m.gather.module.endswith("(coordinator replay)")
    assert m.gather.total_bytes == m.buffers_detail["gathered_params_forward"] >= 2 * int(zero.max_reuse_distance)


# ---- the caching allocator (c10/cuda/CUDACachingAllocator.cpp) ----

def test_reserved_pools_per_stream_not_a_flat_fraction():
    """BlockPool lookups match the stream: each pool keeps its own maximum."""
    live = {"forward": 10 * 2**30, "backward": 12 * 2**30, "step": 8 * 2**30}
    side = {"allgather": {"forward": 4 * 2**30, "backward": 1 * 2**30}}
    alloc, reserved, pools = reserved_bytes(live, side, fragmentation_fraction=0.0)
    assert alloc == 12 * 2**30
    # default stream: max(6, 11, 8) GiB, all-gather stream: 4 GiB
    assert reserved == 11 * 2**30 + 4 * 2**30
    assert pools == {"allgather": 4 * 2**30}


def test_step_blocks_do_not_reuse_activation_segments():
    """get_free_block finds no cached block as large as the step's flat buffers: alloc_block maps more."""
    live = {"forward": 10 * 2**30, "backward": 12 * 2**30, "step": 11 * 2**30}
    _, reserved, _ = reserved_bytes(live, {}, fragmentation_fraction=0.0, step_transient=3 * 2**30)
    assert reserved == 15 * 2**30
    _, reserved_exp, _ = reserved_bytes(live, {}, fragmentation_fraction=0.0, step_transient=3 * 2**30,
                                        expandable_segments=True)
    assert reserved_exp == 12 * 2**30


def test_large_segments_round_to_two_mib():
    assert round_segment(1) == 2**21 and round_segment(2**21 + 1) == 2**22


def test_estimate_reports_allocated_and_reserved():
    m = evaluate(model=SPEC, training=TrainingSetup(precision=get_precision("bf16")), zero=ZeroConfig(stage=3),
                 n_gpus=N, hardware=__import__("zeroplan.specs.hardware", fromlist=["load_profile"]).load_profile(
                     "dgx-a100-80gb")).memory
    assert m.allocated <= m.reserved < m.peak
    assert m.peak == m.reserved + m.overhead_detail["cuda_context"] + m.overhead_detail["nccl"]


# ---- the CLI ----

def _estimate_json(args):
    import io
    import json
    from contextlib import redirect_stdout

    from zeroplan.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            main(["estimate", "--model", "llama-2-7b", "--gpus", "8", "--json", *args])
        except SystemExit as e:
            assert e.code in (0, None)
    return json.loads(buf.getvalue())


def test_estimate_json_flavour_and_optimizer_impl():
    ds = _estimate_json(["--stage", "0", "--precision", "fp32"])["stages"][0]["memory"]
    paper = _estimate_json(["--stage", "0", "--precision", "fp32", "--flavour", "paper"])["stages"][0]["memory"]
    alias = _estimate_json(["--stage", "0", "--precision", "fp32", "--comm-model", "paper"])["stages"][0]["memory"]
    assert paper["model_states"] == alias["model_states"] == 20 * SPEC.params
    assert ds["model_states"] == 16 * SPEC.params
    m = _estimate_json(["--stage", "2", "--precision", "bf16", "--optimizer-impl", "torch-foreach"])["stages"][0]["memory"]
    assert m["optimizer_impl"] == "torch-foreach" and m["allocated"] <= m["reserved"] <= m["peak"]


def test_optimizer_impl_bad_value_is_one_line_exit_2():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", "--model", "7B", "--optimizer-impl", "nope"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--optimizer-impl" in r.stderr
