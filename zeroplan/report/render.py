"""Rich renderers for the terminal. Units are always printed: GB = 10^9 bytes, GiB = 2^30.

Lazy import: ``rich`` (in ``render_estimate``, the one function that draws a table). The planning
commands import this module for its number formats (``gb``, ``seconds``) and their ``--json`` path
must not pay for rich; zeroplan modules are imported at module level.
"""

from __future__ import annotations

from typing import Any

from zeroplan._util import GiB, fmt_gb, fmt_gib, safe_text
from zeroplan.report.charts import render_memory_bars, render_time_bars

__all__ = ["render_estimate", "gb", "gb_gib", "render_findings", "seconds", "estimator_line", "rounded_parts", "esc", "esc_line"]


def esc(text: object) -> str:
    """Text from an input file (a model or GPU name, a config key, a message quoting one) made safe to
    interpolate into Rich markup: ANSI and control characters escaped (``_util.safe_text``), then
    square brackets escaped so that ``[/]`` or ``[bold]`` in a name prints as written."""
    from rich.markup import escape

    return escape(safe_text(str(text)))


def esc_line(text: object) -> str:
    """``esc`` for text that must stay on its line (a finding's file, key and message): line breaks and tabs
    are written as ``\\n``, ``\\r`` and ``\\t``, so a key or file name holding a newline cannot start a line of
    its own (``::error::`` in a GitHub Actions log is a workflow command)."""
    return esc(str(text).replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t"))


def gb(n: float | None) -> str:
    return "—" if n is None else fmt_gb(n)


def gb_gib(n: float | None) -> str:
    return "—" if n is None else f"{fmt_gb(n)} ({fmt_gib(n)})"


def seconds(t: float | None) -> str:
    if t is None:
        return "—"
    if t < 1e-3:
        return f"{t * 1e6:,.1f} µs"
    if t < 1:
        return f"{t * 1e3:,.1f} ms"
    return f"{t:,.2f} s"


def _stage_label(p: Any) -> str:
    label = f"ZeRO-{p.stage}"
    extra = []
    if p.offload_optimizer != "none":
        extra.append(f"opt→{p.offload_optimizer}")
    if p.offload_param != "none":
        extra.append(f"param→{p.offload_param}")
    return label + (f" ({', '.join(extra)})" if extra else "")


def rounded_parts(total_units: int, parts: list[int], unit: int = 10**7) -> list[int]:
    """``parts`` (bytes) in whole ``unit``s (default 0.01 GB), rounded so that they add up to
    ``total_units`` exactly: each part is floored, then the units left over go to the parts with the
    largest remainders (the largest remainder method; ``total_units`` is within len(parts) units
    of the sum of the floors)."""
    floors = [p // unit for p in parts]
    left = total_units - sum(floors)
    order = sorted(range(len(parts)), key=lambda i: -(parts[i] - floors[i] * unit))
    out = list(floors)
    whole, rest = divmod(abs(left), len(parts))  # O(parts) whatever ``left`` is (huge after float rounding)
    step = 1 if left > 0 else -1
    for k, i in enumerate(order if left > 0 else order[::-1]):
        out[i] += step * (whole + (1 if k < rest else 0))
    return out


def estimator_line(p: Any) -> str:
    """One plan's DeepSpeed estimator, and zeroplan's peak minus it in named parts that add up to the
    shown difference (GB = 1e9 bytes, two decimals: peak and estimate are rounded first, the parts
    are rounded to match)."""
    e = p.deepspeed_estimator
    name = e.estimator or e.function.split("(")[0]
    none1 = " (DeepSpeed has no ZeRO-1 estimator)" if p.stage == 1 else ""
    line = (f"{_stage_label(p)} vs {name}{none1}: {gb_gib(e.gpu_bytes_per_gpu)} per GPU, "
            f"{gb(e.cpu_bytes_per_node)} CPU per node")
    d = e.vs_peak
    if d is None:
        return line
    unit = 10**7
    peak_u, est_u = round(p.memory.peak / unit), round(e.gpu_bytes_per_gpu / unit)
    st, bu, ac, ov = rounded_parts(peak_u - est_u, [d.model_states_bytes, d.buffers_bytes, d.activations_bytes,
                                                    d.overhead_bytes], unit)
    u = lambda x: f"{x / 100:,.2f}".replace("-", "−")  # noqa: E731  (hundredths of a GB)
    return (f"{line}\n    zeroplan's peak {u(peak_u)} − DeepSpeed's {u(est_u)} = {u(peak_u - est_u)} GB: model states "
            f"{u(st)} + buffers {u(bu)} + activations {u(ac)} + overhead {u(ov)} (DeepSpeed counts model states only)")


def render_findings(con: Any, findings: list[Any]) -> None:
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for f in findings:
        where = f" [{f.key}]" if getattr(f, "key", "") else ""
        con.print(f"[{colors.get(f.severity, 'white')}]{f.severity:7}[/] {f.rule_id}" + esc_line(f"{where}: {f.message}"),
                  markup=True, highlight=False)


def render_estimate(con: Any, result: Any, ds_findings: list[Any] | None = None) -> None:
    from rich.table import Table

    m, c = result.model, result.cluster
    approx = " (approximate shape)" if m.approximate else ""
    con.print(
        f"[bold]{esc(m.name)}[/]{approx}: {m.params:,} parameters "
        f"(largest module {esc(m.largest_layer_name)}: {m.largest_layer_params:,})",
        markup=True,
    )
    hw = (f" on {safe_text(c.hardware)} ({safe_text(c.gpu)}, {gb_gib(c.gpu_memory_bytes)} each)" if c.hardware
          else " (no hardware profile)")  # printed with markup=False
    t = result.training
    con.print(
        f"{c.n_gpus} GPUs = {c.nodes} node(s) × {c.gpus_per_node}{hw}; {t['precision']} "
        f"({t['bytes_per_param']['params']}/{t['bytes_per_param']['gradients']}/"
        f"{t['bytes_per_param']['optimizer_states']:g} bytes per parameter), {t['optimizer']}, micro-batch "
        f"{t['micro_batch']} × {t['seq_len']} tokens, grad-accum {t['grad_accum']}, checkpointing "
        f"{t['checkpointing']}, comm model {result.comm_model}",
        markup=False,
    )
    ft = getattr(result, "finetune", None)
    if ft is not None:
        targets = ", ".join(f"{x.target} ×{x.modules}" for x in ft.by_target) or "none"
        frozen = ft.frozen_storage_bytes or 0
        con.print(f"{ft.method}: {ft.trainable_params:,} trainable of {ft.total_params:,} parameters "
                  f"({100 * ft.trainable_fraction:.2f}%); adapters on {targets}; frozen weights {gb(frozen)}",
                  markup=False)
    table = Table(title="Per-GPU memory and communication per optimizer step", title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    for p in result.stages:
        table.add_column(_stage_label(p), justify="right")

    def row(label: str, fn) -> None:
        table.add_row(label, *[fn(p) for p in result.stages])

    def live(p, *cats):
        by = p.memory.phases[p.memory.peak_phase].by_category
        return sum(by.get(c, 0) for c in cats)

    row("parameters", lambda p: gb(p.memory.params))
    row("gradients", lambda p: gb(p.memory.gradients))
    row("optimizer states", lambda p: gb(p.memory.optimizer_states))
    row("model states (sum)", lambda p: gb(p.memory.model_states))
    row("at the peak: states", lambda p: gb(live(p, "params", "gradients", "optimizer_states")))
    row("  + buffers", lambda p: gb(p.memory.buffers))
    row("  + activations", lambda p: gb(p.memory.activations))
    row("= allocated", lambda p: f"{gb(p.memory.allocated)}\n{p.memory.allocated / GiB:,.2f} GiB")
    row("reserved (allocator)", lambda p: f"{gb(p.memory.reserved)}\n{p.memory.reserved / GiB:,.2f} GiB")
    row("  + context, NCCL", lambda p: gb(p.memory.peak - p.memory.reserved))
    row("= peak per GPU", lambda p: f"[bold]{gb(p.memory.peak)}[/]\n{p.memory.peak / GiB:,.2f} GiB, {p.memory.peak_phase}")
    if c.gpu_memory_bytes:
        row("fits", lambda p: ("[green]yes[/]" if p.fits else "[red]NO[/]") + f"\n{gb(p.headroom_bytes)} headroom")
    row("host RAM per node", lambda p: gb(p.host_memory_per_node) + ("" if p.host_fits in (None, True) else " [red]over[/]"))
    if any(p.memory.host.nvme_per_node_bytes for p in result.stages):
        row("NVMe per node", lambda p: gb(p.memory.host.nvme_per_node_bytes))
    row("sent per GPU per step", lambda p: gb(p.comm.bytes_per_gpu_per_step))
    if c.hardware:
        row("compute", lambda p: f"{seconds(p.time.compute_time_s)}\nMFU {p.time.mfu:.0%}")
        row("comm time (serial)", lambda p: seconds(p.comm.time_s))
        row("exposed comm", lambda p: f"{seconds(p.time.exposed_time_s['estimate'])}\n"
            f"({seconds(p.time.exposed_time_s['best'])} – {seconds(p.time.exposed_time_s['worst'])})")
        for label, field in (("overlap slowdown", "overlap_slowdown_s"), ("offload PCIe copies", "pcie_time_s"),
                             ("GPU optimizer step", "gpu_optimizer_time_s"), ("CPU optimizer step", "cpu_optimizer_time_s"),
                             ("NVMe swap", "nvme_time_s"), ("GPU waits for host", "host_bound_s")):
            if any(getattr(p.time, field) for p in result.stages):  # a row only where some stage has the term
                row(label, lambda p, f=field: seconds(getattr(p.time, f)))
        row("step time", lambda p: seconds(p.step_time_s))
        row("comm share", lambda p: f"{p.time.comm_share:.0%}")
        if any(p.time.offload_share for p in result.stages):
            row("offload share", lambda p: f"{p.time.offload_share:.0%}")
        row("tokens/s (cluster)", lambda p: f"{p.tokens_per_s:,.0f}")
    con.print(table)
    render_memory_bars(con, result)
    if c.hardware:
        render_time_bars(con, result)

    con.print("[bold]What sets the peak[/]", markup=True)
    for p in result.stages:
        con.print(f"  {_stage_label(p)}: {p.memory.peak_reason}", markup=False, highlight=False)
    ds_rows = [p for p in result.stages if p.deepspeed_estimator is not None]
    if ds_rows:
        con.print("[bold]DeepSpeed's own estimators[/] (model states only; DeepSpeed prints GiB labelled \"GB\": "
                  "shown here as GB and GiB)", markup=True)
        for p in ds_rows:
            for text in estimator_line(p).split("\n"):
                con.print("  " + text, markup=False, highlight=False)
    notes = list(dict.fromkeys(result.assumptions + [n for p in result.stages for n in p.notes]))
    if notes:
        con.print("[bold]Assumptions[/]", markup=True)
        for n in notes:
            con.print(f"  - {n}", markup=False, highlight=False)
    if ds_findings:
        con.print("[bold]DeepSpeed config findings[/]", markup=True)
        render_findings(con, ds_findings)
