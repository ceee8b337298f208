"""Benchmark (not a test): cold start of the CLI and of the Python API beside DeepSpeed's estimator.

    python tests/bench/bench_startup.py [--runs 7]

Each run is a fresh interpreter (process start to exit, measured from outside: wall with
``time.perf_counter``, CPU with ``resource.getrusage(RUSAGE_CHILDREN)``). The commands run in turn
(A B C D, A B C D, …) so a drift in the machine's speed hits all of them alike; medians are
reported, and each one's ratio to DeepSpeed's own estimator
(``estimate_zero3_model_states_mem_needs_all_cold``, which imports torch and DeepSpeed) in the
same round. ``python -c pass`` is the interpreter's own floor.

Goals (issue 14): the cold CLI call ≤ 0.15 s wall and ``import zeroplan`` + one ``estimate()``
≤ 0.1 s on an idle machine. On a loaded machine compare the ratios, not the seconds. Bytecode
caching matters: an installed package has its .pyc files; with PYTHONDONTWRITEBYTECODE=1 every
run compiles zeroplan again, so set PYTHONPYCACHEPREFIX to a writable folder (this script does).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "cli: zeroplan estimate --json": [sys.executable, "-m", "zeroplan", "estimate", "--model", "llama-2-70b",
                                      "--gpus", "64", "--json"],
    "api: import zeroplan + estimate()": [sys.executable, "-c", "import zeroplan; "
                                          "zeroplan.estimate(model='llama-2-70b', gpus=64)"],
    "deepspeed estimator (cold)": [sys.executable, "-c",
                                   "from deepspeed.runtime.zero.stage3 import "
                                   "estimate_zero3_model_states_mem_needs_all_cold; "
                                   "estimate_zero3_model_states_mem_needs_all_cold(total_params=70e9, "
                                   "largest_layer_params=1e9, num_gpus_per_node=8, num_nodes=8)"],
    "python -c pass": [sys.executable, "-c", "pass"],
}
BASELINE = "deepspeed estimator (cold)"


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "zeroplan-bench-pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for cmd in COMMANDS.values():  # warm-up: writes the bytecode caches, fills the page cache
        _run(cmd, env)
    wall: dict[str, list[float]] = {k: [] for k in COMMANDS}
    cpu: dict[str, list[float]] = {k: [] for k in COMMANDS}
    ratio: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(args.runs):
        this_round = {}
        for name, cmd in COMMANDS.items():
            w, c = _run(cmd, env)
            wall[name].append(w)
            cpu[name].append(c)
            this_round[name] = w
        for name in COMMANDS:
            ratio[name].append(this_round[name] / this_round[BASELINE])
    print(f"{args.runs} cold runs each, medians (ratio: per round, to {BASELINE!r})")
    print(f"{'command':36} {'wall s':>8} {'cpu s':>8} {'wall ratio':>11}")
    for name in COMMANDS:
        print(f"{name:36} {statistics.median(wall[name]):8.3f} {statistics.median(cpu[name]):8.3f} "
              f"{statistics.median(ratio[name]):11.3f}")


if __name__ == "__main__":
    main()
