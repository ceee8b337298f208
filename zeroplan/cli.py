"""The typer app: a thin shell that parses options, calls the library and renders.

Exit codes: 0 success / check passed; 1 check failed or a bench figure out of tolerance;
2 bad input (one clear line on stderr, never a traceback).
"""

from __future__ import annotations

import importlib
import sys

import typer

from zeroplan._util import InputError

__all__ = ["app", "main"]

app = typer.Typer(
    name="zeroplan",
    help=(
        "Plan DeepSpeed ZeRO before booking GPUs: which stage, offload and bucket settings fit a "
        "model on a cluster, what the communication costs on that network, and proof on the cluster."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# Each module registers its own commands; order = order in --help.
_COMMAND_MODULES = (
    "estimate",
    "recommend",
    "check",
    "bench",
    "validate",
    "profiles",
    "models",
    "detect",
    "report",
    "nccl_log",
)

for _name in _COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"zeroplan.commands.{_name}")
    except ModuleNotFoundError as _exc:  # a command module not written yet
        if _exc.name != f"zeroplan.commands.{_name}":
            raise
        continue
    _mod.register(app)


def _error(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {msg}", markup=True)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: maps InputError to exit code 2 without a traceback."""
    try:
        app(args=argv, standalone_mode=True)
    except InputError as exc:
        _error(" ".join(str(exc).splitlines()).replace("[", "\\["))
        sys.exit(2)
    except KeyboardInterrupt:
        _error("interrupted")
        sys.exit(130)
