"""`zeroplan check`: the CI gate over DeepSpeed configs (exit 0 pass, 1 fail, 2 bad input)."""

from __future__ import annotations

from typing import Any, List, Optional

import typer
from typing_extensions import Annotated

from zeroplan.commands._common import (
    DEFAULT_COMM_MODEL, DEFAULT_FAIL_ON, DEFAULT_HEADROOM, DEFAULT_MAX_COMM_SHARE, DEFAULT_MFU, Checkpointing,
    CommModel, FlashAttention, Kernels, GpusPerNode, GradAccum, Gpus, Hardware, Headroom, MicroBatch, Mfu, Model, Nodes,
    Optimizer, Precision, SeqLen, console, finite_float, handle_errors, with_fine_tuning_options, options_from,
    read_files,
)
from zeroplan.options import FAIL_ON, CheckOptions

__all__ = ["register", "render_check_text", "FORMATS"]

FORMATS = ("text", "json", "junit", "github")


def render_check_text(con: Any, report: Any) -> None:
    """Findings grouped per file, with the plan's headline numbers."""
    from zeroplan.report.render import esc, esc_line, gb

    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for f in report.files:
        verdict = "[green]PASS[/]" if f.verdict == "pass" else "[red]FAIL[/]"
        head = f"{verdict} [bold]{esc_line(f.path)}[/]"
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
                      + esc_line(f"{where}{key}: {x.message}"), markup=True, highlight=False)
    c = report.counts
    con.print(f"[bold]{report.verdict.upper()}[/]: {len(report.files)} config(s) for {esc(report.model)} on "
              f"{report.cluster.n_gpus} × {esc(report.cluster.gpu)} ({esc(report.hardware)}); {c['error']} error(s), "
              f"{c['warning']} warning(s), {c['info']} info; failing at {report.fail_on}", markup=True, highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("check")
    @handle_errors
    @with_fine_tuning_options
    def check_cmd(
        configs: Annotated[List[str], typer.Argument(
            metavar="CONFIG...", help="DeepSpeed config files or globs (quote globs: 'configs/**/*.json').")],
        model: Model,
        hardware: Hardware = None,
        gpus: Gpus = None,
        nodes: Nodes = None,
        gpus_per_node: GpusPerNode = None,
        precision: Precision = None,
        optimizer: Optimizer = None,
        micro_batch: MicroBatch = None,
        seq_len: SeqLen = None,
        grad_accum: GradAccum = None,
        checkpointing: Checkpointing = None,
        flash_attention: FlashAttention = None,
        kernels: Kernels = None,
        fail_on: Annotated[str, typer.Option(
            "--fail-on", metavar="error|warning",
            help="Fail (exit 1) on findings at or above this severity.")] = DEFAULT_FAIL_ON,
        fmt: Annotated[str, typer.Option(
            "--format", "-f", metavar="text|json|junit|github",
            help="Report format: text, json, junit (JUnit XML) or github (workflow annotations).")] = "text",
        max_comm_share: Annotated[float, typer.Option(
            "--max-comm-share", metavar="FRACTION", parser=finite_float,
            help="ZP201: warn when exposed communication exceeds this share of the step.")] = DEFAULT_MAX_COMM_SHARE,
        headroom: Headroom = DEFAULT_HEADROOM,
        min_headroom: Annotated[Optional[float], typer.Option(
            "--min-headroom", hidden=True, parser=finite_float, help="Old name of --headroom.")] = None,
        comm_model: CommModel = DEFAULT_COMM_MODEL,
        mfu: Mfu = DEFAULT_MFU,
        output: Annotated[Optional[str], typer.Option(
            "--output", "-o", metavar="PATH", show_default="stdout",
            help="Write the report to this file (atomically); stdout gets a one-line verdict.")] = None,
        expand_globs: Annotated[bool, typer.Option(
            "--glob/--no-glob", help="Expand each CONFIG as a glob ('configs/**/*.json'); without it paths are literal.")] = False,
        **fine_tuning: Any,
    ) -> None:
        """Gate DeepSpeed configs in CI: OOM, host RAM, NVMe, communication and stage/offload rules.

        Exit 0 when no finding reaches --fail-on, 1 when one does, 2 on bad input (unknown model or
        profile, a glob matching nothing). Sequence length, checkpointing and flash attention come from
        the options, else from the config's zeroplan block (`recommend --emit-config` writes it). Example:
        zeroplan check 'configs/*.json' -m llama-2-70b -H h100-8x-ib400 --nodes 4 --format github
        """
        from zeroplan._util import InputError, atomic_write_text, validate_output_path
        from zeroplan.api import check as check_api
        from zeroplan.api import config_paths

        output = None if output == "-" else output  # "-": stdout, as without --output
        validate_output_path(output, option="--output", inputs={"the checked config": config_paths(
            configs, expand_globs=expand_globs), **read_files(model, hardware, None, fine_tuning)})
        from zeroplan.report.formats import summary_line, to_github, to_json, to_junit

        if fmt not in FORMATS:
            raise InputError(f"--format {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")
        if fail_on not in FAIL_ON:
            raise InputError(f"--fail-on {fail_on!r} is unknown; expected error or warning")
        if min_headroom is not None:
            headroom = min_headroom
        report = check_api(configs, options_from(CheckOptions, {**locals(), **fine_tuning}))
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
