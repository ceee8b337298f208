"""Shared CLI plumbing: the planning options, error handling, JSON output, consoles.

The planning options are defined ONCE here (typer ``Annotated`` types) and used by ``estimate``,
``recommend``, ``check`` and ``report``: one name, one type, one meaning and one default each.
Options that a command cannot honour are not offered by it (``check`` gates the stage and
offload its config file sets, so it has no ``--stage``/``--offload-*``/``--ds-config``).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable, List, Optional, TypeVar

import typer
from typing_extensions import Annotated

from zeroplan._util import InputError

__all__ = [
    "handle_errors", "print_json", "console", "err_console", "fail", "parse_stages",
    "Model", "Hardware", "Gpus", "Nodes", "GpusPerNode", "DsConfig", "Precision", "Optimizer", "MicroBatch",
    "SeqLen", "GradAccum", "Checkpointing", "FlashAttention", "OffloadOptimizer", "OffloadParam", "Stage",
    "Headroom", "CommModel", "OptimizerImpl", "Mfu", "Strict", "Lenient", "Json",
    "DEFAULT_HEADROOM", "DEFAULT_MFU", "DEFAULT_COMM_MODEL",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_HEADROOM = 0.10
DEFAULT_MFU: float | None = None  # None: the compute model (rate by GPU generation and shape)
DEFAULT_COMM_MODEL = "deepspeed"

# ------------------------------------------------------------------------------ shared options
Model = Annotated[str, typer.Option(
    "--model", "-m", metavar="NAME|PATH|COUNT",
    help="Catalog name (see `zeroplan models list`), a Hugging Face Hub id found in the catalog or in the "
         "local Hugging Face cache (never downloaded), a path to a config.json, or a count such as 7B, 70e9, 1.3T.")]
Hardware = Annotated[Optional[str], typer.Option(
    "--hardware", "-H", metavar="NAME|PATH", show_default="none (memory only; recommend and check need one)",
    help="Hardware profile name (see `zeroplan profiles list`) or path to a profile TOML.")]
Gpus = Annotated[Optional[int], typer.Option(
    "--gpus", "-g", metavar="N", show_default="--nodes × --gpus-per-node, else one node",
    help="Total data-parallel GPUs.")]
Nodes = Annotated[Optional[int], typer.Option(
    "--nodes", "-n", metavar="N", show_default="1",
    help="Nodes; GPUs = nodes × --gpus-per-node.")]
GpusPerNode = Annotated[Optional[int], typer.Option(
    "--gpus-per-node", metavar="N", show_default="the hardware profile's, else 8",
    help="GPUs per node.")]
DsConfig = Annotated[Optional[str], typer.Option(
    "--ds-config", "-c", metavar="PATH", show_default="none",
    help="DeepSpeed JSON config to plan; its zero_optimization.stage selects the stage. A config DeepSpeed "
         "would refuse is an error (exit 2) unless --lenient.")]
Precision = Annotated[Optional[str], typer.Option(
    "--precision", "-p", metavar="fp32|bf16|fp16", show_default="from --ds-config, else fp32",
    help="Training precision: fp32 (4/4/12 bytes per parameter), bf16 or fp16 (2/2/12). Also resolves a "
         "config's \"enabled\": \"auto\".")]
Optimizer = Annotated[Optional[str], typer.Option(
    "--optimizer", metavar="NAME", show_default="from --ds-config, else adamw",
    help="adamw, adam, sgd-momentum, sgd or adam8bit.")]
MicroBatch = Annotated[Optional[int], typer.Option(
    "--micro-batch", "-b", metavar="N", show_default="from the config, else 1; recommend searches",
    help="Micro-batch size per GPU (overrides the config's train_micro_batch_size_per_gpu).")]
SeqLen = Annotated[Optional[int], typer.Option(
    "--seq-len", "-s", metavar="TOKENS", show_default="the config's zeroplan.seq_len, else 2048",
    help="Sequence length in tokens.")]
GradAccum = Annotated[Optional[int], typer.Option(
    "--grad-accum", metavar="N", show_default="from the config, else 1",
    help="Gradient accumulation steps.")]
Checkpointing = Annotated[Optional[str], typer.Option(
    "--checkpointing", metavar="none|selective|full",
    show_default="the config's zeroplan.checkpointing, else none; recommend searches",
    help="Activation checkpointing the training script uses (not a DeepSpeed switch).")]
FlashAttention = Annotated[Optional[bool], typer.Option(
    "--flash-attention/--no-flash-attention", show_default="the config's zeroplan.flash_attention, else on",
    help="Flash attention (no s² attention-score activations).")]
OffloadOptimizer = Annotated[Optional[str], typer.Option(
    "--offload-optimizer", metavar="none|cpu|nvme", show_default="from --ds-config, else none",
    help="Offload optimizer states (stages 1–3).")]
OffloadParam = Annotated[Optional[str], typer.Option(
    "--offload-param", metavar="none|cpu|nvme", show_default="from --ds-config, else none",
    help="Offload parameters (stage 3).")]
Stage = Annotated[Optional[List[str]], typer.Option(
    "--stage", metavar="0-3", show_default="all four, or --ds-config's stage",
    help="ZeRO stage(s) to evaluate; repeat or separate with commas (--stage 2 --stage 3, --stage 2,3).")]
Headroom = Annotated[float, typer.Option(
    "--headroom", metavar="FRACTION",
    help="Fraction of GPU memory and host RAM to keep free (0–1): recommend only chooses configurations "
         "that leave it; check warns (ZP103) below it.")]
CommModel = Annotated[str, typer.Option(
    "--flavour", "--comm-model", metavar="deepspeed|paper",
    help="deepspeed: what DeepSpeed 0.19.8 allocates and issues; paper: the ZeRO paper's accounting (4/4/12 = 20 "
         "B/param in fp32; 2Ψ/2Ψ/3Ψ communication). --comm-model is an alias.")]
OptimizerImpl = Annotated[Optional[str], typer.Option(
    "--optimizer-impl", metavar="fused-adam|torch-foreach|torch-fused|torch-single|cpu-adam",
    show_default="from --ds-config (an optimizer block: fused-adam; none: torch-foreach), else fused-adam",
    help="How the Adam step runs on the GPU: DeepSpeed FusedAdam (no temporaries), torch AdamW foreach "
         "(4 B/element), fused, single-tensor (8 B/element of the largest tensor) or DeepSpeedCPUAdam (host).")]
Mfu = Annotated[Optional[float], typer.Option(
    "--mfu", metavar="FRACTION", show_default="the compute model (FLOPs from the architecture at a rate by GPU "
    "generation and shape)", help="Override the compute model with a fixed model FLOPs utilisation (0–1].")]
Strict = Annotated[bool, typer.Option(
    "--strict/--no-strict",
    help="Also refuse config warnings DeepSpeed tolerates (unknown top-level keys, coerced types).")]
Lenient = Annotated[bool, typer.Option(
    "--lenient/--no-lenient",
    help="Plan a --ds-config even when DeepSpeed would refuse it (its errors become findings, defaults used).")]
Json = Annotated[bool, typer.Option(
    "--json/--no-json", help="Print one JSON object on stdout, nothing else.")]


def parse_stages(values: list[str] | None) -> list[int] | None:
    """``--stage`` values (repeated and/or comma-separated) -> sorted unique stages, or None."""
    if not values:
        return None
    out: list[int] = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if part not in ("0", "1", "2", "3"):
                raise InputError(f"--stage {part or v!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
            out.append(int(part))
    return sorted(set(out))


# ------------------------------------------------------------------------------ output
def console():
    """stdout console. On a terminal rich wraps to its width; otherwise (pipes, CI logs, files) text
    is never wrapped, so one finding or sentence stays on one line (tables keep their layout)."""
    from rich.console import Console

    c = Console(highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c.soft_wrap = True
    return c


def err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(msg: str, code: int = 2) -> None:
    """Print one error line on stderr and exit with ``code`` (2 = bad input)."""
    one_line = " ".join(str(msg).splitlines())  # user-supplied keys can carry newlines: keep it one line
    err_console().print(f"[bold red]error:[/] {one_line.replace('[', chr(92) + '[')}")
    raise typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Turn InputError (a user mistake) into one stderr line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            fail(str(exc), 2)

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    """Print one JSON object on stdout, nothing else. Accepts pydantic models."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()
