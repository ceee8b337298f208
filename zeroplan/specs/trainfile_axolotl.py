"""axolotl's training YAML: ``base_model``, ``adapter`` and ``lora_*``, ``load_in_4bit/8bit``,
``sequence_len``, ``micro_batch_size``, ``gradient_checkpointing``, ``optimizer``, ``deepspeed``.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan._util import InputError
from zeroplan.specs.finetune import ALL_LINEAR, FineTune, LoraSpec, QuantSpec
from zeroplan.specs.trainfile_hf_args import _HF_OPTIM
from zeroplan.specs.trainfile_reader import TrainingFile, _ds_path, _kernels, _load_mapping, _precision, _Reader, _storage

def read_axolotl(path: str | Path) -> TrainingFile:
    where = str(path)
    r = _Reader(_load_mapping(path, "axolotl config"), where)
    out = TrainingFile(source=where, format="axolotl", model=r.str("base_model"))
    if out.model is None:
        raise InputError(f"{where}: base_model is missing; expected a Hub id or a local path")
    out.seq_len = r.int("sequence_len")
    out.micro_batch = r.int("micro_batch_size")
    out.grad_accum = r.int("gradient_accumulation_steps")
    gc = r.raw("gradient_checkpointing")
    out.checkpointing = "full" if gc in (True, "unsloth", "offload") else ("none" if gc is False else None)
    out.precision = _precision(r)
    adapter = r.choice("adapter", ("lora", "qlora"))
    in4 = r.bool("load_in_4bit")
    in8 = r.bool("load_in_8bit")
    if in4 and in8:
        raise InputError(f"{where}: load_in_4bit and load_in_8bit are both true; expected at most one")
    if adapter == "qlora" and in4 is False:
        raise InputError(f"{where}: adapter = 'qlora' with load_in_4bit: false; axolotl's QLoRA loads 4-bit weights")
    if adapter is None and (in4 or in8):
        raise InputError(f"{where}: load_in_{'4' if in4 else '8'}bit without an adapter; a quantised base can only train adapters")
    if adapter is not None:
        targets: tuple[str, ...] | str = r.names("lora_target_modules") or ()
        if r.bool("lora_target_linear"):
            targets = ALL_LINEAR
        if not targets:
            raise InputError(f"{where}: adapter = {adapter!r} needs lora_target_modules or lora_target_linear: true")
        lora = LoraSpec(r=r.int("lora_r", hi=1 << 16) or 8, alpha=r.raw("lora_alpha"), targets=targets,
                        dora=bool(r.bool("peft_use_dora")), modules_to_save=r.names("lora_modules_to_save") or ())
        # axolotl loads 4-bit weights with bnb_4bit_quant_storage = the model dtype under DeepSpeed
        # ZeRO-3 / FSDP (its model loader's BitsAndBytesConfig), which ZeRO-3 needs; it does no harm below
        quant = (QuantSpec(bits=4, storage_dtype=_storage(out.precision)) if (adapter == "qlora" or in4)
                 else (QuantSpec(bits=8) if in8 else None))
        out.finetune = FineTune(method="qlora" if quant is not None else "lora", lora=lora, quant=quant)
    out.optimizer = _axolotl_optimizer(r)
    out.ds_config = _ds_path(r, "deepspeed", Path(where).resolve().parent)
    # axolotl's Liger plugin switches (integrations/liger/args.py) and torch_compile
    _kernels(r, out, ("liger_rms_norm", "liger_glu_activation", "liger_rope", "liger_layer_norm",
                      "liger_fused_linear_cross_entropy", "torch_compile"))
    r.refuse_typos()
    out.ignored_keys = r.ignored()
    return out


def _axolotl_optimizer(r: _Reader) -> str | None:
    opt = r.str("optimizer")
    if opt is None:
        return None
    if opt not in _HF_OPTIM:
        raise InputError(f"{r.where}: optimizer = {opt!r} is not planned; expected one of {', '.join(sorted(_HF_OPTIM))}")
    return _HF_OPTIM[opt]
