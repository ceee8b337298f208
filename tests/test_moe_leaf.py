"""MoE blocks as DeepSpeed's ZeRO-3 fetches them with transformers 5 (core/moe_leaf.py): the stage-3 replay's
fetch units against what DeepSpeed 0.19.8 fetches in one forward and backward of transformers' tiny Mixtral
(tests/ds_moe_leaf_probe.py) and what its estimators read of that model, and the plan's note on the gradients
still counted per tensor. Counts only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.core.layout import zero_layout
from zeroplan.core.plan import evaluate
from zeroplan.core.moe_leaf import largest_module_params, moe_fetch_groups, moe_leaf_block, moe_leaf_note
from zeroplan.core.stage3_fetch import micro_step_events
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model, spec_from_config
from zeroplan.specs.training import TrainingSetup, get_precision

PROBE = Path(__file__).resolve().parent / "ds_moe_leaf_probe.py"
TINY = {"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
EXPERTS = 4 * 3 * 16 * 32  # 4 experts of 3 matrices
ROUTER = 4 * 16
# zero_optimization.leaf_module blocks: DeepSpeed's default (the HF block class), none, the bare class name,
# and the block by its transformers-5 name suffix
LEAVES = {"default": "default", "none": {"classes": []}, "bare class": {"classes": ["MixtralSparseMoeBlock"]},
          "suffix": {"classes": [], "name_suffixes": ["mlp"]}}


class _Probe:
    """What tests/ds_moe_leaf_probe.py printed, per configuration (a leaf_module JSON block or "default")."""

    def __init__(self, n: int, stdout: str) -> None:
        self.fetched: list[list[tuple[str, int, bool]]] = [[] for _ in range(n)]  # (name, elements, forward)
        self.reduced: list[list[int]] = [[] for _ in range(n)]  # elements per gradient, in reduction order
        self.estimator: list[int] = []  # DeepSpeed's estimators' (total, largest_layer_params)
        self.params: list[tuple[str, int]] = []  # the model's parameters in its order
        for line in stdout.splitlines():  # DeepSpeed's own log lines start otherwise
            kind, _, rest = line.partition(" ")
            if kind == "FETCH":
                index, name, numel, forward = json.loads(rest)
                self.fetched[index].append((name, numel, forward))
            elif kind == "REDUCE":
                index, numel = json.loads(rest)
                self.reduced[index].append(numel)
            elif kind == "ESTIMATOR":
                self.estimator = json.loads(rest)
            elif kind == "PARAMS":
                self.params = [tuple(p) for p in json.loads(rest)]


def _probe(*leaf: str) -> _Probe:
    from zeroplan.bench import deepspeed_engine as dse

    if not dse.deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, str(PROBE), *leaf], capture_output=True, text=True, timeout=300,
                         check=True, env=dict(os.environ, MASTER_PORT=str(port)))
    return _Probe(len(leaf), out.stdout)


def _planned(spec, zero: ZeroConfig) -> list[tuple[int, bool]]:
    """The replay's fetches of one micro-step (core/stage3_fetch.py micro_step_events): (elements, forward)."""
    layout = zero_layout(spec, 1, zero)
    units = layout.units
    return [(sum(layout.tensors[p].numel for p in units[u].params), phase == "forward")
            for kind, u, phase, _ in micro_step_events(units) if kind == "fetch" and u >= 0]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_the_replay_fetches_the_moe_block_as_deepspeed_does():
    spec = spec_from_config(TINY, "mixtral-tiny", "test")
    probe = _probe(*(v if isinstance(v, str) else json.dumps(v) for v in LEAVES.values()))
    runs = dict(zip(LEAVES, probe.fetched))
    for (key, leaf), reduced in zip(LEAVES.items(), probe.reduced):
        zero = ZeroConfig(stage=3) if leaf == "default" else ZeroConfig(stage=3, leaf_module=leaf)
        assert [(n, f) for _, n, f in runs[key]] == _planned(spec, zero), key
        # gradients reach DeepSpeed's reduction in the layout's ready order: a leaf block's together, in
        # parameter order, at its backward hook; otherwise in reverse
        assert reduced == [t.numel for t in zero_layout(spec, 1, zero).grad_ready], key
    # the layout holds transformers' parameters: the experts fused into gate_up_proj and down_proj
    layout = zero_layout(spec, 1, ZeroConfig(stage=3))
    assert sorted(n for _, n in probe.params) == sorted(t.numel for t in layout.tensors)
    fused = {n.rpartition(".")[2]: k for n, k in probe.params if ".experts." in n}
    assert fused == {t.name.rpartition(".")[2]: t.numel for t in layout.tensors if ".experts." in t.name}
    assert probe.reduced[0][2:5] == [ROUTER, 2 * EXPERTS // 3, EXPERTS // 3]  # router, gate_up, down
    # a leaf block is fetched whole and none of its children; without one the fused experts are one fetch
    assert ("model.layers.0.mlp", ROUTER + EXPERTS, True) in runs["default"]
    assert not [n for n, _, _ in runs["default"] if n.startswith("model.layers.0.mlp.")]
    assert {n: k for n, k, _ in runs["none"]}["model.layers.0.mlp.experts"] == EXPERTS
    # DeepSpeed's estimators read the fused experts module as the largest layer (the plan's estimator row)
    assert probe.estimator == [spec.params, largest_module_params(spec)] == [spec.params, EXPERTS]
    # the bundled runtime's module tree (one module per expert matrix) is fetched module by module
    per_module = _planned(spec.model_copy(update={"module_tree": "checkpoint"}), ZeroConfig(stage=3))
    assert len(per_module) == len(_planned(spec, ZeroConfig(stage=3))) + 2 * (4 * 3 + 1 - 1)


def test_groups_follow_the_leaf_configuration():
    spec = spec_from_config(TINY, "mixtral-tiny", "test")
    block = "model.layers.0.block_sparse_moe"
    leaf = moe_fetch_groups(spec, ZeroConfig(stage=3))
    # the router, 12 expert matrices and the fused experts module all map to the block
    assert set(leaf.values()) == {block} and len(leaf) == 14 and leaf[f"{block}.experts"] == block
    fused = moe_fetch_groups(spec, ZeroConfig(stage=3, leaf_module={"classes": []}))
    assert f"{block}.gate" not in fused and set(fused.values()) == {f"{block}.experts"}
    assert moe_fetch_groups(load_model("llama-3-8b"), ZeroConfig(stage=3)) == {}
    assert moe_fetch_groups(spec.model_copy(update={"module_tree": "checkpoint"}), ZeroConfig(stage=3)) == {}


def test_a_leaf_blocks_gradients_are_live_together_in_the_backward():
    mixtral = load_model("mixtral-8x7b")
    block = 8 * 4096 + 24 * 4096 * 14336  # the router and every expert matrix of one layer
    leaf = zero_layout(mixtral, 16, ZeroConfig(stage=3))
    assert leaf.leaf_elements_by_layer == {layer: block for layer in range(32)}
    assert zero_layout(mixtral, 16, ZeroConfig(stage=3, leaf_module={"classes": []})).leaf_elements_by_layer == {}
    assert zero_layout(mixtral, 16, ZeroConfig(stage=2)).leaf_elements_by_layer == {}
    # 32 layers of (gate_up_proj, down_proj) stand for 768 expert matrices, in every stage's layout
    stage2 = zero_layout(mixtral, 16, ZeroConfig(stage=2))
    assert len(stage2.tensors) == len(mixtral.tensors) - 768 + 64 - (1 if mixtral.tie_word_embeddings else 0)
    assert sum(t.numel for t in stage2.tensors) == mixtral.params
    training = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=4096, checkpointing="full")
    plans = {name: evaluate(model=mixtral, training=training, zero=ZeroConfig(stage=3, **extra), n_gpus=16)
             for name, extra in (("leaf", {}), ("fused", {"leaf_module": {"classes": []}}))}
    # the backward holds the block's bf16 gradients at its hook; the fused gate_up_proj's without a leaf
    assert max(m.autograd for m in plans["leaf"].memory.backward_moments) >= 2 * block
    assert max(m.autograd for m in plans["fused"].memory.backward_moments) < 2 * block
    assert plans["leaf"].memory.peak > plans["fused"].memory.peak


def test_the_note_says_what_is_gathered_and_reduced_together():
    mixtral = load_model("mixtral-8x7b")
    per_matrix = 4096 * 14336
    assert moe_leaf_block(mixtral, ZeroConfig(stage=3)) == (8 * 4096 + 24 * per_matrix,) * 2
    note = moe_leaf_note(mixtral, ZeroConfig(stage=3), 2, 2)
    assert note is not None and "2.63 GiB per layer" in note and "leaf_module" in note
    assert "reduce_leaf_module_grads" in note and "2.63 GiB of gradients" in note
    # without a leaf: the fused gate_up_proj (gate and up of 8 experts) is the largest gradient held at once
    fused = moe_leaf_note(mixtral, ZeroConfig(stage=3, leaf_module={"classes": []}), 2, 2)
    assert "fuses them" in fused and "1.75 GiB of gradients" in fused  # 16 x 112 MiB
    assert moe_leaf_note(mixtral, ZeroConfig(stage=2), 2, 2) is None
    assert moe_leaf_note(load_model("llama-3-8b"), ZeroConfig(stage=3), 2, 2) is None


def test_check_offers_fetching_the_moe_block_apart_when_memory_is_short(tmp_path):
    """ZP304: Mixtral-8x7B on 16 H100s at 4,096 tokens with full checkpointing peaks at 70.84 GB with the
    default leaf blocks and 70.29 GB without them; with 17.5% kept free only the second fits."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    cfg = tmp_path / "z3.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))

    def findings(headroom: str, extra: dict | None = None) -> dict:
        if extra:
            cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **extra}))
        r = CliRunner().invoke(app, ["check", str(cfg), "--model", "mixtral-8x7b", "--hardware", "dgx-h100", "--gpus",
                                     "16", "--seq-len", "4096", "--checkpointing", "full", "--headroom", headroom,
                                     "--format", "json"])
        assert r.exit_code in (0, 1), r.output
        return {f["rule_id"]: f for f in json.loads(r.stdout)["files"][0]["findings"]}

    zp = findings("0.175")["ZP304"]
    assert zp["severity"] == "warning" and zp["key"] == "zero_optimization.leaf_module"
    assert "70.84 GB" in zp["message"] and "70.29 GB" in zp["message"] and '"classes": []' in zp["message"]
    (alt,) = zp["alternatives"]
    assert alt["change"] == {"leaf_module": "none"} and alt["after"] < alt["before"] and alt["fits"]
    assert "ZP304" not in findings("0.10")  # fits as it is
    # already without leaf classes: nothing to offer
    assert "ZP304" not in findings("0.175", {"zero_optimization": {"stage": 3, "leaf_module": {"classes": []}}})
