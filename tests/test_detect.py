"""`zeroplan detect` through a fake NVML built on pynvml's real error classes.

Expected values come from published facts: nvidia-smi reports 81559 MiB on an H100 SXM5 80GB and
24564 MiB on an RTX 4090; an H100 SXM has 18 NVLink4 links (NVIDIA H100 datasheet), a DGX H100
has 4 NVSwitch chips; GeForce cards have no NVLink (NVML answers NotSupported).
"""

from __future__ import annotations

import ctypes.util
import json
import tomllib
from types import SimpleNamespace

import pynvml
import pytest
from typer.testing import CliRunner

import zeroplan.inspect.detect as det
from zeroplan.cli import app
from zeroplan.inspect.detect import NoNvidiaGPU, detect_node

MiB = 2**20
H100_MEM = 81559 * MiB
RTX4090_MEM = 24564 * MiB
DGX_BUS = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
           "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"]
NVSWITCH_BUS = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"]
MEMINFO_KB = 2_113_330_512  # a DGX H100 (2 TB) MemTotal line, kB = KiB


class FakeNVML:
    """pynvml's API for a made-up node. ``unsupported``: function names that raise NotSupported."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS  # 36 in current bindings

    def __init__(self, gpus, *, init_error=None, unsupported=(), driver="550.54.15", cuda=12040, missing=()):
        self.gpus = gpus
        self.init_error = init_error
        self.unsupported = set(unsupported)
        self.driver = driver
        self.cuda = cuda
        self.shutdown_called = False
        for name in missing:  # functions an older pynvml lacks
            setattr(self, name, None)

    def _chk(self, fn):
        if fn in self.unsupported:
            raise pynvml.NVMLError_NotSupported()

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["mem"], free=h["mem"] - 500 * MiB, used=500 * MiB)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=h["bus"].encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h["links"] == 0:
            raise pynvml.NVMLError_NotSupported()
        if link >= h["links"]:
            raise pynvml.NVMLError_InvalidArgument()
        return 1 if link not in h.get("down", ()) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=NVSWITCH_BUS[link % 4].encode())

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        self._chk("pcie")
        return h["pcie"][0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        self._chk("pcie")
        return h["pcie"][1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        self._chk("pcie")
        return h["pcie"][2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        self._chk("pcie")
        return h["pcie"][3]

    def nvmlDeviceGetNumaNodeId(self, h):
        self._chk("numa")
        return h["numa"]

    def nvmlDeviceGetCpuAffinity(self, h, size):
        self._chk("affinity")
        return [h["affinity"]] + [0] * (size - 1)


def h100_node(**kw):
    gpus = [dict(name="NVIDIA H100 80GB HBM3", mem=H100_MEM, bus=DGX_BUS[i], links=18, pcie=(1, 5, 16, 16),
                 numa=0 if i < 4 else 1, affinity=0xFF << (8 * (i // 4))) for i in range(8)]
    return FakeNVML(gpus, **kw)


def rtx4090_node(**kw):
    gpus = [dict(name="NVIDIA GeForce RTX 4090", mem=RTX4090_MEM, bus=f"00000000:{0x17 + 0x20 * i:02X}:00.0",
                 links=0, pcie=(4, 4, 16, 16), numa=0, affinity=0xFFFF) for i in range(8)]
    return FakeNVML(gpus, **kw)


@pytest.fixture
def host_files(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {MEMINFO_KB} kB\nMemFree:        1000 kB\n")
    cpuinfo = tmp_path / "cpuinfo"
    blocks = []
    for phys, core in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (1, 1)]:  # 4 cores + 2 hyperthreads
        blocks.append(f"processor\t: {len(blocks)}\nphysical id\t: {phys}\ncore id\t\t: {core}\n")
    cpuinfo.write_text("\n".join(blocks))
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    monkeypatch.setattr(det, "MEMINFO_PATH", str(meminfo))
    monkeypatch.setattr(det, "CPUINFO_PATH", str(cpuinfo))
    monkeypatch.setattr(det, "SYSFS_ROOT", str(sysfs))
    return tmp_path


def test_h100_node_matches_an_h100_profile(host_files):
    fake = h100_node()
    r = detect_node(fake, hostname="dgx-07")
    assert fake.shutdown_called
    assert r.gpu_count == 8 and r.driver_version == "550.54.15" and r.cuda_driver_version == "12.4"
    g = r.gpus[5]
    assert g.memory_bytes == H100_MEM and g.pci_bus_id == DGX_BUS[5]
    assert (g.nvlink_active, g.nvlink_total) == (18, 18)
    assert sorted(g.nvlink_remote_bus_ids) == NVSWITCH_BUS
    assert (g.pcie_gen_current, g.pcie_gen_max, g.pcie_width_current, g.pcie_width_max) == (1, 5, 16, 16)
    assert g.numa_node == 1 and g.cpu_affinity == "8-15"
    assert r.nvlink is True
    assert r.host_ram_bytes == MEMINFO_KB * 1024
    assert r.cpu_cores == 4
    assert r.match is not None and "H100" in r.match.name.upper() + " " + r.match.reason
    from zeroplan.specs.hardware import load_profile

    best = load_profile(r.match.name)
    assert "H100" in best.gpu.name and best.node.gpus_per_node == 8
    assert "nvlink" in best.intra_node.name.lower()
    assert r.match.score > 90
    # a node the profile cannot tell apart from others says so
    assert all("H100" in load_profile(n).gpu.name for n in r.match.ties)


def test_rtx4090_node_matches_the_workstation_profile(host_files):
    r = detect_node(rtx4090_node(), hostname="ws")
    assert r.nvlink is False
    assert all(g.nvlink_total == 0 and g.nvlink_active == 0 for g in r.gpus)
    assert r.gpus[0].memory_bytes == RTX4090_MEM
    assert r.match is not None and r.match.name == "rtx4090-8x-workstation"
    # the second best is not another 4090 profile: the GPU model dominates the score
    assert r.candidates[1].score < r.match.score


def test_link_down_counts_as_present_but_inactive(host_files):
    fake = h100_node()
    fake.gpus[0]["down"] = {3, 4}
    r = detect_node(fake, hostname="x")
    assert (r.gpus[0].nvlink_active, r.gpus[0].nvlink_total) == (16, 18)


def test_not_supported_queries_are_tolerated(host_files):
    fake = h100_node(unsupported={"pcie", "numa", "affinity"})
    r = detect_node(fake, hostname="x")
    g = r.gpus[0]
    assert g.pcie_gen_current is None and g.pcie_gen_max is None and g.pcie_width_max is None
    assert g.numa_node is None and g.cpu_affinity is None
    assert g.memory_bytes == H100_MEM  # the rest still read


def test_functions_missing_from_older_pynvml_fall_back(host_files):
    fake = h100_node(missing=("nvmlDeviceGetNumaNodeId", "nvmlSystemGetCudaDriverVersion_v2"))
    dev = host_files / "sys" / "bus" / "pci" / "devices" / "0000:9a:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    r = detect_node(fake, hostname="x")
    assert r.gpus[4].numa_node == 1  # from sysfs
    assert r.gpus[0].numa_node is None  # neither NVML nor sysfs
    assert r.cuda_driver_version is None


def test_cpu_affinity_ranges():
    # bits 0-7 and 16-23 of word 0, bit 0 of word 1 (= CPU 64)
    assert det._cpu_list([0x00FF00FF, 0x1]) == "0-7,16-23,64"
    assert det._cpu_list([0]) is None


def test_library_not_found_raises_one_line(host_files):
    fake = h100_node(init_error=pynvml.NVMLError_LibraryNotFound())
    with pytest.raises(NoNvidiaGPU) as ei:
        detect_node(fake)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("no NVIDIA driver found (NVML: NVML Shared Library Not Found)")
    assert "detect needs a machine with NVIDIA GPUs" in msg


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA driver is installed")
def test_real_pynvml_without_driver_exits_2():
    res = CliRunner().invoke(app, ["detect"])
    assert res.exit_code == 2
    assert "no NVIDIA driver found" in res.output
    assert "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def _cli(monkeypatch, fake, args):
    monkeypatch.setattr(det, "_load_pynvml", lambda: fake)
    return CliRunner().invoke(app, ["detect", *args])


def test_cli_library_not_found_exit_2(host_files, monkeypatch):
    res = _cli(monkeypatch, h100_node(init_error=pynvml.NVMLError_DriverNotLoaded()), [])
    assert res.exit_code == 2, res.output
    assert "no NVIDIA driver found (NVML: Driver Not Loaded)" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_cli_zero_gpus_exit_2(host_files, monkeypatch):
    res = _cli(monkeypatch, FakeNVML([]), ["--json"])
    assert res.exit_code == 2
    assert "no NVIDIA GPU found" in res.output


def test_cli_table_and_json(host_files, monkeypatch):
    res = _cli(monkeypatch, rtx4090_node(), [])
    assert res.exit_code == 0, res.output
    assert "RTX 4090" in res.output and "rtx4090-8x-workstation" in res.output
    res = _cli(monkeypatch, h100_node(), ["--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["gpu_count"] == 8 and data["gpus"][0]["nvlink_total"] == 18
    assert data["gpus"][0]["memory_bytes"] == H100_MEM
    assert data["saved_profile"] is None
    assert "H100" in data["match"]["reason"]


def test_save_profile_round_trips(host_files, monkeypatch, tmp_path):
    from zeroplan.specs.hardware import load_profile

    out = tmp_path / "node.toml"
    res = _cli(monkeypatch, h100_node(), ["--save-profile", str(out), "--name", "my-dgx", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["saved_profile"] == str(out)
    tomllib.loads(out.read_text())  # plain TOML
    p = load_profile(str(out))
    assert p.name == "my-dgx"
    assert p.gpu.name == "NVIDIA H100 80GB HBM3"
    assert p.gpu.memory_bytes == H100_MEM
    assert p.node.gpus_per_node == 8
    assert p.node.host_ram_bytes == MEMINFO_KB * 1024
    assert p.node.cpu_cores == 4
    for k in ("bandwidth_GBps_per_gpu", "latency_us", "efficiency"):
        assert p.sources[f"inter_node.{k}"].startswith(
            "unmeasured: run `zeroplan bench collectives --save-profile` across nodes to fill")
    assert p.inter_node.name.startswith("UNMEASURED")
    assert "zeroplan detect" in p.sources["gpu.memory_bytes"]
    # no temp files left behind by the atomic write
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".node.toml")) == []


def test_save_profile_4090_keeps_no_nvlink_intra(host_files, monkeypatch, tmp_path):
    from zeroplan.specs.hardware import load_profile

    out = tmp_path / "ws.toml"
    res = _cli(monkeypatch, rtx4090_node(), ["--save-profile", str(out)])
    assert res.exit_code == 0, res.output
    p = load_profile(str(out))
    assert p.gpu.memory_bytes == RTX4090_MEM and "nvlink" not in p.intra_node.name.lower().replace("no nvlink", "")
    assert p.name.endswith("-detected")


def test_save_profile_into_missing_dir_exit_2(host_files, monkeypatch, tmp_path):
    res = _cli(monkeypatch, h100_node(), ["--save-profile", str(tmp_path / "nope" / "x.toml")])
    assert res.exit_code == 2
    assert "does not exist" in res.output
