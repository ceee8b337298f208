"""Bounded fuzzing of the readers that take user files (hypothesis, fixed example budgets).

What tests/test_ds_config.py already fuzzes (random JSON-ish dicts and a small-alphabet text
grammar against the DeepSpeed reader) is not repeated. Here:

1. byte-level mutations of the shipped DeepSpeed configs (examples/configs) -> load_ds_config,
   then the planner on whatever the reader accepts (a config the reader accepts must never
   crash evaluate());
2. random HF config.json dicts for every family (right keys, hostile values) -> spec_from_config:
   InputError naming the key, or a spec whose inventory sums to its params;
3. byte-level mutations of real config.json files read from disk -> load_model;
4. byte-level mutations of a bundled hardware-profile TOML -> parse_profile_toml;
5. line-level mutations of the NCCL fixture logs -> parse_nccl_log.

The contract for every reader: return a valid object or raise InputError with one line; any
other exception is a bug. Budgets: ``max_examples`` per test below; the whole module runs in
about 20 s on 2 cores (measured, see the report in the pull request notes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan._util import InputError
from zeroplan.core.plan import evaluate
from zeroplan.inspect.nccl_log import parse_nccl_log
from zeroplan.specs.deepspeed_config import load_ds_config
from zeroplan.specs.hardware import parse_profile_toml
from zeroplan.specs.model import SUPPORTED_MODEL_TYPES, load_model, spec_from_config
from zeroplan.specs.training import PRECISIONS, TrainingSetup

REPO = Path(__file__).resolve().parent.parent
DS_EXAMPLES = {p.name: p.read_text(encoding="utf-8") for p in sorted((REPO / "examples" / "configs").glob("*.json"))}
MODEL_FILES = [REPO / "examples" / "models" / "tinyllama-1.1b" / "config.json",
               REPO / "examples" / "models" / "custom-decoder" / "config.json"]
PROFILE = (REPO / "hardware_profiles" / "h100-8x-100gbe.toml").read_text(encoding="utf-8")
NCCL_LOGS = {p.name: p.read_text(encoding="utf-8") for p in sorted((REPO / "tests" / "data" / "nccl").glob("*.log"))}
SMALL = load_model("llama-2-7b").scaled(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1000)

def fuzz(max_examples: int) -> settings:
    # derandomize: the suite runs the same examples every time (no flaky failures); exploratory
    # runs with 15x the budget and random seeds found the bug pinned in test_hostile.py
    # (control characters in DeepSpeed keys break the one-line error).
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def one_line(exc: InputError, where: str | None = None) -> None:
    msg = str(exc)
    assert msg.strip() and "\n" not in msg, repr(msg)
    if where is not None:
        assert where in msg, (where, msg)


# ------------------------------------------------------------------------------------- mutations

JSON_BYTES = list(b'{}[]:,"\\/*0123456789.eE+-ntrufalsNIiy \n\t') + [0, 0xFF, 0xC3, 0xE9]


@st.composite
def mutated(draw, text: str, alphabet: list[int] = JSON_BYTES, max_ops: int = 6):
    """``text`` with 1..max_ops byte edits: flip, delete a run, insert, duplicate a run, truncate."""
    data = bytearray(text.encode("utf-8"))
    for _ in range(draw(st.integers(1, max_ops))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "delete", "insert", "dup", "truncate", "replace"]))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 16))]
        elif op == "insert":
            data[i:i] = bytes(draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=8)))
        elif op == "dup":
            j = min(len(data), i + draw(st.integers(1, 64)))
            data[i:i] = data[i:j]
        elif op == "truncate":
            del data[i:]
        else:
            data[i] = draw(st.sampled_from(alphabet))
    return bytes(data)


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ------------------------------------------------------------------------------------- 1. DeepSpeed configs

@fuzz(600)
@given(data=st.data(), name=st.sampled_from(sorted(DS_EXAMPLES)), strict=st.booleans(),
       ws=st.sampled_from([None, 1, 8, 64]))
def test_fuzz_mutated_deepspeed_configs(data, name, strict, ws, tmp_path_factory):
    raw = data.draw(mutated(DS_EXAMPLES[name]))
    path = tmp_path_factory.mktemp("ds") / name
    path.write_bytes(raw)
    try:
        cfg = load_ds_config(str(path), strict=strict, hidden_size=256, world_size=ws)
    except InputError as exc:
        one_line(exc, str(path))
        return
    assert cfg.zero.stage in (0, 1, 2, 3)
    json.dumps(cfg.model_dump(mode="json"), allow_nan=False)
    # what the reader accepts, the planner must evaluate (no crash, integer non-negative bytes)
    tr = TrainingSetup(precision=PRECISIONS[cfg.precision], micro_batch=cfg.micro_batch or 1, seq_len=128,
                       grad_accum=cfg.grad_accum or 1)
    plan = evaluate(model=SMALL, training=tr, zero=cfg.zero, n_gpus=ws or 8, gpus_per_node=8)
    assert plan.memory.peak >= 0 and plan.comm.bytes_per_gpu_per_step >= 0


_leaf_values = st.one_of(
    st.integers(-(2**40), 2**63), st.sampled_from([0, 1, -1, 3, 4, 2**31, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e30, -1e30, 0.5, 2.5, 5e8, 1e-9]),
    st.booleans(), st.none(), st.sampled_from(["auto", "cpu", "nvme", "none", "true", "3", "", "fp16", "bf16"]),
    st.just({}), st.just([]))


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


@fuzz(400)
@given(data=st.data(), name=st.sampled_from(sorted(DS_EXAMPLES)), ws=st.sampled_from([1, 2, 8, 64]))
def test_fuzz_deepspeed_values_then_plan(data, name, ws):
    """Valid JSON, hostile VALUES (replace, delete, rename keys at any depth): the reader accepts
    (non-strict) or raises InputError, and every config it accepts plans without a crash."""
    from zeroplan.specs.deepspeed_config import parse_ds_json

    cfg, _ = parse_ds_json(DS_EXAMPLES[name], name)
    for _ in range(data.draw(st.integers(1, 4))):
        paths = list(_paths(cfg))
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = cfg
        for k in path[:-1]:
            parent = parent[k]
        op = data.draw(st.sampled_from(["set", "set", "delete", "rename"]))
        if op == "set":
            parent[path[-1]] = data.draw(_leaf_values)
        elif op == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1] + data.draw(st.sampled_from(["_", "s", "X"]))] = parent.pop(path[-1])
    try:
        ds = load_ds_config(json.loads(json.dumps(cfg)), hidden_size=256, world_size=ws)
    except InputError as exc:
        one_line(exc)
        return
    assert ds.zero.stage in (0, 1, 2, 3)
    tr = TrainingSetup(precision=PRECISIONS[ds.precision], micro_batch=min(ds.micro_batch or 1, 64), seq_len=128,
                       grad_accum=min(ds.grad_accum or 1, 64))
    plan = evaluate(model=SMALL, training=tr, zero=ds.zero, n_gpus=ws, gpus_per_node=min(ws, 8))
    assert plan.memory.peak >= 0 and plan.comm.bytes_per_gpu_per_step >= 0
    json.dumps(plan.model_dump(mode="json"), allow_nan=False)


# ------------------------------------------------------------------------------------- 2. config.json dicts

_hostile_ints = st.one_of(st.integers(-3, 4), st.integers(1, 4096), st.sampled_from([0, -1, 2**31, 2**63, 10**30]))
_values = st.one_of(
    _hostile_ints, st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["", "8", "auto", "llama", "1e3"]), st.lists(st.integers(0, 8), max_size=2),
    st.dictionaries(st.sampled_from(["type", "factor"]), st.integers(0, 4), max_size=2))
_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "head_dim", "tie_word_embeddings", "max_position_embeddings", "num_local_experts",
         "num_experts_per_tok", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "d_model",
         "num_layers", "num_heads", "ffn_dim", "rotary_pct", "partial_rotary_factor", "multi_query",
         "new_decoder_architecture", "n_head_kv", "num_kv_heads", "parallel_attn", "bias", "attention_bias",
         "mlp_bias", "use_parallel_residual", "layer_norm_epsilon", "model_type"]


@st.composite
def hf_configs(draw):
    """A plausible small config of some family, then a few keys given hostile values."""
    mt = draw(st.sampled_from(list(SUPPORTED_MODEL_TYPES) + ["mamba", "", None, 7]))
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([8, 16, 32]))
    layers = draw(st.integers(1, 3))
    cfg = {"model_type": mt, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "intermediate_size": 2 * hidden, "vocab_size": draw(st.integers(1, 512)),
           "n_embd": hidden, "n_layer": layers, "n_head": heads, "max_position_embeddings": 64,
           "n_positions": 64, "num_local_experts": 2, "num_experts_per_tok": 1}
    for key in draw(st.lists(st.sampled_from(_KEYS), max_size=3, unique=True)):
        value = draw(_values)
        # keep sizes that multiply into a tensor inventory bounded (a 1e9-layer config is a
        # separate, known bug: tests/test_hostile.py::test_model_config_absurd_layer_count...)
        if isinstance(value, int) and not isinstance(value, bool) and value > 4096 and key in (
                "num_hidden_layers", "n_layer", "num_layers", "num_local_experts", "hidden_size", "n_embd",
                "d_model", "intermediate_size", "n_inner", "ffn_dim", "vocab_size", "head_dim"):
            value = 4096
        cfg[key] = value
    return cfg


@fuzz(1000)
@given(cfg=hf_configs())
def test_fuzz_config_json_dicts(cfg):
    try:
        spec = spec_from_config(cfg, "fuzz", "config:fuzz/config.json")
    except InputError as exc:
        one_line(exc, "fuzz/config.json")
        return
    own = [t for t in spec.tensors if t.tied_to is None]
    assert spec.params == sum(t.numel for t in own) > 0
    assert all(d > 0 for t in spec.tensors for d in t.shape), [t.shape for t in spec.tensors]
    assert 0 < spec.largest_module_params <= spec.params
    assert 0 < spec.active_params <= spec.params
    assert math.isfinite(spec.params)


# ------------------------------------------------------------------------------------- 3. config.json files

@fuzz(300)
@given(data=st.data(), src=st.sampled_from(MODEL_FILES))
def test_fuzz_mutated_config_json_files(data, src, tmp_path_factory):
    raw = data.draw(mutated(src.read_text(encoding="utf-8")))
    path = tmp_path_factory.mktemp("m") / "config.json"
    path.write_bytes(raw)
    try:
        spec = load_model(str(path))
    except InputError as exc:
        one_line(exc, str(path))
        return
    assert spec.params == sum(t.numel for t in spec.tensors if t.tied_to is None) > 0


# ------------------------------------------------------------------------------------- 4. profile TOML

TOML_BYTES = list(b'[]{}=."\'#_-+0123456789.eEinfa \n\t') + [0, 0xFF]


@fuzz(300)
@given(data=st.data())
def test_fuzz_mutated_profile_toml(data):
    raw = data.draw(mutated(PROFILE, TOML_BYTES))
    text = _decode(raw)
    if text is None:
        return  # load_profile's read_text_file rejects non-UTF-8 before parsing (test_hostile covers it)
    try:
        prof = parse_profile_toml(text, "fuzz.toml")
    except InputError as exc:
        one_line(exc, "fuzz.toml")
        return
    assert prof.gpu.memory_bytes > 0 and prof.node.gpus_per_node >= 1


# ------------------------------------------------------------------------------------- 5. NCCL logs

@fuzz(200)
@given(data=st.data(), name=st.sampled_from(sorted(NCCL_LOGS)))
def test_fuzz_mutated_nccl_logs(data, name):
    lines = NCCL_LOGS[name].splitlines()
    ops = data.draw(st.lists(st.tuples(st.integers(0, max(0, len(lines) - 1)),
                                       st.sampled_from(["drop", "cut", "dup", "digits", "garble"])),
                             min_size=1, max_size=8))
    for i, op in ops:
        if not lines:
            break
        i %= len(lines)
        if op == "drop":
            del lines[i]
        elif op == "cut":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "digits":
            lines[i] = "".join(data.draw(st.sampled_from("0123456789-x")) if c.isdigit() else c for c in lines[i])
        else:
            lines[i] = data.draw(st.text(max_size=40))
    try:
        summary = parse_nccl_log("\n".join(lines))
    except InputError as exc:
        one_line(exc)
        return
    json.dumps(summary.model_dump(mode="json"), allow_nan=False)
