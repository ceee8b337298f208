"""Apply a fine-tuning spec (``zeroplan.specs.finetune.FineTune``) to the runtime's model.

``apply_finetune(model, spec, ft)`` gives a ``build_model`` model the adapters PEFT 0.21 would
add and freezes what PEFT freezes, so the bundled engine and the real DeepSpeed engine train
the very parameter set the planner counts (``finetune_inventory``):

- LoRA on a linear module (``peft.tuners.lora.layer.Linear``): the module becomes a wrapper with
  three children, as PEFT builds it: ``base_layer`` (the original weight and bias, moved:
  ``<module>.base_layer.weight``), ``lora_A.default`` [r, in] and ``lora_B.default`` [out, r]
  without bias (``update_layer``); PEFT's names without the ``base_model.model.`` prefix (the
  planner keeps the checkpoint name ``<module>.weight`` for the base: same tensor, same order).
  A ~ N(0, 0.02) from the model's seed (PEFT: Kaiming-uniform), B = 0 (``reset_lora_parameters``:
  ``nn.init.zeros_(self.lora_B[adapter_name].weight)``), so the first forward equals the base
  model's. The forward is ``base_layer(x) + B(A(x)) · alpha / r`` (runtime/model.py
  ``Holder.forward``; no dropout), alpha defaulting to PEFT's ``lora_alpha = 8``. The base weight
  being its own module matters to ZeRO-3: hooks see it apart from the adapters, so in the first
  adapted block, whose input needs no gradient, DeepSpeed never re-gathers it in backward.
- Every base parameter gets ``requires_grad = False`` (``peft.tuners.tuners_utils.BaseTuner.
  _mark_only_adapters_as_trainable``) unless ``ft.trainable`` keeps it trainable; adapters train.
- The gather units (``model.zero_units``, the order the engine partitions and buckets in) get
  each adapter right after the module it wraps, A before B — the order
  ``core.finetune.finetune_views`` puts the planner's tensors in, and the order ``parameters()``
  lists them (a module's own parameters before its children's).

Not implemented here (the planner models them): DoRA magnitudes, ``modules_to_save`` copies,
LoRA on embeddings, quantised bases (QLoRA). They raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any

from zeroplan.specs.finetune import FineTune, finetune_inventory
from zeroplan.specs.model import ModelSpec

__all__ = ["apply_finetune", "PEFT_DEFAULT_ALPHA"]

PEFT_DEFAULT_ALPHA = 8.0  # peft.LoraConfig.lora_alpha default (0.21)


def apply_finetune(model: Any, spec: ModelSpec, ft: FineTune | None, *, seed: int = 0) -> Any:
    """Add ``ft``'s adapters to ``model`` (from ``build_model(spec)``) and freeze the base; returns ``model``.

    ``ft`` None or full training: the model is returned unchanged. Raises ``ValueError`` for the
    settings the runtime does not implement (see the module docstring).
    """
    if ft is None or ft.is_full:
        return model
    if ft.method == "qlora":
        raise ValueError("the bundled runtime does not quantise the base (QLoRA); use method lora")
    import torch
    from torch import nn

    from zeroplan.runtime.model import _make_classes

    _, _, _, Holder, _ = _make_classes()
    inv = finetune_inventory(spec, ft, compute_bytes=2)
    if inv.saved_copy_params:
        raise ValueError("modules_to_save copies are not implemented by the bundled runtime")
    train_names = {t.name for t in inv.trainable_tensors}
    adapters: dict[str, dict[str, Any]] = {}  # base module -> {"A": tensor, "B": tensor}
    for t in inv.trainable_tensors:
        if t.role != "lora":
            continue
        base, _, rest = t.module.partition(".lora_")
        if not rest or rest.startswith("embedding") or rest.startswith("magnitude"):
            raise ValueError(f"adapter {t.name!r}: only LoRA A/B on linear modules are implemented by the runtime")
        adapters.setdefault(base, {})[rest.split(".", 1)[0]] = t
    # freeze the base (tied tensors share the Parameter of their source)
    for name, p in model.named_parameters():
        p.requires_grad_(name in train_names)
    holders = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + 7919)
    lora = ft.lora
    scaling = float(lora.alpha if lora.alpha is not None else PEFT_DEFAULT_ALPHA) / lora.r
    new_units: dict[str, list] = {}
    for base, ab in adapters.items():
        holder = holders.get(base)
        if holder is None or "A" not in ab or "B" not in ab:
            raise ValueError(f"LoRA target {base!r} is not a module of the runtime model")
        inner = Holder(holder.kind, conv1d=holder.conv1d, layernorm=holder.layernorm, eps=holder.eps)
        inner.spec_role, inner.layer, inner.expert = holder.spec_role, holder.layer, holder.expert
        moved = []
        for pname in list(holder._parameters):
            p = holder._parameters.pop(pname)
            inner.register_parameter(pname, p)
            moved.append((f"{base}.base_layer.{pname}", p))
        holder.add_module("base_layer", inner)
        new_units[base] = [(f"{base}.base_layer", inner, moved)]
        for key, init in (("A", "normal"), ("B", "zeros")):
            t = ab[key]
            data = torch.zeros(t.shape) if init == "zeros" else torch.empty(t.shape).normal_(0.0, 0.02, generator=gen)
            mod = Holder("lora")
            mod.register_parameter("weight", nn.Parameter(data.to(device=device, dtype=dtype)))
            mod.spec_role, mod.layer, mod.expert = "lora", t.layer, None
            holder.add_module(f"lora_{key}", nn.ModuleDict({"default": mod}))
            new_units.setdefault(base, []).append((f"{base}.lora_{key}.default", mod,
                                                   [(f"{base}.lora_{key}.default.weight", mod.weight)]))
        holder.lora_scaling = scaling
    units = []
    for unit in model.zero_units:  # an adapted module's unit becomes base_layer, lora_A, lora_B
        units.extend(new_units.get(unit[0], [unit]))
    model.zero_units = units
    model.zero_params = [(n, p) for _, _, ps in units for n, p in ps]
    model.finetune = ft
    return model
