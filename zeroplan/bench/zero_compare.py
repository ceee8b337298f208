"""Predicted vs measured rows for ``bench zero``: collectives (exact), model states, phase peaks and
their breakdown, step time; the tolerances (split out of ``bench/validate.py``).

A phase peak is gated by how well the plan knows that phase (``phase_peak_tolerance``), from the 256-run
sweep of the bundled engine against the plan (``examples/validation/phase-peaks/``):
``PHASE_PEAK_TOLERANCE_TRACED`` where the activations come from the transformers trace
(core/activation_data.json) and the phase is planned moment by moment; ``PHASE_PEAK_TOLERANCE`` where the
activations come from Korthikanti's formula (a family or setting the trace does not cover, such as GPT-2
with its dropout), for the ``paper`` flavour (an idealisation, not an engine's schedule), and for stage 3's
forward when it gathers parameters (planned region by region from the coordinator replay, each region's
activations bounded from the top layer's forward peak; the sweep gathers nothing, so no narrower bound
has been measured for it)."""

from __future__ import annotations

from typing import Any

from zeroplan.bench.zero_inputs import step_time_row

MODEL_STATE_TOLERANCE = 0.01
PHASE_PEAK_TOLERANCE = 0.6
PHASE_PEAK_TOLERANCE_TRACED = 0.15

_STATES = ("params", "gradients", "optimizer_states")
_CATS = ("params", "gradients", "optimizer_states", "buffers", "activations", "other")
_PHASES = ("forward", "backward", "step")


def phase_peak_tolerance(plan: Any, phase: str = "backward", floor: float = 0.0) -> float:
    """The tolerance for ``plan``'s ``phase`` peak (module docstring), never below ``floor`` (``--tolerance``)."""
    mem = plan.memory
    traced = str(getattr(mem.activations_detail, "source", "")).startswith("transformers ")
    paper = getattr(plan.comm, "flavour", "deepspeed") == "paper"
    stacked = phase == "forward" and plan.stage == 3 and mem.buffers_detail.get("gathered_params_forward", 0) > 0
    known = traced and not paper and not stacked
    return max(PHASE_PEAK_TOLERANCE_TRACED if known else PHASE_PEAK_TOLERANCE, floor)


def tolerances(override: dict[str, float] | None = None) -> dict[str, float | None]:
    """A report's tolerances by kind, ``override`` (``--tolerance``) applied; ``phase_peak`` None: each plan's
    own per phase (``phase_peak_tolerance``), shown per row."""
    return {"collective": 0.0, "model_state": MODEL_STATE_TOLERANCE, "phase_peak": None, **(override or {})}


def _row(kind: str, name: str, predicted: float | None, measured: float | None, tol: float | None) -> dict:
    err = None
    ok = True
    if predicted is not None and measured is not None:
        if predicted == measured:
            err = 0.0
        elif predicted:
            err = (measured - predicted) / predicted
        else:
            err = float("inf")
        if tol is not None:
            ok = err == 0.0 if tol == 0 else abs(err) <= tol
    elif tol is not None:
        ok = False
    return {"kind": kind, "name": name, "predicted": predicted, "measured": measured,
            "error": None if err is None or err == float("inf") else err, "tolerance": tol, "ok": ok}


def compare(plan: Any, measured: list[dict], *, model_state_tol: float = MODEL_STATE_TOLERANCE,
            phase_tol: float | None = None, collective_tol: float = 0.0,
            include_host: bool = False, device: str = "cpu", hardware: Any = None) -> list[dict]:
    """Rows of predicted vs measured (``measured``: one dict per rank from ``measure_rank``). ``phase_tol``:
    None for the plan's own per phase (``phase_peak_tolerance``), else a floor under it."""
    floor = phase_tol or 0.0
    rows: list[dict] = []
    r0 = measured[0]
    # collectives: per (op, phase), counts and bytes per optimizer step
    pred: dict[str, dict[str, int]] = {}
    for e in plan.comm.collectives:
        d = pred.setdefault(f"{e.op}/{e.phase}", {"count": 0, "bytes": 0})
        d["count"] += e.count
        d["bytes"] += e.count * e.buffer_bytes
    meas = r0["collectives"]
    for key in sorted(set(pred) | set(meas)):
        p, m = pred.get(key, {"count": 0, "bytes": 0}), meas.get(key, {"count": 0, "bytes": 0})
        rows.append(_row("collective", f"{key} calls", p["count"], m["count"], collective_tol))
        rows.append(_row("collective", f"{key} bytes", p["bytes"], m["bytes"], collective_tol))
    for other in measured[1:]:
        if other["collectives"] != meas:
            rows.append(_row("collective", f"rank {other['rank']} schedule equals rank 0's", 1, 0, 0.0))
    if not all(r.get("steady", True) for r in measured):
        rows.append(_row("collective", "every measured step issued the same schedule", 1, 0, 0.0))
    # model states
    mem = plan.memory
    # the plan reports the heaviest rank; stage 2's gradient buffer covers whole params (a buffer
    # line in the plan, part of the measured gradient storage)
    ms = {c: max(r["model_states"].get(c, 0) for r in measured) for c in _STATES}
    want = {c: getattr(mem, c) for c in _STATES}
    want["gradients"] += mem.buffers_detail.get("gradient_partition_whole_params", 0)
    if include_host:  # measured on CPU, where offloaded states are counted with the rest
        host = mem.host.detail
        want["optimizer_states"] += host.get("optimizer_states", 0) + host.get("fp32_master_partition", 0)
        want["gradients"] += host.get("fp32_gradient_partition", 0) + host.get("bit16_gradient_partition", 0)
    for cat in _STATES:
        rows.append(_row("model_state", cat, want[cat], ms.get(cat, 0), model_state_tol))
    rows.append(_row("model_state", "model_states", sum(want.values()),
                     sum(ms.get(c, 0) for c in _STATES), model_state_tol))
    # phase peaks (max over ranks) and the breakdown at the peak
    for ph in _PHASES:
        pp = mem.phases.get(ph)
        mpk = [r["phase_peaks"].get(ph) for r in measured if r.get("phase_peaks", {}).get(ph)]
        if pp is None or not mpk:
            continue
        top = max(mpk, key=lambda x: x["peak"])
        rows.append(_row("phase_peak", f"{ph} peak", pp.peak, top["peak"], phase_peak_tolerance(plan, ph, floor)))
        if top.get("reserved_peak") is not None:  # CUDA: the caching allocator's segments
            rows.append(_row("phase_peak", f"{ph} reserved peak", getattr(pp, "reserved", None),
                             top["reserved_peak"], None))
        for cat in _CATS:
            pv = pp.by_category.get(cat, 0)
            mv = top["by_category"].get(cat, 0)
            if pv or mv:
                rows.append(_row("phase_category", f"{ph}: {cat}", pv, mv, None))
    # step time
    times = [r["step_time_s"] for r in measured if r.get("step_time_s") is not None]
    rows.append(step_time_row(plan.step_time_s, max(times) if times else None, device=device,
                              hardware_name=getattr(hardware, "name", None),
                              gpu_name=getattr(getattr(hardware, "gpu", None), "name", None)))
    return rows
