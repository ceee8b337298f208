"""The PEFT / bitsandbytes / Trainer settings a recommendation was planned with.

``recommend --emit-config PATH`` writes them beside the DeepSpeed config (``peft_sidecar_path``:
``ds.json`` → ``ds.peft.json``), spelt as the libraries spell their arguments so they can be
copied into ``LoraConfig``, ``BitsAndBytesConfig`` and ``TrainingArguments``:

- ``peft``: ``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``, ``use_dora``,
  ``modules_to_save``, ``task_type`` (None for full fine-tuning). ``lora_alpha`` is a scale and
  changes no memory; when it was not given PEFT's default (``LoraConfig.lora_alpha`` = 8) is written.
  ``lora_dropout`` is 0.0 (PEFT's default): the activation model counts no dropout mask, and a
  dropout on the adapters' input keeps one more copy of it per adapted module.
- ``quantization``: ``load_in_4bit`` / ``load_in_8bit``, ``bnb_4bit_quant_type``,
  ``bnb_4bit_use_double_quant``, ``bnb_4bit_quant_storage``, ``bnb_4bit_compute_dtype`` (QLoRA only).
- ``trainer``: ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``bf16`` / ``fp16``,
  ``gradient_checkpointing``, ``max_seq_length`` (TRL's SFTConfig name), ``deepspeed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["peft_settings", "peft_sidecar_path", "PEFT_DEFAULT_ALPHA"]

PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig.lora_alpha default
_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def peft_sidecar_path(ds_config_path: str) -> str:
    """``ds.json`` → ``ds.peft.json``; a path without ``.json`` gets ``.peft.json`` appended."""
    p = Path(ds_config_path)
    return str(p.with_suffix(".peft.json")) if p.suffix.lower() == ".json" else f"{ds_config_path}.peft.json"


def _peft(ft: Any) -> dict[str, Any] | None:
    if ft is None or ft.lora is None:
        return None
    lo = ft.lora
    targets = lo.targets if isinstance(lo.targets, str) else list(lo.targets)
    return {"r": lo.r, "lora_alpha": lo.alpha if lo.alpha is not None else PEFT_DEFAULT_ALPHA,
            "target_modules": targets, "lora_dropout": 0.0, "use_dora": lo.dora,
            "modules_to_save": list(lo.modules_to_save) or None, "task_type": "CAUSAL_LM"}


def _quant(ft: Any, precision: str) -> dict[str, Any] | None:
    if ft is None or ft.quant is None:
        return None
    q = ft.quant
    if q.bits == 8:
        return {"load_in_8bit": True}
    return {"load_in_4bit": True, "bnb_4bit_quant_type": q.quant_type, "bnb_4bit_use_double_quant": q.double_quant,
            "bnb_4bit_quant_storage": q.storage_dtype, "bnb_4bit_compute_dtype": _TORCH_DTYPE.get(precision, precision)}


def peft_settings(finetune: Any, training: dict[str, Any], chosen: Any, *, ds_config_path: str | None = None,
                  ) -> dict[str, Any]:
    """The settings of ``finetune`` (a core FineTune, None for full training), the recommendation's
    ``training`` summary and its chosen configuration (micro-batch, checkpointing)."""
    precision = str(training["precision"])
    ft = finetune
    method = ft.method if ft is not None else "full"
    out: dict[str, Any] = {
        "method": method,
        "peft": _peft(ft),
        "quantization": _quant(ft, precision),
        "trainer": {
            "per_device_train_batch_size": chosen.micro_batch,
            "gradient_accumulation_steps": int(training["grad_accum"]),
            "bf16": precision == "bf16", "fp16": precision == "fp16",
            "gradient_checkpointing": chosen.checkpointing != "none",
            "max_seq_length": int(training["seq_len"]),
            "deepspeed": ds_config_path,
        },
    }
    if ft is not None and ft.trainable:
        out["trainable"] = list(ft.trainable)  # partial fine-tuning: set requires_grad on these only
    if chosen.checkpointing == "selective":
        out["trainer_note"] = ("selective checkpointing recomputes the attention core only: not a TrainingArguments "
                               "switch (gradient_checkpointing=True is full checkpointing)")
    return out
