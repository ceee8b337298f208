"""Count specs: a model given as a bare parameter count (``7B``, ``70e9``, ``1.3T``, ``125M``).

``params`` is the stated count EXACTLY (the planner multiplies it by bytes per parameter). The
spec also carries a default llama-style shape so that activations, per-layer sizes and the
largest module can be estimated: the rule is

- take the row of ``DEFAULT_SHAPES`` (known llama-style shapes, head_dim 128, vocab
  32000, gated SiLU MLP, untied embeddings, no biases) whose own parameter count is
  nearest the stated count on a log scale;
- keep its hidden size, heads and intermediate size, and pick the number of layers
  (>= 1) that brings the shape's count nearest the stated count.

The tensors of that shape do not sum to ``params`` exactly; ``approximate=True`` and the
notes say so and by how much.
"""

from __future__ import annotations

import math

from zeroplan._util import InputError, parse_count
from zeroplan.specs.model_families import _llama_like
from zeroplan.specs.model_hf_config import MAX_LAYERS, _Cfg
from zeroplan.specs.model_spec import ModelSpec, _build

__all__ = ["DEFAULT_SHAPES", "spec_from_count"]

# (hidden, heads, kv_heads, intermediate, layers) of known llama-style shapes, head_dim 128.
DEFAULT_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (256, 2, 2, 704, 4),
    (512, 4, 4, 1408, 8),
    (1024, 8, 8, 2816, 16),
    (2048, 16, 16, 5632, 24),
    (2560, 20, 20, 6912, 32),
    (4096, 32, 32, 11008, 32),  # Llama-2-7B
    (5120, 40, 40, 13824, 40),  # Llama-2-13B
    (6656, 52, 52, 17920, 60),  # LLaMA-33B
    (8192, 64, 8, 28672, 80),  # Llama-2-70B
    (16384, 128, 8, 53248, 126),  # Llama-3.1-405B shape
)
_COUNT_VOCAB = 32000


def _shape_params(h: int, nh: int, kv: int, i: int, layers: int) -> int:
    hd = h // nh
    per_layer = 2 * h * h + 2 * h * kv * hd + 3 * h * i + 2 * h
    return layers * per_layer + 2 * _COUNT_VOCAB * h + h


def _shape_config(h: int, nh: int, kv: int, i: int, layers: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
            "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": kv,
            "intermediate_size": i, "vocab_size": _COUNT_VOCAB, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "hidden_act": "silu"}


def spec_from_count(text: str) -> ModelSpec:
    """A bare parameter count: params exact, shape a stated llama-style default."""
    n = parse_count(text, what="model size")
    best = min(DEFAULT_SHAPES, key=lambda s: abs(math.log(_shape_params(*s) / n)))
    h, nh, kv, i, _ = best
    per_layer = _shape_params(h, nh, kv, i, 1) - _shape_params(h, nh, kv, i, 0)
    layers = max(1, round((n - _shape_params(h, nh, kv, i, 0)) / per_layer))
    if layers > MAX_LAYERS:
        raise InputError(f"model size {text!r}: the largest default shape (hidden {h}) would need {layers:,} "
                         f"layers, beyond {MAX_LAYERS:,}; give a config.json for a model this large")
    smallest = _shape_params(h, nh, kv, i, layers)
    if smallest > 2 * n:  # the vocabulary's embeddings alone outweigh it: "7" for 7B, most likely
        raise InputError(f"model size {text!r} = {n:,} parameter{'s' * (n != 1)}: the smallest default shape (hidden {h}, "
                         f"{layers} layer, vocab {_COUNT_VOCAB}) has {smallest:,}, so no shape fits; a count is "
                         "the whole model's (7B, 125M, 70e9), or give a config.json for a model this small")
    cfg = _shape_config(h, nh, kv, i, layers)
    fields, T, _ = _llama_like(_Cfg(cfg, f"count {text}"), "llama")
    shape_total = _shape_params(h, nh, kv, i, layers)
    notes = [
        f"a bare count: params = {n:,} exactly as stated; everything else comes from a default "
        f"llama-style shape (hidden {h}, {layers} layers, {nh} heads / {kv} kv heads of 128, "
        f"gated MLP {i}, vocab {_COUNT_VOCAB}, untied) chosen as the nearest known llama shape "
        f"with the layer count fitted to the stated size",
        f"that shape has {shape_total:,} parameters ({(shape_total - n) / n:+.1%} vs the stated "
        f"count): per-layer, embedding and largest-module figures are estimates",
    ]
    spec = _build(text.strip(), f"count:{text.strip()}", "llama", fields, T, notes, cfg,
                  approximate=True, params=n)
    return spec
