"""Issue 17 §4: hpZ / MiCS / node shapes — zeroplan accepts exactly what DeepSpeed 0.19.8 accepts,
and an hpZ group is timed on the links it crosses.

The DeepSpeed side runs DeepSpeed's own code, not copies: ``runtime/config.py::
_reject_removed_config_keys`` (MiCS keys are removed in 0.19.8), ``DeepSpeedZeroConfig`` (pydantic
bounds) and ``utils/groups.py::_create_zero_param_parallel_group`` (group size min(hpz, world),
``_ensure_divisibility``) with ``deepspeed.comm`` stubbed to report the world size.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.core.comm import build_ledger  # noqa: F401 - imported for the layer it belongs to
from zeroplan.core.inputs import build_plan_inputs
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import hpz_group_size, load_ds_config

pytestmark = pytest.mark.deepspeed


def _deepspeed_accepts(cfg: dict, world: int, monkeypatch) -> bool:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    zero_mod = pytest.importorskip("deepspeed.runtime.zero.config")
    groups = pytest.importorskip("deepspeed.utils.groups")
    try:
        ds_config._reject_removed_config_keys(cfg)
        zc = zero_mod.DeepSpeedZeroConfig(**cfg["zero_optimization"])
    except Exception:  # noqa: BLE001 - DeepSpeed refusing the config
        return False
    if not (zc.stage == 3 and zc.zero_hpz_partition_size > 1):  # runtime/zero/stage3.py builds the group only then
        return True
    with monkeypatch.context() as m:
        m.setattr(groups.dist, "is_initialized", lambda: True)
        m.setattr(groups.dist, "get_world_size", lambda *a, **k: world)
        m.setattr(groups.dist, "get_rank", lambda *a, **k: 0)
        m.setattr(groups.dist, "new_group", lambda ranks, *a, **k: tuple(ranks))
        m.setattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP", None)
        try:
            groups._create_zero_param_parallel_group(zc.zero_hpz_partition_size)
        except AssertionError:
            return False
    return True


def _zeroplan_accepts(cfg: dict, world: int) -> bool:
    ds = load_ds_config(cfg, world_size=world, micro_batch=1, grad_accum=1)
    return not [f for f in ds.findings if f.severity == "error"]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stage=st.sampled_from([1, 2, 3]),
    hpz=st.one_of(st.integers(-2, 80), st.sampled_from([2.0, 2.5, 1024, 4096])),
    gpn=st.sampled_from([1, 2, 4, 6, 8, 16]),
    nodes=st.integers(1, 64),
    mics=st.one_of(st.none(), st.integers(1, 16)),
)
def test_property_hpz_mics_shapes_match_deepspeed(stage, hpz, gpn, nodes, mics, monkeypatch):
    world = gpn * nodes
    zero = {"stage": stage, "zero_hpz_partition_size": hpz}
    if mics is not None:
        zero["mics_shard_size"] = mics
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero}
    assert _zeroplan_accepts(cfg, world) == _deepspeed_accepts(cfg, world, monkeypatch), (cfg, world)


@pytest.mark.parametrize("hpz,world,ok", [(3, 32, False), (8, 32, True), (64, 32, True), (48, 32, True), (48, 64, False),
                                          (5, 5, True), (7, 5, True), (0, 8, True), (1, 8, True)])
def test_hpz_divisibility_examples(hpz, world, ok, monkeypatch):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz}}
    assert _zeroplan_accepts(cfg, world) is ok
    assert _deepspeed_accepts(cfg, world, monkeypatch) is ok


def _hpz_entry(hpz: int, nodes: int, gpn: int = 8):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz}}
    inp = build_plan_inputs(model="llama-2-7b", hardware="h100-8x-ib400", nodes=nodes, ds_config=cfg)
    plan = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(3), n_gpus=inp.n_gpus,
                    gpus_per_node=inp.gpus_per_node, hardware=inp.hardware)
    return plan, [e for e in plan.comm.collectives if "hpZ" in e.what]


def test_hpz_within_a_node_is_timed_on_nvlink():
    _, entries = _hpz_entry(8, 4)
    assert entries and all(e.group == "intra-node" and e.group_size == 8 for e in entries)


def test_hpz_larger_than_a_node_is_timed_across_the_nodes_it_spans():
    from zeroplan.core.timing import collective_time_s

    plan8, in_node = _hpz_entry(8, 4)
    plan16, across = _hpz_entry(16, 4)
    assert across and all(e.group == "all" and e.group_size == 16 and "across 2 nodes" in e.what for e in across)
    from zeroplan.specs.hardware import load_profile

    hw = load_profile("h100-8x-ib400")
    # same buffer, bigger group over the NICs: slower per call than the in-node group
    a, b = in_node[0], next(e for e in across if e.buffer_bytes == in_node[0].buffer_bytes)
    assert collective_time_s(b, hw, 32, 8) > collective_time_s(a, hw, 32, 8)


def test_hpz_larger_than_the_world_sizes_the_secondary_copy_by_the_world():
    plan_world, _ = _hpz_entry(32, 4)
    plan_over, _ = _hpz_entry(4096, 4)  # min(4096, 32) = 32 ranks, as DeepSpeed groups them
    assert hpz_group_size(4096, 32) == 32
    assert (plan_over.memory.buffers_detail["hpz_secondary_partition"]
            == plan_world.memory.buffers_detail["hpz_secondary_partition"])
