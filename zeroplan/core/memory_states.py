"""Model-state bytes per GPU and the optimizer step's transients, as DeepSpeed 0.19.8 allocates them.

Which optimizer wrapper DeepSpeed builds decides what is kept (deepspeed/runtime/engine.py,
``DeepSpeedEngine._do_optimizer_sanity_check`` and ``_configure_optimizer``):

  ZeRO stage >= 1, bf16, grad_accum_dtype fp32, stage 1, no offload -> BF16_Optimizer
      (runtime/bf16_optimizer.py ``BF16_Optimizer.__init__``: whole-model bf16 flat params,
      whole-model fp32 gradients ``fp32_groups_gradients_flat``, fp32 master + states partitioned)
  ZeRO stage 1/2 otherwise -> DeepSpeedZeroOptimizer (runtime/zero/stage_1_and_2.py); with a
      gradient-accumulation dtype other than the model's, gradients are kept in that dtype
      (``_fill_param_grad_accum_attribute``; stage 2's ``_build_compact_grad_partition_buffer``)
  ZeRO stage 3 -> DeepSpeedZeroOptimizer_Stage3: the gradient partition buffer
      ``grad_partitions_flat_buffer`` has ``gradient_accumulation_dtype`` (stage3.py ``__init__``)
  no ZeRO, fp16 or bf16 (same accumulation dtype) -> FP16_Optimizer when the optimizer is DeepSpeed's
      FusedAdam (an Adam/AdamW ``optimizer`` block on CUDA), else FP16_UnfusedOptimizer (a client
      optimizer such as the HF Trainer's torch AdamW, ``torch_adam``): fp32 master of the whole model
      either way (engine.py ``_configure_fp16_optimizer``: ``isinstance(optimizer, fused_opts)``)
  no ZeRO, fp32 -> the basic optimizer alone: no fp32 master (16 B/param for Adam, not 20)
  no ZeRO, accumulation dtype != model dtype -> DeepSpeed raises NotImplementedError

The ``paper`` flavour keeps the ZeRO paper's accounting instead (Table I: K = 12, gradients in
the model dtype, the fp32 master always counted): 70B x 20 B = 1.4 TB in fp32 stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.layout import Layout
from zeroplan.specs.ds_schema import ZeroConfig
from zeroplan.specs.training import TrainingSetup

__all__ = ["FLAVOURS", "StatePlan", "model_state_bytes", "optimizer_temp_bytes", "stage1_reduces_in_hooks", "state_plan"]

FLAVOURS = ("deepspeed", "paper")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class StatePlan:
    """What DeepSpeed keeps per parameter, for one stage and training setup."""

    # "zero" | "bf16_optimizer" | "fp16_optimizer" | "fp16_unfused_optimizer" | "basic" | "unsupported"
    wrapper: str
    master_bytes: int  # fp32 master copy per parameter (0 when the optimizer updates the params directly)
    grad_bytes: int  # the gradient buffer's bytes per element (the accumulation dtype)
    whole_model_grads: bool  # the gradient buffer spans the whole model (BF16_Optimizer, stage 0/1)
    note: str | None = None


def stage1_reduces_in_hooks(stage: int, zero: ZeroConfig, training: TrainingSetup, *, offload: bool) -> bool:
    """Whether ZeRO-1 keeps its gradients as stage 2 does, reduced in the backward's gradient hooks.

    DeepSpeed 0.19.8 ``stage_1_and_2.py``: with ``overlap_comm`` the hook's ``process_gradients`` calls
    ``reduce_ready_partitions_and_remove_grads``, which on the accumulation boundary runs
    ``reduce_independent_p_g_buckets_and_remove_grads``. Each gradient is copied into the ipg bucket (two
    with ``overlap_comm``) and its own storage freed, a bucket is flushed when the next gradient would
    overflow it, and ``reduce_ipg_grads`` copies the owned gradients into ``grads_in_partition``. With
    one micro-step per optimizer step no whole-model gradient is kept (measured on real DeepSpeed:
    ``examples/validation/cpu-replay/peak-live-stage1-overlap-*.json``). With more, ``p.grad`` accumulates
    over the earlier micro-steps and the boundary's backward starts with it, as without ``overlap_comm``.
    Contiguous gradients (the bucket) and no optimizer offload; gradients in the model dtype (another
    accumulation dtype takes ``use_grad_accum_attribute`` or BF16_Optimizer)."""
    acc = training.grad_accum_dtype or training.precision.name
    return (stage == 1 and bool(zero.overlap_comm) and bool(zero.contiguous_gradients) and not offload
            and training.grad_accum == 1 and acc == training.precision.name)


def state_plan(training: TrainingSetup, stage: int, *, offload: bool = False, flavour: str = "deepspeed",
               hooked: bool = False) -> StatePlan:
    """What DeepSpeed keeps for ``stage`` (module docstring); ``hooked``: stage 1 reduces in the
    gradient hooks (``stage1_reduces_in_hooks``), so its gradients are the partition's, as stage 2's."""
    prec = training.precision
    if flavour == "paper":
        return StatePlan("paper", prec.master_bytes, prec.grad_bytes, stage <= 1)
    model = prec.name
    acc = training.grad_accum_dtype or model
    acc_bytes = _DTYPE_BYTES[acc]
    if stage >= 1:
        if model == "bf16" and acc == "fp32" and stage == 1 and not offload:
            # engine.py _do_optimizer_sanity_check -> BFLOAT16 -> BF16_Optimizer
            return StatePlan("bf16_optimizer", 4, 4, True)
        return StatePlan("zero", prec.master_bytes, acc_bytes, stage == 1 and not hooked)
    if acc != model:
        return StatePlan("unsupported", prec.master_bytes, prec.grad_bytes, True,
                         note=(f"DeepSpeed 0.19.8 rejects {model} training with grad_accum_dtype {acc} without ZeRO "
                               "(engine.py _do_optimizer_sanity_check raises NotImplementedError); modelled as "
                               f"{model} accumulation"))
    if model == "fp32":
        # no wrapper: the basic optimizer steps the fp32 parameters themselves
        return StatePlan("basic", 0, 4, True)
    fused = training.optimizer_impl == "fused-adam" and training.optimizer.name in ("adam", "adamw")
    return StatePlan("fp16_optimizer" if fused else "fp16_unfused_optimizer", prec.master_bytes, prec.grad_bytes, True)


def model_state_bytes(layout: Layout, training: TrainingSetup, stage: int, *, offload: bool = False,
                      flavour: str = "deepspeed", hooked: bool = False) -> tuple[int, int, int]:
    """(params, gradients, optimizer_states) bytes per GPU at the end of backward, padded as
    DeepSpeed lays buffers out (core/layout.py), before any offload is applied (``hooked``: state_plan)."""
    sp = state_plan(training, stage, offload=offload, flavour=flavour, hooked=hooked)
    k = sp.master_bytes + training.optimizer.state_bytes
    b_p = training.precision.param_bytes
    if stage == 0:
        n_p = n_g = n_o = layout.params
    elif stage in (1, 2):
        n_p = layout.flat_padded
        n_g = layout.flat_padded if sp.whole_model_grads else layout.partition_12
        n_o = layout.partition_12
    else:
        n_p = layout.partition_3 + layout.persistent_padded
        n_g = layout.partition_3
        n_o = layout.partition_3
    return b_p * n_p, sp.grad_bytes * n_g, int(k * n_o)


def optimizer_temp_bytes(training: TrainingSetup, group_elems: int, largest_elems: int) -> int:
    """GPU bytes the optimizer's step allocates beside its states, for one step call over
    ``group_elems`` fp32 elements whose largest tensor has ``largest_elems`` (Adam-like only).

    - fused-adam: DeepSpeed FusedAdam applies the update in multi_tensor_apply chunks, no
      temporaries (deepspeed/ops/adam/fused_adam.py ``FusedAdam.step``).
    - torch-foreach: torch.optim.adamw ``_multi_tensor_adamw`` builds ``exp_avg_sq_sqrt =
      torch._foreach_sqrt(...)``, one fp32 copy of every tensor in the group: 4 B/element.
    - torch-single: ``_single_tensor_adamw`` computes ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)``
      per tensor: two fp32 temporaries of the largest tensor coexist, 8 B/element of it.
    - torch-fused: ``_fused_adamw`` (one kernel), none. cpu-adam: the step runs on the host.
    """
    if training.optimizer.state_bytes < 8:
        return 0
    impl = training.optimizer_impl
    if impl == "torch-foreach":
        return 4 * group_elems
    if impl == "torch-single":
        return 8 * largest_elems
    return 0
