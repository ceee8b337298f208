"""The bundled runtime model keeps what transformers keeps: traced the way the planner's data was.

``zeroplan/core/activation_data.json`` is transformers' activation memory, traced by
``examples/activations/trace.py``. The bundled model (``runtime/model.py``) is what ``bench zero``,
``validate`` and the CPU replays of real DeepSpeed train, so if it kept other activations than
transformers, comparing the planner with those runs would measure the bundled model, not the planner.
Here the bundled model is traced with the same measures (``examples/activations/live.py``: live
activation storages, one sequence of a prime length, a 1- and a 2-layer model) and held to the data.

Exact, all eight measures, no checkpointing: llama, mistral and qwen2 (grouped-query heads through
SDPA's ``enable_gqa``, rotary cos/sin, LlamaRMSNorm's single fp32 copy, ForCausalLMLoss's one upcast
of the logits and the base model's embedding output alive through the layers). gemma: exact per
layer (GemmaRMSNorm keeps its fp32 normalised input); its head is 448 bytes a token under the data
(the embedding's scaling by sqrt(hidden), not mirrored). With full checkpointing the per-layer bytes
are exact; the data's layer inputs also carry a causal mask (s² bytes) and the positions (8·s) that
transformers' checkpointed layers receive under the trace, and grouped-query models repeat k and v
when that mask is present: the bundled model has neither (the measures that differ are listed below).
Not mirrored at all (the bundled model's layers differ from transformers' by more): gpt2 (dropout),
gpt_neox, falcon, phi, phi3 (fused qkv layouts), mixtral (transformers' grouped_mm experts).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zeroplan.core.activations import _eval, token_features, traced_data  # noqa: E402
from zeroplan.runtime import model_forward  # noqa: E402
from zeroplan.runtime.model import build_model  # noqa: E402
from zeroplan.specs.model import load_model, spec_from_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQ = 61  # a prime no weight dimension below equals (the trace's SEQS[0])
CATALOG = {"llama": "llama-2-7b", "mistral": "mistral-7b", "qwen2": "qwen2-7b", "gemma": "gemma-7b"}


def _live():
    spec = importlib.util.spec_from_file_location("zeroplan_trace_live", ROOT / "examples" / "activations" / "live.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


LIVE = _live()


def _small(family: str, layers: int) -> dict:
    """The family's catalog config at a width a CPU traces in milliseconds: hidden 256, 8 heads of 32,
    grouped-query (2 kv heads) where the catalog model is."""
    full = load_model(CATALOG[family])
    cfg = dict(full.hf_config, hidden_size=256, intermediate_size=688, num_attention_heads=8, vocab_size=1000,
               num_hidden_layers=layers)
    if "head_dim" in cfg:
        cfg["head_dim"] = 32
    if cfg.get("num_key_value_heads"):
        cfg["num_key_value_heads"] = 2 if full.num_key_value_heads < full.num_attention_heads else 8
    return cfg


def _run(family: str, layers: int, checkpointing: str, monkeypatch) -> dict[str, int]:
    model = build_model(spec_from_config(_small(family, layers), "small", "test"), "bf16", checkpointing=checkpointing)
    for p in model.parameters():  # gradients dropped as they are accumulated, as the trace (and ZeRO) does
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    marks = LIVE.LayerMarks(LIVE.Live(SEQ))
    layer = model_forward._layer

    def marked(root, lay, x, rope, torch_, F):  # noqa: ANN001 - the decoder-layer hooks of the trace
        last, prev = lay is root.plan_layers[-1], len(root.plan_layers) > 1 and lay is root.plan_layers[-2]
        if last:
            marks.last_forward_start()
        out = layer(root, lay, x, rope, torch_, F)
        if last:
            marks.last_forward_end(out)
        if prev:
            marks.previous_forward_end(out)
        return out

    monkeypatch.setattr(model_forward, "_layer", marked)
    return LIVE.run_measures(model, marks, SEQ)


def _differences(family: str, checkpointing: str, monkeypatch) -> tuple[dict[str, int], dict[str, int]]:
    got = LIVE.combine(_run(family, 1, checkpointing, monkeypatch), _run(family, 2, checkpointing, monkeypatch))
    variant = traced_data()["families"][family]["variants"][f"sdpa/{checkpointing}"]
    feats = token_features(spec_from_config(_small(family, 2), "small", "test"), SEQ)
    want = {m: _eval(coef, feats, SEQ) for m, coef in variant.items()}
    assert set(got) == set(want)
    return got, {m: got[m] - want[m] for m in got if got[m] != want[m]}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_llama_like_families_keep_exactly_the_traced_bytes(family, monkeypatch):
    got, diff = _differences(family, "none", monkeypatch)
    assert got["layer"] > 0 and got["head"] > 0
    assert diff == {}


def test_gemma_layers_keep_the_traced_bytes(monkeypatch):
    got, diff = _differences("gemma", "none", monkeypatch)
    # per layer exact: GemmaRMSNorm's fp32 product keeps 2 bytes of hidden a token more than LlamaRMSNorm
    llama, _ = _differences("llama", "none", monkeypatch)
    assert got["layer"] - llama["layer"] == 2 * (2 * 256) * SEQ
    assert diff == {"head": -448 * SEQ}


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma"])
def test_full_checkpointing_keeps_the_traced_layer_inputs(family, monkeypatch):
    got, diff = _differences(family, "full", monkeypatch)
    assert got["layer"] == 2 * 256 * SEQ  # the layer input, 16-bit
    assert "layer" not in diff
    # the trace's layer inputs carry a causal mask (s² bytes) and the positions (8·s) besides
    assert diff["head"] in (-(SEQ * SEQ + 8 * SEQ), -(SEQ * SEQ + 8 * SEQ) - 448 * SEQ)
    assert set(diff) <= {"head", "fwd_layer_start_delta", "layer_extra"}


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast", "gelu_pytorch_tanh"])
def test_the_written_out_gelus_are_the_tanh_approximation(name):
    """transformers' NewGELUActivation and FastGELUActivation are the tanh approximation written in Python
    (so autograd keeps their intermediates); the bundled model writes them the same way, and they must
    still compute that approximation."""
    from types import SimpleNamespace

    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    got = model_forward._act(SimpleNamespace(hidden_act=name), x, torch, torch.nn.functional)
    assert torch.allclose(got, torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-9)
