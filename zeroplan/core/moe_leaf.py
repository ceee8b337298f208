"""MoE blocks as DeepSpeed's ZeRO-3 fetches them under transformers 5: whole blocks, or all experts at once.

Two things make a layer's experts one fetch and one coalesced all-gather:
- transformers 5.x fuses a Mixtral layer's experts into one module with two 3-D parameters
  (``MixtralExperts.gate_up_proj`` and ``down_proj``, ``modeling_mixtral.py``), so the stage-3 hooks
  fetch every expert at once;
- DeepSpeed 0.19.8 installs no hooks inside a ZeRO-3 "leaf" module and fetches all of its parameters
  at once (``utils/z3_leaf_module.py``, ``parameter_offload.py`` ``iter_params(recurse=z3_leaf_module)``).
  Its default classes (``runtime/zero/leaf_module_config.py``) are transformers' Mixtral, Qwen2-MoE and
  Qwen3-MoE sparse MoE blocks, so the router joins the experts. ``zero_optimization.leaf_module``
  overrides them: a class matches by its qualified or its bare name (``_do_set_z3_leaf_modules``),
  ``names`` and ``name_suffixes`` by the module's name in the model (transformers 5 calls the block
  ``model.layers.N.mlp``).

Measured on transformers 5.23's tiny Mixtral (tests/test_moe_leaf.py): by default DeepSpeed fetches
``model.layers.0.mlp`` with all of its parameters and never its children; with no leaf classes it
fetches the router, then ``mlp.experts`` with every expert's parameters. ``moe_fetch_groups`` gives the
stage-3 replay the same fetch units (core/layout.py ``_fetch_units``). A spec whose ``module_tree`` is
"checkpoint" (the bundled runtime's model: one module per checkpoint module) is fetched module by module.

The gradients follow the same module tree: the layout holds transformers' fused parameters
(``fused_parameters``: each layer's ``gate_up_proj`` and ``down_proj``), so buckets and partitions are
DeepSpeed's, and a leaf block's gradients are all live when its backward hook reduces them together
(``moe_leaf_units``, ``stage3.py`` ``reduce_leaf_module_grads``). A plan says so in a note (``moe_leaf_note``).
"""

from __future__ import annotations

from zeroplan._util import fmt_bytes
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.model import ModelSpec

__all__ = ["HF_MOE_LEAF_CLASSES", "fused_parameters", "largest_module_params", "moe_block_is_leaf", "moe_fetch_groups",
           "moe_leaf_block", "moe_leaf_note", "moe_leaf_units"]

_EXPERT_ROLES = {"expert_gate": "gate_up_proj", "expert_up": "gate_up_proj", "expert_down": "down_proj"}

# model_type -> transformers' sparse MoE block class, as DeepSpeed 0.19.8 lists it by default
HF_MOE_LEAF_CLASSES = {
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
}


def _fused(spec: ModelSpec) -> bool:
    return spec.model_type in HF_MOE_LEAF_CLASSES and spec.module_tree == "transformers"


def _blocks(spec: ModelSpec) -> dict[int, str]:
    """Per layer, the sparse MoE block's module name in the spec (the router's parent)."""
    return {t.layer: t.module.rpartition(".")[0] for t in spec.tensors if t.role == "router" and t.layer is not None}


def fused_parameters(spec: ModelSpec) -> tuple[list[tuple[str, str, int, int | None]], dict[str, str]] | None:
    """The spec's parameters (tied copies left out) as transformers 5 holds them: each layer's expert
    matrices become its experts module's two parameters, ``gate_up_proj`` (every expert's gate and up) and
    ``down_proj``, where the first expert matrix stood (``MixtralExperts.__init__``: after the router,
    gate_up first). As (name, module, elements, layer), with each fused checkpoint tensor's new name.
    None where the experts are not fused (dense models, a checkpoint-shaped module tree)."""
    if not _fused(spec):
        return None
    blocks = _blocks(spec)
    out: list[tuple[str, str, int, int | None]] = []
    renamed: dict[str, str] = {}
    where: dict[str, int] = {}  # fused parameter name -> its index in out
    for t in spec.tensors:
        if t.tied_to is not None:
            continue
        role = _EXPERT_ROLES.get(t.role)
        block = blocks.get(t.layer) if t.layer is not None else None
        if role is None or t.expert is None or block is None:
            out.append((t.name, t.module, t.numel, t.layer))
            continue
        module = f"{block}.experts"
        name = f"{module}.{role}"
        if name not in where:
            if role == "down_proj" and f"{module}.gate_up_proj" not in where:  # keep gate_up first
                where[f"{module}.gate_up_proj"] = len(out)
                out.append((f"{module}.gate_up_proj", module, 0, t.layer))
            where[name] = len(out)
            out.append((name, module, 0, t.layer))
        i = where[name]
        out[i] = (name, module, out[i][2] + t.numel, t.layer)
        renamed[t.name] = name
    return [p for p in out if p[2] > 0], renamed


def moe_block_is_leaf(spec: ModelSpec, zero: ZeroConfig, block: str) -> bool:
    """Whether DeepSpeed treats this block as a ZeRO-3 leaf module (``apply_zero_leaf_module_config``)."""
    lm = zero.leaf_module or {}
    qualified = HF_MOE_LEAF_CLASSES[spec.model_type]
    if any(c in (qualified, qualified.rpartition(".")[2]) for c in lm.get("classes", [])):
        return True
    hf_name = f"model.layers.{block.split('.layers.')[1].split('.')[0]}.mlp" if ".layers." in block else block
    return hf_name in lm.get("names", []) or any(hf_name.endswith(s) for s in lm.get("name_suffixes", []))


def moe_fetch_groups(spec: ModelSpec, zero: ZeroConfig) -> dict[str, str]:
    """Spec module -> the fetch unit DeepSpeed calls it in under transformers 5: a leaf block's modules
    all map to the block; otherwise each expert's modules map to the block's fused ``experts`` module.
    Empty for dense models and for a checkpoint-shaped module tree."""
    if not _fused(spec):
        return {}
    blocks = _blocks(spec)
    leaf = {b: moe_block_is_leaf(spec, zero, b) for b in set(blocks.values())}
    out: dict[str, str] = {}
    for t in spec.tensors:
        b = blocks.get(t.layer) if t.layer is not None else None
        if b is None or not t.module.startswith(b + "."):
            continue
        if leaf[b]:
            out[t.module] = out[f"{b}.experts"] = b  # the fused experts module (fused_parameters) too
        elif t.expert is not None:
            out[t.module] = f"{b}.experts"
    return out


def moe_leaf_units(spec: ModelSpec, zero: ZeroConfig) -> frozenset[str]:
    """The MoE blocks DeepSpeed treats as ZeRO-3 leaf modules (fetch units of ``moe_fetch_groups``): it
    reduces such a block's gradients together once the block's backward ends (``stage3.py``
    ``create_reduce_and_remove_grad_hooks``: one ``register_full_backward_hook`` per leaf,
    ``reduce_leaf_module_grads``), so they are all live at once then."""
    if not _fused(spec):
        return frozenset()
    return frozenset(b for b in set(_blocks(spec).values()) if moe_block_is_leaf(spec, zero, b))


def largest_module_params(spec: ModelSpec) -> int:
    """The most parameters one module owns directly in the module tree DeepSpeed is given: what its estimators
    read (``stage3.py`` ``model_to_params``: ``largest_layer_params``). Under transformers 5 a layer's fused
    experts module owns every expert's matrices."""
    largest = spec.largest_module_params
    if not _fused(spec):
        return largest
    per_layer: dict[int, int] = {}
    for t in spec.tensors:
        if t.expert is not None and t.layer is not None and t.tied_to is None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.numel
    return max([largest, *per_layer.values()])


def moe_leaf_block(spec: ModelSpec, zero: ZeroConfig) -> tuple[int, int] | None:
    """For layer 0's MoE block under stage 3 where transformers fuses the experts: (elements DeepSpeed
    fetches at once, elements whose gradients are live at once before it reduces them). None otherwise. A
    leaf block's gradients are reduced together after its backward (``moe_leaf_units``); without a leaf,
    the largest fused parameter's (``gate_up_proj``: the gate and up matrices of every expert) is one
    gradient."""
    if int(zero.stage) != 3 or not _fused(spec):
        return None
    blocks = _blocks(spec)
    if not blocks:
        return None
    layer = min(blocks)
    groups = moe_fetch_groups(spec, zero)
    mine = [t for t in spec.tensors if t.layer == layer and t.tied_to is None and t.module in groups]
    fetched = sum(t.numel for t in mine)
    if moe_block_is_leaf(spec, zero, blocks[layer]):
        return fetched, fetched
    gate_up = sum(t.numel for t in mine if t.role in ("expert_gate", "expert_up"))
    return fetched, max(gate_up, sum(t.numel for t in mine if t.role == "expert_down"))


def moe_leaf_note(spec: ModelSpec, zero: ZeroConfig, param_bytes: int, grad_bytes: int) -> str | None:
    """What a stage-3 plan of a fused-experts MoE model says about its MoE gathers and gradients."""
    got = moe_leaf_block(spec, zero)
    if got is None:
        return None
    fetched, held = got
    leaf = moe_block_is_leaf(spec, zero, next(iter(_blocks(spec).values())))
    what = ("the whole sparse MoE block (a ZeRO-3 leaf module: zero_optimization.leaf_module)" if leaf else
            "every expert at once (transformers fuses them into one module)")
    how = ("reduces the block's gradients together after its backward (stage3.py reduce_leaf_module_grads)" if leaf
           else "reduces the fused gate_up_proj as one gradient")
    return (f"MoE under ZeRO-3: DeepSpeed 0.19.8 fetches transformers 5's {spec.model_type} layers as {what}, "
            f"{fmt_bytes(fetched * param_bytes)} per layer, and {how}: {fmt_bytes(held * grad_bytes)} of gradients "
            f"live at once; both are planned so (core/moe_leaf.py)")
