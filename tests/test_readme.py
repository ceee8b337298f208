"""The README is the manual: its excerpts are real output and its commands are what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from readme_examples import BLOCK, README, examples, run_example, stable_lines, varying_examples

ROOT = Path(__file__).resolve().parent.parent
TEXT = README.read_text()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.+?)\n```", TEXT)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd.strip() in ci, (test_cmd, ci)


def test_readme_has_a_main_job_command():
    blocks = re.findall(r"```bash\n(.+?)\n```", TEXT)
    assert any(b.startswith("pip install . && zeroplan ") for b in blocks)


@pytest.mark.parametrize("cmd", examples(TEXT))
def test_readme_excerpt_is_true(cmd):
    block = next(m for m in BLOCK.finditer(TEXT) if m.group("cmd").strip() == cmd)
    shown = block.group(0).split("```console\n", 1)[1].rsplit("```", 1)[0]
    body = shown.split("\n", 1)[1].rstrip("\n")  # drop the "$ zeroplan ..." line
    assert body == run_example(cmd), f"README excerpt for {cmd!r} is stale: run python tests/readme_examples.py"


def _varying_params() -> list:
    """Each varying excerpt; DeepSpeedCPUAdam's builds a C++ op on first use (about a minute on
    2 cores), so it runs in .ci/run's second pass (opbuild) rather than in the default suite."""
    import importlib.util
    import shutil

    no_build = (importlib.util.find_spec("deepspeed") is None
                or (shutil.which("c++") is None and shutil.which("g++") is None))
    out = []
    for cmd, body in varying_examples(TEXT):
        slow = "bench cpu-adam" in cmd and "--optimizer torch" not in cmd
        marks = [pytest.mark.opbuild, pytest.mark.skipif(no_build, reason="needs DeepSpeed and a C++ compiler to "
                                                                            "build its cpu_adam op")] if slow else []
        out.append(pytest.param(cmd, body, id=cmd, marks=marks))
    return out


@pytest.mark.parametrize("cmd,body", _varying_params())
def test_readme_varying_excerpt_still_matches(cmd, body):
    out = run_example(cmd.split("| head -")[0])
    lines = stable_lines(body)
    assert lines, "a varying excerpt must show some stable text"
    for ln in lines:
        assert ln in out, f"README excerpt line {ln!r} no longer appears in the output of {cmd!r}"


PYTHON_BLOCKS = re.findall(r"```python\n(.+?)```", TEXT, re.S)


def test_readme_has_a_python_api_example():
    assert PYTHON_BLOCKS, "the README's Python API section needs a runnable ```python example"


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-block-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_example_runs(code, tmp_path):
    """Each ```python block runs as written, in a fresh interpreter (this checkout's zeroplan), and
    planning imports neither torch nor rich."""
    import os
    import subprocess
    import sys

    script = tmp_path / "example.py"
    script.write_text(code + "\nimport sys\nbad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich'))\n"
                             "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
