"""MoE blocks DeepSpeed gathers whole under ZeRO-3 with transformers 5 (core/moe_leaf.py): what DeepSpeed
0.19.8 fetches in one forward of transformers' tiny Mixtral (tests/ds_moe_leaf_probe.py), and the
plan's note that its per-expert gathers under-state that block. Counts only, no timing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.core.moe_leaf import moe_leaf_block, moe_leaf_note
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model, spec_from_config

PROBE = Path(__file__).resolve().parent / "ds_moe_leaf_probe.py"
TINY = {"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}


def _fetched(*leaf: str) -> list[list[tuple[str, int]]]:
    """Per configuration (a leaf_module JSON block or "default"), the modules fetched in one forward."""
    from zeroplan.bench import deepspeed_engine as dse

    if not dse.deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, str(PROBE), *leaf], capture_output=True, text=True, timeout=300,
                         check=True, env=dict(os.environ, MASTER_PORT=str(port)))
    runs: list[list[tuple[str, int]]] = [[] for _ in leaf]
    for line in out.stdout.splitlines():
        if line.startswith("[") and not line.startswith("[2"):  # not DeepSpeed's dated log lines
            index, name, numel = json.loads(line)
            runs[index].append((name, numel))
    return runs


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_gathers_the_moe_block_whole():
    spec = spec_from_config(TINY, "mixtral-tiny", "test")
    whole, largest = moe_leaf_block(spec, ZeroConfig(stage=3))
    assert (whole, largest) == (64 + 4 * 3 * 16 * 32, 16 * 32)  # router + 4 experts of 3 matrices
    by_default, no_leaf_run = _fetched("default", json.dumps({"classes": []}))
    assert ("model.layers.0.mlp", whole) in by_default
    assert not [n for n, _ in by_default if n.startswith("model.layers.0.mlp.")]  # a leaf: no child is fetched
    no_leaf = dict(no_leaf_run)
    assert no_leaf["model.layers.0.mlp.experts"] == whole - 64  # every expert in one fused module
    assert no_leaf["model.layers.0.mlp.gate"] == 64


def test_the_note_says_how_much_the_plan_may_be_low():
    mixtral = load_model("mixtral-8x7b")
    note = moe_leaf_note(mixtral, ZeroConfig(stage=3), 2)
    assert note is not None and "2.63 GiB per layer" in note and "up to 2.52 GiB low" in note
    assert "leaf_module" in note
    assert "fuses the experts" in moe_leaf_note(mixtral, ZeroConfig(stage=3, leaf_module={"classes": []}), 2)
    assert moe_leaf_note(mixtral, ZeroConfig(stage=2), 2) is None
    assert moe_leaf_note(load_model("llama-3-8b"), ZeroConfig(stage=3), 2) is None
