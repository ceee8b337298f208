"""Benchmark (not a test): wall time of `recommend` sweeping the whole search space.

    python tests/bench/bench_recommend.py [--rounds 5]

Cases: Llama-3.1-405B on 64 DGX H100 nodes (512 GPUs), Llama-2-70B on 4 nodes over 100 GbE,
Llama-2-7B on one DGX A100. For each: the first run of ``recommend()`` (inputs built once; cold: the
stage-3 coordinator replays of core/stage3_fetch.py and core/stage3_live.py are cached per process, so
this is what one CLI call pays), the best and the median of ``rounds`` runs, how many (micro-batch × checkpointing × state) configurations were decided, and how many
direct memory evaluations and collective ledgers the per-stage composition needed. The target is
well under a second for the 405B case. CPU timings are noisy; the best round is reported.
"""

from __future__ import annotations

import argparse
import time

CASES = (
    ("llama-3.1-405b", "dgx-h100", 64),
    ("llama-2-70b", "h100-8x-100gbe", 4),
    ("llama-2-7b", "dgx-a100-80gb", 1),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from zeroplan.advice import recommend as R
    from zeroplan.core.inputs import build_plan_inputs

    sweeps: list = []
    orig = R._Sweep.__init__

    def init(self, *a, **k):  # count the sweep's direct evaluations
        orig(self, *a, **k)
        sweeps.append(self)

    R._Sweep.__init__ = init
    print(f"{'case':44} {'first s':>8} {'best s':>8} {'median s':>9} {'decided':>8} {'mem evals':>10} {'ledgers':>8}  choice")
    for model, hw, nodes in CASES:
        inp = build_plan_inputs(model=model, hardware=hw, nodes=nodes, precision="bf16")
        times = []
        rec = None
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            rec = R.recommend(inp)
            times.append(time.perf_counter() - t0)
        fams = sweeps[-1].families.values()
        first = times[0]
        times.sort()
        choice = f"{rec.chosen.label()} mb {rec.chosen.micro_batch} {rec.chosen.checkpointing}" if rec.chosen else "nothing fits"
        print(f"{model + ' on ' + str(nodes) + ' x ' + hw:44} {first:8.3f} {times[0]:8.3f} {times[len(times) // 2]:9.3f} "
              f"{rec.searched:8d} {sum(f.direct_evals for f in fams):10d} {sum(f.direct_ledgers for f in fams):8d}  {choice}")
    R._Sweep.__init__ = orig


if __name__ == "__main__":
    main()
