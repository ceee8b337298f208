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
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from zeroplan._util import InputError, read_text_file
from zeroplan.specs.finetune import ALL_LINEAR, FineTune, LoraSpec, QuantSpec

__all__ = ["TrainingFile", "read_accelerate_config", "read_hf_args", "read_axolotl", "read_llama_factory",
           "read_training_file", "FORMATS"]

MAX_FILE_BYTES = 4 * 1024 * 1024


class TrainingFile(BaseModel):
    """What a training file says about the run; None = the file does not say."""

    source: str
    format: str
    model: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    precision: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    seq_len: int | None = None
    checkpointing: str | None = None
    optimizer: str | None = None
    ds_config: str | dict | None = None  # a path (resolved against the file's folder) or an inline config
    finetune: FineTune | None = None
    ignored_keys: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _load_mapping(path: str | Path, what: str) -> dict[str, Any]:
    text = read_text_file(path, what)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise InputError(f"{path}: {what} is larger than {MAX_FILE_BYTES // 2**20} MiB")
    if str(path).endswith(".json") or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InputError(f"{path}: not valid JSON ({exc})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise InputError(f"{path}{at}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
        except RecursionError:
            raise InputError(f"{path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    return data


class _Reader:
    """Typed access to one file's keys; remembers which keys were used."""

    def __init__(self, data: dict[str, Any], where: str):
        self.data = data
        self.where = where
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def int(self, key: str, lo: int = 1, hi: int = 1 << 40) -> int | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise InputError(f"{self.where}: {key} = {v!r}; expected an integer from {lo} to {hi}")
        return v

    def bool(self, key: str) -> bool | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no"):
            return v.lower() in ("true", "yes")
        if not isinstance(v, bool):
            raise InputError(f"{self.where}: {key} = {v!r}; expected true or false")
        return v

    def choice(self, key: str, allowed: tuple[str, ...]) -> str | None:
        v = self.raw(key)
        if v is None:
            return None
        s = str(v).lower()
        if s not in allowed:
            raise InputError(f"{self.where}: {key} = {v!r}; expected one of {', '.join(allowed)}")
        return s

    def str(self, key: str) -> str | None:
        v = self.raw(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"{self.where}: {key} = {v!r}; expected a non-empty string")
        return v

    def names(self, key: str) -> tuple[str, ...] | None:
        """A list of module names, or a comma-separated string of them."""
        v = self.raw(key)
        if v is None:
            return None
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
            raise InputError(f"{self.where}: {key} = {v!r}; expected a list of module names")
        return tuple(x.strip() for x in items)

    def ignored(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.used)

    def refuse_unknown(self, known: frozenset[str]) -> None:
        """Every key must be one the format defines (Accelerate's config is a closed set)."""
        for k in self.data:
            if k not in known:
                near = difflib.get_close_matches(str(k), sorted(known), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise InputError(f"{self.where}: unknown key {k!r}{hint}; expected one of the format's keys")

    def refuse_typos(self) -> None:
        """Open formats (axolotl, LLaMA-Factory, Trainer arguments) have hundreds of keys that do not
        change memory; those are listed as ignored. A key one typo away from a key that does is an
        error, so that ``micro_batch_sise: 64`` is not planned with the default."""
        for k in self.ignored():
            near = difflib.get_close_matches(str(k), sorted(self.used), n=1, cutoff=0.88)
            if near and near[0] not in self.data:
                raise InputError(f"{self.where}: unknown key {k!r}; did you mean {near[0]!r}?")


def _precision(r: _Reader, bf16_key: str = "bf16", fp16_key: str = "fp16") -> str | None:
    bf = r.raw(bf16_key)
    fp = r.raw(fp16_key)
    on = lambda v: v is True or (isinstance(v, str) and v.lower() in ("true", "auto"))  # noqa: E731
    if on(bf) and on(fp) and not (bf == "auto" and fp == "auto"):
        raise InputError(f"{r.where}: {bf16_key} and {fp16_key} are both enabled; expected at most one")
    if on(bf) and bf != "auto":
        return "bf16"
    if on(fp) and fp != "auto":
        return "fp16"
    if bf == "auto":  # axolotl: bf16: auto = bf16 where the GPU supports it
        return "bf16"
    return None


def _storage(precision: str | None) -> str:
    return {"fp16": "float16", "fp32": "float32"}.get(precision or "bf16", "bfloat16")


def _ds_path(r: _Reader, key: str, base: Path) -> str | dict | None:
    v = r.raw(key)
    if v is None:
        return None
    if isinstance(v, dict):
        return v
    if not isinstance(v, str) or not v.strip():
        raise InputError(f"{r.where}: {key} = {v!r}; expected a path to a DeepSpeed JSON or an inline config")
    p = Path(v).expanduser()
    return str(p if p.is_absolute() else base / p)


# ---------------------------------------------------------------- Accelerate

_ACC_OFFLOAD = ("none", "cpu", "nvme")
# accelerate.commands.config.config_args.ClusterConfig / BaseConfig fields
_ACC_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "deepspeed_config", "fsdp_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "tpu_name", "tpu_zone", "tpu_use_cluster",
    "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config", "iam_role_name",
    "image_uri", "downcast_bf16", "ipex_config", "fp8_config",
})
# the deepspeed_config keys `accelerate config` writes (accelerate.utils.dataclasses.DeepSpeedPlugin)
_ACC_DS_KEYS = frozenset({
    "deepspeed_config_file", "gradient_accumulation_steps", "gradient_clipping", "zero_stage",
    "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names",
    "transformer_moe_cls_names",
})


def read_accelerate_config(path: str | Path) -> TrainingFile:
    where = str(path)
    r = _Reader(_load_mapping(path, "Accelerate config"), where)
    r.refuse_unknown(_ACC_KEYS)
    dist = r.raw("distributed_type")
    if dist is not None and str(dist).upper() != "DEEPSPEED":
        raise InputError(f"{where}: distributed_type = {dist!r}; zeroplan plans DeepSpeed runs (expected DEEPSPEED)")
    procs = r.int("num_processes")
    machines = r.int("num_machines")
    if procs is not None and machines is not None and procs % machines:
        raise InputError(f"{where}: num_processes {procs} is not divisible by num_machines {machines}")
    mp = r.choice("mixed_precision", ("no", "fp16", "bf16", "fp8"))
    if mp == "fp8":
        raise InputError(f"{where}: mixed_precision = 'fp8' is not planned by zeroplan; expected no, fp16 or bf16")
    precision = {"no": "fp32", None: None}.get(mp, mp)
    out = TrainingFile(source=where, format="accelerate", gpus=procs, nodes=machines, precision=precision)
    dsc = r.raw("deepspeed_config")
    if dsc is not None:
        if not isinstance(dsc, dict):
            raise InputError(f"{where}: deepspeed_config = {dsc!r}; expected a mapping")
        sub = _Reader(dsc, f"{where}: deepspeed_config")
        sub.refuse_unknown(_ACC_DS_KEYS)
        file_ = _ds_path(sub, "deepspeed_config_file", Path(where).resolve().parent)
        inline_keys = [k for k in dsc if k not in ("deepspeed_config_file", "zero3_init_flag", "zero3_save_16bit_model",
                                                     "deepspeed_multinode_launcher", "deepspeed_hostfile")]
        if file_ is not None and inline_keys:
            # accelerate: "When using `deepspeed_config_file`, the following accelerate config variables
            # will be ignored" — and it refuses them (DeepSpeedPlugin._deepspeed_config_checks)
            raise InputError(f"{where}: deepspeed_config has both deepspeed_config_file and {', '.join(sorted(inline_keys))}; "
                             "Accelerate refuses that: put them in the DeepSpeed JSON")
        if file_ is not None:
            out.ds_config = file_
        else:
            out.ds_config = _accelerate_inline_ds(sub, precision)
            out.grad_accum = out.ds_config.get("gradient_accumulation_steps") if isinstance(out.ds_config, dict) else None
        sub.raw("zero3_init_flag")
        sub.raw("zero3_save_16bit_model")
        out.ignored_keys += [f"deepspeed_config.{k}" for k in sub.ignored()]
    out.ignored_keys = r.ignored() + out.ignored_keys
    return out


def _accelerate_inline_ds(sub: _Reader, precision: str | None) -> dict:
    """DeepSpeedPlugin.__post_init__: the inline keys become a DeepSpeed config."""
    stage = sub.int("zero_stage", lo=0, hi=3)
    gas = sub.int("gradient_accumulation_steps")
    clip = sub.raw("gradient_clipping")
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": gas if gas is not None else 1,
        "zero_optimization": {"stage": 2 if stage is None else stage},
    }
    for key, sect in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        dev = sub.choice(key, _ACC_OFFLOAD)
        if dev is not None and dev != "none":
            ds["zero_optimization"][sect] = {"device": dev}
    if clip is not None:
        ds["gradient_clipping"] = clip
    if precision in ("bf16", "fp16"):
        ds[precision] = {"enabled": True}
    return ds


# ---------------------------------------------------------------- HF Trainer / TRL

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
    optim = r.str("optim")
    if optim is not None:
        if optim not in _HF_OPTIM:
            raise InputError(f"{where}: optim = {optim!r} is not planned; expected one of {', '.join(sorted(_HF_OPTIM))}")
        out.optimizer = _HF_OPTIM[optim]
    out.ds_config = _ds_path(r, "deepspeed", Path(where).resolve().parent)
    r.refuse_typos()
    out.ignored_keys = r.ignored()
    return out


# ---------------------------------------------------------------- axolotl

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


# ---------------------------------------------------------------- LLaMA-Factory

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
    optim = r.str("optim")
    if optim is not None:
        if optim not in _HF_OPTIM:
            raise InputError(f"{where}: optim = {optim!r} is not planned; expected one of {', '.join(sorted(_HF_OPTIM))}")
        out.optimizer = _HF_OPTIM[optim]
    out.ds_config = _ds_path(r, "deepspeed", Path(where).resolve().parent)
    r.refuse_typos()
    out.ignored_keys = r.ignored()
    return out


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
