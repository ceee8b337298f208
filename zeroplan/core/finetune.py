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
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.layout import Layout
from zeroplan.specs.finetune import FineTune, FineTuneInventory, finetune_inventory
from zeroplan.specs.model import ModelSpec

__all__ = ["FineTuneViews", "finetune_views", "ledger_layouts"]


@dataclass(frozen=True)
class FineTuneViews:
    inventory: FineTuneInventory
    trainable: ModelSpec  # the parameters DeepSpeed's optimizer owns
    full: ModelSpec  # every parameter the model holds (base + adapters + copies)
    frozen_storage_bytes: int  # frozen base weights at rest, whole (compute dtype or quantised)
    quantized_params: int  # base elements stored quantised (they are in `full` as elements)
    finetune: FineTune | None = None  # the settings these views were made from (PEFT's r, targets, quantisation)


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
    return FineTuneViews(inventory=inv, trainable=trainable, full=full,
                         frozen_storage_bytes=int(inv.frozen_storage_bytes or 0),
                         quantized_params=inv.quantized_params, finetune=ft)


def ledger_layouts(layout: Layout, train_layout: Layout | None, stage: int) -> tuple[Layout, Layout | None]:
    """(layout, train_layout) for core.comm.build_ledger: stages 0-2 communicate only the trainable
    parameters; stage 3 gathers every parameter and reduces the trainable ones."""
    if train_layout is not None and stage < 3:
        return train_layout, None
    return layout, train_layout
