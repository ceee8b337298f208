"""Values DeepSpeed 0.19.8 refuses at start-up though their key is known: a present section that is not
an object (``"scheduler": null``: ``DeepSpeedConfig`` dereferences it and raises TypeError/AttributeError),
a scalar it cannot use (``"wall_clock_breakdown": "1"`` is or-ed with a bool), the fp16 loss-scale
validators of ``DeepSpeedFP16Config``, and a number beyond the float range (hjson raises OverflowError).

Each is a user error. ``estimate`` exits 2 with one line naming the file, the key path and the value, and no
traceback; ``load_ds_config(strict=True)`` raises InputError; ``check`` reports an error finding on the key
(and fails: exit 1, its contract being 0 pass / 1 fail / 2 bad command line). Configs DeepSpeed accepts
(dynamic loss scaling, HF Trainer "auto" values, ``"bf16": null``) stay accepted. Where DeepSpeed is
installed, every verdict here is also checked against ``DeepSpeedConfig`` itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from zeroplan._util import InputError
from zeroplan.cli import app
from zeroplan.specs.deepspeed_config import load_ds_config, parse_ds_json
from zeroplan.specs.ds_keys import TOP_LEVEL_KEYS
from zeroplan.specs.ds_shapes import AT_INITIALIZE, SCALARS, SECTIONS, SUBKEYS

runner = CliRunner()
EX = Path(__file__).resolve().parent.parent / "examples" / "configs"
BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}

# name -> (the keys over BASE, the key path the message must name, the value as the message writes it)
REFUSED: dict[str, tuple[dict[str, Any], str, str]] = {
    "zero_optimization null": ({"zero_optimization": None}, "zero_optimization", "null"),
    "fp16 null": ({"fp16": None}, "fp16", "null"),
    "optimizer null": ({"optimizer": None}, "optimizer", "null"),
    "scheduler null": ({"scheduler": None}, "scheduler", "null"),
    "activation_checkpointing null": ({"activation_checkpointing": None}, "activation_checkpointing", "null"),
    "checkpoint null": ({"checkpoint": None}, "checkpoint", "null"),
    "data_types null": ({"data_types": None}, "data_types", "null"),
    "bfloat16 null": ({"bfloat16": None}, "bfloat16", "null"),
    "scheduler list": ({"scheduler": [{"type": "WarmupLR"}]}, "scheduler", '[{"type": "WarmupLR"}]'),
    "scheduler bool": ({"scheduler": True}, "scheduler", "true"),
    "scheduler string": ({"scheduler": "WarmupLR"}, "scheduler", '"WarmupLR"'),
    "checkpoint number": ({"checkpoint": 1.5}, "checkpoint", "1.5"),
    "checkpoint list": ({"checkpoint": []}, "checkpoint", "[]"),
    "data_types string": ({"data_types": "bf16"}, "data_types", '"bf16"'),
    "data_types bool": ({"data_types": False}, "data_types", "false"),
    "tensorboard null": ({"tensorboard": None}, "tensorboard", "null"),
    "compile string": ({"compile": "yes"}, "compile", '"yes"'),
    "torch_autocast bool": ({"torch_autocast": True}, "torch_autocast", "true"),
    "wall_clock_breakdown string": ({"wall_clock_breakdown": "1"}, "wall_clock_breakdown", '"1"'),
    "wall_clock_breakdown list": ({"wall_clock_breakdown": [True]}, "wall_clock_breakdown", "[true]"),
    "wall_clock_breakdown object": ({"wall_clock_breakdown": {}}, "wall_clock_breakdown", "{}"),
    "wall_clock_breakdown float": ({"wall_clock_breakdown": 1.5}, "wall_clock_breakdown", "1.5"),
    "flops_profiler.enabled string": ({"flops_profiler": {"enabled": "true"}}, "flops_profiler.enabled", '"true"'),
    "seq_parallel dtype string": ({"seq_parallel_communication_data_type": "1"},
                                  "seq_parallel_communication_data_type", '"1"'),
    "seq_parallel dtype number": ({"seq_parallel_communication_data_type": 16},
                                  "seq_parallel_communication_data_type", "16"),
    "gradient_allreduce_op null": ({"gradient_allreduce_op": None}, "gradient_allreduce_op", "null"),
    "gradient_allreduce_op avg": ({"gradient_allreduce_op": "avg"}, "gradient_allreduce_op", '"avg"'),
    "gradient_allreduce_op sum at stage 3": ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
                                             "gradient_allreduce_op", '"sum"'),
    "gradient_allreduce_op sum with ZenFlow": ({"gradient_allreduce_op": "sum",
                                                "zero_optimization": {"stage": 2, "zenflow": {}}},
                                               "gradient_allreduce_op", '"sum"'),
    "gradient_allreduce_op sum with DeepCompile": ({"gradient_allreduce_op": "Sum", "compile": {"deepcompile": "yes"}},
                                                   "gradient_allreduce_op", '"Sum"'),
    "checkpoint.tag_validation": ({"checkpoint": {"tag_validation": "strict"}}, "checkpoint.tag_validation",
                                  '"strict"'),
    "vocabulary_size string": ({"vocabulary_size": "32000"}, "vocabulary_size", '"32000"'),
    "fp16 loss_scale -1": ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale", "-1"),
    "fp16 loss_scale inf": ({"fp16": {"enabled": True, "loss_scale": "inf"}}, "fp16.loss_scale", '"inf"'),
    "fp16 min_loss_scale 0": ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", "0"),
    "fp16 loss_scale_window 0": ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window",
                                 "0"),
    "fp16 loss_scale_window -5": ({"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": -5}},
                                  "fp16.loss_scale_window", "-5"),
    "fp16 min_loss_scale bool": ({"fp16": {"enabled": False, "min_loss_scale": True}}, "fp16.min_loss_scale",
                                 "true"),
    "fp16 loss_scale_window bool": ({"fp16": {"loss_scale_window": False}}, "fp16.loss_scale_window", "false"),
    "train_batch_size false": ({"train_batch_size": False}, "train_batch_size", "false"),
    "timers.throughput null": ({"timers": {"throughput": None}}, "timers.throughput", "null"),
    "timers.throughput.enabled null": ({"timers": {"throughput": {"enabled": None}}}, "timers.throughput.enabled",
                                       "null"),
    "data_types.keep_in_fp32_modules string": ({"data_types": {"keep_in_fp32_modules": "norm"}},
                                               "data_types.keep_in_fp32_modules", '"norm"'),
}

# Configs DeepSpeed accepts as written: no error finding, strict reading passes, estimate plans them.
ACCEPTED: dict[str, dict[str, Any]] = {
    "fp16 dynamic loss scaling": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                           "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}},
    "fp16 static loss scale ignores the dynamic bounds": {"fp16": {"enabled": True, "loss_scale": 128,
                                                                   "loss_scale_window": 0, "min_loss_scale": 0}},
    "fp16 disabled ignores the dynamic bounds": {"fp16": {"enabled": False, "min_loss_scale": 0}},
    "fp16 auto values dropped": {"fp16": {"enabled": True, "loss_scale": "auto", "loss_scale_window": "auto",
                                          "min_loss_scale": "auto"}},
    "bf16 null": {"bf16": None},
    "bf16 null falls back to bfloat16": {"bf16": None, "bfloat16": {"enabled": True}},
    "bfloat16 unread next to bf16": {"bf16": {"enabled": True}, "bfloat16": "ignored"},
    "deprecated boolean zero_optimization": {"zero_optimization": True},
    "empty sections": {"optimizer": {}, "scheduler": {}, "checkpoint": {}, "data_types": {}, "fp16": {},
                       "activation_checkpointing": {}, "pipeline": {}},
    "aio null and empty expert_parallel": {"aio": None, "expert_parallel": None},
    "monitor auto": {"wandb": "auto", "tensorboard": {"enabled": False}},
    "wall_clock_breakdown int and flops_profiler": {"wall_clock_breakdown": 1, "flops_profiler": {"enabled": 0}},
    "dtype and op in upper case": {"communication_data_type": "BF16", "seq_parallel_communication_data_type": "fp32",
                                   "gradient_allreduce_op": "SUM", "checkpoint": {"tag_validation": "warn"}},
    "vocabulary_size": {"vocabulary_size": 50257},
    "gradient_allreduce_op sum, DeepCompile auto": {"gradient_allreduce_op": "sum", "compile": {"deepcompile": "auto"}},
    "timers and data_types": {"timers": {"throughput": {"enabled": False, "synchronized": "auto"}},
                              "data_types": {"grad_accum_dtype": None, "keep_in_fp32_modules": ["norm"]}},
}


def _cfg(body: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, **body}


def _write(tmp_path: Path, body: dict[str, Any]) -> Path:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(_cfg(body), indent=2) + "\n")
    return p


def _line_of(path: Path, key: str) -> int:
    leaf = key.split(".")[-1]
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if f'"{leaf}"' in ln)


def _errors(cfg: dict[str, Any]) -> list[Any]:
    return [f for f in load_ds_config(cfg, world_size=1).findings if f.severity == "error"]


# ----------------------------------------------------------------------------------- refused configs

@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_value_is_an_error_finding_on_its_key(case):
    body, key, value = REFUSED[case]
    errors = _errors(_cfg(body))
    assert [f.key for f in errors] == [key], [(f.key, f.message) for f in errors]
    assert f"{key} = {value}" in errors[0].message and "expected" in errors[0].message


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_value_raises_input_error_when_strict(case):
    body, key, value = REFUSED[case]
    with pytest.raises(InputError) as exc:
        load_ds_config(_cfg(body), strict=True, world_size=1)
    msg = str(exc.value)
    assert f"{key} = {value}" in msg and "expected" in msg
    assert "coerces" not in msg  # DeepSpeed refuses it: not a value it would coerce and use


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_estimate_exits_2_naming_file_line_key_and_value(tmp_path, case):
    body, key, value = REFUSED[case]
    path = _write(tmp_path, body)
    r = runner.invoke(app, ["estimate", "-m", "gpt2", "-c", str(path)])
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert f"{path}:{_line_of(path, key)}:" in lines[0]
    assert f"{key} = {value}" in lines[0] and "expected" in lines[0]


@pytest.mark.parametrize("case", ["zero_optimization null", "fp16 null", "scheduler list", "data_types bool",
                                  "wall_clock_breakdown string", "seq_parallel dtype string",
                                  "fp16 loss_scale -1", "fp16 min_loss_scale 0", "fp16 loss_scale_window 0"])
def test_check_fails_with_the_error_on_the_key(tmp_path, case):
    body, key, value = REFUSED[case]
    path = _write(tmp_path, body)
    r = runner.invoke(app, ["check", str(path), "-m", "gpt2", "-H", "dgx-h100", "--fail-on", "warning",
                            "--format", "json"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    rep = json.loads(r.stdout)
    errors = [f for f in rep["files"][0]["findings"] if f["severity"] == "error"]
    assert [(f["key"], f["line"]) for f in errors] == [(key, _line_of(path, key))]
    assert rep["verdict"] == "fail"


# ----------------------------------------------------------------------------------- accepted configs

@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_config_deepspeed_accepts_stays_accepted(tmp_path, case):
    cfg = load_ds_config(_cfg(ACCEPTED[case]), strict=True, world_size=8)
    assert not cfg.errors
    r = runner.invoke(app, ["estimate", "-m", "gpt2", "-c", str(_write(tmp_path, ACCEPTED[case])), "--json"])
    assert r.exit_code == 0, r.output


def test_bf16_null_reads_the_legacy_bfloat16_block_as_deepspeed_does():
    # get_bfloat16_config: bf16 null -> param_dict.get("bfloat16", {})
    cfg = load_ds_config(_cfg({"bf16": None, "bfloat16": {"enabled": True}}), world_size=1)
    assert cfg.precision == "bf16"
    assert [(f.rule_id, f.key) for f in cfg.findings] == [("DS002", "bfloat16")]


def test_hf_trainer_auto_config_with_fp16_passes(tmp_path):
    path = EX / "hf-zero3-auto.json"
    args = ["-m", "gpt2", "-c", str(path), "-p", "fp16", "--micro-batch", "2", "--grad-accum", "1", "--json"]
    r = runner.invoke(app, ["estimate", *args])
    assert r.exit_code == 0, r.output
    cfg = load_ds_config(path, strict=True, hidden_size=768, micro_batch=2, grad_accum=1, world_size=8,
                         precision="fp16")
    assert cfg.precision == "fp16" and not cfg.errors


def test_fp16_enabled_by_the_hf_trainer_gets_the_dynamic_loss_scale_check():
    body = {"fp16": {"enabled": "auto", "min_loss_scale": 0}}
    assert not _errors(_cfg(body))  # no precision given: "auto" is not filled, DeepSpeed drops it -> disabled
    cfg = load_ds_config(_cfg(body), world_size=1, precision="fp16")  # HF fills enabled=true from --fp16
    assert [f.key for f in cfg.errors] == ["fp16.min_loss_scale"]


def test_null_micro_batch_is_read_as_absent():
    # get_scalar_param returns the null, which DeepSpeed's fill-in rule treats as "not given"
    cfg = load_ds_config({"train_micro_batch_size_per_gpu": None, "zero_optimization": {"stage": 2}}, world_size=1)
    absent = load_ds_config({"zero_optimization": {"stage": 2}}, world_size=1)
    assert [(f.rule_id, f.severity) for f in cfg.findings] == [(f.rule_id, f.severity) for f in absent.findings]
    assert [f.rule_id for f in cfg.findings] == ["DS008"]


# ----------------------------------------------------------------------------------- numbers out of range

@pytest.mark.parametrize("text,key,line,col", [
    ('{\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {\n    "stage": 1e400\n  }\n}\n',
     "zero_optimization.stage", 4, 14),
    ('{\n  "train_micro_batch_size_per_gpu": 1,\n  "foo": -2.5E+400\n}\n', "foo", 3, 10),
    ('// hjson\n{\n  train_micro_batch_size_per_gpu: 1\n  bar: [1, {"x": 1e999}]\n}\n', "bar[1].x", 4, 18),
    ('{"train_micro_batch_size_per_gpu": 1, "baz": 1' + "0" * 5000 + "}", "baz", 1, 46),
])
def test_number_out_of_range_names_key_line_and_column(tmp_path, text, key, line, col):
    with pytest.raises(InputError) as exc:
        parse_ds_json(text, "f.json")
    msg = str(exc.value)
    assert msg.startswith(f"f.json: line {line} column {col}: {key} = "), msg
    assert "beyond" in msg and "\n" not in msg
    path = tmp_path / "ds.json"
    path.write_text(text)
    r = runner.invoke(app, ["estimate", "-m", "gpt2", "-c", str(path)])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and f"line {line} column {col}: {key} = " in r.stderr
    r = runner.invoke(app, ["check", str(path), "-m", "gpt2", "-H", "dgx-h100", "--format", "json"])
    assert r.exit_code == 1, r.output
    (finding,) = json.loads(r.stdout)["files"][0]["findings"]
    assert finding["rule_id"] == "ZP000" and finding["line"] == line and key in finding["message"]


def test_tiny_and_large_finite_numbers_still_parse():
    data, _ = parse_ds_json('{"a": 1e-400, "b": 1e308, "c": 9223372036854775807}', "f.json")
    assert data == {"a": 0, "b": 1e308, "c": 2**63 - 1}


# ----------------------------------------------------------------------------------- the tables

def test_every_shape_is_for_a_key_deepspeed_reads():
    assert set(SECTIONS) <= TOP_LEVEL_KEYS
    assert {path.split(".")[0] for path in [*SCALARS, *AT_INITIALIZE, *SUBKEYS]} <= TOP_LEVEL_KEYS
    assert all(shape.deepspeed for shape in [*SECTIONS.values(), *SCALARS.values(), *AT_INITIALIZE.values()])
    for path, (known, _, deepspeed) in SUBKEYS.items():  # each checked leaf is a key its block lists
        assert deepspeed and {p.rsplit(".", 1)[1] for p in [*SCALARS, *AT_INITIALIZE]
                              if p.rsplit(".", 1)[0] == path} <= known


# ----------------------------------------------------------------------------------- against DeepSpeed itself

@pytest.fixture(scope="module")
def deepspeed_config_cls():
    ds = pytest.importorskip("deepspeed.runtime.config")
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    return ds.DeepSpeedConfig


def _deepspeed_accepts(cls: Any, cfg: dict[str, Any]) -> bool:
    try:
        cls(json.loads(json.dumps(cfg)))  # no process group: world size 1
    except Exception:  # noqa: BLE001 - DeepSpeed raises TypeError/AttributeError/ValueError/ValidationError
        return False
    return True


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_deepspeed_itself_refuses_each_refused_case(deepspeed_config_cls, case):
    assert not _deepspeed_accepts(deepspeed_config_cls, _cfg(REFUSED[case][0]))


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_deepspeed_itself_accepts_each_accepted_case(deepspeed_config_cls, case):
    assert _deepspeed_accepts(deepspeed_config_cls, _cfg(ACCEPTED[case]))


# shapes only: the keys inside a section are not what these tables check
_ODD_VALUES = [None, "auto", "", "x", "FP16", [], [1], {}, True, False, 0, 1, -1, 1.5]


def _with(path: str, value: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(BASE))
    *parents, leaf = path.split(".")
    block = cfg
    for p in parents:
        block = block.setdefault(p, {})
    block[leaf] = value
    return cfg


@pytest.mark.deepspeed
@pytest.mark.parametrize("path", sorted([*SECTIONS, *SCALARS]))
def test_same_verdict_as_deepspeed_for_every_shaped_key(deepspeed_config_cls, path):
    """Each key of the tables set to each odd value: zeroplan reports an error on that key exactly when
    DeepSpeedConfig raises."""
    mismatches = []
    for value in _ODD_VALUES:
        cfg = _with(path, value)
        theirs = _deepspeed_accepts(deepspeed_config_cls, cfg)
        errors = _errors(cfg)
        ours = not errors
        if theirs != ours or (errors and path not in {f.key for f in errors}):
            mismatches.append((value, "DeepSpeed accepts" if theirs else "DeepSpeed refuses",
                               [(f.key, f.message) for f in errors]))
    assert not mismatches, mismatches
