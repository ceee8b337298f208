"""zeroplan against published GPU memory of DeepSpeed runs (tests/data/published/memory.json).

Each case is evaluated from the setup its source states (assumptions are listed in the file);
the figure compared is the one the source measured: ``allocated_at_oom`` against zeroplan's
allocated peak (``max_memory_allocated``), ``nvidia_smi`` against the device total (reserved +
CUDA context + NCCL). Fits/OOM is judged on the device total. The overheads (CUDA context, NCCL
per communicator, allocator slack) are the dgx-a100-80gb profile's; each case's GPU memory is its own.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

DATA = Path(__file__).parent / "data" / "published" / "memory.json"
CASES = json.loads(DATA.read_text())["cases"]
GIB = 2**30
PROFILE = Path(__file__).parents[1] / "hardware_profiles" / "dgx-a100-80gb.toml"
MEDIAN_ABS_ERROR_BOUND = 0.05
# Verdicts zeroplan gets wrong today, each with its reason (README "Memory per GPU"): the test
# fails when one of them starts passing (update the set) or another goes wrong.
KNOWN_WRONG_VERDICTS: set[str] = set()


def predict(case: dict) -> tuple[object, int | None]:
    s = case["setup"]
    spec = load_model(s["model"])
    ds = load_ds_config(s["ds_config"], hidden_size=spec.hidden_size)
    zero = ds.zero
    training = TrainingSetup(
        precision=get_precision(s["precision"]), micro_batch=s["micro_batch"], seq_len=s["seq_len"],
        grad_accum=s["grad_accum"], checkpointing=s["checkpointing"], optimizer_impl=s["optimizer_impl"],
    )
    base = load_profile(str(PROFILE))
    hw = base.model_copy(update={
        "gpu": base.gpu.model_copy(update={"memory_bytes": s["gpu_memory_bytes"]}),
        "node": base.node.model_copy(update={"gpus_per_node": s["gpus_per_node"]}),
    })
    plan = evaluate(model=spec, training=training, zero=zero, n_gpus=s["gpus"], gpus_per_node=s["gpus_per_node"],
                    hardware=hw)
    fig = case["measured"]["figure"]
    got = {"allocated_at_oom": plan.memory.allocated, "nvidia_smi": plan.memory.peak, None: None}[fig]
    return plan, got


def table() -> tuple[list[tuple], list[float]]:
    rows, errors = [], []
    for case in CASES:
        plan, got = predict(case)
        want = case["measured"].get("bytes")
        err = (got - want) / want if want else None
        if err is not None:
            errors.append(err)
        verdict = "fits" if plan.fits else "oom"
        rows.append((case["id"], case["measured"]["figure"] or "verdict", want, got, err, case["verdict"], verdict))
    return rows, errors


def test_published_cases_error_and_verdicts(capsys):
    rows, errors = table()
    with capsys.disabled():
        print("\ncase                                            figure            measured GiB  zeroplan GiB   error  verdict (published/zeroplan)")
        for cid, fig, want, got, err, pub, mine in rows:
            w = f"{want / GIB:12.2f}" if want else f"{'-':>12}"
            g = f"{got / GIB:13.2f}" if got else f"{'-':>13}"
            e = f"{err:+7.1%}" if err is not None else f"{'-':>7}"
            print(f"{cid:47} {fig:17} {w} {g} {e}  {pub}/{mine}")
        med = statistics.median(abs(e) for e in errors)
        print(f"median |error| over {len(errors)} measured figures: {med:.1%}; "
              f"{sum(r[5] == r[6] for r in rows)}/{len(rows)} verdicts right; "
              f"{len({c['tracker'] for c in CASES})} independent sources")
    assert med <= MEDIAN_ABS_ERROR_BOUND
    wrong = {r[0] for r in rows if r[5] != r[6]}
    assert wrong == KNOWN_WRONG_VERDICTS, f"fits/OOM verdicts wrong: {sorted(wrong)}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case_setup_is_complete(case):
    s = case["setup"]
    for key in ("model", "gpus", "stage", "precision", "micro_batch", "seq_len", "checkpointing", "offload_optimizer",
                "offload_param", "optimizer_impl", "gpu_memory_bytes", "ds_config"):
        assert key in s, key
    assert case["source"].startswith("https://")
    assert case["verdict"] in ("fits", "oom")
    assert s["ds_config"]["zero_optimization"]["stage"] == s["stage"]
