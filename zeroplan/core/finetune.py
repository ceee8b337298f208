"""What ZeRO does with frozen weights: the two parameter views a fine-tuning plan needs.

DeepSpeed 0.19.8 treats trainable and frozen parameters differently:

- Stages 0–2: only parameters with ``requires_grad`` enter the optimizer's flat groups
  (runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``: ``trainable_parameters =
  [p for p in param_group['params'] if p.requires_grad]`` → ``bit16_groups``). Frozen weights
  stay whole, as the module holds them, on every rank: no gradient, no fp32 master, no optimizer
  state, no bucket, no all-reduce and no all-gather.
- Stage 3: ``zero.Init`` / ``DeepSpeedZeRoOffload._convert_to_zero_parameters`` partitions EVERY
  module parameter, frozen ones too, and gathers them every micro-step in forward and backward;
  gradients, reduce-scatter buckets and optimizer state cover only ``is_optimized_parameter``
  ones (stage3.py ``_get_trainable_parameter_groups``). The persistence threshold
  (``mark_persistent_parameters``) applies to adapters like any parameter: a LoRA A of r × h
  elements under the threshold stays whole on every rank.

So a plan keeps two layouts: the trainable one (gradients, optimizer, buckets, step) and the
full one (stage-3 partitions and gathers). Activations are not changed by freezing: with an
adapter in every layer, every layer's activations are needed for backward.

Stage-3 backward re-gathers happen only for modules whose forward output needs a gradient:
DeepSpeed fetches a module's parameters in backward from ``PreBackwardFunctionForModule``, an
autograd function ``_pre_backward_module_hook`` applies to the module's outputs
(parameter_offload.py ``DeepSpeedZeRoOffload._register_deepspeed_module``); an output that does
not require grad is not in the graph, so the function never runs. With a frozen embedding
every module that reads only frozen-derived tensors (the embedding, the first layer's input
norm, its projections' base weights — PEFT keeps them in ``base_layer``) is released after
forward and never gathered again (``FineTuneViews.no_backward``, measured:
tests/test_finetune_engines.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.layout import Layout
from zeroplan.specs.finetune import FineTune, FineTuneInventory, finetune_inventory
from zeroplan.specs.model import ModelSpec

__all__ = ["FineTuneViews", "finetune_views", "ledger_layouts", "backward_skips"]


@dataclass(frozen=True)
class FineTuneViews:
    inventory: FineTuneInventory
    trainable: ModelSpec  # the parameters DeepSpeed's optimizer owns
    full: ModelSpec  # every parameter the model holds (base + adapters + copies)
    frozen_storage_bytes: int  # frozen base weights at rest, whole (compute dtype or quantised)
    quantized_params: int  # base elements stored quantised (they are in `full` as elements)
    finetune: FineTune | None = None  # the settings these views were made from (PEFT's r, targets, quantisation)
    # modules of `full` whose output needs no gradient: stage 3 never re-gathers them in backward
    no_backward: frozenset[str] = frozenset()


def _view(spec: ModelSpec, tensors: list, suffix: str) -> ModelSpec:
    total = sum(t.numel for t in tensors)
    largest: dict[str, int] = {}
    for t in tensors:
        largest[t.module] = largest.get(t.module, 0) + t.numel
    name, size = max(largest.items(), key=lambda kv: kv[1]) if largest else ("(none)", 0)
    return spec.model_copy(update={
        "name": f"{spec.name} ({suffix})", "tensors": list(tensors), "params": total,
        "largest_module_params": size, "largest_module_name": name, "approximate": spec.approximate,
    })


def _base_module(module: str) -> str:
    for marker in (".lora_", ".modules_to_save."):
        if marker in module:
            return module.split(marker, 1)[0]
    return module


def finetune_views(spec: ModelSpec, ft: FineTune, compute_bytes: int) -> FineTuneViews:
    inv = finetune_inventory(spec, ft, compute_bytes=compute_bytes)
    # forward order: each adapter right after the module it wraps (the order hooks see them in)
    order: dict[str, int] = {}
    for t in spec.tensors:
        order.setdefault(t.module, len(order))
    key = lambda t: order.get(_base_module(t.module), len(order))  # noqa: E731
    trainable = _view(spec, sorted(inv.trainable_tensors, key=key), "trainable")
    full = _view(spec, sorted(inv.frozen_tensors + inv.trainable_tensors, key=key), "with adapters")
    trained = {_base_module(t.module) for t in inv.trainable_tensors if t.role != "lora"}
    adapted = {_base_module(t.module) for t in inv.trainable_tensors if t.role == "lora"}
    return FineTuneViews(inventory=inv, trainable=trainable, full=full,
                         frozen_storage_bytes=int(inv.frozen_storage_bytes or 0),
                         quantized_params=inv.quantized_params, finetune=ft,
                         no_backward=no_backward_modules(spec, trained, adapted))


_ATTN_IN = ("attn_q", "attn_k", "attn_v", "attn_qkv")
_MLP_IN = ("mlp_up", "mlp_gate", "mlp_gate_up", "router", "expert_up", "expert_gate")
_MLP_OUT = ("mlp_down", "expert_down")
_PARALLEL = ("gpt_neox", "falcon", "phi", "gptj")  # runtime/model.py PARALLEL_FAMILIES


def no_backward_modules(spec: ModelSpec, trained: set[str], adapted: set[str] = frozenset()) -> frozenset[str]:
    """Base modules whose forward output requires no gradient: stage 3 never re-gathers them.

    ``trained``: modules owning a trainable base tensor (partial fine-tuning, ``modules_to_save``);
    ``adapted``: modules wrapped by a LoRA adapter. PEFT keeps an adapted module's weight in its
    own ``base_layer`` (``peft.tuners.lora.layer.Linear``; runtime/lora.py does the same): the
    base output needs a gradient only when its input does, while the wrapped module's output
    (base + adapter) always does.

    Data flow of a decoder block (the runtime model's forward, runtime/model.py ``_layer``): an
    output needs a gradient iff its module trains or its input needs one. The residual stream
    needs one from the first block with a trained or adapted module on; before that, a norm
    reading the stream, the projections reading that norm, and so on, need none. A tied head
    reuses the embedding in backward: the embedding is then never listed.
    """
    mods: dict[str, tuple[str, int | None]] = {}
    qk_norm: set[str] = set()
    for t in spec.tensors:
        if t.tied_to is not None:
            continue
        mods.setdefault(t.module, (t.role, t.layer))
        if t.role == "norm" and t.layer is not None and len(t.shape) == 1 and spec.head_dim \
                and t.shape[0] == spec.head_dim != spec.hidden_size:
            qk_norm.add(t.module)
    tied = any(t.tied_to is not None for t in spec.tensors)
    inputs: dict[str, bool] = {}

    def out(m: str, inp: bool) -> bool:
        """Record m's input flag; whether m's output (as the next module sees it) needs a gradient."""
        inputs[m] = inp
        return inp or m in trained or m in adapted

    stream = False
    layers: dict[int, list[tuple[str, str]]] = {}
    post: list[tuple[str, str]] = []
    for m, (role, layer) in mods.items():
        if layer is not None:
            layers.setdefault(layer, []).append((m, role))
        elif role in ("embed", "pos_embed"):
            stream = out(m, False) or stream
        else:
            post.append((m, role))
    parallel = spec.model_type in _PARALLEL
    for layer in sorted(layers):
        ms = layers[layer]
        norms = [m for m, r in ms if r == "norm" and m not in qk_norm]
        h0 = out(norms[0], stream) if norms else stream
        attn = False
        for m, r in ms:
            if r in _ATTN_IN:
                attn = out(m, h0) or attn
        for m in sorted(qk_norm & {m for m, _ in ms}):
            attn = out(m, attn) or attn
        o = next((m for m, r in ms if r == "attn_o"), None)
        o_out = out(o, attn) if o is not None else attn
        if parallel:
            mlp_in = out(norms[1], stream) if len(norms) > 1 else h0
            after_attn = stream
        elif len(norms) >= 4:  # gemma2: post-attention norm on the attention output
            after_attn = stream or out(norms[1], o_out)
            mlp_in = out(norms[2], after_attn)
        else:
            after_attn = stream or o_out
            mlp_in = out(norms[1], after_attn) if len(norms) > 1 else after_attn
        mid = False
        for m, r in ms:
            if r in _MLP_IN:
                mid = out(m, mlp_in) or mid
        mlp_out = mid
        for m, r in ms:
            if r in _MLP_OUT:
                mlp_out = out(m, mid) or mlp_out
        if len(norms) >= 4 and not parallel:
            mlp_out = out(norms[3], mlp_out)
        stream = after_attn or mlp_out or (parallel and o_out)
        for m, _ in ms:  # a module of another role: conservatively re-gathered
            inputs.setdefault(m, True)
    for m, _role in post:
        stream = out(m, stream)
    result = {m for m, inp in inputs.items() if not inp and m not in trained}
    if tied:
        result -= {m for m, (role, _) in mods.items() if role == "embed"}
    return frozenset(result)


def backward_skips(finetune: FineTuneViews | None, checkpointing: str) -> frozenset[str]:
    """The modules stage 3 never re-gathers in backward (``FineTuneViews.no_backward``), none under full
    checkpointing: transformers' ``gradient_checkpointing_enable`` (5.x ``modeling_utils.py``) calls
    ``enable_input_require_grads`` on every model whose main input is ``input_ids``, a forward hook that
    makes the input embedding's output require a gradient, so every module's output then needs one
    (PEFT's ``prepare_model_for_kbit_training`` and ``PeftModel`` do the same). Measured: DeepSpeed
    0.19.8 on a PEFT-LoRA Llama fetches the embedding and the first layer's frozen modules in backward
    with checkpointing on, not without (tests/test_host_time.py)."""
    if finetune is None or checkpointing == "full":
        return frozenset()
    return finetune.no_backward


def ledger_layouts(layout: Layout, train_layout: Layout | None, stage: int) -> tuple[Layout, Layout | None]:
    """(layout, train_layout) for core.comm.build_ledger: stages 0-2 communicate only the trainable
    parameters; stage 3 gathers every parameter and reduces the trainable ones."""
    if train_layout is not None and stage < 3:
        return train_layout, None
    return layout, train_layout
