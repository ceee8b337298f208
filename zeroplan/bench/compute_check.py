"""`zeroplan validate`'s compute check: the compute model's times against the GPU running them.

Three measurements, each beside what ``core/compute.py`` plans for the same work on ``--hardware``:

- **HBM copy**: one device-to-device copy of ``COPY_BYTES``; bytes read + written over its time,
  against ``hbm_bandwidth_GBps × HBM_EFFICIENCY`` (the rate the element-wise traffic is timed at).
- **attention core**: ``torch.nn.functional.scaled_dot_product_attention`` (causal; FlashAttention
  on a Hopper/Ampere GPU) forward + backward at one layer's shape, against the compute model's
  attention time for one layer: 3 × 4 · (heads · head_dim) · s FLOPs per token at
  ``peak × attention_fraction`` (the full square, as ``flops_per_token`` counts it).
- **model step**: the model itself, built by transformers from the spec's own ``config.json``
  (``AutoModelForCausalLM.from_config``: local config, no download, no remote code) with the
  validated number of layers at full width, in the training dtype with SDPA attention; one
  micro-step's forward + backward of the loss, against ``estimate_compute`` with
  ``kernels="unfused"`` (transformers' modeling code runs each element-wise op as its own kernel,
  core/elementwise.py) — once as is and once with ``gradient_checkpointing_enable()`` against
  ``checkpointing="full"``. No optimizer step (the compute model does not count one).

Times are CUDA events on the GPU (``gemm_check.timer``), the wall clock on CPU, where the rows
exist so the code path is tested; only a GPU's figures mean anything.
"""

from __future__ import annotations

from typing import Any

from zeroplan.bench.gemm_check import timer
from zeroplan.bench.validate_rows import row, skip_row
from zeroplan.runtime.model import resolve_dtype

__all__ = ["COPY_BYTES", "CPU_COPY_BYTES", "measure_compute"]

COPY_BYTES = 1 << 30  # several times any GPU's L2, so the copy streams HBM
CPU_COPY_BYTES = 1 << 24  # on CPU the row only exercises the code path


def _setup(precision: str, micro_batch: int, seq_len: int, checkpointing: str = "none") -> Any:
    from zeroplan.specs.training import TrainingSetup, get_precision

    return TrainingSetup(precision=get_precision(precision), micro_batch=micro_batch, seq_len=seq_len,
                         checkpointing=checkpointing, flash_attention=True, kernels="unfused")


def _copy_row(device: str, torch: Any, hardware: Any, timed: Any, iters: int, copy_bytes: int) -> dict[str, Any]:
    from zeroplan.core.compute import HBM_EFFICIENCY

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters)
    pred = None if hardware is None else hardware.gpu.hbm_bandwidth_GBps * HBM_EFFICIENCY
    del src, dst
    return row("compute", f"device copy of {copy_bytes:,} bytes (read + write)", pred, 2 * copy_bytes / t / 1e9,
               unit="GB/s", note=f"{t * 1e3:.3f} ms; planner: HBM bandwidth × {HBM_EFFICIENCY} (core/compute.py)")


def _attention_row(device: str, torch: Any, spec: Any, setup: Any, hardware: Any, timed: Any,
                   iters: int) -> dict[str, Any]:
    from zeroplan.core.compute import GENERATIONS, gpu_generation, peak_flops

    b, s, heads, hd = setup.micro_batch, setup.seq_len, spec.num_attention_heads, spec.head_dim
    dtype = resolve_dtype(torch, setup.precision.name)
    q, k, v = (torch.randn(b, heads, s, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, hd, device=device, dtype=dtype)

    def fwd_bwd() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    t = timed(fwd_bwd, iters)
    flops = 3 * 4.0 * heads * hd * s * b * s  # core/compute.flops_per_token's attention term, forward + backward
    pred_ms = None
    if hardware is not None:
        gen = GENERATIONS[gpu_generation(hardware.gpu.name)]
        pred_ms = flops / (peak_flops(hardware, setup) * gen.attention_fraction) * 1e3
    return row("compute", f"attention core of one layer (SDPA causal, b={b}, heads={heads}, s={s}, "
               f"head_dim={hd}), forward + backward", pred_ms, t * 1e3, unit="ms",
               note=f"{flops / t / 1e12:.4g} TFLOP/s counting the full square ({flops / 2 / t / 1e12:.4g} "
                    "counting the causal half); planner: peak × the generation's attention fraction")


def _build_model(spec: Any, device: str, dtype: Any) -> Any:
    """The spec's architecture from its own config.json, randomly initialised."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in spec.hf_config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    cfg = AutoConfig.for_model(spec.model_type, **cfg_dict)
    cfg.use_cache = False
    with torch.device(device):  # initialised where it runs: a CPU init of billions of weights takes minutes
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(dtype=dtype).train()


def _step_rows(device: str, torch: Any, spec: Any, precision: str, micro_batch: int, seq_len: int,
               hardware: Any, timed: Any, iters: int) -> list[dict[str, Any]]:
    from zeroplan.core.compute import estimate_compute

    model = _build_model(spec, device, resolve_dtype(torch, precision))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len), generator=gen).to(device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)  # each step writes fresh gradients, as DeepSpeed's hooks take them

    rows = []
    for ck in ("none", "full"):
        if ck == "full":  # transformers 5.23 renamed it; older 5.x has only the first name
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        t = timed(step, iters)
        pred_ms, note = None, ""
        if hardware is not None:
            est = estimate_compute(spec, _setup(precision, micro_batch, seq_len, ck), hardware)
            pred_ms = est.time_s * 1e3
            note = (f"planner: {est.elementwise_time_s * 1e3:.3f} ms of it element-wise (unfused), MFU "
                    f"{est.mfu:.3f}; measured MFU {est.model_flops / t / est.peak_flops:.3f}")
        rows.append(row("compute", f"{spec.name}: forward + backward of one micro-step ({spec.num_layers} layers, "
                        f"b={micro_batch}, s={seq_len}, {precision}, checkpointing {ck})", pred_ms, t * 1e3,
                        unit="ms", note=note))
    del model
    return rows


def measure_compute(device: str, spec: Any, *, seq_len: int, micro_batch: int, precision: str = "bf16",
                    hardware: Any = None, iters: int = 5, copy_bytes: int | None = None) -> list[dict[str, Any]]:
    """The copy, attention and model-step rows (predicted None without ``hardware``); the copy moves
    ``copy_bytes`` (default ``COPY_BYTES`` on a GPU, ``CPU_COPY_BYTES`` on CPU)."""
    import torch

    if copy_bytes is None:
        copy_bytes = COPY_BYTES if device == "cuda" else CPU_COPY_BYTES
    timed = timer(device, torch)
    setup = _setup(precision, micro_batch, seq_len)
    rows = [_copy_row(device, torch, hardware, timed, iters, copy_bytes),
            _attention_row(device, torch, spec, setup, hardware, timed, iters)]
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return rows + [skip_row("compute", f"transformers is not importable: {exc}"[:300])]
    return rows + _step_rows(device, torch, spec, precision, micro_batch, seq_len, hardware, timed, iters)
