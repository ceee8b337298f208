"""The shape terms every activation model shares: Korthikanti et al.'s per-layer sum
(``layer_activation_bytes``, see core/activations.py for the derivation), the HF config's dropout
flags and ``ActivationBreakdown``, what an activation model returns (bytes for one micro-batch on one
GPU). core/activations.py (transformers trace, paper) and core/activations_megatron.py build on it.
"""

from __future__ import annotations

from pydantic import BaseModel

from zeroplan.specs.model import ModelSpec

__all__ = ["ActivationBreakdown", "dropout_flags", "layer_activation_bytes"]


def dropout_flags(spec: ModelSpec) -> tuple[bool, bool]:
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
    attn_drop, hid_drop = dropout_flags(spec)
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
    recompute: int  # full ckpt: the recomputed layer and its backward transient (paper: its activations)
    embeddings: int  # everything alive at the end of forward that is neither a layer nor logits
    logits: int  # logits kept for backward (paper: s·b·V in compute dtype + fp32 copy)
    total: int  # live at the end of forward: layers + embeddings + logits
    forward_peak: int  # most activation bytes live during forward (incl. the loss)
    backward_peak: int  # most activation bytes live during backward
    # the backward's two regions (core/backward_moments.py): the loss/head backward, before any parameter's
    # gradient hook fires, and the top layer's backward, after the logits and their gradient are freed
    # (each layer back-propagated below it frees ``per_layer``). None: ``backward_peak`` for both.
    backward_head_peak: int | None = None
    backward_layer_peak: int | None = None
    # live when the top layer's backward starts, before its own transients (without checkpointing: what the
    # layers saved, less the logits and their gradient). None: ``backward_layer_peak``
    backward_layer_start: int | None = None
    # the forward's two traced regions (stage 3's forward moments, core/memory.py): the last layer's forward
    # at its most (each layer below holds ``per_layer`` less), and the loss. None: ``forward_peak`` for both
    forward_layer_peak: int | None = None
    forward_loss_peak: int | None = None
    formula: str
    source: str = "paper"  # "paper" (Korthikanti), "transformers <version> trace: ..." or "megatron-lm ..."
    host_checkpoints: int = 0  # layer checkpoints kept in host RAM (DeepSpeed cpu_checkpointing), not on the GPU
