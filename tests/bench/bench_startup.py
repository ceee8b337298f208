"""Benchmark (not a test): cold start of the CLI and of the Python API beside DeepSpeed's estimator.

    python tests/bench/bench_startup.py [--runs 7] [--no-bytecode] [--importtime-only]

Each run is a fresh interpreter (process start to exit, measured from outside: wall with
``time.perf_counter``, CPU with ``resource.getrusage(RUSAGE_CHILDREN)``). The commands run in turn
(A B C …, A B C …) so a drift in the machine's speed hits all of them alike; medians are
reported, and each one's ratio to DeepSpeed's own estimator
(``estimate_zero3_model_states_mem_needs_all_cold``, which imports torch and DeepSpeed) in the
same round. Three floors are measured beside them: ``python -c pass`` (the interpreter), pydantic
imported with one model class built (what any pydantic result costs: the import, the schema
machinery, pydantic's plugin scan over the installed distributions) and ``import typer`` (the
CLI's parser).

Goals (issue 14): the cold CLI call ≤ 0.15 s wall and ``import zeroplan`` + one ``estimate()``
≤ 0.1 s on an idle machine. On a loaded machine compare the ratios, not the seconds.

Bytecode: an installed package has its .pyc files, so by default this script lets Python cache
bytecode under PYTHONPYCACHEPREFIX (a temp folder) and warms it up. ``--no-bytecode`` measures a
source checkout under PYTHONDONTWRITEBYTECODE=1: the installed packages read their own
__pycache__, a checkout that has none compiles every zeroplan module on every run.

The second table is ``python -X importtime`` (the interpreter's own per-module timer), summed by
package over each module's self time, medians over the runs: less sensitive to load than wall
time, since it counts only the importing process. ``zeroplan`` includes building its pydantic
models (the class statements run in zeroplan's modules).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CLI = "cli: zeroplan estimate --json"
API = "api: import zeroplan + estimate()"
BASELINE = "deepspeed estimator (cold)"
COMMANDS = {
    CLI: [PY, "-m", "zeroplan", "estimate", "--model", "llama-2-70b", "--gpus", "64", "--json"],
    API: [PY, "-c", "import zeroplan; zeroplan.estimate(model='llama-2-70b', gpus=64)"],
    BASELINE: [PY, "-c", "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold; "
                         "estimate_zero3_model_states_mem_needs_all_cold(total_params=70e9, "
                         "largest_layer_params=1e9, num_gpus_per_node=8, num_nodes=8)"],
    "floor: pydantic + one model": [PY, "-c", "from pydantic import BaseModel\nclass A(BaseModel):\n    x: int"],
    "floor: import typer": [PY, "-c", "import typer"],
    "floor: python -c pass": [PY, "-c", "pass"],
}
# -X importtime rows summed by the first part of the module name; the rest is "other"
GROUPS = {"zeroplan": "zeroplan", "pydantic": "pydantic", "pydantic_core": "pydantic", "annotated_types": "pydantic",
          "typing_inspection": "pydantic", "typing_extensions": "pydantic", "typer": "typer", "click": "typer",
          "importlib.metadata": "importlib.metadata (pydantic's plugin scan)",
          "email": "importlib.metadata (pydantic's plugin scan)"}
_ROW = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def _env(no_bytecode: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if no_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the installed packages keep their own __pycache__
        env.pop("PYTHONPYCACHEPREFIX", None)
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "zeroplan-bench-pycache"))
    return env


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def wall_table(runs: int, env: dict[str, str]) -> None:
    wall: dict[str, list[float]] = {k: [] for k in COMMANDS}
    cpu: dict[str, list[float]] = {k: [] for k in COMMANDS}
    ratio: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(runs):
        this_round = {}
        for name, cmd in COMMANDS.items():
            w, c = _run(cmd, env)
            wall[name].append(w)
            cpu[name].append(c)
            this_round[name] = w
        for name in COMMANDS:
            ratio[name].append(this_round[name] / this_round[BASELINE])
    print(f"{runs} cold runs each, medians (ratio: per round, to {BASELINE!r})")
    print(f"{'command':36} {'wall s':>8} {'cpu s':>8} {'wall ratio':>11}")
    for name in COMMANDS:
        print(f"{name:36} {statistics.median(wall[name]):8.3f} {statistics.median(cpu[name]):8.3f} "
              f"{statistics.median(ratio[name]):11.3f}")


def importtime_by_group(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Milliseconds of each group's module self time in one ``-X importtime`` run, and the total."""
    err = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, check=True).stderr
    out: dict[str, float] = {}
    for line in err.splitlines():
        m = _ROW.match(line)
        if m:
            parts = m[4].split(".")
            group = GROUPS.get(".".join(parts[:2]), GROUPS.get(parts[0], "other (stdlib, site)"))
            out[group] = out.get(group, 0.0) + int(m[1]) / 1000
            out["total"] = out.get("total", 0.0) + int(m[1]) / 1000
    return out


def importtime_table(runs: int, env: dict[str, str]) -> None:
    print(f"\npython -X importtime: module self time summed by package, ms, median of {runs} runs")
    names = [CLI, API]
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(runs):
        for n in names:
            samples[n].append(importtime_by_group(COMMANDS[n], env))
    groups = sorted({g for n in names for s in samples[n] for g in s} - {"total"}) + ["total"]
    print(f"{'package':44} " + " ".join(f"{n.split(':')[0]:>8}" for n in names))
    for g in groups:
        print(f"{g:44} " + " ".join(f"{statistics.median(s.get(g, 0.0) for s in samples[n]):8.1f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-bytecode", action="store_true", help="PYTHONDONTWRITEBYTECODE=1, no bytecode cache")
    ap.add_argument("--importtime-only", action="store_true", help="skip the wall-time table (and DeepSpeed)")
    args = ap.parse_args()
    env = _env(args.no_bytecode)
    for name, cmd in COMMANDS.items():  # warm-up: writes the bytecode caches, fills the page cache
        if not args.importtime_only or name in (CLI, API):
            _run(cmd, env)
    print(f"bytecode: {'none (PYTHONDONTWRITEBYTECODE=1)' if args.no_bytecode else 'cached'}")
    if not args.importtime_only:
        wall_table(args.runs, env)
    importtime_table(args.runs, env)


if __name__ == "__main__":
    main()
