"""The HTML report's tables and text sections: the numbers behind each chart (every cell carries
its exact value in ``data-value``: bytes, seconds or a fraction), the inputs and assumptions, and
the recommendation with its reasons.

Imports: module level only.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from zeroplan._util import GB
from zeroplan.report.charts import MEMORY_CATEGORIES
from zeroplan.report.svg import _e, _gb, _sec

__all__: list[str] = []  # internal to the HTML report: the sections render_report_html assembles

_CODE = re.compile(r"`([^`\n]+)`")


def _prose(s: Any) -> str:
    """Escaped text whose `code` spans (the advice names modules in backticks, as in the terminal)
    become <code> elements: no literal markdown in the page."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", _e(s))


def _td(text: str, value: Any = None, **attrs: Any) -> str:
    a = "".join(f' data-{k.replace("_", "-")}="{_e(v)}"' for k, v in attrs.items())
    if value is not None:
        a += f' data-value="{_e(value)}"'
    return f"<td{a}>{_e(text)}</td>"


def _table(ident: str, caption: str, head: Sequence[str], rows: Sequence[str]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return (f'<table id="{ident}"><caption>{_e(caption)}</caption><thead><tr>{th}</tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def _memory_table(data: dict[str, Any]) -> str:
    cats = [c for c in MEMORY_CATEGORIES]
    ram = next((p.get("host_ram_per_node_bytes") for p in data["plans"] if p.get("host_ram_per_node_bytes")), None)
    ram_of = f", of {ram / GB:,.0f}" if ram else ""
    head = (["option"] + [f"{c.label} at peak (GB)" for c in cats]
            + ["peak (GB)", "peak phase", "fits", "model states, steady (GB)", "host RAM per node (GB)" + ram_of,
               "host RAM fits"])
    rows = []
    for p in data["plans"]:
        m = p["memory_at_peak"]
        cells = [f"<th>{_e(p['label'])}</th>"]
        cells += [_td(f"{m[c.key] / GB:,.2f}", m[c.key], key=c.key, stage=p["stage"]) for c in cats]
        cells.append(_td(f"{m['peak'] / GB:,.2f}", m["peak"], key="peak", stage=p["stage"]))
        cells.append(_td(p["peak_phase"]))
        fits = p.get("fits")
        cells.append(_td("—" if fits is None else ("yes" if fits else "NO"), None if fits is None else int(fits),
                         key="fits", stage=p["stage"]))
        ms = p["memory"]["model_states"]
        cells.append(_td(f"{ms / GB:,.2f}", ms, key="model_states", stage=p["stage"]))
        host = p.get("host_memory_per_node")
        cells.append(_td("—" if host is None else f"{host / GB:,.2f}", host, key="host_memory_per_node",
                         stage=p["stage"]))
        hf = p.get("host_fits")
        cells.append(_td("—" if hf is None else ("yes" if hf else "NO"), None if hf is None else int(hf),
                         key="host_fits", stage=p["stage"]))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-memory", "Per-GPU memory live in the peak phase, by category (GB = 10^9 bytes; data-value: bytes). Model states "
                  "(steady state: parameters + gradients + optimizer states, as the ZeRO paper counts them) for comparison", head, rows)


def _time_table(data: dict[str, Any]) -> str:
    head = ["option", "compute (s)", "exposed comm best (s)", "exposed comm worst (s)", "comm serial (s)",
            "step estimate (s)", "comm share", "tokens/s (cluster)", "sent per GPU per step (GB)"]
    rows = []
    for p in data["plans"]:
        t = p.get("time")
        if not t:
            continue
        st = p["stage"]
        rows.append("<tr>" + f"<th>{_e(p['label'])}</th>" + "".join([
            _td(f"{t['compute_s']:.4g}", t["compute_s"], key="compute_s", stage=st),
            _td(f"{t['exposed_best_s']:.4g}", t["exposed_best_s"], key="exposed_best_s", stage=st),
            _td(f"{t['exposed_worst_s']:.4g}", t["exposed_worst_s"], key="exposed_worst_s", stage=st),
            _td(f"{t['comm_s']:.4g}", t["comm_s"], key="comm_s", stage=st),
            _td(f"{t['step_time_s']:.4g}", t["step_time_s"], key="step_time_s", stage=st),
            _td(f"{t['comm_share']:.1%}", t["comm_share"], key="comm_share", stage=st),
            _td(f"{t['tokens_per_s']:,.0f}", t["tokens_per_s"], key="tokens_per_s", stage=st),
            _td(f"{p['comm_bytes_per_gpu_per_step'] / GB:,.2f}", p["comm_bytes_per_gpu_per_step"],
                key="comm_bytes_per_gpu_per_step", stage=st),
        ]) + "</tr>")
    return _table("table-time", "Time per optimizer step (seconds; comm share = exposed comm / step estimate)",
                  head, rows)


def _memory_sweep_table(data: dict[str, Any]) -> str:
    sw = data["memory_sweep"]
    head = ["GPUs"]
    for s in sw["series"]:
        head += [f"{s['label']} model states (GB)", f"{s['label']} peak (GB)"]
    rows = []
    for i, g in enumerate(sw["gpus"]):
        cells = [f'<th data-gpus="{g}">{g:,}</th>']
        for s in sw["series"]:
            ms, pk = s["model_states"][i], s["peak"][i]
            cells.append(_td(f"{ms / GB:,.2f}", ms, key="model_states", stage=s["stage"], gpus=g))
            cells.append(_td(f"{pk / GB:,.2f}", pk, key="peak", stage=s["stage"], gpus=g))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-memory-sweep", "Per-GPU memory vs GPUs (GB = 10^9 bytes; data-value: bytes)", head, rows)


def _time_sweep_table(data: dict[str, Any]) -> str:
    sw = data["time_sweep"]
    head = ["nodes", "GPUs"]
    for s in sw["series"]:
        head += [f"{s['label']} step (s)", f"{s['label']} comm share"]
    rows = []
    for i, (n, g) in enumerate(zip(sw["nodes"], sw["gpus"])):
        cells = [f'<th data-nodes="{n}">{n:,}</th>', f"<td>{g:,}</td>"]
        for s in sw["series"]:
            t, c = s["step_time_s"][i], s["comm_share"][i]
            cells.append(_td(f"{t:.4g}", t, key="step_time_s", stage=s["stage"], nodes=n))
            cells.append(_td(f"{c:.1%}", c, key="comm_share", stage=s["stage"], nodes=n))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return _table("table-time-sweep", "Step time and exposed-comm share vs nodes", head, rows)


def _inputs_section(data: dict[str, Any]) -> str:
    m, c, t = data["model"], data["cluster"], data["training"]
    bpp = t["bytes_per_param"]
    pairs = [
        ("model", f"{m['name']} ({m['model_type']}; source {m['source']})"),
        ("parameters", f"{m['params']:,}" + (" (approximate shape)" if m.get("approximate") else "")),
        ("largest module", f"{m['largest_layer_name']}: {m['largest_layer_params']:,} parameters"),
        ("hardware", c.get("hardware") or "none given (no capacity line, no times)"),
        ("GPU", f"{c['gpu']}, {_gb(c['gpu_memory_bytes'])} ({c['gpu_memory_bytes'] / 2**30:,.2f} GiB)"
         if c.get("gpu") else "—"),
        ("cluster", f"{c['n_gpus']:,} GPUs = {c['nodes']:,} node(s) × {c['gpus_per_node']}"),
        ("precision", f"{t['precision']} ({t['precision_source']})"),
        ("bytes per parameter", f"params {bpp['params']}, gradients {bpp['gradients']}, optimizer states "
                                f"{bpp['optimizer_states']:g}"),
        ("optimizer", t["optimizer"]),
        ("batch", f"micro-batch {t['micro_batch']} × {t['seq_len']:,} tokens, gradient accumulation {t['grad_accum']}"),
        ("activations", f"checkpointing {t['checkpointing']}, flash attention {'on' if t['flash_attention'] else 'off'}"),
        ("comm model", data["comm_model"]),
        ("MFU", f"{data['mfu']:g} (--mfu)" if data.get("mfu") is not None else "compute model (core/compute.py)"),
        ("sweep", f"memory: 1 … {data['memory_sweep']['gpus'][-1]:,} GPUs; time: 1 … {data['max_nodes']:,} nodes"),
    ]
    for k, v in data.get("inputs", {}).items():
        if k in ("ds_config", "offload_optimizer", "offload_param", "stage") and v is not None:
            pairs.append((f"--{k.replace('_', '-')}", str(v)))
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)
    notes = list(dict.fromkeys(data.get("assumptions", []) + data.get("notes", [])))
    items = "".join(f"<li>{_prose(n)}</li>" for n in notes) or "<li>none</li>"
    reasons = "".join(f"<li><b>{_e(p['label'])}</b>: {_prose(p['peak_reason'])}</li>" for p in data["plans"])
    return (f'<section id="inputs"><h2>Inputs and assumptions</h2><table id="table-inputs">{rows}</table>'
            f"<h3>Assumptions and notes</h3><ul>{items}</ul><h3>What sets each peak</h3><ul>{reasons}</ul></section>")


def _recommendation_section(data: dict[str, Any]) -> str:
    """What ``zeroplan recommend`` chooses for the same inputs, and why (its explanation sentences)."""
    rec = data.get("recommendation")
    if not rec:
        return ('<section id="recommendation"><h2>Recommendation</h2><p>No recommendation: it needs a hardware '
                "profile (--hardware).</p></section>")
    c = rec.get("chosen")
    out = ['<section id="recommendation"><h2>Recommendation</h2>']
    if c is None:
        out.append('<p class="chosen"><b>Nothing fits</b> on this cluster with the searched settings.</p>')
    else:
        pairs = [
            ("configuration", c["label"]),
            ("micro-batch per GPU", f"{c['micro_batch']:,}"),
            ("activation checkpointing", c["checkpointing"]),
            ("reduce_bucket_size", f"{c['reduce_bucket_size']:,} elements"),
        ]
        if c["stage"] == 3:
            pairs.append(("stage3_prefetch_bucket_size", f"{c['prefetch_bucket_size']:,} elements"))
            if c.get("hpz_partition_size", 1) > 1:
                pairs.append(("zero_hpz_partition_size (hpZ)", f"{c['hpz_partition_size']}"))
        pairs += [
            ("peak per GPU", f"{_gb(c['peak_bytes'])} of {_gb(c['gpu_memory_bytes'])} ({_gb(c['headroom_bytes'])} free)"),
            ("host RAM per node", _gb(c["host_per_node_bytes"])),
            ("step time", _sec(c.get("step_time_s"))),
            ("useful throughput", f"{c['tokens_per_s']:,.0f} tokens/s (cluster)" if c.get("tokens_per_s") else "—"),
        ]
        rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)
        out.append(f'<p class="chosen">Recommended: <b>{_e(c["label"])}</b>, micro-batch {c["micro_batch"]}, '
                   f"checkpointing {_e(c['checkpointing'])}.</p>")
        out.append(f'<table id="table-recommendation">{rows}</table>')
    # the first sentence restates the choice shown above
    sentences = [x for x in rec.get("explanation", []) if not (c is not None and x.startswith("Recommended:"))]
    why = "".join(f"<li>{_prose(x.strip())}</li>" for x in sentences)
    out.append(f'<h3>Why</h3><ul id="recommendation-reasons">{why}</ul>')
    if rec.get("warnings"):
        warn = "".join(f"<li>{_prose(x)}</li>" for x in rec["warnings"])
        out.append(f'<h3>Warnings</h3><ul id="recommendation-warnings" class="warn">{warn}</ul>')
    out.append("</section>")
    return "".join(out)

