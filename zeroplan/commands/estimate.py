"""`zeroplan estimate`: per-GPU memory, communication and time for ZeRO stages 0–3 (``zeroplan.estimate``)."""

from __future__ import annotations

from typing import Any

import typer

from zeroplan.commands._common import (
    OptionalModel,
    DEFAULT_COMM_MODEL, DEFAULT_MFU, Checkpointing, CommModel, DsConfig, FlashAttention, GpusPerNode, GradAccum,
    Gpus, Hardware, Json, Lenient, MicroBatch, Mfu, Nodes, OffloadOptimizer, OffloadParam, Optimizer,
    Activations, OptimizerImpl, Precision, SeqLen, Stage, Strict, console, handle_errors, with_fine_tuning_options, options_from, print_json,
)
from zeroplan.options import PlanOptions

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("estimate")
    @handle_errors
    @with_fine_tuning_options
    def estimate(
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
        stage: Stage = None,
        comm_model: CommModel = DEFAULT_COMM_MODEL,
        optimizer_impl: OptimizerImpl = None,
        activations: Activations = None,
        mfu: Mfu = DEFAULT_MFU,
        strict: Strict = False,
        lenient: Lenient = False,
        json_out: Json = False,
        **fine_tuning: Any,
    ) -> None:
        """Per-GPU memory (by category and phase), host RAM, collectives and step time for ZeRO stages 0–3.

        Example: zeroplan estimate --model llama-2-70b --hardware dgx-h100 --nodes 4
        """
        from zeroplan.api import estimate as estimate_api

        result = estimate_api(options_from(PlanOptions, {**locals(), **fine_tuning}))
        if json_out:
            print_json(result)
            return
        from zeroplan.report.render import render_estimate

        render_estimate(console(), result, ds_findings=result.ds_config_findings)
