"""What the adversarial sweep of stop 27 left accepted in silence, and the numbers CPython cannot read.

Each case failed before its fix: a traceback (a number of over 4,300 digits in a config.json, a
hardware TOML, a training YAML, or an NCCL log), a value planned as if it were meaningful
(``--lora-alpha nan``, LoRA flags with ``--method full``, an NCCL record of ``nranks=0``), an
offload option that did nothing without saying so, or a ``bench zero`` that started ranks for a
sequence no host could hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
HUGE = "9" * 5000  # CPython's int() refuses over 4,300 digits (sys.get_int_max_str_digits)
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 100, "intermediate_size": 128}


def _cli(args: list[str]):
    return runner.invoke(app, args, catch_exceptions=True)


def _rejected(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-800:])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output[-800:]
    for n in needles:
        assert n in result.output, (n, result.output[-800:])
    return result.output


def _plan(args: list[str]) -> dict:
    r = _cli(["estimate", *args, "--json"])
    assert r.exit_code == 0, r.output[-800:]
    return json.loads(r.output)


# ------------------------------------------------------------------- fine-tuning flags
@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf", "0", "-16"])
def test_lora_alpha_must_be_positive_and_finite(alpha):
    # a non-finite value is refused as typed when the option is parsed (commands._common.finite_float)
    why = "expected a positive finite number" if alpha in ("0", "-16") else f"'{alpha}' is not a finite number"
    _rejected(_cli(["estimate", "-m", "llama-2-7b", "--method", "lora", f"--lora-alpha={alpha}"]), "--lora-alpha", why)


@pytest.mark.parametrize("flags,named", [
    (["--lora-alpha", "16"], "--lora-alpha 16.0 with --method full"),
    (["--dora"], "--dora with --method full"),
    (["--modules-to-save", "lm_head"], "--modules-to-save lm_head with --method full"),
    (["--quant-storage", "bf16"], "--quant-storage bf16 with --method full"),
])
def test_lora_flags_with_full_training_are_refused(flags, named):
    _rejected(_cli(["estimate", "-m", "llama-2-7b", "--method", "full", *flags]), named)


def test_quant_storage_with_plain_lora_is_refused():
    _rejected(_cli(["estimate", "-m", "llama-2-7b", "--method", "lora", "--quant-storage", "bf16"]),
              "--quant-storage bf16 with --method lora", "--method qlora")


def test_lora_alpha_alone_plans_lora_as_the_other_lora_flags_do():
    assert _plan(["-m", "llama-2-7b", "--lora-alpha", "32"])["finetune"]["method"] == "lora"
    assert _plan(["-m", "llama-2-7b", "--quant-storage", "bf16", "-p", "bf16"])["finetune"]["method"] == "qlora"


# ------------------------------------------------------------------- offload options below their stage
def test_offload_options_say_where_they_do_nothing():
    notes = [a for a in _plan(["-m", "gpt2", "--offload-param", "cpu", "--offload-optimizer", "nvme"])["assumptions"]
             if "no effect" in a]
    assert notes == [
        "--offload-optimizer nvme has no effect at stage 0 (DeepSpeed offloads optimizer states from stage 1): "
        "planned without it there",
        "--offload-param cpu has no effect at stages 0, 1, 2 (DeepSpeed offloads parameters only in stage 3): "
        "planned without it there",
    ]
    assert not [a for a in _plan(["-m", "gpt2", "--offload-param", "cpu", "--stage", "3"])["assumptions"]
                if "no effect" in a]
    assert not [a for a in _plan(["-m", "gpt2", "--offload-param", "none"])["assumptions"] if "no effect" in a]


# ------------------------------------------------------------------- numbers of over 4,300 digits
@pytest.fixture
def huge_files(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY).replace('"hidden_size": 64', f'"hidden_size": {HUGE}'))
    profile = tmp_path / "hw.toml"
    text = (REPO / "hardware_profiles" / "dgx-h100.toml").read_text()
    profile.write_text(text.replace("gpus_per_node = 8", f"gpus_per_node = {HUGE}", 1))
    assert profile.read_text() != text
    axolotl = tmp_path / "ax.yaml"
    axolotl.write_text(f"base_model: gpt2\nmicro_batch_size: {HUGE}\nsequence_len: 512\n")
    hf = tmp_path / "args.json"
    hf.write_text(f'{{"per_device_train_batch_size": {HUGE}}}')
    return {"model": model, "profile": profile, "axolotl": axolotl, "hf": hf}


@pytest.mark.parametrize("which,args", [
    ("model", ["-m", "{}"]),
    ("profile", ["-m", "gpt2", "-H", "{}"]),
    ("axolotl", ["--axolotl", "{}"]),
    ("hf", ["-m", "gpt2", "--hf-args", "{}"]),
])
def test_a_number_of_5000_digits_is_one_error_line(huge_files, which, args):
    path = str(huge_files[which])
    _rejected(_cli(["estimate", *[a.format(path) for a in args]]), path, "a number of over 4,300 digits")


def test_nccl_log_records_numbers_nccl_cannot_log_are_skipped_and_said(tmp_path):
    rec = ("h:1:1 [0] NCCL INFO {op}: opCount 0 sendbuff 0x1 recvbuff 0x1 count {count} datatype 7 op 0 root 0 "
           "comm 0xa [nranks={nranks}] stream 0x2")
    log = tmp_path / "nccl.log"
    log.write_text("\n".join([
        rec.format(op="AllReduce", count=10, nranks=2),
        rec.format(op="AllReduce", count=10, nranks=0),
        rec.format(op="AllGather", count=2**48 + 1, nranks=2),
        rec.format(op="AllGather", count=HUGE, nranks=2),  # no record: the pattern takes at most 30 digits
        f"[E x] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
        f"Timeout(ms)={HUGE}) ran for 1 milliseconds",
        "[E x] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
        "Timeout(ms)=\u00b2) ran for 1 milliseconds",
    ]) + "\n")
    r = _cli(["nccl-log", str(log), "--json"])
    assert r.exit_code == 0, r.output[-800:]
    summary = json.loads(r.output)["summary"]
    assert [(c["op"], c["nranks"]) for c in summary["collectives"]] == [("all_reduce", 2)]
    skipped = sorted(i["line"] for i in summary["issues"] if i["kind"] == "skipped")
    assert skipped == [2, 3]
    timeouts = [i for i in summary["issues"] if i["kind"] == "timeout"]
    assert len(timeouts) == 2 and all(i["timeout_ms"] is None for i in timeouts)


def test_nccl_log_communicators_nccl_cannot_build_are_skipped_and_said(tmp_path):
    """``nranks 99999999999999999999`` was reported as that many ranks (JSON too), and ``rank 99 nranks 8``
    passed unremarked; both lines are skipped now, each named, and a sound communicator still counts."""
    init = "h:1:1 [0] NCCL INFO comm 0x{p} rank {r} nranks {n} cudaDev 0 nvmlDev 0 busId 18000 commId 0x{p}{p} - Init COMPLETE"
    log = tmp_path / "nccl.log"
    log.write_text("\n".join([init.format(p="a", r=0, n="99999999999999999999"), init.format(p="b", r=99, n=8),
                              init.format(p="c", r=1, n=8)]) + "\n")
    r = _cli(["nccl-log", str(log), "--json"])
    assert r.exit_code == 0, r.output[-800:]
    summary = json.loads(r.output)["summary"]
    assert summary["nranks"] == 8
    assert sorted(i["line"] for i in summary["issues"] if i["kind"] == "skipped") == [1, 2]


# ------------------------------------------------------------------- bench zero's per-rank work
@pytest.mark.parametrize("args,needle", [
    (["--seq-len", "99999999"], "--seq-len 99,999,999 is beyond what bench zero runs: expected at most 16,777,216"),
    (["--micro-batch", "2000000"], "--micro-batch 2,000,000 is beyond what bench zero runs"),
    (["--grad-accum", "16777217"], "--grad-accum 16,777,217 is beyond what bench zero runs"),
])
def test_bench_zero_bounds_the_work_per_rank_as_estimate_does(args, needle):
    pytest.importorskip("torch")
    _rejected(_cli(["bench", "zero", "--model", "gpt2", "--stage", "2", "--backend", "gloo", *args]), needle)


def test_bench_zero_checks_the_planned_peak_against_host_memory_before_any_rank(monkeypatch):
    pytest.importorskip("torch")
    import zeroplan.runtime.launch as launch

    monkeypatch.setattr(launch, "mem_available_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("ranks started"))
    out = _rejected(_cli(["bench", "zero", "--model", "gpt2", "--stage", "2", "--backend", "gloo",
                          "--seq-len", "16000000"]),
                    "--micro-batch 2 × --seq-len 16,000,000 on 198,400 parameters: the planner's peak for this run is",
                    "× 2 rank(s) on this host, more than 80% of the 8.00 GiB")
    assert "lower --micro-batch, --seq-len, --layers or --hidden" in out


@pytest.mark.parametrize("args,needle", [
    (["recommend", "-m", "gpt2", "-H", "dgx-h100", "--global-batch", f"{HUGE}tokens"],
     "more tokens than a float holds; expected at most 1e+12"),
    (["recommend", "-m", "gpt2", "-H", "dgx-h100", "--lora-ranks", HUGE], "is not a positive whole rank"),
    (["recommend", "-m", "gpt2", "-H", "dgx-h100", "--lora-ranks", "\u00b2"], "'\u00b2' is not a positive whole rank"),
    (["estimate", "-m", "gpt2", "--trainable", f"last:{HUGE}"], "expected last:K with 1 <= K <= 12 layers"),
])
def test_options_with_5000_digits_are_one_error_line(args, needle):
    _rejected(_cli(args), needle)


@pytest.mark.parametrize("name", ["COLUMNS", "LINES"])
@pytest.mark.parametrize("value", ["\u00b2", HUGE])
def test_a_terminal_size_int_cannot_read_is_ignored(name, value):
    """Rich int()s COLUMNS/LINES when isdigit() is true: '²' and 5,000 digits raised in Console()."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "zeroplan", "models", "list"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, name: value})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-800:]
    assert "llama-2-7b" in r.stdout


@pytest.mark.parametrize("value", ["0", "39"])
def test_a_width_no_table_fits_is_ignored(value):
    """COLUMNS=0 made Rich print nothing: the estimate's table and the error line of a bad model were both
    empty (exit 0 and exit 2 with no word said); a few columns gave empty table rows."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": value, "NO_COLOR": "1"}
    run = [sys.executable, "-m", "zeroplan", "estimate", "-m"]
    r = subprocess.run(run + ["llama-2-7b", "--stage", "3"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0 and "ZeRO-3" in r.stdout and "peak" in r.stdout.lower(), r.stdout[-800:]
    r = subprocess.run(run + ["no-such-model"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 2 and "no-such-model" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["abc", "1:", "1:nan", "-1:0.1", "1:1e9", f"{HUGE}:1", "\u00b2:1"])
def test_a_bad_bench_delay_hook_is_one_line_before_any_rank(monkeypatch, value):
    """ZEROPLAN_BENCH_DELAY was parsed inside each rank: a typo was a ValueError in every rank (exit 1)."""
    from zeroplan._util import InputError
    from zeroplan.bench.collectives import BenchConfig, validate_config

    monkeypatch.setenv("ZEROPLAN_BENCH_DELAY", value)
    with pytest.raises(InputError, match="ZEROPLAN_BENCH_DELAY=.*is not rank:seconds"):
        validate_config(BenchConfig())
    monkeypatch.setenv("ZEROPLAN_BENCH_DELAY", "1:0.05, 0:0")
    validate_config(BenchConfig())


# ------------------------------------------------------------------- names the OS cannot look up
def test_a_hardware_name_over_name_max_is_unknown_not_an_oserror():
    """pathlib's is_file() swallows ENOENT but not ENAMETOOLONG: a 5,000-character -H raised OSError."""
    _rejected(_cli(["estimate", "-m", "gpt2", "-H", HUGE]), "hardware profile", "is unknown")


def test_a_hub_cache_the_os_cannot_look_up_is_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / HUGE))  # over PATH_MAX
    _rejected(_cli(["estimate", "-m", "org/model"]), "not in the local Hugging Face cache")
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("x" * 300)  # a commit name over NAME_MAX
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _rejected(_cli(["estimate", "-m", "org/model"]), "not in the local Hugging Face cache")
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(TINY))
    assert _plan(["-m", "org/model"])["model"]["params"] > 0  # the snapshot is still found by listing


@pytest.mark.parametrize("args", [
    ["report", "-m", "gpt2", "-H", "dgx-h100", "--html", "a\0b"],
    ["recommend", "-m", "gpt2", "-H", "dgx-h100", "--emit-config", "a\0b"],
    ["check", "/dev/null", "-m", "gpt2", "-H", "dgx-h100", "--output", "a\0b"],
])
def test_an_output_path_with_a_nul_is_one_error_line(args):
    """No shell passes a NUL in argv, but the API and CliRunner do: os.stat raised ValueError."""
    _rejected(_cli(args), "contains a NUL character")


# ------------------------------------------------------------------- "-" as an output path
def test_report_dash_prints_the_document_and_writes_no_file(tmp_path, monkeypatch):
    """`report --html -` wrote a file named '-' into the working directory."""
    monkeypatch.chdir(tmp_path)
    r = _cli(["report", "-m", "gpt2", "-H", "dgx-h100", "--html", "-"])
    assert r.exit_code == 0, r.output[-800:]
    assert r.output.startswith("<!DOCTYPE html>") and r.output.rstrip().endswith("</html>")
    r = _cli(["report", "-m", "gpt2", "-H", "dgx-h100", "--svg", "-", "--html", "r.html"])
    assert r.exit_code == 0 and r.output.startswith("<?xml") and "wrote" not in r.output, r.output[-300:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


@pytest.mark.parametrize("args,needle", [
    (["report", "-m", "gpt2", "-H", "dgx-h100", "--html", "-", "--svg", "-"], "only one document can go to stdout"),
    (["report", "-m", "gpt2", "-H", "dgx-h100", "--svg", "-", "--json"], "both would go to stdout"),
    (["bench", "collectives", "--output", "-"], "--output -: expected a file path"),
])
def test_a_dash_that_cannot_mean_stdout_is_refused(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    _rejected(_cli(args), needle)
    assert list(tmp_path.iterdir()) == []


def test_check_output_dash_is_stdout_as_its_help_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = REPO / "examples" / "configs" / "zero2-bf16.json"
    r = _cli(["check", str(cfg), "-m", "gpt2", "-H", "dgx-h100", "--format", "json", "--output", "-"])
    assert r.exit_code in (0, 1), r.output[-800:]
    assert json.loads(r.output)["files"][0]["path"] == str(cfg)
    assert list(tmp_path.iterdir()) == []
