"""Reading Accelerate, HF Trainer, axolotl and LLaMA-Factory files (specs/training_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan._util import InputError
from zeroplan.specs.finetune import ALL_LINEAR
from zeroplan.specs.training_files import read_training_file

EX = Path(__file__).resolve().parent.parent / "examples" / "finetune"


def test_accelerate_inline_deepspeed():
    tf = read_training_file("accelerate", EX / "accelerate-zero3.yaml")
    assert (tf.gpus, tf.nodes, tf.precision, tf.grad_accum) == (16, 2, "bf16", 4)
    assert tf.ds_config["zero_optimization"]["stage"] == 3
    assert tf.ds_config["bf16"] == {"enabled": True}
    assert "offload_optimizer" not in tf.ds_config["zero_optimization"]  # device none
    assert "main_process_ip" in tf.ignored_keys and "deepspeed_config.deepspeed_multinode_launcher" in tf.ignored_keys


def test_accelerate_config_file_is_resolved_next_to_the_yaml():
    tf = read_training_file("accelerate", EX / "accelerate-ds-file.yaml")
    assert tf.ds_config == str(EX / "ds-zero3-auto.json")
    assert (tf.gpus, tf.nodes, tf.precision) == (8, 1, "bf16")


def test_hf_trainer_arguments():
    tf = read_training_file("hf-args", EX / "trainer-args.json")
    assert (tf.micro_batch, tf.grad_accum, tf.precision, tf.checkpointing, tf.seq_len, tf.optimizer) == (
        2, 8, "bf16", "full", 4096, "adamw")
    assert tf.ds_config == str(EX / "ds-zero3-auto.json")
    assert {"learning_rate", "output_dir", "num_train_epochs"} <= set(tf.ignored_keys)


def test_axolotl_qlora():
    tf = read_training_file("axolotl", EX / "axolotl-qlora.yml")
    assert tf.model == "meta-llama/Meta-Llama-3-70B"
    assert (tf.seq_len, tf.micro_batch, tf.grad_accum, tf.checkpointing, tf.precision) == (4096, 1, 4, "full", "bf16")
    ft = tf.finetune
    assert ft.method == "qlora" and ft.quant.bits == 4 and ft.lora.r == 32 and ft.lora.targets == ALL_LINEAR
    assert "datasets" in tf.ignored_keys and "learning_rate" in tf.ignored_keys


def test_llama_factory_lora():
    tf = read_training_file("llama-factory", EX / "llama-factory-lora.yaml")
    assert tf.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert (tf.seq_len, tf.micro_batch, tf.grad_accum, tf.precision, tf.checkpointing) == (2048, 1, 8, "bf16", "full")
    assert tf.finetune.method == "lora" and tf.finetune.lora.r == 8 and tf.finetune.lora.targets == ALL_LINEAR


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("fmt,text,needle", [
    # unknown keys
    ("accelerate", "distributed_type: DEEPSPEED\nnum_procesess: 8\n", "unknown key 'num_procesess'"),
    ("accelerate", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 3\n", "unknown key 'zero_stag'"),
    ("axolotl", "base_model: gpt2\nmicro_batch_sise: 4\nmicro_batch_size: 1\n", None),  # both present: not a typo of a missing key
    ("axolotl", "base_model: gpt2\nmicro_batch_sise: 4\n", "did you mean 'micro_batch_size'"),
    ("llama-factory", "model_name_or_path: gpt2\ncutof_len: 4096\n", "did you mean 'cutoff_len'"),
    # missing
    ("axolotl", "adapter: lora\nlora_target_linear: true\n", "base_model is missing"),
    ("llama-factory", "finetuning_type: lora\n", "model_name_or_path is missing"),
    ("axolotl", "base_model: gpt2\nadapter: lora\n", "needs lora_target_modules"),
    # contradictory
    ("accelerate", "distributed_type: DEEPSPEED\nnum_processes: 12\nnum_machines: 5\n", "not divisible"),
    ("accelerate", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: x.json\n  zero_stage: 3\n",
     "Accelerate refuses"),
    ("accelerate", "distributed_type: FSDP\n", "expected DEEPSPEED"),
    ("hf-args", '{"bf16": true, "fp16": true}', "both enabled"),
    ("hf-args", '{"max_seq_length": 1024, "max_length": 2048}', "disagree"),
    ("axolotl", "base_model: gpt2\nload_in_4bit: true\nload_in_8bit: true\n", "at most one"),
    ("axolotl", "base_model: gpt2\nadapter: qlora\nload_in_4bit: false\nlora_target_linear: true\n", "4-bit"),
    ("llama-factory", "model_name_or_path: gpt2\nfinetuning_type: full\nquantization_bit: 4\n", "only train LoRA"),
    # bad values
    ("hf-args", '{"per_device_train_batch_size": 0}', "per_device_train_batch_size = 0"),
    ("hf-args", '{"optim": "lion_magic"}', "optim = 'lion_magic'"),
    ("axolotl", "base_model: gpt2\nadapter: prefix\n", "adapter = 'prefix'"),
    ("llama-factory", "model_name_or_path: gpt2\nquantization_bit: 3\n", "quantization_bit = 3"),
    ("hf-args", "[1, 2]", "expected a mapping"),
    ("axolotl", "base_model: [unclosed\n", "not valid YAML"),
    ("axolotl", "!!python/object/apply:os.system ['true']\n", "not valid YAML"),
    # keys YAML reads as something other than a name (a TypeError in the typo check before)
    ("llama-factory", "model_name_or_path: gpt2\n99999999999999999999999: 2048\n",
     "f.yaml:2:1: not valid YAML (key '99999999999999999999999' reads as an integer"),
    ("axolotl", "base_model: gpt2\ntrue: 1\n", ":2:1: not valid YAML (key 'true' reads as a boolean"),
    ("axolotl", "base_model: gpt2\n2024-01-01: x\n", "key '2024-01-01' reads as a date"),
    ("accelerate", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  1.5: x\n", ":3:3: not valid YAML (key '1.5'"),
    ("llama-factory", "model_name_or_path: gpt2\n~: 1\n", "key '~' reads as null"),
    ("llama-factory", "model_name_or_path: gpt2\n? !!set {a, b}\n: 1\n", ":2:3: not valid YAML (a key that is a set;"),
])
def test_bad_training_files_are_one_line_input_errors(tmp_path, fmt, text, needle):
    p = _write(tmp_path, "f.json" if text.lstrip().startswith(("{", "[")) else "f.yaml", text)
    if needle is None:
        read_training_file(fmt, p)
        return
    with pytest.raises(InputError) as exc:
        read_training_file(fmt, p)
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg and str(p) in msg


def test_an_inline_deepspeed_config_is_named_by_its_file_not_printed(tmp_path):
    """An inline ``deepspeed`` object of an HF Trainer arguments file was named "<config>" in its errors, and its
    whole dict was printed in notes ("seq len 1024 from {'zero_optimization': ...}")."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    args = tmp_path / "args.json"
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "zeroplan": {"seq_len": 1024}}
    args.write_text(json.dumps({"per_device_train_batch_size": 1, "bf16": True, "deepspeed": ds}))
    r = CliRunner().invoke(app, ["estimate", "-m", "llama-2-7b", "--hf-args", str(args)])
    assert r.exit_code == 0, r.output[-600:]
    assert f"seq len 1024 from {args}: its inline DeepSpeed config: zeroplan.seq_len" in " ".join(r.output.split())
    assert "{'zero_optimization'" not in r.output
    ds["zero_optimization"]["stage"] = "three"
    args.write_text(json.dumps({"per_device_train_batch_size": 1, "bf16": True, "deepspeed": ds}))
    r = CliRunner().invoke(app, ["estimate", "-m", "llama-2-7b", "--hf-args", str(args)])
    assert r.exit_code == 2 and f"{args}: its inline DeepSpeed config: DS003 zero_optimization.stage" in r.stderr
