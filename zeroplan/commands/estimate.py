"""`zeroplan estimate`: per-GPU memory, communication and time for ZeRO stages 0–3."""

from __future__ import annotations

from typing import Optional

import typer

from zeroplan.commands._common import console, handle_errors, print_json

__all__ = ["register", "run_estimate"]

# Shared option declarations (also used by recommend / check / report).
MODEL_OPT = typer.Option(..., "--model", "-m", help="Catalog name (see `zeroplan models list`), path to a Hugging Face config.json, or a count such as 7B, 70e9, 1.3T.")
HARDWARE_OPT = typer.Option(None, "--hardware", "-H", help="Hardware profile name (see `zeroplan profiles list`) or path to a profile TOML.")
GPUS_OPT = typer.Option(None, "--gpus", "-g", help="Total data-parallel GPUs.")
NODES_OPT = typer.Option(None, "--nodes", "-n", help="Nodes (× --gpus-per-node, default from the profile).")
GPN_OPT = typer.Option(None, "--gpus-per-node", help="GPUs per node (default: the hardware profile's).")
DS_OPT = typer.Option(None, "--ds-config", "-c", help="DeepSpeed JSON config; its zero_optimization.stage selects the stage.")
PREC_OPT = typer.Option(None, "--precision", "-p", help="fp32 (4/4/12 bytes per param), bf16 or fp16 (2/2/12). Default: from --ds-config, else fp32.")
OPT_OPT = typer.Option(None, "--optimizer", help="adamw, adam, sgd-momentum, sgd, adam8bit (default: from --ds-config, else adamw).")
MB_OPT = typer.Option(None, "--micro-batch", "-b", help="Micro-batch size per GPU (default: from --ds-config, else 1).")
SEQ_OPT = typer.Option(2048, "--seq-len", "-s", help="Sequence length in tokens.")
GAS_OPT = typer.Option(None, "--grad-accum", help="Gradient accumulation steps (default: from --ds-config, else 1).")
CKPT_OPT = typer.Option("none", "--checkpointing", help="Activation checkpointing: none, selective or full.")
FLASH_OPT = typer.Option(True, "--flash-attention/--no-flash-attention", help="Flash attention (no s² attention-score activations).")
OFFOPT_OPT = typer.Option(None, "--offload-optimizer", help="Offload optimizer states: none, cpu or nvme (stages 1–3).")
OFFPAR_OPT = typer.Option(None, "--offload-param", help="Offload parameters: none, cpu or nvme (stage 3).")
STAGE_OPT = typer.Option(None, "--stage", help="Evaluate one ZeRO stage (0–3). Default: all four, or the --ds-config's stage.")
COMM_OPT = typer.Option("deepspeed", "--comm-model", help="deepspeed: what DeepSpeed actually issues; paper: the ZeRO paper's 2Ψ/2Ψ/3Ψ.")
MFU_OPT = typer.Option(None, "--mfu", help="Override the compute model with a fixed model FLOPs utilisation (0–1). Default: the compute model (FLOPs from the architecture at a rate by GPU generation and shape).")
JSON_OPT = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
STRICT_OPT = typer.Option(False, "--strict", help="Treat DeepSpeed config problems (unknown keys, wrong types) as errors (exit 2).")


def run_estimate(**kw):
    """Library entry: returns an EstimateResult."""
    from zeroplan._util import InputError
    from zeroplan.core.inputs import build_plan_inputs
    from zeroplan.core.plan import ClusterSummary, EstimateResult, evaluate, model_summary, training_summary

    comm_model = kw.pop("comm_model", "deepspeed")
    mfu = kw.pop("mfu", None)
    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {comm_model!r} is unknown; expected deepspeed or paper")
    if mfu is not None and not (0 < mfu <= 1):
        raise InputError(f"--mfu {mfu} must be in (0, 1]")
    inp = build_plan_inputs(**kw)
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
        model: str = MODEL_OPT,
        hardware: Optional[str] = HARDWARE_OPT,
        gpus: Optional[int] = GPUS_OPT,
        nodes: Optional[int] = NODES_OPT,
        gpus_per_node: Optional[int] = GPN_OPT,
        ds_config: Optional[str] = DS_OPT,
        precision: Optional[str] = PREC_OPT,
        optimizer: Optional[str] = OPT_OPT,
        micro_batch: Optional[int] = MB_OPT,
        seq_len: int = SEQ_OPT,
        grad_accum: Optional[int] = GAS_OPT,
        checkpointing: str = CKPT_OPT,
        flash_attention: bool = FLASH_OPT,
        offload_optimizer: Optional[str] = OFFOPT_OPT,
        offload_param: Optional[str] = OFFPAR_OPT,
        stage: Optional[int] = STAGE_OPT,
        comm_model: str = COMM_OPT,
        mfu: Optional[float] = MFU_OPT,
        strict: bool = STRICT_OPT,
        json_out: bool = JSON_OPT,
    ) -> None:
        """Per-GPU memory (by category and phase), host RAM, collectives and step time for ZeRO stages 0–3.

        Example: zeroplan estimate --model llama-2-70b --hardware dgx-h100 --nodes 4
        """
        result, inp = run_estimate(
            model=model, hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node,
            ds_config=ds_config, strict=strict, precision=precision, optimizer=optimizer,
            micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attention=flash_attention, offload_optimizer=offload_optimizer, offload_param=offload_param,
            stage=stage, comm_model=comm_model, mfu=mfu,
        )
        if json_out:
            print_json(result)
            return
        from zeroplan.report.render import render_estimate

        render_estimate(console(), result, ds_findings=(inp.ds.findings if inp.ds is not None else []))
