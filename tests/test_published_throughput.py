"""zeroplan's step time against published training throughput (tests/data/published/).

Prints the error per case and the median |error|; asserts the median it reaches today, so a
change that makes the model worse fails. Goal (issue 13): median |error| <= 10% over >= 30
cases from >= 5 sources. Sources: llm-foundry H100 and A100 tables (FSDP), torchtitan (FSDP2,
A100), the IBM/PyTorch FSDP blog (A100 and H100), the ZeRO++ figures (DeepSpeed ZeRO-3, V100),
flash-attention's training speeds (DDP/ZeRO-1, A100) and Lambda's (ZeRO-1, A100 and H100);
tests/data/published/README.md describes each.
"""

from __future__ import annotations

import csv
import functools
import statistics
from collections.abc import Callable
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


# reached: 9.9% (10.0% before the GPU optimizer step; before the compute model and overlap schedule: 15.0%, worst +67%)
MEDIAN_BOUND = 0.11


# --------------------------------------------------------------------------------------------
# More sources: torchtitan (FSDP2, A100), IBM/PyTorch FSDP blog (A100 and H100), ZeRO++ (ZeRO-3, V100)
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
LLAMA_34B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 22016, "num_attention_heads": 64,
             "num_key_value_heads": 8, "num_hidden_layers": 48, "vocab_size": 32000, "max_position_embeddings": 4096}


def _hw(ref: str):
    return load_profile(str(DATA / ref if ref.startswith("profiles/") else ROOT / "hardware_profiles" / f"{ref}.toml"))


def _fsdp_case(r: dict[str, str]) -> float:
    from zeroplan.specs.model import load_model

    spec = spec_from_config(LLAMA_34B, "llama-34b", "published") if r["model"] == "llama-34b" else load_model(r["model"])
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=int(r["micro_batch"]), seq_len=int(r["seq_len"]),
                       grad_accum=1, checkpointing=r["checkpointing"])
    n = int(r["n_gpus"])
    return evaluate(model=spec, training=tr, zero=ZeroConfig(stage=3), n_gpus=n, hardware=_hw(r["profile"])).tokens_per_s / n


def _zeropp_cases() -> list[tuple[str, float, float]]:
    """ZeRO-3 rows of the ZeRO++ figures (TFLOPs per GPU) as tokens/s per GPU. Megatron-DeepSpeed counts
    24·c·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) FLOPs per iteration with c = 4 under activation checkpointing
    (its training.py throughput), so tokens/s/GPU = TFLOPs / (24·4·L·h²·(1 + s/(6h) + V/(16·L·h)))."""
    from test_published_zeropp import SEQ, _rows as zrows, _tokens_per_s

    out = []
    for r in zrows():
        if r["figure"] == "eval3":
            continue  # 200/800 Gb/s bars repeat eval1/eval2's models; kept for the ratio test only
        L, h, V = int(r["layers"]), int(r["hidden"]), 50257
        flops_per_token = 24 * 4 * L * h * h * (1 + SEQ / (6 * h) + V / (16 * L * h))
        meas = float(r["zero3_tflops_per_gpu"]) * 1e12 / flops_per_token
        label = f"{r['model']:>5} {r['tokens_per_gpu']} tok/GPU {int(r['nics_per_node']) * 100} Gb/s"
        out.append((label, _tokens_per_s(r) / 384, meas))
    return out


def _report(name: str, cases: list[tuple[str, float, float]]) -> list[float]:
    errs = []
    for label, pred, meas in cases:
        err = pred / meas - 1
        errs.append(err)
        print(f"{name:<10} {label}: measured {meas:8.1f}, zeroplan {pred:8.1f} tokens/s/GPU ({err:+.1%})")
    print(f"{name:<10} n={len(errs)} median |error| {statistics.median(abs(e) for e in errs):.1%}")
    return errs


def _foundry_rest_case(r: dict[str, str]) -> float:
    """A row of throughput_llm_foundry_rest.csv: MPT shapes as in _predict, ZeRO-2 for SHARD_GRAD_OP."""
    spec = spec_from_config({"model_type": "gpt2", "n_embd": int(r["d_model"]), "n_head": int(r["n_heads"]),
                             "n_layer": int(r["n_layers"]), "vocab_size": 50368, "n_positions": int(r["seq_len"]),
                             "tie_word_embeddings": True}, f"mpt-{r['model']}", "published")
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=int(r["micro_batch"]), seq_len=int(r["seq_len"]),
                       grad_accum=int(r["grad_accum"]), checkpointing=r["checkpointing"])
    stage = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[r["sharding"]]
    n = int(r["n_gpus"])
    return evaluate(model=spec, training=tr, zero=ZeroConfig(stage=stage), n_gpus=n,
                    hardware=_hw(r["profile"])).tokens_per_s / n


Row = dict[str, str]


def _grouped(name: str, group: Callable[[Row], str], label: Callable[[Row], str],
             predict: Callable[[Row], float]) -> dict[str, list[tuple[str, float, float]]]:
    """The rows of one data file as (label, zeroplan, measured) cases, by group."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for r in _rows(name):
        out.setdefault(group(r), []).append((label(r), predict(r), float(r["tokens_per_s_per_gpu"])))
    return out


@functools.cache
def _foundry_rest() -> dict[str, list[tuple[str, float, float]]]:
    """The rest of llm-foundry's four bf16 tables, by table (computed once: two tests read it, neither changes it)."""
    return _grouped("throughput_llm_foundry_rest.csv", lambda r: f"llm-foundry-{r['table']}",
                    lambda r: (f"{r['model']} seq {r['seq_len']} gpus {r['n_gpus']} mb {r['micro_batch']} "
                               f"{r['checkpointing']} {r['sharding']}"), _foundry_rest_case)


def test_llm_foundry_complete_tables():
    """The llm-foundry rows not in the two hand-picked files: none of them set any constant of the model."""
    rest = _foundry_rest()
    assert sum(len(v) for v in rest.values()) == 165
    meds = {}
    for name, cases in rest.items():
        errs = _report(name, cases)
        meds[name] = statistics.median(abs(e) for e in errs)
    allerr = [p / m - 1 for cases in rest.values() for _, p, m in cases]
    med = statistics.median(abs(e) for e in allerr)
    print(f"rest of llm-foundry's tables: {len(allerr)} rows, median |error| {med:.1%}")
    assert med <= FOUNDRY_REST_MEDIAN_BOUND
    # the large-scale H100 table (128-512 GPUs, its ZeRO-2 rows among them) stays within 10%
    assert meds["llm-foundry-h100-large"] <= 0.10


# reached: 7.3% over the 165 rows (7.4% before the GPU optimizer step; h100-large 8.1%, h100 9.3%, a100-80gb 7.2%,
# a100-40gb 7.2%); worst the MPT-125M
# rows on A100 (+19% to +32%), where per-kernel overheads the model does not count dominate
FOUNDRY_REST_MEDIAN_BOUND = 0.085


def _gpt_node_case(r: dict[str, str]) -> float:
    """A row of throughput_flash_attention.csv: a GPT-2/GPT-3 shape on one node, DDP (stage 0) or ZeRO-1."""
    cfg = {"model_type": "gpt2", "n_embd": int(r["d_model"]), "n_head": int(r["n_heads"]), "n_layer": int(r["n_layers"]),
           "vocab_size": int(r["vocab_size"]), "n_positions": int(r["seq_len"]), "tie_word_embeddings": True}
    p_drop = float(r["dropout"])
    cfg.update(attn_pdrop=p_drop, resid_pdrop=p_drop, embd_pdrop=p_drop)
    tr = TrainingSetup(precision=get_precision(r["precision"]), micro_batch=int(r["micro_batch"]),
                       seq_len=int(r["seq_len"]), grad_accum=int(r["grad_accum"]), checkpointing="none",
                       flash_attention=r["attention"] == "flash", kernels=r["kernels"])
    n = int(r["n_gpus"])
    return evaluate(model=spec_from_config(cfg, r["model"], "published"), training=tr,
                    zero=ZeroConfig(stage=int(r["stage"])), n_gpus=n, hardware=_hw(r["profile"])).tokens_per_s / n


@functools.cache
def _gpt_node() -> dict[str, list[tuple[str, float, float]]]:
    """flash-attention's and Lambda's rows by source, then attention kernel (computed once; two tests read them)."""
    return _grouped("throughput_flash_attention.csv", lambda r: f"{r['source']}/{r['attention']}",
                    lambda r: (f"{r['model']} seq {r['seq_len']} x{r['n_gpus']} mb {r['micro_batch']} "
                               f"{r['precision']} stage {r['stage']} ({r['profile']})"), _gpt_node_case)


def test_flash_attention_and_lambda_tables():
    """Two more projects, neither fitted: flash-attention's own GPT-2/GPT-3 speeds on 8 A100s (its FlashAttention
    rows and transformers' eager baseline) and Lambda's GPT-3 2.7B on 1 and 8 A100s/H100s."""
    groups = _gpt_node()
    assert sum(len(v) for v in groups.values()) == 21
    meds = {name: statistics.median(abs(e) for e in _report(name, cases)) for name, cases in groups.items()}
    print(", ".join(f"{k} {v:.1%}" for k, v in meds.items()))
    assert meds["flash-attention/flash"] <= FLASH_ATTENTION_MEDIAN_BOUND
    assert meds["lambda/flash"] <= LAMBDA_MEDIAN_BOUND
    # transformers' GPT-2 under AMP (the "Huggingface" bars): the score matrix's HBM traffic
    # (core/compute.py eager_score_bytes) and transformers' element-wise kernels run op by op under autocast
    # (core/elementwise.py, kernels "unfused-amp", traced from transformers) are counted
    assert meds["flash-attention/eager"] <= EAGER_MEDIAN_BOUND


# reached: flash-attention's FlashAttention rows 3.6% (9 rows, -2% to +10%); Lambda 18.8% (A100 +8%, +12%; H100 +26%,
# +27%); transformers' eager rows 29.8% (+24% to +41%; 88.9% with the fused element-wise count, +157% to +412% before
# the score traffic was counted)
FLASH_ATTENTION_MEDIAN_BOUND = 0.05
LAMBDA_MEDIAN_BOUND = 0.21
EAGER_MEDIAN_BOUND = 0.32


def test_all_sources_throughput():
    """Every source together: per-source and overall median |error| (goal <= 10% over >= 30 cases, >= 5 sources;
    the cases come from 6 independent projects)."""
    errs: dict[str, list[float]] = {}
    hw = load_profile("dgx-h100")
    foundry = [(f"{r['model']} seq {r['seq_len']} gpus {r['n_gpus']} mb {r['micro_batch']} {r['checkpointing']}",
                _predict(r, hw), float(r["tokens_per_s_per_gpu"])) for r in _rows("throughput_llm_foundry_h100.csv")]
    errs["llm-foundry"] = _report("llm-foundry", foundry)
    a100 = load_profile(str(ROOT / "hardware_profiles" / "dgx-a100-80gb.toml"))
    foundry_a100 = [(f"{r['model']} seq {r['seq_len']} gpus {r['n_gpus']} mb {r['micro_batch']} {r['checkpointing']}",
                     _predict(r, a100), float(r["tokens_per_s_per_gpu"])) for r in _rows("throughput_llm_foundry_a100.csv")]
    errs["llm-foundry-a100"] = _report("llm-foundry-a100", foundry_a100)
    more: dict[str, list[tuple[str, float, float]]] = {}
    for r in _rows("throughput_fsdp_more.csv"):
        label = f"{r['model']} x{r['n_gpus']} mb {r['micro_batch']} seq {r['seq_len']} {r['checkpointing']} ({r['profile']})"
        more.setdefault(r["source"], []).append((label, _fsdp_case(r), float(r["tokens_per_s_per_gpu"])))
    for src, cases in more.items():
        errs[src] = _report(src, cases)
    errs["zeropp-v100"] = _report("zeropp-v100", _zeropp_cases())
    picked = [e for v in errs.values() for e in v]
    picked_med = statistics.median(abs(e) for e in picked)
    print(f"the 72 hand-picked cases: median |error| {picked_med:.1%}")
    for name, cases in _foundry_rest().items():
        errs[name] = [p / m - 1 for _, p, m in cases]
    for name, cases in _gpt_node().items():
        errs[name] = [p / m - 1 for _, p, m in cases]
    allerr = [e for v in errs.values() for e in v]
    med = statistics.median(abs(e) for e in allerr)
    # one number per source, so that llm-foundry's many rows do not outweigh the others
    by_source: dict[str, list[float]] = {}
    for name, v in errs.items():
        by_source.setdefault("llm-foundry" if name.startswith("llm-foundry") else name.split("/")[0], []).extend(v)
    src_meds = {k: statistics.median(abs(e) for e in v) for k, v in by_source.items()}
    print("per source: " + ", ".join(f"{k} {v:.1%} ({len(by_source[k])})" for k, v in src_meds.items()))
    print(f"all: {len(allerr)} cases from {len(by_source)} sources, median |error| {med:.1%}; "
          f"median of the per-source medians {statistics.median(src_meds.values()):.1%}")
    # six independent projects: llm-foundry's H100 and A100 tables are one source here (they were counted as two)
    assert len(allerr) >= 30 and len(by_source) >= 6
    assert statistics.median(src_meds.values()) <= SOURCE_MEDIANS_BOUND
    assert med <= ALL_SOURCES_MEDIAN_BOUND
    assert picked_med <= PICKED_MEDIAN_BOUND


# reached: 8.1% over all 258 cases from 6 sources (median of their medians 8.9%; 8.3% and 9.0% before the GPU optimizer
# step was counted); before flash-attention's and
# Lambda's tables: 8.0% over all 237 cases (median of the four sources' medians: 6.5%; the 72 hand-picked cases: 10.4%; the
# 165 rows added with the rest of llm-foundry's tables were fitted by no constant; the Ampere matmul fraction cites
# the A100 table's MFU range in general, the Hopper one a row of the hand-picked file)
# earlier figures (the 72 hand-picked ones: 10.4%; 56 FSDP cases on A100/H100: 8.9%; 16 ZeRO-3 V100
# cases: 40.8%, 46.8% before the ledger counted the gathers of full checkpointing's recomputation)
ALL_SOURCES_MEDIAN_BOUND = 0.085
SOURCE_MEDIANS_BOUND = 0.10
PICKED_MEDIAN_BOUND = 0.11
