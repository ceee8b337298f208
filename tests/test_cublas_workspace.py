"""torch's cuBLAS workspaces in the memory model (core/cublas_workspace.py)."""

from __future__ import annotations

from zeroplan.core.cublas_workspace import CUBLAS_HANDLES_PER_STEP, cublas_workspace_bytes, device_overhead
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision


def test_sizes_follow_torchs_defaults_per_gpu():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB on compute capability 9.x (Hopper) and, since
    # pytorch PR #175344, 10.x/12.x (Blackwell); ":4096:2:16:8" otherwise
    assert cublas_workspace_bytes("NVIDIA H100 SXM5 80GB") == 33_554_432
    assert cublas_workspace_bytes("NVIDIA H200 SXM 141GB") == 33_554_432
    assert cublas_workspace_bytes("NVIDIA B200") == 33_554_432
    assert cublas_workspace_bytes("NVIDIA A100 SXM4 80GB") == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert cublas_workspace_bytes("NVIDIA Tesla V100 SXM2 32GB") == 8_519_680
    assert cublas_workspace_bytes("AMD Instinct MI300X 192GB") == 0  # not counted: see the module doc
    assert CUBLAS_HANDLES_PER_STEP == 2


def test_every_phase_holds_both_workspaces_and_allocated_grows_by_them():
    hw = load_profile("hgx-h200")
    spec = load_model("llama-2-7b")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=2048)
    with_ws = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=8, hardware=hw).memory
    hw_none = hw.model_copy(deep=True)
    hw_none.gpu.name = "AMD Instinct MI300X (no cuBLAS workspace counted)"
    without = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=8, hardware=hw_none).memory
    assert with_ws.buffers_detail["cublas_workspaces"] == 2 * 33_554_432
    assert "cublas_workspaces" not in without.buffers_detail
    for p in ("forward", "backward", "step"):
        assert with_ws.phases[p].peak - without.phases[p].peak == 2 * 33_554_432
        assert with_ws.held_bytes[p] - without.held_bytes[p] == 2 * 33_554_432  # held: no split slack on them
    assert with_ws.allocated - without.allocated == 2 * 33_554_432
    assert device_overhead(hw)["cublas_workspace_bytes"] == 33_554_432


def test_a_plan_without_hardware_says_what_it_leaves_out():
    spec = load_model("llama-2-7b")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=512)
    mem = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2), n_gpus=8).memory
    assert "cublas_workspaces" not in mem.buffers_detail
    assert any("cuBLAS workspaces are not included" in n for n in mem.notes)
