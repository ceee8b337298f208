"""DeepSpeed's stage-3 module hooks on the host (core/host_time.py).

The fetch counts are DeepSpeed's own: examples/validation/stage3-host/run*.json (CPU) and
examples/validation/gpu/h200-2026-11-28/stage3-host-cuda.json (one H200) recorded, by wrapping
``PartitionedParameterCoordinator.fetch_sub_module``, how often DeepSpeed 0.19.8 fetches a module that
owns parameters in one step of transformers' Llama and GPT-2 (2 and 10 layers, with and without
checkpointing); the planner's count must be that, exactly. The time per fetch is the mean of the GPU
node's measurements (the CPU runs' no-op stream and event calls made them a lower bound). Nothing here
times anything.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.core.host_time import STAGE3_FETCH_HOST_S, host_bound_s, stage3_fetches
from zeroplan.core.layout import zero_layout
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import load_model, spec_from_config
from zeroplan.specs.training import TrainingSetup, get_precision

DATA = Path(__file__).resolve().parent.parent / "examples" / "validation" / "stage3-host"
GPU_RUN = DATA.parent / "gpu" / "h200-2026-11-28" / "stage3-host-cuda.json"


def _runs() -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(DATA.glob("run*.json"))]
    assert len(runs) >= 2
    return runs + [json.loads(GPU_RUN.read_text())]


def _tiny(arch: str, layers: int):
    """The models measure.py builds (transformers' defaults elsewhere)."""
    if arch == "llama":
        cfg = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers,
               "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64,
               "tie_word_embeddings": False}
    else:
        cfg = {"model_type": "gpt2", "n_embd": 16, "n_layer": layers, "n_head": 2, "vocab_size": 64, "n_positions": 64}
    return spec_from_config(cfg, f"{arch}-{layers}", "test")


def test_fetch_counts_are_deepspeeds():
    checked = 0
    for run in _runs():
        for r in run["runs"]:
            if r["stage"] != 3:
                continue
            units = zero_layout(_tiny(r["arch"], r["layers"]), 1, ZeroConfig(stage=3)).units
            planned = stage3_fetches(tuple(units), r["checkpointing"])
            measured = {ph: r["fetches_per_step"][ph]["owning_params"] for ph in ("forward", "backward")}
            assert planned == measured, (r["arch"], r["layers"], r["checkpointing"])
            checked += 1
    assert checked >= 24


def test_time_per_fetch_is_the_gpu_nodes_measured_mean():
    gpu = json.loads(GPU_RUN.read_text())
    assert gpu["environment"]["device"] == "cuda" and gpu["environment"]["gpu"].startswith("NVIDIA H200")
    for ph in ("forward", "backward"):
        per_fetch_ms = [v[ph]["ms_per_fetch"] for v in gpu["per_fetch"].values()]
        assert len(per_fetch_ms) == 4  # Llama and GPT-2, with and without checkpointing
        assert STAGE3_FETCH_HOST_S[ph] * 1e3 == pytest.approx(statistics.mean(per_fetch_ms), abs=0.005)
        # the CPU runs, where DeepSpeed's stream and event calls are no-ops, were a lower bound
        cpu_ms = [run["per_fetch"][cfg][ph]["ms_per_fetch"] for run in _runs()[:-1] for cfg in run["per_fetch"]]
        assert statistics.mean(cpu_ms) < statistics.mean(per_fetch_ms)


def test_a_phase_lasts_the_longer_of_gpu_and_host():
    assert host_bound_s({"forward": 0.3, "backward": 0.2}, {"forward": 0.1, "backward": 0.5}) == pytest.approx(0.2)
    assert host_bound_s({"forward": 0.1}, {"forward": 0.1}) == 0.0
    assert host_bound_s({}, {"forward": 1.0}) == 0.0


def _plan(model: str, *, stage: int, gpus: int, micro_batch: int, seq: int, grad_accum: int = 1,
          checkpointing: str = "none"):
    tr = TrainingSetup(precision=get_precision("bf16"), micro_batch=micro_batch, seq_len=seq, grad_accum=grad_accum,
                       checkpointing=checkpointing)
    return evaluate(model=load_model(model), training=tr, zero=ZeroConfig(stage=stage), n_gpus=gpus,
                    hardware=load_profile("dgx-h100"))


def test_a_small_model_on_h100_waits_for_the_host():
    t = _plan("phi-2", stage=3, gpus=8, micro_batch=1, seq=2048).time
    n = stage3_fetches(tuple(zero_layout(load_model("phi-2"), 8, ZeroConfig(stage=3)).units), False)
    assert t.host_time_s == pytest.approx(sum(n[ph] * STAGE3_FETCH_HOST_S[ph] for ph in n))
    assert t.host_bound_s > 0
    assert t.step_time_best_s <= t.step_time_s <= t.step_time_worst_s
    assert any(a.startswith("host-bound: DeepSpeed's stage-3 module hooks") for a in t.assumptions)
    # four times the tokens per hook: the GPU's work outgrows the host's
    assert _plan("phi-2", stage=3, gpus=8, micro_batch=4, seq=2048).time.host_bound_s < t.host_bound_s


def test_large_work_per_module_hides_the_host():
    t = _plan("llama-2-70b", stage=3, gpus=64, micro_batch=1, seq=4096, checkpointing="full").time
    assert t.host_time_s > 0 and t.host_bound_s == 0.0
    assert not any(a.startswith("host-bound") for a in t.assumptions)


def test_only_stage_3_runs_module_hooks_and_each_micro_step_runs_them():
    assert _plan("phi-2", stage=2, gpus=8, micro_batch=1, seq=2048).time.host_time_s == 0.0
    one = _plan("phi-2", stage=3, gpus=8, micro_batch=1, seq=2048).time
    two = _plan("phi-2", stage=3, gpus=8, micro_batch=1, seq=2048, grad_accum=2).time
    assert two.host_time_s == pytest.approx(2 * one.host_time_s)
    ckpt = _plan("phi-2", stage=3, gpus=8, micro_batch=1, seq=2048, checkpointing="full").time
    assert ckpt.host_by_phase_s["backward"] > one.host_by_phase_s["backward"]
    assert ckpt.host_by_phase_s["forward"] == pytest.approx(one.host_by_phase_s["forward"])


def test_check_warns_when_the_gpu_waits_for_the_hooks(tmp_path):
    """ZP303, with twice the micro-batch evaluated; not raised where the hooks hide (70B over 32 GPUs at
    4 × 4096 tokens with full checkpointing, which fits)."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    cfg = tmp_path / "z3.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))

    def findings(*args: str) -> dict:
        r = CliRunner().invoke(app, ["check", str(cfg), "--hardware", "dgx-h100", *args, "--format", "json"])
        assert r.exit_code in (0, 1), r.output
        return {f["rule_id"]: f for f in json.loads(r.stdout)["files"][0]["findings"]}

    small = findings("--model", "phi-2", "--gpus", "8")
    zp = small["ZP303"]
    assert zp["severity"] == "warning" and zp["key"] == "train_micro_batch_size_per_gpu"
    assert "stage-3 module hooks" in zp["message"] and "micro-batch 2" in zp["message"]
    (alt,) = zp["alternatives"]
    assert alt["change"] == {"micro_batch": 2} and alt["after"] > alt["before"]
    big = findings("--model", "llama-2-70b", "--gpus", "32", "--seq-len", "4096", "--micro-batch", "1",
                   "--checkpointing", "full")
    assert "ZP101" not in big and "ZP303" not in big


@functools.lru_cache(maxsize=1)
def _live_lora_counts() -> dict[bool, dict]:
    """DeepSpeed's fetch counts for the PEFT LoRA tiny Llama without and with checkpointing: one process,
    both configurations (measure.py --one takes several), shared by the two cases below."""
    from zeroplan.bench import deepspeed_engine as dse

    if not dse.deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    pytest.importorskip("peft")
    with socket.socket() as sock:  # a free port: other DeepSpeed tests may run beside this one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [a for ck in (False, True) for a in ("3", "llama-lora", "2", str(int(ck)), "cpu")]
    out = subprocess.run([sys.executable, str(DATA / "measure.py"), "--one", *args], capture_output=True, text=True,
                         timeout=300, check=True, env=dict(os.environ, MASTER_PORT=str(port)))
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"stage"')]
    return {r["checkpointing"]: r["fetches_per_step"] for r in rows}


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("ckpt", [False, True])
def test_lora_fetch_counts_are_deepspeeds_live(ckpt):
    """PEFT LoRA (r=4 on q_proj, v_proj) on the tiny Llama, run by DeepSpeed now (measure.py's harness,
    counts only). Without checkpointing the frozen embedding and the first layer's frozen modules are
    not fetched in backward (24 of 29); with it transformers' enable_input_require_grads makes every
    output need a gradient (55 = 29 + the recomputation's 26)."""
    from zeroplan.core.finetune import backward_skips, finetune_views
    from zeroplan.core.stage3_live import replay_inputs
    from zeroplan.specs.finetune import FineTune, LoraSpec

    measured = _live_lora_counts()[ckpt]
    views = finetune_views(_tiny("llama", 2), FineTune(method="lora", lora=LoraSpec(r=4, targets=("q_proj", "v_proj"))),
                           2)
    layout = zero_layout(views.full, 1, ZeroConfig(stage=3))
    units = replay_inputs(layout, layout, backward_skips(views, "full" if ckpt else "none"))[3]  # backward flags
    planned = stage3_fetches(units, ckpt)
    assert planned == {ph: measured[ph]["owning_params"] for ph in ("forward", "backward")}
    assert planned["backward"] == (55 if ckpt else 24)
