"""Trace the activation memory of the catalog's model families as transformers computes it.

Regenerates ``zeroplan/core/activation_data.json``::

    python examples/activations/trace.py            # writes the data file
    python examples/activations/trace.py --check    # re-traces, compares, exit 1 on a difference

Needs torch and transformers (neither is a zeroplan dependency; the planner reads the JSON
only). Each model is built under ``FakeTensorMode`` (no real memory, no real compute) at its
real width with 1 and 2 decoder layers and one sequence of a prime length ``s``; forward and
backward run with the loss computed by the model (``labels=input_ids``), the outputs other
than the loss dropped before backward (as the HF Trainer does).

Measured, for activation tensors only (a storage counts when one of its tensors has the
sequence length in its shape: parameters and their gradients never do, and parameter
gradients are dropped as soon as they are accumulated, as ZeRO does):

- ``saved``: what autograd keeps for backward, from ``torch.autograd.graph.saved_tensors_hooks``,
  deduplicated by storage (``StorageWeakRef``);
- ``end_forward``: activation bytes live once forward and the loss are done;
- ``fwd_layer_start`` / ``fwd_layer_peak``: live when the last layer's forward starts, and the
  most live until it ends;
- ``forward_peak``: the most live from the end of the last layer to the end of the loss
  (final norm, lm_head, the loss' fp32 logits copy);
- ``head_peak``: the most live while backward runs through loss, lm_head and final norm;
- ``layer_start`` / ``layer_peak``: live when the last decoder layer's backward starts (its
  output's gradient hook fires) and the most live until the next layer starts.

Traced in bf16 (fp16 checked equal at the catalog shape) and in fp32, whose variants are keyed
``.../fp32``: fp32 training keeps other tensors (no fp32 copy of a norm's input or of the logits).

A layer's share is the difference between the 2-layer and the 1-layer trace; the rest is the
"head" (embeddings, final norm, logits, loss). Bytes per token are fitted as integer-exact
linear forms over h, q = a·head_dim, kv = kv_heads·head_dim, ffn, a, a·s (eager attention
scores), V and E (experts) by tracing perturbed shapes of each family; the fit is checked
exactly on every traced shape.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "zeroplan" / "specs" / "catalog"
DATA = ROOT / "zeroplan" / "core" / "activation_data.json"
if str(ROOT) not in sys.path:  # the feature definition is zeroplan's own (core/activations.py)
    sys.path.insert(0, str(ROOT))
if str(Path(__file__).parent) not in sys.path:  # live.py: how a run is measured (shared with the tests)
    sys.path.insert(0, str(Path(__file__).parent))

from live import LayerMarks, Live, combine, run_measures  # noqa: E402

# one catalog model per family (model_type)
FAMILIES = {
    "llama": "llama-2-7b",
    "mistral": "mistral-7b",
    "mixtral": "mixtral-8x7b",
    "qwen2": "qwen2-7b",
    "gemma": "gemma-7b",
    "gpt2": "gpt2",
    "gpt_neox": "gpt-neox-20b",
    "falcon": "falcon-7b",
    "phi": "phi-2",
    "phi3": "phi-3-mini",
}
SEQS = (61, 67)  # (and HELD_OUT_SEQ = 71) primes: no weight dimension equals them, so shapes tell activations apart
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def catalog_config(family: str) -> dict[str, Any]:
    return json.loads((CATALOG / f"{FAMILIES[family]}.json").read_text())["config"]


def _build(cfgd: dict[str, Any], layers: int, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    cfgd = dict(cfgd)
    for k in ("num_hidden_layers", "n_layer"):
        if k in cfgd:
            cfgd[k] = layers
    cfgd["num_hidden_layers"] = layers
    # no dropout in the trace: the catalog's configs have none except gpt2/phi (see data notes)
    cfg = transformers.AutoConfig.for_model(**cfgd)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=dtype, attn_implementation=attn,
        **({"experts_implementation": "grouped_mm"} if cfgd.get("num_local_experts") else {}))
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and hasattr(mod[0], "forward"):
            return list(mod)
    raise RuntimeError("no decoder layer list")


def trace_once(cfgd: dict[str, Any], *, layers: int, seq: int, dtype: str, attn: str, ckpt: bool) -> dict[str, int]:
    """One fake forward+backward; bytes of each measure (see module doc and live.py)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build(cfgd, layers, attn, DTYPES[dtype])
        model.train()
        for p in model.parameters():
            if any(d % seq == 0 for d in p.shape):
                raise RuntimeError(f"a parameter dimension {tuple(p.shape)} is a multiple of seq {seq}")
        if ckpt:
            model.gradient_checkpointing_enable()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        marks = LayerMarks(Live(seq))
        dec = _decoder_layers(model)
        dec[-1].register_forward_pre_hook(lambda _m, _i: marks.last_forward_start())
        dec[-1].register_forward_hook(lambda _m, _i, out: marks.last_forward_end(out))
        if layers >= 2:
            dec[-2].register_forward_hook(lambda _m, _i, out: marks.previous_forward_end(out))
        # the outputs other than the loss are dropped before backward, as the HF Trainer does
        return run_measures(lambda ids: model(input_ids=ids, labels=ids).loss, marks, seq)


# ---------------------------------------------------------------------------- fitting

def _spec(cfgd: dict[str, Any]):  # noqa: ANN202
    from zeroplan.specs.model import spec_from_config
    return spec_from_config(cfgd, "trace", "trace")


def _try(make: Any) -> list[Any]:
    from zeroplan._util import InputError
    try:
        return [make()]
    except InputError:  # the family has no such knob (e.g. gpt2 has no grouped-query heads)
        return []


def _perturbed(family: str) -> list[Any]:
    """The family's catalog shape and shapes that each move some of the fitted dimensions."""
    base = _spec(catalog_config(family))
    h, a, kv, hd = base.hidden_size, base.num_attention_heads, base.num_key_value_heads, base.head_dim
    out = [base]
    out += _try(lambda: _wider(base, 2))  # more heads of the same width
    # narrower heads (or more of them where head_dim is a key)
    out += _try(lambda: base.scaled(num_attention_heads=a * 2, num_key_value_heads=a * 2 if kv == a else None))
    if "head_dim" in base.hf_config:
        out.append(_spec(dict(base.hf_config, head_dim=hd + 64)))
    else:
        out += _try(lambda: base.scaled(hidden_size=h + 16 * a, num_attention_heads=a))  # wider heads
    out += _try(lambda: base.scaled(num_key_value_heads=kv // 2 if kv % 2 == 0 and kv > 1 else a))
    if "partial_rotary_factor" in base.hf_config:
        # phi: the rotary width int(head_dim · factor) is a term of its own (the cos/sin tables); the
        # shapes above move it only together with h, a and head_dim, which leaves it in their span
        # with fractional coefficients, so move it alone too
        factor = float(base.hf_config["partial_rotary_factor"])
        out.append(_spec(dict(base.hf_config, partial_rotary_factor=factor + 0.1)))
    out.append(base.scaled(intermediate_size=base.intermediate_size + 64))
    out.append(base.scaled(vocab_size=base.vocab_size + 128))
    if base.num_experts:
        k = base.experts_per_token
        out.append(_spec(dict(base.hf_config, num_local_experts=base.num_experts + 2)))
        out.append(_spec(dict(base.hf_config, num_experts_per_tok=k + 1)))
        # k moves k·h, k·ffn and the per-token routing bytes together; with k changed at a wider
        # h and at another ffn as well, the three are told apart
        out.append(_spec(dict(_wider(base, 2).hf_config, num_experts_per_tok=k + 1)))
        out.append(_spec(dict(base.scaled(intermediate_size=base.intermediate_size + 64).hf_config,
                              num_experts_per_tok=k + 1)))
    return out


def _wider(base: Any, extra_heads: int) -> Any:
    """``extra_heads`` more heads of the same head_dim (multi-head attention stays multi-head)."""
    heads = base.num_attention_heads + extra_heads
    mha = base.num_key_value_heads == base.num_attention_heads
    return base.scaled(hidden_size=base.hidden_size + extra_heads * base.head_dim, num_attention_heads=heads,
                       num_key_value_heads=heads if mha else None)


def held_out(family: str) -> Any:
    """A shape none of the fit's samples has: wider, another ffn and vocabulary at once."""
    base = _spec(catalog_config(family))
    wide = _wider(base, 4)
    out = wide.scaled(intermediate_size=wide.intermediate_size + 32, vocab_size=wide.vocab_size + 64)
    if base.num_experts:  # and more experts, more of them per token
        out = _spec(dict(out.hf_config, num_local_experts=base.num_experts + 1,
                         num_experts_per_tok=base.experts_per_token + 2))
    return out


HELD_OUT_SEQ = 71
EXTRA_SEQ = 79  # a third length at the catalog shape separates per-sequence, per-token and s² terms


def predict(coef: dict[str, int | float], spec: Any, seq: int) -> int:
    from zeroplan.core.activations import token_features
    return int(round(sum(coef.get(k, 0) * v * seq for k, v in token_features(spec, seq).items())
                     + coef.get("const", 0)))


def _rows(spec: Any, seq: int) -> dict[str, int]:
    from zeroplan.core.activations import token_features
    feats = {k: v * seq for k, v in token_features(spec, seq).items()}
    feats["const"] = 1
    return feats


def _measures(cfgd: dict[str, Any], seq: int, dtype: str, attn: str, ckpt: bool) -> dict[str, int]:
    """Per-layer and head quantities from a 1- and a 2-layer trace (see module doc)."""
    return combine(trace_once(cfgd, layers=1, seq=seq, dtype=dtype, attn=attn, ckpt=ckpt),
                   trace_once(cfgd, layers=2, seq=seq, dtype=dtype, attn=attn, ckpt=ckpt))


class NotLinear(RuntimeError):
    """A measure that no linear form over the features reproduces exactly."""


def _check_held_out(family: str, dtype: str, attn: str, ckpt: bool, fitted: dict[str, dict[str, Any]]) -> None:
    spec = held_out(family)
    got = _measures(spec.hf_config, HELD_OUT_SEQ, dtype, attn, ckpt)
    for m, coef in fitted.items():
        if predict(coef, spec, HELD_OUT_SEQ) != got[m]:
            raise NotLinear(f"{m}: the fit predicts {predict(coef, spec, HELD_OUT_SEQ)} bytes at the held-out "
                            f"shape, the trace gives {got[m]}")


def _fit(rows: list[dict[str, int]], ys: list[int], measure: str = "") -> dict[str, Fraction]:
    """Exact rational least squares over the independent feature columns (greedy by rank)."""
    import numpy as np
    names = [k for k in rows[0] if any(r[k] for r in rows)]
    chosen: list[str] = []
    for n in names:
        m = np.array([[r[c] for c in chosen + [n]] for r in rows], dtype=float)
        if np.linalg.matrix_rank(m) == len(chosen) + 1:
            chosen.append(n)
    m = np.array([[r[c] for c in chosen] for r in rows], dtype=float)
    sol, *_ = np.linalg.lstsq(m, np.array(ys, dtype=float), rcond=None)
    coef = {c: Fraction(float(v)).limit_denominator(64) for c, v in zip(chosen, sol)}
    for r, y in zip(rows, ys):
        got = sum(coef[c] * r[c] for c in chosen)
        if got != y:
            raise NotLinear(f"{measure}: no exact linear form over {', '.join(chosen)} (a sample traces {y} bytes)")
    return {c: v for c, v in coef.items() if v}


def fit_family(family: str, log: Any = None) -> dict[str, Any]:
    specs = _perturbed(family)
    from zeroplan.core.activation_terms import dropout_flags
    out: dict[str, Any] = {"catalog_model": FAMILIES[family], "samples": len(specs) + 3,
                           "dropout": list(dropout_flags(specs[0]))}  # (attention, hidden) dropout as traced
    variants: dict[str, Any] = {}
    # 16-bit training under "sdpa/none" etc.; fp32 training (no casts: an fp32 RMSNorm input is the input
    # itself, the loss' upcast is the logits) under "sdpa/none/fp32" etc.
    for dtype, attn, ckpt in ((d, a, c) for d in ("bf16", "fp32") for a in ("sdpa", "eager") for c in (False, True)):
        key = f"{attn}/{'full' if ckpt else 'none'}" + ("/fp32" if dtype == "fp32" else "")
        rows, meas = [], []
        try:
            for i, spec in enumerate(specs):
                # every shape at SEQS[0]; the catalog shape and the one with more heads also at the
                # other lengths (separates per-sequence, per-token, s² and a·s² terms)
                for seq in (SEQS[0],) + ((SEQS[1], EXTRA_SEQ) if i == 0 else (SEQS[1],) if i == 1 else ()):
                    rows.append(_rows(spec, seq))
                    meas.append(_measures(spec.hf_config, seq, dtype, attn, ckpt))
            fitted = {m: {c: _num(v) for c, v in _fit(rows, [x[m] for x in meas], m).items()} for m in meas[0]}
            _check_held_out(family, dtype, attn, ckpt, fitted)
        # NotLinear: a peak that moves between ops as the shape changes, not one linear form; fp32 also where a
        # CPU kernel takes no fp32 (the MoE experts' grouped_mm)
        except (NotLinear if dtype == "bf16" else RuntimeError) as e:
            out.setdefault("unfitted", {})[key] = str(e).splitlines()[0]
            variants[key] = None
            if log:
                log(f"{family} {key}: not fitted ({e})")
            continue
        variants[key] = fitted
        if log:
            log(f"{family} {key}: layer {variants[key]['layer']}")
    # fp16 at the catalog shape must trace the same bytes as bf16 (both 2-byte dtypes)
    base = specs[0].hf_config
    for attn, ckpt in (("sdpa", False), ("eager", True)):
        try:
            fp16 = _measures(base, SEQS[0], "fp16", attn, ckpt)
        except RuntimeError as e:  # e.g. CPU grouped_mm (MoE experts) takes bf16 only
            out["fp16"] = f"not traced: {str(e).splitlines()[0]}"
            break
        if fp16 != _measures(base, SEQS[0], "bf16", attn, ckpt):
            raise RuntimeError(f"{family}: fp16 and bf16 traces differ ({attn}, ckpt={ckpt})")
    out["variants"] = variants
    return out


def _num(v: Fraction) -> int | float:
    return int(v) if v.denominator == 1 else float(v)


def generate(families: list[str], log: Any = print) -> dict[str, Any]:
    return {
        "about": "Activation bytes per token traced from transformers (examples/activations/trace.py); "
                 "regenerate with `python examples/activations/trace.py`.",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "dtypes": ["bf16", "fp16", "fp32"],
        "features": "bytes per token: tok=1, s=seq, h, q=a*head_dim, kv=kv_heads*head_dim, hd=head_dim, rot=rotary dims, ffn, a, "
                    "as=a*seq, V, E, kh=k*h, kffn=k*ffn, k (k=experts per token); const = bytes per sequence",
        "families": {f: fit_family(f, log) for f in families},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="re-trace and compare with the shipped data")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    data = generate(args.families, log=lambda m: print(m, file=sys.stderr))
    shipped = json.loads(DATA.read_text()) if DATA.exists() else None
    if args.check:
        bad = [f for f in args.families if not shipped or shipped["families"].get(f) != data["families"][f]]
        print("differ: " + ", ".join(bad) if bad else "shipped data matches the trace")
        return 1 if bad else 0
    if shipped and shipped["transformers_version"] == data["transformers_version"]:
        data["families"] = {**shipped["families"], **data["families"]}  # re-traced families replace theirs
    tmp = DATA.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(DATA)
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
