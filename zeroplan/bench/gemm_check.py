"""`zeroplan validate`'s gemm check: a transformer layer's matmuls timed at their real shapes,
beside the rate the compute model plans them at (core/compute.py ``matmul_rate``).

Every weight matrix of one decoder layer, and the LM head, is timed at the shapes training runs
it with ``m = micro-batch × sequence`` tokens: the forward (m × k) @ (k × n), the activation
gradient (m × n) @ (n × k) and the weight gradient (n × m) @ (m × k); 6·m·k·n FLOPs in all. A
layer with grouped-query attention has k and v of width ``kv_heads × head_dim``; a gated MLP has
gate and up. The rows give each matrix's TFLOP/s and the layer's total (all its matrices' FLOPs
over all their time), against ``peak × gemm_fraction × shape`` for the profile's GPU.

The compute model's fraction is the matmuls' share of peak **end to end in training** (kernel
launch gaps, the odd small kernel, the framework), so isolated GEMMs should run at or above it;
far below says the generation's fraction or the shape factor is wrong for this GPU.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["layer_matmul_shapes", "measure_layer_gemms", "timer"]


def layer_matmul_shapes(spec: Any) -> list[tuple[str, int, int]]:
    """(name, k = input width, n = output width) of one decoder layer's weight matrices and the
    LM head; MoE layers are timed as one expert (the shapes a routed token passes through)."""
    h, qd = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kvd = (spec.num_key_value_heads or spec.num_attention_heads) * spec.head_dim
    ffn = spec.intermediate_size
    shapes = [("q_proj", h, qd), ("k_proj", h, kvd), ("v_proj", h, kvd), ("o_proj", qd, h)]
    shapes += [("gate_proj", h, ffn), ("up_proj", h, ffn)] if spec.gated_mlp else [("up_proj", h, ffn)]
    return shapes + [("down_proj", ffn, h), ("lm_head", h, spec.vocab_size)]


def timer(device: str, torch: Any) -> Any:
    """A function that runs ``fn`` ``iters`` times and returns the mean seconds: CUDA events on the
    GPU (the kernels' time, not the launches'), the wall clock on CPU."""
    def run(fn: Any, iters: int) -> float:
        fn()  # warm-up: cuBLAS picks its kernel, the allocator its blocks
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    return run


def measure_layer_gemms(device: str, spec: Any, *, seq_len: int, micro_batch: int, precision: str = "bf16",
                        hardware: Any = None, iters: int = 10) -> list[dict[str, Any]]:
    """One row per matrix and one for the layer, TFLOP/s measured vs the compute model's rate
    (predicted None without ``hardware``, whose peak the rate needs)."""
    import torch

    from zeroplan.bench.validate_rows import row
    from zeroplan.runtime.model import resolve_dtype

    dtype = resolve_dtype(torch, precision)
    m = micro_batch * seq_len
    predicted = None
    shape_note = ""
    if hardware is not None:
        from zeroplan.core.compute import matmul_rate
        from zeroplan.specs.training import TrainingSetup, get_precision

        rate, shape = matmul_rate(hardware, TrainingSetup(precision=get_precision(precision), micro_batch=micro_batch,
                                                          seq_len=seq_len), spec.hidden_size)
        predicted = rate / 1e12
        shape_note = f"; planned at {predicted:.4g} TFLOP/s ({hardware.gpu.name}, shape factor {shape:.3f})"
    timed = timer(device, torch)
    rows, total_flops, total_s = [], 0.0, 0.0
    for name, k, n in layer_matmul_shapes(spec):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        g = torch.randn(m, n, device=device, dtype=dtype)
        t = timed(lambda: (x @ w.t(), g @ w, g.t() @ x), iters)  # forward, activation grad, weight grad
        flops = 6.0 * m * k * n
        total_flops, total_s = total_flops + flops, total_s + t
        rows.append(row("gemm", f"{name} ({m} × {k}) @ ({k} × {n}) forward + backward", predicted, flops / t / 1e12,
                        unit="TFLOP/s", note=f"{t * 1e3:.3f} ms for {flops:.4g} FLOPs, {precision}"))
        del x, w, g
    rows.append(row("gemm", f"one layer + LM head, m = {m} tokens", predicted, total_flops / total_s / 1e12,
                    unit="TFLOP/s", note=f"{total_s * 1e3:.3f} ms for {total_flops:.4g} FLOPs{shape_note}"))
    return rows
