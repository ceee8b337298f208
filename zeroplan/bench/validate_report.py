"""Write `zeroplan validate`'s report: one JSON file and one markdown table (torch-free).

``validation.json``: {"environment", "inputs", "rows", "command"}; each row
{"check", "figure", "predicted", "measured", "unit", "error", "note"} with ``error`` =
measured / predicted − 1 (None when either side is missing or the prediction is 0).
``validation.md``: the environment, the exact command and a predicted-vs-measured table.
Both are written atomically (``_util.atomic_write_text``); the markdown only after the JSON,
and neither when the report does not serialise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zeroplan._util import (InputError, atomic_write_text, display_path, expand_path, kernel_fs_root,
                            validate_output_path)

__all__ = ["render_markdown", "write_validation", "check_validation_dir", "JSON_NAME", "MD_NAME"]

JSON_NAME = "validation.json"
MD_NAME = "validation.md"


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return f"{int(v):,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_markdown(report: dict[str, Any]) -> str:
    """The predicted-vs-measured table with the environment and command above it."""
    env = report.get("environment", {})
    lines = ["# zeroplan validate", ""]
    if report.get("command"):
        lines += ["```", report["command"], "```", ""]
    lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
              "| check | figure | predicted | measured | unit | error | note |",
              "|---|---|---:|---:|---|---:|---|"]
    for r in report["rows"]:
        err = "-" if r.get("error") is None else f"{100 * r['error']:+.1f}%"
        cells = [r["check"], r["figure"], _fmt(r.get("predicted"), r.get("unit", "")),
                 _fmt(r.get("measured"), r.get("unit", "")), r.get("unit", ""), err, r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def check_validation_dir(out_dir: str) -> Path:
    """The directory ``validate --output`` names, checked before any measurement: an existing, writable
    directory whose two report files are writable paths (not inputs, links to devices or kernel files), or
    a path whose nearest existing ancestor is a writable directory (it is created). InputError if not."""
    d = Path(expand_path(out_dir))
    try:
        exists, is_link = d.exists(), d.is_symlink()
        if is_link and not exists:  # mkdir would fail on the link ("File exists") after the measurements
            raise InputError(f"--output {out_dir}: a symlink to {os.readlink(d)!r}, which does not exist (or "
                             "loops); expected a directory, or a path where one can be created")
        if exists:
            if not d.is_dir():
                raise InputError(f"--output {out_dir}: exists and is not a directory; expected a directory")
            if not os.access(d, os.W_OK | os.X_OK):
                raise InputError(f"--output {out_dir}: directory is not writable; expected one the reports can "
                                 "be written into")
            for name in (JSON_NAME, MD_NAME):
                validate_output_path(d / name, option="--output")
            return d
        ancestor = Path(os.path.realpath(d)).parent
        while not ancestor.exists():
            ancestor = ancestor.parent
    except OSError as exc:  # a parent the user cannot search (EACCES), a name too long
        raise InputError(f"--output {out_dir}: cannot inspect the path: {exc.strerror or exc}") from None
    kernel_fs = kernel_fs_root(ancestor)
    if kernel_fs:
        raise InputError(f"--output {out_dir}: under /{kernel_fs}, a kernel pseudo-filesystem; "
                         "expected a directory to write validation.json and validation.md into")
    if not ancestor.is_dir():
        raise InputError(f"--output {out_dir}: {display_path(ancestor)} is not a directory, so the directory "
                         "cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"--output {out_dir}: directory {display_path(ancestor)} is not writable, so the "
                         "directory cannot be created")
    return d


def write_validation(report: dict[str, Any], out_dir: str) -> tuple[Path, Path]:
    """Write ``validation.json`` and ``validation.md`` into ``out_dir`` (created if missing)."""
    d = check_validation_dir(out_dir)
    text = json.dumps(report, indent=2, allow_nan=False, default=str) + "\n"  # fails before any write
    md = render_markdown(report)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--output {out_dir}: cannot create the directory: {exc.strerror or exc}") from None
    return atomic_write_text(d / JSON_NAME, text), atomic_write_text(d / MD_NAME, md)
