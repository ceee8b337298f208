"""Turn the common planning options into library inputs (model, hardware, training, ZeRO configs).

Library code below advice (it was commands/_inputs.py): shared by estimate, recommend, check,
report and nccl-log. Every user mistake raises
InputError naming the option or file, the value and what was expected.

Two imports sit inside the function that needs them: the DeepSpeed config reader
(``specs.ds_reader``) where a ``--ds-config`` is read, and the profile reader
(``specs.hardware_load``: TOML, sanity checks) where a ``--hardware`` is loaded, so a plan from a
catalog name alone neither compiles nor runs them (issue 14: the cold start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zeroplan._util import InputError
from zeroplan.core.ds_config_inputs import (  # noqa: F401
    _FALLBACK,
    _META_CHECKS,
    CHECKPOINTING,
    _where,
    annotate_ds_config,
    grad_accum_dtype_from_config,
    optimizer_impl_from_config,
    planning_metadata,
    refuse_ds_errors,
)
from zeroplan.core.finetune import FineTuneViews
from zeroplan.core.option_checks import (  # noqa: F401 - MAX_* and OFFLOAD_DEVICES are re-exported
    MAX_GPUS, MAX_OPTION_VALUES, OFFLOAD_DEVICES, check_bound, checked_options, unused_offload_notes,
)
from zeroplan.core.finetune_inputs import (
    FineTuneOptions, fill_from_file, fill_from_record, read_training_files, resolve_finetune,
)
from zeroplan.specs.ds_keys import ZEROPLAN_KEY
from zeroplan.specs.ds_schema import DSConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zeroplan.specs.hardware_schema import HardwareProfile
from zeroplan.specs.model import ModelSpec, load_model
from zeroplan.specs.training import (
    ACTIVATION_IMPLS, GRAD_ACCUM_DTYPES, KERNELS, TrainingSetup, get_optimizer, get_precision,
)

if TYPE_CHECKING:  # read_training_files loads the readers only when a file is given
    from zeroplan.specs.trainfile_reader import TrainingFile

__all__ = [
    "PlanInputs", "build_plan_inputs", "zero_for_stage", "OFFLOAD_DEVICES", "CHECKPOINTING", "DEFAULT_SEQ_LEN",
    "ZEROPLAN_KEY", "refuse_ds_errors", "annotate_ds_config", "planning_metadata", "optimizer_impl_from_config",
    "grad_accum_dtype_from_config",
]

DEFAULT_SEQ_LEN = 2048
DEFAULT_CHECKPOINTING = "none"
DEFAULT_FLASH_ATTENTION = True


@dataclass
class PlanInputs:
    spec: ModelSpec
    hardware: HardwareProfile | None
    training: TrainingSetup
    n_gpus: int
    gpus_per_node: int
    nodes: int
    ds: DSConfig | None = None
    finetune: FineTuneViews | None = None  # trainable vs frozen (core/finetune.py); None = full training
    stages: list[int] = field(default_factory=list)
    offload_optimizer: str | None = None
    offload_param: str | None = None
    assumptions: list[str] = field(default_factory=list)

    def zero(self, stage: int) -> ZeroConfig:
        return zero_for_stage(self, stage)


def zero_for_stage(inp: PlanInputs, stage: int) -> ZeroConfig:
    """The ZeroConfig for ``stage``: the DeepSpeed config's if given, else DeepSpeed's defaults."""

    if inp.ds is not None:
        base = inp.ds.zero
        upd: dict[str, Any] = {"stage": stage}
        if base.stage != stage and "overlap_comm" not in (inp.ds.raw.get("zero_optimization") or {}):
            upd["overlap_comm"] = stage == 3
        zero = base.model_copy(update=upd)
    else:
        zero = ZeroConfig(stage=stage, overlap_comm=stage == 3)
    if inp.offload_optimizer is not None:
        dev = inp.offload_optimizer if stage >= 1 else "none"
        zero = zero.model_copy(update={"offload_optimizer": zero.offload_optimizer.model_copy(update={"device": dev})})
    elif stage == 0 and zero.offload_optimizer.device != "none":
        zero = zero.model_copy(update={"offload_optimizer": OffloadOptimizerConfig()})
    if inp.offload_param is not None:
        dev = inp.offload_param if stage == 3 else "none"
        zero = zero.model_copy(update={"offload_param": zero.offload_param.model_copy(update={"device": dev})})
    elif stage != 3 and zero.offload_param.device != "none":
        zero = zero.model_copy(update={"offload_param": OffloadParamConfig()})
    return zero


def _refuse_too_many_gpus(n_gpus: int) -> None:
    if n_gpus > MAX_GPUS:
        raise InputError(f"{n_gpus:,} GPUs: zeroplan plans clusters of up to {MAX_GPUS:,} data-parallel GPUs "
                         "(the stage-1/2 bucket ledger is linear in the GPU count)")


def _cluster_shape(gpus: int | None, nodes: int | None, gpus_per_node: int | None, hw: HardwareProfile | None,
                   assumptions: list[str]) -> tuple[int, int, int]:
    """(GPUs, GPUs per node, nodes) from the options and the hardware profile."""
    gpn = gpus_per_node or (hw.node.gpus_per_node if hw is not None else None)
    if gpus is not None:  # the cap first: a count this large is not worth a divisibility hint
        _refuse_too_many_gpus(gpus)
    if gpus is not None and nodes is not None:
        gpn = gpn or max(1, gpus // nodes)
        if gpus != nodes * gpn:
            raise InputError(f"--gpus {gpus} does not equal --nodes {nodes} × {gpn} GPUs per node")
        n_gpus = gpus
    elif nodes is not None:
        if gpn is None:
            raise InputError("--nodes needs --gpus-per-node or a --hardware profile that says how many GPUs a node has")
        n_gpus = nodes * gpn
    elif gpus is not None:
        n_gpus = gpus
        if gpn is None:
            gpn = gpus
            assumptions.append(f"all {gpus} GPUs assumed in one node (give --gpus-per-node or --hardware)")
        elif gpus > gpn and gpus % gpn:
            raise InputError(f"--gpus {gpus} is not divisible by {gpn} GPUs per node; use whole nodes or set --gpus-per-node")
    else:
        n_gpus = gpn or 8
        gpn = gpn or 8
        assumptions.append(f"no --gpus/--nodes given: one node of {n_gpus} GPUs")
    _refuse_too_many_gpus(n_gpus)
    gpn = min(gpn, n_gpus)
    n_nodes = -(-n_gpus // gpn)
    return n_gpus, gpn, n_nodes


def _from_metadata(meta: dict[str, Any], ds_config: str | None, seq_len: int | None, checkpointing: str | None,
                   flash_attention: bool | None, assumptions: list[str]) -> tuple[int, str, bool]:
    """Sequence length, checkpointing and flash attention: the option, else the config's ``zeroplan``
    block (said in the assumptions), else the default."""
    for name, flag, value in (("seq_len", "--seq-len", seq_len), ("checkpointing", "--checkpointing", checkpointing),
                              ("flash_attention", "--flash-attention", flash_attention)):
        if value is None and name in meta:
            assumptions.append(f"{name.replace('_', ' ')} {meta[name]} from {ds_config}: {ZEROPLAN_KEY}.{name} "
                               f"(give {flag} to override)")
    seq_len = seq_len if seq_len is not None else meta.get("seq_len", DEFAULT_SEQ_LEN)
    checkpointing = checkpointing if checkpointing is not None else meta.get("checkpointing", DEFAULT_CHECKPOINTING)
    if flash_attention is None:
        flash_attention = meta.get("flash_attention", DEFAULT_FLASH_ATTENTION)
    return seq_len, checkpointing, flash_attention


def _precision_and_optimizer(precision: str | None, optimizer: str | None, ds: DSConfig | None,
                             ds_config: str | None, assumptions: list[str]) -> tuple[Any, str, Any]:
    """(precision preset, where it came from, optimizer preset): the option, else the config's, else the default."""
    if precision is not None:
        prec = get_precision(precision)
        prec_src = f"--precision {prec.name}"
    elif ds is not None:
        prec = get_precision(ds.precision)
        prec_src = f"from {ds_config}: {ds.precision_source}"
    else:
        prec = get_precision("fp32")
        prec_src = "default: fp32 (no --precision and no DeepSpeed config)"
    if optimizer is not None:
        opt = get_optimizer(optimizer)
    elif ds is not None and ds.optimizer_type:
        try:
            opt = get_optimizer(ds.optimizer_type)
        except InputError:
            opt = get_optimizer("adamw")
            assumptions.append(f"optimizer {ds.optimizer_type!r} from the DeepSpeed config is modelled as AdamW states")
    else:
        opt = get_optimizer("adamw")
    return prec, prec_src, opt


def _optimizer_step(optimizer_impl: str | None, ds: DSConfig | None, assumptions: list[str]) -> str:
    """How the optimizer step runs: --optimizer-impl, else what the config implies."""
    if optimizer_impl is not None:
        impl = optimizer_impl
        assumptions.append(f"optimizer step: {impl} (--optimizer-impl)")
    else:
        impl, why = optimizer_impl_from_config(ds)
        assumptions.append(f"optimizer step: {impl} ({why})")
    return impl


def _training_setup(*, precision: str | None, optimizer: str | None, micro_batch: int | None, grad_accum: int | None,
                    seq_len: int, checkpointing: str, flash_attention: bool, optimizer_impl: str | None,
                    expandable_segments: bool, ds: DSConfig | None, ds_config: str | None,
                    assumptions: list[str]) -> TrainingSetup:
    """Precision, optimizer and batch shape: each option, else the DeepSpeed config's, else the default."""
    prec, prec_src, opt = _precision_and_optimizer(precision, optimizer, ds, ds_config, assumptions)
    mb = micro_batch or (ds.micro_batch if ds is not None and ds.micro_batch else None) or 1
    gas = grad_accum or (ds.grad_accum if ds is not None and ds.grad_accum else None) or 1
    for flag, key, value in (("--micro-batch", "train_micro_batch_size_per_gpu", mb),
                             ("--seq-len", f"{ZEROPLAN_KEY}.seq_len", seq_len),
                             ("--grad-accum", "gradient_accumulation_steps", gas)):
        # the options were checked already (checked_options): a value beyond the bound is the config's
        check_bound(flag, f"{ds_config}: {key} = {value:,}", value)
    impl = _optimizer_step(optimizer_impl, ds, assumptions)
    acc = grad_accum_dtype_from_config(ds)
    assert acc is None or acc in GRAD_ACCUM_DTYPES
    training = TrainingSetup(
        precision=prec, precision_source=prec_src, optimizer=opt, micro_batch=mb, seq_len=seq_len,
        grad_accum=gas, checkpointing=checkpointing, flash_attention=flash_attention,
        optimizer_impl=impl, grad_accum_dtype=acc, expandable_segments=expandable_segments,
    )
    assumptions.append(f"precision {prec.name} ({prec_src})")
    return training


def _activation_code(training: TrainingSetup, option: str | None, meta: dict[str, Any], ds: DSConfig | None,
                     ds_config: str | None, assumptions: list[str]) -> TrainingSetup:
    """Which code computes the activations (``--activations``, else the config's ``zeroplan.activations``,
    else transformers) and, for Megatron-LM, DeepSpeed's ``activation_checkpointing`` block, which it
    calls through ``deepspeed.checkpointing`` (transformers' checkpointing does not read the block)."""
    if option is not None and option not in ACTIVATION_IMPLS:
        raise InputError(f"--activations {option!r} is unknown; expected one of {', '.join(ACTIVATION_IMPLS)}")
    impl = option if option is not None else meta.get("activations", training.activation_impl)
    if impl == training.activation_impl:
        return training
    ac = ds.activation_checkpointing if ds is not None else None
    source = "--activations" if option is not None else f"{ds_config}: {ZEROPLAN_KEY}.activations"
    assumptions.append(f"activations of {impl} (from {source})"
                       + (f"; DeepSpeed activation checkpointing: partition_activations {ac.partition_activations}, "
                          f"cpu_checkpointing {ac.cpu_checkpointing}" if ac is not None else ""))
    return training.model_copy(update={
        "activation_impl": impl,
        "cpu_checkpointing": bool(ac and ac.cpu_checkpointing),
        "partition_activations": bool(ac and ac.partition_activations)})


def _kernels(training: TrainingSetup, option: str | None, meta: dict[str, Any], ds_config: str | None,
             tf: TrainingFile | None, assumptions: list[str]) -> TrainingSetup:
    """How the element-wise kernels run: ``--kernels``, else what a training file implies (transformers'
    code, fused by Liger or torch.compile or not), else the config's ``zeroplan.kernels``, else fused."""
    if option is not None and option not in KERNELS:
        raise InputError(f"--kernels {option!r} is unknown; expected one of {', '.join(KERNELS)}")
    said = False  # a training file's choice is said even where it is the default: the file decided it
    if option is not None:
        kernels, source = option, "--kernels"
    elif tf is not None and tf.kernels is not None:
        kernels, source, said = tf.kernels, tf.kernels_why, True
    else:
        kernels, source = meta.get("kernels", training.kernels), f"{ds_config}: {ZEROPLAN_KEY}.kernels"
    if kernels == training.kernels and not said:
        return training
    assumptions.append(f"element-wise kernels: {kernels} (from {source})")
    return training.model_copy(update={"kernels": kernels})


def _config_label(ds_config: str | dict[str, Any] | None, tf: TrainingFile | None) -> str:
    """How messages name the DeepSpeed config: its path, or where an inline one came from (a training file's
    ``deepspeed`` object), never the object itself."""
    if not isinstance(ds_config, dict):
        return str(ds_config)
    return f"{tf.source}: its inline DeepSpeed config" if tf is not None else "<config dict>"


def _load_config(ds_config: str | dict[str, Any] | None, *, strict: bool, spec: ModelSpec, precision: str | None,
                 micro_batch: int | None, grad_accum: int | None, n_gpus: int, label: str) -> DSConfig | None:
    """The DeepSpeed config read as DeepSpeed would see it on this cluster (None: no config)."""
    ds = None
    if ds_config is not None:
        if precision is not None:
            get_precision(precision)  # a bad --precision is the option's mistake, not the file's
        from zeroplan.specs.ds_reader import load_ds_config  # the reader, only when a config is read

        ds = load_ds_config(ds_config, strict=strict, hidden_size=spec.hidden_size, micro_batch=micro_batch,
                            grad_accum=grad_accum, world_size=n_gpus, precision=precision, label=label)
    return ds


def _stages(stage_list: list[int] | None, ds: DSConfig | None) -> list[int]:
    """The stages to plan: those given, else the config's, else all four."""
    if stage_list:
        stages = sorted(set(stage_list))
    elif ds is not None:
        stages = [ds.zero.stage]
    else:
        stages = [0, 1, 2, 3]
    return stages




def _load_hardware(hardware: str | None) -> HardwareProfile | None:
    """The hardware profile by name or path; None when none was given."""
    if hardware is None:
        return None
    from zeroplan.specs.hardware_load import load_profile  # the TOML reader and checks, only with --hardware

    return load_profile(hardware)


def build_plan_inputs(
    *,
    model: str | None = None,
    hardware: str | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    ds_config: str | None = None,
    strict: bool = False,
    precision: str | None = None,
    optimizer: str | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    grad_accum: int | None = None,
    checkpointing: str | None = None,
    flash_attention: bool | None = None,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    stage: int | list[int] | None = None,
    optimizer_impl: str | None = None,
    expandable_segments: bool = False,
    activations: str | None = None,
    kernels: str | None = None,
    method: str | None = None,
    lora_r: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: str | None = None,
    dora: bool = False,
    modules_to_save: str | None = None,
    trainable: str | None = None,
    quant_bits: int | None = None,
    double_quant: bool = True,
    quant_storage: str | None = None,
    accelerate_config: str | None = None,
    hf_args: str | None = None,
    axolotl: str | None = None,
    llama_factory: str | None = None,
) -> PlanInputs:
    """The planning inputs. ``None`` means "not given": the DeepSpeed config's value (seq_len, checkpointing,
    flash_attention, activations, kernels: its ``zeroplan`` block), else the default. ``stage``: one or a list.
    Fine-tuning options and training files: core/finetune_inputs.py (a file fills what the options leave unset)."""
    ft_opts = FineTuneOptions(method=method, lora_r=lora_r, lora_alpha=lora_alpha, lora_targets=lora_targets, dora=dora,
                              modules_to_save=modules_to_save, trainable=trainable, quant_bits=quant_bits,
                              double_quant=double_quant, quant_storage=quant_storage)
    tf = read_training_files({"accelerate_config": accelerate_config, "hf_args": hf_args, "axolotl": axolotl,
                              "llama_factory": llama_factory})
    file_notes: list[str] = []
    if tf is not None:
        filled = dict(model=model, gpus=gpus, nodes=nodes, precision=precision, micro_batch=micro_batch,
                      grad_accum=grad_accum, seq_len=seq_len, checkpointing=checkpointing, optimizer=optimizer,
                      ds_config=ds_config)
        file_notes = fill_from_file(tf, filled)
        model, gpus, nodes, precision = filled["model"], filled["gpus"], filled["nodes"], filled["precision"]
        micro_batch, grad_accum, seq_len = filled["micro_batch"], filled["grad_accum"], filled["seq_len"]
        checkpointing, optimizer, ds_config = filled["checkpointing"], filled["optimizer"], filled["ds_config"]
        if tf.nodes is not None and gpus is not None and gpus_per_node is None and gpus % tf.nodes == 0:
            gpus_per_node = gpus // tf.nodes
        ft_opts.from_file = tf.finetune
    if model is None:
        raise InputError("--model is needed (or a training file that names the base model)")
    stage_list = checked_options(gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, micro_batch=micro_batch,
                                  seq_len=seq_len, grad_accum=grad_accum, optimizer_impl=optimizer_impl, stage=stage,
                                  checkpointing=checkpointing, offload_optimizer=offload_optimizer,
                                  offload_param=offload_param)

    spec = load_model(model)
    hw = _load_hardware(hardware)
    assumptions: list[str] = []
    n_gpus, gpn, n_nodes = _cluster_shape(gpus, nodes, gpus_per_node, hw, assumptions)

    ds_label = _config_label(ds_config, tf)
    ds = _load_config(ds_config, strict=strict, spec=spec, precision=precision, micro_batch=micro_batch,
                      grad_accum=grad_accum, n_gpus=n_gpus, label=ds_label)
    meta = planning_metadata(ds) if ds is not None else {}
    seq_len, checkpointing, flash_attention = _from_metadata(meta, ds_label, seq_len, checkpointing, flash_attention,
                                                            assumptions)

    training = _training_setup(precision=precision, optimizer=optimizer, micro_batch=micro_batch,
                               grad_accum=grad_accum, seq_len=seq_len, checkpointing=checkpointing,
                               flash_attention=flash_attention, optimizer_impl=optimizer_impl,
                               expandable_segments=expandable_segments, ds=ds, ds_config=ds_label,
                               assumptions=assumptions)
    training = _kernels(_activation_code(training, activations, meta, ds, ds_label, assumptions), kernels, meta,
                        ds_label, tf, assumptions)

    stages = _stages(stage_list, ds)
    assumptions.extend(unused_offload_notes(stages, offload_optimizer, offload_param))
    if spec.approximate:
        assumptions.extend(spec.notes)
    file_notes += fill_from_record(ft_opts, meta.get("finetune"), str(ds_label))
    views, stages = resolve_finetune(spec, ft_opts, training.precision.name, stages,
                                     stage_explicit=bool(stage_list) or ds is not None)
    if not stages:
        raise InputError(f"no ZeRO stage can run this fine-tuning: {'; '.join(ft_opts.notes)}")
    assumptions.extend(file_notes + ft_opts.notes)
    return PlanInputs(
        spec=spec, hardware=hw, training=training, n_gpus=n_gpus, gpus_per_node=gpn, nodes=n_nodes, ds=ds,
        stages=stages, offload_optimizer=offload_optimizer, offload_param=offload_param, assumptions=assumptions,
        finetune=views,
    )
