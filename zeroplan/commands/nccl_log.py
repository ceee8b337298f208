"""`zeroplan nccl-log FILE`: what NCCL chose and ran, read from an NCCL_DEBUG=INFO log.

With model options (``--model`` and the usual planning options) it also evaluates the plan and
compares the predicted collective ledger with the collectives the log shows (needs
``NCCL_DEBUG_SUBSYS=COLL``), per op, per rank, in full-buffer bytes. No torch import.

JSON (``--json``): ``{"file", "summary": NcclLogSummary, "comparison": LedgerComparison | null,
"plan": {"stage", "n_gpus", "comm_model"} | null}``.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from zeroplan._util import LOG_MAX_BYTES, InputError, fmt_bytes, read_text_file
from zeroplan.commands._common import console, handle_errors, print_json

__all__ = ["register", "run_nccl_log"]


def run_nccl_log(
    file: str,
    *,
    model: str | None = None,
    steps: int = 1,
    nranks: int | None = None,
    comm_model: str = "deepspeed",
    **plan_kw: Any,
) -> dict[str, Any]:
    """Parse ``file`` and, when ``model`` is given, compare with the predicted ledger.

    ``plan_kw`` are ``build_plan_inputs`` keywords (hardware, gpus, nodes, ds_config, stage...).
    Returns ``{"file", "summary", "comparison", "plan"}`` with pydantic objects.
    """
    from zeroplan.inspect.nccl_log import compare_with_ledger, parse_nccl_log

    text = read_text_file(file, "NCCL log", max_bytes=LOG_MAX_BYTES)
    summary = parse_nccl_log(text)
    if summary.lines_nccl == 0 and not summary.issues and summary.nccl_version is None:
        raise InputError(f"{file}: no NCCL log lines found (expected lines such as "
                         "'host:pid:tid [0] NCCL INFO ...'; run with NCCL_DEBUG=INFO)")
    if steps < 1:
        raise InputError(f"--steps {steps} must be a positive integer")
    out: dict[str, Any] = {"file": str(file), "summary": summary, "comparison": None, "plan": None}
    if model is None:
        given = [k for k, v in plan_kw.items() if v not in (None, False)]
        if given:
            raise InputError(f"--{given[0].replace('_', '-')} needs --model to compare the log with a plan")
        return out

    from zeroplan.core.inputs import build_plan_inputs
    from zeroplan.core.plan import evaluate

    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {comm_model!r} is unknown; expected deepspeed or paper")
    inp = build_plan_inputs(model=model, **plan_kw)
    if len(inp.stages) != 1:
        raise InputError("nccl-log compares one plan: give --stage or a --ds-config with zero_optimization.stage")
    stage = inp.stages[0]
    plan = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(stage), n_gpus=inp.n_gpus,
                    gpus_per_node=inp.gpus_per_node, hardware=inp.hardware, comm_model=comm_model)
    out["comparison"] = compare_with_ledger(
        summary, plan.comm.collectives, steps=steps, nranks=nranks if nranks is not None else inp.n_gpus
    )
    out["plan"] = {"stage": stage, "n_gpus": inp.n_gpus, "comm_model": comm_model, "model": model}
    return out


def _render(result: dict[str, Any]) -> None:
    from rich.markup import escape as esc
    from rich.table import Table

    con = console()
    s = result["summary"]
    ver = f"NCCL {s.nccl_version}" if s.nccl_version else "NCCL version not in log"
    if s.nccl_cuda_version:
        ver += f" (built for CUDA {s.nccl_cuda_version})"
    if s.cuda_driver_version:
        ver += f"; driver supports CUDA {s.cuda_driver_version // 1000}.{(s.cuda_driver_version % 1000) // 10}"
    con.print(f"[bold]{esc(result['file'])}[/]: {esc(ver)}")
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
        for c in s.collectives:
            buf = fmt_bytes(c.buffer_bytes) if c.buffer_bytes is not None else "?"
            calls = f"{c.calls_per_rank}" + (" (uneven)" if c.uneven else "")
            t.add_row(esc(c.op), esc(c.datatype), f"{c.count:,}", str(c.nranks), buf, calls, str(c.ranks_logging))
        con.print(t)
        con.print("per op: " + "; ".join(
            f"{o.op} {o.calls_per_rank} call(s), {fmt_bytes(o.bytes_per_rank)}" for o in s.op_totals))
    else:
        con.print("collectives: none logged (set NCCL_DEBUG_SUBSYS=COLL to log every call)")

    if s.issues:
        t = Table(title=f"Warnings and errors ({s.issue_count} line(s))")
        for col in ("kind", "line", "times", "message"):
            t.add_column(col)
        for i in s.issues:
            t.add_row(i.kind, str(i.line), str(i.occurrences), esc(i.message))
        con.print(t)
    else:
        con.print("warnings/errors: none")

    cmp_ = result.get("comparison")
    if cmp_ is not None:
        p = result["plan"]
        t = Table(title=(f"Predicted (stage {p['stage']}, {p['comm_model']}, {cmp_.steps} step(s)) vs logged, "
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
    def nccl_log(
        file: str = typer.Argument(..., help="A log written with NCCL_DEBUG=INFO (add NCCL_DEBUG_SUBSYS=INIT,COLL to see every collective)."),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Compare with the plan for this model (catalog name, config.json or a count such as 7B)."),
        hardware: Optional[str] = typer.Option(None, "--hardware", "-H", help="Hardware profile name or TOML path."),
        gpus: Optional[int] = typer.Option(None, "--gpus", "-g", help="Total data-parallel GPUs of the plan."),
        nodes: Optional[int] = typer.Option(None, "--nodes", "-n", help="Nodes (× --gpus-per-node)."),
        gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node."),
        ds_config: Optional[str] = typer.Option(None, "--ds-config", "-c", help="DeepSpeed JSON config (selects the stage)."),
        stage: Optional[int] = typer.Option(None, "--stage", help="ZeRO stage of the plan (0–3)."),
        precision: Optional[str] = typer.Option(None, "--precision", "-p", help="fp32, bf16 or fp16."),
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", "-b", help="Micro-batch size per GPU."),
        seq_len: int = typer.Option(2048, "--seq-len", "-s", help="Sequence length in tokens."),
        grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Gradient accumulation steps."),
        offload_optimizer: Optional[str] = typer.Option(None, "--offload-optimizer", help="none, cpu or nvme."),
        offload_param: Optional[str] = typer.Option(None, "--offload-param", help="none, cpu or nvme."),
        comm_model: str = typer.Option("deepspeed", "--comm-model", help="deepspeed or paper."),
        steps: int = typer.Option(1, "--steps", help="Optimizer steps the log covers (the ledger is per step)."),
        nranks: Optional[int] = typer.Option(None, "--nranks", help="Compare only collectives on communicators of this size (default: the plan's GPUs)."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
    ) -> None:
        """Summarise an NCCL debug log: version, ranks, rings/trees, transports, collectives, warnings.

        Example: zeroplan nccl-log train.log --model llama-2-7b --gpus 16 --stage 2 --precision bf16
        """
        plan_kw: dict[str, Any] = dict(
            hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, ds_config=ds_config,
            stage=stage, precision=precision, micro_batch=micro_batch, grad_accum=grad_accum,
            offload_optimizer=offload_optimizer, offload_param=offload_param,
        )
        if model is not None:
            plan_kw["seq_len"] = seq_len
        result = run_nccl_log(file, model=model, steps=steps, nranks=nranks, comm_model=comm_model, **plan_kw)
        if json_out:
            print_json({
                "file": result["file"],
                "summary": result["summary"].model_dump(mode="json"),
                "comparison": result["comparison"].model_dump(mode="json") if result["comparison"] else None,
                "plan": result["plan"],
            })
            return
        _render(result)
