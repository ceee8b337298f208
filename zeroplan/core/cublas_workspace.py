"""cuBLAS workspaces: memory torch allocates *inside* the caching allocator for every cuBLAS handle
and stream that runs a GEMM, so it counts in ``memory_allocated`` and in the planner's ``allocated``.

torch's ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
- ``getCurrentCUDABlasHandle`` -> ``setWorkspaceForHandle`` keeps one workspace per (handle, stream)
  in ``cublas_handle_stream_to_workspace`` and never frees it; handles come from a per-thread pool
  window, so each thread that runs GEMMs has its own.
- ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` when set, else ``:4096:2:16:8``
  (2 x 4096 KiB + 8 x 16 KiB = 8,519,680 bytes), and 32 MiB on compute capability 9.x (Hopper;
  pytorch PR #89027). PR #175344 (2026-02) extended the 32 MiB default to majors 10 and 12
  (Blackwell).
- A training step runs GEMMs on two threads: the forward on the Python thread and the backward (and
  full checkpointing's recomputation) on autograd's device thread. So two workspaces per rank, both
  allocated from the first step on and held.

Measured (examples/validation/gpu/h200-2026-11-26, examples/validation/cpu-replay): on an H200 the
bundled engine's peak allocated was 2 x 33,554,432 bytes (+ a 1 MiB cuBLASLt workspace) above the
tensors it holds; real DeepSpeed's stage-2 and stage-3 peaks were 67.5-70.0 MB above the same runs'
tensor peaks replayed on CPU (tests/test_gpu_measurements.py). The cuBLASLt workspaces (1 MiB per
thread, ``CUBLASLT_WORKSPACE_SIZE``, only where a GEMM takes the Lt path) are not planned.

ROCm is not counted: its hipBLAS (128 MiB on gfx94x) and hipBLASLt (76 MiB) workspaces have separate
handle pools, and which of them a training step allocates was not measured.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CUBLAS_HANDLES_PER_STEP", "cublas_workspace_bytes", "device_overhead"]

_KIB = 1024
PRE_HOPPER_BYTES = 4096 * _KIB * 2 + 16 * _KIB * 8  # ":4096:2:16:8"
HOPPER_AND_LATER_BYTES = 32 * _KIB * _KIB
CUBLAS_HANDLES_PER_STEP = 2  # the forward's thread and autograd's backward thread

# GPU names by the default the torch source gives them (compute capability 9.x, 10.x, 12.x -> 32 MiB)
_HOPPER_OR_BLACKWELL = ("H100", "H200", "GH200", "H800", "H20", "B100", "B200", "B300", "GB200", "GB300",
                        "RTX PRO 6000", "RTX 5090", "RTX 5080")
_ROCM = ("MI100", "MI210", "MI250", "MI300", "MI325", "MI350", "INSTINCT", "AMD ")


def cublas_workspace_bytes(gpu_name: str) -> int:
    """Bytes of ONE cuBLAS workspace (one handle and stream) on this GPU under torch's default
    ``CUBLAS_WORKSPACE_CONFIG``; 0 for AMD GPUs (not counted: see the module doc)."""
    name = gpu_name.upper()
    if any(k in name for k in _ROCM):
        return 0
    if any(k in name for k in _HOPPER_OR_BLACKWELL):
        return HOPPER_AND_LATER_BYTES
    return PRE_HOPPER_BYTES


def device_overhead(hardware: Any) -> dict[str, Any]:
    """The memory model's ``overhead`` input from a hardware profile: the profile's ``[overhead]``
    table plus ``cublas_workspace_bytes`` (per handle and stream) for its GPU."""
    out: dict[str, Any] = hardware.overhead.model_dump()
    out["cublas_workspace_bytes"] = cublas_workspace_bytes(str(hardware.gpu.name))
    return out
