"""The typer app: a thin shell that parses options, calls the library and renders.

Exit codes: 0 success / check passed; 1 check failed or a bench figure out of tolerance;
2 bad input (one clear line on stderr, never a traceback).

Usage mistakes (an unknown option, a value of the wrong type, a missing value) are bad input
too: ``zeroplan: error: …`` on one line and exit 2, not click's boxed panel. Help is click's
plain formatter (every option with its description and default, flags as ``--x / --no-x``),
up to 120 columns wide and never cutting option names.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer >= 0.2x vendors click as typer._click; its exceptions are not click's
    from typer._click import exceptions as _cx
    from typer._click.utils import echo as _echo
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as _cx  # type: ignore[no-redef]
    from click.utils import echo as _echo  # type: ignore[no-redef]

from zeroplan._util import InputError

__all__ = ["app", "main", "HELP_WIDTH"]

HELP_WIDTH = 120


def _error_line(msg: str) -> None:
    one_line = " ".join(str(msg).split())
    try:
        sys.stderr.write(f"zeroplan: error: {one_line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _usage_message(exc: _cx.UsageError) -> str:
    msg = exc.format_message().rstrip(".")
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if callable(errors):  # typer coerces with pydantic: name the value that failed
        try:
            msg += f" (got {errors()[0]['input']!r})"
        except (LookupError, TypeError, ValueError):
            pass
    ctx = exc.ctx
    if ctx is not None:
        msg += f" (see '{ctx.command_path} --help')"
    return msg


class _ZeroplanGroup(TyperGroup):
    """The root group: runs click non-standalone so usage errors are ours to print (one line)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            rv = super().main(args=args, prog_name=prog_name or "zeroplan", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except _cx.NoArgsIsHelpError as exc:
            _echo(exc.ctx.get_help())
            rv = 0
        except _cx.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter, ...
            _error_line(_usage_message(exc))
            rv = 2
        except _cx.ClickException as exc:
            _error_line(exc.format_message())
            rv = exc.exit_code
        except InputError as exc:
            _error_line(str(exc))
            rv = 2
        except typer.Abort:
            _error_line("interrupted")
            rv = 130
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="zeroplan",
    cls=_ZeroplanGroup,
    help=(
        "Plan DeepSpeed ZeRO before booking GPUs: which stage, offload and bucket settings fit a "
        "model on a cluster, what the communication costs on that network, and proof on the cluster."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    # on a terminal help fits its width (up to HELP_WIDTH); in pipes and logs it is HELP_WIDTH wide
    context_settings={"max_content_width": HELP_WIDTH, "help_option_names": ["--help", "-h"],
                      "show_default": True, **({} if sys.stdout.isatty() else {"terminal_width": HELP_WIDTH})},
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
    "schema",
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
