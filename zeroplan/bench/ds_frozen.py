"""What DeepSpeed did with the frozen (``requires_grad=False``) parameters, read from its objects after
the steps (split out of ``bench/deepspeed_engine.py``)."""

from __future__ import annotations




def _numel_of_tensors(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.numel())
    if isinstance(obj, (list, tuple)):
        return sum(_numel_of_tensors(x) for x in obj)
    return 0


def _frozen_check(engine, model) -> dict:
    """What DeepSpeed did with the frozen (``requires_grad=False``) parameters, read from its objects.

    - ``trainable_numel`` / ``frozen_numel``: the model's parameters by ``requires_grad``;
    - ``optimizer_numel``: elements the innermost torch optimizer steps (its param groups: the
      fp32 partitions under ZeRO 1-2, ``fp32_partitioned_groups_flat`` at stage 3, the fp32 copies
      of FP16_UnfusedOptimizer at bf16 stage 0, the parameters themselves at fp32 stage 0);
    - ``optimizer_state_numel``: elements of its state tensors (AdamW exp_avg + exp_avg_sq; the
      0-dim ``step`` counters excluded);
    - ``zero_group_numel``: elements of the bit16 parameters ZeRO put in its groups
      (stage_1_and_2.py ``bit16_groups``, bf16_optimizer.py ``bf16_groups``, stage3.py
      ``fp16_groups``), and ``frozen_in_groups``: frozen parameters found in any of them or in the
      optimizer's param groups (expected: none);
    - ``frozen_with_grad``: frozen parameters holding a ``.grad`` after the steps (expected: none).
    """
    import torch

    frozen = {id(p): n for n, p in model.named_parameters() if not p.requires_grad}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    groups_params = [p for g in getattr(inner, "param_groups", []) for p in g["params"]]
    if isinstance(getattr(opt, "fp32_partitioned_groups_flat", None), list):
        # stage3.py _optimizer_step puts a sub-group's fp32 partition into the param group only
        # while it steps (`param_groups[...]['params'] = [fp32_param]`, then `[]`): read the partitions
        groups_params = list(opt.fp32_partitioned_groups_flat)
    state_numel = 0
    for st in getattr(inner, "state", {}).values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state_numel += int(v.numel())
    zero_groups = []
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        got = getattr(opt, attr, None)
        if isinstance(got, list) and got:
            zero_groups = [p for grp in got for p in grp]
            break
    in_groups = sorted({frozen[id(p)] for p in zero_groups + groups_params if id(p) in frozen})
    return {
        "trainable_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel())
                               for p in model.parameters() if p.requires_grad),
        "frozen_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel())
                            for p in model.parameters() if not p.requires_grad),
        "trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad),
        "frozen_tensors": len(frozen),
        "optimizer_numel": _numel_of_tensors(groups_params),
        "optimizer_state_numel": state_numel,
        "zero_group_numel": sum(int(p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for p in zero_groups),
        "frozen_in_groups": in_groups,
        "frozen_with_grad": sorted(n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None),
    }
