"""`zeroplan check`: the CI gate over DeepSpeed configs (exit 0 pass, 1 fail, 2 bad input)."""

from __future__ import annotations

from typing import Any, List, Optional

import typer

from zeroplan.commands._common import console, handle_errors
from zeroplan.commands.estimate import (
    COMM_OPT,
    FLASH_OPT,
    GAS_OPT,
    GPN_OPT,
    GPUS_OPT,
    HARDWARE_OPT,
    MFU_OPT,
    MODEL_OPT,
    NODES_OPT,
    SEQ_OPT,
)

__all__ = ["register", "render_check_text", "FORMATS"]

FORMATS = ("text", "json", "junit", "github")


def render_check_text(con: Any, report: Any) -> None:
    """Findings grouped per file, with the plan's headline numbers."""
    from rich.markup import escape

    from zeroplan.report.render import gb

    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for f in report.files:
        verdict = "[green]PASS[/]" if f.verdict == "pass" else "[red]FAIL[/]"
        head = f"{verdict} [bold]{f.path}[/]"
        p = f.plan
        if p is not None:
            off = [x for x in (f"optimizer→{p.offload_optimizer}" if p.offload_optimizer != "none" else "",
                               f"params→{p.offload_param}" if p.offload_param != "none" else "") if x]
            head += (f"  ZeRO-{p.stage}{' (' + ', '.join(off) + ')' if off else ''}, {p.precision}, micro-batch "
                     f"{p.micro_batch} × grad-accum {p.grad_accum}: peak {gb(p.peak_bytes)} of {gb(p.gpu_memory_bytes)}"
                     + (f", comm share {p.comm_share:.0%}" if p.comm_share is not None else ""))
        con.print(head, markup=True, highlight=False)
        for x in f.findings:
            where = f"{f.path}:{x.line}" if x.line else f.path
            key = f" [{x.key}]" if x.key else ""
            con.print(f"  [{colors.get(x.severity, 'white')}]{x.severity:7}[/] {x.rule_id} "
                      + escape(f"{where}{key}: {x.message}"), markup=True, highlight=False)
    c = report.counts
    con.print(f"[bold]{report.verdict.upper()}[/]: {len(report.files)} config(s) for {report.model} on "
              f"{report.cluster.n_gpus} × {report.cluster.gpu} ({report.hardware}); {c['error']} error(s), "
              f"{c['warning']} warning(s), {c['info']} info; failing at {report.fail_on}", markup=True, highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("check")
    @handle_errors
    def check_cmd(
        configs: List[str] = typer.Argument(..., help="DeepSpeed config files or globs (quote globs: 'configs/**/*.json')."),
        model: str = MODEL_OPT,
        hardware: Optional[str] = HARDWARE_OPT,
        gpus: Optional[int] = GPUS_OPT,
        nodes: Optional[int] = NODES_OPT,
        gpus_per_node: Optional[int] = GPN_OPT,
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", "-b", help="Micro-batch per GPU when the config leaves it \"auto\" or unset (overrides the config)."),
        seq_len: int = SEQ_OPT,
        grad_accum: Optional[int] = GAS_OPT,
        checkpointing: str = typer.Option("none", "--checkpointing", help="Activation checkpointing the training script uses: none, selective or full (not a DeepSpeed key)."),
        flash_attention: bool = FLASH_OPT,
        fail_on: str = typer.Option("error", "--fail-on", help="Fail (exit 1) on findings at or above this severity: error or warning."),
        fmt: str = typer.Option("text", "--format", "-f", help="text, json, junit (JUnit XML) or github (workflow annotations)."),
        max_comm_share: float = typer.Option(0.5, "--max-comm-share", help="ZP201: warn when exposed communication exceeds this share of the step."),
        min_headroom: float = typer.Option(0.10, "--min-headroom", help="ZP103: warn when free GPU memory is under this fraction."),
        comm_model: str = COMM_OPT,
        mfu: Optional[float] = MFU_OPT,
        output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report to this file (atomically); stdout gets a one-line verdict."),
    ) -> None:
        """Gate DeepSpeed configs in CI: OOM, host RAM, NVMe, communication and stage/offload rules.

        Exit 0 when no finding reaches --fail-on, 1 when one does, 2 on bad input (unknown model or
        profile, a glob matching nothing). Example:
        zeroplan check 'configs/*.json' -m llama-2-70b -H h100-8x-ib400 --nodes 4 --format github
        """
        from zeroplan._util import InputError, atomic_write_text
        from zeroplan.advice.check import run_check
        from zeroplan.report.formats import summary_line, to_github, to_json, to_junit

        if fmt not in FORMATS:
            raise InputError(f"--format {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")
        if fail_on not in ("error", "warning"):
            raise InputError(f"--fail-on {fail_on!r} is unknown; expected error or warning")
        report = run_check(
            configs, fail_on=fail_on, model=model, hardware=hardware, gpus=gpus, nodes=nodes,
            gpus_per_node=gpus_per_node, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
            checkpointing=checkpointing, flash_attention=flash_attention, comm_model=comm_model, mfu=mfu,
            max_comm_share=max_comm_share, min_headroom=min_headroom,
        )
        if fmt == "text":
            if output is not None:
                from io import StringIO

                from rich.console import Console

                buf = StringIO()
                render_check_text(Console(file=buf, width=120, no_color=True, highlight=False), report)
                text = buf.getvalue()
            else:
                render_check_text(console(), report)
                text = None
        else:
            text = {"json": to_json, "junit": to_junit, "github": to_github}[fmt](report)
            if output is None:
                import sys

                sys.stdout.write(text)
                sys.stdout.flush()
        if output is not None:
            atomic_write_text(output, text)
            console().print(summary_line(report), markup=False, highlight=False)
        raise typer.Exit(report.exit_code)
