"""`zeroplan report`: terminal charts, a self-contained HTML report (inline SVG), sweeps.

The data (what ``--json`` prints, exactly ``ReportData.model_dump(mode="json")``, and what the
HTML is drawn from) is built by ``zeroplan.build_report``; its schema is in report/sweep.py.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError, atomic_write_bytes, validate_output_path
from zeroplan.commands._common import (
    DEFAULT_MAX_NODES, Json, console, handle_errors, options_from, print_json, with_fine_tuning_options,
    with_plan_options,
    read_files,
)
from zeroplan.options import ReportOptions

__all__ = ["register"]


def _print_sweep_table(con: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    sw = data["memory_sweep"]
    table = Table(title="Per-GPU peak memory vs GPUs (GB = 10^9 bytes; * = over the GPU memory)",
                  title_justify="left")
    table.add_column("GPUs", justify="right")
    for s in sw["series"]:
        table.add_column(s["label"], justify="right")
    for i, g in enumerate(sw["gpus"]):
        table.add_row(f"{g:,}", *[f"{s['peak'][i] / 1e9:,.1f}" + ("*" if s["fits"][i] is False else "")
                                  for s in sw["series"]])
    con.print(table)
    ts = data.get("time_sweep")
    if ts:
        table = Table(title="Estimated step time (s) and exposed-comm share vs nodes", title_justify="left")
        table.add_column("nodes", justify="right")
        for s in ts["series"]:
            table.add_column(s["label"], justify="right")
        for i, n in enumerate(ts["nodes"]):
            table.add_row(f"{n:,}", *[f"{s['step_time_s'][i]:.3g} s, {s['comm_share'][i]:.0%}" for s in ts["series"]])
        con.print(table)


def _stdout_document(html: str | None, svg: str | None, json_out: bool) -> bool:
    """True when ``--html -`` or ``--svg -`` sends that document to stdout, which then carries
    nothing else; InputError when two things would share it."""
    dashes = [o for o, v in (("--html", html), ("--svg", svg)) if v == "-"]
    if len(dashes) == 2:
        raise InputError("--html - and --svg -: only one document can go to stdout; give the other a file path")
    if dashes and json_out:
        raise InputError(f"{dashes[0]} - and --json: both would go to stdout; give {dashes[0]} a file path")
    return bool(dashes)


def _write_document(path: str, text: str, written: list[tuple[str, int]]) -> None:
    """``text`` to ``path`` atomically, or to stdout for ``-``; ``written`` gets (path, bytes written)
    (counted here: a character device such as /dev/null has no size to stat afterwards)."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    data = text.encode("utf-8")
    atomic_write_bytes(path, data)
    written.append((path, len(data)))


def report(
    html: Annotated[Optional[str], typer.Option(
        "--html", metavar="PATH", show_default="none",
        help="Write a self-contained HTML report (inline SVG charts, no network) to this path ('-': stdout).")] = None,
    svg: Annotated[Optional[str], typer.Option(
        "--svg", metavar="PATH", show_default="none",
        help="Write the per-GPU memory chart alone as an SVG file ('-': stdout).")] = None,
    max_nodes: Annotated[int, typer.Option(
        "--max-nodes", metavar="N", help="Sweeps go to this many nodes (1, 2, 4, …).")] = DEFAULT_MAX_NODES,
    json_out: Json = False,
    **options: Any,
) -> None:
    """Charts: per-GPU memory by category vs GPU memory, compute vs communication, and sweeps over
    the number of GPUs and nodes — in the terminal, or as one self-contained HTML file.

    Example: zeroplan report --model llama-2-70b --hardware dgx-h100 --nodes 4 --precision bf16 --html r.html
    """
    from zeroplan.api import build_report

    to_stdout = _stdout_document(html, svg, json_out)
    ins = read_files(options["model"], options["hardware"], options["ds_config"], options)
    validate_output_path(None if html == "-" else html, option="--html", inputs=ins)
    validate_output_path(None if svg == "-" else svg, option="--svg",
                         inputs={**ins, "the --html output": None if html == "-" else html})
    options = options_from(ReportOptions, {**locals(), **options})
    con = console()
    show_progress = not json_out and not to_stdout and sys.stdout.isatty() and con.is_terminal
    if show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("evaluating plans"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=con, transient=True) as progress:
            task = progress.add_task("sweep", total=None)
            data = build_report(options, progress=lambda done, total: progress.update(
                task, completed=done, total=total))
    else:
        data = build_report(options)

    written: list[tuple[str, int]] = []
    if html is not None:
        from zeroplan.report.html import render_report_html

        _write_document(html, render_report_html(data.model_dump(mode="json")), written)
    if svg is not None:
        from zeroplan.report.html import memory_chart_svg

        _write_document(svg, memory_chart_svg(data.model_dump(mode="json"), standalone=True), written)
    if to_stdout:  # the document is the whole of stdout: no "wrote" line
        return
    if json_out:
        print_json(data)
        return
    if written:
        for path, size_bytes in written:
            con.print(f"wrote {path} ({size_bytes:,} bytes)", markup=False, highlight=False)
        return
    from zeroplan.report.charts import render_memory_bars, render_time_bars

    render_memory_bars(con, data.estimate)
    con.print()
    render_time_bars(con, data.estimate)
    con.print()
    _print_sweep_table(con, data.model_dump(mode="json"))


def register(app: typer.Typer) -> None:
    app.command("report")(handle_errors(with_plan_options(with_fine_tuning_options(report))))
