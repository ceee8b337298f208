"""Hardware profiles: bundled data, sources, unit sanity, TOML round trip, CLI.

Expected numbers are written here from published facts (datasheets, cloud pages,
nvidia-smi totals) and unit arithmetic done independently of zeroplan's code.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.resources import files
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from zeroplan._util import InputError
from zeroplan.cli import app
from zeroplan.specs.hardware import (
    HardwareProfile,
    list_profiles,
    load_profile,
    profile_to_toml,
    save_profile,
)

MiB = 2**20
GiB = 2**30
REQUIRED = {
    "dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h200", "gh200", "aws-p4d", "aws-p4de", "aws-p5",
    "azure-nd-a100-v4", "azure-nd-h100-v5", "gcp-a3", "l40s-8x-pcie-100gbe", "aws-g5-48xlarge",
    "dgx-1-v100", "rtx4090-8x-workstation", "mi300x-8x", "h100-8x-100gbe", "h100-8x-ib400",
}
runner = CliRunner()


def _bundled_files() -> dict[str, Path]:
    root = files("zeroplan.hardware_profiles")
    return {e.name[:-5]: Path(str(e)) for e in root.iterdir() if e.name.endswith(".toml")}


def _raw(name: str) -> dict:
    return tomllib.loads(_bundled_files()[name].read_text(encoding="utf-8"))


def _numeric_leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out += _numeric_leaves(v, path)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(path)
    return out


def _write(tmp_path: Path, data_text: str, name: str = "mine.toml") -> Path:
    p = tmp_path / name
    p.write_text(data_text, encoding="utf-8")
    return p


def _dump_raw(d: dict) -> str:
    """A tiny independent TOML emitter for test inputs (two levels of tables)."""
    def val(v):
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    lines = [f"{k} = {val(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{json.dumps(kk) if '.' in kk else kk} = {val(vv)}" for kk, vv in v.items() if not isinstance(vv, dict)]
            for kk, vv in v.items():
                if isinstance(vv, dict):
                    lines.append(f"[{k}.{kk}]")
                    lines += [f"{kkk} = {val(vvv)}" for kkk, vvv in vv.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- bundled data


def test_bundled_set_is_complete_and_named_by_file():
    found = _bundled_files()
    assert len(found) >= 16
    assert REQUIRED <= set(found)
    for stem in found:
        assert _raw(stem)["name"] == stem


def test_every_bundled_profile_loads_and_validates():
    profiles = list_profiles()
    assert {p.name for p in profiles} == set(_bundled_files())
    for p in profiles:
        assert load_profile(p.name).model_dump() == p.model_dump()
    assert load_profile("DGX-H100").name == "dgx-h100"  # case-insensitive


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_numeric_field_has_a_source(name):
    raw = _raw(name)
    sources = raw["sources"]
    body = {k: v for k, v in raw.items() if k != "sources"}
    leaves = _numeric_leaves(body)
    assert len(leaves) >= 18
    for path in leaves:
        parts = path.split(".")
        cands = [".".join(parts[:i]) for i in range(len(parts), 1, -1)]
        assert any(c in sources and len(sources[c]) > 20 for c in cands), f"{name}: {path} has no source"


def test_h100_pair_differs_only_in_inter_node():
    a, b = _raw("h100-8x-100gbe"), _raw("h100-8x-ib400")
    strip = lambda d: {k: v for k, v in d.items() if k not in ("name", "description", "sources", "inter_node")}
    assert strip(a) == strip(b)
    assert a["inter_node"] != b["inter_node"]
    # 100 GbE: one 100 Gb/s NIC per node shared by 8 GPUs -> 100/8 GB/s per node, /8 per GPU.
    assert a["inter_node"]["bandwidth_GBps_per_gpu"] == pytest.approx(100 / 8 / 8)
    # NDR: one 400 Gb/s NIC per GPU -> 50 GB/s per GPU.
    assert b["inter_node"]["bandwidth_GBps_per_gpu"] == pytest.approx(400 / 8)
    assert b["inter_node"]["bandwidth_GBps_per_gpu"] / a["inter_node"]["bandwidth_GBps_per_gpu"] == pytest.approx(32)


# Published per-node NIC totals in Gb/s (datasheets / cloud pages), GPUs per node.
INTER_NODE_GBPS_PER_NODE = {
    "dgx-a100-40gb": (8 * 200, 8), "dgx-a100-80gb": (8 * 200, 8), "dgx-h100": (8 * 400, 8),
    "hgx-h200": (8 * 400, 8), "gh200": (400, 1), "aws-p4d": (400, 8), "aws-p4de": (400, 8),
    "aws-p5": (3200, 8), "azure-nd-a100-v4": (1600, 8), "azure-nd-h100-v5": (3200, 8),
    "gcp-a3": (4 * 200, 8), "l40s-8x-pcie-100gbe": (100, 8), "aws-g5-48xlarge": (100, 8),
    "dgx-1-v100": (4 * 100, 8), "rtx4090-8x-workstation": (10, 8), "mi300x-8x": (8 * 400, 8),
    "h100-8x-100gbe": (100, 8), "h100-8x-ib400": (8 * 400, 8),
}
# Bidirectional per-GPU GPU-GPU figures from datasheets, halved for one direction.
INTRA_NODE_BIDIR_GBPS = {
    "dgx-a100-40gb": 600, "dgx-a100-80gb": 600, "aws-p4d": 600, "aws-p4de": 600, "azure-nd-a100-v4": 600,
    "dgx-h100": 900, "hgx-h200": 900, "aws-p5": 900, "azure-nd-h100-v5": 900, "gcp-a3": 900,
    "h100-8x-100gbe": 900, "h100-8x-ib400": 900, "dgx-1-v100": 300, "mi300x-8x": 896,
}
# Device totals the driver reports (nvidia-smi MiB, rocm-smi bytes).
MEMORY_BYTES = {
    "dgx-a100-40gb": 40960 * MiB, "aws-p4d": 40960 * MiB, "azure-nd-a100-v4": 40960 * MiB,
    "dgx-a100-80gb": 81920 * MiB, "aws-p4de": 81920 * MiB,
    "dgx-h100": 81559 * MiB, "aws-p5": 81559 * MiB, "gcp-a3": 81559 * MiB, "azure-nd-h100-v5": 81559 * MiB,
    "h100-8x-100gbe": 81559 * MiB, "h100-8x-ib400": 81559 * MiB, "hgx-h200": 143771 * MiB,
    "gh200": 97871 * MiB, "l40s-8x-pcie-100gbe": 46068 * MiB, "aws-g5-48xlarge": 23028 * MiB,
    "rtx4090-8x-workstation": 24564 * MiB, "dgx-1-v100": 32480 * MiB,  # nvidia-smi on a V100-SXM2-32GB (issue 13)
    "mi300x-8x": 205822885888,
}
# Marketing capacity in "GB" for the same GPUs (first matching key wins): the device total must be close to it.
NOMINAL_GB = {"GH200": 96, "A100 SXM4 40GB": 40, "A100 SXM4 80GB": 80, "H100": 80, "H200": 141, "L40S": 48,
              "A10G": 24, "4090": 24, "V100": 32, "MI300X": 192}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_unit_sanity_against_published_figures(name):
    p = load_profile(name)
    gbps_node, gpus = INTER_NODE_GBPS_PER_NODE[name]
    assert p.node.gpus_per_node == gpus
    # Gb/s per node -> GB/s per GPU: / 8 bits, / GPUs sharing the node's NICs.
    assert p.inter_node.bandwidth_GBps_per_gpu == pytest.approx(gbps_node / 8 / gpus)
    assert p.inter_node_Gbps_per_node == pytest.approx(gbps_node)
    if name in INTRA_NODE_BIDIR_GBPS:
        assert p.intra_node.bandwidth_GBps_per_gpu == pytest.approx(INTRA_NODE_BIDIR_GBPS[name] / 2)
    assert p.gpu.memory_bytes == MEMORY_BYTES[name]
    nominal = next(v for k, v in NOMINAL_GB.items() if k in p.gpu.name)
    # GiB-nominal HBM minus driver reservations: between 0.93 x nominal GiB and nominal GiB.
    assert 0.93 * nominal * GiB <= p.gpu.memory_bytes <= nominal * GiB * 1.0001
    assert 0 < p.intra_node.efficiency <= 1 and 0 < p.inter_node.efficiency <= 1
    # of the churned bytes: between what the two calibrating sources pin (tests/test_published_memory.py)
    assert 0.14 <= p.overhead.fragmentation_fraction <= 0.58
    assert 0.5 * GiB <= p.overhead.cuda_context_bytes + p.overhead.nccl_bytes <= 2 * GiB


def test_published_peak_flops_and_bandwidths():
    h100 = load_profile("dgx-h100").gpu
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)  # H100 SXM5 dense BF16 (whitepaper)
    assert h100.peak_flops["fp8"] == pytest.approx(1978.9e12)
    assert h100.hbm_bandwidth_GBps == pytest.approx(3352, rel=0.01)
    a100 = load_profile("dgx-a100-80gb").gpu
    assert a100.peak_flops["bf16"] == pytest.approx(312e12) and a100.hbm_bandwidth_GBps == pytest.approx(2039)
    assert "bf16" not in load_profile("dgx-1-v100").gpu.peak_flops  # Volta has no BF16
    assert load_profile("hgx-h200").gpu.hbm_bandwidth_GBps == pytest.approx(4800)
    # GH200: NVLink-C2C 900 GB/s bidirectional -> 450 GB/s host<->GPU per direction.
    assert load_profile("gh200").node.pcie_bandwidth_GBps_per_gpu == pytest.approx(900 / 2)
    # PCIe 5.0 x16: 32 GT/s * 16 lanes * 128/130 / 8 bits.
    assert load_profile("dgx-h100").node.pcie_bandwidth_GBps_per_gpu == pytest.approx(32 * 16 * 128 / 130 / 8, rel=0.01)
    assert load_profile("dgx-a100-80gb").node.host_ram_bytes == 2 * 2**40
    assert load_profile("aws-p4d").node.host_ram_bytes == 1152 * GiB


# ---------------------------------------------------------------- TOML round trip


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_toml_round_trip_is_exact(name):
    p = load_profile(name)
    text = profile_to_toml(p)
    assert tomllib.loads(text) == _raw(name)
    again = HardwareProfile.model_validate(tomllib.loads(text))
    assert again.model_dump() == p.model_dump()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    text=st.text(max_size=40),
    bw=st.floats(min_value=50, max_value=20000, allow_nan=False),
    flops=st.floats(min_value=1e12, max_value=1e16),
    lat=st.floats(min_value=0.1, max_value=1000),
)
def test_toml_writer_round_trips_any_text_and_float(text, bw, flops, lat):
    base = load_profile("dgx-h100")
    p = base.model_copy(update={
        "description": text,
        "gpu": base.gpu.model_copy(update={"hbm_bandwidth_GBps": bw, "peak_flops": {"bf16": flops}}),
        "inter_node": base.inter_node.model_copy(update={"latency_us": lat}),
        "sources": {**base.sources, "gpu.peak_flops": text + "!"},
    })
    again = HardwareProfile.model_validate(tomllib.loads(profile_to_toml(p)))
    assert again.model_dump() == p.model_dump()


def test_save_profile_writes_atomically_and_reloads(tmp_path):
    p = load_profile("aws-p5")
    out = save_profile(p, tmp_path / "p5-copy.toml")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p5-copy.toml"]
    q = load_profile(str(out))
    assert q.model_dump() == p.model_dump() and q.path == str(out)
    bad = p.model_copy(update={"sources": {k: v for k, v in p.sources.items() if k != "node.host_ram_bytes"}})
    with pytest.raises(InputError, match="node.host_ram_bytes has no source"):
        save_profile(bad, tmp_path / "bad.toml")
    assert not (tmp_path / "bad.toml").exists()


# ---------------------------------------------------------------- user files: errors


def _user_file(tmp_path: Path, mutate) -> Path:
    raw = _raw("h100-8x-ib400")
    mutate(raw)
    return _write(tmp_path, _dump_raw(raw))


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_gbit_written_as_gbyte_per_gpu_is_rejected_with_hint(tmp_path):
    # 3200 Gb/s per node written as GB/s per GPU on the intra tier (bound 2000) ...
    f = _user_file(tmp_path, lambda r: r["intra_node"].update(bandwidth_GBps_per_gpu=3200.0))
    res = _run("profiles", "show", str(f))
    assert res.exit_code == 2, res.output
    assert str(f) in res.output and "intra_node.bandwidth_GBps_per_gpu" in res.output
    assert "Gb/s vs GB/s" in res.output and "per-GPU" in res.output
    assert "Traceback" not in res.output
    # ... and a 400 Gb/s NIC written as 400 GB/s per GPU on the inter-node tier.
    f2 = _user_file(tmp_path, lambda r: r["inter_node"].update(bandwidth_GBps_per_gpu=400.0))
    res = _run("profiles", "show", str(f2))
    assert res.exit_code == 2 and "inter_node.bandwidth_GBps_per_gpu" in res.output and "= 400" in res.output


def test_user_file_loads_when_correct(tmp_path):
    f = _user_file(tmp_path, lambda r: r.update(name="my-cluster"))
    res = _run("profiles", "show", str(f), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["name"] == "my-cluster" and d["path"] == str(f)


def test_malformed_toml_names_file_and_line(tmp_path):
    f = _write(tmp_path, 'name = "x"\ndescription = "y"\n[gpu\nname = "z"\n')
    res = _run("profiles", "show", str(f))
    assert res.exit_code == 2
    assert str(f) in res.output and "line 3" in res.output


def test_unknown_key_is_rejected(tmp_path):
    f = _user_file(tmp_path, lambda r: r["node"].update(host_ram_gb=2048))
    res = _run("profiles", "show", str(f))
    assert res.exit_code == 2 and "node.host_ram_gb" in res.output and str(f) in res.output
    f2 = _user_file(tmp_path, lambda r: r["gpu"]["peak_flops"].update(int4=1e15))
    res = _run("profiles", "show", str(f2))
    assert res.exit_code == 2 and "gpu.peak_flops.int4" in res.output


def test_missing_source_names_file_and_key(tmp_path):
    f = _user_file(tmp_path, lambda r: r["sources"].pop("inter_node.latency_us"))
    res = _run("profiles", "show", str(f))
    assert res.exit_code == 2 and str(f) in res.output and "inter_node.latency_us has no source" in res.output
    f2 = _user_file(tmp_path, lambda r: r["sources"].update({"gpu.memory_gb": "typo"}))
    res = _run("profiles", "show", str(f2))
    assert res.exit_code == 2 and "gpu.memory_gb" in res.output


def test_wrong_type_names_key_value_and_expected(tmp_path):
    f = _user_file(tmp_path, lambda r: r["gpu"].update(memory_bytes="80GB"))
    res = _run("profiles", "show", str(f))
    assert res.exit_code == 2
    assert "gpu.memory_bytes" in res.output and "'80GB'" in res.output and "integer" in res.output
    assert len(res.output.strip().splitlines()) <= 3  # one line (rich may wrap long lines)
    text = _dump_raw(_raw("h100-8x-ib400")).replace("cpu_cores = 112", "cpu_cores = true")
    with pytest.raises(InputError, match="node.cpu_cores = true"):
        load_profile(str(_write(tmp_path, text, "bool.toml")))


@pytest.mark.parametrize("value,expected", [("ring", " = 'ring' is invalid; expected a list"),
                                            (["ring", 3], ".1 = 3 is invalid; expected a string")])
def test_algorithms_of_the_wrong_type_say_what_was_expected(tmp_path, value, expected):
    """A string for the list said "expected Input should be a valid list" (pydantic's message pasted in)."""
    f = _user_file(tmp_path, lambda r: r["intra_node"].update(algorithms=value))
    with pytest.raises(InputError, match=re.escape(f"intra_node.algorithms{expected}")):
        load_profile(str(f))


@pytest.mark.parametrize(
    "section,key,value,fragment",
    [
        ("gpu", "memory_bytes", 80, "bytes"),  # 80 "GB" written as bytes
        ("gpu", "hbm_bandwidth_GBps", 3.35, "TB/s"),  # TB/s written as GB/s
        ("inter_node", "efficiency", 0.0, "[0.01, 1]"),
        ("intra_node", "efficiency", 1.2, "[0.01, 1]"),
        ("inter_node", "efficiency", 1e-308, "[0.01, 1]"),  # was accepted: every collective took inf seconds
        ("intra_node", "efficiency", 0.008, "[0.01, 1]"),  # 0.8 written as a percentage of a percent
        ("inter_node", "latency_us", 0.005, "microseconds"),  # 5 ns: seconds/us confusion
        ("intra_node", "latency_us", 50000.0, "microseconds"),  # 50 us written in ns
        ("overhead", "fragmentation_fraction", 10.0, "fraction"),  # a percentage
    ],
)
def test_sanity_bounds(tmp_path, section, key, value, fragment):
    f = _user_file(tmp_path, lambda r: r[section].update({key: value}))
    with pytest.raises(InputError) as e:
        load_profile(str(f))
    msg = str(e.value)
    assert str(f) in msg and f"{section}.{key}" in msg and fragment in msg


def test_unknown_profile_name_suggests_close_names():
    res = _run("profiles", "show", "dgx-h10")
    assert res.exit_code == 2 and "dgx-h100" in res.output
    res = _run("profiles", "show", "no/such/file.toml")
    assert res.exit_code == 2 and "not found" in res.output


# ---------------------------------------------------------------- CLI


def test_cli_list_table_and_json():
    res = _run("profiles", "list")
    assert res.exit_code == 0, res.output
    for name in REQUIRED:
        assert name in res.stdout
    assert "GiB" in res.stdout and "GB/s" in res.stdout and "Gb/s" in res.stdout
    res = _run("profiles", "list", "--json")
    assert res.exit_code == 0
    d = json.loads(res.stdout)
    by = {p["name"]: p for p in d["profiles"]}
    assert REQUIRED <= set(by)
    assert by["h100-8x-100gbe"]["derived"]["inter_node_Gbps_per_node"] == pytest.approx(100)
    assert by["dgx-h100"]["derived"]["inter_node_Gbps_per_node"] == pytest.approx(3200)
    assert by["dgx-h100"]["gpu"]["memory_bytes"] == 81559 * MiB


def test_cli_show_prints_units_and_sources():
    res = _run("profiles", "show", "dgx-h100")
    assert res.exit_code == 0, res.output
    out = res.stdout
    for field in ("gpu.memory_bytes", "node.host_ram_bytes", "intra_node.bandwidth_GBps_per_gpu",
                  "inter_node.efficiency", "overhead.fragmentation_fraction"):
        assert field in out
    assert "79.65 GiB" in out and "85.52 GB" in out and "µs" in out
    assert "nvidia-smi" in out and "ConnectX-7" in out  # sources shown
    res = _run("profiles", "show", "dgx-h100", "--json")
    d = json.loads(res.stdout)
    assert d["inter_node"]["bandwidth_GBps_per_gpu"] == 50 and "sources" in d


def test_planning_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import zeroplan.specs.hardware as h, zeroplan.commands.profiles\n"
        "h.list_profiles(); h.load_profile('dgx-h100')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(_bundled_files()))
def test_show_lists_every_field_of_the_profile(name):
    """`profiles show` has a row for every numeric field a profile sets (optional ones included)."""
    from zeroplan.commands.profiles import _rows
    from zeroplan.specs.hardware import numeric_field_paths

    p = load_profile(name)
    shown = {path for path, _ in _rows(p)}
    flops = {f"gpu.peak_flops.{k}" for k in p.gpu.peak_flops}
    missing = [f for f in numeric_field_paths(p) if f not in shown and f not in flops]
    assert not missing, f"{name}: profiles show leaves out {missing}"
    for tier in ("intra_node", "inter_node"):
        if getattr(p, tier).algorithms is not None:
            assert f"{tier}.algorithms" in shown
