"""`zeroplan validate`: measure a GPU node and write predicted vs measured (JSON + markdown).

The library is ``zeroplan.bench.gpu_validate`` (measurements) and
``zeroplan.bench.validate_report`` (the writer). torch is imported inside the command only.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Optional

import typer

from zeroplan._util import InputError
from zeroplan.bench.gpu_validate import CHECKS as _CHECKS  # torch-free at import: the list of checks
from zeroplan.commands._common import console, err_console, handle_errors

__all__ = ["register", "cuda_status"]


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): a CUDA device torch can use, else why not."""
    import os

    import torch

    # NVML, not the CUDA runtime: a runtime probe here would break the ranks validate forks later
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not torch.cuda.is_available():
        return False, (f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
                       f"{torch.version.cuda or 'none'})")
    from zeroplan.runtime.gpus import visible_gpu_count

    return True, f"{visible_gpu_count()} device(s)"


@handle_errors
def validate(
    output: str = typer.Option(..., "--output", help="Directory for validation.json and validation.md (atomic)."),
    model: str = typer.Option("llama-2-7b", "--model", help="Catalog model whose layer shapes are measured."),
    gpus: int = typer.Option(8, "--gpus", help="Virtual world size for the DeepSpeed rank-0 check."),
    precision: str = typer.Option("bf16", "--precision", help="bf16, fp16 or fp32."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-step."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence."),
    layers: int = typer.Option(2, "--layers", help="Layers of the model kept for the engine checks."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Scale the hidden size (default: the model's)."),
    hardware: Optional[str] = typer.Option(None, "--hardware",
                                           help="Profile the measurements are set beside: GEMM rate, links (α–β), "
                                                "overlap, PCIe, CPU-Adam."),
    checks: str = typer.Option(",".join(_CHECKS), "--checks", help="Comma list of " + ", ".join(_CHECKS) + "."),
) -> None:
    """Measure this GPU node (context, optimizer temporaries, activations, a layer's GEMMs, reserved
    vs allocated, real DeepSpeed as rank 0 of --gpus, PCIe copies, the CPU optimizer) against the
    planner; needs one CUDA GPU, more for the multi-GPU checks."""
    from zeroplan.commands.bench import require_torch

    wanted = tuple(c.strip() for c in checks.split(",") if c.strip())
    bad = [c for c in wanted if c not in _CHECKS]
    if bad or not wanted:
        raise InputError(f"--checks {checks!r}: expected a comma list of {', '.join(_CHECKS)}")
    if precision not in ("bf16", "fp16", "fp32"):
        raise InputError(f"--precision {precision!r}: expected bf16, fp16 or fp32")
    for name, v in (("--gpus", gpus), ("--micro-batch", micro_batch), ("--seq-len", seq_len), ("--layers", layers)):
        if v < 1:
            raise InputError(f"{name} {v}: expected a whole number >= 1")
    from zeroplan.bench.validate_report import check_validation_dir

    check_validation_dir(output)  # a bad --output is found now, not after minutes of measurement
    hw = None
    if hardware is not None:
        from zeroplan.specs.hardware import load_profile

        hw = load_profile(hardware)
    require_torch("validate")  # after the torch-free checks: a typo is reported at once
    ok, why = cuda_status()
    if not ok:
        raise InputError(f"no CUDA device: {why}; run zeroplan validate on a GPU node")
    from zeroplan.bench.gpu_validate import run_validation
    from zeroplan.bench.validate_report import write_validation

    command = "zeroplan " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.monotonic()

    def progress(check: str, partial: dict) -> None:
        # the report so far is on disk before each check: a run stopped part-way keeps what it measured
        write_validation({**partial, "command": command, "incomplete": f"stopped before or during {check}"}, output)
        err_console().print(f"validate: {check} ({len(partial['rows'])} rows so far, "
                            f"{time.monotonic() - started:.0f} s)", markup=False)

    report = run_validation("cuda", model=model, gpus=gpus, precision=precision, micro_batch=micro_batch,
                            seq_len=seq_len, layers=layers, hidden=hidden, hardware=hw, checks=wanted,
                            progress=progress)
    report["command"] = command
    js, md = write_validation(report, output)
    console().print(f"wrote {js} and {md} ({len(report['rows'])} rows)")


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
