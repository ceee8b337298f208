"""`zeroplan profiles list` and `zeroplan profiles show NAME|PATH` (no torch).

Units on screen: GiB = 2**30 bytes, GB = 1e9 bytes, GB/s = 1e9 bytes/s unidirectional,
Gb/s = 1e9 bits/s. Link bandwidths are per GPU; the inter-node column also shows the
per-node figure in Gb/s (the number NIC datasheets and cloud pages quote).
"""

from __future__ import annotations

from typing import Any

import typer

from zeroplan._util import GB, GiB
from zeroplan.commands._common import console, handle_errors, print_json

__all__ = ["register", "profiles_app"]

profiles_app = typer.Typer(
    name="profiles",
    help="Bundled hardware profiles (GPU, node, links, overheads, each number with its source).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _wide_console():
    out = console()
    if not out.is_terminal:
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=False, width=max(out.width, 230))
    return out


def _profile_json(p: Any) -> dict[str, Any]:
    d = p.model_dump(mode="json")
    d["path"] = p.path
    d["derived"] = {
        "gpu_memory_GiB": p.gpu.memory_bytes / GiB,
        "gpu_memory_GB": p.gpu.memory_bytes / GB,
        "gpus_per_node": p.node.gpus_per_node,
        "intra_node_effective_GBps_per_gpu": p.intra_node.effective_GBps_per_gpu,
        "inter_node_effective_GBps_per_gpu": p.inter_node.effective_GBps_per_gpu,
        "inter_node_GBps_per_node": p.inter_node_GBps_per_node,
        "inter_node_Gbps_per_node": p.inter_node_Gbps_per_node,
    }
    return d


@profiles_app.command("list")
@handle_errors
def list_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object {\"profiles\": [...]}."),
) -> None:
    """List the bundled hardware profiles."""
    from zeroplan.specs.hardware import list_profiles

    profiles = list_profiles()
    if json_out:
        print_json({"profiles": [_profile_json(p) for p in profiles]})
        return
    from rich.table import Table

    t = Table(title=f"{len(profiles)} bundled hardware profiles", title_justify="left")
    cols = (
        ("name", "left"), ("GPU", "left"), ("mem GiB", "right"), ("mem GB", "right"),
        ("GPUs/node", "right"), ("intra GB/s/GPU", "right"), ("inter GB/s/GPU", "right"),
        ("inter Gb/s/node", "right"), ("inter-node link", "left"), ("host RAM GiB", "right"),
    )
    for name, justify in cols:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for p in profiles:
        t.add_row(
            p.name, p.gpu.name,
            f"{p.gpu.memory_bytes / GiB:,.1f}", f"{p.gpu.memory_bytes / GB:,.1f}",
            str(p.node.gpus_per_node),
            f"{p.intra_node.bandwidth_GBps_per_gpu:,.4g}",
            f"{p.inter_node.bandwidth_GBps_per_gpu:,.4g}",
            f"{p.inter_node_Gbps_per_node:,.0f}",
            p.inter_node.name.split(" (")[0],
            f"{p.node.host_ram_bytes / GiB:,.0f}",
        )
    out = _wide_console()
    out.print(t)
    out.print(
        "GiB = 2^30 bytes, GB = 1e9 bytes; GB/s = 1e9 bytes/s unidirectional peak (before efficiency); "
        "Gb/s = 1e9 bits/s. 'zeroplan profiles show NAME' prints every field with its source."
    )


def _bytes(v: int) -> str:
    return f"{v:,} B ({v / GiB:,.2f} GiB = {v / GB:,.2f} GB)"


def _rows(p: Any) -> list[tuple[str, str]]:
    """(dotted field path, value with units) for every field of the profile."""
    rows: list[tuple[str, str]] = [("name", p.name), ("description", p.description), ("gpu.name", p.gpu.name),
                                   ("gpu.memory_bytes", _bytes(p.gpu.memory_bytes))]
    for k, v in p.gpu.peak_flops.items():
        rows.append((f"gpu.peak_flops.{k}", f"{v:.4g} FLOP/s ({v / 1e12:,.1f} TFLOP/s, dense)"))
    rows.append(("gpu.hbm_bandwidth_GBps", f"{p.gpu.hbm_bandwidth_GBps:,.6g} GB/s"))
    n = p.node
    rows += [
        ("node.gpus_per_node", str(n.gpus_per_node)),
        ("node.host_ram_bytes", _bytes(n.host_ram_bytes)),
        ("node.pcie_bandwidth_GBps_per_gpu", f"{n.pcie_bandwidth_GBps_per_gpu:,.6g} GB/s per GPU, one direction"),
        ("node.nvme_bandwidth_GBps", f"{n.nvme_bandwidth_GBps:,.6g} GB/s per node" if n.nvme_bandwidth_GBps else "0 (no local NVMe)"),
        ("node.nvme_capacity_bytes", _bytes(n.nvme_capacity_bytes) if n.nvme_capacity_bytes else "0 (no local NVMe)"),
    ]
    if n.cpu_cores is not None:
        rows.append(("node.cpu_cores", f"{n.cpu_cores} physical cores"))
    if n.cpu_adam_params_per_s_per_core is not None:
        rows.append(("node.cpu_adam_params_per_s_per_core",
                     f"{n.cpu_adam_params_per_s_per_core:,.0f} parameters/s per core (CPU Adam)"))
    if n.overlap_slowdown is not None:
        rows.append(("node.overlap_slowdown", f"{n.overlap_slowdown:g} of the hidden communication time "
                                              "(0 = hidden for free, 1 = nothing hides)"))
    for tier in ("intra_node", "inter_node"):
        rows += _link_rows(tier, getattr(p, tier), n.gpus_per_node)
    o = p.overhead
    rows += [
        ("overhead.cuda_context_bytes", _bytes(o.cuda_context_bytes)),
        ("overhead.nccl_bytes", _bytes(o.nccl_bytes)),
        ("overhead.fragmentation_fraction", f"{o.fragmentation_fraction:g} of the churned bytes (freed and re-requested at other sizes)"),
    ]
    return rows


def _link_rows(tier: str, link: Any, gpus_per_node: int) -> list[tuple[str, str]]:
    bw = link.bandwidth_GBps_per_gpu
    rows = [
        (f"{tier}.name", link.name),
        (f"{tier}.bandwidth_GBps_per_gpu",
         f"{bw:,.6g} GB/s per GPU, one direction (= {bw * 8:,.4g} Gb/s per GPU, "
         f"{bw * gpus_per_node * 8:,.4g} Gb/s per node)"),
        (f"{tier}.latency_us", f"{link.latency_us:g} µs per step"),
        (f"{tier}.efficiency", f"{link.efficiency:g} (achievable {link.effective_GBps_per_gpu:,.4g} GB/s per GPU)"),
    ]
    if link.algorithms is not None:
        rows.append((f"{tier}.algorithms", ", ".join(link.algorithms) + " (NCCL algorithms offered)"))
    if link.mesh_link_GBps is not None:
        rows.append((f"{tier}.mesh_link_GBps", f"{link.mesh_link_GBps:,.6g} GB/s per GPU-to-GPU link, one direction"))
    if link.nics_per_node is not None:
        rows.append((f"{tier}.nics_per_node", f"{link.nics_per_node} network adapters per node"))
    return rows


@profiles_app.command("show")
@handle_errors
def show_cmd(
    ref: str = typer.Argument(..., metavar="NAME|PATH", help="A bundled profile name or a path to a profile .toml."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile as one JSON object."),
) -> None:
    """Show every field of a hardware profile with its unit and source."""
    from zeroplan.specs.hardware import load_profile, source_for

    p = load_profile(ref)
    if json_out:
        print_json(_profile_json(p))
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"{p.name} — {p.description}"), title_justify="left", show_lines=False)
    t.add_column("field", no_wrap=True)
    t.add_column("value")
    t.add_column("source", overflow="fold")
    for path, value in _rows(p):
        numeric = path not in ("name", "description") and not path.endswith(".name")
        t.add_row(Text(path), Text(value), Text((source_for(p, path) or "") if numeric else ""))
    out = _wide_console()
    out.print(t)
    out.print(Text(f"file: {p.path}"))


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")
