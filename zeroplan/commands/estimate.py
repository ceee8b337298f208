"""`zeroplan estimate`: per-GPU memory, communication and time for ZeRO stages 0–3 (``zeroplan.estimate``)."""

from __future__ import annotations

from typing import Any

import typer

from zeroplan.commands._common import (
    Json, console, handle_errors, options_from, print_json, with_fine_tuning_options, with_plan_options,
)
from zeroplan.options import PlanOptions

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("estimate")
    @handle_errors
    @with_plan_options
    @with_fine_tuning_options
    def estimate(
        json_out: Json = False,
        **options: Any,
    ) -> None:
        """Per-GPU memory (by category and phase), host RAM, collectives and step time for ZeRO stages 0–3.

        Example: zeroplan estimate --model llama-2-70b --hardware dgx-h100 --nodes 4
        """
        from zeroplan.api import estimate as estimate_api

        result = estimate_api(options_from(PlanOptions, {**locals(), **options}))
        if json_out:
            print_json(result)
            return
        from zeroplan.report.render import render_estimate

        render_estimate(console(), result, ds_findings=result.ds_config_findings)
