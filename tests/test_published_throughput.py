"""zeroplan's step time against published training throughput (tests/data/published/).

Prints the error per case and the median |error|; asserts the median it reaches today, so a
change that makes the model worse fails. Goal (issue 13): median |error| <= 10% over >= 30
cases from >= 5 sources; this dataset is one source (llm-foundry, H100, FSDP) so far.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import spec_from_config
from zeroplan.specs.training import TrainingSetup, get_precision

DATA = Path(__file__).parent / "data" / "published"


def _rows(name: str) -> list[dict[str, str]]:
    lines = [ln for ln in (DATA / name).read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _predict(r: dict[str, str], hw) -> float:
    d, n = int(r["d_model"]), int(r["n_gpus"])
    spec = spec_from_config({"model_type": "gpt2", "n_embd": d, "n_head": int(r["n_heads"]),
                             "n_layer": int(r["n_layers"]), "vocab_size": 50368, "n_positions": int(r["seq_len"]),
                             "tie_word_embeddings": True}, f"mpt-{r['model']}", "published")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=int(r["micro_batch"]), seq_len=int(r["seq_len"]),
                       grad_accum=int(r["grad_accum"]), checkpointing=r["checkpointing"])
    p = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=n, hardware=hw)
    return p.tokens_per_s / n


def test_llm_foundry_h100_fsdp_throughput():
    hw = load_profile("dgx-h100")
    rows = _rows("throughput_llm_foundry_h100.csv")
    assert len(rows) >= 30
    errs = []
    for r in rows:
        pred = _predict(r, hw)
        meas = float(r["tokens_per_s_per_gpu"])
        err = pred / meas - 1
        errs.append(err)
        print(f"{r['model']:>5} seq {r['seq_len']:>5} gpus {r['n_gpus']:>3} mb {r['micro_batch']:>2} "
              f"ckpt {r['checkpointing']:<4}: measured {meas:>7.0f}, zeroplan {pred:>7.0f} tokens/s/GPU ({err:+.1%})")
    med = statistics.median(abs(e) for e in errs)
    worst = max(errs, key=abs)
    print(f"median |error| {med:.1%}, worst {worst:+.1%}")
    assert med <= MEDIAN_BOUND


MEDIAN_BOUND = 0.11  # reached: 10.1% (before the compute model and overlap schedule: 15.0%, worst +67%)
