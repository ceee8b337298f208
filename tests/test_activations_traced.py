"""Activations as transformers computes them: the shipped trace (core/activation_data.json).

The re-trace tests need torch and transformers (skipped without them); the others check the
shipped data against transformers' source, read by hand, and that the planner uses it.
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest

from zeroplan.core.activations import activation_memory, token_features, traced_data
from zeroplan.core.backward_moments import activation_at
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import SUPPORTED_MODEL_TYPES, load_model
from zeroplan.specs.training import TrainingSetup, get_precision

ROOT = Path(__file__).resolve().parents[1]
MEASURES = {"layer", "head", "loss_extra", "fwd_layer_start_delta", "fwd_layer_extra", "head_extra",
            "layer_start_delta", "layer_extra"}
VARIANTS = {"sdpa/none", "sdpa/full", "eager/none", "eager/full"}
VARIANTS = VARIANTS | {f"{v}/fp32" for v in VARIANTS}  # fp32 training, traced apart (no upcast copies)


def _bf16(**kw) -> TrainingSetup:
    return TrainingSetup(precision=get_precision("bf16"), **kw)


def test_shipped_data_covers_every_family_and_variant():
    data = traced_data()
    assert data["transformers_version"] and data["torch_version"]
    assert set(data["families"]) == set(SUPPORTED_MODEL_TYPES)
    feats = set(token_features(load_model("llama-2-7b"), 1)) | {"const"}
    for fam, entry in data["families"].items():
        assert set(entry["variants"]) == VARIANTS, fam
        # a variant whose peak moves between ops with the shape has no exact linear form: it is
        # left out (the planner uses the paper formula there) and the data says why
        assert {k for k, v in entry["variants"].items() if v is None} == set(entry.get("unfitted", {})), fam
        for var in filter(None, entry["variants"].values()):
            assert set(var) == MEASURES, fam
            for coef in var.values():
                assert set(coef) <= feats, (fam, coef)
                # bytes are integers: every coefficient is a multiple of 1/64 (the fit's grid)
                assert all(Fraction(v).denominator <= 64 for v in coef.values()), (fam, coef)
        # traced with the catalog model's own dropout settings
        from zeroplan.core.activation_terms import dropout_flags as _dropout
        assert entry["dropout"] == list(_dropout(load_model(entry["catalog_model"]))), fam


def test_llama_layer_matches_transformers_source():
    # LlamaDecoderLayer (transformers 5.x) keeps per token, 16-bit unless said:
    #   two LlamaRMSNorm: fp32 input 4h + fp32 rsqrt 4 + 16-bit normalised 2h (weight multiply)
    #   q/k/v projection input 2h; q, k, v after rotary 2q + 2kv + 2kv; SDPA output (= o_proj
    #   input) 2q and its fp32 log-sum-exp 4a; MLP input 2h; gate, act(gate), up, product 4·2ffn
    spec = load_model("llama-3-8b")
    h, a, ffn = spec.hidden_size, spec.num_attention_heads, spec.intermediate_size
    q, kv = a * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    per_token = 2 * (4 * h + 4 + 2 * h) + 2 * h + 2 * q + 4 * kv + 2 * q + 4 * a + 2 * h + 8 * ffn
    s, b = 4096, 2
    act = activation_memory(spec, _bf16(seq_len=s, micro_batch=b))
    assert act.source.startswith("transformers ") and "llama, sdpa" in act.source
    assert act.per_layer == per_token * s * b
    # eager attention: k, v repeated to all heads (repeat_kv) and the fp32 softmax + its 16-bit cast
    eager = activation_memory(spec, _bf16(seq_len=s, micro_batch=b), attention="eager")
    assert eager.per_layer == (per_token - 4 * kv + 4 * q - 4 * a + 6 * a * s) * s * b
    # the loss keeps its fp32 log-softmax output (4·s·V), not the 16-bit logits
    assert act.logits == 4 * s * b * spec.vocab_size
    # ... and the forward transient adds the 16-bit logits and their fp32 upcast (6·s·V)
    assert act.forward_peak >= act.total + 6 * s * b * spec.vocab_size


def test_full_checkpointing_does_not_stack_logits_and_recompute():
    spec = load_model("llama-3-8b")
    s, V = 4096, spec.vocab_size
    tr = _bf16(seq_len=s, micro_batch=1, checkpointing="full")
    act = activation_memory(spec, tr)
    paper = activation_memory(spec, tr, flavour="paper")
    assert act.per_layer == 2 * s * spec.hidden_size  # the checkpointed layer input, 16-bit
    # backward through the loss: nll_loss' fp32 gradient (4·s·V) and log_softmax's fp32 input
    # gradient (4·s·V) beside its saved output; the int64 labels (8 B/token) are gone by then
    head = act.total + 8 * s * V - 8 * s - 8
    assert act.backward_peak == head
    # the recomputed layer comes after the logits and their gradients are freed: not stacked
    assert act.recompute > 0 and act.backward_peak < head + act.recompute
    assert paper.backward_peak == paper.total + 4 * s * V + paper.recompute


def test_fp32_training_reads_its_own_trace():
    """fp32 keeps no fp32 copies of what 16-bit training upcasts: LlamaRMSNorm's ``to(float32)`` of an fp32
    input is the input itself, so per token a layer keeps 4 bytes per element where bf16 keeps 2 plus the
    norms' fp32 copies; the fp32 trace is its own variant, not twice the bf16 one."""
    spec = load_model("llama-2-7b")
    tr = dict(seq_len=2048, micro_batch=1)
    fp32 = activation_memory(spec, TrainingSetup(precision=get_precision("fp32"), **tr))
    bf16 = activation_memory(spec, _bf16(**tr))
    assert fp32.source.endswith(", fp32") and bf16.source.startswith("transformers ")
    assert fp32.per_layer != 2 * bf16.per_layer


def test_fallbacks_to_korthikanti():
    spec = load_model("llama-2-7b")
    paper = activation_memory(spec, _bf16(), flavour="paper")
    assert paper.source == "paper" and paper.forward_peak == paper.total
    cfg = dict(spec.hf_config, model_type="made_up_family")
    from zeroplan.specs.model import spec_from_config
    unknown = spec_from_config(cfg, "x", "test")
    assert activation_memory(unknown, _bf16()).source == "paper"


def test_estimate_charges_the_traced_peaks():
    spec = load_model("llama-2-7b")
    tr = _bf16(seq_len=2048, micro_batch=1)
    p = evaluate(model=spec, training=tr, zero=ZeroConfig(stage=2), n_gpus=8)
    act = p.memory.activations_detail
    assert act.source.startswith("transformers ")
    assert p.memory.phases["forward"].by_category["activations"] == act.forward_peak
    # the backward's largest moment (core/backward_moments.py): under stage 2 the head's peak, a layer's
    # (less the layers already back-propagated) or none at the end
    at = {activation_at(act, m.activations, m.layers_done) for m in p.memory.backward_moments}
    assert act.backward_head_peak in at and act.backward_layer_peak in at and 0 in at
    assert p.memory.phases["backward"].by_category["activations"] in at


# ------------------------------------------------------------------- re-trace (needs transformers)

def _tracer():
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("transformers/torch not installed: the re-trace needs them (the planner does not)")
    # loaded by path: the stdlib has a module named trace
    spec = importlib.util.spec_from_file_location("zeroplan_activation_trace", ROOT / "examples" / "activations" / "trace.py")
    tracer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tracer)
    return tracer


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi", "mixtral"])
def test_retrace_matches_shipped_data(family):
    tr = _tracer()
    data = traced_data()
    if tr.transformers.__version__ != data["transformers_version"]:
        pytest.skip(f"data traced with transformers {data['transformers_version']}, "
                    f"installed {tr.transformers.__version__}")
    # a small width of the same family, with the catalog model's ffn/h and V/h proportions: the
    # shipped forms are functions of the width (peaks are piecewise: which op sets a transient
    # depends on those proportions, so they are kept)
    base = load_model(tr.FAMILIES[family])
    h = 4 * base.head_dim
    spec = base.scaled(hidden_size=h, intermediate_size=base.intermediate_size * h // base.hidden_size,
                       vocab_size=base.vocab_size * h // base.hidden_size)
    checked = 0
    for attn, ckpt, dtype in (("sdpa", False, "bf16"), ("eager", True, "bf16"), ("sdpa", False, "fp32")):
        coef = data["families"][family]["variants"][f"{attn}/{'full' if ckpt else 'none'}"
                                                    + ("/fp32" if dtype == "fp32" else "")]
        if coef is None:  # no exact form (the data says why): the planner uses the paper formula
            continue
        checked += 1
        got = tr._measures(spec.hf_config, 59, dtype, attn, ckpt)
        want = {m: tr.predict(c, spec, 59) for m, c in coef.items()}
        assert got == want, (family, attn, ckpt)
    assert checked, family


def test_readme_table_is_what_the_planner_uses():
    # README "Memory per GPU": bytes per token per layer at s = 4096, bf16, one sequence
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| model | traced, SDPA | Korthikanti, flash |")
    rows = [r for r in text[start:].split("\n\n")[0].splitlines()[2:] if r.startswith("| ")]
    assert len(rows) >= 10
    s = 4096
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        spec = load_model(cells[0])
        tr = _bf16(seq_len=s, micro_batch=1)
        want = [activation_memory(spec, tr).per_layer // s,
                activation_memory(spec, tr, flavour="paper").per_layer // s,
                activation_memory(spec, tr, attention="eager").per_layer // s,
                activation_memory(spec, tr, flavour="paper", attention="eager").per_layer // s]
        got = [int(cells[i].replace(",", "")) for i in (1, 2, 4, 5)]
        assert got == want, cells[0]
