"""zeroplan against published GPU memory of DeepSpeed runs (tests/data/published/memory.json).

Each case is evaluated from the setup its source states (assumptions are listed in the file);
the figure compared is the one the source measured: ``allocated_at_oom`` and ``max_allocated`` (a
training log's memory report) against zeroplan's allocated peak (``max_memory_allocated``), the same
report's ``max_memory_reserved`` (a second row) against zeroplan's reserved, ``nvidia_smi`` against the
device total (reserved + CUDA context + NCCL), ``allocated_at_oom_forward`` (an OOM raised inside the
forward pass, so the bytes are a lower bound on the forward peak) against the forward phase's allocated
peak, as a bound and not in the median. Fits/OOM is judged on the device total. The overheads (CUDA context,
NCCL per communicator, allocator slack) are the dgx-a100-80gb profile's; each case's GPU memory
is its own.

What is asserted: every case plans; the fits/OOM verdicts zeroplan gets wrong are exactly the
known ones (none); the issue's goal, median |error| <= 5% over the scored figures; the step-phase
OOM figures (PyTorch's own counters) are within 2%; the forward-OOM bound holds; the reserved totals
zeroplan plans more than 30% too low are exactly the known ones; and README.md's sentence about this
dataset states the numbers this code computes (regenerate it with ``python tests/test_published_memory.py``).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from zeroplan.core.allocator import STAGE3_CACHE_NOTE
from zeroplan.core.memory import grads_from_autograd
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model
from zeroplan.specs.training import ACTIVATION_IMPLS, TrainingSetup, get_precision

DATA = Path(__file__).parent / "data" / "published" / "memory.json"
CASES = json.loads(DATA.read_text())["cases"]
README = Path(__file__).parents[1] / "README.md"
GIB = 2**30
MiB = 2**20
PROFILE = Path(__file__).parents[1] / "hardware_profiles" / "dgx-a100-80gb.toml"
# figures in the median: max_allocated / max_reserved are torch.cuda's counters in a training log's memory report
SCORED = ("allocated_at_oom", "max_allocated", "max_reserved", "nvidia_smi")
STEP_OOM_TOLERANCE = 0.02  # allocated_at_oom read from PyTorch's counters (two decimals of GiB)
# Verdicts zeroplan gets wrong, each with its reason (tests/data/published/README.md, README
# "Against published measurements"): the test fails when one of them starts passing (update the
# set) or another goes wrong. None today.
KNOWN_WRONG_VERDICTS: dict[str, str] = {}
MEDIAN_GOAL = 0.05  # issue #12: median |error| of the scored figures


def predict(case: dict, fragmentation_fraction: float | None = None) -> tuple[object, int | None]:
    """zeroplan's plan for the case (``fragmentation_fraction``: the profile's, unless given)."""
    s = case["setup"]
    model = s["model"]
    # a config.json under tests/data/published/models/ (shapes the source gives), else a catalog name or count
    spec = load_model(str(DATA.parent / model) if model.endswith(".json") else model)
    ds = load_ds_config(s["ds_config"], hidden_size=spec.hidden_size)
    zero = ds.zero
    training = TrainingSetup(
        precision=get_precision(s["precision"]), micro_batch=s["micro_batch"], seq_len=s["seq_len"],
        grad_accum=s["grad_accum"], checkpointing=s["checkpointing"], optimizer_impl=s["optimizer_impl"],
        flash_attention=s.get("flash_attention", True), activation_impl=s.get("activations", "transformers"),
        cpu_checkpointing=ds.activation_checkpointing.cpu_checkpointing,
        partition_activations=ds.activation_checkpointing.partition_activations,
    )
    base = load_profile(str(PROFILE))
    hw = base.model_copy(update={
        "gpu": base.gpu.model_copy(update={"memory_bytes": s["gpu_memory_bytes"]}),
        "node": base.node.model_copy(update={"gpus_per_node": s["gpus_per_node"]}),
    })
    if fragmentation_fraction is not None:
        hw = hw.model_copy(update={"overhead": hw.overhead.model_copy(
            update={"fragmentation_fraction": fragmentation_fraction})})
    plan = evaluate(model=spec, training=training, zero=zero, n_gpus=s["gpus"], gpus_per_node=s["gpus_per_node"],
                    hardware=hw)
    fig = case["measured"]["figure"]
    got = {"allocated_at_oom": plan.memory.allocated, "max_allocated": plan.memory.allocated,
           "nvidia_smi": plan.memory.peak, "allocated_at_oom_forward": plan.memory.phases["forward"].peak,
           None: None}[fig]
    return plan, got


def table() -> list[dict]:
    """One row per case (its figure and fits/OOM verdict), and a second row for a case whose report
    also gives ``torch.cuda.max_memory_reserved`` (``measured.max_reserved_bytes``: the allocator's
    cached total, zeroplan's reserved; no verdict on that row)."""
    rows = []
    for case in CASES:
        plan, got = predict(case)
        want = case["measured"].get("bytes")
        rows.append({
            "id": case["id"], "figure": case["measured"]["figure"], "want": want, "got": got,
            "err": (got - want) / want if want else None, "published": case["verdict"],
            "zeroplan": "fits" if plan.fits else "oom",
        })
        reserved = case["measured"].get("max_reserved_bytes")
        if reserved:
            rows.append({"id": case["id"], "figure": "max_reserved", "want": reserved, "got": plan.memory.reserved,
                         "err": (plan.memory.reserved - reserved) / reserved, "published": None, "zeroplan": None})
    return rows


def summary(rows: list[dict]) -> dict:
    scored = [r["err"] for r in rows if r["figure"] in SCORED]
    verdicts = [r for r in rows if r["published"] is not None]
    return {
        "cases": len(verdicts), "sources": len({c["tracker"] for c in CASES}), "scored": len(scored),
        "median": statistics.median(abs(e) for e in scored),
        "right": sum(r["published"] == r["zeroplan"] for r in verdicts),
    }


def readme_sentence(s: dict) -> str:
    return (f"{s['cases']} cases from {s['sources']} independent sources, {s['scored']} scored "
            f"figures: median |error| **{s['median']:.1%}**; {s['right']} of {s['cases']} fits/OOM verdicts right.")


def print_table(rows: list[dict]) -> None:
    print("\ncase                                            figure                    measured GiB  zeroplan GiB"
          "   error  verdict (published/zeroplan)")
    for r in rows:
        w = f"{r['want'] / GIB:12.2f}" if r["want"] else f"{'-':>12}"
        g = f"{r['got'] / GIB:13.2f}" if r["got"] else f"{'-':>13}"
        e = f"{r['err']:+7.1%}" if r["err"] is not None else f"{'-':>7}"
        v = f"{r['published']}/{r['zeroplan']}" if r["published"] is not None else "-"
        print(f"{r['id']:47} {r['figure'] or 'verdict':25} {w} {g} {e}  {v}")
    s = summary(rows)
    print(f"median |error| over {s['scored']} scored figures: {s['median']:.1%}; {s['right']}/{s['cases']} verdicts "
          f"right; {s['sources']} independent sources; goal (<= 5%, all verdicts right) "
          f"{'met' if s['median'] <= MEDIAN_GOAL and s['right'] == s['cases'] else 'not met'}")


def test_published_cases_error_and_verdicts(capsys):
    rows = table()
    with capsys.disabled():
        print_table(rows)
    wrong = {r["id"] for r in rows if r["published"] is not None and r["published"] != r["zeroplan"]}
    assert wrong == set(KNOWN_WRONG_VERDICTS), f"fits/OOM verdicts wrong: {sorted(wrong)}"
    assert summary(rows)["median"] <= MEDIAN_GOAL, summary(rows)
    for r in rows:
        if r["figure"] == "allocated_at_oom":
            assert abs(r["err"]) <= STEP_OOM_TOLERANCE, (r["id"], r["err"])
        if r["figure"] == "allocated_at_oom_forward":
            # the OOM struck inside forward: the forward peak cannot be below what was allocated then
            assert r["got"] >= r["want"], (r["id"], r["got"], r["want"])


def test_readme_states_what_the_code_computes():
    text = " ".join(README.read_text().split())
    want = readme_sentence(summary(table()))
    assert want in text, f"README.md should say: {want!r}"
    # every case id is listed in the README's table of this dataset, with its error as printed
    for r in table():
        cell = f"{r['err']:+.1%}".replace("-", "−") if r["err"] is not None else "—"
        assert re.search(rf"`{re.escape(r['id'])}`[^\n]*\| {re.escape(cell)} \|", README.read_text()), (r["id"], cell)


# Reserved totals zeroplan plans too low, each with its reason (README "Against published measurements"):
# the test fails when one comes within 30% (update the set) or another falls that far short.
KNOWN_RESERVED_GAPS: dict[str, str] = {
    "ds-zeropp-tutorial-18b-z3-64xv100": "unexplained: 18.40 GiB cached at 8.09 GiB allocated (2.27x); the slack "
                                         "and side-pool model reaches 10.17 GiB, and 10.92 GiB with slack on every "
                                         "churned byte",
    "ds-zeropp-tutorial-18b-zeropp-64xv100": "unexplained, as the ZeRO-3 run of the same tutorial: 20.06 GiB cached at "
                                             "10.02 GiB allocated (2.00x)",
}


def test_megatron_memory_reports(capsys):
    """Cases read off a Megatron memory report also give the bytes allocated between steps: the
    baseline ZeRO-3 run's pin its unpublished bucket size (model states + one fp16 bucket of 1e7
    elements, within 1 MiB; DeepSpeed's default 5e8 would add 934 MiB). Their reserved totals are the
    known gaps above."""
    reports = [c for c in CASES if "idle_allocated_bytes" in c["measured"]]
    assert len(reports) == 2
    with capsys.disabled():
        for case in reports:
            mem = predict(case)[0].memory
            idle = mem.model_states + mem.buffers_detail["ipg_bucket"]
            want = case["measured"]["idle_allocated_bytes"]
            print(f"{case['id']}: allocated between steps {want / MiB:.2f} MiB, zeroplan's model states + bucket "
                  f"{idle / MiB:.2f} MiB ({(idle - want) / MiB:+.2f})")
            if case["id"] == "ds-zeropp-tutorial-18b-z3-64xv100":
                assert abs(idle - want) <= MiB
    short = {r["id"] for r in table() if r["figure"] == "max_reserved" and r["err"] < -0.30}
    assert short == set(KNOWN_RESERVED_GAPS)


def test_stage3_cache_note_states_the_published_ratios():
    """Every stage-3 plan carries STAGE3_CACHE_NOTE (core/allocator.py); its ranges are these cases':
    the cached memory measured over the planned (the two reports' max_reserved, LLaMA-Factory #5977's
    nvidia-smi) and the reports' reserved over their max allocated."""
    rows = table()
    planned = [r["want"] / r["got"] for r in rows if r["figure"] == "max_reserved"
               or r["id"] == "llamafactory-5977-llama3-8b-z3-offload-3090"]
    measured = [c["measured"]["max_reserved_bytes"] / c["measured"]["bytes"] for c in CASES
                if "max_reserved_bytes" in c["measured"]]
    assert len(planned) == 3 and len(measured) == 2
    assert f"cached {min(planned):.1f}-{max(planned):.1f}x the reserved memory" in STAGE3_CACHE_NOTE
    assert f"({min(measured):.1f}-{max(measured):.1f}x their allocated peak)" in STAGE3_CACHE_NOTE
    by_stage = {c["setup"]["stage"]: predict(c)[0] for c in CASES if c["setup"]["stage"] in (2, 3)}
    assert STAGE3_CACHE_NOTE in by_stage[3].memory.notes and STAGE3_CACHE_NOTE not in by_stage[2].memory.notes


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case_setup_is_complete(case):
    s = case["setup"]
    for key in ("model", "gpus", "stage", "precision", "micro_batch", "seq_len", "checkpointing", "offload_optimizer",
                "offload_param", "optimizer_impl", "gpu_memory_bytes", "ds_config"):
        assert key in s, key
    assert case["source"].startswith("https://")
    assert case["verdict"] in ("fits", "oom")
    assert s["ds_config"]["zero_optimization"]["stage"] == s["stage"]
    assert s.get("activations", "transformers") in ACTIVATION_IMPLS
    assert case["measured"]["figure"] in (None, *SCORED, "allocated_at_oom_forward")
    assert case["measured"]["figure"] != "max_reserved"  # a second row of a report's case (table())
    assert (case["measured"]["figure"] is None) == (case["measured"].get("bytes") is None)
    zero = load_ds_config(s["ds_config"], hidden_size=load_model(
        str(DATA.parent / s["model"]) if s["model"].endswith(".json") else s["model"]).hidden_size).zero
    assert zero.optimizer_offload_device == s["offload_optimizer"] and zero.param_offload_device == s["offload_param"]


# ---- reserved / allocated: the caching allocator's split-segment slack (core/allocator.py) ----
# An OOM line states PyTorch's allocated and reserved bytes *after* DeviceCachingAllocator::malloc
# released every cached segment no live block sits in (release_cached_blocks): reserved is then what
# the allocator cannot release, zeroplan's ``required``. With the failed request added to both (it
# would have been mapped in a segment of its own: alloc_block), the measured ratio is
# (reserved + request) / (allocated + request); zeroplan's is required / allocated of the phase the
# OOM struck in. The slack model is linear in the profile's fragmentation_fraction f, so each pair
# whose churned bytes are not zero pins one f: the profile's value is the mean over the sources.
SLACK_BEFORE_F = 0.10  # the flat fraction of the whole default pool zeroplan used before (issue #12 §3)
SLACK_CALIBRATION_DIGITS = 2


def _ratio(case: dict, plan: object, f: float, old: bool = False) -> float:
    """zeroplan's non-releasable / allocated ratio for the pair's phase; ``old``: the flat fraction
    ``f`` of every live byte (the model before this calibration: held_by_phase None)."""
    from zeroplan.core.allocator import required_bytes
    m = plan.memory
    phase = case["measured"]["reserved_pair"]["phase"]
    live = {p: m.phases[p].peak for p in ("forward", "backward", "step")}
    if phase != "step":
        live = {phase: live[phase]}
    pinned = grads_from_autograd(m.optimizer_wrapper, case["setup"]["stage"])
    held = None if old else {p: m.held_bytes[p] for p in live}
    need = required_bytes(live, {}, fragmentation_fraction=f, step_transient=m.step_transient_bytes if phase == "step" else 0,
                          step_pinned=pinned and phase == "step", held_by_phase=held)
    return need / max(live.values())


def slack_rows() -> list[dict]:
    rows = []
    f_now = load_profile(str(PROFILE)).overhead.fragmentation_fraction
    for case in CASES:
        pair = case["measured"].get("reserved_pair")
        if not pair:
            continue
        plan0, _ = predict(case, 0.0)
        plan1, _ = predict(case, 1.0)
        r0, r1 = _ratio(case, plan0, 0.0), _ratio(case, plan1, 1.0)
        q = pair["request_bytes"]
        want = (pair["reserved_bytes"] + q) / (pair["allocated_bytes"] + q)
        slope = r1 - r0
        rows.append({"id": case["id"], "tracker": case["tracker"], "phase": pair["phase"], "want": want,
                     "before": _ratio(case, plan0, SLACK_BEFORE_F, old=True), "after": r0 + f_now * slope,
                     "r0": r0, "slope": slope, "f": (want - r0) / slope if slope > 1e-3 else None})
    return rows


def calibrated_f(rows: list[dict], leave_out: str | None = None) -> float:
    """The mean over sources (each the mean of its pairs) of the f each informative pair pins."""
    by_src: dict[str, list[float]] = {}
    for r in rows:
        if r["f"] is not None and r["tracker"] != leave_out:
            by_src.setdefault(r["tracker"], []).append(r["f"])
    return statistics.mean(statistics.mean(v) for v in by_src.values())


def slack_summary(rows: list[dict]) -> dict:
    return {"pairs": len(rows), "sources": len({r["tracker"] for r in rows}),
            "informative": len({r["tracker"] for r in rows if r["f"] is not None}),
            "before": statistics.median(abs(r["before"] / r["want"] - 1) for r in rows),
            "after": statistics.median(abs(r["after"] / r["want"] - 1) for r in rows),
            "f": calibrated_f(rows)}


def slack_sentence(rows: list[dict]) -> str:
    s = slack_summary(rows)
    return (f"reserved/allocated at {s['pairs']} published OOMs from {s['sources']} independent sources: median "
            f"|error| of the ratio **{s['before']:.1%}** with a flat {SLACK_BEFORE_F:.0%} of every live byte, "
            f"**{s['after']:.1%}** with slack on the churned bytes only (fragmentation_fraction "
            f"{s['f']:.{SLACK_CALIBRATION_DIGITS}f}, calibrated on the {s['informative']} sources whose pairs have "
            f"churned bytes).")


def print_slack(rows: list[dict]) -> None:
    print("\ncase                                            phase    measured  before  after   err before/after  f pinned"
          "  leave-this-source-out f, err")
    for r in rows:
        f_loo = calibrated_f(rows, leave_out=r["tracker"]) if len({x["tracker"] for x in rows if x["f"] is not None
                                                                  and x["tracker"] != r["tracker"]}) else None
        loo = (f"{f_loo:.2f}, {(r['r0'] + f_loo * r['slope']) / r['want'] - 1:+.1%}" if f_loo is not None else "-")
        fp = f"{r['f']:.2f}" if r["f"] is not None else "-"
        print(f"{r['id']:47} {r['phase']:8} {r['want']:8.3f} {r['before']:7.3f} {r['after']:6.3f}   "
              f"{r['before'] / r['want'] - 1:+7.1%} {r['after'] / r['want'] - 1:+7.1%}  {fp:>8}  {loo}")
    s = slack_summary(rows)
    print(f"median |error| of reserved/allocated: before {s['before']:.1%}, after {s['after']:.1%}; "
          f"calibrated fragmentation_fraction {s['f']:.3f} (profile: "
          f"{load_profile(str(PROFILE)).overhead.fragmentation_fraction})")


def test_reserved_to_allocated_pairs(capsys):
    """The profile's slack fraction is the documented calibration over the published pairs (at least
    two independent sources pin it); the ratio is no worse than the flat fraction's; README says so."""
    rows = slack_rows()
    with capsys.disabled():
        print_slack(rows)
    s = slack_summary(rows)
    assert s["informative"] >= 2, "the calibration needs two independent sources"
    f_profile = load_profile(str(PROFILE)).overhead.fragmentation_fraction
    assert f_profile == round(s["f"], SLACK_CALIBRATION_DIGITS), (f_profile, s["f"])
    assert s["after"] <= s["before"], s
    assert slack_sentence(rows) in " ".join(README.read_text().split())
    for r in rows:  # README's table of the pairs shows this code's ratios
        cells = f"| {r['want']:.3f} | {r['before']:.3f} ({r['before'] / r['want'] - 1:+.1%}) | " \
                f"{r['after']:.3f} ({r['after'] / r['want'] - 1:+.1%}) |"
        assert re.search(rf"`{re.escape(r['id'])}`[^\n]*{re.escape(cells.replace('-', '−'))}", README.read_text()), (
            r["id"], cells)


if __name__ == "__main__":  # regenerate the README figures: python tests/test_published_memory.py
    rows = table()
    print_table(rows)
    print("\nREADME sentence:\n" + readme_sentence(summary(rows)))
    srows = slack_rows()
    print_slack(srows)
    print("\nREADME slack sentence:\n" + slack_sentence(srows))
