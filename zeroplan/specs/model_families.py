"""The model families zeroplan parses exactly, one parser per HF ``model_type``.

Families parsed exactly (``model_type``): llama, mistral, mixtral, qwen2, gemma, gpt2,
gpt_neox, falcon, phi, phi3 (``SUPPORTED_MODEL_TYPES``). Each parser reads a config.json
(through ``_Cfg``) and returns ``(fields, tensors, notes)``: the ModelSpec architecture fields,
every parameter tensor as a tuple ``(name, module, shape, role, layer, expert, tied_to)`` named as
in the Hugging Face implementation, in forward order, and notes. ``_lin`` / ``_conv1d`` / ``_norm``
yield the tensors of one module.

MoE experts are named as in the published checkpoints and transformers 4.x
(``model.layers.N.block_sparse_moe.experts.E.w1`` ...), one module per expert
projection. transformers >= 5 fuses each layer's experts into one parameter; the parameter
count is the same, the largest directly-owned module is not (a note on the spec says so).
"""

from __future__ import annotations

from typing import Callable, Iterator

from zeroplan._util import InputError
from zeroplan.specs.model_hf_config import _Cfg

__all__ = ["SUPPORTED_MODEL_TYPES"]

_T = tuple  # (name, module, shape, role, layer, expert, tied_to)


def _lin(prefix: str, out_f: int, in_f: int, role: str, layer: int | None, bias: bool,
         expert: int | None = None) -> Iterator[_T]:
    """nn.Linear: weight [out, in] (+ bias [out])."""
    yield (f"{prefix}.weight", prefix, [out_f, in_f], role, layer, expert, None)
    if bias:
        yield (f"{prefix}.bias", prefix, [out_f], role, layer, expert, None)


def _conv1d(prefix: str, in_f: int, out_f: int, role: str, layer: int) -> Iterator[_T]:
    """GPT-2 Conv1D: weight [in, out], bias [out]."""
    yield (f"{prefix}.weight", prefix, [in_f, out_f], role, layer, None, None)
    yield (f"{prefix}.bias", prefix, [out_f], role, layer, None, None)


def _norm(prefix: str, size: int, layer: int | None, bias: bool) -> Iterator[_T]:
    yield (f"{prefix}.weight", prefix, [size], "norm", layer, None, None)
    if bias:
        yield (f"{prefix}.bias", prefix, [size], "norm", layer, None, None)


def _heads(c: _Cfg, hidden: int, heads: int, kv: int, head_dim: int | None) -> int:
    """Validate head counts; return head_dim."""
    if head_dim is None:
        if hidden % heads:
            raise InputError(f"{c.where}: hidden size {hidden} is not divisible by "
                             f"num_attention_heads {heads}")
        head_dim = hidden // heads
    if heads % kv:
        raise InputError(f"{c.where}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    return head_dim


# Each family parser returns (fields, tensors, notes). fields: the ModelSpec architecture
# fields; tensors: tuples as yielded above, in forward order.

def _llama_like(c: _Cfg, mt: str) -> tuple[dict, list[_T], list[str]]:
    """llama, mistral, mixtral, qwen2, gemma, phi3 (and the generic fallback)."""
    H = c.int("hidden_size")
    L = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", default=nh)
    I = c.int("intermediate_size")
    V = c.int("vocab_size")
    explicit_hd = c.int("head_dim", default=256 if mt == "gemma" else None)
    hd = _heads(c, H, nh, kv, explicit_hd)
    tie = c.bool("tie_word_embeddings", mt == "gemma")
    attn_bias = c.bool("attention_bias", False) if mt in ("llama", "gemma") else False
    mlp_bias = c.bool("mlp_bias", False) if mt == "llama" else False
    qkv_bias = mt == "qwen2"  # Qwen2: q/k/v biases, no o bias
    E = k = 0
    if mt == "mixtral":
        E = c.int("num_local_experts", default=8)
        k = c.int("num_experts_per_tok", default=2)
        if k > E:
            raise InputError(f"{c.where}: num_experts_per_tok {k} exceeds num_local_experts {E}")
    T: list[_T] = []
    T.append(("model.embed_tokens.weight", "model.embed_tokens", [V, H], "embed", None, None, None))
    for i in range(L):
        p = f"model.layers.{i}"
        T.extend(_norm(f"{p}.input_layernorm", H, i, False))
        if mt == "phi3":
            T.extend(_lin(f"{p}.self_attn.qkv_proj", nh * hd + 2 * kv * hd, H, "attn_qkv", i, attn_bias))
        else:
            T.extend(_lin(f"{p}.self_attn.q_proj", nh * hd, H, "attn_q", i, attn_bias or qkv_bias))
            T.extend(_lin(f"{p}.self_attn.k_proj", kv * hd, H, "attn_k", i, attn_bias or qkv_bias))
            T.extend(_lin(f"{p}.self_attn.v_proj", kv * hd, H, "attn_v", i, attn_bias or qkv_bias))
        T.extend(_lin(f"{p}.self_attn.o_proj", H, nh * hd, "attn_o", i, attn_bias))
        T.extend(_norm(f"{p}.post_attention_layernorm", H, i, False))
        if mt == "mixtral":
            m = f"{p}.block_sparse_moe"
            T.extend(_lin(f"{m}.gate", E, H, "router", i, False))
            for e in range(E):
                T.extend(_lin(f"{m}.experts.{e}.w1", I, H, "expert_gate", i, False, e))
                T.extend(_lin(f"{m}.experts.{e}.w2", H, I, "expert_down", i, False, e))
                T.extend(_lin(f"{m}.experts.{e}.w3", I, H, "expert_up", i, False, e))
        elif mt == "phi3":
            T.extend(_lin(f"{p}.mlp.gate_up_proj", 2 * I, H, "mlp_gate_up", i, False))
            T.extend(_lin(f"{p}.mlp.down_proj", H, I, "mlp_down", i, False))
        else:
            T.extend(_lin(f"{p}.mlp.gate_proj", I, H, "mlp_gate", i, mlp_bias))
            T.extend(_lin(f"{p}.mlp.up_proj", I, H, "mlp_up", i, mlp_bias))
            T.extend(_lin(f"{p}.mlp.down_proj", H, I, "mlp_down", i, mlp_bias))
    T.extend(_norm("model.norm", H, None, False))
    T.append(("lm_head.weight", "lm_head", [V, H], "lm_head", None, None,
              "model.embed_tokens.weight" if tie else None))
    notes: list[str] = []
    if mt == "mixtral":
        fused = 2 * E * I * H
        notes.append(
            f"experts named as in the checkpoint / transformers 4.x (one module per expert "
            f"projection); transformers >= 5 fuses a layer's experts into mlp.experts.gate_up_proj "
            f"[{E}, {2 * I}, {H}] = {fused:,} params in one module")
    fields = dict(hidden_size=H, num_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                  head_dim=hd, intermediate_size=I, vocab_size=V,
                  max_position_embeddings=c.int("max_position_embeddings", default=None),
                  tie_word_embeddings=tie, gated_mlp=True, num_experts=E, experts_per_token=k)
    return fields, T, notes


def _gpt2(c: _Cfg, mt: str) -> tuple[dict, list[_T], list[str]]:
    H = c.int("n_embd", "hidden_size")
    L = c.int("n_layer", "num_hidden_layers")
    nh = c.int("n_head", "num_attention_heads")
    V = c.int("vocab_size")
    P = c.int("n_positions", "max_position_embeddings", default=1024)
    I = c.int("n_inner", default=4 * H)
    hd = _heads(c, H, nh, nh, None)
    tie = c.bool("tie_word_embeddings", True)
    T: list[_T] = [
        ("transformer.wte.weight", "transformer.wte", [V, H], "embed", None, None, None),
        ("transformer.wpe.weight", "transformer.wpe", [P, H], "pos_embed", None, None, None),
    ]
    for i in range(L):
        p = f"transformer.h.{i}"
        T.extend(_norm(f"{p}.ln_1", H, i, True))
        T.extend(_conv1d(f"{p}.attn.c_attn", H, 3 * H, "attn_qkv", i))
        T.extend(_conv1d(f"{p}.attn.c_proj", H, H, "attn_o", i))
        T.extend(_norm(f"{p}.ln_2", H, i, True))
        T.extend(_conv1d(f"{p}.mlp.c_fc", H, I, "mlp_up", i))
        T.extend(_conv1d(f"{p}.mlp.c_proj", I, H, "mlp_down", i))
    T.extend(_norm("transformer.ln_f", H, None, True))
    T.append(("lm_head.weight", "lm_head", [V, H], "lm_head", None, None,
              "transformer.wte.weight" if tie else None))
    fields = dict(hidden_size=H, num_layers=L, num_attention_heads=nh, num_key_value_heads=nh,
                  head_dim=hd, intermediate_size=I, vocab_size=V, max_position_embeddings=P,
                  tie_word_embeddings=tie, gated_mlp=False)
    return fields, T, []


def _gpt_neox(c: _Cfg, mt: str) -> tuple[dict, list[_T], list[str]]:
    H = c.int("hidden_size")
    L = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    I = c.int("intermediate_size", default=4 * H)
    V = c.int("vocab_size")
    hd = _heads(c, H, nh, nh, None)
    tie = c.bool("tie_word_embeddings", False)
    bias = c.bool("attention_bias", True)
    T: list[_T] = [("gpt_neox.embed_in.weight", "gpt_neox.embed_in", [V, H], "embed", None, None, None)]
    for i in range(L):
        p = f"gpt_neox.layers.{i}"
        T.extend(_norm(f"{p}.input_layernorm", H, i, True))
        T.extend(_norm(f"{p}.post_attention_layernorm", H, i, True))
        T.extend(_lin(f"{p}.attention.query_key_value", 3 * H, H, "attn_qkv", i, bias))
        T.extend(_lin(f"{p}.attention.dense", H, H, "attn_o", i, bias))
        T.extend(_lin(f"{p}.mlp.dense_h_to_4h", I, H, "mlp_up", i, True))
        T.extend(_lin(f"{p}.mlp.dense_4h_to_h", H, I, "mlp_down", i, True))
    T.extend(_norm("gpt_neox.final_layer_norm", H, None, True))
    T.append(("embed_out.weight", "embed_out", [V, H], "lm_head", None, None,
              "gpt_neox.embed_in.weight" if tie else None))
    notes = []
    if c.bool("use_parallel_residual", True):
        notes.append("parallel residual (attention and MLP read the same input); rotary embeddings have no parameters")
    fields = dict(hidden_size=H, num_layers=L, num_attention_heads=nh, num_key_value_heads=nh,
                  head_dim=hd, intermediate_size=I, vocab_size=V,
                  max_position_embeddings=c.int("max_position_embeddings", default=None),
                  tie_word_embeddings=tie, gated_mlp=False)
    return fields, T, notes


def _falcon(c: _Cfg, mt: str) -> tuple[dict, list[_T], list[str]]:
    H = c.int("hidden_size")
    L = c.int("num_hidden_layers", "n_layer")
    nh = c.int("num_attention_heads", "n_head")
    V = c.int("vocab_size")
    I = c.int("ffn_hidden_size", default=4 * H)
    new_arch = c.bool("new_decoder_architecture", False)
    multi_query = c.bool("multi_query", True)
    parallel = c.bool("parallel_attn", True)
    bias = c.bool("bias", False)
    tie = c.bool("tie_word_embeddings", True)
    kv_cfg = c.int("num_kv_heads", "n_head_kv", default=nh)
    kv = kv_cfg if (new_arch or not multi_query) else 1
    hd = _heads(c, H, nh, kv, None)
    if new_arch:
        qkv_out = (2 * kv + nh) * hd
    elif multi_query:
        qkv_out = H + 2 * hd
    else:
        qkv_out = 3 * H
    n_ln = c.int("num_ln_in_parallel_attn", default=2 if new_arch else None)
    T: list[_T] = [("transformer.word_embeddings.weight", "transformer.word_embeddings", [V, H],
                    "embed", None, None, None)]
    for i in range(L):
        p = f"transformer.h.{i}"
        if not parallel:
            T.extend(_norm(f"{p}.input_layernorm", H, i, True))
        elif n_ln == 2:
            T.extend(_norm(f"{p}.ln_attn", H, i, True))
            T.extend(_norm(f"{p}.ln_mlp", H, i, True))
        else:
            T.extend(_norm(f"{p}.input_layernorm", H, i, True))
        T.extend(_lin(f"{p}.self_attention.query_key_value", qkv_out, H, "attn_qkv", i, bias))
        T.extend(_lin(f"{p}.self_attention.dense", H, H, "attn_o", i, bias))
        if not parallel:
            T.extend(_norm(f"{p}.post_attention_layernorm", H, i, True))
        T.extend(_lin(f"{p}.mlp.dense_h_to_4h", I, H, "mlp_up", i, bias))
        T.extend(_lin(f"{p}.mlp.dense_4h_to_h", H, I, "mlp_down", i, bias))
    T.extend(_norm("transformer.ln_f", H, None, True))
    T.append(("lm_head.weight", "lm_head", [V, H], "lm_head", None, None,
              "transformer.word_embeddings.weight" if tie else None))
    notes = []
    if not new_arch and multi_query:
        notes.append("multi-query attention: one shared key/value head, fused query_key_value "
                     "of hidden + 2*head_dim outputs")
    fields = dict(hidden_size=H, num_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                  head_dim=hd, intermediate_size=I, vocab_size=V,
                  max_position_embeddings=c.int("max_position_embeddings", default=None),
                  tie_word_embeddings=tie, gated_mlp=False)
    return fields, T, notes


def _phi(c: _Cfg, mt: str) -> tuple[dict, list[_T], list[str]]:
    H = c.int("hidden_size")
    L = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", default=nh)
    I = c.int("intermediate_size")
    V = c.int("vocab_size")
    hd = _heads(c, H, nh, kv, None)
    tie = c.bool("tie_word_embeddings", False)
    qk_ln = c.bool("qk_layernorm", False)
    T: list[_T] = [("model.embed_tokens.weight", "model.embed_tokens", [V, H], "embed", None, None, None)]
    for i in range(L):
        p = f"model.layers.{i}"
        T.extend(_norm(f"{p}.input_layernorm", H, i, True))
        T.extend(_lin(f"{p}.self_attn.q_proj", nh * hd, H, "attn_q", i, True))
        T.extend(_lin(f"{p}.self_attn.k_proj", kv * hd, H, "attn_k", i, True))
        T.extend(_lin(f"{p}.self_attn.v_proj", kv * hd, H, "attn_v", i, True))
        if qk_ln:
            T.extend(_norm(f"{p}.self_attn.q_layernorm", H // nh, i, True))
            T.extend(_norm(f"{p}.self_attn.k_layernorm", H // nh, i, True))
        T.extend(_lin(f"{p}.self_attn.dense", H, nh * hd, "attn_o", i, True))
        T.extend(_lin(f"{p}.mlp.fc1", I, H, "mlp_up", i, True))
        T.extend(_lin(f"{p}.mlp.fc2", H, I, "mlp_down", i, True))
    T.extend(_norm("model.final_layernorm", H, None, True))
    if tie:
        T.append(("lm_head.weight", "lm_head", [V, H], "lm_head", None, None, "model.embed_tokens.weight"))
        T.append(("lm_head.bias", "lm_head", [V], "lm_head", None, None, None))
    else:
        T.extend(_lin("lm_head", V, H, "lm_head", None, True))
    notes = [f"parallel attention/MLP block, partial rotary "
             f"(factor {c.float('partial_rotary_factor', 0.5)}, no parameters), lm_head with bias"]
    fields = dict(hidden_size=H, num_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                  head_dim=hd, intermediate_size=I, vocab_size=V,
                  max_position_embeddings=c.int("max_position_embeddings", default=None),
                  tie_word_embeddings=tie, gated_mlp=False)
    return fields, T, notes


_FAMILIES: dict[str, Callable[[_Cfg, str], tuple[dict, list[_T], list[str]]]] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "mixtral": _llama_like,
    "qwen2": _llama_like,
    "gemma": _llama_like,
    "phi3": _llama_like,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "phi": _phi,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
