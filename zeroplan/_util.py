"""Ground-floor helpers shared by every layer (imports nothing of zeroplan).

- ``InputError``: a user mistake. The CLI prints its message on one line and exits 2.
- ``atomic_write_text`` / ``atomic_write_bytes``: every file zeroplan writes goes to a
  temporary file in the same directory and is renamed over the target, so an
  interrupted write never leaves a truncated file.
- ``parse_count``: "7B", "70e9", "1.3T", "125M" -> int.
- Unit helpers: GB = 10**9 bytes, GiB = 2**30 bytes. Never print "GB" for GiB.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import signal
import stat
import tempfile
from collections.abc import Iterator
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
    "input_guard",
    "kernel_fs_root",
    "read_input_bytes",
    "CONFIG_MAX_BYTES",
    "LOG_MAX_BYTES",
    "validate_output_path",
    "display_path",
    "safe_text",
    "atomic_write_files",
    "expand_path",
    "data_kind",
    "DuplicateKeyError",
    "no_duplicate_keys",
    "remove_live_temps",
]

GB = 10**9
GiB = 2**30


class InputError(Exception):
    """Bad input from the user: exit code 2 with this one-line message, no traceback.

    Messages name the file, the key, the value and what was expected.
    """


# ---------------------------------------------------------------------------------------------
# Output paths: validated before any work, written atomically, never renamed over a device
# ---------------------------------------------------------------------------------------------

_NAME_MAX_BYTES = 255  # NAME_MAX on Linux/macOS file systems
_TMP_RANDOM_BYTES = 8 + len(".tmp")  # mkstemp's random part + our suffix
_LIVE_TEMPS: set[str] = set()
# temp files being written are removed on these signals and at exit
_CLEANUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def display_path(path: str | os.PathLike) -> str:
    """A path as printable text: undecodable bytes as \\xNN, control characters escaped."""
    raw = os.fsencode(path)
    return safe_text(raw.decode("utf-8", "backslashreplace"))


_ANSI_RE = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")


def safe_text(text: str) -> str:
    """Strip ANSI escape sequences, escape other control characters and lone surrogates.

    Every regex here is a single character class or a bounded run: linear in the input.
    """
    text = _ANSI_RE.sub("", str(text))
    text = _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return _SURROGATE_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def data_kind(value: object) -> str:
    """What a parsed JSON/YAML value is, in the file's words (null, a number, a string, a list, an object),
    not Python's type names (NoneType, int, str)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a fractional number" if math.isfinite(value) and value != int(value) else "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    import datetime

    if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads 2024-01-01 as a date
        return "a date"
    if isinstance(value, (set, frozenset)):  # YAML's !!set
        return "a set"
    return type(value).__name__


class DuplicateKeyError(ValueError):
    """A JSON object with a key given twice (``args[0]``: the key)."""


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``object_pairs_hook`` for ``json`` and ``hjson``: a key given twice raises ``DuplicateKeyError``, as
    DeepSpeed 0.19.8's ``runtime/config_utils.py::dict_raise_error_on_duplicate_keys`` does; plain ``json``
    would keep the last value silently."""
    d: dict[str, object] = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKeyError(k)
        d[k] = v
    return d


def expand_path(path: str | os.PathLike) -> str:
    """``~`` and ``~user`` expanded; nothing else (no globbing, no variables)."""
    return os.path.expanduser(os.fspath(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a special file"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# Every regular file ``read_input_bytes`` read during one CLI command, by (st_dev, st_ino): the
# files an option names and the ones found through them (the DeepSpeed config a training file
# points to, a model directory's config.json, the HF cache). While a command runs (the CLI turns
# it on in ``input_guard``) no output may replace one of them; library calls outside the CLI
# record nothing.
_INPUTS_READ: dict[tuple[int, int], str] | None = None


@contextlib.contextmanager
def input_guard() -> Iterator[None]:
    """Within the block, refuse any write over a file ``read_input_bytes`` has read (one command)."""
    global _INPUTS_READ
    outer, _INPUTS_READ = _INPUTS_READ, {}
    try:
        yield
    finally:
        _INPUTS_READ = outer


def _refuse_input_overwrite(st: os.stat_result | None, shown: str) -> None:
    if st is not None and _INPUTS_READ and (st.st_dev, st.st_ino) in _INPUTS_READ:
        raise InputError(f"{shown}: is the same file as the input {_INPUTS_READ[(st.st_dev, st.st_ino)]} this "
                         "command read; refusing to overwrite it")


def kernel_fs_root(path: Path) -> str | None:
    """``"proc"`` or ``"sys"`` when the resolved ``path`` lies under that kernel pseudo-filesystem (its files
    stat as regular, of size 0, and take no temporary file beside them), else None."""
    return path.parts[1] if path.parts[1:2] in (("proc",), ("sys",)) else None


def _resolve_output(path: str | os.PathLike, option: str = "") -> tuple[Path, os.stat_result | None]:
    """(file to write, its stat or None when it does not exist yet), or InputError.

    A symlink is followed to its target (the link stays); a directory, a trailing slash, a
    block device, a socket or a missing parent directory is refused. A character device or a
    FIFO is returned as is: the writer writes it in place and never renames over it.
    """
    shown = f"{option} {display_path(path)}" if option else display_path(path)
    text = os.fspath(path)
    if not text:
        raise InputError(f"{option or 'output path'}: empty path, expected a file path to write")
    if text == "-":  # the commands whose output can be stdout map "-" to it before this check
        raise InputError(f"{shown}: expected a file path; this option cannot write to stdout, and a file named "
                         "'-' is never what '-' means")
    if "\0" in text:  # no OS path holds one (os.stat raises ValueError); reachable through the API
        raise InputError(f"{shown}: contains a NUL character, expected a file path to write")
    if text.endswith(os.sep) or text.endswith("/."):
        raise InputError(f"{shown}: ends with a slash (a directory), expected a file path to write")
    target = Path(os.path.realpath(expand_path(text)))  # follows every symlink, also a dangling one
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
    _refuse_input_overwrite(st, shown)
    kernel_fs = kernel_fs_root(target)
    if kernel_fs:
        if target.parent.name == "fd":  # /dev/stdout into a pipe: /proc/<pid>/fd/pipe:[N]
            raise InputError(f"{shown}: resolves to {target}, an open pipe or socket, not a file; write to "
                             "stdout with '-' where the option takes it, or give a file path")
        raise InputError(f"{shown}: resolves to {target}, a kernel pseudo-file under /{kernel_fs}; "
                         "expected a path to a regular file to write")
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{shown}: is a directory, expected a file path to write")
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise InputError(f"{shown}: is {_kind(st.st_mode)}, expected a regular file, a character device or a FIFO")
        return target, st
    parent = target.parent
    if not parent.is_dir():
        raise InputError(f"{shown}: directory {display_path(parent)} does not exist")
    if len(os.fsencode(target.name)) > _NAME_MAX_BYTES:
        raise InputError(f"{shown}: file name longer than {_NAME_MAX_BYTES} bytes")
    return target, st


def validate_output_path(path: str | os.PathLike | None, *, option: str = "",
                         inputs: dict[str, str | os.PathLike | None] | None = None) -> Path | None:
    """Check an output path before any work is done; InputError (exit 2) with one line if unusable.

    ``inputs`` maps an option name (``--ds-config``) to a path the same command reads: the output
    may not be the same file, compared by resolved path and by (st_dev, st_ino), so a hard link,
    a symlink or ``./x`` versus ``x`` is caught. Returns the file that will be written.
    """
    if path is None:
        return None
    target, st = _resolve_output(path, option)
    for name, inp in (inputs or {}).items():
        if inp is None:
            continue
        for one in ([inp] if isinstance(inp, (str, os.PathLike)) else list(inp)):
            src = Path(os.path.realpath(expand_path(one)))
            try:
                same = src == target or (st is not None and _same_file(os.stat(src), st))
            except OSError:
                same = False
            if same:
                what = f"the input {name}" if name.startswith("-") else name  # "--ds-config", or said in full
                raise InputError(f"{option or 'output'} {display_path(path)}: is the same file as {what} "
                                 f"{display_path(one)}; refusing to overwrite it")
    return target


def _write_in_place(target: Path, st: os.stat_result, data: bytes, shown: str) -> None:
    """Write a character device or a FIFO without creating, renaming or truncating anything."""
    flags = os.O_WRONLY | getattr(os, "O_NOCTTY", 0)
    if stat.S_ISFIFO(st.st_mode):
        flags |= os.O_NONBLOCK  # no reader: ENXIO at once instead of blocking forever
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        why = "a FIFO with no reader" if exc.errno == errno.ENXIO else (exc.strerror or str(exc))
        raise InputError(f"{shown}: cannot write: {why}") from None
    try:
        if flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory + rename.

    A symlink is resolved and its target replaced (the link stays a link); a character device
    or FIFO is written in place; the new file keeps the old file's mode, else 0666 & ~umask.
    """
    target, st = _resolve_output(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        _write_in_place(target, st, data, display_path(path))
        return Path(path)
    atomic_write_files([(path, data)])
    return Path(path)


def atomic_write_files(files: list[tuple[str | os.PathLike, bytes]]) -> None:
    """Write several regular files all or none: every temp file is written and synced before the
    first rename, so a full disk or a bad directory leaves every target as it was (a file and its
    sidecar never disagree). Symlinks are resolved as in ``atomic_write_bytes``."""
    staged: list[tuple[str, Path, str]] = []
    try:
        for path, data in files:
            target, st = _resolve_output(path)
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise InputError(f"{display_path(path)}: is {_kind(st.st_mode)}; expected a regular file path")
            staged.append((_staged_temp(target, st, data, display_path(path)), target, display_path(path)))
        for tmp, target, shown in staged:
            try:
                os.replace(tmp, target)  # same directory, temp already synced: fails only if the disk goes away
            except OSError as exc:
                raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
    finally:
        for tmp, _, _ in staged:
            try:
                os.unlink(tmp)  # renamed already: nothing there
            except OSError:
                pass
            _LIVE_TEMPS.discard(tmp)


def _staged_temp(target: Path, st: os.stat_result | None, data: bytes, shown: str) -> str:
    """A synced temp file beside ``target`` holding ``data`` (with the old file's mode and owner);
    registered in _LIVE_TEMPS until the caller renames or removes it."""
    name = os.fsencode(target.name)[: _NAME_MAX_BYTES - _TMP_RANDOM_BYTES - 2]
    # SIGINT/SIGTERM/SIGHUP are held while the temp file is created and registered, so a signal can
    # never land between the two and leave an untracked temp file behind.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _CLEANUP_SIGNALS) if hasattr(signal, "pthread_sigmask") else None
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.fsdecode(b"." + name + b"."), suffix=".tmp", dir=target.parent)
        _LIVE_TEMPS.add(tmp)
    except OSError as exc:
        raise InputError(f"{shown}: cannot create a temporary file in {display_path(target.parent)} to write it: "
                         f"{exc.strerror or exc}") from None
    finally:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    try:
        if st is not None:
            mode = stat.S_IMODE(st.st_mode)
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # mkstemp makes 0600; give the file normal permissions
        os.chmod(tmp, mode)
        if st is not None and hasattr(os, "fchown") and os.geteuid() == 0:
            try:
                os.fchown(fd, st.st_uid, st.st_gid)  # root rewriting a user's file keeps its owner
            except OSError:
                pass
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        _LIVE_TEMPS.discard(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
        raise
    return tmp


def remove_live_temps() -> None:
    """Remove temp files a write left half-done (called on SIGTERM and at exit)."""
    for tmp in list(_LIVE_TEMPS):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        _LIVE_TEMPS.discard(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Input files: regular files only, read with a size cap
# ---------------------------------------------------------------------------------------------

CONFIG_MAX_BYTES = 4 * 2**20  # a DeepSpeed config, HF config.json or profile TOML is a few KB; 4 MiB is absurd
LOG_MAX_BYTES = 256 * 2**20  # an NCCL debug log of a long multi-node run


def read_input_bytes(path: str | os.PathLike, what: str = "file", max_bytes: int = CONFIG_MAX_BYTES) -> bytes:
    """Read a regular file of at most ``max_bytes``; InputError naming it otherwise.

    Opened with O_NONBLOCK, so a FIFO never blocks the open; anything that is not a regular
    file after following symlinks (a FIFO, /dev/zero, a socket) is refused, and the read stops
    at ``max_bytes`` + 1 whatever the file claims its size is.
    """
    shown = display_path(path)
    if not os.fspath(path):  # `--ds-config ""` printed ": DeepSpeed config not found"
        raise InputError(f"{what} path is empty (''); expected the path to the {what} file")
    p = expand_path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise InputError(f"{shown}: {what} not found") from None
    except IsADirectoryError:
        raise InputError(f"{shown}: is a directory, expected a {what}") from None
    except (OSError, ValueError) as exc:  # ENAMETOOLONG, ELOOP, EACCES, an embedded NUL
        raise InputError(f"{shown}: cannot read {what}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{shown}: is a directory, expected a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{shown}: is {_kind(st.st_mode)}, expected a regular {what} file")
        if _INPUTS_READ is not None:
            _INPUTS_READ[(st.st_dev, st.st_ino)] = shown
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise InputError(f"{shown}: cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise InputError(f"{shown}: {what} is over {fmt_bytes(max_bytes)}; refusing to read it")
    return b"".join(chunks)


def read_text_file(path: str | os.PathLike, what: str = "file", max_bytes: int = CONFIG_MAX_BYTES) -> str:
    """Read a UTF-8 text file or raise InputError naming the file and the problem."""
    shown = display_path(path)
    raw = read_input_bytes(path, what, max_bytes)
    if not raw.strip():
        raise InputError(f"{shown}: {what} is empty")
    if b"\x00" in raw[:4096]:
        raise InputError(f"{shown}: {what} is binary, expected UTF-8 text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{shown}: {what} is not valid UTF-8 (byte {exc.start})") from None


_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Unambiguous (digits, then an optional fraction): linear, where "[0-9]*\.?[0-9]+" backtracked
# cubically on a long run of digits followed by a bad character (20,000 digits ran for minutes).
_COUNT_RE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.I)
_COUNT_MAX_CHARS = 64


def ascii_digits(text: str, max_digits: int = 30) -> bool:
    """True when int() takes ``text`` as a plain count: ASCII digits only ("²".isdigit() is true, but
    int("²") fails) and at most ``max_digits`` of them (int() refuses over 4,300)."""
    return text.isascii() and text.isdigit() and len(text) <= max_digits


def parse_error_text(exc: ValueError) -> str:
    """A JSON/TOML/YAML parser's ValueError as the user should read it. CPython's int() refuses a
    number of over 4,300 digits (``sys.get_int_max_str_digits``); its message advises a Python
    call, which is no use to someone whose file holds such a number."""
    if "integer string conversion" in str(exc):
        return "a number of over 4,300 digits (no value zeroplan reads has that many)"
    return str(exc)


def parse_count(text: str, what: str = "count") -> int:
    """Parse '7B', '70e9', '1.3T', '125M', '6738415616' into an int (decimal suffixes)."""
    text = str(text)
    if len(text) > _COUNT_MAX_CHARS:
        raise InputError(f"{what} {text[:20]!r}… ({len(text)} characters) is not a number such as 7B, 70e9 or 1.3T")
    m = _COUNT_RE.match(text)
    if not m:
        raise InputError(f"{what} {text!r} is not a number such as 7B, 70e9, 1.3T or 125M")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{what} {text!r} must be a positive finite number")
    if value > 1e16:
        raise InputError(f"{what} {text!r} is beyond 1e16; no model that size can be planned")
    if value < 1:  # 0.4 or 5e-324 would round to a zero-parameter model
        raise InputError(f"{what} {text!r} is under 1; expected a count such as 7B, 70e9 or 125M")
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
