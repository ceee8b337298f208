"""Scaling a model down (``ModelSpec.scaled``): the config.json edited so the same family and
module structure comes out smaller. The key names that hold each scalable field, per family, and
the edit itself; ``ModelSpec.scaled`` (model_spec.py) re-parses the edited config.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from zeroplan._util import InputError

if TYPE_CHECKING:  # model_spec imports this module; the annotation only
    from zeroplan.specs.model_spec import ModelSpec

# Key names that hold each scalable field, per family (first = the one written when absent).
_SCALE_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"num_layers": ("n_layer", "num_hidden_layers"), "hidden_size": ("n_embd", "hidden_size"),
             "intermediate_size": ("n_inner",), "num_attention_heads": ("n_head", "num_attention_heads")},
    "falcon": {"num_layers": ("num_hidden_layers", "n_layer"),
               "num_attention_heads": ("num_attention_heads", "n_head"),
               "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
               "intermediate_size": ("ffn_hidden_size",)},
}
_DEFAULT_SCALE_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads",),
    "num_experts": ("num_local_experts",),
}


def _scaled_config(spec: ModelSpec, num_layers, hidden_size, intermediate_size, vocab_size,
                   num_attention_heads, num_key_value_heads, num_experts) -> tuple[dict, list[str]]:
    """The edited config.json of ``spec.scaled(...)`` and the notes the edit adds."""
    req = {"num_layers": num_layers, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
           "vocab_size": vocab_size, "num_attention_heads": num_attention_heads,
           "num_key_value_heads": num_key_value_heads, "num_experts": num_experts}
    for k, v in req.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise InputError(f"scaled(): {k} = {v!r}, expected a positive integer")
    if num_experts is not None and not spec.num_experts:
        raise InputError(f"scaled(): num_experts given but {spec.name} is a dense model")
    cfg = copy.deepcopy(spec.hf_config)
    if not cfg:
        raise InputError(f"scaled(): {spec.name} has no config to scale")
    mt = cfg.get("model_type") if spec.model_type != "generic" else "__generic__"
    keys = {**_DEFAULT_SCALE_KEYS, **_SCALE_KEYS.get(mt, {})}

    def put(field: str, value: int) -> None:
        names = keys[field]
        for k in names:
            if k in cfg and cfg[k] is not None:
                cfg[k] = value
                return
        cfg[names[0]] = value

    heads = num_attention_heads
    explicit_hd = "head_dim" in cfg and cfg["head_dim"] is not None
    extra_notes: list[str] = []
    if hidden_size is not None and heads is None:
        if explicit_hd:  # head_dim is a config key (Gemma): scale the head count with the width
            heads = max(1, round(spec.num_attention_heads * hidden_size / spec.hidden_size))
        elif hidden_size % spec.head_dim == 0:
            heads = hidden_size // spec.head_dim
        else:  # nearest head count that divides the new width
            want = hidden_size / spec.head_dim
            heads = min((d for d in range(1, hidden_size + 1) if hidden_size % d == 0),
                        key=lambda d: (abs(d - want), d))
            extra_notes.append(f"hidden_size {hidden_size} is not a multiple of head_dim {spec.head_dim}: "
                               f"{heads} heads of {hidden_size // heads}")
    if heads is not None:
        put("num_attention_heads", heads)
        if num_key_value_heads is None:
            kv = min(spec.num_key_value_heads, heads)
            while heads % kv:
                kv -= 1
            num_key_value_heads = kv
    for field, value in (("num_layers", num_layers), ("hidden_size", hidden_size),
                         ("intermediate_size", intermediate_size), ("vocab_size", vocab_size),
                         ("num_experts", num_experts)):
        if value is not None:
            put(field, value)
    if num_key_value_heads is not None and not (mt == "falcon" and not cfg.get("new_decoder_architecture")
                                                and cfg.get("multi_query", True)):
        if mt in ("gpt2", "gpt_neox"):
            if num_key_value_heads != (heads or spec.num_attention_heads):
                raise InputError(f"scaled(): {mt} has no grouped-query attention; "
                                 f"num_key_value_heads must equal num_attention_heads")
        else:
            put("num_key_value_heads", num_key_value_heads)
    if num_experts is not None:
        k = cfg.get("num_experts_per_tok", 2)
        if isinstance(k, int) and k > num_experts:
            cfg["num_experts_per_tok"] = num_experts
    return cfg, extra_notes
