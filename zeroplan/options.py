"""The planning options: the public API's input models (part of the ``api`` layer).

One pydantic model per kind of call. Each option is declared once, here, with its default;
the CLI (commands/_common.py) takes its defaults from these models (``default_of``), so a
default is never written twice. ``None`` means "not given": the DeepSpeed config's value, else
the library's default (core/inputs.py: sequence length 2048, fp32, AdamW, micro-batch 1, …).

- :class:`CommonOptions`: model, cluster and training; every planning call takes them.
- :class:`PlanOptions`: plus a DeepSpeed config, offload and stages (``estimate``, ``nccl-log``).
- :class:`RecommendOptions`: plus the search's bounds (``recommend``).
- :class:`CheckOptions`: plus the gate's thresholds (``check``; the stage and offload come from
  each config file).
- :class:`ReportOptions`: plus the sweep's extent (``report``).

To add an option: declare it on the class whose calls honour it. An option whose name is a
keyword of ``core.inputs.build_plan_inputs`` is passed to it automatically (``plan_kwargs``).

This module imports pydantic only (no core, no rich, no typer), so the CLI reads its defaults
cheaply.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

from pydantic import BaseModel, ConfigDict

__all__ = [
    "FineTuneOptions", "CommonOptions", "PlanOptions", "RecommendOptions", "CheckOptions", "ReportOptions", "default_of",
    "COMM_MODELS", "FAIL_ON",
]

COMM_MODELS = ("deepspeed", "paper")
FAIL_ON = ("error", "warning")


class _Options(BaseModel):
    # defer_build: a class's validator is built on first use, so a process pays only for the
    # options it uses (the CLI reads the defaults of all of them through model_fields)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, defer_build=True)


class FineTuneOptions(_Options):
    """Fine-tuning (core/finetune_inputs.py): which parameters train, and quantised base weights.

    - ``method``: full, lora or qlora (``None``: lora when LoRA settings are given, else full);
      ``recommend`` also takes ``any`` (search all three).
    - ``lora_r``, ``lora_alpha``, ``lora_targets`` (PEFT module names, comma-separated, or
      ``all-linear``; ``None``: PEFT's default for the family), ``dora``, ``modules_to_save``.
    - ``trainable``: globs of parameter names (or ``last:K``) for partial full fine-tuning.
    - ``quant_bits`` (4 or 8), ``double_quant``, ``quant_storage`` (bnb_4bit_quant_storage: uint8,
      bf16, fp16; ZeRO-3 needs the model dtype): QLoRA's base weights.
    - ``accelerate_config`` / ``hf_args`` / ``axolotl`` / ``llama_factory``: a training file that
      fills every option left unset (the model included).
    """

    method: Optional[str] = None
    lora_r: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_targets: Optional[str] = None
    dora: bool = False
    modules_to_save: Optional[str] = None
    trainable: Optional[str] = None
    quant_bits: Optional[int] = None
    double_quant: bool = True
    quant_storage: Optional[str] = None
    accelerate_config: Optional[str] = None
    hf_args: Optional[str] = None
    axolotl: Optional[str] = None
    llama_factory: Optional[str] = None


class CommonOptions(FineTuneOptions):
    """Model, cluster and training: what every planning call takes.

    - ``model``: catalog name, Hugging Face Hub id (catalog or local cache, never downloaded),
      path to a config.json, or a parameter count such as ``"7B"``.
    - ``hardware``: hardware profile name or TOML path (``None``: memory only).
    - ``gpus`` / ``nodes`` / ``gpus_per_node``: the data-parallel cluster shape.
    - ``precision`` (fp32, bf16, fp16), ``optimizer`` (adamw, adam, sgd-momentum, sgd, adam8bit),
      ``micro_batch``, ``seq_len``, ``grad_accum``, ``checkpointing`` (none, selective, full),
      ``flash_attention``: the training setup.
    - ``kernels``: how the element-wise kernels run: ``"fused"`` (torch.compile, Liger, Megatron-LM),
      ``"unfused"`` (transformers' modeling code op by op, the module in the training dtype, as
      DeepSpeed runs it) or ``"unfused-amp"`` (the same under torch.autocast with fp32 weights);
      ``None``: the config's ``zeroplan.kernels``, else fused.
    - ``comm_model``: the flavour (``--flavour``, alias ``--comm-model``): ``"deepspeed"`` (what
      DeepSpeed 0.19.8 allocates and issues) or ``"paper"`` (the ZeRO paper's accounting).
    - ``mfu``: a fixed model FLOPs utilisation in (0, 1]; ``None``: the compute model.
    """

    model: Optional[str] = None  # may come from a training file (axolotl, LLaMA-Factory)
    hardware: Optional[str] = None
    gpus: Optional[int] = None
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    precision: Optional[str] = None
    optimizer: Optional[str] = None
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    grad_accum: Optional[int] = None
    checkpointing: Optional[str] = None
    flash_attention: Optional[bool] = None
    kernels: Optional[str] = None
    comm_model: str = "deepspeed"
    mfu: Optional[float] = None


class _ConfigOptions(_Options):
    """A DeepSpeed config to plan, and which stages.

    - ``ds_config``: path to a DeepSpeed JSON config; its ``zero_optimization.stage`` selects the stage.
    - ``stage``: one ZeRO stage or a list (``None``: all four, or the config's stage).
    - ``strict``: also refuse config warnings DeepSpeed tolerates.
    - ``lenient``: plan a config DeepSpeed would refuse (its errors become findings).
    """

    ds_config: Optional[str] = None
    stage: Union[int, List[int], None] = None
    strict: bool = False
    lenient: bool = False


class PlanOptions(CommonOptions, _ConfigOptions):
    """Everything ``estimate`` plans with. ``offload_optimizer`` / ``offload_param``: none, cpu or
    nvme (``None``: the config's, else none). ``optimizer_impl``: how the Adam step runs on the GPU
    (fused-adam, torch-foreach, torch-fused, torch-single, cpu-adam; ``None``: from the config).
    ``expandable_segments``: plan for PyTorch's ``expandable_segments:True`` allocator (API only).
    ``activations``: the code that computes activations, transformers or megatron (DeepSpeedExamples'
    Megatron-LM GPT-2, with DeepSpeed's ``activation_checkpointing`` block); ``None``: the config's
    ``zeroplan.activations``, else transformers."""

    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    optimizer_impl: Optional[str] = None
    expandable_segments: bool = False
    activations: Optional[str] = None


class RecommendOptions(CommonOptions, _ConfigOptions):
    """``recommend``'s search. ``hardware`` is required. ``headroom``: fraction of GPU memory and
    host RAM to keep free; ``max_micro_batch``: the largest micro-batch searched (``None``: 1024);
    ``allow_nvme``: consider NVMe offload; ``top``: alternatives listed.

    Fine-tuning searches (advice/recommend_finetune.py): ``method="any"`` searches full, LoRA and
    QLoRA; ``lora_ranks`` (e.g. ``[8, 16, 64]``) searches those LoRA ranks (``None``: ``lora_r``).
    ``global_batch``: a global batch target such as ``"4Mtokens"`` or ``"512samples"``
    (advice/global_batch.py); it sets the gradient accumulation."""

    headroom: float = 0.10
    max_micro_batch: Optional[int] = None
    allow_nvme: bool = True
    top: int = 8
    lora_ranks: Optional[List[int]] = None
    global_batch: Optional[str] = None


class CheckOptions(CommonOptions):
    """``check``'s gate. ``hardware`` is required. ``fail_on``: error or warning; ``headroom``: warn
    (ZP103) below this free fraction of GPU memory; ``max_comm_share``: warn (ZP201) above this
    exposed-communication share of the step."""

    fail_on: str = "error"
    headroom: float = RecommendOptions.model_fields["headroom"].default
    max_comm_share: float = 0.5
    expand_globs: bool = False  # CONFIGS are literal paths unless this is set (then globs, ** recursive)


class ReportOptions(PlanOptions):
    """``report``: ``max_nodes`` is the sweeps' extent (1, 2, 4, … nodes)."""

    max_nodes: int = 64


def default_of(cls: type[BaseModel], name: str) -> Any:
    """The default of option ``name`` on ``cls`` (the CLI's defaults come from here)."""
    return cls.model_fields[name].default
