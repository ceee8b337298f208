"""Activation memory per micro-batch for the architecture actually given.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, §4.1) count, per transformer layer with 16-bit activations and 1-byte
dropout masks: ``s·b·h·(34 + 5·a·s/h)`` bytes = attention 11sbh + 5as²b, MLP 19sbh, two
LayerNorms 4sbh. We rebuild that sum term by term so it generalises:

- attention: inputs of the QKV projection (h), Q (h), K and V (h_kv each, grouped-query),
  input of the output projection (h); without flash attention also the a·s² score
  softmax output (and, with dropout, its output and 1-byte mask); flash attention keeps
  only a per-row log-sum-exp (fp32, a·s);
- MLP: input (h) and the intermediate tensors: dense (I for the up-projection output, I for
  the activation output) or gated (gate, act(gate), up, product: 4·I); MoE: the routed
  tokens' expert MLPs (top-k per token) plus fp32 router logits;
- the two norm inputs (h each); dropout masks (1 byte per element) where the config has
  non-zero dropout.
With h_kv = h, I = 4h, dense MLP and dropout this is exactly 34sbh + 5as²b (tested).

Checkpointing: ``full`` keeps only each layer's input (b_a·s·b·h) plus one layer being
recomputed during backward; ``selective`` drops the attention score terms (the 5as²b part).
Logits: ``s·b·V`` in the compute dtype plus an fp32 copy for the loss (b_a + 4 bytes each;
4 bytes in fp32 training, where no cast copy is made).

All results are bytes for ONE micro-batch on one GPU (data parallel: no sequence or tensor
parallel splitting).
"""

from __future__ import annotations

from pydantic import BaseModel

from zeroplan.specs.model import ModelSpec
from zeroplan.specs.training import TrainingSetup

__all__ = ["ActivationBreakdown", "activation_memory", "layer_activation_bytes"]


def _dropout(spec: ModelSpec) -> tuple[bool, bool]:
    """(attention dropout, residual/hidden dropout) from the HF config, default off."""
    cfg = spec.hf_config or {}
    attn = any(float(cfg.get(k) or 0) > 0 for k in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"))
    hid = any(float(cfg.get(k) or 0) > 0 for k in ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "embd_pdrop"))
    return attn, hid


def layer_activation_bytes(
    spec: ModelSpec,
    seq_len: int,
    micro_batch: int,
    act_bytes: int,
    *,
    flash_attention: bool,
    drop_scores: bool = False,
) -> int:
    """Bytes of activations one transformer layer keeps for backward (no recomputation)."""
    s, b, h = seq_len, micro_batch, spec.hidden_size
    a = spec.num_attention_heads
    hd = spec.head_dim
    q_width = a * hd
    kv_width = spec.num_key_value_heads * hd
    attn_drop, hid_drop = _dropout(spec)
    sb = s * b

    # attention block
    attn = act_bytes * sb * (h + q_width + 2 * kv_width + q_width)
    if flash_attention:
        attn += 4 * a * sb  # fp32 log-sum-exp per row
    elif not drop_scores:
        attn += act_bytes * a * s * s * b  # softmax output
        if attn_drop:
            attn += act_bytes * a * s * s * b + a * s * s * b  # dropout output + 1-byte mask
    if hid_drop:
        attn += sb * h  # residual dropout mask

    # MLP block
    inter = spec.intermediate_size
    per_token_mlp = h + (4 * inter if spec.gated_mlp else 2 * inter)
    if spec.num_experts:
        k = max(1, spec.experts_per_token)
        mlp = act_bytes * sb * h + act_bytes * sb * k * (per_token_mlp - h)
        mlp += 4 * sb * spec.num_experts  # fp32 router logits
    else:
        mlp = act_bytes * sb * per_token_mlp
    if hid_drop:
        mlp += sb * h

    norms = 2 * act_bytes * sb * h
    return attn + mlp + norms


class ActivationBreakdown(BaseModel):
    """Bytes of activations for one micro-batch on one GPU."""

    per_layer: int  # one layer as stored for backward (after checkpointing policy)
    layers: int  # all layers stored at the end of forward
    recompute: int  # one layer's full activations re-created during backward (full ckpt)
    embeddings: int  # embedding output (+ dropout mask)
    logits: int  # s·b·V in compute dtype + fp32 copy for the loss
    total: int  # live at the end of forward: layers + embeddings + logits
    formula: str


def activation_memory(spec: ModelSpec, training: TrainingSetup) -> ActivationBreakdown:
    s, b = training.seq_len, training.micro_batch
    ab = training.precision.activation_bytes
    h, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    full_layer = layer_activation_bytes(spec, s, b, ab, flash_attention=training.flash_attention)
    if training.checkpointing == "full":
        per_layer = ab * s * b * h
        recompute = full_layer
        formula = "full checkpointing: 2·s·b·h per layer (layer inputs) + one layer recomputed in backward"
    elif training.checkpointing == "selective":
        per_layer = layer_activation_bytes(spec, s, b, ab, flash_attention=training.flash_attention, drop_scores=True)
        recompute = 0
        formula = "selective checkpointing: Korthikanti per-layer sum without the attention-score terms"
    else:
        per_layer = full_layer
        recompute = 0
        formula = (
            "Korthikanti et al. 2022 per-layer sum (34·s·b·h + 5·a·s²·b for GPT shapes), "
            + ("flash attention (no s² terms)" if training.flash_attention else "with attention scores")
        )
    _, hid_drop = _dropout(spec)
    embeddings = ab * s * b * h + (s * b * h if hid_drop else 0)
    logit_bytes = (ab + 4) if ab != 4 else 4
    logits = logit_bytes * s * b * V
    layers = per_layer * L
    return ActivationBreakdown(
        per_layer=per_layer,
        layers=layers,
        recompute=recompute,
        embeddings=embeddings,
        logits=logits,
        total=layers + embeddings + logits,
        formula=formula,
    )
