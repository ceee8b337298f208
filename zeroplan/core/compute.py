"""Compute time of one optimizer step: FLOPs counted from the architecture, run at an
achievable rate that depends on the GPU generation and the shapes of the work.

FLOPs per token (the PaLM / Megatron-LM convention, Korthikanti et al. 2022; llm-foundry's
``scripts/train/benchmarking/README.md`` uses the same): every weight of a matmul costs
2 FLOPs per token forward and 4 backward (6 in all), counted over the matmuls one token
actually passes through:
- attention projections: q and o are h × (heads · head_dim), k and v are h × (kv_heads ·
  head_dim) (grouped-query attention shrinks k/v, not q/o);
- MLP: 3 matrices h × ffn when gated (SwiGLU), 2 otherwise; MoE: the router plus
  ``experts_per_token`` experts, not all of them;
- the logits: h × vocab (also when the head is tied to the embedding: the matmul runs);
- attention scores and values: 2 · 2 · s · (heads · head_dim) forward per token and layer
  (Q·Kᵀ and P·V over the whole sequence, without the causal half counted off, as published MFU
  tables count it), 3× for forward + backward: 12 · L · (heads·head_dim) · s.
Fine-tuning (core/finetune_compute.py): a frozen weight skips its weight-gradient GEMM, so it
costs 2 forward + 2 backward (the activation gradient) = 4 per token; trainable weights, LoRA's A
and B included, cost 6. ``work.trainable_share`` is the share of matmul FLOPs whose weights train.
Full activation checkpointing runs the forward of every transformer block once more (+1/3 of
the blocks' matmul work, and the attention forward again) but not the LM head: the checkpointed
unit is the block (transformers ``GradientCheckpointingLayer``, the base of e.g.
``LlamaDecoderLayer``; llm-foundry ``MPTPreTrainedModel.activation_checkpointing_fn`` returns
``isinstance(module, MPTBlock)``), and the final norm and logits run outside it. Selective
checkpointing recomputes the attention core only.
``model_flops`` is the work without recomputation (what MFU divides by), ``hardware_flops``
with it (what the GPU runs).

Rate: matmuls at ``peak × gemm_fraction(generation) × shape factor``; attention at
``peak × attention_fraction`` (FlashAttention kernels; without FlashAttention its matmuls at the
matmul rate plus the score matrix streamed through HBM, ``eager_score_bytes``); the element-wise
and normalisation work, which is bound by memory bandwidth, at
``HBM bandwidth × HBM_EFFICIENCY`` for the bytes core/elementwise.py counts per token (fused kernels,
or transformers' code op by op: ``--kernels``). The shape
factor is m / (m + GEMM_HALF_DIM) for the smallest of (micro-batch × sequence, hidden size):
small matmuls do not fill the GPU's tiles and waves. The per-generation fractions are the
table ``GENERATIONS``, each with its source. ``--mfu`` overrides all of it: compute time =
model FLOPs / (peak × mfu).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from zeroplan._util import InputError
from zeroplan.core.activation_terms import dropout_flags
from zeroplan.core.elementwise import elementwise_traffic
from zeroplan.core.finetune_compute import FULL_TRAINING, MatmulWork
from zeroplan.specs.training import PrecisionPreset, TrainingSetup

__all__ = ["ComputeEstimate", "GENERATIONS", "Generation", "eager_score_bytes", "flops_per_token", "gpu_generation",
           "estimate_compute", "hbm_stream_time_s", "matmul_rate", "peak_flops"]


@dataclass(frozen=True)
class Generation:
    name: str
    gemm_fraction: float  # of dense peak reached by the training matmuls, end to end
    attention_fraction: float  # of dense peak reached by FlashAttention forward + backward
    source: str


# Achievable fractions of dense peak. Each is a published measurement, stated as such.
GENERATIONS: dict[str, Generation] = {
    "hopper": Generation(
        "Hopper (H100/H200/GH200)", 0.56, 0.36,
        "matmuls: llm-foundry MPT bf16 on H100 reaches 46% MFU at 7B, seq 2048, without checkpointing (its "
        "benchmarking README) with the element-wise work below counted apart (and the optimizer step, "
        "core/optimizer_step.py: 2% of that row's step, within this fraction's precision); attention: FlashAttention-2 "
        "forward+backward reaches ~335-350 TFLOP/s on H100 SXM5 at head dim 128 (Dao 2023, arXiv:2307.08691, "
        "fig. 'Attention forward + backward speed on H100'), 0.35 of 989 TFLOP/s"),
    "ampere": Generation(
        "Ampere (A100)", 0.70, 0.55,
        "matmuls: Megatron-LM reaches 52-57% of A100 peak (model FLOPs with recomputation; Narayanan et al. "
        "2021, arXiv:2104.04473, table 1) and llm-foundry MPT on A100 80GB ~55-60% MFU (its benchmarking "
        "README); attention: FlashAttention-2 forward+backward ~170-190 TFLOP/s causal at head dim 128 on "
        "A100 80GB (arXiv:2307.08691, fig. 4), 0.55-0.6 of 312"),
    "volta": Generation(
        "Volta (V100)", 0.50, 0.25,
        "ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054, fig. 2): ZeRO-100B runs at ~38-48 TFLOP/s per V100 "
        "(0.30-0.38 of 125 TFLOP/s fp16) end to end including communication; matmul fraction 0.5 for the "
        "compute alone; no FlashAttention on Volta: attention at 0.25"),
    "ada": Generation(
        "Ada/Ampere workstation (L40S, RTX 4090, A10G)", 0.55, 0.35,
        "rule: GDDR parts sustain a smaller share of their tensor peak than HBM parts; taken between Ampere and "
        "Hopper datacenter parts, not measured"),
    "cdna3": Generation(
        "CDNA3 (MI300X)", 0.40, 0.25,
        "AMD MI300X: large bf16 GEMMs reach ~500-600 TFLOP/s of 1307 (rocBLAS/hipBLASLt results reported in "
        "SemiAnalysis 'MI300X vs H100' training benchmarks, Dec 2024) -> ~0.4"),
}
_DEFAULT_GEN = "ampere"

HBM_EFFICIENCY = 0.8  # of hbm_bandwidth_GBps reached by streaming kernels (STREAM-like copy on HBM2e/HBM3)
GEMM_HALF_DIM = 128  # a matmul dimension of this size runs at half the large-shape rate (one 128-wide tile)


def hbm_stream_time_s(nbytes: float, hw: Any) -> float:
    """Seconds a memory-bound kernel takes to read and write ``nbytes``: HBM bandwidth × ``HBM_EFFICIENCY``
    (element-wise work, eager attention scores, the optimizer step's passes)."""
    return nbytes / (hw.gpu.hbm_bandwidth_GBps * 1e9 * HBM_EFFICIENCY)


def gpu_generation(gpu_name: str) -> str:
    n = gpu_name.upper()
    if any(k in n for k in ("H100", "H200", "GH200", "H800", "H20")):
        return "hopper"
    if "MI300" in n or "MI325" in n:
        return "cdna3"
    if "V100" in n:
        return "volta"
    if any(k in n for k in ("L40", "4090", "A10G", "A10 ", "L4", "A6000", "3090")) or n.endswith("A10"):
        return "ada"
    if "A100" in n or "A800" in n:
        return "ampere"
    return _DEFAULT_GEN


def peak_flops(hw: Any, training: TrainingSetup) -> float:
    """Dense peak FLOP/s of the profile's GPU for the training dtype (fp32 trains on TF32 cores)."""
    flops = hw.gpu.peak_flops
    want = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}.get(training.precision.name, "bf16")
    # Same-width fallbacks only (bf16 and fp16 run at one tensor-core rate on NVIDIA GPUs; fp32
    # matmuls run on TF32 cores). Never the fp8/int8 figure, which the old max() silently took.
    fallback = {"bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16"), "fp32": ("fp32", "tf32")}[want]
    for k in fallback:
        if k in flops and flops[k] > 0:
            return float(flops[k])
    raise InputError(f"hardware profile {getattr(hw, 'name', '?')}: gpu.peak_flops has no {' or '.join(fallback)} "
                     f"figure for {want} training (has {', '.join(sorted(flops)) or 'none'})")


def flops_per_token(model: Any, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by part: matmul weights (2 per weight) and attention core."""
    h = model.hidden_size
    qd = model.num_attention_heads * model.head_dim
    kvd = model.num_key_value_heads * model.head_dim
    L = model.num_layers
    attn_proj = 2 * h * qd + 2 * h * kvd
    n_mlp = 3 if model.gated_mlp else 2
    if model.num_experts:
        mlp = n_mlp * h * model.intermediate_size * max(1, model.experts_per_token) + h * model.num_experts
    else:
        mlp = n_mlp * h * model.intermediate_size
    matmul_weights = L * (attn_proj + mlp) + h * model.vocab_size
    return {
        "matmul": 2.0 * matmul_weights,
        "logits": 2.0 * h * model.vocab_size,
        "attention": 4.0 * L * qd * seq_len,
        "layers": float(L),
    }


class ComputeEstimate(BaseModel):
    """Compute time of one optimizer step per GPU and how it was derived (quotable fields)."""

    time_s: float
    model_flops: float  # per GPU per step, without recomputation (what MFU divides by)
    hardware_flops: float  # with recomputation
    attention_share: float  # of model FLOPs
    peak_flops: float
    mfu: float  # model FLOPs / (time × peak): the achieved fraction this estimate implies
    source: str  # where the rate came from ("--mfu override" or the generation's source)
    generation: str
    gemm_fraction: float | None = None
    attention_fraction: float | None = None
    shape_factor: float | None = None
    elementwise_time_s: float = 0.0
    forward_time_s: float = 0.0  # the forward pass of all micro-steps (without recomputation)
    backward_time_s: float = 0.0  # the backward pass, with the recomputation that runs inside it


EAGER_NOTE = " (no FlashAttention: its matmuls plus the score matrix streamed through HBM)"


def eager_score_bytes(precision: PrecisionPreset, dropout: bool) -> tuple[int, int]:
    """HBM bytes moved per element of the attention score matrix without FlashAttention (forward, backward).

    transformers' eager path (``modeling_llama.eager_attention_forward`` and the models that copy it:
    ``matmul(q, kᵀ) * scaling``, ``+ mask``, ``softmax(..., dtype=torch.float32).to(q.dtype)``,
    ``dropout``, ``matmul(p, v)``) materialises the heads × s scores of every token, and each step is
    its own kernel. With a = the activation bytes:
    - forward: Q·Kᵀ writes the scores (a); the scaling reads and writes them (2a); the mask add reads
      and writes them (2a; the mask itself, broadcast over heads, is not counted); the fp32 softmax
      (below); the cast back reads 4 and writes a; P·V reads the probabilities (a);
    - backward: dV's matmul reads P (a) and dP's writes dP (a); the cast's backward reads a, writes 4;
      softmax's backward reads dP and its output (4 + 4) and writes its input's dtype; the scaling's
      backward reads and writes (2a); dQ's and dK's matmuls read dS once each (2a);
    - the fp32 softmax: ATen's ``softmax(input, dim, dtype)`` (aten/src/ATen/native/SoftMax.cpp) fuses
      the upcast only for fp16 on CUDA (``_softmax(half_to_float=True)``: reads a, writes 4; its
      backward writes a). Otherwise the input is cast first (reads a, writes 4), ``_softmax`` reads 4
      and writes 4, and its backward writes 4, then the cast's backward reads 4 and writes a. fp32
      training has no casts at all;
    - attention dropout (p > 0; ``native_dropout`` on CUDA): forward reads a, writes a and a 1-byte
      mask; backward reads a and the mask and writes a.
    tests/test_eager_attention_trace.py checks the bf16 and fp32 counts against the ATen kernels the
    eager path runs (traced on CPU; the fused fp16 softmax exists on CUDA only).
    """
    a = precision.activation_bytes
    fwd = a + 2 * a + 2 * a + a  # Q·Kᵀ write, scaling, mask add, P·V read
    bwd = a + a + 2 * a + 2 * a  # dV's read of P, dP's write, the scaling's backward, dQ's and dK's reads
    if a == 4:  # fp32: softmax reads and writes 4, its backward reads 4 + 4 and writes 4
        fwd, bwd = fwd + 8, bwd + 12
    elif precision.name == "fp16":  # fused upcast: softmax reads a, writes 4; backward writes a
        fwd, bwd = fwd + (a + 4) + (4 + a), bwd + (a + 4) + (8 + a)
    else:  # bf16: cast up, softmax in fp32, cast back; the same three backward
        fwd, bwd = fwd + (a + 4) + 8 + (4 + a), bwd + (a + 4) + 12 + (4 + a)
    if dropout:
        fwd, bwd = fwd + 2 * a + 1, bwd + 2 * a + 1
    return fwd, bwd


def _eager_attention_time_s(model: Any, training: TrainingSetup, hw: Any, tokens: int, t_matmul_s: float) -> float:
    """Attention core without FlashAttention: its two matmuls at the matmul rate plus the score traffic.

    Every token has heads × s scores per layer (the eager path computes the masked upper half too and
    overwrites it), streamed at the element-wise rate; recomputation (full or selective
    checkpointing) streams the forward's share again."""
    attn_dropout, _ = dropout_flags(model)
    fwd_b, bwd_b = eager_score_bytes(training.precision, attn_dropout)
    passes = fwd_b + bwd_b + (fwd_b if training.checkpointing in ("full", "selective") else 0)
    elements = model.num_attention_heads * training.seq_len * model.num_layers * tokens
    return t_matmul_s + hbm_stream_time_s(elements * passes, hw)


def matmul_rate(hw: Any, training: TrainingSetup, hidden: int) -> tuple[float, float]:
    """(FLOP/s the model's matmuls run at, the shape factor): peak × the generation's
    ``gemm_fraction`` × m / (m + GEMM_HALF_DIM) for m the smaller of micro-batch × sequence and
    the hidden size. ``zeroplan validate`` sets timed GEMMs of a layer's shapes beside it."""
    small = min(training.micro_batch * training.seq_len, hidden)
    shape = small / (small + GEMM_HALF_DIM)
    return peak_flops(hw, training) * GENERATIONS[gpu_generation(hw.gpu.name)].gemm_fraction * shape, shape


def estimate_compute(model: Any, training: TrainingSetup, hw: Any, *, mfu: float | None = None,
                     work: MatmulWork = FULL_TRAINING) -> ComputeEstimate:
    """Compute time for ``grad_accum`` micro-steps of ``micro_batch × seq_len`` tokens on one GPU;
    ``work``: which matmul weights train (fine-tuning; default: all)."""
    tokens = training.micro_batch * training.seq_len * training.grad_accum
    f = flops_per_token(model, training.seq_len)
    # LoRA's A and B run as extra matmuls beside the weights they adapt (2 FLOPs per weight forward)
    fwd_mm, fwd_att = (f["matmul"] + 2.0 * work.adapter_params_per_token) * tokens, f["attention"] * tokens
    fwd_ad = 2.0 * work.adapter_params_per_token * tokens
    # backward: the activation gradient of every matmul (= its forward) plus the weight gradient
    # (= its forward) of the trainable ones only; adapters always train (core/finetune_compute.py)
    bwd_mm = fwd_mm + (fwd_mm - fwd_ad) * work.trainable_share + fwd_ad
    model_flops = fwd_mm + bwd_mm + 3 * fwd_att
    ck = training.checkpointing
    # full checkpointing reruns the blocks' forward, not the logits matmul (outside every block)
    re_mm = fwd_mm - f["logits"] * tokens if ck == "full" else 0.0
    re_att = fwd_att if ck in ("full", "selective") else 0.0
    hardware_flops = model_flops + re_mm + re_att
    peak = peak_flops(hw, training)
    gen_key = gpu_generation(hw.gpu.name)
    gen = GENERATIONS[gen_key]
    # recomputation runs inside the backward pass (torch.utils.checkpoint: the reentrant
    # CheckpointFunction.backward reruns the block; the non-reentrant variant reruns it when backward
    # first unpacks a saved tensor), so it is compute the backward's collectives can hide behind
    fwd_share = (fwd_mm + fwd_att) / hardware_flops if hardware_flops else 1 / 3
    if mfu is not None:
        t = model_flops / (peak * mfu)
        return ComputeEstimate(
            time_s=t, model_flops=model_flops, hardware_flops=hardware_flops,
            attention_share=3 * fwd_att / model_flops if model_flops else 0.0, peak_flops=peak, mfu=mfu,
            source=f"--mfu {mfu:g} (override)", generation=gen.name,
            forward_time_s=t * fwd_share, backward_time_s=t * (1 - fwd_share))
    rate_mm, shape = matmul_rate(hw, training, model.hidden_size)
    t_mm = (fwd_mm + bwd_mm + re_mm) / rate_mm
    # Known gap (issue 13, not applied): FlashAttention's benchmark (Dao-AILab/flash-attention
    # benchmarks/benchmark_flash_attention.py, flops()) counts a causal forward as half the square
    # and the backward as 2.5 forwards, so the cited rates imply ~0.58x this time for causal models.
    # Applying that alone moves the 56 published FSDP cases from 8.8% to 12.7% median |error|: the
    # matmul fractions were set against this count and must be re-derived with it.
    if training.flash_attention:
        t_att = (3 * fwd_att + re_att) / (peak * gen.attention_fraction)
    else:
        t_att = _eager_attention_time_s(model, training, hw, tokens, (3 * fwd_att + re_att) / (peak * gen.gemm_fraction))
    att_frac = (3 * fwd_att + re_att) / (t_att * peak) if t_att > 0 else gen.attention_fraction
    ew = elementwise_traffic(model, training)
    ew_bytes = tokens * (ew.forward_bytes + ew.backward_bytes + (ew.recompute_bytes if ck == "full" else 0.0))
    t_ew = hbm_stream_time_s(ew_bytes, hw)
    t = t_mm + t_att + t_ew
    return ComputeEstimate(
        time_s=t, model_flops=model_flops, hardware_flops=hardware_flops,
        attention_share=3 * fwd_att / model_flops if model_flops else 0.0, peak_flops=peak,
        mfu=model_flops / (t * peak) if t > 0 else 0.0,
        source=f"compute model: {gen.name} matmuls at {gen.gemm_fraction:.2f} of peak × shape {shape:.2f}, "
               f"attention at {att_frac:.2f}{'' if training.flash_attention else EAGER_NOTE}, element-wise "
               f"({ew.source}) at {HBM_EFFICIENCY:.0%} of HBM bandwidth ({gen.source})",
        generation=gen.name, gemm_fraction=gen.gemm_fraction, attention_fraction=att_frac, shape_factor=shape,
        elementwise_time_s=t_ew, forward_time_s=t * fwd_share, backward_time_s=t * (1 - fwd_share))
