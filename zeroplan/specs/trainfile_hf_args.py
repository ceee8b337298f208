"""HF Trainer / TRL arguments as JSON or YAML (``TrainingArguments`` field names), and ``_HF_OPTIM``,
the ``optim`` names (shared by axolotl and LLaMA-Factory) mapped to zeroplan's optimizer presets.
A DeepSpeed config's ``"auto"`` values are filled from these arguments as
``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process`` does (the
DeepSpeed reader applies them).
"""

from __future__ import annotations

from pathlib import Path

from zeroplan._util import InputError
from zeroplan.specs.trainfile_reader import TrainingFile, _ds_path, _kernels, _load_mapping, _precision, _Reader

_HF_OPTIM = {  # TrainingArguments.optim -> zeroplan optimizer preset (state bytes)
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_apex_fused": "adamw",
    "adamw_torch_xla": "adamw", "adamw_anyprecision": "adamw", "adam": "adam",
    "adamw_bnb_8bit": "adam8bit", "adamw_8bit": "adam8bit", "paged_adamw_8bit": "adam8bit", "adam8bit": "adam8bit",
    "paged_adamw_32bit": "adamw", "sgd": "sgd",
}


def read_hf_args(path: str | Path) -> TrainingFile:
    where = str(path)
    r = _Reader(_load_mapping(path, "HF Trainer arguments"), where)
    out = TrainingFile(source=where, format="hf-args")
    out.micro_batch = r.int("per_device_train_batch_size")
    out.grad_accum = r.int("gradient_accumulation_steps")
    out.precision = _precision(r)
    if out.precision is None and (r.data.get("bf16") is False or r.data.get("fp16") is False):
        out.precision = "fp32"
    gc = r.bool("gradient_checkpointing")
    out.checkpointing = "full" if gc else ("none" if gc is False else None)
    for key in ("max_seq_length", "max_length"):  # TRL SFTConfig spells it either way
        v = r.int(key)
        if v is not None:
            if out.seq_len is not None and v != out.seq_len:
                raise InputError(f"{where}: max_seq_length {out.seq_len} and max_length {v} disagree")
            out.seq_len = v
    return finish_trainer_keys(r, out, where)


def finish_trainer_keys(r: _Reader, out: TrainingFile, where: str, fusing_keys: tuple[str, ...] = ()) -> TrainingFile:
    """The keys HF Trainer arguments and LLaMA-Factory's YAML share at the end of a read: ``optim``
    (a preset), ``deepspeed`` (a path beside the file), the kernel switches (``fusing_keys``: the format's
    own besides TrainingArguments'); then typos refused and the rest listed as ignored."""
    optim = r.str("optim")
    if optim is not None:
        if optim not in _HF_OPTIM:
            raise InputError(f"{where}: optim = {optim!r} is not planned; expected one of {', '.join(sorted(_HF_OPTIM))}")
        out.optimizer = _HF_OPTIM[optim]
    out.ds_config = _ds_path(r, "deepspeed", Path(where).resolve().parent)
    _kernels(r, out, ("use_liger_kernel", "torch_compile") + fusing_keys)  # TrainingArguments' switches
    r.refuse_typos()
    out.ignored_keys = r.ignored()
    return out
