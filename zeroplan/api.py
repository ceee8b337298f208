"""zeroplan's public Python API: typed planning calls, the layer the CLI is a thin shell over.

Layers: specs → core → advice / report → **api** → commands / cli. Every call takes an options
model (zeroplan/options.py) or the same fields as keywords, and returns a pydantic model; the CLI's
``--json`` prints exactly ``result.model_dump(mode="json")``::

    import zeroplan

    result = zeroplan.estimate(model="llama-2-7b", gpus=8, precision="bf16")
    for plan in result.stages:
        print(plan.stage, plan.memory.peak)

- :func:`estimate` → :class:`~zeroplan.core.plan.EstimateResult`: per-GPU memory, communication
  and step time for the chosen ZeRO stages.
- :func:`recommend` → :class:`~zeroplan.advice.recommend.Recommendation`: the stage, offload,
  micro-batch, checkpointing and buckets to use, and why.
- :func:`check` → :class:`~zeroplan.advice.check.CheckReport`: the CI gate over DeepSpeed configs.
- :func:`build_report` → :class:`~zeroplan.report.sweep.ReportData`: plans plus sweeps over GPUs
  and nodes.
- :func:`read_nccl_log` → :class:`~zeroplan.inspect.nccl_log.NcclLogReport`.
- :func:`load_model`, :func:`load_profile`, :func:`load_ds_config`: the readers.

A user mistake (unknown model, bad value, a DeepSpeed config DeepSpeed would refuse) raises
:class:`zeroplan.InputError` naming the option or file, the value and what was
expected; an unknown field or a value of the wrong type raises pydantic's ``ValidationError``.
No call imports torch or rich.

Lazy imports (zeroplan/ARCHITECTURE.md): the heavier result types and the commands' engines
(advice, report, inspect) are imported inside the call that needs them, and ``load_ds_config`` /
``load_profile`` resolve on first access (module ``__getattr__``): a plan from a catalog name
never reads a DeepSpeed config or a profile TOML, so it neither compiles nor runs their readers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from zeroplan._util import InputError
from zeroplan.advice.peft_settings import peft_sidecar_path
from zeroplan.core.finetune_inputs import FINETUNE_KEYS, finetune_record
from zeroplan.core.inputs import MAX_GPUS, PlanInputs, annotate_ds_config, build_plan_inputs, refuse_ds_errors
from zeroplan.core.plan import ClusterSummary, EstimateResult, evaluate, model_summary, training_summary
from zeroplan.options import (
    COMM_MODELS, CheckOptions, CommonOptions, PlanOptions, RecommendOptions, ReportOptions,
)
from zeroplan.specs.ds_schema import DSConfig
from zeroplan.specs.hardware_schema import HardwareProfile
from zeroplan.specs.model import ModelSpec, load_model

if TYPE_CHECKING:  # result types of heavier modules, imported when a call needs them (see __getattr__)
    from zeroplan.advice.check import CheckReport
    from zeroplan.advice.recommend import Recommendation
    from zeroplan.inspect.nccl_log import NcclLogReport
    from zeroplan.report.sweep import ReportData
    from zeroplan.specs.ds_reader import load_ds_config
    from zeroplan.specs.hardware_load import load_profile

__all__ = [
    "estimate", "recommend", "check", "config_paths", "peft_sidecar_path", "build_report", "read_nccl_log", "plan_inputs",
    "load_model", "load_profile", "load_ds_config",
    "CommonOptions", "PlanOptions", "RecommendOptions", "CheckOptions", "ReportOptions",
    "ModelSpec", "HardwareProfile", "DSConfig", "PlanInputs", "InputError",
]

O = TypeVar("O", bound=CommonOptions)

# build_plan_inputs' keywords, in its order (they are all keyword-only): an option with one of
# these names is passed to it. Read from the code object, which costs nothing (inspect does).
_code = build_plan_inputs.__code__
_INPUT_KEYWORDS: tuple[str, ...] = _code.co_varnames[_code.co_argcount:_code.co_argcount + _code.co_kwonlyargcount]
del _code
_API_ONLY = ("expandable_segments",)  # options with no CLI flag (yet)
MAX_LORA_RANKS = 16  # LoRA ranks one recommend searches (each is a search over every configuration)
MAX_LOG_STEPS = 10**9  # optimizer steps one NCCL log can cover (a log of every collective is far shorter)


def _options(cls: type[O], options: O | None, fields: dict[str, Any]) -> O:
    """``options`` (a ``cls``), the keyword ``fields``, or both (the keywords override)."""
    if options is None:
        return cls(**fields)
    if not isinstance(options, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(options).__name__}")
    return options if not fields else cls(**{**options.model_dump(), **fields})


def plan_kwargs(options: CommonOptions) -> dict[str, Any]:
    """The options that are ``build_plan_inputs`` keywords, in its order."""
    return {k: getattr(options, k) for k in _INPUT_KEYWORDS if k in type(options).model_fields}


def _validate_model_options(options: CommonOptions) -> None:
    if options.comm_model not in COMM_MODELS:
        raise InputError(f"--flavour (--comm-model) {options.comm_model!r} is unknown; expected deepspeed or paper")
    if options.mfu is not None and not (1e-3 <= options.mfu <= 1):
        raise InputError(f"--mfu {options.mfu} must be in [0.001, 1]")


def _needs_hardware(options: CommonOptions, command: str, why: str = "") -> None:
    if not options.hardware:
        raise InputError(f"{command} needs --hardware (a profile name from `zeroplan profiles list` or a TOML path)"
                         + why)


def plan_inputs(options: CommonOptions | None = None, /, **fields: Any) -> PlanInputs:
    """The typed planning inputs (model spec, hardware, training, ZeRO configs) for the options;
    refuses a DeepSpeed config DeepSpeed would refuse unless ``lenient``."""
    opts = _options(PlanOptions if options is None else type(options), options, fields)
    inp = build_plan_inputs(**plan_kwargs(opts))
    if not getattr(opts, "lenient", False):
        refuse_ds_errors(inp.ds)
    return inp


def _estimate(opts: PlanOptions) -> tuple[EstimateResult, PlanInputs]:
    _validate_model_options(opts)
    inp = plan_inputs(opts)
    plans = [
        evaluate(model=inp.spec, training=inp.training, zero=inp.zero(s), n_gpus=inp.n_gpus, finetune=inp.finetune,
                 gpus_per_node=inp.gpus_per_node, hardware=inp.hardware, comm_model=opts.comm_model, mfu=opts.mfu)
        for s in inp.stages
    ]
    hw = inp.hardware
    result = EstimateResult(
        model=model_summary(inp.spec),
        cluster=ClusterSummary(
            n_gpus=inp.n_gpus, nodes=inp.nodes, gpus_per_node=inp.gpus_per_node,
            hardware=hw.name if hw is not None else None, gpu=hw.gpu.name if hw is not None else None,
            gpu_memory_bytes=hw.gpu.memory_bytes if hw is not None else None,
        ),
        training=training_summary(inp.training),
        comm_model=opts.comm_model,
        assumptions=inp.assumptions,
        ds_config_findings=list(inp.ds.findings) if inp.ds is not None else [],
        finetune=inp.finetune.inventory if inp.finetune is not None else None,
        stages=plans,
    )
    return result, inp


def estimate(options: PlanOptions | None = None, /, **fields: Any) -> EstimateResult:
    """Per-GPU memory (by category and phase), host RAM, collectives and step time for each ZeRO
    stage asked for (all four by default, or the DeepSpeed config's).

    ``zeroplan.estimate(model="llama-2-70b", hardware="dgx-h100", nodes=4, precision="bf16")``;
    the keywords are :class:`PlanOptions`' fields. Time figures need ``hardware``.
    """
    return _estimate(_options(PlanOptions, options, fields))[0]


def _recommend(opts: RecommendOptions, inp: PlanInputs,
               progress: Callable[[int, int], None] | None = None) -> Any:
    from zeroplan.advice.recommend import recommend as search

    return search(inp, headroom=opts.headroom, comm_model=opts.comm_model, mfu=opts.mfu,
                  max_micro_batch=opts.max_micro_batch, micro_batch=opts.micro_batch,
                  checkpointing=opts.checkpointing,
                  stages=None if opts.stage is None else ([opts.stage] if isinstance(opts.stage, int) else opts.stage),
                  allow_nvme=opts.allow_nvme, top=opts.top, progress=progress)


def recommend(options: RecommendOptions | None = None, /, *,
              progress: Callable[[int, int], None] | None = None, **fields: Any) -> Recommendation:
    """Which ZeRO stage, offload, micro-batch, checkpointing and buckets to use on this cluster, and
    why: capacity first (peak per GPU, host RAM and NVMe per node fit with ``headroom``), then the
    highest useful throughput. ``hardware`` is required.

    The chosen DeepSpeed config (``ds_config`` of the result) carries a ``zeroplan`` block with the
    sequence length, checkpointing and flash attention it was planned for, so :func:`check` reads
    them back; ``peft`` holds the PEFT / Trainer settings it assumes. ``method="any"`` or
    ``lora_ranks`` search the fine-tuning method and rank (``finetune_search``); ``global_batch``
    sets the accumulation (``global_batch`` of the result). ``progress(done, total)`` is called
    as the search runs.
    """
    from zeroplan.advice.global_batch import parse_global_batch
    from zeroplan.advice.recommend_finetune import search_finetune

    opts = _options(RecommendOptions, options, fields)
    _needs_hardware(opts, "recommend")
    if opts.top < 1:
        raise InputError(f"--top {opts.top} must be a positive integer")
    _validate_model_options(opts)
    gb = parse_global_batch(opts.global_batch) if opts.global_batch is not None else None
    if gb is not None and opts.grad_accum is not None:
        raise InputError("--global-batch sets the gradient accumulation; give it or --grad-accum, not both")
    if opts.method != "any" and opts.lora_ranks is None:
        return _recommend_one(opts, gb, progress)
    methods, ranks, notes = _finetune_variants(opts)
    rec, fs = search_finetune(lambda m, r: _recommend_one(_variant_options(opts, m, r), gb, progress),
                              methods=methods, lora_ranks=ranks, quant_bits=opts.quant_bits, notes=notes)
    rec.finetune_search = fs
    rec.explanation_reasons[:0] = fs.reasons
    rec.explanation[:0] = fs.explanation
    return rec


def _variant_options(opts: RecommendOptions, method: str, lora_r: int | None) -> RecommendOptions:
    """``opts`` for one searched variant: full training drops the LoRA and quantisation settings."""
    upd: dict[str, Any] = {"method": method, "lora_r": lora_r, "lora_ranks": None}
    if method == "full":
        upd |= {"lora_alpha": None, "lora_targets": None, "dora": False, "modules_to_save": None, "quant_bits": None,
                "quant_storage": None}
    elif method == "lora":
        upd |= {"quant_bits": None, "quant_storage": None}
    return opts.model_copy(update=upd)


def _finetune_variants(opts: RecommendOptions) -> tuple[list[str], list[int], list[str]]:
    """(methods, LoRA ranks, notes) that ``--method any`` / ``--lora-ranks`` search."""
    from zeroplan.core.finetune_inputs import DEFAULT_LORA_R

    if opts.method not in (None, "any", "full", "lora", "qlora"):
        raise InputError(f"--method {opts.method!r} is unknown; expected full, lora, qlora or any")
    if opts.lora_ranks is not None:
        if opts.method == "full":
            raise InputError("--lora-ranks with --method full; LoRA ranks need --method lora, qlora or any")
        if opts.lora_r is not None:
            raise InputError(f"--lora-r {opts.lora_r} and --lora-ranks: give one rank or the ranks to search")
        if not opts.lora_ranks or any(not 1 <= r <= 1 << 16 for r in opts.lora_ranks):
            raise InputError(f"--lora-ranks {opts.lora_ranks}: expected ranks from 1 to 65536")
        if len(set(opts.lora_ranks)) > MAX_LORA_RANKS:  # each rank is a whole recommend search
            raise InputError(f"--lora-ranks: {len(set(opts.lora_ranks)):,} ranks; expected at most "
                             f"{MAX_LORA_RANKS} to search (e.g. 8,16,32,64)")
    ranks = sorted(set(opts.lora_ranks or [opts.lora_r or DEFAULT_LORA_R]))
    qlora_note = ("QLoRA's time counts no dequantisation: bitsandbytes dequantises each 4-bit layer in every "
                  "forward and backward, so real QLoRA steps are slower than shown (its memory is modelled)")
    if opts.method != "any":
        method = opts.method or ("qlora" if opts.quant_bits or opts.quant_storage else "lora")
        return [method], ranks, [qlora_note] if method == "qlora" else []
    notes = [qlora_note]
    methods = ["full", "lora", "qlora"]
    precision = plan_inputs(_variant_options(opts, "full", None)).training.precision.name
    if precision == "fp32":
        methods.remove("qlora")
        notes = ["QLoRA not searched: it computes in bf16 or fp16 and the precision is fp32 (give --precision bf16)"]
    return methods, ranks, notes


def _recommend_one(opts: RecommendOptions, gb: tuple[int, str] | None,
                   progress: Callable[[int, int], None] | None) -> Recommendation:
    """One search (one method and rank); with ``gb`` (target, unit) the accumulation that reaches it."""
    from zeroplan.advice.global_batch import fit_global_batch
    from zeroplan.advice.peft_settings import peft_settings

    inp = plan_inputs(opts)
    if gb is None:
        rec = _recommend(opts, inp, progress)
    else:
        def run(**kw: Any) -> Any:
            o = opts.model_copy(update=kw)
            return _recommend(o, plan_inputs(o), progress)

        rec, chosen_gb = fit_global_batch(run, *gb, data_parallel=inp.n_gpus, seq_len=inp.training.seq_len,
                                          micro_batch=opts.micro_batch, max_micro_batch=opts.max_micro_batch)
        rec.global_batch = chosen_gb
        if rec.global_batch is not None:
            rec.explanation_reasons.insert(0, rec.global_batch.reason)
            rec.explanation.insert(0, rec.global_batch.sentence)
    rec.finetune = inp.finetune.inventory if inp.finetune is not None else None
    if rec.ds_config is not None and rec.chosen is not None:
        rec.ds_config = annotate_ds_config(
            rec.ds_config, seq_len=inp.training.seq_len, checkpointing=rec.chosen.checkpointing,
            flash_attention=inp.training.flash_attention, model=inp.spec.name,
            hardware=inp.hardware.name if inp.hardware is not None else None, n_gpus=inp.n_gpus,
            finetune=finetune_record(inp.finetune), activations=inp.training.activation_impl,
            kernels=inp.training.kernels)
        rec.peft = peft_settings(inp.finetune.finetune if inp.finetune is not None else None, rec.training,
                                 rec.chosen)
    return rec


def config_paths(configs: str | Sequence[str], *, expand_globs: bool = False) -> list[str]:
    """The config files ``check`` would read: literal paths, or globs with ``expand_globs``."""
    from zeroplan.advice.config_paths import expand_config_paths

    return expand_config_paths([configs] if isinstance(configs, str) else list(configs), expand_globs=expand_globs)


def check(configs: str | Sequence[str], options: CheckOptions | None = None, /, **fields: Any) -> CheckReport:
    """Gate DeepSpeed config files (literal paths; globs, ``**`` recursive, with ``expand_globs``) against the model on the
    hardware: OOM, host RAM, NVMe, communication and stage/offload rules, plus the DeepSpeed
    reader's findings. ``hardware`` is required. The report's ``verdict`` is "fail" when a finding
    reaches ``fail_on``; ``exit_code`` is what ``zeroplan check`` exits with.
    """
    from zeroplan.advice.check import run_check

    opts = _options(CheckOptions, options, fields)
    _needs_hardware(opts, "check", ": its rules compare memory and links with the hardware")
    patterns = [configs] if isinstance(configs, str) else list(configs)
    return run_check(patterns, fail_on=opts.fail_on, **plan_kwargs(opts), comm_model=opts.comm_model,
                     mfu=opts.mfu, max_comm_share=opts.max_comm_share, min_headroom=opts.headroom,
                     expand_globs=opts.expand_globs)


def build_report(options: ReportOptions | None = None, /, *,
                 progress: Callable[[int, int], None] | None = None, **fields: Any) -> ReportData:
    """The report: the plans at the chosen cluster, every stage swept over 1, 2, 4, … GPUs up to
    ``max_nodes`` nodes (memory) and, with hardware, over whole nodes (time), and what
    :func:`recommend` chooses for the same inputs. ``progress(done, total)`` follows the sweep.
    """
    from zeroplan.report.sweep import (
        MAX_SWEEP_NODES, build_report_data, recommendation_summary, sweep_evaluations,
    )

    opts = _options(ReportOptions, options, fields)
    if not 1 <= opts.max_nodes <= MAX_SWEEP_NODES:
        raise InputError(f"--max-nodes {opts.max_nodes} must be between 1 and {MAX_SWEEP_NODES}")
    result, inp = _estimate(opts)
    on_step = None
    if progress is not None:
        total, done = sweep_evaluations(inp, opts.max_nodes), [0]

        def on_step() -> None:
            done[0] += 1
            progress(done[0], total)
    rec = None
    if inp.hardware is not None:
        # what `zeroplan recommend` chooses for the same inputs: it searches every stage and checkpointing
        searched = set(RecommendOptions.model_fields) - {"stage", "checkpointing"}
        rec = recommendation_summary(_recommend(RecommendOptions(**opts.model_dump(include=searched)), inp))
    # the options as given (the CLI's flags that were set, and --strict); API-only fields only when set
    # (fine-tuning switches, like API-only fields, only when they differ from their default)
    inputs = {k: v for k, v in plan_kwargs(opts).items()
              if v is not None and not ((k in _API_ONLY or k in FINETUNE_KEYS)
                                        and v == ReportOptions.model_fields[k].default)}
    return build_report_data(result, inp, max_nodes=opts.max_nodes, comm_model=opts.comm_model, mfu=opts.mfu,
                             inputs=inputs, recommendation=rec, on_step=on_step)


def read_nccl_log(file: str, plan: PlanOptions | None = None, /, *, steps: int = 1,
                  nranks: int | None = None) -> NcclLogReport:
    """Summarise an NCCL_DEBUG=INFO log (version, ranks, rings/trees, transports, collectives,
    warnings) and, given ``plan`` (one ZeRO stage), compare its predicted collective ledger with
    the collectives the log shows, per op and rank, over ``steps`` optimizer steps, on
    communicators of ``nranks`` ranks (default: the plan's GPUs)."""
    from zeroplan._util import LOG_MAX_BYTES, read_text_file
    from zeroplan.inspect.nccl_log import NcclLogPlan, NcclLogReport, compare_with_ledger, parse_nccl_log

    text = read_text_file(file, "NCCL log", max_bytes=LOG_MAX_BYTES)
    summary = parse_nccl_log(text)
    if summary.lines_nccl == 0 and not summary.issues and summary.nccl_version is None:
        raise InputError(f"{file}: no NCCL log lines found (expected lines such as "
                         "'host:pid:tid [0] NCCL INFO ...'; run with NCCL_DEBUG=INFO)")
    if steps < 1:
        raise InputError(f"--steps {steps} must be a positive integer")
    if steps > MAX_LOG_STEPS:
        raise InputError(f"--steps {steps:,}: expected at most {MAX_LOG_STEPS:,} optimizer steps in one log")
    if nranks is not None and not 1 <= nranks <= MAX_GPUS:
        raise InputError(f"--nranks {nranks:,}: expected a communicator size from 1 to {MAX_GPUS:,}")
    if plan is None:
        return NcclLogReport(file=str(file), summary=summary)
    _validate_model_options(plan)
    inp = plan_inputs(plan)
    if len(inp.stages) != 1:
        raise InputError("nccl-log compares one plan: give --stage or a --ds-config with zero_optimization.stage")
    stage = inp.stages[0]
    p = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(stage), n_gpus=inp.n_gpus, finetune=inp.finetune,
                 gpus_per_node=inp.gpus_per_node, hardware=inp.hardware, comm_model=plan.comm_model, mfu=plan.mfu)
    comparison = compare_with_ledger(summary, p.comm.collectives, steps=steps,
                                     nranks=nranks if nranks is not None else inp.n_gpus)
    return NcclLogReport(file=str(file), summary=summary, comparison=comparison,
                         plan=NcclLogPlan(stage=stage, n_gpus=inp.n_gpus, comm_model=plan.comm_model, model=plan.model))


def __getattr__(name: str) -> Any:
    # result types named in the signatures above, imported on first use (their modules are heavier)
    # and the file readers re-exported here (a plan from a catalog name never reads a file)
    where = {"Recommendation": "zeroplan.advice", "CheckReport": "zeroplan.advice",
             "ReportData": "zeroplan.report.sweep", "NcclLogReport": "zeroplan.inspect.nccl_log",
             "load_ds_config": "zeroplan.specs.ds_reader", "load_profile": "zeroplan.specs.hardware_load"}
    if name in where:
        import importlib

        return getattr(importlib.import_module(where[name]), name)
    raise AttributeError(f"module 'zeroplan.api' has no attribute {name!r}")
