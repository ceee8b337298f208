"""The bundled engine's phase peaks against the plan for the same run (what ``bench zero`` compares).

Simulated as one rank (runtime/simulate.py: FakeTensorMode, the same engine code as a real run, no gloo
thread): small llama-shaped models, whose activations the planner takes from the transformers trace. The
optimizer's temporaries are planned for the optimizer the engine runs on CPU (bench/zero_predict.py
``engine_optimizer_impl``: one fp32 temporary of the group's size).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.bench.zero_predict import engine_optimizer_impl, predict, scaled_spec
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model

pytest.importorskip("torch")


def _pair(stage: int, precision: str, **zero):
    from zeroplan.runtime.simulate import simulate_rank

    spec = scaled_spec(load_model("llama-2-7b"), layers=2, hidden=64, vocab=512)
    z = ZeroConfig(stage=stage, **zero)
    ranks = [simulate_rank(spec, z, n=2, precision=precision, micro_batch=2, seq_len=16, rank=r, grad_accum=1)
             for r in range(2)]
    plan = predict(spec, z, precision=precision, micro_batch=2, seq_len=16, grad_accum=1, n=2,
                   optimizer_impl=engine_optimizer_impl("cpu"))
    # the plan is the heaviest rank's, as bench zero compares it with the largest measured peak
    return {ph: max(r["phase_peaks"][ph]["peak"] for r in ranks) for ph in ("forward", "backward", "step")}, \
        plan.memory.phases


def test_stage3_step_holds_no_bit16_flatten_copy():
    """stage3.py ``_prepare_fp32_grad_for_sub_group`` turns each sub-group's gradients into fp32 with
    ``flatten(...).to(fp32)``: the bit16 flatten copy is a temporary, gone before the optimizer runs. The
    engine's CPU accounting kept it through AdamW (+7% of the step at 2 ranks, bf16). In fp32 the flatten is
    the fp32 gradient itself; the step peaks at the plan's bytes but for the loss and the step counters."""
    measured, planned = _pair(3, "fp32", reduce_bucket_size=3000)
    assert 0 <= measured["step"] - planned["step"].peak < 1024


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_phase_of_a_traced_family_is_planned_to_within_six_percent(stage):
    """bf16 llama: the planner's activations are the transformers trace and the engine's model keeps what
    transformers keeps, so the forward agrees within 1% and the step to the bytes of the loss and the step
    counters (stage 3: without the bit16 flatten copy, see above); the backward within 6%
    (examples/validation/phase-peaks/: stage 0 at 4 x 64 tokens is the largest, +5.8%)."""
    measured, planned = _pair(stage, "bf16", reduce_bucket_size=3000)
    assert 0 <= measured["step"] - planned["step"].peak < 1024
    for phase, lo, hi in (("forward", -0.01, 0.01), ("backward", -0.01, 0.06)):
        assert lo <= measured[phase] / planned[phase].peak - 1 <= hi, phase


SWEEP = Path(__file__).resolve().parents[1] / "examples" / "validation" / "phase-peaks" / "sweep-cpu-2026-11-28.json"


def test_the_sweep_runs_within_the_tolerance_bench_zero_gives_them():
    """examples/validation/phase-peaks/: 256 runs of the bundled engine on gloo against the plan. Every phase
    peak is within the tolerance bench zero gives its run (±15% with traced activations, ±60% with the
    formula's), and the step within 0.2% everywhere; each run's prediction is still what the planner gives
    (a planner change that moves one asks for a new sweep)."""
    from zeroplan.bench.zero_compare import phase_peak_tolerance

    rows = json.loads(SWEEP.read_text())["rows"]
    assert len(rows) == 256
    for r in rows:
        for ph in ("forward", "backward", "step"):
            assert abs(r[ph]["error"]) <= r[ph]["tolerance"], (r, ph)
        assert abs(r["step"]["error"]) <= 0.002, r
    assert {r[ph]["tolerance"] for r in rows if r["activations"].startswith("transformers ")
            for ph in ("forward", "backward", "step")} == {0.15}
    specs = {m: scaled_spec(load_model(m), layers=2, hidden=64, vocab=512) for m in {r["model"] for r in rows}}
    sample = rows[::11]  # 24 plans, every model, world size, precision, stage, accumulation and bucket size
    assert all(len({r[k] for r in sample}) == len({r[k] for r in rows}) for k in
               ("model", "world", "precision", "stage", "grad_accum", "reduce_bucket_size", "micro_batch"))
    for r in sample:
        z = ZeroConfig(stage=r["stage"], reduce_bucket_size=r["reduce_bucket_size"])
        plan = predict(specs[r["model"]], z, precision=r["precision"], micro_batch=r["micro_batch"],
                       seq_len=r["seq_len"], grad_accum=r["grad_accum"], n=r["world"],
                       optimizer_impl=engine_optimizer_impl("cpu"))
        for ph in ("forward", "backward", "step"):
            assert (plan.memory.phases[ph].peak, phase_peak_tolerance(plan, ph)) == (
                r[ph]["predicted"], r[ph]["tolerance"]), (r, ph)
