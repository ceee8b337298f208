"""Ground-floor helpers shared by every layer (imports nothing of zeroplan).

- ``InputError``: a user mistake. The CLI prints its message on one line and exits 2.
- ``atomic_write_text`` / ``atomic_write_bytes``: every file zeroplan writes goes to a
  temporary file in the same directory and is renamed over the target, so an
  interrupted write never leaves a truncated file.
- ``parse_count``: "7B", "70e9", "1.3T", "125M" -> int.
- Unit helpers: GB = 10**9 bytes, GiB = 2**30 bytes. Never print "GB" for GiB.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

__all__ = [
    "InputError",
    "atomic_write_text",
    "atomic_write_bytes",
    "parse_count",
    "GB",
    "GiB",
    "fmt_bytes",
    "fmt_gb",
    "fmt_gib",
    "read_text_file",
]

GB = 10**9
GiB = 2**30


class InputError(Exception):
    """Bad input from the user: exit code 2 with this one-line message, no traceback.

    Messages name the file, the key, the value and what was expected.
    """


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory + rename."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{target}: is a directory, expected a file path to write")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise InputError(f"{target}: directory {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise InputError(f"{target}: cannot write here: {exc.strerror or exc}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file normal permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"{target}: cannot write: {exc.strerror or exc}") from None
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_text_file(path: str | os.PathLike, what: str = "file") -> str:
    """Read a UTF-8 text file or raise InputError naming the file and the problem."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: {what} not found")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected a {what}")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"{p}: cannot read {what}: {exc.strerror or exc}") from None
    if not raw.strip():
        raise InputError(f"{p}: {what} is empty")
    if b"\x00" in raw[:4096]:
        raise InputError(f"{p}: {what} is binary, expected UTF-8 text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{p}: {what} is not valid UTF-8 (byte {exc.start})") from None


_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.I)


def parse_count(text: str, what: str = "count") -> int:
    """Parse '7B', '70e9', '1.3T', '125M', '6738415616' into an int (decimal suffixes)."""
    m = _COUNT_RE.match(str(text))
    if not m:
        raise InputError(f"{what} {text!r} is not a number such as 7B, 70e9, 1.3T or 125M")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{what} {text!r} must be a positive finite number")
    if value > 1e16:
        raise InputError(f"{what} {text!r} is beyond 1e16; no model that size can be planned")
    return int(round(value))


def fmt_gb(n: float, digits: int = 2) -> str:
    """Decimal gigabytes, labelled GB (10**9 bytes)."""
    return f"{n / GB:,.{digits}f} GB"


def fmt_gib(n: float, digits: int = 2) -> str:
    """Binary gibibytes, labelled GiB (2**30 bytes)."""
    return f"{n / GiB:,.{digits}f} GiB"


def fmt_bytes(n: float) -> str:
    """Human size with an honest unit: GiB/MiB/KiB for binary quantities."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
