"""Fine-tuning options and training files → the planning inputs (used by core/inputs.py).

Two ways in, one result:

- flags: ``--method full|lora|qlora``, ``--lora-r``, ``--lora-alpha``, ``--lora-targets``
  (PEFT's spelling: module names, or ``all-linear``), ``--dora``, ``--modules-to-save``,
  ``--trainable`` (globs or ``last:K`` for partial fine-tuning), ``--quant-bits 4|8``,
  ``--double-quant/--no-double-quant``, ``--quant-storage``;
- files people already have (specs/training_files.py): ``--accelerate-config``, ``--hf-args``,
  ``--axolotl``, ``--llama-factory``. A file fills only what the flags leave unset.

What DeepSpeed 0.19.8 accepts with quantised base weights is checked here: ZeRO-3 partitions
every parameter into flat buffers of one dtype, so 4-bit weights must be stored in the model's
dtype (``bnb_4bit_quant_storage``, as PEFT's DeepSpeed guide requires), and bitsandbytes'
8-bit ``Int8Params`` (int8 data + a row-scale attribute) cannot be partitioned at all.

The four training-file readers (``specs.training_files``) are imported in
``read_training_files`` when a file is given, so a plan without one never loads them (issue 14).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zeroplan._util import InputError
from zeroplan.core.finetune import FineTuneViews, finetune_views
from zeroplan.specs.finetune import ALL_LINEAR, FineTune, LoraSpec, QuantSpec
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.trainfile_reader import TrainingFile

# build_plan_inputs' fine-tuning keywords (the fields of the options models that carry them)
FINETUNE_KEYS = ("method", "lora_r", "lora_alpha", "lora_targets", "dora", "modules_to_save", "trainable",
                 "quant_bits", "double_quant", "quant_storage", "accelerate_config", "hf_args", "axolotl",
                 "llama_factory")

__all__ = ["FINETUNE_KEYS", "DEFAULT_LORA_R", "finetune_record", "fill_from_record", "FineTuneOptions", "TRAINING_FILE_OPTIONS", "read_training_files", "resolve_finetune", "PEFT_DEFAULT_TARGETS"]

# peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: PEFT's targets when
# LoraConfig gets none
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "gemma": ("q_proj", "v_proj"), "phi": ("q_proj", "v_proj"),
    "phi3": ("qkv_proj",), "gpt2": ("c_attn",), "gpt_neox": ("query_key_value",), "falcon": ("query_key_value",),
}
TRAINING_FILE_OPTIONS = {"accelerate_config": "accelerate", "hf_args": "hf-args", "axolotl": "axolotl",
                         "llama_factory": "llama-factory"}
_QUANT_STORAGE = {"uint8": "uint8", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                  "float16": "float16", "fp32": "float32", "float32": "float32"}
DEFAULT_LORA_R = 8  # PEFT's LoraConfig.r default
_DTYPE_OF_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class FineTuneOptions:
    method: str | None = None
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    dora: bool = False
    modules_to_save: str | None = None
    trainable: str | None = None
    quant_bits: int | None = None
    double_quant: bool = True
    quant_storage: str | None = None
    from_file: FineTune | None = None  # what a training file said
    notes: list[str] = field(default_factory=list)

    @property
    def given(self) -> bool:
        return any(v not in (None, False) for v in (self.method, self.lora_r, self.lora_alpha, self.lora_targets,
                                                     self.dora, self.modules_to_save, self.trainable, self.quant_bits,
                                                     self.quant_storage))


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def read_training_files(paths: dict[str, str | None]) -> TrainingFile | None:
    """The one training file given (``accelerate_config``/``hf_args``/``axolotl``/``llama_factory``)."""
    given = [(k, v) for k, v in paths.items() if v is not None]
    if len(given) > 1:
        raise InputError(f"give one training file, not {' and '.join('--' + k.replace('_', '-') for k, _ in given)}")
    if not given:
        return None
    key, path = given[0]
    from zeroplan.specs.training_files import FORMATS, read_training_file  # the four readers, only for a file

    assert TRAINING_FILE_OPTIONS[key] in FORMATS
    return read_training_file(TRAINING_FILE_OPTIONS[key], path)


def _fine_tune(spec: ModelSpec, o: FineTuneOptions) -> FineTune | None:
    if o.lora_alpha is not None and not (math.isfinite(o.lora_alpha) and o.lora_alpha > 0):
        raise InputError(f"--lora-alpha {o.lora_alpha}: expected a positive finite number (PEFT scales the adapter "
                         "output by alpha / r)")
    if o.lora_r is not None and not 1 <= o.lora_r <= 1 << 16:  # before `given`, which takes 0 for unset
        raise InputError(f"--lora-r {o.lora_r}: expected a rank from 1 to 65536")
    if not o.given:
        return o.from_file
    lora_given = o.lora_r or o.lora_alpha or o.lora_targets or o.dora or o.modules_to_save
    method = o.method or ("qlora" if o.quant_bits or o.quant_storage else ("lora" if lora_given else "full"))
    if method == "any":  # api.recommend expands it into full, lora and qlora before planning
        raise InputError("--method any searches the method and is a `zeroplan recommend` option; this command plans "
                         "one: full, lora or qlora")
    if method not in ("full", "lora", "qlora"):
        raise InputError(f"--method {method!r} is unknown; expected full, lora or qlora")
    if method == "full":
        for name, v in (("--lora-r", o.lora_r), ("--lora-alpha", o.lora_alpha), ("--lora-targets", o.lora_targets),
                        ("--dora", o.dora or None), ("--modules-to-save", o.modules_to_save),
                        ("--quant-bits", o.quant_bits), ("--quant-storage", o.quant_storage)):
            if v is not None:
                shown = "" if v is True else f" {v if str(v).strip() else repr(v)}"  # --lora-targets '' shows ''
                raise InputError(f"{name}{shown} with --method full; LoRA settings need --method lora or qlora")
        return FineTune(trainable=_names(o.trainable)) if o.trainable else None
    if method == "qlora" and o.quant_bits is None:
        o.quant_bits = 4
    if o.quant_bits is not None and o.quant_bits not in (4, 8):
        raise InputError(f"--quant-bits {o.quant_bits}: bitsandbytes quantises to 4 or 8 bits")
    if method == "lora" and (o.quant_bits is not None or o.quant_storage is not None):
        said = f"--quant-bits {o.quant_bits}" if o.quant_bits is not None else f"--quant-storage {o.quant_storage}"
        raise InputError(f"{said} with --method lora; quantised base weights are --method qlora")
    if o.lora_targets is None:
        targets: tuple[str, ...] | str = PEFT_DEFAULT_TARGETS.get(spec.model_type, ())
        if not targets:
            raise InputError(f"--lora-targets is needed for model_type {spec.model_type!r} (PEFT has no default for it)")
        o.notes.append(f"LoRA targets {','.join(targets)} (PEFT's default for {spec.model_type})")
    else:
        targets = ALL_LINEAR if o.lora_targets.strip().lower() in (ALL_LINEAR, "all") else _names(o.lora_targets)
    storage = _QUANT_STORAGE.get((o.quant_storage or "uint8").lower())
    if storage is None:
        raise InputError(f"--quant-storage {o.quant_storage!r} is unknown; expected uint8, bf16, fp16 or fp32")
    return FineTune(
        method=method,
        lora=LoraSpec(r=o.lora_r or DEFAULT_LORA_R, alpha=o.lora_alpha, targets=targets, dora=o.dora,
                      modules_to_save=_names(o.modules_to_save)),
        quant=QuantSpec(bits=o.quant_bits, double_quant=o.double_quant, storage_dtype=storage) if method == "qlora" else None,
        trainable=_names(o.trainable),
    )


def resolve_finetune(spec: ModelSpec, o: FineTuneOptions, precision: str, stages: list[int],
                     stage_explicit: bool) -> tuple[FineTuneViews | None, list[int]]:
    """The fine-tuning views, and the stages DeepSpeed can run with them."""
    ft = _fine_tune(spec, o)
    if ft is None or ft.is_full:
        return None, stages
    if ft.quant is not None and precision == "fp32":  # first: the storage advice below names the precision
        raise InputError("QLoRA computes in bf16 or fp16; give --precision bf16 or fp16")
    if ft.quant is not None and 3 in stages:
        model_dtype = _DTYPE_OF_PRECISION[precision]
        why = None
        if ft.quant.bits == 8:
            why = "ZeRO-3 cannot partition bitsandbytes 8-bit weights (Int8Params); use 4-bit or stage 1/2"
        elif ft.quant.storage_dtype != model_dtype:
            why = (f"ZeRO-3 needs 4-bit weights stored in the model dtype (bnb_4bit_quant_storage={model_dtype}, "
                   f"got {ft.quant.storage_dtype}); pass --quant-storage {precision}")
        if why is not None:
            if stage_explicit:
                raise InputError(f"--stage 3 with QLoRA: {why}")
            stages = [s for s in stages if s != 3]
            o.notes.append(f"stage 3 left out: {why}")
    compute = 4 if precision == "fp32" else 2
    views = finetune_views(spec, ft, compute_bytes=compute)
    if views.inventory.unmatched_modules_to_save:
        o.notes.append(f"--modules-to-save {','.join(views.inventory.unmatched_modules_to_save)}: no module of "
                       f"{spec.name} has that name; PEFT skips it, so no copy of it is trained")
    o.notes.append(f"{views.inventory.method}: {views.inventory.trainable_params:,} trainable of "
                   f"{views.inventory.total_params:,} parameters")
    return views, stages


def fill_from_file(tf: TrainingFile, kw: dict[str, Any]) -> list[str]:
    """Fill the planning keywords the user left unset from a training file; returns notes."""
    for key in ("model", "gpus", "nodes", "precision", "micro_batch", "grad_accum", "seq_len", "checkpointing",
                "optimizer", "ds_config"):
        if kw.get(key) is None and getattr(tf, key) is not None:
            kw[key] = getattr(tf, key)
    notes = [f"read {tf.format} file {tf.source}"]
    if tf.ignored_keys:
        shown = ", ".join(tf.ignored_keys[:12]) + (" …" if len(tf.ignored_keys) > 12 else "")
        notes.append(f"{tf.source}: keys that do not change memory, ignored: {shown}")
    return notes


# The fine-tuning a recommended DeepSpeed config was planned with, recorded in its ``zeroplan``
# block (core/inputs.py annotate_ds_config) so ``check`` and ``estimate`` plan the same thing back
# when no fine-tuning flag is given. key -> the types it may hold.
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "method": (str,), "lora_r": (int,), "lora_alpha": (int, float), "lora_targets": (str,), "dora": (bool,),
    "modules_to_save": (str,), "trainable": (str,), "quant_bits": (int,), "double_quant": (bool,),
    "quant_storage": (str,),
}


def finetune_record(views: FineTuneViews | None) -> dict[str, Any] | None:
    """The options that give ``views`` again (None for full training of every weight)."""
    ft = views.finetune if views is not None else None
    if ft is None:
        return None
    out: dict[str, Any] = {"method": ft.method}
    if ft.lora is not None:
        lo = ft.lora
        out |= {"lora_r": lo.r, "lora_targets": lo.targets if isinstance(lo.targets, str) else ",".join(lo.targets),
                "dora": lo.dora}
        if lo.alpha is not None:
            out["lora_alpha"] = lo.alpha
        if lo.modules_to_save:
            out["modules_to_save"] = ",".join(lo.modules_to_save)
    if ft.trainable:
        out["trainable"] = ",".join(ft.trainable)
    if ft.quant is not None:
        storage = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(ft.quant.storage_dtype,
                                                                                  ft.quant.storage_dtype)
        out |= {"quant_bits": ft.quant.bits, "double_quant": ft.quant.double_quant, "quant_storage": storage}
    return out


def fill_from_record(o: FineTuneOptions, record: Any, where: str) -> list[str]:
    """Fill ``o`` from a config's ``zeroplan.finetune`` record when no fine-tuning flag or training
    file said anything; returns the note. A malformed record is an InputError naming ``where``."""
    if record is None or o.given or o.from_file is not None:
        return []
    if not isinstance(record, dict):
        raise InputError(f"{where}: zeroplan.finetune = {record!r}: expected an object of fine-tuning options")
    for k, v in record.items():
        types = _RECORD_TYPES.get(k)
        if types is None or isinstance(v, bool) and bool not in types or not isinstance(v, types):
            raise InputError(f"{where}: zeroplan.finetune.{k} = {v!r}: expected one of {', '.join(_RECORD_TYPES)} "
                             "with the type its --option takes")
        setattr(o, k, v)
    return [f"fine-tuning {record.get('method')} from {where}: zeroplan.finetune (give --method to override)"]
