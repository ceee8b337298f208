"""Element-wise (non-matmul) HBM traffic per token: norms, activation functions, rotary, residual
adds, dropout, layout copies and, for transformers' code, the loss over the logits.

These kernels are bound by memory bandwidth: core/compute.py streams the bytes counted here at
``HBM bandwidth × HBM_EFFICIENCY``. The attention score matrix is not counted here
(``compute.eager_score_bytes``), nor any matmul. How many bytes a token moves depends on how the
code runs its kernels (``TrainingSetup.kernels``, ``--kernels``):

- ``fused``: fused or compiled kernels (torch.compile, Liger, Apex or Transformer Engine norms,
  Megatron-LM, llm-foundry, torchtitan): ``FUSED_H_PER_TOKEN_LAYER`` = 42 units of
  hidden × activation bytes per token and layer, forward + backward (counted below for a pre-norm
  block), and no loss traffic (a fused cross-entropy);
- ``unfused``: transformers' modeling code op by op, the module in the training dtype (DeepSpeed's
  engine casts the module to bf16/fp16; FSDP's mixed precision does the same to its parameters);
- ``unfused-amp``: the same code under ``torch.autocast`` on CUDA with fp32 weights (DDP + AMP,
  the HF Trainer without DeepSpeed or FSDP): autocast runs ``layer_norm``, ``pow``,
  ``softmax``/``log_softmax`` and the loss in fp32 and casts at every matmul's input.

Unfused counts are sums of components, each in bytes per element of the tensor it acts on, read +
written, every tensor streamed once (no L2 reuse). ``UNFUSED`` holds them per mode;
tests/test_elementwise_trace.py traces the ATen kernels transformers' modules run
(``TorchDispatchMode``) and checks every number and whole decoder layers against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroplan.core.activation_terms import dropout_flags
from zeroplan.specs.training import TrainingSetup

__all__ = ["ElementwiseTraffic", "FUSED_H_PER_TOKEN_LAYER", "elementwise_traffic"]

# Fused kernels, per token per layer in units of (hidden size × activation bytes): 2 norms
# (read + write, backward twice), 2 residual adds (3 reads/writes), the MLP activation on 2-3 × ffn
# elements, rotary on q/k; ~14 h forward, ~2× that backward: 42.
FUSED_H_PER_TOKEN_LAYER = 42
_FUSED_FORWARD_SHARE = 1 / 3  # 14 of the 42: what full checkpointing streams again


@dataclass(frozen=True)
class ElementwiseTraffic:
    """Bytes per token (one micro-step token, all layers): forward, backward, and what full
    activation checkpointing adds (the blocks' forward again, not the loss)."""

    forward_bytes: float
    backward_bytes: float
    recompute_bytes: float
    source: str


def _fused(model: Any, training: TrainingSetup) -> ElementwiseTraffic:
    per_layer = FUSED_H_PER_TOKEN_LAYER * model.hidden_size * training.precision.activation_bytes
    total = per_layer * model.num_layers
    fwd = total * _FUSED_FORWARD_SHARE
    return ElementwiseTraffic(forward_bytes=fwd, backward_bytes=total - fwd, recompute_bytes=fwd,
                              source=f"fused kernels: {FUSED_H_PER_TOKEN_LAYER}·h × activation bytes per token and layer; "
                                     "--kernels unfused for transformers' code op by op")


# Unfused components: (forward, backward) bytes per element of the tensor each acts on, for the module
# in bf16/fp16 ("half2"), in fp32 ("half4"), and under CUDA autocast to bf16/fp16 with fp32 weights
# ("amp": the residual stream and the norms in fp32). fp16 and bf16 give the same numbers. Traced from
# transformers 5.23 on CPU with CUDA's kernels emulated (F.dropout as native_dropout; autocast's CUDA
# op lists, ATen/autocast_mode.h; scaled_dot_product_attention as one opaque fused kernel):
_Pair = tuple[float, float]
UNFUSED: dict[str, dict[str, _Pair]] = {
    "half2": {
        # nn.LayerNorm: native_layer_norm(_backward), + per-token mean/rstd ("layernorm_tok", per token)
        "layernorm": (4, 6), "layernorm_tok": (4, 4),
        # LlamaRMSNorm: .to(float32), pow, mean, rsqrt·x, .to(dtype), ·weight; backward ~6 muls, sum, pow
        "rmsnorm": (36, 92), "rmsnorm_tok": (24, 40),
        # NewGELUActivation (gelu_new): pow, 4 mul, 2 add, tanh, each its own kernel; per element of i
        "gelu_new": (36, 56),
        "gelu": (4, 6),  # one kernel (F.gelu exact or tanh, relu): per element of i
        "gated": (10, 18),  # act_fn(gate) * up (silu or gelu_pytorch_tanh) and its backward: per element of i
        "rope": (20, 28),  # apply_rotary_pos_emb with rotate_half: per element of q and of k
        "residual": (6, 6),  # the add: per element of h, twice a layer
        "dropout": (5, 5),  # native_dropout (1-byte mask): per element of h
        "bias_grad": (0, 2),  # sum over tokens for a biased linear: per output element
        "fork": (0, 6),  # the add where a tensor feeding two linears sums its gradients: per element of h
        "cast_in": (0, 0),  # autocast's cast at a matmul's input (amp only)
        "glue_gpt2_eager": (16, 24), "glue_gpt2_sdpa": (0, 12),  # c_attn split + head merge: per element of h
        "glue_mha_eager": (16, 16), "glue_mha_sdpa": (0, 8),  # q/k/v transposes + merge: per element of q
        "glue_q_eager": (12, 12), "glue_k_eager": (4, 12),  # grouped-query: repeat_kv, per q / k element
        "glue_q_sdpa": (0, 4), "glue_k_sdpa": (0, 4),
        "logits": (14, 22),  # ForCausalLMLoss: logits.float(), log_softmax, nll: per vocab entry per token
    },
    "half4": {
        "layernorm": (8, 12), "layernorm_tok": (8, 8), "rmsnorm": (28, 92), "rmsnorm_tok": (24, 40),
        "gelu_new": (72, 112), "gelu": (8, 12), "gated": (20, 36), "rope": (40, 56), "residual": (12, 12),
        "dropout": (9, 9), "bias_grad": (0, 4), "fork": (0, 12), "cast_in": (0, 0),
        "glue_gpt2_eager": (32, 48), "glue_gpt2_sdpa": (0, 24), "glue_mha_eager": (32, 32), "glue_mha_sdpa": (0, 16),
        "glue_q_eager": (24, 24), "glue_k_eager": (8, 24), "glue_q_sdpa": (0, 8), "glue_k_sdpa": (0, 8),
        "logits": (8, 16),
    },
    "amp": {
        # the residual stream is fp32 (fp32 embeddings and norms); pow is on autocast's fp32 list, so
        # gelu_new's whole chain runs in fp32; matmul outputs are half
        "layernorm": (8, 12), "layernorm_tok": (8, 8), "rmsnorm": (28, 92), "rmsnorm_tok": (24, 40),
        "gelu_new": (70, 112), "gelu": (4, 6), "gated": (10, 18), "rope": (30, 48), "residual": (10, 18),
        "dropout": (5, 5), "bias_grad": (0, 2), "fork": (0, 12), "cast_in": (6, 6),
        "glue_gpt2_eager": (16, 24), "glue_gpt2_sdpa": (0, 12), "glue_mha_eager": (28, 28), "glue_mha_sdpa": (12, 20),
        "glue_q_eager": (26, 26), "glue_k_eager": (6, 14), "glue_q_sdpa": (6, 10), "glue_k_sdpa": (6, 10),
        "logits": (14, 22),
    },
}
AMP_PARAM_CAST_BYTES = (6, 6)  # autocast's weight cast fp32 -> half (once per forward), the gradient cast back
# transformers families with LayerNorm, learned positions and GPT-2's fused c_attn (with biases);
# every other family is counted as Llama's block (RMSNorm, rotary, separate q/k/v projections)
_GPT2_LAYOUT = frozenset({"gpt2", "gpt_bigcode"})
_LAYERNORM = frozenset({"gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon", "phi", "opt", "bloom", "mpt",
                        "starcoder2", "stablelm"})
_NO_ROTARY = frozenset({"gpt2", "gpt_bigcode", "opt", "bloom", "mpt"})
_UNFUSED_CHAIN_ACTS = frozenset({"gelu_new", "gelu_fast"})  # transformers' python tanh-GELU (several kernels)


def _mode(training: TrainingSetup) -> tuple[str, str]:
    """(constants key, words) for the kernels and precision."""
    if training.precision.activation_bytes == 4:
        return "half4", "fp32" + (" (autocast off in fp32 training)" if training.kernels == "unfused-amp" else "")
    if training.kernels == "unfused-amp":
        return "amp", f"torch.autocast to {training.precision.name}, fp32 weights"
    return "half2", f"the module in {training.precision.name}"


# transformers' config defaults where a config.json may leave the activation out (GPT2Config,
# GPTJConfig and PhiConfig default to gelu_new); only non-gated MLPs need the name
_DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "gptj": "gelu_new", "phi": "gelu_new"}


def _activation_name(model: Any) -> str:
    cfg = getattr(model, "hf_config", None) or {}
    name = cfg.get("activation_function") or cfg.get("hidden_act") or cfg.get("hidden_activation")
    return str(name or _DEFAULT_ACTIVATION.get(model.model_type, "gelu"))


def _stream_bytes(key: str, training: TrainingSetup) -> int:
    """Bytes per element of the residual stream, the rotary tables and the weights: the training dtype's
    when the module runs in it, fp32 under autocast (fp32 weights and embeddings)."""
    return training.precision.activation_bytes if key != "amp" else 4


def _layer_bytes(model: Any, training: TrainingSetup, key: str) -> _Pair:
    """(forward, backward) bytes per token of one decoder layer; ``key``: the ``UNFUSED`` mode."""
    c = UNFUSED[key]
    h, mt = model.hidden_size, model.model_type
    ffn = model.intermediate_size * max(1, model.experts_per_token if model.num_experts else 1)
    norm = "layernorm" if mt in _LAYERNORM else "rmsnorm"
    act = "gated" if model.gated_mlp else ("gelu_new" if _activation_name(model) in _UNFUSED_CHAIN_ACTS else "gelu")
    impl = "sdpa" if training.flash_attention else "eager"
    terms: list[tuple[str, float]] = [(norm, 2 * h), (f"{norm}_tok", 2), (act, ffn), ("residual", 2 * h)]
    if dropout_flags(model)[1]:
        terms.append(("dropout", 2 * h))  # after the attention and after the MLP
    q, k = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    if mt in _GPT2_LAYOUT:  # c_attn's split and the merge; biases on c_attn, c_proj, c_fc, c_proj
        terms += [(f"glue_gpt2_{impl}", h), ("bias_grad", 5 * h + ffn), ("cast_in", 2 * h)]
        if act == "gelu_new" and key == "amp":
            terms.append(("cast_in", ffn))  # the fp32 chain's output cast for c_proj
    else:  # q, k, v read one normed input and gate, up another: 3 gradient sums; autocast casts 5 inputs
        terms += [("fork", 3 * h), ("cast_in", 5 * h)]
        terms += [(f"glue_mha_{impl}", q)] if q == k else [(f"glue_q_{impl}", q), (f"glue_k_{impl}", k)]
    fwd = sum(c[name][0] * n for name, n in terms)
    bwd = sum(c[name][1] * n for name, n in terms)
    if mt not in _NO_ROTARY:
        rot = int(model.head_dim * float((getattr(model, "hf_config", None) or {}).get("partial_rotary_factor") or 1.0))
        rot_elems = (model.num_attention_heads + model.num_key_value_heads) * rot
        # plus the cos/sin tables (1, s, rot) read 4 times each way per micro-batch: 4·bytes·rot per token / b
        table = 4 * _stream_bytes(key, training) * rot / training.micro_batch
        fwd += c["rope"][0] * rot_elems + table
        bwd += c["rope"][1] * rot_elems + table
    return fwd, bwd


def _unfused(model: Any, training: TrainingSetup) -> ElementwiseTraffic:
    key, words = _mode(training)
    c = UNFUSED[key]
    fwd_l, bwd_l = _layer_bytes(model, training, key)
    L, h, V = model.num_layers, model.hidden_size, model.vocab_size
    norm = "layernorm" if model.model_type in _LAYERNORM else "rmsnorm"
    # outside the layers: the final norm, the loss over the logits, and per micro-step the embedding
    # gradient (embedding_dense_backward writes the whole table) and autocast's weight casts
    fwd_out = c[norm][0] * h + c[f"{norm}_tok"][0] + c["logits"][0] * V
    bwd_out = c[norm][1] * h + c[f"{norm}_tok"][1] + c["logits"][1] * V
    tokens = training.micro_batch * training.seq_len
    per_step_fwd = AMP_PARAM_CAST_BYTES[0] * model.params if key == "amp" else 0.0
    per_step_bwd = (AMP_PARAM_CAST_BYTES[1] * model.params if key == "amp" else 0.0) + _stream_bytes(key, training) * V * h
    return ElementwiseTraffic(
        forward_bytes=L * fwd_l + fwd_out + per_step_fwd / tokens,
        backward_bytes=L * bwd_l + bwd_out + per_step_bwd / tokens,
        recompute_bytes=L * fwd_l,
        source=f"unfused: transformers' code op by op, {words}: {(fwd_l + bwd_l) / (h * training.precision.activation_bytes):.0f}·h "
               f"× activation bytes per token and layer, the loss {sum(c['logits'])} B per vocabulary entry")


def elementwise_traffic(model: Any, training: TrainingSetup) -> ElementwiseTraffic:
    """The element-wise bytes one token moves through HBM, by ``training.kernels``."""
    if training.kernels == "fused":
        return _fused(model, training)
    return _unfused(model, training)
