"""Model specs: what is trained, with its exact parameter inventory.

A ModelSpec carries the architecture fields (from an HF config.json, the bundled catalog
or a bare count) and the exact parameter inventory: every parameter tensor with the
module that owns it directly, named as in the Hugging Face implementation. Everything
else (params, largest module, per-layer sizes) is derived from that inventory, so counts
are exact to the parameter. All sizes here are ELEMENT counts (parameters), never bytes.

``load_model(ref)`` accepts, decided in this order:

1. an existing path: an HF ``config.json`` or a directory containing one;
2. a catalog name (case-insensitive), e.g. ``llama-2-7b`` — the bundled catalog in
   ``zeroplan/specs/catalog/<name>.json`` ships the published config.json of each model
   and its published parameter count;
3. a count such as ``7B``, ``70e9``, ``1.3T``, ``125M``;
4. otherwise an InputError that suggests close catalog names.

Families parsed exactly (``model_type``): llama, mistral, mixtral, qwen2, gemma, gpt2,
gpt_neox, falcon, phi, phi3. Any other ``model_type`` falls back to a generic llama-like
decoder (``approximate=True``) built from hidden_size / num_hidden_layers /
num_attention_heads / intermediate_size / vocab_size (or n_embd / n_layer / n_head /
n_inner).

MoE experts are named as in the published checkpoints and transformers 4.x
(``model.layers.N.block_sparse_moe.experts.E.w1`` ...), one module per expert
projection. transformers >= 5 fuses each layer's experts into one parameter; the parameter
count is the same, the largest directly-owned module is not (a note on the spec says so).

Count specs (``70B``): ``params`` is the stated count EXACTLY (the planner multiplies it
by bytes per parameter). The spec also carries a default llama-style shape so that
activations, per-layer sizes and the largest module can be estimated: the rule is

- take the row of ``DEFAULT_SHAPES`` (known llama-style shapes, head_dim 128, vocab
  32000, gated SiLU MLP, untied embeddings, no biases) whose own parameter count is
  nearest the stated count on a log scale;
- keep its hidden size, heads and intermediate size, and pick the number of layers
  (>= 1) that brings the shape's count nearest the stated count.

The tensors of that shape do not sum to ``params`` exactly; ``approximate=True`` and the
notes say so and by how much.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, Field

from zeroplan._util import InputError, parse_count, read_text_file

__all__ = [
    "ParamTensor",
    "ModuleParams",
    "ModelSpec",
    "ROLES",
    "SUPPORTED_MODEL_TYPES",
    "DEFAULT_SHAPES",
    "load_model",
    "spec_from_config",
    "spec_from_count",
    "catalog_names",
    "catalog_entry",
]

# The fixed vocabulary of ParamTensor.role. A bias has the same role as its weight and a
# name ending in ".bias". Fused projections have their own role.
ROLES = (
    "embed",  # token embedding [vocab, hidden]
    "pos_embed",  # learned absolute positions [max_pos, hidden]
    "norm",  # LayerNorm / RMSNorm weight or bias (input, post-attention, final, q/k norms)
    "attn_q", "attn_k", "attn_v",  # separate projections
    "attn_qkv",  # fused q,k,v (GPT-2 c_attn, NeoX query_key_value, Falcon, Phi-3)
    "attn_o",  # attention output projection
    "mlp_up", "mlp_gate", "mlp_down",  # (gated) MLP
    "mlp_gate_up",  # fused gate+up (Phi-3)
    "router",  # MoE router / gate [num_experts, hidden]
    "expert_up", "expert_gate", "expert_down",  # MoE expert MLPs (ParamTensor.expert set)
    "lm_head",  # output projection [vocab, hidden] (tied_to the embedding when tied)
)


class ParamTensor(BaseModel):
    """One parameter tensor, named as in the Hugging Face implementation."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    module: str  # the module owning it directly, e.g. "model.layers.0.self_attn.q_proj"
    shape: list[int]
    role: str  # see ROLES: what the runtime does with it ("attn_q", "mlp_down", "norm", ...)
    layer: int | None = None  # transformer block index; None for embeddings / final norm / head
    expert: int | None = None  # MoE expert index within the layer
    tied_to: str | None = None  # name of the tensor it shares storage with (counted once)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ModuleParams(BaseModel):
    name: str
    params: int  # parameters owned directly (non-recursive), DeepSpeed's definition


class ModelSpec(BaseModel):
    name: str
    source: str  # "catalog:llama-2-7b", "config:/path/config.json", "count:70B"
    model_type: str  # HF model_type ("llama", "gpt2", ...) or "generic"
    approximate: bool = False  # True for counts and generic fallbacks
    notes: list[str] = Field(default_factory=list)

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    num_experts: int = 0  # 0 = dense
    experts_per_token: int = 0

    params: int  # exact total parameter count (shared tensors counted once)
    largest_module_params: int  # max over modules of directly-owned params
    largest_module_name: str
    per_layer_params: int  # one transformer block (layer 0)
    embedding_params: int  # input embedding(s) incl. positions
    active_params: int  # params touched per token (MoE: experts_per_token of num_experts)
    # Added by the models helper (catalog provenance; None outside the catalog).
    hf_repo: str | None = None
    published_params: int | None = None
    published_params_source: str | None = None
    tensors: list[ParamTensor] = Field(default_factory=list, exclude=True)
    hf_config: dict = Field(default_factory=dict, exclude=True)  # the config.json it came from

    def modules(self) -> list[ModuleParams]:
        """Directly-owned parameter counts per module, in forward order (tied counted once)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            if t.tied_to is None:
                out[t.module] = out.get(t.module, 0) + t.numel
        return [ModuleParams(name=k, params=v) for k, v in out.items()]

    def layer_params(self) -> list[int]:
        """Parameters owned by each transformer block, index = layer (elements)."""
        out = [0] * self.num_layers
        for t in self.tensors:
            if t.layer is not None and t.tied_to is None:
                out[t.layer] += t.numel
        return out

    def scaled(
        self,
        num_layers: int | None = None,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        vocab_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        num_experts: int | None = None,
    ) -> "ModelSpec":
        """The same family and module structure, smaller: edits hf_config and re-parses.

        head_dim is kept when hidden_size changes and no head count is given (heads =
        hidden_size / head_dim); an explicit ``head_dim`` key (Gemma) is kept as is.
        For count specs the default shape is scaled. The result is exact (its tensors sum
        to its params) unless this spec came from the generic fallback.
        """
        return _scale(self, num_layers, hidden_size, intermediate_size, vocab_size,
                      num_attention_heads, num_key_value_heads, num_experts)


# --------------------------------------------------------------------------- helpers

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


class _Cfg:
    """Typed reads from a config.json dict; errors name the file and the key."""

    def __init__(self, cfg: dict, where: str):
        self.cfg = cfg
        self.where = where

    def has(self, *keys: str) -> bool:
        return any(self.cfg.get(k) is not None for k in keys)

    def int(self, *keys: str, default: Any = ..., positive: bool = True) -> int:
        for k in keys:
            v = self.cfg.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                isinstance(v, float) and (not math.isfinite(v) or v != int(v))
            ):
                raise InputError(f"{self.where}: key {k!r} = {v!r}, expected an integer")
            v = int(v)
            if positive and v <= 0:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected a positive integer")
            limit = _MAX_LAYERS if k in _LAYER_KEYS else _MAX_DIM
            if v > limit:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected at most {limit:,} (a real model size)")
            if not positive and v < 0:
                raise InputError(f"{self.where}: key {k!r} = {v}, expected a non-negative integer")
            return v
        if default is ...:
            raise InputError(f"{self.where}: missing required key {keys[0]!r}"
                             + (f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""))
        return default

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise InputError(f"{self.where}: key {key!r} = {v!r}, expected true or false")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InputError(f"{self.where}: key {key!r} = {v!r}, expected a positive number")
        return float(v)


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


# --------------------------------------------------------------------------- families
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

# Key names that hold each scalable field, per family (first = the one written when absent).
_SCALE_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"num_layers": ("n_layer", "num_hidden_layers"), "hidden_size": ("n_embd", "hidden_size"),
             "intermediate_size": ("n_inner",), "num_attention_heads": ("n_head", "num_attention_heads")},
    "falcon": {"num_layers": ("num_hidden_layers", "n_layer"),
               "num_attention_heads": ("num_attention_heads", "n_head"),
               "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
               "intermediate_size": ("ffn_hidden_size",)},
}
_DEFAULT_SCALE_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads",),
    "num_experts": ("num_local_experts",),
}


# --------------------------------------------------------------------------- assembly

def _build(name: str, source: str, model_type: str, fields: dict, T: list[_T], notes: list[str],
           cfg: dict, approximate: bool = False, params: int | None = None) -> ModelSpec:
    tensors = [ParamTensor.model_construct(name=t[0], module=t[1], shape=t[2], role=t[3], layer=t[4],
                                           expert=t[5], tied_to=t[6]) for t in T]
    total = 0
    per_module: dict[str, int] = {}
    layer0 = emb = expert_total = 0
    for t in T:
        if t[6] is not None:
            continue
        n = 1
        for d in t[2]:
            n *= d
        total += n
        per_module[t[1]] = per_module.get(t[1], 0) + n
        if t[4] == 0:
            layer0 += n
        if t[3] in ("embed", "pos_embed"):
            emb += n
        if t[5] is not None:
            expert_total += n
    big_name, big = "", 0
    for m, n in per_module.items():
        if n > big:
            big_name, big = m, n
    E, k = fields.get("num_experts", 0), fields.get("experts_per_token", 0)
    active = total - expert_total + (expert_total // E) * k if E else total
    if params is None:
        params = total
    elif params != total:
        active = params
    return ModelSpec.model_construct(
        name=name, source=source, model_type=model_type, approximate=approximate, notes=list(notes),
        **{"max_position_embeddings": None, "tie_word_embeddings": False, "gated_mlp": True,
           "num_experts": 0, "experts_per_token": 0, **fields},
        params=params, largest_module_params=big, largest_module_name=big_name,
        per_layer_params=layer0, embedding_params=emb, active_params=active,
        hf_repo=None, published_params=None, published_params_source=None,
        tensors=tensors, hf_config=cfg,
    )


def spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """Parse an HF config.json dict into an exact ModelSpec (generic fallback if unknown)."""
    where = source.split(":", 1)[1] if source.startswith("config:") else source
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: expected a JSON object (an HF config.json), got {type(cfg).__name__}")
    c = _Cfg(cfg, where)
    mt = cfg.get("model_type")
    parser = _FAMILIES.get(mt) if isinstance(mt, str) else None
    if parser is not None:
        fields, T, notes = parser(c, mt)
        return _build(name, source, mt, fields, T, notes, cfg)
    return _generic(c, name, source, mt)


def _generic(c: _Cfg, name: str, source: str, mt: Any) -> ModelSpec:
    cfg = c.cfg
    groups = {"hidden size": ("hidden_size", "n_embd", "d_model"),
              "layers": ("num_hidden_layers", "n_layer", "num_layers"),
              "heads": ("num_attention_heads", "n_head", "num_heads"),
              "vocab": ("vocab_size",)}
    missing = [keys[0] for keys in groups.values() if not c.has(*keys)]
    if missing:
        raise InputError(
            f"{c.where}: model_type {mt!r} is not one zeroplan parses exactly "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}) and the generic decoder fallback "
            f"needs the missing key(s) {', '.join(missing)}")
    H = c.int(*groups["hidden size"])
    norm = {
        "model_type": "llama",
        "hidden_size": H,
        "num_hidden_layers": c.int(*groups["layers"]),
        "num_attention_heads": c.int(*groups["heads"]),
        "num_key_value_heads": c.int("num_key_value_heads", "num_kv_heads", default=None),
        "intermediate_size": c.int("intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * H),
        "vocab_size": c.int("vocab_size"),
        "head_dim": c.int("head_dim", default=None),
        "max_position_embeddings": c.int("max_position_embeddings", "n_positions", default=None),
        "tie_word_embeddings": c.bool("tie_word_embeddings", False),
    }
    norm = {k: v for k, v in norm.items() if v is not None}
    fields, T, notes = _llama_like(_Cfg(norm, c.where), "llama")
    notes = [f"model_type {mt!r} is not parsed exactly (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
             "counted as a generic llama-like decoder (gated MLP, RMSNorm, no biases) from its "
             "hidden size, layers, heads, intermediate size and vocab — approximate"] + notes
    if not c.has("intermediate_size", "n_inner", "ffn_dim", "d_ff"):
        notes.append(f"no intermediate size given: assumed 4 x hidden = {4 * H}")
    spec = _build(name, source, "generic", fields, T, notes, dict(cfg), approximate=True)
    spec.hf_config = dict(cfg)
    return spec


# --------------------------------------------------------------------------- counts

# (hidden, heads, kv_heads, intermediate, layers) of known llama-style shapes, head_dim 128.
DEFAULT_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (256, 2, 2, 704, 4),
    (512, 4, 4, 1408, 8),
    (1024, 8, 8, 2816, 16),
    (2048, 16, 16, 5632, 24),
    (2560, 20, 20, 6912, 32),
    (4096, 32, 32, 11008, 32),  # Llama-2-7B
    (5120, 40, 40, 13824, 40),  # Llama-2-13B
    (6656, 52, 52, 17920, 60),  # LLaMA-33B
    (8192, 64, 8, 28672, 80),  # Llama-2-70B
    (16384, 128, 8, 53248, 126),  # Llama-3.1-405B shape
)
_COUNT_VOCAB = 32000


def _shape_params(h: int, nh: int, kv: int, i: int, layers: int) -> int:
    hd = h // nh
    per_layer = 2 * h * h + 2 * h * kv * hd + 3 * h * i + 2 * h
    return layers * per_layer + 2 * _COUNT_VOCAB * h + h


def _shape_config(h: int, nh: int, kv: int, i: int, layers: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
            "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": kv,
            "intermediate_size": i, "vocab_size": _COUNT_VOCAB, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "hidden_act": "silu"}


def spec_from_count(text: str) -> ModelSpec:
    """A bare parameter count: params exact, shape a stated llama-style default."""
    n = parse_count(text, what="model size")
    best = min(DEFAULT_SHAPES, key=lambda s: abs(math.log(_shape_params(*s) / n)))
    h, nh, kv, i, _ = best
    per_layer = _shape_params(h, nh, kv, i, 1) - _shape_params(h, nh, kv, i, 0)
    layers = max(1, round((n - _shape_params(h, nh, kv, i, 0)) / per_layer))
    cfg = _shape_config(h, nh, kv, i, layers)
    fields, T, _ = _llama_like(_Cfg(cfg, f"count {text}"), "llama")
    shape_total = _shape_params(h, nh, kv, i, layers)
    notes = [
        f"a bare count: params = {n:,} exactly as stated; everything else comes from a default "
        f"llama-style shape (hidden {h}, {layers} layers, {nh} heads / {kv} kv heads of 128, "
        f"gated MLP {i}, vocab {_COUNT_VOCAB}, untied) chosen as the nearest known llama shape "
        f"with the layer count fitted to the stated size",
        f"that shape has {shape_total:,} parameters ({(shape_total - n) / n:+.1%} vs the stated "
        f"count): per-layer, embedding and largest-module figures are estimates",
    ]
    spec = _build(text.strip(), f"count:{text.strip()}", "llama", fields, T, notes, cfg,
                  approximate=True, params=n)
    return spec


# --------------------------------------------------------------------------- catalog

_CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


@functools.lru_cache(maxsize=1)
def _catalog_files() -> dict[str, Path]:
    return {p.stem.lower(): p for p in sorted(_CATALOG_DIR.glob("*.json"))}


def catalog_names() -> list[str]:
    """Names of the bundled catalog models, sorted."""
    return list(_catalog_files())


@functools.lru_cache(maxsize=None)
def _catalog_entry_cached(key: str) -> dict:
    path = _catalog_files()[key]
    entry = _parse_json(path)
    for k in ("name", "hf_repo", "published_params", "published_params_source", "config"):
        if k not in entry:
            raise InputError(f"{path}: catalog entry lacks key {k!r}")
    return entry


def catalog_entry(name: str) -> dict:
    """The raw catalog entry {name, hf_repo, published_params, published_params_source, config}."""
    key = name.strip().lower()
    if key not in _catalog_files():
        raise _unknown(name)
    return copy.deepcopy(_catalog_entry_cached(key))


@functools.lru_cache(maxsize=None)
def _catalog_spec_cached(key: str) -> ModelSpec:
    entry = _catalog_entry_cached(key)
    spec = spec_from_config(copy.deepcopy(entry["config"]), entry["name"], f"catalog:{entry['name']}")
    spec.hf_repo = entry["hf_repo"]
    spec.published_params = entry["published_params"]
    spec.published_params_source = entry["published_params_source"]
    return spec


def _fresh(spec: ModelSpec) -> ModelSpec:
    """A copy safe to mutate at the top level (tensors themselves are shared, treat as read-only)."""
    return spec.model_copy(update={"notes": list(spec.notes), "tensors": list(spec.tensors),
                                   "hf_config": copy.deepcopy(spec.hf_config)})


def _unknown(ref: str) -> InputError:
    names = catalog_names()
    close = difflib.get_close_matches(ref.strip().lower(), names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return InputError(
        f"model {ref!r} is not a file, a catalog name or a count such as 7B / 70e9{hint} "
        f"(catalog: {', '.join(names)})")


# --------------------------------------------------------------------------- files

# sanity bounds on config.json sizes: far beyond any real model, small enough to stay fast
_MAX_DIM = 10**8  # hidden / intermediate / vocab / positions / heads / experts
_MAX_LAYERS = 100_000
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers"}


def _parse_json(path: Path) -> Any:
    text = read_text_file(path, "model config")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InputError(f"{path}: invalid JSON: nested too deeply for a config.json") from None


def _load_path(p: Path) -> ModelSpec:
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InputError(f"{p}: directory has no config.json")
        p = p / "config.json"
    cfg = _parse_json(p)
    if not isinstance(cfg, dict):
        raise InputError(f"{p}: expected a JSON object (an HF config.json), got {type(cfg).__name__}")
    name = cfg.get("_name_or_path") if isinstance(cfg.get("_name_or_path"), str) and cfg.get("_name_or_path") else None
    return spec_from_config(cfg, name or (p.parent.name if p.name == "config.json" else p.stem), f"config:{p}")


# --------------------------------------------------------------------------- Hugging Face Hub ids

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@functools.lru_cache(maxsize=1)
def _hub_index() -> dict[str, str]:
    """Lower-case Hub id (``hf_repo`` and ``hf_aliases`` of each catalog entry) -> catalog key."""
    out: dict[str, str] = {}
    for key in _catalog_files():
        entry = _catalog_entry_cached(key)
        for repo in [entry["hf_repo"], *entry.get("hf_aliases", [])]:
            out[str(repo).lower()] = key
    return out


def _hub_catalog_key(ref_lower: str) -> str | None:
    return _hub_index().get(ref_lower)


def hf_hub_cache_dir() -> Path:
    """The Hugging Face Hub cache, resolved as huggingface_hub.constants does: HF_HUB_CACHE
    (or the older HUGGINGFACE_HUB_CACHE), else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hf_cache_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local Hub cache, or None. Never touches the network.

    Layout (huggingface_hub file_download): ``models--ORG--NAME/refs/main`` holds the commit
    hash of ``snapshots/<hash>/``; without a usable ref, the newest snapshot holding a config.json.
    """
    repo_dir = hf_hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    try:
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
    except (OSError, UnicodeDecodeError):
        commit = ""
    if commit and "/" not in commit and commit not in (".", ".."):
        cfg = snapshots / commit / "config.json"
        if cfg.is_file():
            return cfg
    found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    if not found:
        return None
    return max(found, key=lambda c: c.stat().st_mtime)


def load_model(ref: str) -> ModelSpec:
    """Catalog name, path to an HF config.json (or its directory), a Hugging Face Hub id (the catalog
    entry whose ``hf_repo``/``hf_aliases`` match, else the config.json in the local Hub cache), or a
    count such as 7B / 70e9 / 1.3T. Never uses the network.

    Catalog specs are parsed once per process and cached; each call returns a copy whose
    lists/dicts may be mutated, but whose ParamTensor objects are shared (treat as read-only).
    """
    if not isinstance(ref, str) or not ref.strip():
        raise InputError("model: empty reference, expected a catalog name, a config.json path or a count such as 7B")
    p = Path(ref).expanduser()
    if p.exists():
        return _load_path(p)
    key = ref.strip().lower()
    if key in _catalog_files():
        return _fresh(_catalog_spec_cached(key))
    hub = _hub_catalog_key(key)
    if hub is not None:
        return _fresh(_catalog_spec_cached(hub))
    if _HUB_ID.match(ref.strip()):
        cached = hf_cache_config(ref.strip())
        if cached is not None:
            spec = _load_path(cached)
            spec.hf_repo = ref.strip()
            spec.name = ref.strip()  # the Hub id, not the snapshot hash or the uploader's _name_or_path
            return spec
    try:
        parse_count(ref)
    except InputError:
        if _HUB_ID.match(ref.strip()) and not ref.strip().lower().endswith(".json"):
            raise InputError(
                f"model {ref!r}: not a file, not a Hub id in the catalog, and not in the local Hugging Face "
                f"cache ({hf_hub_cache_dir()}); zeroplan never downloads: pass the path to its config.json "
                "(or `huggingface-cli download " + ref.strip() + " config.json` first)") from None
        if ref.strip().lower().endswith(".json") or "/" in ref:
            raise InputError(f"{ref}: model config not found") from None
        if re.match(r"^\s*[-+]?[0-9.]+(?:[eE][+-]?[0-9]+)?\s*[KMBGTkmbgt]?\s*$", ref):
            raise  # a number that is out of range: parse_count says why
        raise _unknown(ref) from None
    return spec_from_count(ref)


# --------------------------------------------------------------------------- scaling

def _scale(spec: ModelSpec, num_layers, hidden_size, intermediate_size, vocab_size,
           num_attention_heads, num_key_value_heads, num_experts) -> ModelSpec:
    req = {"num_layers": num_layers, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
           "vocab_size": vocab_size, "num_attention_heads": num_attention_heads,
           "num_key_value_heads": num_key_value_heads, "num_experts": num_experts}
    for k, v in req.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise InputError(f"scaled(): {k} = {v!r}, expected a positive integer")
    if num_experts is not None and not spec.num_experts:
        raise InputError(f"scaled(): num_experts given but {spec.name} is a dense model")
    cfg = copy.deepcopy(spec.hf_config)
    if not cfg:
        raise InputError(f"scaled(): {spec.name} has no config to scale")
    mt = cfg.get("model_type") if spec.model_type != "generic" else "__generic__"
    keys = {**_DEFAULT_SCALE_KEYS, **_SCALE_KEYS.get(mt, {})}

    def put(field: str, value: int) -> None:
        names = keys[field]
        for k in names:
            if k in cfg and cfg[k] is not None:
                cfg[k] = value
                return
        cfg[names[0]] = value

    heads = num_attention_heads
    explicit_hd = "head_dim" in cfg and cfg["head_dim"] is not None
    extra_notes: list[str] = []
    if hidden_size is not None and heads is None:
        if explicit_hd:  # head_dim is a config key (Gemma): scale the head count with the width
            heads = max(1, round(spec.num_attention_heads * hidden_size / spec.hidden_size))
        elif hidden_size % spec.head_dim == 0:
            heads = hidden_size // spec.head_dim
        else:  # nearest head count that divides the new width
            want = hidden_size / spec.head_dim
            heads = min((d for d in range(1, hidden_size + 1) if hidden_size % d == 0),
                        key=lambda d: (abs(d - want), d))
            extra_notes.append(f"hidden_size {hidden_size} is not a multiple of head_dim {spec.head_dim}: "
                               f"{heads} heads of {hidden_size // heads}")
    if heads is not None:
        put("num_attention_heads", heads)
        if num_key_value_heads is None:
            kv = min(spec.num_key_value_heads, heads)
            while heads % kv:
                kv -= 1
            num_key_value_heads = kv
    for field, value in (("num_layers", num_layers), ("hidden_size", hidden_size),
                         ("intermediate_size", intermediate_size), ("vocab_size", vocab_size),
                         ("num_experts", num_experts)):
        if value is not None:
            put(field, value)
    if num_key_value_heads is not None and not (mt == "falcon" and not cfg.get("new_decoder_architecture")
                                                and cfg.get("multi_query", True)):
        if mt in ("gpt2", "gpt_neox"):
            if num_key_value_heads != (heads or spec.num_attention_heads):
                raise InputError(f"scaled(): {mt} has no grouped-query attention; "
                                 f"num_key_value_heads must equal num_attention_heads")
        else:
            put("num_key_value_heads", num_key_value_heads)
    if num_experts is not None:
        k = cfg.get("num_experts_per_tok", 2)
        if isinstance(k, int) and k > num_experts:
            cfg["num_experts_per_tok"] = num_experts
    name = f"{spec.name} (scaled)"
    out = spec_from_config(cfg, name, f"scaled:{spec.source}")
    if spec.source.startswith("count:"):
        out.approximate = False
        out.notes = [f"scaled from the default llama-style shape of the count spec {spec.name!r}; "
                     "this small shape is exact"]
    out.notes.extend(extra_notes)
    return out
