"""`zeroplan bench collectives` against the planner: the predicted time of every measured row
(``core.timing``), and the α–β fit of the sweep saved as a hardware profile's link tier (split out
of ``bench/collectives.py``, which re-exports these names)."""

from __future__ import annotations

from datetime import date
from typing import TYPE_CHECKING, Any

from zeroplan._util import InputError

if TYPE_CHECKING:
    from zeroplan.bench.collectives import CollectivesReport

__all__ = ["R2_WARN_BELOW", "add_predictions", "measured_link_name", "fit_tiers", "save_profile_from_report"]

# A fit below this R² does not describe the link: --save-profile still writes it (the data
# are what they are) but warns, in the output and in the profile's sources.
R2_WARN_BELOW = 0.9


# ------------------------------------------------------------------ prediction
def add_predictions(report: CollectivesReport, hw: Any) -> None:
    """Fill ``predicted_time_s`` / ``predicted_busbw_GBps`` of every row from the planner's
    collective time model (``core.timing.collective_time_s``) on profile ``hw``, for the same
    op, full-buffer size, group and layout (``world_size`` ranks, ``gpus_per_node`` per node)."""
    from zeroplan.core.comm import LedgerEntry
    from zeroplan.core.timing import collective_time_s

    report.hardware = hw.name
    for r in report.results:
        e = LedgerEntry(op=r.op, phase="step", what="bench collectives", buffer_bytes=r.size_bytes, count=1,
                        dtype=r.dtype, group=r.group, group_size=r.group_size, overlap=False,
                        sent_bytes_per_call=0, sent_bytes=0)
        t = collective_time_s(e, hw, report.world_size, report.gpus_per_node)
        r.predicted_time_s = t
        r.predicted_busbw_GBps = r.size_bytes * r.busbw_factor / t / 1e9 if t > 0 else None


def measured_link_name(report: CollectivesReport) -> str:
    """The link tier's name in a saved profile: what was measured, not the base profile's link."""
    hosts = sorted({str(r.get("hostname", "?")) for r in report.ranks})
    where = hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts"
    return (f"measured {report.backend} {report.group}, {report.nodes} node(s) x {report.gpus_per_node} "
            f"on {where}")


# ------------------------------------------------------------------ calibration
def fit_tiers(report: CollectivesReport) -> dict[str, Any]:
    """α–β fit over the sweep for the link tier the measured group exercised.

    group "intra-node" -> intra_node; "inter-node" -> inter_node; "all" -> intra_node on one
    node, inter_node (the bottleneck tier) across nodes.
    """
    from zeroplan.bench.fit import fit_alpha_beta

    if report.group == "intra-node" or (report.group == "all" and report.nodes == 1):
        tier = "intra_node"
    else:
        tier = "inter_node"
    points = [(r.size_bytes * r.busbw_factor, r.time_s) for r in report.results if r.busbw_factor > 0]
    if not points:
        raise InputError("--save-profile: no op in the sweep moves data across the group (world size 1?)")
    return {tier: fit_alpha_beta(points)}


def save_profile_from_report(report: CollectivesReport, path: str, hardware: str | None) -> dict[str, dict[str, Any]]:
    """Write a hardware-profile TOML: the fitted link tier(s) from the sweep, every other field
    (and its source) from the ``hardware`` base profile. Returns the fit per tier."""
    from zeroplan.specs import hardware as hw

    if hardware is None:
        raise InputError("--save-profile needs --hardware BASE (a profile name or TOML path) for the non-link fields")
    fits = fit_tiers(report)
    base = hw.load_profile(hardware)
    today = date.today().isoformat()
    note = (f"measured by zeroplan bench collectives on {today}: {report.backend}, world size "
            f"{report.world_size} ({report.nodes} node(s) x {report.gpus_per_node}), group {report.group}, "
            f"{report.dtype}, ops {','.join(sorted({r.op for r in report.results}))}, "
            f"{len(report.results)} points; alpha-beta least squares t = alpha + busbw_bytes/beta")
    updates: dict[str, Any] = {}
    sources = dict(base.sources)
    out: dict[str, dict[str, float]] = {}
    for tier, f in fits.items():
        latency_us = min(max(f.latency_us, 0.1), 10_000.0)  # the profile schema's bounds (0.1 us .. 10 ms)
        bw = f.bandwidth_GBps
        per_gpu_note = ""
        if tier == "inter_node" and report.group == "all" and report.nodes > 1:
            # a ring over all GPUs crosses nodes on every NIC at once: the measured bus bandwidth is
            # the node's NICs together; the profile stores the per-GPU share (core/timing.py)
            bw = f.bandwidth_GBps / max(1, report.gpus_per_node)
            per_gpu_note = f"; busbw {f.bandwidth_GBps:.4g} GB/s over whole nodes / {report.gpus_per_node} GPUs per node"
        updates[tier] = getattr(base, tier).model_copy(update={
            "name": measured_link_name(report), "bandwidth_GBps_per_gpu": bw, "latency_us": latency_us,
            "efficiency": 1.0,
        })
        warning = None
        if not f.r2 >= R2_WARN_BELOW:
            warning = (f"poor alpha-beta fit for {tier}: R^2 {f.r2:.3f} < {R2_WARN_BELOW} (max relative error "
                       f"{f.max_rel_error:.0%}); the times do not follow t = alpha + bytes/beta, so the fitted "
                       "link may not predict this network: rerun with more --iters, on an idle machine, or a "
                       "wider size range")
        sources[f"{tier}.bandwidth_GBps_per_gpu"] = (f"{note} (R^2 {f.r2:.3f}){per_gpu_note}"
                                                     + (f"; WARNING {warning}" if warning else ""))
        sources[f"{tier}.latency_us"] = note + ("" if latency_us == f.latency_us else
                                                f" (fitted {f.latency_us:.3g} us, clamped to the schema's 0.1 us .. 10 ms)")
        sources[f"{tier}.efficiency"] = f"{note}: 1.0 because the bandwidth is the measured bus bandwidth"
        out[tier] = {"latency_us": latency_us, "bandwidth_GBps": bw, "r2": f.r2,
                     "points": f.points, "max_rel_error": f.max_rel_error, "link_name": measured_link_name(report),
                     "warning": warning}
    updates["sources"] = sources
    updates["name"] = f"{base.name}-measured"
    updates["description"] = f"{base.description} — link tier(s) {', '.join(fits)} {note}"
    profile = base.model_copy(update=updates)
    hw.save_profile(profile, path)
    return out
