"""Fine-tuning setups read from the files people already have.

Four formats, each read for the keys that change memory or time, every other key listed as
ignored (never silently dropped), contradictions refused with one line:

- Accelerate's ``default_config.yaml`` (``accelerate config``): ``num_processes`` (total
  GPUs), ``num_machines``, ``mixed_precision``, and ``deepspeed_config`` either as
  ``deepspeed_config_file`` or inline (``zero_stage``, ``offload_*_device``,
  ``gradient_accumulation_steps``, ``gradient_clipping``) — turned into a DeepSpeed config the
  way ``accelerate.utils.dataclasses.DeepSpeedPlugin.__post_init__`` builds one.
- HF Trainer / TRL arguments as JSON or YAML (``TrainingArguments`` field names). They fill a
  DeepSpeed config's ``"auto"`` values as ``transformers.integrations.deepspeed.
  HfTrainerDeepSpeedConfig.trainer_config_process`` does (the DeepSpeed reader applies them).
- axolotl's training YAML (``adapter``, ``lora_*``, ``sequence_len``, ``micro_batch_size``...).
- LLaMA-Factory's training YAML (``finetuning_type``, ``lora_rank``, ``lora_target``,
  ``quantization_bit``, ``cutoff_len``...).

Files are data: YAML is read with ``yaml.safe_load`` (no tags, no code), JSON with ``json``.

Where each part lives (specs/): ``trainfile_reader`` (``TrainingFile``, the file read as a
mapping, typed key access, the readers the formats share), ``trainfile_accelerate``,
``trainfile_hf_args`` (also ``_HF_OPTIM``, the ``optim`` names), ``trainfile_axolotl`` and
``trainfile_llama_factory``. This module keeps ``FORMATS`` and ``read_training_file`` and
re-exports their names, public and private, so ``from zeroplan.specs.training_files import ...``
keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from zeroplan._util import InputError
from zeroplan.specs.trainfile_accelerate import (  # noqa: F401
    _ACC_DS_KEYS,
    _ACC_KEYS,
    _ACC_OFFLOAD,
    _accelerate_inline_ds,
    read_accelerate_config,
)
from zeroplan.specs.trainfile_axolotl import _axolotl_optimizer, read_axolotl  # noqa: F401
from zeroplan.specs.trainfile_hf_args import _HF_OPTIM, read_hf_args  # noqa: F401
from zeroplan.specs.trainfile_llama_factory import read_llama_factory  # noqa: F401
from zeroplan.specs.trainfile_reader import (  # noqa: F401
    MAX_FILE_BYTES,
    TrainingFile,
    _ds_path,
    _load_mapping,
    _precision,
    _Reader,
    _storage,
)

__all__ = ["TrainingFile", "read_accelerate_config", "read_hf_args", "read_axolotl", "read_llama_factory",
           "read_training_file", "FORMATS"]

FORMATS: dict[str, Callable[[str | Path], TrainingFile]] = {
    "accelerate": read_accelerate_config,
    "hf-args": read_hf_args,
    "axolotl": read_axolotl,
    "llama-factory": read_llama_factory,
}


def read_training_file(fmt: str, path: str | Path) -> TrainingFile:
    if fmt not in FORMATS:
        raise InputError(f"training file format {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt](path)
