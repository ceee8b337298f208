"""`zeroplan estimate`: per-GPU memory, communication and time for ZeRO stages 0–3."""

from __future__ import annotations

import typer

from zeroplan.commands._common import (
    DEFAULT_COMM_MODEL, DEFAULT_MFU, Checkpointing, CommModel, DsConfig, FlashAttention, GpusPerNode, GradAccum,
    Gpus, Hardware, Json, Lenient, MicroBatch, Mfu, Model, Nodes, OffloadOptimizer, OffloadParam, Optimizer, OptimizerImpl,
    Precision, SeqLen, Stage, Strict, console, handle_errors, parse_stages, print_json,
)

__all__ = ["register", "run_estimate"]

def run_estimate(*, lenient: bool = False, **kw):
    """Library entry: returns (EstimateResult, PlanInputs).

    A ``ds_config`` DeepSpeed would refuse raises InputError (file:line, key, value, expected)
    unless ``lenient``; then its errors stay findings and the defaults are planned.
    """
    from zeroplan._util import InputError
    from zeroplan.core.inputs import build_plan_inputs, refuse_ds_errors
    from zeroplan.core.plan import ClusterSummary, EstimateResult, evaluate, model_summary, training_summary

    comm_model = kw.pop("comm_model", DEFAULT_COMM_MODEL)
    mfu = kw.pop("mfu", DEFAULT_MFU)
    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--flavour (--comm-model) {comm_model!r} is unknown; expected deepspeed or paper")
    if mfu is not None and not (0 < mfu <= 1):
        raise InputError(f"--mfu {mfu} must be in (0, 1]")
    inp = build_plan_inputs(**kw)
    if not lenient:
        refuse_ds_errors(inp.ds)
    plans = [
        evaluate(model=inp.spec, training=inp.training, zero=inp.zero(s), n_gpus=inp.n_gpus,
                 gpus_per_node=inp.gpus_per_node, hardware=inp.hardware, comm_model=comm_model, mfu=mfu)
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
        comm_model=comm_model,
        assumptions=inp.assumptions,
        ds_config_findings=list(inp.ds.findings) if inp.ds is not None else [],
        stages=plans,
    )
    return result, inp


def register(app: typer.Typer) -> None:
    @app.command("estimate")
    @handle_errors
    def estimate(
        model: Model,
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
        stage: Stage = None,
        comm_model: CommModel = DEFAULT_COMM_MODEL,
        optimizer_impl: OptimizerImpl = None,
        mfu: Mfu = DEFAULT_MFU,
        strict: Strict = False,
        lenient: Lenient = False,
        json_out: Json = False,
    ) -> None:
        """Per-GPU memory (by category and phase), host RAM, collectives and step time for ZeRO stages 0–3.

        Example: zeroplan estimate --model llama-2-70b --hardware dgx-h100 --nodes 4
        """
        result, inp = run_estimate(
            model=model, hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node,
            ds_config=ds_config, strict=strict, precision=precision, optimizer=optimizer,
            micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attention=flash_attention, offload_optimizer=offload_optimizer, offload_param=offload_param,
            stage=parse_stages(stage), comm_model=comm_model, mfu=mfu, lenient=lenient, optimizer_impl=optimizer_impl,
        )
        if json_out:
            print_json(result)
            return
        from zeroplan.report.render import render_estimate

        render_estimate(console(), result, ds_findings=(inp.ds.findings if inp.ds is not None else []))
