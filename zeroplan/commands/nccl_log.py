"""`zeroplan nccl-log FILE`: what NCCL chose and ran, read from an NCCL_DEBUG=INFO log.

With model options (``--model`` and the usual planning options) it also evaluates the plan and
compares the predicted collective ledger with the collectives the log shows (needs
``NCCL_DEBUG_SUBSYS=COLL``), per op, per rank, in full-buffer bytes. No torch import.

JSON (``--json``): ``NcclLogReport.model_dump(mode="json")`` (``zeroplan.read_nccl_log``): ``{"file",
"summary": NcclLogSummary, "comparison": LedgerComparison | null,
"plan": {"stage", "n_gpus", "comm_model", "model"} | null}``.
"""

from __future__ import annotations

from typing import Any, Optional

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError, fmt_bytes
from zeroplan.commands._common import (
    Json, console, handle_errors, options_from, print_json, with_fine_tuning_options, with_plan_options,
)
from zeroplan.options import PlanOptions

__all__ = ["register"]

MAX_TABLE_ROWS = 50  # rows of a text table; --json lists every one


def _more(con: Any, shown: int, total: int, what: str) -> None:
    if total > shown:
        con.print(f"… and {total - shown:,} more {what} (the first {shown} shown; --json lists all {total:,})")


def _render(result: Any) -> None:
    from rich.table import Table

    from zeroplan.report.render import esc

    con = console()
    s = result.summary
    ver = f"NCCL {s.nccl_version}" if s.nccl_version else "NCCL version not in log"
    if s.nccl_cuda_version:
        ver += f" (built for CUDA {s.nccl_cuda_version})"
    if s.cuda_driver_version:
        ver += f"; driver supports CUDA {s.cuda_driver_version // 1000}.{(s.cuda_driver_version % 1000) // 10}"
    con.print(f"[bold]{esc(result.file)}[/]: {esc(ver)}")
    shape = f"{s.nranks} ranks" if s.nranks else "ranks unknown"
    if s.nnodes:
        shape += f" on {s.nnodes} node(s)"
    con.print(f"{shape}; hosts: {esc(', '.join(s.hosts)) or '-'}; {s.processes} process(es) logged; "
              f"{len(s.communicators)} communicator(s)")
    net = ", ".join(s.networks) or "-"
    con.print(f"network: {esc(net)}")
    for kind, devs in s.net_devices.items():
        con.print(f"  NET/{esc(kind)} devices: {esc(' '.join(devs))}")
    if s.channels is not None or s.rings:
        con.print(f"channels: {s.channels}; rings logged: {len(s.rings)}; tree entries: {len(s.trees)}")
        if s.rings:
            con.print(f"  ring channel {s.rings[0].channel:02d}: {' '.join(map(str, s.rings[0].ranks))}")
    nvls = []
    if s.nvls_available_devices or s.nvls_unavailable_devices:
        nvls.append(f"NVLS multicast available on {s.nvls_available_devices} device(s), "
                    f"not on {s.nvls_unavailable_devices}")
    if s.nvls_channels is not None:
        nvls.append(f"{s.nvls_channels} NVLS channel(s)")
    if s.collnet_channels is not None:
        nvls.append(f"{s.collnet_channels} CollNet channel(s)")
    if nvls:
        con.print("; ".join(nvls))

    if s.transports:
        t = Table(title="Transports (connection lines)")
        for col in ("transport", "connections", "GPUDirect RDMA", "as logged"):
            t.add_column(col, justify="right" if col in ("connections", "GPUDirect RDMA") else "left")
        for tr in s.transports:
            t.add_row(esc(tr.kind), str(tr.connections), str(tr.gdrdma),
                      esc(", ".join(f"{k} ×{v}" for k, v in tr.variants.items())) or "(channel count only)")
        con.print(t)

    if s.collectives:
        t = Table(title="Collectives (per rank; full-buffer bytes, AllGather/ReduceScatter count × nranks)")
        for col in ("op", "dtype", "NCCL count", "nranks", "buffer", "calls/rank", "ranks logging"):
            t.add_column(col, justify="left" if col in ("op", "dtype") else "right")
        for c in s.collectives[:MAX_TABLE_ROWS]:
            buf = fmt_bytes(c.buffer_bytes) if c.buffer_bytes is not None else "?"
            calls = f"{c.calls_per_rank}" + (" (uneven)" if c.uneven else "")
            t.add_row(esc(c.op), esc(c.datatype), f"{c.count:,}", str(c.nranks), buf, calls, str(c.ranks_logging))
        con.print(t)
        _more(con, MAX_TABLE_ROWS, len(s.collectives), "collective shapes")
        con.print("per op: " + "; ".join(
            f"{o.op} {o.calls_per_rank} call(s), {fmt_bytes(o.bytes_per_rank)}" for o in s.op_totals))
    else:
        con.print("collectives: none logged (set NCCL_DEBUG_SUBSYS=COLL to log every call)")

    if s.issues:
        t = Table(title=f"Warnings and errors ({s.issue_count} line(s))")
        for col in ("kind", "line", "times", "message"):
            t.add_column(col)
        for i in s.issues[:MAX_TABLE_ROWS]:
            t.add_row(esc(i.kind), str(i.line), str(i.occurrences), esc(i.message))
        con.print(t)
        _more(con, MAX_TABLE_ROWS, len(s.issues), "distinct warnings/errors")
    else:
        con.print("warnings/errors: none")

    cmp_ = result.comparison
    if cmp_ is not None:
        p = result.plan
        t = Table(title=(f"Predicted (stage {p.stage}, {p.comm_model}, {cmp_.steps} step(s)) vs logged, "
                         f"per rank, communicators of {cmp_.nranks} ranks"))
        for col in ("op", "pred. calls", "logged calls", "pred. bytes", "logged bytes", "logged/pred.", "note"):
            t.add_column(col, justify="left" if col in ("op", "note") else "right")
        for o in cmp_.ops:
            ratio = f"{o.bytes_ratio:.3f}" if o.bytes_ratio is not None else "-"
            t.add_row(o.op, str(o.predicted_calls), str(o.logged_calls), fmt_bytes(o.predicted_bytes),
                      fmt_bytes(o.logged_bytes), ratio, esc(o.note) or ("match" if o.match else "differs"))
        con.print(t)
        if cmp_.unmatched_logged_ops:
            con.print(f"logged without a ledger counterpart: {esc(', '.join(cmp_.unmatched_logged_ops))}")
    con.print(f"lines: {s.lines_total} total, {s.lines_nccl} NCCL record(s), "
              f"{s.lines_unrecognized} unrecognised NCCL message(s), {s.lines_ignored} other line(s) ignored")


def register(app: typer.Typer) -> None:
    @app.command("nccl-log")
    @handle_errors
    @with_plan_options
    @with_fine_tuning_options
    def nccl_log(
        file: Annotated[str, typer.Argument(
            metavar="FILE",
            help="A log written with NCCL_DEBUG=INFO (add NCCL_DEBUG_SUBSYS=INIT,COLL to see every collective).")],
        steps: Annotated[int, typer.Option(
            "--steps", metavar="N", help="Optimizer steps the log covers (the ledger is per step).")] = 1,
        nranks: Annotated[Optional[int], typer.Option(
            "--nranks", metavar="N", show_default="the plan's GPUs",
            help="Compare only collectives on communicators of this size.")] = None,
        json_out: Json = False,
        **options: Any,
    ) -> None:
        """Summarise an NCCL debug log: version, ranks, rings/trees, transports, collectives, warnings.

        With --model (and the usual planning options, one ZeRO stage) it also compares the plan's
        predicted collectives with the logged ones. Example:
        zeroplan nccl-log train.log --model llama-2-7b --gpus 16 --stage 2 --precision bf16
        """
        from zeroplan.api import read_nccl_log

        params = {**locals(), **options}
        plan = None
        if params["model"] is not None:
            plan = options_from(PlanOptions, params)
        else:
            defaults = PlanOptions.model_fields
            given = [k for k in defaults if k != "model" and k in params and params[k] != defaults[k].default]
            if given:
                raise InputError(f"--{given[0].replace('_', '-')} needs --model to compare the log with a plan")
        result = read_nccl_log(file, plan, steps=steps, nranks=nranks)
        if json_out:
            print_json(result)
            return
        _render(result)
