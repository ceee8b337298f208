"""Model specs, the catalog and `zeroplan models`.

Expected numbers are published parameter counts (Hugging Face safetensors totals) and
closed-form per-family formulas written here independently of zeroplan/specs/model.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan._util import InputError
from zeroplan.cli import app
from zeroplan.specs.model import ROLES, catalog_entry, catalog_names, load_model, spec_from_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "models"

# Published totals (Hugging Face safetensors parameter counts of the named repositories).
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2-7b": 7_615_616_512,
    "gpt-neox-20b": 20_554_567_680,
    "falcon-7b": 6_921_720_704,
    "phi-2": 2_779_683_840,
    "phi-3-mini": 3_821_079_552,
    "gemma-7b": 8_537_680_896,
}


# ---------------------------------------------------------------- closed forms (independent)

def llama_layer(h, heads, kv, inter, head_dim=None, qkv_bias=False):
    hd = head_dim or h // heads
    attn = h * heads * hd * 2 + 2 * h * kv * hd  # q, o, k, v
    if qkv_bias:
        attn += heads * hd + 2 * kv * hd
    return attn + 3 * h * inter + 2 * h  # gate/up/down + two RMSNorm weights


def gpt2_layer(h, inter):
    return (h * 3 * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h) + 4 * h


def neox_layer(h, inter):
    return (3 * h * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h) + 4 * h


def falcon7b_layer(h, inter, head_dim):
    return (h + 2 * head_dim) * h + h * h + 2 * h * inter + 2 * h  # no biases, one LayerNorm


def phi2_layer(h, inter):
    return 4 * (h * h + h) + (h * inter + inter) + (inter * h + h) + 2 * h


EXPECTED_LAYER = {
    "gpt2": gpt2_layer(768, 3072),
    "llama-2-7b": llama_layer(4096, 32, 32, 11008),
    "llama-2-13b": llama_layer(5120, 40, 40, 13824),
    "llama-2-70b": llama_layer(8192, 64, 8, 28672),
    "llama-3-8b": llama_layer(4096, 32, 8, 14336),
    "llama-3-70b": llama_layer(8192, 64, 8, 28672),
    "llama-3.1-405b": llama_layer(16384, 128, 8, 53248),
    "mistral-7b": llama_layer(4096, 32, 8, 14336),
    "mixtral-8x7b": llama_layer(4096, 32, 8, 8 * 14336) + 8 * 4096,  # 8 experts + router
    "qwen2-7b": llama_layer(3584, 28, 4, 18944, qkv_bias=True),
    "gpt-neox-20b": neox_layer(6144, 24576),
    "falcon-7b": falcon7b_layer(4544, 4 * 4544, 64),
    "phi-2": phi2_layer(2560, 10240),
    "phi-3-mini": llama_layer(3072, 32, 32, 8192),  # fused qkv / gate_up: same count
    "gemma-7b": llama_layer(3072, 16, 16, 24576, head_dim=256),
}

# (module, params): the largest directly-owned module (DeepSpeed's model_to_params view).
EXPECTED_LARGEST = {
    "gpt2": ("transformer.wte", 50257 * 768),
    "llama-2-7b": ("model.embed_tokens", 32000 * 4096),  # 131,072,000
    "llama-2-70b": ("model.embed_tokens", 32000 * 8192),
    "llama-3-8b": ("model.embed_tokens", 128256 * 4096),
    "llama-3.1-405b": ("model.embed_tokens", 128256 * 16384),
    "mixtral-8x7b": ("model.embed_tokens", 32000 * 4096),
    "qwen2-7b": ("model.embed_tokens", 152064 * 3584),
    "gpt-neox-20b": ("gpt_neox.embed_in", 50432 * 6144),
    "falcon-7b": ("transformer.word_embeddings", 65024 * 4544),
    "phi-2": ("lm_head", 51200 * 2560 + 51200),  # the head has a bias, so it beats the embedding
    "gemma-7b": ("model.embed_tokens", 256000 * 3072),
}


# ---------------------------------------------------------------- catalog counts

def test_catalog_holds_the_required_models():
    names = set(catalog_names())
    assert set(PUBLISHED) <= names


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_count_equals_published(name):
    spec = load_model(name)
    assert spec.params == PUBLISHED[name]
    entry = catalog_entry(name)
    assert entry["published_params"] == PUBLISHED[name]
    assert spec.published_params == PUBLISHED[name]
    assert entry["hf_repo"] and entry["published_params_source"]
    assert not spec.approximate
    # the inventory is what the count is made of (tied tensors once)
    assert sum(t.numel for t in spec.tensors if t.tied_to is None) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYER))
def test_per_layer_params_closed_form(name):
    spec = load_model(name)
    assert spec.per_layer_params == EXPECTED_LAYER[name]
    assert spec.layer_params() == [EXPECTED_LAYER[name]] * spec.num_layers


@pytest.mark.parametrize("name", sorted(EXPECTED_LARGEST))
def test_largest_module(name):
    spec = load_model(name)
    mod, n = EXPECTED_LARGEST[name]
    assert (spec.largest_module_name, spec.largest_module_params) == (mod, n)


def test_llama_2_7b_totals_from_closed_form():
    spec = load_model("llama-2-7b")
    assert spec.largest_module_params == 131_072_000
    assert spec.embedding_params == 131_072_000
    assert 32 * llama_layer(4096, 32, 32, 11008) + 2 * 32000 * 4096 + 4096 == spec.params


def test_mixtral_active_params():
    spec = load_model("mixtral-8x7b")
    expert = 3 * 4096 * 14336
    assert spec.num_experts == 8 and spec.experts_per_token == 2
    assert spec.active_params == PUBLISHED["mixtral-8x7b"] - 32 * 6 * expert  # 12,879,925,248 ("12.9B")
    assert spec.active_params == 12_879_925_248
    router = [t for t in spec.tensors if t.role == "router"]
    assert len(router) == 32 and router[0].name == "model.layers.0.block_sparse_moe.gate.weight"
    assert router[0].shape == [8, 4096]
    w1 = [t for t in spec.tensors if t.layer == 0 and t.role == "expert_gate"]
    assert [t.expert for t in w1] == list(range(8))
    assert all(t.shape == [14336, 4096] for t in w1)


def test_dense_models_active_equals_total():
    for name in ("llama-2-7b", "gpt2", "falcon-7b"):
        s = load_model(name)
        assert s.active_params == s.params and s.num_experts == 0


def test_tied_lm_heads_counted_once():
    gpt2 = load_model("gpt2")
    head = [t for t in gpt2.tensors if t.name == "lm_head.weight"]
    assert head and head[0].tied_to == "transformer.wte.weight" and head[0].role == "lm_head"
    assert gpt2.tie_word_embeddings
    assert gpt2.embedding_params == 50257 * 768 + 1024 * 768  # token + learned positions
    for name in ("falcon-7b", "gemma-7b"):
        s = load_model(name)
        assert s.tie_word_embeddings and any(t.tied_to for t in s.tensors)
    for name in ("llama-2-7b", "gpt-neox-20b", "phi-2", "qwen2-7b"):
        assert not any(t.tied_to for t in load_model(name).tensors)


def test_family_specific_tensors():
    qwen = {t.name: t for t in load_model("qwen2-7b").tensors}
    assert qwen["model.layers.0.self_attn.q_proj.bias"].shape == [3584]
    assert qwen["model.layers.0.self_attn.k_proj.bias"].shape == [512]
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen
    neox = {t.name: t for t in load_model("gpt-neox-20b").tensors}
    assert neox["gpt_neox.layers.0.attention.query_key_value.weight"].shape == [3 * 6144, 6144]
    assert neox["gpt_neox.layers.0.attention.query_key_value.bias"].role == "attn_qkv"
    assert neox["embed_out.weight"].tied_to is None
    falcon = {t.name: t for t in load_model("falcon-7b").tensors}
    assert falcon["transformer.h.0.self_attention.query_key_value.weight"].shape == [4544 + 2 * 64, 4544]
    assert "transformer.h.0.self_attention.query_key_value.bias" not in falcon
    assert falcon["transformer.h.0.input_layernorm.bias"].shape == [4544]
    assert not any("post_attention_layernorm" in n for n in falcon)
    gpt2 = {t.name: t for t in load_model("gpt2").tensors}
    assert gpt2["transformer.h.0.attn.c_attn.weight"].shape == [768, 2304]  # Conv1D [in, out]
    assert gpt2["transformer.wpe.weight"].role == "pos_embed"
    phi = {t.name: t for t in load_model("phi-2").tensors}
    assert phi["lm_head.bias"].shape == [51200]
    assert phi["model.final_layernorm.bias"].shape == [2560]
    phi3 = {t.name: t for t in load_model("phi-3-mini").tensors}
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"].shape == [3 * 3072, 3072]
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"].role == "mlp_gate_up"
    gemma = load_model("gemma-7b")
    assert gemma.head_dim == 256 and gemma.hidden_size == 3072
    assert {t.name: t.shape for t in gemma.tensors}["model.layers.0.self_attn.q_proj.weight"] == [4096, 3072]
    big = load_model("llama-3.1-405b")
    assert big.num_key_value_heads == 8 and big.head_dim == 128 and big.num_layers == 126


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_inventory_is_well_formed(name):
    spec = load_model(name)
    names = [t.name for t in spec.tensors]
    assert len(names) == len(set(names))
    for t in spec.tensors:
        assert t.role in ROLES
        assert t.name.startswith(t.module + ".")
        assert t.layer is None or 0 <= t.layer < spec.num_layers
        assert (t.expert is not None) == t.role.startswith("expert_")
        assert all(d > 0 for d in t.shape)
    assert sum(m.params for m in spec.modules()) == spec.params
    assert max(m.params for m in spec.modules()) == spec.largest_module_params


def test_catalog_names_are_case_insensitive_and_copies_are_independent():
    a = load_model("LLaMA-2-7B")
    assert a.name == "llama-2-7b" and a.source == "catalog:llama-2-7b"
    a.notes.append("mutated")
    a.tensors.clear()
    a.hf_config["hidden_size"] = 1
    b = load_model("llama-2-7b")
    assert "mutated" not in b.notes and b.tensors and b.hf_config["hidden_size"] == 4096


# ---------------------------------------------------------------- config files

def test_config_file_and_directory(tmp_path):
    tiny = 22 * llama_layer(2048, 32, 4, 5632) + 2 * 32000 * 2048 + 2048
    assert tiny == 1_100_048_384  # TinyLlama-1.1B
    by_dir = load_model(str(EXAMPLES / "tinyllama-1.1b"))
    by_file = load_model(str(EXAMPLES / "tinyllama-1.1b" / "config.json"))
    assert by_dir.params == by_file.params == tiny
    assert by_file.source.startswith("config:") and not by_file.approximate
    assert by_file.name == "tinyllama-1.1b"


def test_catalog_config_round_trip_through_a_file(tmp_path):
    cfg = catalog_entry("qwen2-7b")["config"]
    cfg["tie_word_embeddings"] = True  # as Qwen2-0.5B/1.5B ship it
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    s = load_model(str(p))
    assert s.params == PUBLISHED["qwen2-7b"] - 152064 * 3584


def test_generic_fallback_for_unknown_model_type(tmp_path):
    s = load_model(str(EXAMPLES / "custom-decoder" / "config.json"))
    assert s.approximate and s.model_type == "generic"
    assert any("not parsed exactly" in n for n in s.notes)
    h, inter, v = 1536, 4096, 50304
    assert s.params == 24 * llama_layer(h, 12, 12, inter) + 2 * v * h + h
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"model_type": "newthing", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "vocab_size": 100}))
    s2 = load_model(str(p))
    assert s2.intermediate_size == 256 and any("assumed 4 x hidden" in n for n in s2.notes)


def test_unknown_model_type_without_fields(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(InputError) as e:
        load_model(str(p))
    msg = str(e.value)
    assert str(p) in msg and "llama" in msg and "gpt_neox" in msg  # supported types listed
    assert "num_hidden_layers" in msg and "vocab_size" in msg  # missing keys named
    assert "\n" not in msg


def test_malformed_json_names_file_line_column(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{\n  "model_type": "llama",\n  "hidden_size": 4096,,\n}\n')
    with pytest.raises(InputError) as e:
        load_model(str(p))
    assert str(p) in str(e.value) and "line 3" in str(e.value) and "column" in str(e.value)


def test_missing_and_bad_fields(tmp_path):
    cfg = catalog_entry("llama-2-7b")["config"]
    p = tmp_path / "config.json"
    del cfg["intermediate_size"]
    p.write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="intermediate_size") as e:
        load_model(str(p))
    assert str(p) in str(e.value)
    for key, value in (("hidden_size", 0), ("num_hidden_layers", -2), ("vocab_size", "32000"),
                       ("num_attention_heads", 3.5), ("tie_word_embeddings", "no")):
        cfg = catalog_entry("llama-2-7b")["config"]
        cfg[key] = value
        p.write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=key):
            load_model(str(p))
    cfg = catalog_entry("llama-2-7b")["config"]
    cfg["num_key_value_heads"] = 5
    p.write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="num_key_value_heads"):
        load_model(str(p))
    p.write_text("[1, 2]")
    with pytest.raises(InputError, match="JSON object"):
        load_model(str(p))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no config.json"):
        load_model(str(empty))


# ---------------------------------------------------------------- counts and names

@pytest.mark.parametrize("text,n", [("70B", 70_000_000_000), ("7B", 7_000_000_000), ("70e9", 70_000_000_000),
                                    ("1.3T", 1_300_000_000_000), ("125M", 125_000_000)])
def test_count_specs_are_exact(text, n):
    s = load_model(text)
    assert s.params == n and s.active_params == n
    assert s.approximate and s.source == f"count:{text}"
    assert any("exactly as stated" in x for x in s.notes)
    assert s.head_dim == 128 and s.vocab_size == 32000 and s.gated_mlp and not s.tie_word_embeddings
    shape_total = sum(t.numel for t in s.tensors)
    assert abs(shape_total - n) / n < 0.05  # the default shape is near the count ...
    assert any(f"{shape_total:,}" in x for x in s.notes)  # ... and the notes say by how much


def test_count_default_shapes_follow_known_llama_shapes():
    assert load_model("7B").hidden_size == 4096
    assert load_model("13B").hidden_size == 5120
    s70 = load_model("70B")
    assert (s70.hidden_size, s70.num_key_value_heads, s70.intermediate_size) == (8192, 8, 28672)
    assert load_model("405B").hidden_size == 16384


def test_unknown_name_suggests_close_names():
    with pytest.raises(InputError) as e:
        load_model("llama2-7b")
    assert "llama-2-7b" in str(e.value) and "did you mean" in str(e.value)
    with pytest.raises(InputError):
        load_model("")
    with pytest.raises(InputError, match="not found"):
        load_model("no/such/config.json")


# ---------------------------------------------------------------- scaling

def test_scaled_llama_is_exact_and_same_structure():
    base = load_model("llama-3-8b")
    s = base.scaled(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1000)
    assert s.model_type == "llama" and not s.approximate
    assert (s.num_attention_heads, s.head_dim, s.num_key_value_heads) == (2, 128, 2)
    assert s.params == 2 * llama_layer(256, 2, 2, 512) + 2 * 1000 * 256 + 256
    base_layer0 = {t.name.replace("layers.0.", "L.") for t in base.tensors if t.layer == 0}
    assert {t.name.replace("layers.0.", "L.") for t in s.tensors if t.layer == 0} == base_layer0
    assert base.params == PUBLISHED["llama-3-8b"]  # the original is untouched


def test_scaled_keeps_family_features():
    mix = load_model("mixtral-8x7b").scaled(num_layers=1, hidden_size=128, intermediate_size=256,
                                            vocab_size=100, num_experts=4)
    assert mix.num_experts == 4 and mix.experts_per_token == 2
    expert = 3 * 128 * 256
    assert mix.active_params == mix.params - 4 * expert + 2 * expert
    gpt2 = load_model("gpt2").scaled(num_layers=2, hidden_size=128, vocab_size=300)
    assert gpt2.params == 2 * gpt2_layer(128, 4 * 128) + 300 * 128 + 1024 * 128 + 2 * 128
    assert gpt2.tie_word_embeddings and gpt2.head_dim == 64
    gemma = load_model("gemma-7b").scaled(num_layers=1, hidden_size=192, intermediate_size=384, vocab_size=64)
    assert gemma.head_dim == 256 and gemma.num_attention_heads == 1
    assert gemma.params == llama_layer(192, 1, 1, 384, head_dim=256) + 64 * 192 + 192
    falcon = load_model("falcon-7b").scaled(num_layers=2, hidden_size=128, vocab_size=50)
    assert falcon.params == 2 * falcon7b_layer(128, 512, 64) + 50 * 128 + 2 * 128
    qwen = load_model("qwen2-7b").scaled(num_layers=1, hidden_size=256, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=10)
    assert qwen.params == llama_layer(256, 4, 2, 64, qkv_bias=True) + 2 * 10 * 256 + 256


def test_scaled_count_spec_is_exact():
    s = load_model("70B").scaled(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1000)
    assert not s.approximate
    assert s.params == sum(t.numel for t in s.tensors)
    assert s.params == 2 * llama_layer(256, 2, 2, 512) + 2 * 1000 * 256 + 256


def test_scaled_rejects_bad_values():
    with pytest.raises(InputError):
        load_model("llama-2-7b").scaled(num_layers=0)
    with pytest.raises(InputError):
        load_model("llama-2-7b").scaled(num_experts=4)


def test_spec_from_config_direct():
    s = spec_from_config({"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                          "vocab_size": 10}, "tiny", "test:inline")
    assert s.params == llama_layer(64, 4, 2, 128) + 2 * 10 * 64 + 64
    assert s.name == "tiny" and s.source == "test:inline"


# ---------------------------------------------------------------- optional cross-check with transformers

def test_matches_transformers_on_meta_device_when_installed():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    for name in ("gpt2", "llama-3-8b", "qwen2-7b", "gpt-neox-20b", "falcon-7b", "phi-2", "gemma-7b", "mixtral-8x7b"):
        spec = load_model(name).scaled(num_layers=2, hidden_size=256, intermediate_size=320, vocab_size=512)
        cfg = dict(spec.hf_config)
        mt = cfg.pop("model_type")
        cfg.pop("auto_map", None)
        conf = transformers.AutoConfig.for_model(mt, **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(conf)
        assert sum(p.numel() for p in model.parameters()) == spec.params, name


# ---------------------------------------------------------------- CLI

runner = CliRunner()


def test_cli_models_list():
    r = runner.invoke(app, ["models", "list"])
    assert r.exit_code == 0, r.output
    for name in PUBLISHED:
        assert name in r.output
    assert "405,853,388,800" in r.output and "405.85" in r.output


def test_cli_models_list_json():
    r = runner.invoke(app, ["models", "list", "--json"])
    assert r.exit_code == 0
    rows = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert set(PUBLISHED) <= set(rows)
    for name, n in PUBLISHED.items():
        assert rows[name]["params"] == n
    assert rows["mixtral-8x7b"]["num_experts"] == 8
    assert rows["gpt2"]["tie_word_embeddings"] is True


def test_cli_models_show():
    r = runner.invoke(app, ["models", "show", "llama-2-7b"])
    assert r.exit_code == 0, r.output
    assert "6,738,415,616" in r.output and "131,072,000" in r.output and "model.embed_tokens" in r.output
    r = runner.invoke(app, ["models", "show", "mixtral-8x7b", "--json"])
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["params"] == PUBLISHED["mixtral-8x7b"] and d["active_params"] == 12_879_925_248
    assert d["matches_published"] is True and d["largest_module_params"] == 131_072_000
    assert d["per_layer_params"] == EXPECTED_LAYER["mixtral-8x7b"] and d["notes"]
    assert "tensors" not in d and "hf_config" not in d


def test_cli_models_show_path_and_count():
    r = runner.invoke(app, ["models", "show", str(EXAMPLES / "tinyllama-1.1b"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["params"] == 1_100_048_384
    r = runner.invoke(app, ["models", "show", "70B", "--json"])
    d = json.loads(r.stdout)
    assert d["params"] == 70_000_000_000 and d["approximate"] is True
    r = runner.invoke(app, ["models", "show", "70B"])
    assert r.exit_code == 0 and "70,000,000,000" in r.output and "note" in r.output


def test_cli_models_show_bad_input(tmp_path):
    r = runner.invoke(app, ["models", "show", "mixtral-8x8b"])
    assert r.exit_code == 2
    assert "mixtral-8x7b" in r.output and "Traceback" not in r.output
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",\n "hidden_size": }')
    r = runner.invoke(app, ["models", "show", str(bad)])
    assert r.exit_code == 2
    flat = r.output.replace("\n", "")
    assert "config.json" in flat and "line 2" in flat and "Traceback" not in r.output


def test_models_command_imports_no_torch():
    code = ("import sys; import zeroplan.specs.model as m, zeroplan.commands.models as c; "
            "m.load_model('llama-3.1-405b'); m.load_model('70B'); c.list_rows(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_falcon_new_decoder_architecture():
    # Falcon-40B layout: grouped kv heads in a fused qkv, ln_attn + ln_mlp, no biases, tied head.
    cfg = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
           "num_hidden_layers": 60, "vocab_size": 65024, "new_decoder_architecture": True,
           "parallel_attn": True, "bias": False}
    s = spec_from_config(cfg, "falcon-40b-like", "test:inline")
    hd = 64
    layer = (128 + 2 * 8) * hd * 8192 + 8192 * 8192 + 2 * 8192 * 4 * 8192 + 4 * 8192
    assert s.per_layer_params == layer
    assert s.params == 60 * layer + 65024 * 8192 + 2 * 8192
    names = {t.name for t in s.tensors if t.layer == 0}
    assert "transformer.h.0.ln_attn.weight" in names and "transformer.h.0.ln_mlp.bias" in names
    assert s.num_key_value_heads == 8
    # n_layer / n_head / n_head_kv spellings (RefinedWeb-era configs) read the same
    old = {**{k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "num_attention_heads", "num_kv_heads")},
           "n_layer": 60, "n_head": 128, "n_head_kv": 8}
    assert spec_from_config(old, "x", "test:inline").params == s.params
