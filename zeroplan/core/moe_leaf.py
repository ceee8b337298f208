"""MoE blocks that DeepSpeed's ZeRO-3 gathers whole under transformers 5 (a known gap, said in a note).

Two things make a layer's experts one fetch and one coalesced all-gather:
- transformers 5.x fuses a Mixtral layer's experts into one module with two 3-D parameters
  (``MixtralExperts.gate_up_proj`` and ``down_proj``, ``modeling_mixtral.py``), so the stage-3 hooks
  fetch every expert at once;
- DeepSpeed 0.19.8 installs no hooks inside a ZeRO-3 "leaf" module and fetches all of its parameters
  at once (``runtime/zero/leaf_module_config.py``). Its default classes are transformers' Mixtral,
  Qwen2-MoE and Qwen3-MoE sparse MoE blocks, so the router joins the experts.
  ``zero_optimization.leaf_module`` overrides the classes.

Measured on transformers 5.23's tiny Mixtral (tests/test_moe_leaf.py):
- by default DeepSpeed fetches ``model.layers.0.mlp`` with all of its parameters and never its children;
- with no leaf classes it fetches the router, then ``mlp.experts`` with every expert's parameters.

zeroplan's stage-3 replay still fetches the router and each expert matrix on its own, as the
checkpoint names them (``block_sparse_moe.experts.N.w1``). For these blocks it therefore under-states
the gathered bytes, and over-counts the fetches. Until the replay groups them, a plan says so, and
by how much (``moe_leaf_note``).
"""

from __future__ import annotations

from zeroplan._util import fmt_bytes
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.model import ModelSpec

__all__ = ["HF_MOE_LEAF_CLASSES", "moe_leaf_block", "moe_leaf_note"]

# model_type -> transformers' sparse MoE block class, as DeepSpeed 0.19.8 lists it by default
HF_MOE_LEAF_CLASSES = {
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
}


def moe_leaf_block(spec: ModelSpec, zero: ZeroConfig) -> tuple[int, int] | None:
    """(elements of one layer's MoE block, elements of its largest single module) under stage 3 for a
    family whose experts transformers fuses; None otherwise. The block is gathered whole when its class
    is a leaf (``zero.leaf_module``, DeepSpeed's default), else the experts are, without the router."""
    if int(zero.stage) != 3 or spec.model_type not in HF_MOE_LEAF_CLASSES:
        return None
    routers = [t for t in spec.tensors if t.role == "router" and t.layer is not None]
    if not routers:
        return None
    layer = routers[0].layer
    block = routers[0].module.rpartition(".")[0] + "."  # the router's parent: the sparse MoE block
    by_module: dict[str, int] = {}
    for t in spec.tensors:
        if t.layer == layer and t.tied_to is None and t.module.startswith(block):
            by_module[t.module] = by_module.get(t.module, 0) + t.numel
    if not by_module:
        return None
    return sum(by_module.values()), max(by_module.values())


def moe_leaf_note(spec: ModelSpec, zero: ZeroConfig, param_bytes: int) -> str | None:
    got = moe_leaf_block(spec, zero)
    if got is None:
        return None
    whole, largest = got
    leaf = HF_MOE_LEAF_CLASSES[spec.model_type] in (zero.leaf_module or {}).get("classes", [])
    why = ("its sparse MoE block is a default zero_optimization.leaf_module class" if leaf else
           "transformers 5 fuses the experts into one module")
    return (f"MoE under ZeRO-3: DeepSpeed 0.19.8 gathers all of a {spec.model_type} layer's experts at once ({why}), "
            f"{fmt_bytes(whole * param_bytes)} per layer; this plan gathers the router and experts module by module "
            f"(largest {fmt_bytes(largest * param_bytes)}), so its gather peak can be up to "
            f"{fmt_bytes((whole - largest) * param_bytes)} low (a known gap, core/moe_leaf.py)")
