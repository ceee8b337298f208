"""Hostile names, pipes, sizes and output paths (an adversarial sweep of every command, stop 27).

Each case failed before its fix: a traceback (Rich markup in a name, a closed stdout), exit 1
for a closed pipe (which ``check`` documents as "a finding failed"), a plan that never ended
(a sequence of 1e25 tokens, COLUMNS=999999999, 100,000 distinct NCCL collectives in a table),
or a write that left half its output behind or created a file under /dev.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zeroplan._util as util
from zeroplan.cli import app
from zeroplan.report.render import rounded_parts

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
HANG_S = 120  # a bound on hangs for subprocess runs, not a speed goal (each takes about a second)
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 100, "intermediate_size": 128}


def _cli(args: list[str], **kw):
    return runner.invoke(app, args, catch_exceptions=True, **kw)


def _rejected(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-800:])
    assert "Traceback" not in result.output
    for n in needles:
        assert n in result.output, (n, result.output[-800:])
    return result.output


def _subprocess(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroplan", *args], capture_output=True, text=True,
                          timeout=HANG_S, cwd=REPO, **kw)


# ------------------------------------------------------------------- names printed through Rich markup
@pytest.fixture
def markup_model(tmp_path: Path) -> str:
    p = tmp_path / "m.json"
    p.write_text(json.dumps({**TINY, "_name_or_path": "x[/]"}))
    return str(p)


@pytest.fixture
def markup_profile(tmp_path: Path) -> str:
    text = (REPO / "hardware_profiles" / "dgx-h100.toml").read_text()
    text = text.replace('name = "dgx-h100"', 'name = "[bold]x[/]"', 1)
    text = text.replace('name = "NVIDIA H100 SXM5 80GB"', 'name = "H100 [/] \\u001b[31mred"', 1)
    p = tmp_path / "hw.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("args", [
    ["estimate", "-m", "{m}"], ["models", "show", "{m}"], ["recommend", "-m", "{m}", "-H", "dgx-h100"],
    ["recommend", "-m", "gpt2", "-H", "{h}"], ["estimate", "-m", "gpt2", "-H", "{h}"],
])
def test_square_brackets_in_names_print_as_written(args, markup_model, markup_profile):
    r = _cli([a.format(m=markup_model, h=markup_profile) for a in args])
    assert r.exit_code == 0, r.output[-800:]
    assert "x[/]" in r.output or "H100 [/]" in r.output
    assert "\x1b" not in r.output  # the GPU name's escape sequence is stripped


def test_check_prints_markup_and_escape_codes_from_config_keys_as_text(tmp_path, markup_model):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                               "\u001b[31mRED[/]": 1}))
    r = _cli(["check", str(cfg), "-m", markup_model, "-H", "dgx-h100"])
    assert r.exit_code == 0, r.output[-800:]
    assert "RED[/]: unknown key" in r.output and "x[/]" in r.output
    assert "\x1b" not in r.output


def test_check_text_keeps_a_newline_in_a_key_or_file_name_on_its_line(tmp_path):
    """A config key or a file name holding a newline printed it raw in the text report, so ``::error::...``
    began a line of its own: a workflow command in a GitHub Actions log. Both are written as ``\\n`` now."""
    d = tmp_path / "configs"
    d.mkdir()
    cfg = d / "a\n::error::name.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                               "bad\n::error::key": 1}))
    r = _cli(["check", str(cfg), "-m", "llama-2-7b", "-H", "dgx-h100"])
    assert r.exit_code == 0, r.output[-800:]
    assert not any(line.startswith("::") for line in r.output.splitlines())
    assert "a\\n::error::name.json" in r.output and "[bad\\n::error::key]: bad\\n::error::key: unknown key" in r.output


# ------------------------------------------------------------------- stdout closed or gone
def test_a_closed_pipe_exits_141_quietly_not_1():
    """The reader is gone before the first byte (deterministic, unlike `| head -1`)."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        for args in (["estimate", "-m", "llama-2-7b", "-H", "dgx-h100"], ["profiles", "list"]):
            r = subprocess.run([sys.executable, "-m", "zeroplan", *args], stdout=write_fd, stderr=subprocess.PIPE,
                               text=True, timeout=HANG_S, cwd=REPO)
            assert r.returncode == 141, (args, r.returncode, r.stderr[-800:])
            assert r.stderr == ""
    finally:
        os.close(write_fd)


def test_a_closed_stdout_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", "-m", "gpt2"], stderr=subprocess.PIPE,
                       text=True, timeout=HANG_S, cwd=REPO, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2, r.stderr[-800:]
    assert r.stderr.strip() == ("zeroplan: error: standard output is closed: nothing could be printed "
                                "(redirect it to a file or /dev/null)")


# ------------------------------------------------------------------- sizes that never finished
@pytest.mark.parametrize("args,needle", [
    (["-s", "99999999999999999999999999"], "--seq-len 99,999,999,999,999,999,999,999,999"),
    (["-b", "1048577"], "--micro-batch 1,048,577"),
    (["--grad-accum", "16777217"], "--grad-accum 16,777,217"),
])
def test_per_gpu_work_options_have_an_upper_bound(args, needle):
    _rejected(_cli(["estimate", "-m", "llama-2-7b", *args]), needle, "expected at most")


def test_the_config_s_micro_batch_has_the_same_bound(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 10**15, "zero_optimization": {"stage": 2}}))
    _rejected(_cli(["estimate", "-m", "gpt2", "-c", str(cfg)]),
              "train_micro_batch_size_per_gpu = 1,000,000,000,000,000", "expected at most 1,048,576")


def test_rounded_parts_is_linear_in_the_parts_and_still_adds_up():
    parts = [10**12 + 7, 3 * 10**12 + 5, 5]
    for total in (10**30, -(10**30), sum(p // 10**7 for p in parts) + 2):
        out = rounded_parts(total, parts)
        assert sum(out) == total
        assert max(out) - min(out) <= max(p // 10**7 for p in parts) - min(p // 10**7 for p in parts) + abs(total)


def test_a_huge_columns_gets_a_bounded_chart():
    r = _subprocess(["estimate", "-m", "llama-2-7b", "-H", "dgx-h100"], env={**os.environ, "COLUMNS": "999999999"})
    assert r.returncode == 0, r.stderr[-800:]
    assert len(r.stdout) < 100_000  # about 13 kB; it was 120 MB at COLUMNS=10000000 (charts padded to the width)


def test_nccl_log_tables_show_fifty_rows_and_say_how_many_more(tmp_path):
    lines = [f"h:1:1 [0] NCCL INFO AllReduce: opCount {i} sendbuff 0x1 recvbuff 0x1 count {i + 1} datatype 7 op 0 "
             f"root 0 comm 0xa [nranks=2] stream 0x2" for i in range(60)]
    log = tmp_path / "nccl.log"
    log.write_text("\n".join(lines) + "\n")
    r = _cli(["nccl-log", str(log)])
    assert r.exit_code == 0, r.output[-800:]
    assert "… and 10 more collective shapes (the first 50 shown; --json lists all 60)" in r.output
    j = _cli(["nccl-log", str(log), "--json"])
    assert len(json.loads(j.output)["summary"]["collectives"]) == 60


@pytest.mark.parametrize("args,needle", [
    (["--nranks", "-1"], "--nranks -1: expected a communicator size from 1 to 131,072"),
    (["--nranks", "0"], "--nranks 0"),
    (["--steps", "99999999999999"], "--steps 99,999,999,999,999: expected at most"),
])
def test_nccl_log_counts_are_bounded(tmp_path, args, needle):
    log = tmp_path / "nccl.log"
    log.write_text("h:1:1 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 10 datatype 7 op 0 "
                   "root 0 comm 0xa [nranks=2] stream 0x2\n")
    _rejected(_cli(["nccl-log", str(log), *args]), needle)


def test_lora_ranks_searched_are_bounded():
    _rejected(_cli(["recommend", "-m", "gpt2", "-H", "dgx-h100", "--method", "lora",
                    "--lora-ranks", ",".join(str(r) for r in range(1, 18))]), "17 ranks; expected at most 16")


@pytest.mark.parametrize("value,needle", [
    ("999999999999999999999999999Gsamples", "expected at most 1e+12"),
    ("900Gsamples", "needs gradient accumulation 112,500,000,000"),
    ("\uff14Mtokens", "cannot read it"),  # a fullwidth digit, refused as -g refuses it
])
def test_global_batch_is_bounded(value, needle):
    _rejected(_cli(["recommend", "-m", "gpt2", "-H", "dgx-h100", "--global-batch", value]), needle)


# ------------------------------------------------------------------- output files
@pytest.mark.parametrize("target,needle", [
    ("-", "--emit-config -: writes two files"),
    ("/dev/null", "--emit-config /dev/null: not a regular file"),
])
def test_emit_config_needs_a_regular_file(target, needle):
    _rejected(_cli(["recommend", "-m", "gpt2", "-H", "dgx-h100", "--emit-config", target]), needle)
    assert not Path("/dev/null.peft.json").exists()


def test_emit_config_writes_the_config_and_its_sidecar_or_neither(tmp_path, monkeypatch):
    real = util._staged_temp
    calls = []

    def second_fails(target, st, data, shown):
        calls.append(target)
        if len(calls) == 2:
            raise util.InputError(f"{shown}: cannot write: No space left on device")
        return real(target, st, data, shown)

    monkeypatch.setattr(util, "_staged_temp", second_fails)
    out = tmp_path / "c.json"
    _rejected(_cli(["recommend", "-m", "gpt2", "-H", "dgx-h100", "--emit-config", str(out)]),
              "c.peft.json: cannot write: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither file, and no temp file


def test_check_names_the_headroom_option_it_was_given():
    _rejected(_cli(["check", str(REPO / "examples" / "configs" / "zero2-bf16.json"), "-m", "gpt2", "-H",
                    "dgx-h100", "--headroom", "1.5"]), "--headroom 1.5 must be in [0, 1)")


def test_report_calls_its_html_an_output(tmp_path):
    out = str(tmp_path / "r.html")
    _rejected(_cli(["report", "-m", "gpt2", "-H", "dgx-h100", "--html", out, "--svg", out]),
              "is the same file as the --html output")


@pytest.mark.parametrize("key,value,needle", [
    ("num_hidden_layers", 100_000, "key 'num_hidden_layers' = 100000, expected at most 4,096"),
    ("num_local_experts", 100_000, "key 'num_local_experts' = 100000, expected at most 8,192"),
])
def test_layers_and_experts_are_bounded_where_plans_stay_fast(tmp_path, key, value, needle):
    """100,000 layers or experts were accepted and a plan never ended (each makes tensors of its own)."""
    cfg = {**TINY, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, key: value}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    _rejected(_cli(["models", "show", str(p)]), needle)


def test_a_bare_count_too_large_for_the_default_shapes_says_so():
    _rejected(_cli(["estimate", "-m", "1e14"]),
              "model size '1e14': the largest default shape (hidden 16384) would need 31,370 layers, beyond 4,096")


@pytest.mark.parametrize("count", ["7", "1", "8000000"])
def test_a_bare_count_no_default_shape_fits_says_so(count):
    """``-m 7`` planned a 7-parameter model whose largest module had 8,192,000 (the default shape's embedding);
    ``models show 1`` printed the shape's count as +1718758300.0% of it."""
    for cmd in (["estimate", "-m", count], ["models", "show", count]):
        _rejected(_cli(cmd), f"model size '{count}' = {int(count):,} parameter")
    r = _cli(["estimate", "-m", "9000000"])  # within 2x of the smallest shape: planned, its notes say how far off
    assert r.exit_code == 0, r.output[-400:]


@pytest.mark.parametrize("hardware", [[], ["-H", "dgx-h100"]])
def test_too_many_gpus_says_the_cap_before_any_node_arithmetic(hardware):
    """With a profile, --gpus 10^26 said 'not divisible by 8 GPUs per node' instead of the cap."""
    _rejected(_cli(["estimate", "-m", "llama-2-7b", "--gpus", "9" * 26, *hardware]),
              "zeroplan plans clusters of up to 131,072 data-parallel GPUs")
