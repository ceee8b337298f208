"""Trainable / frozen / adapter counts (specs/finetune.py), exact against PEFT.

The PEFT cross-check instantiates each family with transformers on the meta device (2 layers
at the real width: LoRA counts are per module, so depth only multiplies) and compares
``PeftModel.get_nb_trainable_parameters()`` with zeroplan's count, to the parameter.
"""

from __future__ import annotations

import copy

import pytest

from zeroplan._util import InputError
from zeroplan.specs.finetune import FineTune, LoraSpec, QuantSpec, finetune_inventory
from zeroplan.specs.model import load_model

# Families whose module layout transformers 5 keeps as in the checkpoint (Mixtral's experts
# are fused there, so its all-linear count is checked by the closed form below instead).
PEFT_FAMILIES = ["llama-2-7b", "mistral-7b", "qwen2-7b", "gpt2", "gpt-neox-20b", "falcon-7b", "phi-2",
                 "phi-3-mini", "gemma-7b"]
PEFT_CASES = [
    # (targets, modules_to_save, dora)
    ("all-linear", (), False),
    ("all-linear", ("lm_head",), True),
    ("all-linear", ("embed_tokens", "lm_head"), False),
]


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    return torch, transformers, peft


@pytest.mark.parametrize("family", PEFT_FAMILIES)
def test_trainable_counts_match_peft(hf, family):
    torch, transformers, peft = hf
    spec = load_model(family).scaled(num_layers=2)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec.hf_config))
    for targets, saved, dora in PEFT_CASES:
        model = copy.deepcopy(base)
        cfg = peft.LoraConfig(r=8, target_modules=targets, modules_to_save=list(saved) or None, use_dora=dora)
        want = peft.get_peft_model(model, cfg).get_nb_trainable_parameters()
        inv = finetune_inventory(spec, FineTune(method="lora", lora=LoraSpec(
            r=8, targets=targets, modules_to_save=saved, dora=dora)))
        assert (inv.trainable_params, inv.total_params) == tuple(want), (family, targets, saved, dora)


def test_named_targets_match_peft_on_llama(hf):
    torch, transformers, peft = hf
    spec = load_model("llama-3-8b").scaled(num_layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec.hf_config))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    want = peft.get_peft_model(model, peft.LoraConfig(r=64, target_modules=list(targets))).get_nb_trainable_parameters()
    inv = finetune_inventory(spec, FineTune(method="lora", lora=LoraSpec(r=64, targets=targets)))
    assert (inv.trainable_params, inv.total_params) == tuple(want)


def test_lora_closed_form_llama_2_7b_q_v():
    # 32 layers x (q + v) x r x (in + out) = 32 x 2 x 16 x 8192
    inv = finetune_inventory(load_model("llama-2-7b"), FineTune(method="lora", lora=LoraSpec(r=16, targets=("q_proj", "v_proj"))))
    assert inv.adapter_params == 32 * 2 * 16 * (4096 + 4096) == 8_388_608
    assert inv.trainable_params == 8_388_608
    assert inv.frozen_params == 6_738_415_616
    assert {t.target: (t.modules, t.params) for t in inv.by_target} == {
        "q_proj": (32, 4_194_304), "v_proj": (32, 4_194_304)}


def test_mixtral_all_linear_per_expert_closed_form():
    spec = load_model("mixtral-8x7b")
    inv = finetune_inventory(spec, FineTune(method="lora", lora=LoraSpec(r=8, targets="all-linear")))
    H, I, E, kv, L = 4096, 14336, 8, 1024, 32
    per_layer = 8 * ((H + H) + (H + kv) * 2 + (H + H) + (H + E) + E * 3 * (H + I))
    assert inv.adapter_params == L * per_layer


def test_partial_fine_tuning_last_layers_and_globs():
    spec = load_model("llama-2-7b")
    inv = finetune_inventory(spec, FineTune(method="full", trainable=("last:2", "lm_head.*")))
    per_layer = spec.per_layer_params
    assert inv.trainable_params == 2 * per_layer + 32000 * 4096
    assert inv.frozen_params == spec.params - inv.trainable_params
    assert inv.adapter_params == 0


def test_full_fine_tuning_trains_everything():
    spec = load_model("gpt2")
    inv = finetune_inventory(spec, FineTune())
    assert inv.trainable_params == inv.total_params == spec.params == 124_439_808
    assert inv.frozen_params == 0


def test_qlora_storage_nf4_double_quant():
    spec = load_model("llama-2-7b")
    inv = finetune_inventory(spec, FineTune(method="qlora", lora=LoraSpec(r=16, targets="all-linear"),
                                            quant=QuantSpec(bits=4, double_quant=True)), compute_bytes=2)
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # every linear but lm_head
    assert inv.quantized_params == linear
    unquantised = spec.params - linear  # embeddings, norms, lm_head stay bf16
    # each weight tensor is quantised on its own: blocks of 64, absmax uint8 + fp32 per 256 blocks + offset
    q_bytes = 0
    for t in spec.tensors:
        if t.role not in ("embed", "norm", "lm_head"):
            blocks = -(-t.numel // 64)
            q_bytes += t.numel // 2 + blocks + 4 * -(-blocks // 256) + 4
    assert inv.frozen_storage_bytes == q_bytes + 2 * unquantised
    assert inv.dequant_transient_elems == 4096 * 11008
    # ~0.52 bytes per quantised weight
    assert 0.51 < (q_bytes / linear) < 0.53


def test_qlora_8bit_storage():
    spec = load_model("llama-2-7b").scaled(num_layers=1)
    inv = finetune_inventory(spec, FineTune(method="qlora", lora=LoraSpec(targets=("q_proj",)), quant=QuantSpec(bits=8)))
    rows = 4096 * 4 + 11008 * 2 + 4096  # q,k,v,o out rows + gate, up + down
    assert inv.quant_constant_bytes == 4 * rows


@pytest.mark.parametrize("ft,needle", [
    (FineTune(method="lora", lora=LoraSpec(targets=("nonexistent",))), "match no module"),
    (FineTune(method="full", trainable=("nothing.*",)), "matches no parameter"),
    (FineTune(method="full", trainable=("last:0",)), "last:K"),
    (FineTune(method="lora"), "needs LoRA settings"),
    (FineTune(method="qlora", lora=LoraSpec()), "quantisation"),
])
def test_bad_fine_tune_settings_are_input_errors(ft, needle):
    with pytest.raises(InputError, match=needle):
        finetune_inventory(load_model("llama-2-7b"), ft)
