"""Accelerate's ``default_config.yaml`` (``accelerate config``): ``num_processes`` (total GPUs),
``num_machines``, ``mixed_precision`` and ``deepspeed_config``, either a ``deepspeed_config_file``
or inline keys turned into a DeepSpeed config the way
``accelerate.utils.dataclasses.DeepSpeedPlugin.__post_init__`` builds one. Accelerate's keys are
a closed set: an unknown key is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroplan._util import InputError
from zeroplan.specs.trainfile_reader import TrainingFile, _ds_path, _load_mapping, _Reader

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
