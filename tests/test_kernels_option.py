"""``--kernels`` (core/elementwise.py): how the element-wise kernels run, from the CLI, the API and a
DeepSpeed config's ``zeroplan`` block, and what it changes in the plan."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import zeroplan
from zeroplan._util import InputError
from zeroplan.cli import app
from zeroplan.core.ds_config_inputs import annotate_ds_config
from zeroplan.core.inputs import build_plan_inputs

runner = CliRunner()
BASE = ["estimate", "-m", "llama-2-7b", "-H", "dgx-h100", "-g", "8", "-p", "bf16", "--micro-batch", "4",
        "--seq-len", "4096", "--stage", "3", "--json"]


def _estimate(*extra: str) -> dict:
    r = runner.invoke(app, BASE + list(extra))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_unfused_code_takes_longer_and_says_so():
    runs = {k: _estimate("--kernels", k) for k in ("fused", "unfused", "unfused-amp")}
    times = {k: d["stages"][0]["time"] for k, d in runs.items()}
    for k, d in runs.items():
        assert d["training"]["kernels"] == k
    ew = {k: t["compute"]["elementwise_time_s"] for k, t in times.items()}
    # transformers' Llama block moves 239·h bytes per token and layer op by op, 328·h under autocast, vs 42·h fused
    assert ew["fused"] < ew["unfused"] < ew["unfused-amp"]
    assert 4 < ew["unfused"] / ew["fused"] < 8
    assert times["fused"]["step_time_s"] < times["unfused"]["step_time_s"] < times["unfused-amp"]["step_time_s"]
    # the memory plan does not depend on it
    assert runs["fused"]["stages"][0]["memory"] == runs["unfused"]["stages"][0]["memory"]
    src = times["unfused"]["compute"]["source"]
    assert "unfused: transformers' code op by op" in src and "239·h" in src
    assert "fused kernels: 42·h" in times["fused"]["compute"]["source"]
    assert "element-wise kernels: unfused (from --kernels)" in runs["unfused"]["assumptions"]


def test_the_default_is_fused():
    assert _estimate()["training"]["kernels"] == "fused"


def test_amp_in_fp32_training_is_plain_fp32():
    # autocast to a 16-bit type is what "unfused-amp" adds; fp32 training has no autocast
    fp32 = [a if a != "bf16" else "fp32" for a in BASE]
    runs = [json.loads(runner.invoke(app, fp32 + ["--kernels", k]).stdout)["stages"][0]["time"] for k in
            ("unfused", "unfused-amp")]
    assert runs[0]["step_time_s"] == runs[1]["step_time_s"]
    assert "autocast off in fp32 training" in runs[1]["compute"]["source"]


def test_an_unknown_value_is_one_line_and_exit_2():
    for cmd in (BASE, ["recommend", "-m", "llama-2-7b", "-H", "dgx-h100", "-g", "8"]):
        r = runner.invoke(app, cmd + ["--kernels", "triton"])
        assert r.exit_code == 2
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "--kernels 'triton'" in lines[0] and "fused, unfused, unfused-amp" in lines[0]


def test_the_api_takes_it():
    fused = zeroplan.estimate(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", stage=2)
    unfused = zeroplan.estimate(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", stage=2,
                                kernels="unfused")
    assert unfused.training["kernels"] == "unfused"
    assert unfused.stages[0].step_time_s > fused.stages[0].step_time_s


def test_a_config_records_it_and_check_reads_it_back(tmp_path):
    # recommend --emit-config writes what it planned; a fused plan writes no key
    out = annotate_ds_config({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3}},
                             seq_len=4096, checkpointing="none", flash_attention=True, model="llama-2-7b",
                             hardware="dgx-h100", n_gpus=8, kernels="unfused-amp")
    assert out["zeroplan"]["kernels"] == "unfused-amp"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(out))
    inp = build_plan_inputs(model="llama-2-7b", ds_config=str(path), gpus=8)
    assert inp.training.kernels == "unfused-amp"
    assert any(f"element-wise kernels: unfused-amp (from {path}: zeroplan.kernels)" in a for a in inp.assumptions)
    # the option wins over the file
    assert build_plan_inputs(model="llama-2-7b", ds_config=str(path), gpus=8, kernels="fused").training.kernels == "fused"
    plain = annotate_ds_config({}, seq_len=1024, checkpointing="none", flash_attention=True, model="m",
                               hardware=None, n_gpus=1, kernels="fused")
    assert "kernels" not in plain["zeroplan"]


def test_a_bad_value_in_the_config_names_the_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zeroplan": {"kernels": "fast"}}))
    with pytest.raises(InputError, match=r'zeroplan\.kernels = "fast": expected fused, unfused, unfused-amp'):
        build_plan_inputs(model="llama-2-7b", ds_config=str(path), gpus=8)


def test_recommend_emits_the_kernels_it_planned(tmp_path):
    target = tmp_path / "ds.json"
    r = runner.invoke(app, ["recommend", "-m", "llama-2-7b", "-H", "dgx-h100", "-g", "8", "-p", "bf16",
                            "--kernels", "unfused", "--emit-config", str(target)])
    assert r.exit_code == 0, r.output
    assert json.loads(target.read_text())["zeroplan"]["kernels"] == "unfused"


# ----------------------------------------------------------------------------- training files
HF_ARGS = "per_device_train_batch_size: 2\nbf16: true\nmax_seq_length: 4096\n"
AXOLOTL = "base_model: meta-llama/Llama-2-7b-hf\nsequence_len: 2048\nmicro_batch_size: 1\nbf16: auto\n"
LLAMA_FACTORY = "model_name_or_path: meta-llama/Llama-2-7b-hf\nfinetuning_type: full\ncutoff_len: 1024\nbf16: true\n"


@pytest.mark.parametrize("flag,body,fusing", [
    ("hf_args", HF_ARGS, "use_liger_kernel: true\n"),
    ("hf_args", HF_ARGS, "torch_compile: true\n"),
    ("axolotl", AXOLOTL, "liger_rms_norm: true\n"),
    ("llama_factory", LLAMA_FACTORY, "enable_liger_kernel: true\n"),
])
def test_a_training_file_runs_transformers_code_fused_only_with_liger_or_compile(tmp_path, flag, body, fusing):
    # the HF Trainer, axolotl and LLaMA-Factory run transformers' modeling code: op by op unless Liger's
    # kernels or torch.compile are switched on in the file
    plain, fused = tmp_path / "plain.yaml", tmp_path / "fused.yaml"
    plain.write_text(body)
    fused.write_text(body + fusing)
    kw = {"model": None if flag != "hf_args" else "llama-2-7b", "gpus": 8}
    a = build_plan_inputs(**kw, **{flag: str(plain)})
    b = build_plan_inputs(**kw, **{flag: str(fused)})
    assert (a.training.kernels, b.training.kernels) == ("unfused", "fused")
    assert any("element-wise kernels: unfused" in x and "none of" in x for x in a.assumptions)
    key = fusing.split(":")[0]
    assert any(f"element-wise kernels: fused (from {fused}: {key})" in x for x in b.assumptions)
    # the option wins over the file
    assert build_plan_inputs(**kw, kernels="unfused-amp", **{flag: str(fused)}).training.kernels == "unfused-amp"


def test_a_non_boolean_switch_names_the_key(tmp_path):
    f = tmp_path / "args.yaml"
    f.write_text(HF_ARGS + "use_liger_kernel: sometimes\n")
    with pytest.raises(InputError, match="use_liger_kernel = 'sometimes'; expected true or false"):
        build_plan_inputs(model="llama-2-7b", gpus=8, hf_args=str(f))


def test_an_accelerate_config_says_nothing_about_the_model_code(tmp_path):
    f = tmp_path / "accelerate.yaml"
    f.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\nmixed_precision: bf16\n")
    assert build_plan_inputs(model="llama-2-7b", accelerate_config=str(f)).training.kernels == "fused"


def test_recommend_says_what_fusing_would_save():
    kw = dict(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", seq_len=4096)
    unfused = zeroplan.recommend(**kw, kernels="unfused")
    said = [e for e in unfused.explanation if e.startswith("Element-wise kernels run op by op (unfused")]
    assert len(said) == 1 and "Liger's kernels or torch.compile fuse them" in said[0]
    # the saving it quotes is the fused plan's: 42·h against transformers' 239·h per token and layer
    t = unfused.plan.time
    fused_plan = zeroplan.estimate(**kw, stage=unfused.chosen.stage, micro_batch=unfused.chosen.micro_batch,
                                   checkpointing=unfused.chosen.checkpointing).stages[0].time
    assert f"fuse them to about {fused_plan.compute.elementwise_time_s * 1e3:.1f} ms" in said[0]
    assert t.compute.elementwise_time_s > 4 * fused_plan.compute.elementwise_time_s
    assert not any(e.startswith("Element-wise kernels") for e in zeroplan.recommend(**kw).explanation)
