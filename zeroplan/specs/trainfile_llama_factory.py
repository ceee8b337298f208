"""LLaMA-Factory's training YAML: ``model_name_or_path``, ``stage``, ``finetuning_type`` (lora, full,
freeze), ``lora_rank``, ``lora_target``, ``quantization_bit``, ``cutoff_len``, ``optim``, ``deepspeed``.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan._util import InputError
from zeroplan.specs.finetune import ALL_LINEAR, FineTune, LoraSpec, QuantSpec
from zeroplan.specs.trainfile_hf_args import finish_trainer_keys
from zeroplan.specs.trainfile_reader import TrainingFile, _load_mapping, _precision, _Reader, _storage

def read_llama_factory(path: str | Path) -> TrainingFile:
    where = str(path)
    r = _Reader(_load_mapping(path, "LLaMA-Factory config"), where)
    out = TrainingFile(source=where, format="llama-factory", model=r.str("model_name_or_path"))
    if out.model is None:
        raise InputError(f"{where}: model_name_or_path is missing; expected a Hub id or a local path")
    stage = r.choice("stage", ("pt", "sft", "rm", "ppo", "dpo", "kto"))
    if stage in ("ppo",):
        raise InputError(f"{where}: stage = 'ppo' trains a policy, a value model and a reference at once; zeroplan plans one model")
    out.seq_len = r.int("cutoff_len")
    out.micro_batch = r.int("per_device_train_batch_size")
    out.grad_accum = r.int("gradient_accumulation_steps")
    out.precision = _precision(r)
    gc = r.bool("disable_gradient_checkpointing")  # LLaMA-Factory checkpoints unless told not to
    out.checkpointing = "none" if gc else "full"
    ftype = r.choice("finetuning_type", ("lora", "full", "freeze")) or "lora"
    qbit = r.int("quantization_bit", lo=2, hi=8)
    if qbit is not None and qbit not in (4, 8):
        raise InputError(f"{where}: quantization_bit = {qbit}; zeroplan plans bitsandbytes 4 or 8 bits")
    if qbit is not None and ftype != "lora":
        raise InputError(f"{where}: quantization_bit with finetuning_type = {ftype!r}; a quantised base can only train LoRA adapters")
    if ftype == "lora":
        tgt = r.names("lora_target") or ("all",)
        targets: tuple[str, ...] | str = ALL_LINEAR if tgt == ("all",) else tgt
        lora = LoraSpec(r=r.int("lora_rank", hi=1 << 16) or 8, alpha=r.raw("lora_alpha"), targets=targets,
                        dora=bool(r.bool("use_dora")), modules_to_save=r.names("additional_target") or ())
        quant = None
        if qbit is not None:
            dq = r.bool("double_quantization")
            # LLaMA-Factory (model/model_utils/quantization.py) sets bnb_4bit_quant_storage to the compute
            # dtype when DeepSpeed ZeRO-3 or FSDP is on
            quant = QuantSpec(bits=qbit, double_quant=True if dq is None else dq, storage_dtype=_storage(out.precision))
        out.finetune = FineTune(method="qlora" if quant else "lora", lora=lora, quant=quant)
    elif ftype == "freeze":
        k = r.int("freeze_trainable_layers", lo=-(1 << 20), hi=1 << 20) or 2
        if k < 0:
            raise InputError(f"{where}: freeze_trainable_layers = {k} (the first layers) is not planned; use a positive count (the last layers)")
        out.finetune = FineTune(method="full", trainable=(f"last:{k}",))
    else:
        out.finetune = FineTune()
    return finish_trainer_keys(r, out, where, fusing_keys=("enable_liger_kernel",))
