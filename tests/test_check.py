"""`zeroplan check` (the CI gate) through the CLI runner: verdicts, rules, formats, exit codes.

Expected verdicts come from closed forms written here, not from zeroplan's numbers: e.g. a ZeRO-1
config of Llama-2-70B (68,976,648,192 parameters, the published count) keeps the 16-bit parameters
and gradients replicated, 4 bytes × Ψ = 275.9 GB per GPU, which no 80 GB GPU holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app
from zeroplan.report.formats import escape_github_data, escape_github_property, find_key_line, key_lines

runner = CliRunner()
EX = Path(__file__).resolve().parent.parent / "examples" / "configs"
P70 = 68_976_648_192  # Llama-2-70B parameters (published)
P7 = 6_738_415_616  # Llama-2-7B parameters (published)
H100_BYTES = 81_559 * 2**20  # nvidia-smi memory.total of an H100 SXM5 80GB
A100_BYTES = 80 * 2**30

GITHUB_RE = re.compile(r"^::(error|warning|notice) file=[^,:\n]+(,line=\d+)?,title=(ZP|DS)\d{3}::[^\n]+$")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def check_json(*args):
    r = run("check", *args, "--format", "json")
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def rules_of(report, name):
    (f,) = [f for f in report["files"] if f["path"].endswith(name)]
    return f, {x["rule_id"] for x in f["findings"]}


# --------------------------------------------------------------------------------------------
# Verdicts and findings on the example configs
# --------------------------------------------------------------------------------------------

def test_7b_on_one_dgx_a100_examples():
    # micro-batch 4 × 2048 tokens without recomputation needs ~43 GB of activations for 7B, and
    # with gradient accumulation the accumulated 16-bit gradients (13.5 GB) are live in forward:
    # the examples assume full activation checkpointing
    code, rep = check_json("--glob", EX / "*.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb", "--nodes", "1",
                           "--checkpointing", "full")
    assert code == 1 and rep["verdict"] == "fail" and rep["exit_code"] == 1
    assert len(rep["files"]) == 7
    # broken.json: five mistakes + the comment/trailing comma
    f, r = rules_of(rep, "broken.json")
    assert f["verdict"] == "fail"
    assert {"DS001", "DS002", "DS004", "DS005", "DS008", "DS011"} <= r
    lines = {x["rule_id"]: x["line"] for x in f["findings"]}
    text = (EX / "broken.json").read_text().splitlines()
    assert "contigous_gradients" in text[lines["DS001"] - 1]
    assert "allgather_bucket_size" in text[lines["DS004"] - 1]
    # stage 2 with gradient_accumulation_steps 8 where stage 1 fits (7B bf16 stage 1: 4Ψ + 12Ψ/8 = 37 GB)
    assert 4 * P7 + 12 * P7 // 8 < 0.9 * A100_BYTES
    assert "ZP204" in r
    # every other example passes on 7B (stage-1 model states 5.5Ψ = 37 GB at most); no OOM anywhere
    for name in ("zero1-bf16.json", "zero2-bf16.json", "zero3-zeropp.json", "zero3-offload.json",
                 "seed-zero2-offload.json", "hf-zero3-auto.json"):
        f, r = rules_of(rep, name)
        assert f["verdict"] == "pass", (name, f["findings"])
        assert "ZP101" not in r
    # the seed's ZeRO-2 + CPU offload: fp32 (no bf16 block), stage 2 states 4Ψ + 16Ψ/8 = 40.4 GB fit
    # without offload -> offload is flagged as unnecessary
    assert 4 * P7 + 16 * P7 // 8 < 0.9 * A100_BYTES
    f, r = rules_of(rep, "seed-zero2-offload.json")
    assert "ZP302" in r and f["plan"]["precision"] == "fp32" and f["plan"]["offload_optimizer"] == "cpu"
    # stage 3 + full offload on 7B: stage 1 fits and offload is not needed
    f, r = rules_of(rep, "zero3-offload.json")
    assert {"ZP301", "ZP302"} <= r
    # HF "auto" values resolved with the model's hidden size (4096² = 16,777,216)
    f, r = rules_of(rep, "hf-zero3-auto.json")
    assert any(x["rule_id"] == "DS006" and "16777216" in x["message"] for x in f["findings"])


@pytest.mark.parametrize("hw,ethernet", [("h100-8x-100gbe", True), ("h100-8x-ib400", False)])
def test_70b_on_four_h100_nodes(hw, ethernet):
    code, rep = check_json(EX / "zero1-bf16.json", EX / "zero2-bf16.json", EX / "seed-zero2-offload.json",
                           EX / "zero3-offload.json", EX / "zero3-zeropp.json",
                           "-m", "llama-2-70b", "-H", hw, "--nodes", "4", "--checkpointing", "full")
    assert code == 1
    # replicated 16-bit parameters alone exceed the GPU: 2Ψ = 138 GB (stage 1/2), 4Ψ in fp32 (seed config)
    assert 2 * P70 > H100_BYTES
    for name in ("zero1-bf16.json", "zero2-bf16.json", "seed-zero2-offload.json"):
        f, r = rules_of(rep, name)
        assert f["verdict"] == "fail" and "ZP101" in r
        (zp101,) = [x for x in f["findings"] if x["rule_id"] == "ZP101"]
        assert zp101["severity"] == "error" and "OOM" in zp101["message"]
        assert f["plan"]["peak_bytes"] > 2 * P70
    # stage 3 with CPU offload of params and optimizer: 16Ψ/32 = 34 GB of states leave the GPU
    f, r = rules_of(rep, "zero3-offload.json")
    assert f["verdict"] == "pass"
    for name in ("zero3-offload.json", "zero3-zeropp.json"):
        f, r = rules_of(rep, name)
        assert ("ZP202" in r) == ethernet
    if ethernet:
        f, r = rules_of(rep, "zero3-offload.json")
        assert "ZP201" in r  # parameter gathers over 1.56 GB/s per GPU dominate the step


def test_fail_on_warning_turns_warnings_into_failure():
    args = [EX / "zero3-offload.json", "-m", "llama-2-70b", "-H", "h100-8x-100gbe", "--nodes", "4",
            "--checkpointing", "full"]
    assert run("check", *args).exit_code == 0
    r = run("check", *args, "--fail-on", "warning")
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.output and "ZP202" in r.output


# --------------------------------------------------------------------------------------------
# Individual rules on small configs
# --------------------------------------------------------------------------------------------

def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj, indent=2))
    return p


BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}


def test_zp102_gather_phase_oom(tmp_path):
    # one-shot prefetch of the whole 70B model: 2Ψ = 138 GB gathered, while states are 16Ψ/32 = 34 GB
    p = write(tmp_path, "z3big.json", BASE | {"zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 1e11, "stage3_max_live_parameters": 1e11}})
    code, rep = check_json(p, "-m", "llama-2-70b", "-H", "h100-8x-ib400", "--nodes", "4", "--checkpointing", "full")
    f, r = rules_of(rep, "z3big.json")
    assert code == 1 and {"ZP101", "ZP102"} <= r
    (zp,) = [x for x in f["findings"] if x["rule_id"] == "ZP102"]
    assert "gather" in zp["message"] and "`" in zp["message"]  # names the module
    assert zp["line"] == 1 + next(i for i, l in enumerate(p.read_text().splitlines()) if "prefetch" in l)


def test_zp103_low_headroom():
    code, rep = check_json(EX / "zero1-bf16.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb", "--seq-len", "896")  # 4.1 GB free with the traced activations
    f, r = rules_of(rep, "zero1-bf16.json")
    assert code == 0 and "ZP103" in r and "ZP101" not in r
    assert 0 < f["plan"]["headroom_bytes"] < 0.1 * A100_BYTES


def test_zp104_host_ram_and_zp105_nvme(tmp_path):
    # 70B with optimizer + params on the host of one 8-GPU node: at least 16Ψ = 1.1 TB > 768 GiB
    code, rep = check_json(EX / "zero3-offload.json", "-m", "llama-2-70b", "-H", "aws-g5-48xlarge", "--nodes", "1",
                           "--checkpointing", "full")
    f, r = rules_of(rep, "zero3-offload.json")
    assert 16 * P70 > 768 * 2**30
    assert code == 1 and "ZP104" in r
    # 1T parameters to NVMe on one node: (12 + 4 + 2) bytes × 1e12 = 18 TB > 8 TB
    p = write(tmp_path, "nvme.json", BASE | {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}})
    code, rep = check_json(p, "-m", "1T", "-H", "rtx4090-8x-workstation", "--nodes", "1", "--checkpointing", "full")
    f, r = rules_of(rep, "nvme.json")
    assert code == 1 and "ZP105" in r


def test_zp203_latency_bound_buckets(tmp_path):
    # Tiny buckets (10,000 elements: every gpt2 parameter becomes its own bucket, 162 calls per step)
    # across 8 EFA nodes: EFA's small-message latency (164 us for 8 bytes on 2 nodes, more across 8)
    # is most of each call. On InfiniBand (~20 us) the same per-parameter buckets of 1-15 MB are
    # bandwidth-bound, so the scenario needs the high-latency transport.
    p = write(tmp_path, "tiny.json", BASE | {"zero_optimization": {"stage": 2, "reduce_bucket_size": 10000}})
    code, rep = check_json(p, "-m", "gpt2", "-H", "aws-p4d", "--nodes", "8")
    assert "ZP203" in rules_of(rep, "tiny.json")[1]
    p = write(tmp_path, "big.json", BASE | {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}})
    code, rep = check_json(p, "-m", "gpt2", "-H", "aws-p4d", "--nodes", "8")
    assert "ZP203" not in rules_of(rep, "big.json")[1]
    p = write(tmp_path, "ib.json", BASE | {"zero_optimization": {"stage": 2, "reduce_bucket_size": 10000}})
    code, rep = check_json(p, "-m", "gpt2", "-H", "h100-8x-ib400", "--nodes", "2")
    assert "ZP203" not in rules_of(rep, "ib.json")[1]


def test_malformed_config_is_a_finding_with_a_line(tmp_path):
    p = tmp_path / "bad.json"
    # (a missing comma at a line end is valid hjson, which DeepSpeed accepts: a stray "]" is not)
    p.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n    ]\n  }\n}\n')
    code, rep = check_json(p, "-m", "llama-2-7b", "-H", "dgx-a100-80gb")
    f, r = rules_of(rep, "bad.json")
    assert code == 1 and r == {"ZP000"} and f["error"]
    assert f["findings"][0]["line"] in (3, 4)


# --------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------

def test_junit_validates(tmp_path):
    out = tmp_path / "report.xml"
    r = run("check", "--glob", EX / "*.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb", "--format", "junit",
            "--output", out)
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.stdout and "<testsuites" not in r.stdout  # report went to the file
    root = ET.fromstring(out.read_text())
    assert root.tag == "testsuites"
    for a in ("tests", "failures", "errors"):
        assert root.get(a) is not None and int(root.get(a)) >= 0
    suites = root.findall("testsuite")
    assert len(suites) == 7
    tot_tests = tot_fail = 0
    for s in suites:
        for a in ("name", "tests", "failures", "errors"):
            assert s.get(a) is not None
        cases = s.findall("testcase")
        assert int(s.get("tests")) == len(cases) > 0
        fails = [c for c in cases if c.find("failure") is not None]
        assert int(s.get("failures")) == len(fails)
        for c in cases:
            assert c.get("name") and c.get("classname")
            for fl in c.findall("failure"):
                assert fl.get("message") and fl.get("type")
        tot_tests += len(cases)
        tot_fail += len(fails)
    assert int(root.get("tests")) == tot_tests and int(root.get("failures")) == tot_fail
    broken = [s for s in suites if s.get("name").endswith("broken.json")][0]
    failing = {c.get("name").split()[0] for c in broken.findall("testcase") if c.find("failure") is not None}
    assert {"DS001", "DS004", "DS005", "DS008"} <= failing
    assert "ZP101" in {c.get("name").split()[0] for c in broken.findall("testcase")}  # evaluated, passing


def test_github_annotations_syntax():
    r = run("check", EX / "broken.json", EX / "zero3-offload.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb",
            "--format", "github")
    assert r.exit_code == 1
    ann = [l for l in r.stdout.splitlines() if l.startswith("::")]
    assert len(ann) >= 8
    for l in ann:
        assert GITHUB_RE.match(l), l
    assert any(l.startswith("::error ") and "title=DS005" in l for l in ann)
    assert any(l.startswith("::warning ") and "title=ZP302" in l for l in ann)
    assert any(l.startswith("::notice ") or l.startswith("::warning ") for l in ann if "ZP301" in l)


def test_github_escaping():
    assert escape_github_data("50% done\r\nnext") == "50%25 done%0D%0Anext"
    assert escape_github_property("a:b,c%") == "a%3Ab%2Cc%25"


def test_json_format_and_text_format():
    code, rep = check_json(EX / "zero1-bf16.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb", "--checkpointing", "full")
    assert code == 0 and rep["verdict"] == "pass" and rep["fail_on"] == "error"
    plan = rep["files"][0]["plan"]
    for k in ("peak_bytes", "gpu_memory_bytes", "headroom_bytes", "comm_bytes_per_gpu_per_step"):
        assert isinstance(plan[k], int)
    assert plan["stage"] == 1 and plan["micro_batch"] == 4
    r = run("check", EX / "zero1-bf16.json", EX / "broken.json", "-m", "llama-2-7b", "-H", "dgx-a100-80gb",
            "--checkpointing", "full")
    assert r.exit_code == 1
    assert "PASS" in r.output and "FAIL" in r.output and "broken.json" in r.output


@pytest.mark.parametrize("args,needle", [
    (["--glob", "nothing/*.json", "-m", "7B", "-H", "dgx-h100"], "matches no file"),
    (["nothing/*.json", "-m", "7B", "-H", "dgx-h100"], "--glob"),
    (["missing.json", "-m", "7B", "-H", "dgx-h100"], "not found"),
    ([EX / "zero1-bf16.json", "-m", "llama-2-7x", "-H", "dgx-h100"], "llama-2-7"),
    ([EX / "zero1-bf16.json", "-m", "7B", "-H", "no-such-profile"], "no-such-profile"),
    ([EX / "zero1-bf16.json", "-m", "7B"], "--hardware"),
    ([EX / "zero1-bf16.json", "-m", "7B", "-H", "dgx-h100", "--format", "xml"], "--format"),
    ([EX / "zero1-bf16.json", "-m", "7B", "-H", "dgx-h100", "--fail-on", "fatal"], "--fail-on"),
])
def test_bad_input_exit_2(args, needle):
    r = run("check", *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_key_lines_with_comments_and_arrays():
    text = '{\n  // comment "x": 1\n  "a": {\n    "b": [1, {"c": 2}],\n    /* "d": */ "stage3_prefetch_bucket_size": 5\n  },\n  "e": "f:g"\n}\n'
    lines = key_lines(text)
    assert lines == {"a": 3, "a.b": 4, "a.b.c": 4, "a.stage3_prefetch_bucket_size": 5, "e": 7}
    assert find_key_line(lines, "a.prefetch_bucket_size") == 5
    assert find_key_line(lines, "a.missing") == 3
    assert find_key_line(lines, "zz") is None
