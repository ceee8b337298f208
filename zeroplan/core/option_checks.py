"""The planning options checked one by one before anything is loaded, and their bounds.

Each check raises InputError naming the option (or the config key that gave the value), the value
and what was expected. ``MAX_OPTION_VALUES`` bounds the per-GPU work whether a value comes from an
option or from the DeepSpeed config (core/inputs.py applies it to the config's values too);
``bench zero`` and ``--global-batch`` take the same bounds.
"""

from __future__ import annotations

from zeroplan._util import InputError
from zeroplan.core.ds_config_inputs import CHECKPOINTING
from zeroplan.specs.training import OPTIMIZER_IMPLS

__all__ = ["OFFLOAD_DEVICES", "MAX_GPUS", "MAX_OPTION_VALUES", "checked_options", "check_bound", "unused_offload_notes"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MAX_GPUS = 2**17  # 131,072 data-parallel GPUs: beyond any ZeRO job; keeps a plan well under a second
# Upper bounds of the per-GPU work options: far beyond any training run (a 16M-token sequence, a
# million-sample micro-batch), and small enough that every byte count stays an exact integer.
MAX_OPTION_VALUES = {"--micro-batch": 2**20, "--seq-len": 2**24, "--grad-accum": 2**24}


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value}")
    if value is not None and name in MAX_OPTION_VALUES:
        check_bound(name, f"{name} {value:,}", value)


def check_bound(flag: str, said: str, value: int) -> None:
    """``value`` (an option's, or the config's for that option, ``said`` as the message names it)
    within ``MAX_OPTION_VALUES[flag]``."""
    if value > MAX_OPTION_VALUES[flag]:
        raise InputError(f"{said} is beyond what zeroplan plans: expected at most {MAX_OPTION_VALUES[flag]:,}")


def checked_options(*, gpus: int | None, nodes: int | None, gpus_per_node: int | None, micro_batch: int | None,
                     seq_len: int | None, grad_accum: int | None, optimizer_impl: str | None,
                     stage: int | list[int] | None, checkpointing: str | None, offload_optimizer: str | None,
                     offload_param: str | None) -> list[int] | None:
    """The options checked one by one (the first mistake raises); the stages as a list (None: not given)."""
    stage_list = None if stage is None else ([stage] if isinstance(stage, int) else list(stage))
    for name, v in (("--gpus", gpus), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node),
                    ("--micro-batch", micro_batch), ("--seq-len", seq_len), ("--grad-accum", grad_accum)):
        _check_positive(name, v)
    if optimizer_impl is not None and optimizer_impl not in OPTIMIZER_IMPLS:
        raise InputError(f"--optimizer-impl {optimizer_impl!r} is unknown; expected one of {', '.join(OPTIMIZER_IMPLS)}")
    for st in stage_list or []:
        if isinstance(st, bool) or st not in (0, 1, 2, 3):
            raise InputError(f"--stage {st} is not a ZeRO stage; expected 0, 1, 2 or 3")
    if checkpointing is not None and checkpointing not in CHECKPOINTING:
        raise InputError(f"--checkpointing {checkpointing!r} is unknown; expected none, selective or full")
    for name, v in (("--offload-optimizer", offload_optimizer), ("--offload-param", offload_param)):
        if v is not None and v not in OFFLOAD_DEVICES:
            raise InputError(f"{name} {v!r} is unknown; expected one of none, cpu, nvme")
    return stage_list


def unused_offload_notes(stages: list[int], offload_optimizer: str | None, offload_param: str | None) -> list[str]:
    """What an offload option cannot do at some planned stage, as the config's DS010 warnings say it
    (specs/ds_zero.py): DeepSpeed offloads parameters only in stage 3 and optimizer states from stage 1."""
    out = []
    for flag, dev, lowest in (("--offload-optimizer", offload_optimizer, 1), ("--offload-param", offload_param, 3)):
        skipped = [str(st) for st in stages if st < lowest]
        if dev not in (None, "none") and skipped:
            out.append(f"{flag} {dev} has no effect at stage{'s' * (len(skipped) > 1)} {', '.join(skipped)} (DeepSpeed offloads "
                       f"{'parameters only in stage 3' if lowest == 3 else 'optimizer states from stage 1'}): "
                       "planned without it there")
    return out
