"""The bundled engine's phase peaks against the planner's over a grid of small runs: where
``bench zero``'s phase-peak tolerance (``zeroplan/bench/zero_compare.py`` ``PHASE_PEAK_TOLERANCE``)
comes from.

Grid (256 runs): llama- and gpt2-shaped models of 2 layers at width 64 (vocab 512), N = 2 and 4
ranks over gloo, fp32 and bf16, stages 0-3, gradient accumulation 1 and 2, reduce_bucket_size 3000
and DeepSpeed's default, micro-batch 2 x 16 and 4 x 64 tokens. Each run warms up one step and
measures two; every rank's peak of each phase (forward, backward, step; tensor storages, CPU) is
compared with the plan for the same model, world size and config.

    python examples/validation/phase-peaks/sweep.py OUT.json

Writes OUT.json (every run: its inputs and where the plan's activations come from, and per phase the
measured peak over ranks, the predicted peak, measured/predicted - 1 and the tolerance ``bench zero``
gives it) and prints the range per phase, for traced and for formula activations. About
two minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from itertools import product

from zeroplan.bench.validate import _preload_dispatch, measure_rank, predict, scaled_spec
from zeroplan.bench.zero_compare import phase_peak_tolerance
from zeroplan.bench.zero_predict import engine_optimizer_impl
from zeroplan.runtime.launch import spawn
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model

MODELS = ("llama-2-7b", "gpt2")
WORLDS = (2, 4)
PRECISIONS = ("fp32", "bf16")
STAGES = (0, 1, 2, 3)
GAS = (1, 2)
BUCKETS = (3000, None)  # None: DeepSpeed's default (5e8)
TOKENS = ((2, 16), (4, 64))
PHASES = ("forward", "backward", "step")


def _runs() -> list[dict]:
    out = []
    for prec, stage, gas, rbs, (mb, seq) in product(PRECISIONS, STAGES, GAS, BUCKETS, TOKENS):
        z = {"stage": stage} if rbs is None else {"stage": stage, "reduce_bucket_size": rbs}
        out.append({"zero": ZeroConfig(**z), "precision": prec, "micro_batch": mb, "seq_len": seq, "grad_accum": gas,
                    "warmup": 1, "steps": 2, "comm_model": "deepspeed", "seed": 0})
    return out


def _measure(rank: int, world: int, spec, runs: list[dict]) -> list[dict]:
    return measure_rank(rank, world, spec, runs)


def main(out_path: str) -> None:
    _preload_dispatch()
    rows = []
    for name, world in product(MODELS, WORLDS):
        spec = scaled_spec(load_model(name), layers=2, hidden=64, vocab=512)
        runs = _runs()
        per_rank = spawn(_measure, world, args=(spec, runs), timeout_s=1800)
        for k, run in enumerate(runs):
            plan = predict(spec, run["zero"], precision=run["precision"], micro_batch=run["micro_batch"],
                           seq_len=run["seq_len"], grad_accum=run["grad_accum"], n=world,
                           optimizer_impl=engine_optimizer_impl("cpu"))
            row = {"model": name, "world": world, "stage": run["zero"].stage, "precision": run["precision"],
                   "grad_accum": run["grad_accum"], "reduce_bucket_size": int(run["zero"].reduce_bucket_size),
                   "micro_batch": run["micro_batch"], "seq_len": run["seq_len"],
                   "activations": plan.memory.activations_detail.source}
            for ph in PHASES:
                meas = max(r[k]["phase_peaks"][ph]["peak"] for r in per_rank)
                pred = plan.memory.phases[ph].peak
                row[ph] = {"measured": meas, "predicted": pred, "error": meas / pred - 1,
                           "tolerance": phase_peak_tolerance(plan, ph)}
            rows.append(row)
        print(f"{name} N={world}: {len(runs)} runs", file=sys.stderr, flush=True)
    summary = {}
    for traced in (True, False):
        sel = [r for r in rows if r["activations"].startswith("transformers ") == traced]
        if sel:
            summary["traced" if traced else "formula"] = {
                ph: {"min": min(r[ph]["error"] for r in sel), "max": max(r[ph]["error"] for r in sel)} for ph in PHASES}
    report = {"command": "python examples/validation/phase-peaks/sweep.py " + " ".join(sys.argv[1:]),
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count()},
              "runs": len(rows), "summary": summary, "rows": rows}
    import torch

    report["environment"]["torch"] = torch.__version__
    with open(out_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out_path + ".tmp", out_path)
    for kind, by_phase in summary.items():
        for ph, s in by_phase.items():
            print(f"{kind} activations, {ph}: measured/predicted - 1 from {s['min']:+.1%} to {s['max']:+.1%}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
