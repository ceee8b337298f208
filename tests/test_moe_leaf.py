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
from zeroplan.core.moe_leaf import largest_module_params, moe_fetch_groups, moe_leaf_block, moe_leaf_note
from zeroplan.core.stage3_fetch import micro_step_events
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model, spec_from_config

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


def _fetched(*leaf: str) -> tuple[list[list[tuple[str, int, bool]]], list[int]]:
    """Per configuration (a leaf_module JSON block or "default"), the modules fetched in one micro-step:
    (name, elements, forward); and DeepSpeed's estimators' (total, largest_layer_params) of the model."""
    from zeroplan.bench import deepspeed_engine as dse

    if not dse.deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, str(PROBE), *leaf], capture_output=True, text=True, timeout=300,
                         check=True, env=dict(os.environ, MASTER_PORT=str(port)))
    runs: list[list[tuple[str, int, bool]]] = [[] for _ in leaf]
    estimator: list[int] = []
    for line in out.stdout.splitlines():
        if line.startswith("ESTIMATOR "):
            estimator = json.loads(line[10:])
        if line.startswith("FETCH "):  # not DeepSpeed's log lines
            index, name, numel, forward = json.loads(line[6:])
            runs[index].append((name, numel, forward))
    return runs, estimator


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
    fetched, estimator = _fetched(*(v if isinstance(v, str) else json.dumps(v) for v in LEAVES.values()))
    runs = dict(zip(LEAVES, fetched))
    for key, leaf in LEAVES.items():
        zero = ZeroConfig(stage=3) if leaf == "default" else ZeroConfig(stage=3, leaf_module=leaf)
        assert [(n, f) for _, n, f in runs[key]] == _planned(spec, zero), key
    # a leaf block is fetched whole and none of its children; without one the fused experts are one fetch
    assert ("model.layers.0.mlp", ROUTER + EXPERTS, True) in runs["default"]
    assert not [n for n, _, _ in runs["default"] if n.startswith("model.layers.0.mlp.")]
    assert {n: k for n, k, _ in runs["none"]}["model.layers.0.mlp.experts"] == EXPERTS
    # DeepSpeed's estimators read the fused experts module as the largest layer (the plan's estimator row)
    assert estimator == [spec.params, largest_module_params(spec)] == [spec.params, EXPERTS]
    # the bundled runtime's module tree (one module per expert matrix) is fetched module by module
    per_module = _planned(spec.model_copy(update={"module_tree": "checkpoint"}), ZeroConfig(stage=3))
    assert len(per_module) == len(_planned(spec, ZeroConfig(stage=3))) + 2 * (4 * 3 + 1 - 1)


def test_groups_follow_the_leaf_configuration():
    spec = spec_from_config(TINY, "mixtral-tiny", "test")
    block = "model.layers.0.block_sparse_moe"
    leaf = moe_fetch_groups(spec, ZeroConfig(stage=3))
    assert leaf[f"{block}.gate"] == block and leaf[f"{block}.experts.3.w2"] == block and len(leaf) == 13
    fused = moe_fetch_groups(spec, ZeroConfig(stage=3, leaf_module={"classes": []}))
    assert f"{block}.gate" not in fused and set(fused.values()) == {f"{block}.experts"}
    assert moe_fetch_groups(load_model("llama-3-8b"), ZeroConfig(stage=3)) == {}
    assert moe_fetch_groups(spec.model_copy(update={"module_tree": "checkpoint"}), ZeroConfig(stage=3)) == {}


def test_the_note_says_how_much_gradient_the_plan_may_miss():
    mixtral = load_model("mixtral-8x7b")
    per_matrix = 4096 * 14336
    assert moe_leaf_block(mixtral, ZeroConfig(stage=3)) == (8 * 4096 + 24 * per_matrix,) * 2 + (per_matrix,)
    note = moe_leaf_note(mixtral, ZeroConfig(stage=3), 2, 2)
    assert note is not None and "2.63 GiB per layer" in note and "up to 2.52 GiB low" in note
    assert "leaf_module" in note and "reduce_leaf_module_grads" in note
    # without a leaf: the fused gate_up_proj (gate and up of 8 experts) is the largest gradient held at once
    fused = moe_leaf_note(mixtral, ZeroConfig(stage=3, leaf_module={"classes": []}), 2, 2)
    assert "fused" in fused and "up to 1.64 GiB low" in fused  # (16 - 1) x 112 MiB
    assert moe_leaf_note(mixtral, ZeroConfig(stage=2), 2, 2) is None
    assert moe_leaf_note(load_model("llama-3-8b"), ZeroConfig(stage=3), 2, 2) is None
