"""Shared CLI plumbing: the planning options, error handling, JSON output, consoles.

The planning options are declared ONCE here as CLI flags (typer ``Annotated`` types) and used by
``estimate``, ``recommend``, ``check``, ``report`` and ``nccl-log``: one name, one type, one meaning
each. Their defaults are the Python API's (zeroplan/options.py, read with ``default_of``); a
command turns its parameters into the API's options model with ``options_from`` and makes one
API call. Options that a command cannot honour are not offered by it (``check`` gates the stage
and offload its config file sets, so it has no ``--stage``/``--offload-*``/``--ds-config``).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import sys
from typing import Any, Callable, List, Optional, TypeVar, get_type_hints

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError, ascii_digits
from zeroplan.options import CheckOptions, CommonOptions, RecommendOptions, ReportOptions, default_of

__all__ = [
    "handle_errors", "print_json", "console", "err_console", "fail", "parse_stages", "options_from",
    "Model", "OptionalModel", "Hardware", "Gpus", "Nodes", "GpusPerNode", "DsConfig", "Precision", "Optimizer",
    "MicroBatch",
    "SeqLen", "GradAccum", "Checkpointing", "FlashAttention", "OffloadOptimizer", "OffloadParam", "Stage",
    "Headroom", "CommModel", "OptimizerImpl", "Activations", "Mfu", "Strict", "Lenient", "Json",
    "Method", "LoraR", "LoraAlpha", "LoraTargets", "Dora", "ModulesToSave", "Trainable", "QuantBits", "DoubleQuant",
    "QuantStorage", "AccelerateConfig", "HfArgs", "Axolotl", "LlamaFactory", "LoraRanks", "GlobalBatchTarget",
    "parse_ranks", "with_fine_tuning_options", "with_plan_options", "finite_float",
    "DEFAULT_HEADROOM", "DEFAULT_MFU", "DEFAULT_COMM_MODEL", "DEFAULT_TOP", "DEFAULT_FAIL_ON",
    "DEFAULT_MAX_COMM_SHARE", "DEFAULT_MAX_NODES",
]

F = TypeVar("F", bound=Callable[..., Any])

# The defaults are the API's (zeroplan/options.py): written once, there.
DEFAULT_HEADROOM: float = default_of(RecommendOptions, "headroom")
DEFAULT_MFU: float | None = default_of(CommonOptions, "mfu")  # None: the compute model
DEFAULT_COMM_MODEL: str = default_of(CommonOptions, "comm_model")
DEFAULT_TOP: int = default_of(RecommendOptions, "top")
DEFAULT_FAIL_ON: str = default_of(CheckOptions, "fail_on")
DEFAULT_MAX_COMM_SHARE: float = default_of(CheckOptions, "max_comm_share")
DEFAULT_MAX_NODES: int = default_of(ReportOptions, "max_nodes")


def finite_float(text: str) -> float:
    """Parse a float option as typed; refuse what is not a finite number (``1e400`` would become inf
    and ``nan`` compares false with every bound), naming the text the user gave."""
    try:
        if not str(text).isascii():  # float() also reads full-width and other Unicode digits
            raise ValueError(text)
        value = float(text)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"{text!r} is not a number (ASCII digits, e.g. 0.5)") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


# ------------------------------------------------------------------------------ shared options
_MODEL_HELP = ("Catalog name (see `zeroplan models list`), a Hugging Face Hub id found in the catalog or in the "
               "local Hugging Face cache (never downloaded), a path to a config.json, or a count such as 7B, 70e9, 1.3T.")
Model = Annotated[str, typer.Option("--model", "-m", metavar="NAME|PATH|COUNT", help=_MODEL_HELP)]
OptionalModel = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="NAME|PATH|COUNT", show_default="none", help=_MODEL_HELP)]
Hardware = Annotated[Optional[str], typer.Option(
    "--hardware", "-H", metavar="NAME|PATH", show_default="none (memory only; recommend and check need one)",
    help="Hardware profile name (see `zeroplan profiles list`) or path to a profile TOML.")]
Gpus = Annotated[Optional[int], typer.Option(
    "--gpus", "-g", metavar="N", show_default="--nodes × --gpus-per-node, else one node",
    help="Total data-parallel GPUs.")]
Nodes = Annotated[Optional[int], typer.Option(
    "--nodes", "-n", metavar="N", show_default="1",
    help="Nodes; GPUs = nodes × --gpus-per-node.")]
GpusPerNode = Annotated[Optional[int], typer.Option(
    "--gpus-per-node", metavar="N", show_default="the hardware profile's, else 8",
    help="GPUs per node.")]
DsConfig = Annotated[Optional[str], typer.Option(
    "--ds-config", "-c", metavar="PATH", show_default="none",
    help="DeepSpeed JSON config to plan; its zero_optimization.stage selects the stage. A config DeepSpeed "
         "would refuse is an error (exit 2) unless --lenient.")]
Precision = Annotated[Optional[str], typer.Option(
    "--precision", "-p", metavar="fp32|bf16|fp16", show_default="from --ds-config, else fp32",
    help="Training precision: fp32 (4/4/12 bytes per parameter), bf16 or fp16 (2/2/12). Also resolves a "
         "config's \"enabled\": \"auto\".")]
Optimizer = Annotated[Optional[str], typer.Option(
    "--optimizer", metavar="NAME", show_default="from --ds-config, else adamw",
    help="adamw, adam, sgd-momentum, sgd or adam8bit.")]
MicroBatch = Annotated[Optional[int], typer.Option(
    "--micro-batch", "-b", metavar="N", show_default="from the config, else 1; recommend searches",
    help="Micro-batch size per GPU (overrides the config's train_micro_batch_size_per_gpu).")]
SeqLen = Annotated[Optional[int], typer.Option(
    "--seq-len", "-s", metavar="TOKENS", show_default="the config's zeroplan.seq_len, else 2048",
    help="Sequence length in tokens.")]
GradAccum = Annotated[Optional[int], typer.Option(
    "--grad-accum", metavar="N", show_default="from the config, else 1",
    help="Gradient accumulation steps.")]
Checkpointing = Annotated[Optional[str], typer.Option(
    "--checkpointing", metavar="none|selective|full",
    show_default="the config's zeroplan.checkpointing, else none; recommend searches",
    help="Activation checkpointing the training script uses (not a DeepSpeed switch).")]
FlashAttention = Annotated[Optional[bool], typer.Option(
    "--flash-attention/--no-flash-attention", show_default="the config's zeroplan.flash_attention, else on",
    help="Flash attention: transformers' SDPA on its fused kernels, which keep no s² attention scores (Falcon-7B's one key/value head sends SDPA to its math kernel, which keeps them). --no-flash-attention: eager attention.")]
OffloadOptimizer = Annotated[Optional[str], typer.Option(
    "--offload-optimizer", metavar="none|cpu|nvme", show_default="from --ds-config, else none",
    help="Offload optimizer states (stages 1–3).")]
OffloadParam = Annotated[Optional[str], typer.Option(
    "--offload-param", metavar="none|cpu|nvme", show_default="from --ds-config, else none",
    help="Offload parameters (stage 3).")]
Stage = Annotated[Optional[List[str]], typer.Option(
    "--stage", metavar="0-3", show_default="all four, or --ds-config's stage",
    help="ZeRO stage(s) to evaluate; repeat or separate with commas (--stage 2 --stage 3, --stage 2,3).")]
Headroom = Annotated[float, typer.Option(
    "--headroom", metavar="FRACTION", parser=finite_float,
    help="Fraction of GPU memory and host RAM to keep free (0–1): recommend only chooses configurations "
         "that leave it; check warns (ZP103) below it.")]
CommModel = Annotated[str, typer.Option(
    "--flavour", "--comm-model", metavar="deepspeed|paper",
    help="deepspeed: what DeepSpeed 0.19.8 allocates and issues; paper: the ZeRO paper's accounting (4/4/12 = 20 "
         "B/param in fp32; 2Ψ/2Ψ/3Ψ communication). --comm-model is an alias.")]
OptimizerImpl = Annotated[Optional[str], typer.Option(
    "--optimizer-impl", metavar="fused-adam|torch-foreach|torch-fused|torch-single|cpu-adam",
    show_default="from --ds-config (an optimizer block: fused-adam; none: torch-foreach), else fused-adam",
    help="How the Adam step runs on the GPU: DeepSpeed FusedAdam (no temporaries), torch AdamW foreach "
         "(4 B/element), fused, single-tensor (8 B/element of the largest tensor) or DeepSpeedCPUAdam (host).")]
Activations = Annotated[Optional[str], typer.Option(
    "--activations", metavar="transformers|megatron",
    show_default="from --ds-config's zeroplan.activations, else transformers",
    help="The code that computes activations: Hugging Face transformers (traced per family) or Megatron-LM's "
         "GPT-2 (Korthikanti's terms as DeepSpeedExamples computes them; reads DeepSpeed's "
         "activation_checkpointing block, cpu_checkpointing puts layer checkpoints in host RAM).")]
Kernels = Annotated[Optional[str], typer.Option(
    "--kernels", metavar="fused|unfused|unfused-amp",
    show_default="from --ds-config's zeroplan.kernels, else fused",
    help="How the element-wise (non-matmul) kernels run: fused (torch.compile, Liger, Megatron-LM, llm-foundry, "
         "torchtitan); unfused: transformers' modeling code op by op with the model in the training dtype (as "
         "DeepSpeed runs it, and FSDP mixed precision); unfused-amp: the same under torch.autocast with fp32 "
         "weights (DDP + AMP). Unfused code moves several times more bytes through HBM per token.")]
Mfu = Annotated[Optional[float], typer.Option(
    "--mfu", metavar="FRACTION", parser=finite_float,
    show_default="the compute model (FLOPs from the architecture at a rate by GPU "
    "generation and shape)", help="Override the compute model with a fixed model FLOPs utilisation (0–1].")]
Strict = Annotated[bool, typer.Option(
    "--strict/--no-strict",
    help="Also refuse config warnings DeepSpeed tolerates (unknown top-level keys, coerced types).")]
Lenient = Annotated[bool, typer.Option(
    "--lenient/--no-lenient",
    help="Plan a --ds-config even when DeepSpeed would refuse it (its errors become findings, defaults used).")]
Json = Annotated[bool, typer.Option(
    "--json/--no-json", help="Print one JSON object on stdout, nothing else.")]

# ---- fine-tuning (core/finetune_inputs.py); one definition for every planning command ----
Method = Annotated[Optional[str], typer.Option(
    "--method", metavar="full|lora|qlora|any", show_default="lora when LoRA options are given, else full",
    help="What trains: every weight, LoRA adapters, or LoRA on 4/8-bit base weights (QLoRA). recommend also "
         "takes any: search all three and take full if it fits, else LoRA, else QLoRA.")]
LoraRanks = Annotated[Optional[str], typer.Option(
    "--lora-ranks", metavar="R,R,...", show_default="--lora-r",
    help="recommend: search these LoRA ranks (8,16,64) and take the largest within 5% of the fastest that fits.")]
GlobalBatchTarget = Annotated[Optional[str], typer.Option(
    "--global-batch", metavar="N{K,M,G}tokens|N{K,M,G}samples", show_default="none (--grad-accum)",
    help="recommend: a global batch target, e.g. 4Mtokens or 512samples (K/M/G = 10^3/10^6/10^9; the unit is "
         "required); sets gradient accumulation = ceil(target / (micro-batch × GPUs [× seq-len])).")]
LoraR = Annotated[Optional[int], typer.Option(
    "--lora-r", metavar="R", show_default="8", help="LoRA rank (PEFT's r).")]
LoraAlpha = Annotated[Optional[float], typer.Option(
    "--lora-alpha", metavar="ALPHA", parser=finite_float, show_default="none",
    help="LoRA alpha (a scale: recorded, no effect on memory).")]
LoraTargets = Annotated[Optional[str], typer.Option(
    "--lora-targets", metavar="NAMES|all-linear", show_default="PEFT's default for the family (llama: q_proj,v_proj)",
    help="Modules that get adapters, as PEFT spells them: q_proj,k_proj,v_proj,o_proj,... or all-linear.")]
Dora = Annotated[bool, typer.Option(
    "--dora/--no-dora", help="DoRA: a magnitude vector per adapted layer on top of LoRA.")]
ModulesToSave = Annotated[Optional[str], typer.Option(
    "--modules-to-save", metavar="NAMES", show_default="none",
    help="Modules trained in full beside the adapters (PEFT modules_to_save), e.g. lm_head,embed_tokens.")]
Trainable = Annotated[Optional[str], typer.Option(
    "--trainable", metavar="GLOBS", show_default="every parameter",
    help="Partial fine-tuning: only parameters matching these globs train ('lm_head.*,model.layers.3*'), or last:K "
         "for the last K layers.")]
QuantBits = Annotated[Optional[int], typer.Option(
    "--quant-bits", metavar="4|8", show_default="4 with --method qlora",
    help="bitsandbytes quantisation of the frozen base weights (QLoRA).")]
DoubleQuant = Annotated[bool, typer.Option(
    "--double-quant/--no-double-quant",
    help="4-bit: quantise the quantisation constants too (bnb_4bit_use_double_quant).")]
QuantStorage = Annotated[Optional[str], typer.Option(
    "--quant-storage", metavar="uint8|bf16|fp16|fp32", show_default="uint8",
    help="bnb_4bit_quant_storage; ZeRO-3 needs the model dtype (bf16 for bf16 training).")]
AccelerateConfig = Annotated[Optional[str], typer.Option(
    "--accelerate-config", metavar="YAML", show_default="none",
    help="Accelerate's default_config.yaml: GPUs, nodes, precision and its DeepSpeed settings.")]
HfArgs = Annotated[Optional[str], typer.Option(
    "--hf-args", metavar="JSON|YAML", show_default="none",
    help="HF Trainer / TRL arguments: batch, accumulation, precision, checkpointing, max_seq_length, optim, deepspeed.")]
Axolotl = Annotated[Optional[str], typer.Option(
    "--axolotl", metavar="YAML", show_default="none",
    help="An axolotl training YAML (base_model, adapter, lora_*, sequence_len, micro_batch_size, deepspeed, ...).")]
LlamaFactory = Annotated[Optional[str], typer.Option(
    "--llama-factory", metavar="YAML", show_default="none",
    help="A LLaMA-Factory training YAML (model_name_or_path, finetuning_type, lora_*, quantization_bit, ...).")]


def parse_stages(values: list[str] | None) -> list[int] | None:
    """``--stage`` values (repeated and/or comma-separated) -> sorted unique stages, or None."""
    if not values:
        return None
    out: list[int] = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if part not in ("0", "1", "2", "3"):
                raise InputError(f"--stage {part or v!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
            out.append(int(part))
    return sorted(set(out))


def parse_ranks(value: str | None) -> list[int] | None:
    """``--lora-ranks 8,16,64`` -> [8, 16, 64] (sorted, unique), or None."""
    if value is None:
        return None
    out: list[int] = []
    for part in str(value).split(","):
        part = part.strip()
        if not ascii_digits(part) or int(part) < 1:
            raise InputError(f"--lora-ranks {value!r}: {part!r} is not a positive whole rank; expected e.g. 8,16,64")
        out.append(int(part))
    return sorted(set(out))


O = TypeVar("O", bound=CommonOptions)


def _fine_tuning_options(
    method: Method = None,
    lora_r: LoraR = None,
    lora_alpha: LoraAlpha = None,
    lora_targets: LoraTargets = None,
    dora: Dora = False,
    modules_to_save: ModulesToSave = None,
    trainable: Trainable = None,
    quant_bits: QuantBits = None,
    double_quant: DoubleQuant = True,
    quant_storage: QuantStorage = None,
    accelerate_config: AccelerateConfig = None,
    hf_args: HfArgs = None,
    axolotl: Axolotl = None,
    llama_factory: LlamaFactory = None,
) -> None:
    """The fine-tuning flags every planning command offers, declared once (read by its signature only)."""


def _plan_options(
    model: OptionalModel = None,
    hardware: Hardware = None,
    gpus: Gpus = None,
    nodes: Nodes = None,
    gpus_per_node: GpusPerNode = None,
    ds_config: DsConfig = None,
    precision: Precision = None,
    optimizer: Optimizer = None,
    micro_batch: MicroBatch = None,
    seq_len: SeqLen = None,
    grad_accum: GradAccum = None,
    checkpointing: Checkpointing = None,
    flash_attention: FlashAttention = None,
    offload_optimizer: OffloadOptimizer = None,
    offload_param: OffloadParam = None,
    optimizer_impl: OptimizerImpl = None,
    activations: Activations = None,
    kernels: Kernels = None,
    stage: Stage = None,
    comm_model: CommModel = DEFAULT_COMM_MODEL,
    mfu: Mfu = DEFAULT_MFU,
    strict: Strict = False,
    lenient: Lenient = False,
) -> None:
    """The options of one plan, as ``estimate``, ``report`` and ``nccl-log`` offer them, declared once
    (read by its signature only). ``recommend`` searches some of them and ``check`` reads others from
    its config, so those two list their own."""


def _with_options(fn: F, template: Callable[..., None], at: Callable[[list[inspect.Parameter]], int]) -> F:
    """``fn`` with ``template``'s parameters inserted at index ``at(own parameters)``. ``fn`` takes
    them through its ``**kwargs``; typer reads a command's parameters from ``__signature__`` and
    ``__annotations__``, so a flag list is written once and each command's ``--help`` keeps its order."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = {**get_type_hints(fn, include_extras=True), **get_type_hints(template, include_extras=True)}
    added = [p.replace(annotation=hints[p.name]) for p in inspect.signature(template).parameters.values()]
    own = [p.replace(annotation=hints[p.name]) for p in own]
    cut = at(own)

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        return fn(**kwargs)

    wrapper.__signature__ = inspect.Signature(own[:cut] + added + own[cut:])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {k: v for k, v in hints.items() if k != "return"}
    return wrapper  # type: ignore[return-value]


def with_fine_tuning_options(fn: F) -> F:
    """Add the fine-tuning flags of ``_fine_tuning_options``, before a trailing ``json_out``."""
    return _with_options(fn, _fine_tuning_options,
                         lambda own: len(own) - 1 if own and own[-1].name == "json_out" else len(own))


def with_plan_options(fn: F) -> F:
    """Add the plan's flags of ``_plan_options`` first, after the command's arguments (the
    parameters without a default)."""
    return _with_options(fn, _plan_options,
                         lambda own: next((i for i, p in enumerate(own) if p.default is not p.empty), len(own)))


def options_from(cls: type[O], params: dict[str, Any]) -> O:
    """The API options ``cls`` from a command's parameters (its ``locals()``): every parameter
    named like a field of ``cls``; ``--stage`` values parsed."""
    fields = {k: v for k, v in params.items() if k in cls.model_fields}
    if isinstance(fields.get("stage"), list):
        fields["stage"] = parse_stages(fields["stage"])
    if isinstance(fields.get("lora_ranks"), str):
        fields["lora_ranks"] = parse_ranks(fields["lora_ranks"])
    return cls(**fields)


# ------------------------------------------------------------------------------ output
def console():
    """stdout console. On a terminal rich wraps to its width; otherwise (pipes, CI logs, files) text
    is never wrapped, so one finding or sentence stays on one line (tables keep their layout)."""
    from rich.console import Console

    c = Console(highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c.soft_wrap = True
    return c


def read_files(model: str | None, hardware: str | None, ds_config: str | None,
               fine_tuning: dict[str, Any]) -> dict[str, str | None]:
    """The files a planning command reads, by option, for ``validate_output_path`` before any work: a model
    directory stands for its config.json. What is found through them (the DeepSpeed config a training file
    names, the HF cache) is refused at write time (``_util.input_guard``)."""
    if model is not None and os.path.isdir(os.path.expanduser(model)):
        model = os.path.join(model, "config.json")
    return {"--model": model, "--hardware": hardware, "--ds-config": ds_config,
            **{"--" + name.replace("_", "-"): fine_tuning.get(name)
               for name in ("accelerate_config", "hf_args", "axolotl", "llama_factory")}}


def err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(msg: str, code: int = 2) -> None:
    """Print one error line on stderr and exit with ``code`` (2 = bad input)."""
    from zeroplan.report.render import esc

    err_console().print(f"[bold red]error:[/] {esc(' '.join(str(msg).splitlines()))}")  # one line, no ANSI
    raise typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Turn InputError (a user mistake) into one stderr line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            fail(str(exc), 2)

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    """Print one JSON object on stdout, nothing else. A pydantic model (what the API returns) is
    printed as exactly ``obj.model_dump(mode="json")``."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()
