"""The typer app: a thin shell that parses options, calls the library and renders.

Exit codes: 0 success / check passed; 1 check failed or a bench figure out of tolerance;
2 bad input (one clear line on stderr, never a traceback).

Usage mistakes (an unknown option, a value of the wrong type, a missing value) are bad input
too: ``zeroplan: error: …`` on one line and exit 2, not click's boxed panel. Help is click's
plain formatter (every option with its description and default, flags as ``--x / --no-x``),
up to 120 columns wide and never cutting option names.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import os
import signal
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

from zeroplan._util import InputError, ascii_digits

__all__ = ["app", "main", "HELP_WIDTH"]

HELP_WIDTH = 120
MIN_COLUMNS = 40  # a COLUMNS below this is ignored (the terminal's own width, or 80 in a pipe, is used)


def _error_line(msg: str) -> None:
    one_line = " ".join(str(msg).split())
    try:
        sys.stderr.write(f"zeroplan: error: {one_line}\n")
        sys.stderr.flush()
    except UnicodeEncodeError:  # an ASCII-only stderr: the same line with escapes
        _error_line(one_line.encode("ascii", "backslashreplace").decode("ascii"))
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


class _StdoutGone(Exception):
    """stdout's reader went away (EPIPE) inside a command. Click's ``main`` turns an EPIPE OSError,
    and Rich's ``Console.on_broken_pipe`` a BrokenPipeError, into a bare exit 1 (which ``check``
    documents as "a finding failed"); this one passes through Click to ``main`` below, which exits
    quietly with 141 as for SIGPIPE."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _ZeroplanGroup(TyperGroup):
    """The root group: runs click non-standalone so usage errors are ours to print (one line)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
                raise _StdoutGone(exc) from exc
            raise
        except SystemExit as exc:
            if isinstance(exc.__context__, BrokenPipeError):  # Rich's Console.on_broken_pipe
                raise _StdoutGone(exc.__context__) from exc
            raise

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        from zeroplan._util import input_guard

        try:
            with input_guard():  # no output of this command replaces a file it read
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
        if rv == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into a silent Exit(130): say why we stop
            _error_line("interrupted")
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


_app = typer.Typer(
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
    context_settings={"max_content_width": HELP_WIDTH, "help_option_names": ["--help", "-h"], "show_default": True,
                      **({} if sys.stdout is not None and sys.stdout.isatty() else {"terminal_width": HELP_WIDTH})},
)

# command name -> the module whose register(app) adds it; order = order in --help.
COMMANDS = {
    "estimate": "estimate",
    "recommend": "recommend",
    "check": "check",
    "bench": "bench",
    "validate": "validate",
    "profiles": "profiles",
    "models": "models",
    "detect": "detect",
    "report": "report",
    "nccl-log": "nccl_log",
    "schema": "schema",
}
_registered: list[str] = []


def _register(names: Any) -> typer.Typer:
    """Import and register the command modules for ``names`` (each once, in --help order).

    A command module imports its renderers and the API only when it runs, but typer needs the
    command functions at registration; so a plain invocation registers just the command it
    names (``main`` peeks at argv), and ``--help``, a typo or ``app`` (tests) register all.
    """
    for name in COMMANDS:
        if name not in names or name in _registered:
            continue
        _registered.append(name)
        module = f"zeroplan.commands.{COMMANDS[name]}"
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name != module:
                raise
            continue
        mod.register(_app)
    if len(_registered) == 1 and not _app.registered_callback:
        # typer turns an app with one command and no callback into that command: keep it a group
        _app.callback()(_group)
    return _app


def _group() -> None:
    pass


def _invoked(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else list(argv)
    return args[0] if args and args[0] in COMMANDS else None


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole CLI (every command registered), e.g. for typer.testing.CliRunner
        return _register(COMMANDS)
    raise AttributeError(f"module 'zeroplan.cli' has no attribute {name!r}")


def _error(msg: str) -> None:
    """One ``zeroplan: error:`` line with control characters and lone surrogates escaped."""
    from zeroplan._util import safe_text

    _error_line(safe_text(msg))


class Terminated(BaseException):
    """SIGTERM or SIGHUP (the terminal or SSH session went away) as an exception, so ``finally``
    blocks and context managers remove temp files; ``args[0]`` is the signal number."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signal.Signals(signum)

    def __str__(self) -> str:
        return f"terminated by {self.signum.name}"


_TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated(signum)


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


def _drop_unreadable_terminal_size() -> None:
    """Rich reads ``COLUMNS``/``LINES`` with int() when ``str.isdigit()`` says they are digits, and
    int() raises for digits it cannot take ("²" is a digit to isdigit(); over 4,300 digits is
    CPython's limit). Such a value is dropped and the terminal's own size is used. A width that
    parses is bounded where it matters (charts: report/charts.MAX_CHART_WIDTH). A width under
    ``MIN_COLUMNS`` is dropped too: Rich renders nothing at all at 0 columns (not even an error line)
    and empty table rows at a few."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name, "")
        if value.isdigit() and (not ascii_digits(value, 9) or (name == "COLUMNS" and int(value) < MIN_COLUMNS)):
            del os.environ[name]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: InputError → exit 2 with one line; SIGINT → 130; SIGTERM → 143;
    SIGHUP → 129."""
    from zeroplan._util import remove_live_temps

    _drop_unreadable_terminal_size()

    for stream in (sys.stdout, sys.stderr):
        try:  # an ASCII locale or a lone surrogate in a name: replace, never UnicodeEncodeError
            stream.reconfigure(errors="replace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass
    atexit.register(remove_live_temps)
    if sys.stdout is None:  # started with stdout closed (`zeroplan ... >&-`)
        _error("standard output is closed: nothing could be printed (redirect it to a file or /dev/null)")
        sys.exit(2)
    command = _invoked(argv)
    app = _register([command] if command is not None and not _registered else COMMANDS)
    try:
        for signum in _TERMINATING_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # `nohup zeroplan bench …` keeps running
                signal.signal(signum, _on_sigterm)
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
    except Terminated as exc:
        _error(f"terminated ({exc.signum.name})")
        code = 128 + int(exc.signum)
    except (BrokenPipeError, UnicodeEncodeError) as exc:
        code = _output_error(exc)
    except _StdoutGone as exc:
        code = _output_error(exc.exc)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT):
            raise
        code = _output_error(exc)
    finally:
        remove_live_temps()
    sys.exit(code)
