"""Step-time rows (issue 11 §2.1, issue 13): exposed comm never exceeds comm; offload has its own rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app
from zeroplan.core.nccl_model import collective_choice
from zeroplan.specs.hardware import load_profile as _load

ROOT = Path(__file__).resolve().parents[1]


def load_profile(name: str):
    """The repository's own profile file (not an installed copy)."""
    return _load(str(ROOT / "hardware_profiles" / f"{name}.toml"))


def _estimate(*args):
    r = CliRunner().invoke(app, ["estimate", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("hw", ["dgx-h100", "h100-8x-100gbe", "aws-p4d"])
@pytest.mark.parametrize("nodes", [1, 4])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_exposed_comm_never_exceeds_comm(hw, nodes, offload):
    d = _estimate("--model", "llama-2-13b", "--hardware", hw, "--nodes", str(nodes), "--precision", "bf16",
                  "--offload-optimizer", offload)
    for p in d["stages"]:
        t = p["time"]
        e = t["exposed_time_s"]
        assert 0 <= e["best"] <= e["estimate"] <= e["worst"] <= t["comm_time_s"] * (1 + 1e-9)
        parts = (t["compute_time_s"] + t["overlap_slowdown_s"] + e["estimate"] + t["pcie_time_s"]
                 + t["cpu_optimizer_time_s"] + t["nvme_time_s"] + t["gpu_optimizer_time_s"]
                 + t["host_bound_s"])  # stage 3: what DeepSpeed's hooks add beyond the GPU (core/host_time.py)
        assert t["step_time_s"] == pytest.approx(parts)
        assert t["comm_share"] <= 1 and t["comm_share"] * t["step_time_s"] <= t["comm_time_s"] + 1e-12


def test_offload_rows_in_table_and_json():
    args = ["--model", "llama-3.1-405b", "--hardware", "dgx-h100", "--nodes", "1", "--precision", "bf16",
            "--checkpointing", "full", "--seq-len", "8192", "--offload-optimizer", "cpu", "--stage", "3"]
    t = _estimate(*args)["stages"][0]["time"]
    assert t["cpu_optimizer_time_s"] > 0 and t["pcie_time_s"] > 0
    assert t["exposed_time_s"]["worst"] <= t["comm_time_s"] * (1 + 1e-9)
    assert t["cpu_adam_params_per_s"] > 0
    out = CliRunner().invoke(app, ["estimate", *args]).stdout
    assert "CPU optimizer step" in out and "offload PCIe copies" in out and "params/s per core" in out


def test_nccl_model_picks_nvls_on_h100_and_tree_across_two_nodes():
    hw = load_profile("dgx-h100")
    big = 1 << 30
    one = collective_choice("all_reduce", big, 8, 1, 8, hw)
    assert one.algorithm == "nvls"
    ring_bound = hw.intra_node.bandwidth_GBps_per_gpu * hw.intra_node.efficiency
    assert one.busbw_GBps > ring_bound  # NVLS beats the ring bound on one node
    two = collective_choice("all_reduce", big, 16, 2, 8, load_profile("dgx-a100-80gb"))
    assert two.algorithm == "tree"
    small = collective_choice("all_reduce", 8, 8, 1, 8, hw)
    assert small.protocol == "LL"


def test_mi300x_pair_gets_one_link():
    hw = load_profile("mi300x-8x")
    pair = collective_choice("all_gather", 1 << 30, 2, 1, 2, hw)
    eight = collective_choice("all_gather", 1 << 30, 8, 1, 8, hw)
    assert pair.busbw_GBps < eight.busbw_GBps / 4
