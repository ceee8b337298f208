"""Bench options out of bounds are bad input: one line naming the option, the value and what was
expected, exit 2, no traceback, and nothing started (bench/limits.py, bench/validate.py).

Every CLI case here replaces what would do the work (forking ranks, joining torchrun, loading or
running the model) by a function that fails the test, so a check that fires late is caught without
timing anything.
"""

from __future__ import annotations

import pytest

from zeroplan._util import InputError
from zeroplan.bench.limits import MAX_BUFFER_BYTES, parse_size

GiB = 2**30


@pytest.fixture
def no_work(monkeypatch):
    """Ranks, torchrun and the bench zero runs fail the test if reached; the environment is not torchrun's."""
    import zeroplan.bench.validate as validate
    import zeroplan.runtime.launch as launch

    def reached(*args, **kwargs):
        raise AssertionError("the bench started work before rejecting its input")

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(launch, "spawn", reached)
    monkeypatch.setattr(launch, "join_torchrun", reached)
    for name in ("run_bench_zero", "run_simulated_bench", "run_deepspeed_bench"):
        monkeypatch.setattr(validate, name, reached)
    return monkeypatch


def _bad_input(args: list[str]) -> str:
    """Run ``zeroplan bench …`` in-process; assert one error line and exit 2; return that line."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    r = CliRunner().invoke(app, ["bench", *args])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error: " in lines[0], r.output
    return lines[0]


# ------------------------------------------------------------------ sizes: finite, >= 1 byte, <= 1 TiB
@pytest.mark.parametrize("text", ["1e400", "inf", "-inf", "1E400K", "nan"])
def test_parse_size_rejects_non_finite(text):
    with pytest.raises(InputError, match=r"--max-bytes '.*': expected (a finite number of )?bytes"):
        parse_size(text, "--max-bytes")


@pytest.mark.parametrize("text", ["99999999999999999999999G", "1025G", str(MAX_BUFFER_BYTES + 1), "1e13"])
def test_parse_size_rejects_above_one_tib(text):
    with pytest.raises(InputError, match=r"expected at most 1024G \(2\^40 bytes = 1 TiB\)"):
        parse_size(text, "--size")
    with pytest.raises(InputError, match="at most 1024G"):
        parse_size(10**400, "--size")  # an int too big for a float: still a clean error


def test_parse_size_keeps_the_valid_range():
    assert parse_size("1024G", "--size") == MAX_BUFFER_BYTES == 2**40
    assert (parse_size("1", "--size"), parse_size("1K", "--size"), parse_size("1.5M", "--size")) == (1, 1024, 3 * 2**19)
    with pytest.raises(InputError, match="at least 1 byte"):
        parse_size("1e-400", "--size")


@pytest.mark.parametrize("args, needle", [
    (["collectives", "--min-bytes", "1e400"], "--min-bytes '1e400': expected a finite number of bytes"),
    (["collectives", "--max-bytes", "inf"], "--max-bytes 'inf': expected a finite number of bytes"),
    (["collectives", "--max-bytes", "99999999999999999999999G"], "--max-bytes '99999999999999999999999G': "
                                                                 "expected at most 1024G"),
    (["overlap", "--size", "1e400"], "--size '1e400': expected a finite number of bytes"),
    (["overlap", "--size", "9999999999999999999G"], "--size '9999999999999999999G': expected at most 1024G"),
])
def test_cli_size_out_of_bounds_is_exit_2(args, needle, no_work):
    line = _bad_input([*args, "--backend", "gloo"])
    assert needle in line


def test_help_states_the_size_bound():
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    for cmd, option in (("collectives", "--max-bytes"), ("overlap", "--size")):
        r = CliRunner().invoke(app, ["bench", cmd, "--help"])
        assert r.exit_code == 0 and "1024G (2^40 bytes = 1 TiB)" in " ".join(r.output.split()), (cmd, r.output)
        assert option in r.output


# ------------------------------------------------------------------ what the ranks would allocate
def test_cli_collectives_sweep_over_the_host_memory_is_exit_2(no_work):
    import zeroplan.runtime.launch as launch

    no_work.setattr(launch, "mem_available_bytes", lambda: 4 * GiB)
    line = _bad_input(["collectives", "--max-bytes", "1G", "--nproc", "2", "--backend", "gloo"])
    assert "--max-bytes 1073741824 (1.00 GiB)" in line and "× 2 rank(s) on this host" in line
    assert "memory available here" in line and "lower --max-bytes" in line


def test_cli_overlap_matrices_over_the_fixed_cap_are_exit_2(no_work):
    line = _bad_input(["overlap", "--hidden", "100000000", "--tokens", "100000000", "--backend", "gloo"])
    assert "--hidden 100000000 × --tokens 100000000" in line
    assert "over the fixed cap of 1024G" in line and "lower --hidden, --tokens or --size" in line


def test_cli_overlap_matrices_over_the_host_memory_are_exit_2(no_work):
    import zeroplan.runtime.launch as launch

    no_work.setattr(launch, "mem_available_bytes", lambda: 4 * GiB)
    line = _bad_input(["overlap", "--hidden", "16384", "--tokens", "16384", "--nproc", "2", "--backend", "gloo"])
    assert "--hidden 16384 × --tokens 16384" in line and "memory available here" in line


def test_overlap_rank_bytes_counts_every_tensor_the_rank_allocates():
    from zeroplan.bench.overlap import rank_bytes

    s = {"hidden": 256, "tokens": 128, "size_bytes": 4 * 2**20, "dtype": "float32"}
    a, b, c = 128 * 256, 256 * 4 * 256, 128 * 4 * 256
    count = 4 * 2**20 // 4
    assert rank_bytes(s, 2) == 4 * max(a + 2 * b, a + b + c + count + count // 2)


def test_overlap_memory_check_on_cuda_without_nvml_is_the_fixed_cap_only(monkeypatch):
    import zeroplan.runtime.gpus as gpus
    import zeroplan.runtime.launch as launch
    from zeroplan.bench.overlap import check_memory

    monkeypatch.setattr(launch, "mem_available_bytes", lambda: 1)  # the host's memory is not the GPU's
    monkeypatch.setattr(gpus, "visible_gpu_free_bytes", lambda: None)  # NVML cannot say
    fits = {"hidden": 8192, "tokens": 8192, "size_bytes": 256 * 2**20, "dtype": "bfloat16"}
    check_memory(fits, "cuda", 8, 8)
    with pytest.raises(InputError, match="memory available here"):
        check_memory(fits, "cpu", 8, 8)
    with pytest.raises(InputError, match="over the fixed cap of 1024G"):
        check_memory({**fits, "hidden": 10**6}, "cuda", 8, 8)


def test_overlap_memory_check_on_cuda_reads_the_free_gpu_memory_from_nvml(monkeypatch):
    """The ranks' GPUs are unknown in NVML's order, so the check counts the GPUs with room: it never
    refuses a run some assignment of GPUs could hold."""
    import zeroplan.runtime.gpus as gpus
    from zeroplan._util import fmt_bytes
    from zeroplan.bench.overlap import check_memory, rank_bytes

    s = {"hidden": 8192, "tokens": 8192, "size_bytes": 256 * 2**20, "dtype": "bfloat16"}
    need = rank_bytes(s, 2)
    free = [int(need / 0.9) + 1, 2 * need, need // 2]  # one GPU busy with another job
    monkeypatch.setattr(gpus, "visible_gpu_free_bytes", lambda: free)
    check_memory(s, "cuda", 2, 2)  # the two roomiest GPUs hold it
    with pytest.raises(InputError, match=r"per rank, and 2 of the 3 visible GPUs have that within 90% of their free "
                                         rf"memory \(NVML; the most free: {fmt_bytes(2 * need)}\) for 3 rank\(s\)"):
        check_memory(s, "cuda", 2, 3)
    monkeypatch.setattr(gpus, "visible_gpu_free_bytes", lambda: [need])
    with pytest.raises(InputError, match=r"and 0 of the 1 visible GPUs .* for 1 rank\(s\); lower --hidden, --tokens"):
        check_memory(s, "cuda", 1, 1)
    monkeypatch.setattr(gpus, "visible_gpu_free_bytes", lambda: [need])
    check_memory(s, "cuda", 1, 2)  # fewer GPUs than ranks: the launcher refuses that, not this check


def test_bench_zero_leaves_a_gpu_oom_to_the_run(monkeypatch):
    """bench zero compares a predicted OOM with a measured one: its check stops at the fixed cap on CUDA."""
    import zeroplan.runtime.gpus as gpus
    from zeroplan.bench.limits import check_rank_bytes

    monkeypatch.setattr(gpus, "visible_gpu_free_bytes", lambda: [1])
    check_rank_bytes(2**30, device="cuda", ranks=1, what="x", lower="y", gpu_free=False)
    with pytest.raises(InputError):
        check_rank_bytes(2**30, device="cuda", ranks=1, what="x", lower="y")


def test_visible_gpu_free_bytes_follows_cuda_visible_devices(monkeypatch):
    import sys
    import types

    import zeroplan.runtime.gpus as gpus

    free = {0: 10, 1: 11, 2: 12, "GPU-abc": 13}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=free[h]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.visible_gpu_free_bytes() == [10, 11, 12]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,7,1")  # the driver stops at the invalid 7
    assert gpus.visible_gpu_free_bytes() == [12, 10]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert gpus.visible_gpu_free_bytes() == [13]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-missing")
    assert gpus.visible_gpu_free_bytes() is None  # NVML cannot resolve it: no check rather than a guess


def test_collectives_config_built_in_code_is_bounded_too():
    from zeroplan.bench.collectives import BenchConfig, validate_config

    with pytest.raises(InputError, match="--max-bytes .*: expected at most 1024G"):
        validate_config(BenchConfig(max_bytes=2 * MAX_BUFFER_BYTES))


# ------------------------------------------------------------------ bench zero
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_cli_zero_tolerance_must_be_finite_and_non_negative(value, no_work):
    line = _bad_input(["zero", "--model", "gpt2", "--backend", "gloo", "--tolerance", value])
    if value == "-0.5":
        assert f"--tolerance {float(value)!r}: expected a finite relative error >= 0" in line
    else:  # refused as typed when the option is parsed (commands._common.finite_float)
        assert f"'--tolerance': '{value}' is not a finite number" in line


@pytest.mark.parametrize("args, needle", [
    (["--layers", "0"], "--layers 0: expected a whole number >= 1"),
    (["--layers", "-3"], "--layers -3: expected a whole number >= 1"),
    (["--hidden", "0"], "--hidden 0: expected a whole number >= 1"),
    (["--layers", "0", "--simulate"], "--layers 0: expected a whole number >= 1"),  # was "keep" silently
    (["--stage", ""], "--stage '': expected stages 0..3 as a comma list"),
    (["--stage", ","], "--stage ',': expected stages 0..3 as a comma list"),
])
def test_cli_zero_scale_and_stage_name_the_option(args, needle, no_work):
    import zeroplan.specs.model as model

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    no_work.setattr(model, "load_model", load_model)
    line = _bad_input(["zero", "--model", "gpt2", "--backend", "gloo", *args])
    assert needle in line and "scaled()" not in line and "num_layers" not in line


# ------------------------------------------------------------------ repetition counts
@pytest.mark.parametrize("bench", [["collectives", "--backend", "gloo"], ["overlap", "--backend", "gloo"], ["cpu-adam"],
                                   ["zero", "--model", "gpt2", "--backend", "gloo"]])
@pytest.mark.parametrize("flag,value,expected", [
    ("iters", "99999999999999999999", "likely typo"),  # ran until --timeout, then "rank still running"
    ("iters", "0", "from 1 to"),
    ("warmup", "1000001", "likely typo"),
    ("warmup", "-1", "from 0 to"),
])
def test_repetition_counts_are_bounded_before_any_rank_starts(bench, flag, value, expected, no_work):
    from zeroplan.bench.limits import MAX_REPEATS

    option = "--steps" if bench[0] == "zero" and flag == "iters" else f"--{flag}"
    bound = MAX_REPEATS
    line = _bad_input([*bench, option, value])
    assert f"{option} {int(value):,}: expected a whole number from" in line and f"to {bound:,}" in line
    assert expected in line


def test_the_largest_repetition_counts_pass_the_check():
    from zeroplan.bench.limits import MAX_REPEATS, check_repeats

    check_repeats(MAX_REPEATS, MAX_REPEATS)
    check_repeats(1, 0)
