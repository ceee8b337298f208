"""Model specs: what is trained. CONTRACT STUB — the models helper fills in the parsing.

A ModelSpec carries the architecture fields (from an HF config.json, the bundled catalog
or a bare count) and the exact parameter inventory: every parameter tensor with the
module that owns it directly. Everything else (params, largest module, per-layer sizes)
is derived from that inventory, so counts are exact to the parameter.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["ParamTensor", "ModuleParams", "ModelSpec", "ROLES", "load_model"]

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
    tensors: list[ParamTensor] = Field(default_factory=list, exclude=True)
    hf_config: dict = Field(default_factory=dict, exclude=True)  # the config.json it came from

    def modules(self) -> list[ModuleParams]:
        """Directly-owned parameter counts per module, in forward order (tied counted once)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            if t.tied_to is None:
                out[t.module] = out.get(t.module, 0) + t.numel
        return [ModuleParams(name=k, params=v) for k, v in out.items()]


def load_model(ref: str) -> ModelSpec:  # pragma: no cover - replaced by the models helper
    """Catalog name, path to an HF config.json, or a count such as 7B / 70e9 / 1.3T."""
    raise NotImplementedError
