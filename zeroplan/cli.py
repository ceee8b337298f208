"""The typer app: a thin shell that parses options, calls the library and renders.

Exit codes: 0 success / check passed; 1 check failed or a bench figure out of tolerance;
2 bad input (one clear line on stderr, never a traceback).
"""

from __future__ import annotations

import atexit
import errno
import importlib
import os
import signal
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
    from rich.markup import escape

    from zeroplan._util import safe_text

    line = safe_text(" ".join(str(msg).splitlines()))
    try:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(line)}", markup=True)
    except (OSError, UnicodeError):  # stderr closed, full or ASCII-only: last resort, never a traceback
        try:
            os.write(2, f"error: {line}\n".encode("ascii", "replace"))
        except OSError:
            pass


class Terminated(BaseException):
    """SIGTERM as an exception, so ``finally`` blocks and context managers remove temp files."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def _output_error(exc: BaseException) -> int:
    """stdout could not take the output: closed pipe (quiet, 141), full disk or encoding (one line, 2)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more reaches the broken stdout at exit
    except (OSError, ValueError):
        pass
    if isinstance(exc, BrokenPipeError) or getattr(exc, "errno", None) == errno.EPIPE:
        return 128 + signal.SIGPIPE  # the reader went away (e.g. `| head`): quiet, as with SIGPIPE
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    _error(f"cannot write the output to stdout: {why}")
    return 2


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: InputError → exit 2 with one line; SIGINT → 130; SIGTERM → 143."""
    from zeroplan._util import remove_live_temps

    for stream in (sys.stdout, sys.stderr):
        try:  # an ASCII locale or a lone surrogate in a name: replace, never UnicodeEncodeError
            stream.reconfigure(errors="replace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass
    atexit.register(remove_live_temps)
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (embedded use): leave the default
        pass
    code = 0
    try:
        try:
            app(args=argv, standalone_mode=True)
        finally:
            sys.stdout.flush()  # a full disk or closed pipe shows here, not at interpreter exit
    except SystemExit as exc:
        code = exc.code
    except InputError as exc:
        _error(str(exc))
        code = 2
    except KeyboardInterrupt:
        _error("interrupted")
        code = 130
    except Terminated:
        _error("terminated (SIGTERM)")
        code = 143
    except (BrokenPipeError, UnicodeEncodeError) as exc:
        code = _output_error(exc)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT):
            raise
        code = _output_error(exc)
    finally:
        remove_live_temps()
    sys.exit(code)
