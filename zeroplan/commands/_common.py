"""Shared CLI plumbing: error handling, JSON output, consoles."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable, TypeVar

import typer

from zeroplan._util import InputError

__all__ = ["handle_errors", "print_json", "console", "err_console", "fail", "IMPL_OPT"]

F = TypeVar("F", bound=Callable[..., Any])

IMPL_OPT = typer.Option(
    None, "--optimizer-impl",
    help="How the Adam step runs on the GPU: fused-adam (DeepSpeed FusedAdam, no temporaries), torch-foreach "
         "(torch AdamW foreach, 4 B/element), torch-fused, torch-single (foreach=False) or cpu-adam. "
         "Default: from --ds-config (optimizer block: fused-adam; none: torch-foreach), else fused-adam.")


def console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


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
