"""Which matmul work a fine-tuning step runs: the weight-gradient GEMMs only trainable weights need.

A linear layer ``y = x·Wᵀ`` costs, per token and weight, 2 FLOPs forward, 2 backward for the
activation gradient ``dx = dy·W`` and 2 backward for the weight gradient ``dW = dyᵀ·x`` (the
PaLM / Megatron-LM 6Ψ count, core/compute.py). Autograd skips ``dW`` for a weight with
``requires_grad=False`` (torch.nn.functional.linear's backward computes only the gradients
``ctx.needs_input_grad`` asks for), but still runs ``dx`` wherever a trainable parameter lies below
the layer, which with LoRA is every layer: so frozen base weights cost 4 FLOPs per token and
weight, trainable ones (full fine-tuning, LoRA's A and B, modules_to_save copies) 6. Activation
checkpointing re-runs the forward (2 per weight) either way.

``matmul_work(views)`` returns the share of the base model's per-token matmul FLOPs whose weights
train and the adapters' extra weights per token (LoRA A and B: r × (in + out) per adapted module).
Counted as not done: layers below the lowest trainable parameter need no ``dx`` either (with
``--trainable last:K`` the bottom layers run forward only); zeroplan still counts their ``dx``, an
overestimate of partial fine-tuning's backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.finetune import FineTuneViews
from zeroplan.specs.finetune import LINEAR_ROLES
from zeroplan.specs.model import ModelSpec, ParamTensor

__all__ = ["MatmulWork", "FULL_TRAINING", "matmul_work"]

_EXPERT_ROLES = frozenset({"expert_up", "expert_gate", "expert_down"})


@dataclass(frozen=True)
class MatmulWork:
    trainable_share: float  # of the base model's per-token matmul FLOPs whose weight gradient runs
    adapter_params_per_token: int  # LoRA A/B weights a token passes through (2 FLOPs each forward, 6 in all)


FULL_TRAINING = MatmulWork(trainable_share=1.0, adapter_params_per_token=0)


def matmul_work(spec: ModelSpec, views: FineTuneViews | None) -> MatmulWork:
    """Trainable share of ``spec``'s per-token matmul FLOPs and the adapters' weights (core/compute.py)."""
    if views is None:
        return FULL_TRAINING
    expert_w = (max(1, spec.experts_per_token) / spec.num_experts) if spec.num_experts else 1.0

    def per_token(t: ParamTensor) -> float:  # weights a token passes through: a routed expert only for its top-k
        return t.numel * (expert_w if t.role in _EXPERT_ROLES else 1.0)

    inv = views.inventory
    trainable_names = {t.name for t in inv.trainable_tensors}
    # a module_to_save runs its trainable copy in place of the frozen original
    saved = {t.module.split(".modules_to_save.", 1)[0] for t in inv.trainable_tensors if ".modules_to_save." in t.module}

    def trains(t: ParamTensor) -> bool:  # a tied head trains when the tensor it shares storage with does
        return t.name in trainable_names or t.tied_to in trainable_names or t.module in saved

    base = [t for t in spec.tensors if t.role in LINEAR_ROLES]
    total = sum(per_token(t) for t in base)
    trainable = sum(per_token(t) for t in base if trains(t))
    adapters = sum(t.numel for t in inv.trainable_tensors if t.role == "lora" and len(t.shape) == 2)
    share = min(1.0, trainable / total) if total else 1.0
    return MatmulWork(trainable_share=share, adapter_params_per_token=int(adapters))
