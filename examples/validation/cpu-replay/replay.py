"""Real DeepSpeed's rank 0 of 8 on CPU, with every tensor storage counted while it lives: the same runs as
the H200's `zeroplan validate --checks deepspeed` (examples/validation/gpu/h200-2026-11-26/deepspeed-stages-*.json).

    python examples/validation/cpu-replay/replay.py MICRO_BATCH SEQ_LEN OUT.json

The report has the validate format (rows of predicted beside measured); ``predicted`` is the plan with no
hardware profile (the tensors alone, as a CPU counts them).
"""

from __future__ import annotations

import json
import platform
import sys

import torch

from zeroplan.bench.validate import scaled_spec
from zeroplan.bench.validate_deepspeed import deepspeed_stages
from zeroplan.specs.model import load_model


def main() -> None:
    mb, seq, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    spec = scaled_spec(load_model("llama-2-7b"), layers=2, hidden=None, vocab=None, experts=None)
    rows = deepspeed_stages("cpu", spec, n=8, precision="bf16", micro_batch=mb, seq_len=seq)
    import deepspeed

    report = {"environment": {"device": "cpu", "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                              "python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
              "inputs": {"model": "llama-2-7b", "scaled": {"layers": 2}, "gpus": 8, "precision": "bf16",
                         "micro_batch": mb, "seq_len": seq},
              "rows": rows, "command": f"python examples/validation/cpu-replay/replay.py {mb} {seq} {out}"}
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main()
