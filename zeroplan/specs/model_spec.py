"""Model specs: what is trained, with its exact parameter inventory.

A ModelSpec carries the architecture fields (from an HF config.json, the bundled catalog
or a bare count) and the exact parameter inventory: every parameter tensor with the
module that owns it directly, named as in the Hugging Face implementation. Everything
else (params, largest module, per-layer sizes) is derived from that inventory, so counts
are exact to the parameter. All sizes here are ELEMENT counts (parameters), never bytes.

This module holds the spec's models and how one is assembled: ``spec_from_config`` hands a
config.json dict to its family's parser (model_families.py) or to the generic llama-like
fallback, and ``_build`` counts the inventory into the spec's totals. ``ModelSpec.scaled``
re-parses a config edited by model_scale.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan._util import InputError
from zeroplan.specs.model_families import _FAMILIES, SUPPORTED_MODEL_TYPES, _llama_like, _T
from zeroplan.specs.model_hf_config import _Cfg
from zeroplan.specs.model_scale import _scaled_config

__all__ = ["ParamTensor", "ModuleParams", "ModelSpec", "ROLES", "spec_from_config"]

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

    model_config = ConfigDict(defer_build=True)

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
    model_config = ConfigDict(defer_build=True)

    name: str
    params: int  # parameters owned directly (non-recursive), DeepSpeed's definition


class ModelSpec(BaseModel):
    model_config = ConfigDict(defer_build=True)

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
    # the module tree DeepSpeed's ZeRO-3 hooks see (core/moe_leaf.py): "transformers", the HF implementation
    # (transformers 5 fuses an MoE layer's experts into one module), or "checkpoint", one module per module of
    # the checkpoint's names (the bundled runtime's model: runtime/model.py)
    module_tree: Literal["transformers", "checkpoint"] = Field(default="transformers", exclude=True)

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


def _scale(spec: ModelSpec, num_layers, hidden_size, intermediate_size, vocab_size,
           num_attention_heads, num_key_value_heads, num_experts) -> ModelSpec:
    cfg, extra_notes = _scaled_config(spec, num_layers, hidden_size, intermediate_size, vocab_size,
                                      num_attention_heads, num_key_value_heads, num_experts)
    name = f"{spec.name} (scaled)"
    out = spec_from_config(cfg, name, f"scaled:{spec.source}")
    if spec.source.startswith("count:"):
        out.approximate = False
        out.notes = [f"scaled from the default llama-style shape of the count spec {spec.name!r}; "
                     "this small shape is exact"]
    out.notes.extend(extra_notes)
    out.module_tree = spec.module_tree
    return out
