"""`zeroplan detect`: this node's NVIDIA GPUs (NVML), NVLink/PCIe, host RAM → closest profile.

``--save-profile PATH`` writes a hardware profile TOML for this node (atomic), starting from the
matched bundled profile with the detected values in place and the inter-node link marked
UNMEASURED in its sources. Without an NVIDIA driver or GPU: one line, exit code 2.
JSON (``--json``): the NodeReport, plus ``saved_profile`` (path or null).
"""

from __future__ import annotations

from typing import Optional

import typer

from zeroplan.commands._common import console, handle_errors, print_json

__all__ = ["register"]


def _render(report, saved: str | None) -> None:
    from rich.table import Table

    from zeroplan._util import fmt_gb, fmt_gib
    from zeroplan.report.render import esc

    con = console()
    con.print(f"[bold]{esc(report.hostname)}[/]: {report.gpu_count} NVIDIA GPU(s); driver "
              f"{esc(report.driver_version or '?')}, CUDA {esc(report.cuda_driver_version or '?')}")
    ram = f"{fmt_gib(report.host_ram_bytes)} ({fmt_gb(report.host_ram_bytes)})" if report.host_ram_bytes else "?"
    cores = f", {report.cpu_cores} physical cores" if report.cpu_cores else ""
    con.print(f"host RAM {ram}; {report.cpu_count or '?'} logical CPUs{cores}")
    t = Table()
    for col in ("GPU", "name", "memory", "bus id", "NVLink active/total", "PCIe now (max)", "NUMA", "CPU affinity"):
        t.add_column(col)

    def _pcie(g) -> str:
        if g.pcie_gen_current is None and g.pcie_gen_max is None:
            return "?"
        return (f"Gen{g.pcie_gen_current or '?'} x{g.pcie_width_current or '?'} "
                f"(Gen{g.pcie_gen_max or '?'} x{g.pcie_width_max or '?'})")

    for g in report.gpus:
        nvl = "?" if g.nvlink_total is None else (f"{g.nvlink_active}/{g.nvlink_total}" if g.nvlink_total else "none")
        t.add_row(str(g.index), esc(g.name), fmt_gib(g.memory_bytes) if g.memory_bytes else "?",
                  esc(g.pci_bus_id or "?"), nvl, _pcie(g), "?" if g.numa_node is None else str(g.numa_node),
                  esc(g.cpu_affinity or "?"))
    con.print(t)
    for n in report.notes:
        con.print(f"note: {esc(n)}")
    if report.match is not None:
        m = report.match
        con.print(f"closest profile: [bold]{esc(m.name)}[/] (score {m.score:.1f}/100): {esc(m.reason)}")
        others = [c for c in report.candidates[1:] if c.name not in m.ties][:3]
        if others:
            con.print("next: " + ", ".join(f"{esc(c.name)} ({c.score:.1f})" for c in others))
    if saved:
        con.print(f"wrote profile {esc(saved)} (inter-node link UNMEASURED: run `zeroplan bench collectives "
                  "--save-profile` across nodes to fill)")


def register(app: typer.Typer) -> None:
    @app.command("detect")
    @handle_errors
    def detect(
        save_profile: Optional[str] = typer.Option(
            None, "--save-profile", help="Write a hardware profile TOML for this node to this path."),
        name: Optional[str] = typer.Option(None, "--name", help="Profile name for --save-profile (default: HOST-detected)."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
    ) -> None:
        """Detect local NVIDIA GPUs (NVML): memory, NVLink, PCIe, NUMA; suggest the closest hardware profile.

        Example: zeroplan detect --save-profile mynode.toml
        """
        from zeroplan._util import InputError, validate_output_path
        from zeroplan.inspect.detect import detect_node, profile_from_report

        validate_output_path(save_profile, option="--save-profile")
        report = detect_node()
        saved = None
        if save_profile is not None:
            if report.match is None:
                raise InputError("no bundled hardware profile to start from; cannot write --save-profile")
            from zeroplan.specs.hardware import load_profile, save_profile as _save

            prof = profile_from_report(report, load_profile(report.match.name), name=name)
            saved = str(_save(prof, save_profile))
        if json_out:
            data = report.model_dump(mode="json")
            data["saved_profile"] = saved
            print_json(data)
            return
        _render(report, saved)
