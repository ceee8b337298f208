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

That sum is the ``paper`` flavour, and the fallback. For the families transformers implements
(llama, mistral, mixtral, qwen2, gemma, gpt2, gpt_neox, falcon, phi, phi3) in 16-bit and in fp32 training
(fp32 keeps no upcast copies: its variants are traced apart, keyed ``.../fp32``) the
default (``deepspeed``) flavour reads ``activation_data.json``, which
``examples/activations/trace.py`` traces from transformers itself (FakeTensorMode, autograd's
saved-tensor hooks and a live-storage tracker): per family, attention implementation (sdpa,
eager) and checkpointing (none, full), integer-exact linear forms in the shape terms of
:func:`token_features` for

- ``layer``: bytes one decoder layer keeps for backward (LlamaRMSNorm keeps its fp32 input and
  rsqrt besides the 16-bit output: this is where HF differs most from 2 bytes everywhere);
- ``head``: the rest alive at the end of forward (embedding output, rotary cos/sin, final
  norm, the loss' fp32 log-softmax output: 4·s·V, the 16-bit logits are not kept);
- ``loss_extra``: the loss' transient above that (16-bit logits + their fp32 upcast, 6·s·V);
- ``fwd_layer_start_delta`` / ``fwd_layer_extra``: live when the last layer's forward starts
  (relative to the end of forward) and its transient above that;
- ``head_extra``: backward through loss, lm_head and final norm (log-softmax gradient);
- ``layer_start_delta`` / ``layer_extra``: live when the last layer's backward starts
  (the logits and their gradient are gone by then) and that layer's transient: with full
  checkpointing this is the recomputed layer, which never coexists with the logits.

The forward peak is the larger of the last layer's and the loss' transients; the backward
peak the larger of the loss/head backward and the last layer's backward. Every term scales
with the micro-batch; the rotary cos/sin (4·head_dim bytes a position) are shared by the
sequences of a batch in transformers and are counted per sequence here (at most a few MB).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from zeroplan.core.activation_terms import ActivationBreakdown, dropout_flags, layer_activation_bytes
from zeroplan.core.activations_megatron import megatron_activations
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.training import TrainingSetup

__all__ = [
    "ActivationBreakdown",
    "activation_memory",
    "layer_activation_bytes",
    "token_features",
    "traced_data",
    "ATTENTION_IMPLS",
]

DATA_PATH = Path(__file__).with_name("activation_data.json")
ATTENTION_IMPLS = ("sdpa", "eager", "flash")


def token_features(spec: ModelSpec, seq_len: int) -> dict[str, int]:
    """The shape terms the traced activation data is linear in, per token (one sequence).

    Shared with examples/activations/trace.py, which fits the shipped coefficients on them.
    """
    a, hd, k = spec.num_attention_heads, spec.head_dim, spec.experts_per_token
    return {
        "tok": 1,
        "s": seq_len,
        "h": spec.hidden_size,
        "q": a * hd,
        "kv": spec.num_key_value_heads * hd,
        "ffn": spec.intermediate_size,
        "a": a,
        "hd": hd,
        # rotary width (phi: partial_rotary_factor, truncated as transformers' rope init does)
        "rot": int(hd * float((spec.hf_config or {}).get("partial_rotary_factor") or 1.0)),
        "as": a * seq_len,
        "V": spec.vocab_size,
        "E": spec.num_experts,
        "kh": k * spec.hidden_size,
        "kffn": k * spec.intermediate_size,
        # MoE: the bookkeeping of each of a token's k routed rows (transformers' grouped_mm experts:
        # sizes depend on s·k only, not on where the tokens go)
        "k": k,
    }


@functools.lru_cache(maxsize=1)
def traced_data() -> dict[str, Any]:
    """The shipped trace (activation_data.json), parsed once."""
    return json.loads(DATA_PATH.read_text(encoding="utf-8"))


def _eval(coef: dict[str, float], feats: dict[str, int], seq_len: int) -> int:
    """Bytes for one sequence: Σ coefficient·feature·s + const (exact: coefficients are k/64)."""
    total = sum(coef.get(k, 0) * v for k, v in feats.items()) * seq_len + coef.get("const", 0)
    return int(round(total))


def _math_sdpa_on_cuda(spec: ModelSpec) -> bool:
    """Whether transformers' attention of ``spec`` makes SDPA take its math kernel on CUDA too, keeping the fp32
    probabilities the CPU trace kept: Falcon's multi-query layout passes one key/value head beside all the
    query heads, without ``enable_gqa`` (modeling_falcon.py ``FalconAttention.forward``), and CUDA's fused
    kernels need equal head counts (torch ``sdp_utils`` ``check_batch_size_and_num_heads_dense``). Measured on
    an H200: tests/test_gpu_transformers.py."""
    cfg = spec.hf_config or {}
    return (spec.model_type == "falcon" and not cfg.get("new_decoder_architecture", False)
            and spec.num_key_value_heads < spec.num_attention_heads)


def _traced(spec: ModelSpec, training: TrainingSetup, attention: str) -> ActivationBreakdown | None:
    """From the shipped transformers trace, or None where it does not apply (see module doc)."""
    data = traced_data()
    fam = data["families"].get(spec.model_type)
    act_bytes = training.precision.activation_bytes
    if fam is None or act_bytes not in (2, 4):
        return None
    if list(dropout_flags(spec)) != fam["dropout"]:
        return None  # traced with the catalog's dropout setting; another setting saves other masks
    impl = "eager" if attention == "eager" else "sdpa"  # flash-attention-2 keeps what SDPA keeps (q, k, v, out, lse)
    ckpt = "full" if training.checkpointing == "full" else "none"
    var = fam["variants"].get(f"{impl}/{ckpt}" + ("/fp32" if act_bytes == 4 else ""))
    if var is None:
        return None  # no exact linear form for this variant (the data's "unfitted" says why)
    scores = impl == "sdpa" and any(c.get("as") for c in var.values())
    if scores and not (attention == "sdpa" and _math_sdpa_on_cuda(spec)):
        # the CPU trace took SDPA's math kernel (scores kept: gpt2's attention dropout, falcon's
        # explicit mask); CUDA's fused kernels keep no scores, so this trace is not the GPU's
        return None
    s, b, L = training.seq_len, training.micro_batch, spec.num_layers
    feats = token_features(spec, s)
    if training.checkpointing == "selective":  # drops the attention scores: the a·s terms
        feats = dict(feats, **{"as": 0})
    m = {k: b * _eval(c, feats, s) for k, c in var.items()}
    total = L * m["layer"] + m["head"]
    logits = b * _eval({"V": var["head"].get("V", 0)}, feats, s)
    fwd = total + max(m["loss_extra"], m["fwd_layer_start_delta"] + m["fwd_layer_extra"])
    bwd = total + max(m["head_extra"], m["layer_start_delta"] + m["layer_extra"])
    src = f"transformers {data['transformers_version']} trace: {spec.model_type}, {impl} attention" + (
        ", fp32" if act_bytes == 4 else "") + (
        " (SDPA's math kernel on CUDA too: one key/value head beside all query heads, so the fp32 attention "
        "probabilities are kept; flash_attention_2 keeps none)" if scores else "")
    return ActivationBreakdown(
        per_layer=m["layer"], layers=L * m["layer"], recompute=m["layer_extra"] if ckpt == "full" else 0,
        embeddings=m["head"] - logits, logits=logits, total=total, forward_peak=max(fwd, total),
        backward_peak=max(bwd, total), source=src, backward_head_peak=total + max(m["head_extra"], 0),
        backward_layer_peak=total + m["layer_start_delta"] + m["layer_extra"],
        # with full checkpointing a layer's first backward module comes after it is recomputed (activation_memory)
        backward_layer_start=total + m["layer_start_delta"] if ckpt == "none" else None,
        forward_layer_peak=total + m["fwd_layer_start_delta"] + m["fwd_layer_extra"],
        forward_loss_peak=total + max(m["loss_extra"], 0),
        formula=f"{src}, checkpointing {training.checkpointing}: per layer, head, and the forward/backward "
                "transients as traced (core/activation_data.json)",
    )


def activation_memory(
    spec: ModelSpec,
    training: TrainingSetup,
    *,
    flavour: str = "deepspeed",
    attention: str | None = None,
) -> ActivationBreakdown:
    """Activations of one micro-batch: the transformers trace where it applies, else Korthikanti.

    ``flavour="paper"`` always uses Korthikanti's sum. ``attention`` is ``sdpa``, ``eager`` or
    ``flash``; by default ``training.flash_attention`` picks sdpa (True) or eager (False).
    """
    if attention is None:
        attention = "sdpa" if training.flash_attention else "eager"
    if flavour != "paper" and training.activation_impl == "megatron":
        return megatron_activations(spec, training)
    out = _traced(spec, training, attention) if flavour != "paper" else None
    if out is None:
        out = _paper(spec, training, flash_attention=attention != "eager")
    if training.checkpointing == "full" and out.backward_layer_start is None:
        # a layer's first backward module runs once the layer is recomputed: the checkpoints (less the logits,
        # gone with the head's backward) and what the layer saves without checkpointing
        plain = activation_memory(spec, training.model_copy(update={"checkpointing": "none"}), flavour=flavour,
                                  attention=attention)
        out = out.model_copy(update={"backward_layer_start": out.total - out.logits + plain.per_layer})
    return out


def _paper(spec: ModelSpec, training: TrainingSetup, *, flash_attention: bool) -> ActivationBreakdown:
    s, b = training.seq_len, training.micro_batch
    ab = training.precision.activation_bytes
    h, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    full_layer = layer_activation_bytes(spec, s, b, ab, flash_attention=flash_attention)
    if training.checkpointing == "full":
        per_layer = ab * s * b * h
        recompute = full_layer
        formula = "full checkpointing: 2·s·b·h per layer (layer inputs) + one layer recomputed in backward"
    elif training.checkpointing == "selective":
        per_layer = layer_activation_bytes(spec, s, b, ab, flash_attention=flash_attention, drop_scores=True)
        recompute = 0
        formula = "selective checkpointing: Korthikanti per-layer sum without the attention-score terms"
    else:
        per_layer = full_layer
        recompute = 0
        formula = (
            "Korthikanti et al. 2022 per-layer sum (34·s·b·h + 5·a·s²·b for GPT shapes), "
            + ("flash attention (no s² terms)" if flash_attention else "with attention scores")
        )
    _, hid_drop = dropout_flags(spec)
    embeddings = ab * s * b * h + (s * b * h if hid_drop else 0)
    logit_bytes = (ab + 4) if ab != 4 else 4
    logits = logit_bytes * s * b * V
    layers = per_layer * L
    total = layers + embeddings + logits
    return ActivationBreakdown(
        per_layer=per_layer,
        layers=layers,
        recompute=recompute,
        embeddings=embeddings,
        logits=logits,
        total=total,
        forward_peak=total,
        backward_peak=total + 4 * s * b * V + recompute,  # + the fp32 logits gradient, all stacked
        formula=formula,
    )
