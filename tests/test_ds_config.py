"""DeepSpeed config reader/writer: defaults, aliases, findings, "auto", batch rule, round trip.

Expected values come from DeepSpeed 0.19.8's published defaults (shared/reference/
deepspeed-internals.md §3, DeepSpeed's config docs), the HF Trainer's "auto" formulas written
out here, and — when DeepSpeed is installed — DeepSpeed's own pydantic models.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan._util import InputError
from zeroplan.specs.deepspeed_config import (
    ABSENT,
    RULES,
    DSConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    build_ds_config,
    diff_ds_configs,
    load_ds_config,
    parse_ds_json,
    write_ds_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def rules(cfg: DSConfig, severity: str | None = None) -> list[str]:
    return [f.rule_id for f in cfg.findings if severity is None or f.severity == severity]


def finding(cfg: DSConfig, rule: str, key_part: str = "") -> object:
    hits = [f for f in cfg.findings if f.rule_id == rule and key_part in f.key]
    assert hits, f"no {rule} finding for {key_part!r}: {[(f.rule_id, f.key) for f in cfg.findings]}"
    return hits[0]


# ----------------------------------------------------------------------------------------------
# Defaults (DeepSpeed 0.19.8 values, written out literally)
# ----------------------------------------------------------------------------------------------

def test_zero_defaults_are_deepspeed_0_19_8():
    z = load_ds_config({"zero_optimization": {}}).zero
    assert z.stage == 0
    assert z.contiguous_gradients is True
    assert z.reduce_scatter is True
    assert z.reduce_bucket_size == 500_000_000
    assert z.use_multi_rank_bucket_allreduce is True
    assert z.allgather_partitions is True
    assert z.allgather_bucket_size == 500_000_000
    assert z.overlap_comm is False
    assert z.sub_group_size == 1_000_000_000
    assert z.prefetch_bucket_size == 50_000_000
    assert z.param_persistence_threshold == 100_000
    assert z.model_persistence_threshold == sys.maxsize
    assert z.max_live_parameters == 1_000_000_000
    assert z.max_reuse_distance == 1_000_000_000
    assert z.gather_16bit_weights_on_model_save is False
    assert z.zero_hpz_partition_size == 1
    assert z.zero_quantized_weights is False
    assert z.zero_quantized_gradients is False
    assert z.round_robin_gradients is False
    assert z.ignore_unused_parameters is True
    assert z.use_all_reduce_for_fetch_params is False
    assert z.module_granularity_threshold == 0
    assert z.compute_grad_norm is True
    assert z.parameter_alignment is False
    assert z.allgather_sequential is False
    assert z.offload_optimizer.device == "none" and z.offload_param.device == "none"
    # Offload blocks: 0.19.8 pins by default (0.16.5 did not).
    oo, op = OffloadOptimizerConfig(), OffloadParamConfig()
    assert (oo.buffer_count, oo.pin_memory, oo.pipeline_read, oo.pipeline_write, oo.fast_init, oo.ratio) == (
        4, True, False, False, False, 1.0)
    assert (op.buffer_count, op.buffer_size, op.max_in_cpu, op.pin_memory) == (5, 100_000_000, 1_000_000_000, True)
    for name in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "prefetch_bucket_size"):
        assert type(getattr(z, name)) is int


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_resolves_from_stage(stage, expected):
    assert load_ds_config({"zero_optimization": {"stage": stage}}).zero.overlap_comm is expected
    assert ZeroConfig(stage=stage).overlap_comm is expected
    explicit = load_ds_config({"zero_optimization": {"stage": stage, "overlap_comm": not expected}})
    assert explicit.zero.overlap_comm is (not expected)


def test_seed_example_reads_exactly():
    cfg = load_ds_config(CONFIGS / "seed-zero2-offload.json")
    z = cfg.zero
    assert z.stage == 2
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory is True
    assert z.allgather_bucket_size == 200_000_000 and type(z.allgather_bucket_size) is int
    assert z.reduce_bucket_size == 200_000_000
    assert z.overlap_comm is True and z.reduce_scatter is True and z.contiguous_gradients is True
    assert cfg.precision == "fp32" and "no fp16/bf16 block" in cfg.precision_source
    assert rules(cfg, "error") == []
    # The seed snippet has no batch keys: DeepSpeed's assertion, reported as a warning.
    assert rules(cfg) == ["DS008"]
    assert cfg.path == str(CONFIGS / "seed-zero2-offload.json")
    assert cfg.raw["zero_optimization"]["reduce_bucket_size"] == 2e8


def test_aliases_map_to_canonical_fields():
    cfg = load_ds_config({"zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 4096,
        "stage3_model_persistence_threshold": 123456,
        "stage3_max_live_parameters": 3e8,
        "stage3_max_reuse_distance": 2e8,
        "stage3_gather_16bit_weights_on_model_save": True,
        "stage3_module_granularity_threshold": 7,
        "stage3_use_all_reduce_for_fetch_params": True,
        "stage3_allgather_sequential": True,
    }})
    z = cfg.zero
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.model_persistence_threshold) == (
        10_000_000, 4096, 123456)
    assert (z.max_live_parameters, z.max_reuse_distance) == (300_000_000, 200_000_000)
    assert z.gather_16bit_weights_on_model_save and z.use_all_reduce_for_fetch_params and z.allgather_sequential
    assert z.module_granularity_threshold == 7
    assert cfg.findings == [] or rules(cfg) == ["DS008"]


def test_alias_and_name_together_is_an_error():
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e7,
                                                "prefetch_bucket_size": 2e7}})
    f = finding(cfg, "DS010", "prefetch_bucket_size")
    assert f.severity == "error"
    assert cfg.zero.prefetch_bucket_size == 10_000_000


# ----------------------------------------------------------------------------------------------
# Deprecated and removed keys
# ----------------------------------------------------------------------------------------------

def test_deprecated_cpu_offload_maps_to_offload_optimizer():
    cfg = load_ds_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero.offload_optimizer.device == "cpu"
    assert cfg.zero.offload_optimizer.pin_memory is True
    f = finding(cfg, "DS002", "cpu_offload")
    assert f.severity == "warning" and "offload_optimizer" in f.message


def test_deprecated_cpu_offload_param_and_pin_memory_not_transferred():
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "cpu_offload_param": True,
                                                "cpu_offload_use_pin_memory": False}})
    assert cfg.zero.offload_param.device == "cpu"
    assert cfg.zero.offload_param.pin_memory is True  # value NOT transferred (DeepSpeed)
    assert cfg.zero.offload_optimizer.device == "none"
    assert {f.key for f in cfg.findings if f.rule_id == "DS002"} == {
        "zero_optimization.cpu_offload_param", "zero_optimization.cpu_offload_use_pin_memory"}
    assert "NOT transferred" in finding(cfg, "DS002", "cpu_offload_use_pin_memory").message


def test_deprecated_gather_fp16_copies_value():
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero.gather_16bit_weights_on_model_save is True
    assert finding(cfg, "DS002").severity == "warning"


def test_deprecated_with_replacement_is_an_error():
    cfg = load_ds_config({"zero_optimization": {"stage": 2, "cpu_offload": False,
                                                "offload_optimizer": {"device": "cpu"}}})
    f = finding(cfg, "DS002", "cpu_offload")
    assert f.severity == "error" and "together" in f.message
    assert cfg.zero.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("key,value", [("mics_shard_size", 8), ("mics_hierarchical_params_gather", True),
                                       ("zeropp_loco_param", {"err_beta": 0.8})])
def test_removed_mics_loco_keys(key, value):
    cfg = load_ds_config({"zero_optimization": {"stage": 3, key: value}})
    f = finding(cfg, "DS009", key)
    assert f.severity == "error"
    with pytest.raises(InputError, match=key):
        load_ds_config({"zero_optimization": {"stage": 3, key: value}}, strict=True)


def test_removed_top_level_amp():
    cfg = load_ds_config({"amp": {"enabled": True}, "train_micro_batch_size_per_gpu": 1})
    assert finding(cfg, "DS009", "amp").severity == "error"


def test_boolean_zero_optimization_is_deprecated_stage_1():
    cfg = load_ds_config({"zero_optimization": True, "allgather_size": 2e8, "train_batch_size": 8})
    assert cfg.zero.stage == 1 and cfg.zero.allgather_bucket_size == 200_000_000
    assert finding(cfg, "DS002", "zero_optimization").severity == "warning"


# ----------------------------------------------------------------------------------------------
# Types, fractional ints, unknown keys, strict mode
# ----------------------------------------------------------------------------------------------

def test_fractional_int_falls_back_to_default_with_error():
    cfg = load_ds_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5e7 + 0.5}})
    f = finding(cfg, "DS004", "reduce_bucket_size")
    assert f.severity == "error" and f.value == "25000000.5"
    assert cfg.zero.reduce_bucket_size == 500_000_000


def test_hf_old_float_prefetch_is_rejected_like_deepspeed_0_19_8():
    # Older HF wrote 0.9*h*h as a float (15099494.4 for h=4096): DeepSpeed issue #6525.
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494.4}})
    assert finding(cfg, "DS004", "stage3_prefetch_bucket_size").severity == "error"
    with pytest.raises(InputError) as exc:
        load_ds_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 15099494.4}},
                       strict=True)
    msg = str(exc.value)
    assert "stage3_prefetch_bucket_size" in msg and "15099494.4" in msg and "\n" not in msg


@pytest.mark.parametrize("raw,severity,expected", [
    ("yes", "warning", True),       # pydantic lax: DeepSpeed coerces it
    ("false", "warning", False),
    (1, "warning", True),
    ("abc", "error", True),         # DeepSpeed rejects: default (True) used
    (2, "error", True),
    (None, "error", True),
    ([True], "error", True),
])
def test_bool_field_types(raw, severity, expected):
    cfg = load_ds_config({"zero_optimization": {"contiguous_gradients": raw}})
    f = finding(cfg, "DS003", "contiguous_gradients")
    assert f.severity == severity
    assert "zero_optimization.contiguous_gradients" in f.message and "true or false" in f.message
    assert cfg.zero.contiguous_gradients is expected


@pytest.mark.parametrize("raw,severity,expected", [
    ("300", "warning", 300),
    ("5e8", "error", 500_000_000),
    (True, "warning", 1),
    ([1], "error", 500_000_000),
    ({"a": 1}, "error", 500_000_000),
])
def test_int_field_types(raw, severity, expected):
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": raw}})
    f = finding(cfg, "DS003", "reduce_bucket_size")
    assert f.severity == severity
    assert cfg.zero.reduce_bucket_size == expected


def test_integral_float_is_silently_an_int():
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "sub_group_size": 1e9},
                          "train_micro_batch_size_per_gpu": 2.0})
    assert cfg.zero.sub_group_size == 1_000_000_000 and type(cfg.zero.sub_group_size) is int
    assert cfg.micro_batch == 2 and type(cfg.micro_batch) is int
    assert rules(cfg) == []


def test_wrong_type_strict_raises_one_line_naming_key_value_expected(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}))
    with pytest.raises(InputError) as exc:
        load_ds_config(p, strict=True)
    msg = str(exc.value)
    assert str(p) in msg and "zero_optimization.overlap_comm" in msg and '"maybe"' in msg
    assert "true or false" in msg and "\n" not in msg


def test_unknown_keys_severity_by_level():
    cfg = load_ds_config({
        "train_micro_batch_size_per_gpu": 1,
        "trian_batch_size": 8,  # typo at top level: DeepSpeed ignores it
        "zero_optimization": {"stage": 2, "overlap_com": True,  # DeepSpeed forbids it
                              "offload_optimizer": {"device": "cpu", "pin_mem": True}},
        "bf16": {"enabled": True, "loss_scale": 0},  # bf16 has no loss_scale: forbidden
        "optimizer": {"type": "AdamW", "parms": {}},
    })
    sev = {f.key: f.severity for f in cfg.findings if f.rule_id == "DS001"}
    assert sev == {
        "trian_batch_size": "warning",
        "zero_optimization.overlap_com": "error",
        "zero_optimization.offload_optimizer.pin_mem": "error",
        "bf16.loss_scale": "error",
        "optimizer.parms": "warning",
    }
    assert "did you mean 'train_batch_size'" in finding(cfg, "DS001", "trian").message
    assert "did you mean 'overlap_comm'" in finding(cfg, "DS001", "overlap_com").message
    with pytest.raises(InputError, match="trian_batch_size"):
        load_ds_config({"trian_batch_size": 8, "train_batch_size": 8}, strict=True)


def test_all_known_top_level_keys_are_quiet():
    cfg = load_ds_config({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "steps_per_print": 10, "wall_clock_breakdown": False, "gradient_clipping": 1.0,
        "prescale_gradients": False, "communication_data_type": "FP32", "activation_checkpointing": {},
        "flops_profiler": {}, "tensorboard": {}, "wandb": {}, "csv_monitor": {}, "comms_logger": {},
        "data_types": {}, "checkpoint": {}, "aio": {}, "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False, "scheduler": {"type": "WarmupLR", "params": {}},
    }, world_size=8)
    assert cfg.findings == []
    assert cfg.communication_data_type == "fp32"
    assert cfg.gradient_clipping == 1.0


# ----------------------------------------------------------------------------------------------
# Precision
# ----------------------------------------------------------------------------------------------

def test_fp16_and_bf16_both_enabled():
    d = {"fp16": {"enabled": True}, "bf16": {"enabled": True}, "train_batch_size": 8}
    cfg = load_ds_config(d)
    f = finding(cfg, "DS005")
    assert f.severity == "error"
    assert "bfloat16 and fp16 modes cannot be simultaneously enabled" in f.message
    with pytest.raises(InputError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        load_ds_config(d, strict=True)


@pytest.mark.parametrize("d,precision,source_part", [
    ({}, "fp32", "no fp16/bf16 block"),
    ({"fp16": {"enabled": False}}, "fp32", "not enabled"),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16", "fp16.enabled"),
    ({"bf16": {"enabled": True}}, "bf16", "bf16.enabled"),
    ({"bfloat16": {"enabled": True}}, "bf16", "bfloat16.enabled"),
    ({"fp16": {"enabled": "true"}}, "fp16", "fp16.enabled"),
])
def test_precision_from_blocks(d, precision, source_part):
    cfg = load_ds_config({**d, "train_batch_size": 8})
    assert cfg.precision == precision
    assert source_part in cfg.precision_source
    assert cfg.resolved_communication_data_type == precision


def test_bfloat16_legacy_alias_is_reported():
    cfg = load_ds_config({"bfloat16": {"enabled": True}, "train_batch_size": 8})
    assert finding(cfg, "DS002", "bfloat16").severity == "warning"


def test_communication_data_type_invalid():
    cfg = load_ds_config({"communication_data_type": "int8", "train_batch_size": 8})
    assert finding(cfg, "DS010", "communication_data_type").severity == "error"
    assert cfg.communication_data_type is None


# ----------------------------------------------------------------------------------------------
# "auto" (HF Trainer rules)
# ----------------------------------------------------------------------------------------------

def test_hf_auto_with_hidden_size_and_batch():
    h = 4096
    cfg = load_ds_config(CONFIGS / "hf-zero3-auto.json", hidden_size=h, micro_batch=4, grad_accum=2,
                         world_size=16, precision="bf16")
    z = cfg.zero
    assert z.stage == 3
    assert z.reduce_bucket_size == 16_777_216           # h*h
    assert z.prefetch_bucket_size == 15_099_494         # int(0.9*h*h) = int(15099494.4)
    assert z.param_persistence_threshold == 40_960      # 10*h
    assert (cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size) == (4, 2, 128)
    assert cfg.precision == "bf16"
    assert cfg.auto_resolved["zero_optimization.reduce_bucket_size"]["value"] == 16_777_216
    assert "hidden_size" in cfg.auto_resolved["zero_optimization.reduce_bucket_size"]["how"]
    assert cfg.auto_resolved["train_batch_size"]["value"] == 128
    assert cfg.auto_resolved["bf16.enabled"]["value"] is True
    assert cfg.auto_resolved["fp16.enabled"]["value"] is False
    assert rules(cfg, "error") == [] and rules(cfg, "warning") == []
    assert set(rules(cfg)) == {"DS006"}
    assert z.max_live_parameters == 1_000_000_000 and z.gather_16bit_weights_on_model_save is True


def test_hf_auto_without_hidden_size_uses_deepspeed_drop():
    cfg = load_ds_config(CONFIGS / "hf-zero3-auto.json")
    z = cfg.zero
    # DeepSpeed drops "auto" -> defaults.
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    unresolved = {f.key for f in cfg.findings if f.rule_id == "DS007"}
    assert {"zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold", "train_batch_size",
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"} <= unresolved
    assert cfg.precision == "fp32"
    assert rules(cfg, "error") == []


def test_hf_stage3_rules_do_not_apply_to_stage2():
    cfg = load_ds_config({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"},
                          "train_batch_size": 8}, hidden_size=1024)
    assert cfg.zero.prefetch_bucket_size == 50_000_000
    assert finding(cfg, "DS006", "stage3_prefetch_bucket_size").severity == "info"


def test_auto_offload_device_and_stage():
    cfg = load_ds_config({"zero_optimization": {"stage": "auto",
                                                "offload_optimizer": {"device": "auto"},
                                                "offload_param": {"device": "auto", "nvme_path": "auto"}},
                          "train_batch_size": 8})
    assert cfg.zero.stage == 0
    assert cfg.zero.offload_optimizer.device == "none" and cfg.zero.offload_param.device == "none"
    assert finding(cfg, "DS007", "zero_optimization.stage").severity == "warning"
    assert finding(cfg, "DS006", "offload_optimizer.device").severity == "info"
    assert cfg.auto_resolved["zero_optimization.offload_param.device"]["value"] == "none"


def test_fp16_auto_with_precision_fp16():
    cfg = load_ds_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "train_batch_size": 8},
                         precision="fp16")
    assert cfg.precision == "fp16"


# ----------------------------------------------------------------------------------------------
# Batch keys: DeepSpeed's fill-in (integer floor division) and assertion
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given_keys,ws,expected,ok", [
    # tb + mb -> gas = tb // mb // ws
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8, (64, 4, 2), True),
    ({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 3}, 4, (100, 3, 8), False),  # 3*8*4=96
    # tb + gas -> mb = tb // ws // gas
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 8, (64, 2, 4), True),
    # mb + gas -> tb = mb * gas * ws
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 5, (30, 2, 3), True),
    # only tb -> gas = 1, mb = tb // ws
    ({"train_batch_size": 32}, 8, (32, 4, 1), True),
    ({"train_batch_size": 4}, 8, (4, 0, 1), False),  # mb = 0: not > 0
    # only mb -> gas = 1, tb = mb * ws
    ({"train_micro_batch_size_per_gpu": 3}, 7, (21, 3, 1), True),
    # all three: checked
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8,
     (64, 4, 2), True),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     (64, 4, 2), False),
])
def test_batch_fill_in(given_keys, ws, expected, ok):
    cfg = load_ds_config(given_keys, world_size=ws)
    assert (cfg.train_batch_size, cfg.micro_batch, cfg.grad_accum) == expected
    errors = [f for f in cfg.findings if f.rule_id == "DS008" and f.severity == "error"]
    assert (errors == []) is ok
    if not ok:
        with pytest.raises(InputError, match="DS008"):
            load_ds_config(given_keys, world_size=ws, strict=True)


def test_batch_inconsistent_names_the_three_values():
    cfg = load_ds_config(CONFIGS / "broken.json", world_size=4)
    f = finding(cfg, "DS008", "train_batch_size")
    assert f.severity == "error"
    for part in ("train_batch_size=100", "train_micro_batch_size_per_gpu=4",
                 "gradient_accumulation_steps=8", "world_size=4"):
        assert part in f.message


def test_batch_without_world_size_catches_impossible_totals():
    cfg = load_ds_config({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 8})
    assert finding(cfg, "DS008").severity == "error"
    cfg = load_ds_config({"train_batch_size": 128, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 8})
    assert rules(cfg) == []


def test_caller_batch_differs_from_config():
    cfg = load_ds_config({"train_micro_batch_size_per_gpu": 8}, micro_batch=4)
    assert cfg.micro_batch == 8
    assert finding(cfg, "DS008", "train_micro_batch_size_per_gpu").severity == "warning"


# ----------------------------------------------------------------------------------------------
# Invalid values (DS010)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero,key_part,severity", [
    ({"stage": 2, "reduce_bucket_size": 0}, "reduce_bucket_size", "error"),          # must be > 0 in 0.19.8
    ({"stage": 2, "reduce_bucket_size": -5}, "reduce_bucket_size", "error"),
    ({"stage": 3, "sub_group_size": -1}, "sub_group_size", "error"),
    ({"stage": 4}, "stage", "error"),
    ({"stage": -1}, "stage", "error"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param", "warning"),  # no effect < 3
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "ratio", "error"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio", "error"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "nvme_path", "error"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "nvme_path", "error"),
    ({"stage": 2, "offload_optimizer": {"device": "CPU"}}, "device", "error"),       # enum is case-sensitive
    ({"stage": 2, "allgather_bucket_size": 3}, "allgather_bucket_size", "error"),    # multiple of 2 (stage 1/2)
    ({"stage": 3, "compute_grad_norm": False}, "compute_grad_norm", "error"),
    ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights", "warning"),
    ({"stage": 2, "zero_hpz_partition_size": 8}, "zero_hpz_partition_size", "warning"),
])
def test_invalid_values(zero, key_part, severity):
    cfg = load_ds_config({"zero_optimization": zero, "train_batch_size": 8})
    f = finding(cfg, "DS010", key_part)
    assert f.severity == severity


def test_stage_out_of_range_falls_back_and_partial_offload_ok_at_stage3():
    cfg = load_ds_config({"zero_optimization": {"stage": 5}, "train_batch_size": 8})
    assert cfg.zero.stage == 0
    cfg = load_ds_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}},
                          "train_batch_size": 8})
    assert cfg.zero.offload_optimizer.ratio == pytest.approx(0.3) and rules(cfg) == []
    z = load_ds_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}).zero
    assert z.offload_param.device == "cpu" and z.param_offload_device == "none"


# ----------------------------------------------------------------------------------------------
# JSON parsing
# ----------------------------------------------------------------------------------------------

def test_comments_and_trailing_commas(tmp_path):
    text = (
        '{\n'
        '  // line comment "with quotes"\n'
        '  "zero_optimization": {\n'
        '    "stage": 3, /* block\n comment */\n'
        '    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme//x/*y*/",},\n'
        '  },\n'
        '  "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95,],},},\n'
        '}\n'
    )
    p = tmp_path / "c.json"
    p.write_text(text)
    cfg = load_ds_config(p)
    assert cfg.zero.stage == 3
    assert cfg.zero.offload_param.nvme_path == "/local_nvme//x/*y*/"   # strings untouched
    assert cfg.optimizer_params["betas"] == [0.9, 0.95]
    assert finding(cfg, "DS011").severity == "warning"


@pytest.mark.parametrize("text,line,col", [
    ('{\n  "a": 1,\n  "b": ,\n}', 3, 8),
    ('{\n  // c\n  "a" 1\n}', 3, 7),
    ('{"a": [1, 2}', 1, 12),
])
def test_malformed_json_names_line_and_column(tmp_path, text, line, col):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(InputError) as exc:
        load_ds_config(p)
    msg = str(exc.value)
    assert str(p) in msg and f"line {line} column {col}" in msg and "\n" not in msg


@pytest.mark.parametrize("text,part", [
    ('{"a": 1 /* open', "unterminated"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": NaN}', "line 1 column 7: NaN is not a JSON number"),  # the literal, not hjson's error at the end
    ('{\n "a": 1,\n "b": -Infinity}', "line 3 column 7: -Infinity is not a JSON number"),
    ('{"a": NaN, "b": Infinity}', "line 1 column 7: NaN is not a JSON number"),
    # a NaN in a comment is not blamed for another error (here the missing brace at the end)
    ('{\n  // skip steps whose loss is NaN\n  "a": {"b": 2\n}\n', r"line 5 column 1: not valid JSON/hjson \(Bad key"),
    ('[1, 2]', "expected an object"),
])
def test_other_parse_errors(text, part):
    with pytest.raises(InputError, match=part):
        parse_ds_json(text, "x.json")


def test_missing_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_ds_config(tmp_path / "nope.json")


# ----------------------------------------------------------------------------------------------
# Example files: expected findings per file
# ----------------------------------------------------------------------------------------------

EXPECTED_FINDINGS = {
    "seed-zero2-offload.json": {("DS008", "warning")},
    "zero1-bf16.json": set(),
    "zero2-bf16.json": set(),
    "zero3-offload.json": set(),
    "zero3-zeropp.json": set(),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_FINDINGS))
def test_example_files_findings(name):
    cfg = load_ds_config(CONFIGS / name, world_size=8)
    assert {(f.rule_id, f.severity) for f in cfg.findings} == EXPECTED_FINDINGS[name]


def test_example_zero3_zeropp_and_offload_values():
    zpp = load_ds_config(CONFIGS / "zero3-zeropp.json").zero
    assert zpp.zero_quantized_weights and zpp.zero_quantized_gradients and zpp.zero_hpz_partition_size == 8
    off = load_ds_config(CONFIGS / "zero3-offload.json").zero
    assert off.offload_optimizer.device == "cpu" and off.offload_param.device == "cpu"
    assert off.param_offload_device == "cpu"
    z1 = load_ds_config(CONFIGS / "zero1-bf16.json", world_size=8)
    assert (z1.zero.stage, z1.precision, z1.grad_accum) == (1, "bf16", 8)   # 256 // 4 // 8


def test_broken_example_has_each_mistake():
    cfg = load_ds_config(CONFIGS / "broken.json", world_size=8)
    got = {(f.rule_id, f.severity) for f in cfg.findings}
    assert {("DS005", "error"), ("DS001", "error"), ("DS004", "error"), ("DS002", "warning"),
            ("DS008", "error"), ("DS011", "warning")} <= got
    assert finding(cfg, "DS004").key == "zero_optimization.allgather_bucket_size"
    assert finding(cfg, "DS001").key == "zero_optimization.contigous_gradients"
    with pytest.raises(InputError, match="broken.json"):
        load_ds_config(CONFIGS / "broken.json", strict=True)


def test_rules_table_lists_every_rule_used():
    assert set(RULES) == {f"DS{i:03d}" for i in range(1, 12)}


# ----------------------------------------------------------------------------------------------
# Writing and round trip
# ----------------------------------------------------------------------------------------------

ROUND_TRIP_ZEROS = [
    ZeroConfig(),
    ZeroConfig(stage=1),
    ZeroConfig(stage=2, reduce_bucket_size=200_000_000, allgather_bucket_size=200_000_000,
               offload_optimizer=OffloadOptimizerConfig(device="cpu")),
    ZeroConfig(stage=3, overlap_comm=False, prefetch_bucket_size=15_099_494, param_persistence_threshold=40_960,
               offload_param=OffloadParamConfig(device="nvme", nvme_path="/nvme", pin_memory=False),
               offload_optimizer=OffloadOptimizerConfig(device="cpu", ratio=0.25),
               model_persistence_threshold=10**12, zero_hpz_partition_size=8, zero_quantized_weights=True),
]


@pytest.mark.parametrize("zero", ROUND_TRIP_ZEROS, ids=lambda z: f"stage{z.stage}")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_build_write_load_round_trip(tmp_path, zero, precision):
    d = build_ds_config(zero, precision=precision, micro_batch=2, grad_accum=4, world_size=16)
    assert d["train_batch_size"] == 2 * 4 * 16
    p = tmp_path / "out.json"
    write_ds_config(p, d)
    text = p.read_text()
    assert text.endswith("\n") and text.startswith("{\n  ")
    back = load_ds_config(p, world_size=16)
    assert [f for f in back.findings if f.severity == "error"] == []
    assert back.zero == zero
    assert back.precision == precision
    assert (back.train_batch_size, back.micro_batch, back.grad_accum) == (128, 2, 4)


def test_build_only_writes_non_default_and_expected_keys():
    d = build_ds_config(ZeroConfig(stage=2, reduce_bucket_size=200_000_000), precision="bf16",
                        micro_batch=1, grad_accum=1, world_size=8)
    z = d["zero_optimization"]
    assert z["stage"] == 2 and z["reduce_bucket_size"] == 200_000_000 and z["overlap_comm"] is False
    for hidden in ("sub_group_size", "stage3_max_live_parameters", "offload_optimizer", "leaf_module",
                   "model_persistence_threshold", "zero_quantized_weights"):
        assert hidden not in z
    assert d["bf16"] == {"enabled": True} and "fp16" not in d
    assert d["optimizer"]["type"] == "AdamW"
    d3 = build_ds_config(ZeroConfig(stage=3), precision="fp16", micro_batch=1, grad_accum=1, world_size=8)
    assert d3["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert d3["zero_optimization"]["overlap_comm"] is True


def test_build_over_base_keeps_user_keys_and_fixes_precision():
    base = json.loads((CONFIGS / "hf-zero3-auto.json").read_text())
    d = build_ds_config(ZeroConfig(stage=2), precision="bf16", micro_batch=4, grad_accum=2, world_size=8,
                        base=base)
    assert d["bf16"]["enabled"] is True and d["fp16"]["enabled"] is False
    assert d["fp16"]["initial_scale_power"] == 16
    assert d["steps_per_print"] == 2000 and d["scheduler"]["type"] == "WarmupLR"
    assert d["optimizer"]["params"]["lr"] == "auto"
    assert base["zero_optimization"]["stage"] == 3   # base not mutated
    back = load_ds_config(d, world_size=8)
    assert rules(back, "error") == [] and back.zero == ZeroConfig(stage=2)


def test_write_rejects_nan(tmp_path):
    with pytest.raises(InputError):
        write_ds_config(tmp_path / "x.json", {"a": float("nan")})


def test_diff_ds_configs():
    old = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True}, "fp16": {"enabled": True}}
    new = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 200000000, "overlap_comm": 1},
           "bf16": {"enabled": True}}
    diff = diff_ds_configs(old, new)
    assert diff == [
        ("bf16", ABSENT, {"enabled": True}),
        ("fp16", {"enabled": True}, ABSENT),
        ("zero_optimization.overlap_comm", True, 1),
        ("zero_optimization.stage", 2, 3),
    ]
    assert diff_ds_configs(old, old) == []


# ----------------------------------------------------------------------------------------------
# Fuzz: random JSON-ish input never raises anything but InputError
# ----------------------------------------------------------------------------------------------

_KEYS = ["stage", "reduce_bucket_size", "overlap_comm", "offload_optimizer", "offload_param", "device",
         "ratio", "nvme_path", "cpu_offload", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
         "zero_optimization", "fp16", "bf16", "bfloat16", "enabled", "train_batch_size",
         "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "params", "type",
         "leaf_module", "zenflow", "classes", "mics_shard_size", "communication_data_type",
         "gradient_clipping", "allgather_size", "torch_autocast", "x"]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["auto", "cpu", "nvme", "none", "true", "1", "5e8", "fp16", ""]), st.text(max_size=5))
_json_ish = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=4), inner, max_size=5)),
    max_leaves=25)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.dictionaries(st.sampled_from(_KEYS), _json_ish, max_size=6),
       hidden=st.none() | st.integers(1, 10_000), ws=st.none() | st.integers(1, 64))
def test_fuzz_dicts_only_raise_input_error(d, hidden, ws):
    cfg = load_ds_config(d, hidden_size=hidden, world_size=ws)   # non-strict: never raises
    assert cfg.zero.stage in (0, 1, 2, 3)
    json.dumps(cfg.model_dump(mode="json"), allow_nan=True)
    try:
        load_ds_config(d, hidden_size=hidden, world_size=ws, strict=True)
    except InputError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet='{}[],:"/*\\ \n0123456789.eE+-abtrufnl', max_size=60))
def test_fuzz_text_only_raises_input_error(text):
    try:
        parse_ds_json(text, "fuzz.json")
    except InputError as exc:
        assert "fuzz.json" in str(exc)


# ----------------------------------------------------------------------------------------------
# Against DeepSpeed itself (skipped when DeepSpeed is not installed)
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_zero_config():
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.utils import logger
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        pytest.skip("DeepSpeed is not installed")
    logger.setLevel(logging.ERROR)
    return DeepSpeedZeroConfig


def _ds_as_dict(dz) -> dict:
    out = {}
    for name in ZeroConfig.model_fields:
        v = getattr(dz, name)
        if name in ("offload_optimizer", "offload_param"):
            v = {"device": "none"} if v is None else {k: (str(x) if k == "nvme_path" and x is not None else x)
                                                      for k, x in v.model_dump().items()}
            v["device"] = getattr(v["device"], "value", v["device"])
        elif name == "leaf_module":
            v = v.model_dump()
        elif name == "zenflow":
            v = None if v is None else v.model_dump()
        out[name] = v
    return out


def _ours_as_dict(z: ZeroConfig) -> dict:
    d = z.model_dump()
    for name in ("offload_optimizer", "offload_param"):
        if d[name]["device"] == "none":
            d[name] = {"device": "none"}
    return d


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["seed-zero2-offload.json", "zero1-bf16.json", "zero2-bf16.json",
                                  "zero3-offload.json", "zero3-zeropp.json", "hf-zero3-auto.json"])
def test_same_as_deepspeed_for_examples(ds_zero_config, name):
    raw = json.loads((CONFIGS / name).read_text())
    ours = load_ds_config(raw).zero       # no hidden size: "auto" dropped, as DeepSpeed does
    theirs = ds_zero_config(**raw["zero_optimization"])
    d_ours, d_theirs = _ours_as_dict(ours), _ds_as_dict(theirs)
    if d_theirs["offload_optimizer"]["device"] == "none":
        d_theirs["offload_optimizer"] = {"device": "none"}
    if d_theirs["offload_param"]["device"] == "none":
        d_theirs["offload_param"] = {"device": "none"}
    assert d_ours == d_theirs


_zero_values = {
    "stage": st.sampled_from([0, 1, 2, 3, 4, -1, 2.0, 2.5, "2", True, "auto", None]),
    "reduce_bucket_size": st.sampled_from([0, 1, -3, 2e8, 2.5, "7", "5e8", True, None, "auto", 10**20]),
    "allgather_bucket_size": st.sampled_from([0, 2, 5e8, 1.5, "x", None]),
    "overlap_comm": st.sampled_from([True, False, None, "yes", "no", 0, 2, "auto", "maybe"]),
    "contiguous_gradients": st.sampled_from([True, "off", 1.0, 0.5, [], "auto"]),
    "sub_group_size": st.sampled_from([0, -1, 1e12, 3.3, "auto"]),
    "stage3_prefetch_bucket_size": st.sampled_from([0, 5e7, 15099494.4, "auto", -1]),
    "prefetch_bucket_size": st.sampled_from([1, 2e7]),
    "stage3_param_persistence_threshold": st.sampled_from([0, 1e5, "auto", "10"]),
    "model_persistence_threshold": st.sampled_from([0, 2**40, -1]),
    "zero_hpz_partition_size": st.sampled_from([0, 1, 8, -1, 8.0]),
    "module_granularity_threshold": st.sampled_from([0, -5, 100]),
    "zero_quantized_weights": st.sampled_from([True, False, "true"]),
    "offload_optimizer": st.sampled_from([
        None, {}, {"device": "cpu"}, {"device": "CPU"}, {"device": "auto"}, {"device": "cpu", "ratio": 0.5},
        {"device": "cpu", "ratio": 1.5}, {"device": "cpu", "pin_memory": "auto"}, {"device": "cpu", "x": 1},
        {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 8.0}, {"device": "cpu", "buffer_count": 2.5},
        "cpu", True]),
    "offload_param": st.sampled_from([None, {"device": "cpu"}, {"device": "cpu", "max_in_cpu": 1e9},
                                      {"device": "none", "buffer_size": -1}]),
    "cpu_offload": st.sampled_from([True, False, None, "auto", "x"]),
    "cpu_offload_param": st.sampled_from([True, False]),
    "cpu_offload_use_pin_memory": st.sampled_from([True, False, "x"]),
    "stage3_gather_fp16_weights_on_model_save": st.sampled_from([True, False]),
    "gather_16bit_weights_on_model_save": st.sampled_from([True, False]),
    "compute_grad_norm": st.sampled_from([True, False]),
    "leaf_module": st.sampled_from([None, {}, {"classes": "a.B"}, {"names": ["x", "x"]}, {"bad": 1},
                                    {"classes": [1]}]),
    "mics_shard_size": st.sampled_from([4]),
    "unknown_key": st.sampled_from([1]),
}

# Runtime checks zeroplan adds that DeepSpeed's config model does not make (DeepSpeed fails later).
_RUNTIME_ONLY = ("nvme_path", "allgather_bucket_size")


@pytest.mark.deepspeed
@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(zero=st.lists(st.sampled_from(sorted(_zero_values)), max_size=4, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _zero_values[k] for k in keys})))
def test_differential_against_deepspeed(ds_zero_config, zero):
    cfg = load_ds_config({"zero_optimization": zero, "train_batch_size": 8})
    errors = [f for f in cfg.findings if f.severity == "error"
              and not (f.rule_id == "DS010" and any(f.key.endswith(s) for s in _RUNTIME_ONLY))]
    try:
        theirs = ds_zero_config(**zero)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises ValidationError/AssertionError/TypeError
        assert errors, f"DeepSpeed rejects {zero} ({type(exc).__name__}: {exc}) but zeroplan found no error"
        return
    assert not errors, f"DeepSpeed accepts {zero} but zeroplan reports {[e.message for e in errors]}"
    d_theirs = _ds_as_dict(theirs)
    for name in ("offload_optimizer", "offload_param"):
        if d_theirs[name]["device"] == "none":
            d_theirs[name] = {"device": "none"}
    assert _ours_as_dict(cfg.zero) == d_theirs


# ----------------------------------------------------------------------------------------------
# Smaller behaviours
# ----------------------------------------------------------------------------------------------

def test_strict_accepts_configs_with_only_warnings_and_infos():
    cfg = load_ds_config(CONFIGS / "seed-zero2-offload.json", strict=True)
    assert cfg.zero.stage == 2
    cfg = load_ds_config(CONFIGS / "hf-zero3-auto.json", strict=True, hidden_size=1024)
    assert cfg.zero.reduce_bucket_size == 1024 * 1024


def test_fp16_block_value_types():
    cfg = load_ds_config({"fp16": {"enabled": True, "loss_scale": True, "hysteresis": "x",
                                   "initial_scale_power": 16.0}, "train_batch_size": 8})
    keys = {f.key: f.severity for f in cfg.findings if f.rule_id == "DS003"}
    assert keys == {"fp16.loss_scale": "error", "fp16.hysteresis": "error"}
    assert cfg.precision == "fp16"


def test_caller_micro_batch_differs_from_deepspeed_fill_in():
    cfg = load_ds_config({"train_batch_size": 64}, micro_batch=4, world_size=8)
    assert (cfg.train_batch_size, cfg.micro_batch, cfg.grad_accum) == (64, 8, 1)   # 64 // 8, gas 1
    assert finding(cfg, "DS008", "train_micro_batch_size_per_gpu").severity == "warning"


def test_dropped_auto_alias_does_not_conflict_but_resolved_one_does():
    d = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "prefetch_bucket_size": 7},
         "train_batch_size": 8}
    cfg = load_ds_config(d)                      # "auto" dropped: only prefetch_bucket_size remains
    assert cfg.zero.prefetch_bucket_size == 7 and rules(cfg, "error") == []
    cfg = load_ds_config(d, hidden_size=100)     # HF fills it: now both keys are set
    assert finding(cfg, "DS010", "prefetch_bucket_size").severity == "error"


def test_dict_input_with_non_string_keys_and_tuples():
    cfg = load_ds_config({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {
        "betas": (0.9, 0.99)}}, 5: 1, "train_batch_size": 8})
    assert cfg.optimizer_type == "adam"                     # DeepSpeed lower-cases built-in names
    assert cfg.optimizer_params["betas"] == [0.9, 0.99]
    assert finding(cfg, "DS001", "5").severity == "warning"
    with pytest.raises(InputError):
        load_ds_config({"a": object()})
