"""Frozen parameters (``requires_grad`` False, runtime/lora.py) as DeepSpeed 0.19.8 treats them
(split out of ``runtime/engine.py``).

Stages 0-2 leave them out of the optimizer's flat groups (stage_1_and_2.py
DeepSpeedZeroOptimizer.__init__: `if is_optimized_parameter(param)` -> bit16_groups;
bf16_optimizer.py BF16_Optimizer.__init__ likewise; the stage-0 all-reduce in engine.py skips
`not param.requires_grad`): whole on every rank, no gradient, no state, no communication. Stage 3
partitions and gathers them like any parameter (parameter_offload.py _convert_to_zero_parameters;
mark_persistent_parameters walks every named parameter) but reduces and updates only the
trainable ones (stage3.py _get_trainable_parameter_groups); ``engine_stage3`` keeps their
partitions in a flat buffer of their own.
"""

from __future__ import annotations

from typing import Any


def split_frozen(params: list[Any], names: list[str], stage: int) -> tuple[list[Any], list[str], list[Any]]:
    """(the params the engine manages, their names, the frozen params): stages 0-2 manage only the
    trainable ones, stage 3 all of them. Raises ValueError when nothing trains."""
    frozen = [p for p in params if not p.requires_grad]
    if len(frozen) == len(params):
        raise ValueError("every parameter is frozen (requires_grad False): nothing to train")
    if stage < 3 and frozen:
        keep = [k for k, p in enumerate(params) if p.requires_grad]
        params = [params[k] for k in keep]
        names = [names[k] for k in keep]
    return params, names, frozen
