"""ZeRO-3 throughput on a low- vs a high-bandwidth network, as in the ZeRO++ paper's figures.

tests/data/published/zeropp_v100.csv holds the ZeRO-3 ("Baseline") TFLOPs per GPU read off the
ZeRO++ blog figures: 384 V100 (24 DGX-2 nodes), 18B–138B GPT models, 1K or 2K tokens per GPU,
InfiniBand of 1, 2, 4 or 8 x 100 Gb/s per node. For each model and micro-batch, zeroplan's
ratio of ZeRO-3 tokens/s on the slow network to the fast one is compared with the measured
TFLOPs ratio (same model and tokens, so the FLOP counts cancel). Goal (issue 13): within 0.1.
Reached: 5 of 10 pairs within 0.1 (every 2K-token pair at 100 vs 400 Gb/s, 18B at 200 vs 800),
median 0.113. At 1K tokens zeroplan's ratio is 0.13-0.20 too low: the measured runs on the FAST
network already expose most of their communication (1K tokens at 400 Gb/s runs at about compute
+ communication), which the overlap schedule (core/overlap.py) hides, so zeroplan is too
optimistic about the fast network. For 138B at 200 vs 800 Gb/s its ratio is 0.20 too high: there
it hides too much on the slow network. With nothing hidden (the worst-case bracket) every pair
but the three 18B ones is within 0.06 (median 0.045: the second test, a profile whose measured
node.overlap_slowdown is 1); no DeepSpeed 0.9 scheduling rule found so far explains
why those runs overlapped so little (tests/data/published/README.md). The ZeRO++ tutorial's logs of
the same software on 64 GPUs did hide most of their compute (tests/test_published_zeropp_log.py).
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
SEQ = 512  # DeepSpeed docs/_tutorials/zeropp.md: --seq-length 512; 1K/2K tokens = micro-batch 2/4


def _rows() -> list[dict[str, str]]:
    lines = [ln for ln in (DATA / "zeropp_v100.csv").read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _tokens_per_s(r: dict[str, str], overlap_slowdown: float | None = None) -> float:
    hw = load_profile(str(DATA / "profiles" / "dgx2-v100-ib4.toml"))
    nics = int(r["nics_per_node"])
    hw.inter_node.bandwidth_GBps_per_gpu = nics * 100 / 8 / hw.node.gpus_per_node  # n x 100 Gb/s per node
    hw.inter_node.nics_per_node = nics
    hw.node.overlap_slowdown = overlap_slowdown  # None: the planner's default (core/overlap.py)
    spec = spec_from_config({"model_type": "gpt2", "n_embd": int(r["hidden"]), "n_head": int(r["heads"]),
                             "n_layer": int(r["layers"]), "vocab_size": 50304, "n_positions": SEQ,
                             "tie_word_embeddings": True}, f"gpt-{r['model']}", "zeropp")
    tr = TrainingSetup(precision=get_precision("fp16"), micro_batch=int(r["tokens_per_gpu"]) // SEQ, seq_len=SEQ,
                       grad_accum=1, checkpointing="full")
    return evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=384, hardware=hw).tokens_per_s


def _pairs(overlap_slowdown: float | None = None) -> list[tuple[str, float, float]]:
    rows = _rows()
    by_key: dict[tuple[str, str, str], dict[int, dict[str, str]]] = {}
    for r in rows:
        key = (r["figure"] if r["figure"] == "eval3" else "eval1/2", r["model"], r["tokens_per_gpu"])
        by_key.setdefault(key, {})[int(r["nics_per_node"])] = r
    out = []
    for (fig, model, tok), by_nics in by_key.items():
        lo, hi = by_nics[min(by_nics)], by_nics[max(by_nics)]
        meas = float(lo["zero3_tflops_per_gpu"]) / float(hi["zero3_tflops_per_gpu"])
        pred = _tokens_per_s(lo, overlap_slowdown) / _tokens_per_s(hi, overlap_slowdown)
        label = f"{model} {tok} tokens/GPU, {min(by_nics) * 100} vs {max(by_nics) * 100} Gb/s"
        out.append((label, pred, meas))
    return out


def test_zero3_low_vs_high_bandwidth_ratio():
    pairs = _pairs()
    assert len(pairs) == 10
    for label, pred, meas in pairs:
        print(f"{label}: measured ratio {meas:.2f}, zeroplan {pred:.2f} ({pred - meas:+.2f})")
    diffs = [abs(p - m) for _, p, m in pairs]
    med = statistics.median(diffs)
    print(f"median |ratio difference| {med:.3f}, worst {max(diffs):.2f}")
    assert med <= MEDIAN_BOUND
    # 2K tokens per GPU at 100 vs 400 Gb/s (fig. 7 vs fig. 6): each within 0.1
    assert all(abs(p - m) <= 0.1 for label, p, m in pairs if "2048" in label and "100 vs 400" in label)
    # the slow network always costs throughput, and more for the bigger model at 200 vs 800 Gb/s
    assert all(p < 1 for _, p, _ in pairs)


# reached: 0.113 (0.114 before the GPU optimizer step was counted; 0.108 while recomputation counted as forward
# compute that forward gathers could hide behind)
MEDIAN_BOUND = 0.115


def test_a_cluster_where_nothing_hides_gives_the_measured_ratios():
    """What a profile with ``node.overlap_slowdown = 1`` (``zeroplan bench overlap`` on a cluster whose
    collectives serialise with compute) plans: the no-overlap step. Not the default: "nothing hides"
    would come from this one paper, so it is a measured profile field, not a rule. Reached: median
    |difference| 0.045; every pair but the three 18B ones (0.10-0.12) within 0.06."""
    pairs = _pairs(overlap_slowdown=1.0)
    for label, pred, meas in pairs:
        print(f"{label}: measured ratio {meas:.2f}, zeroplan with nothing hidden {pred:.2f} ({pred - meas:+.2f})")
    assert statistics.median(abs(p - m) for _, p, m in pairs) <= 0.05
    assert all(abs(p - m) <= 0.06 for label, p, m in pairs if not label.startswith("18B"))
    assert sum(label.startswith("18B") for label, _, _ in pairs) == 3

