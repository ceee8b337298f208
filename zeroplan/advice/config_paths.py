"""Which files ``check`` reads: its arguments as paths, or as globs with ``check --glob``.

- Paths are literal (a file named ``ds[1].json`` is that file); ``~`` and ``~user`` expand.
- A glob without ``**`` is ``glob.glob``'s. A glob with ``**`` is walked here with ``os.walk``
  (symlinked directories are not entered), matching one path component per pattern component,
  ``**`` for zero or more directories, with ``glob``'s rule for hidden names (``*``, ``?`` and ``**``
  never match a name starting with ``.``; ``.*`` does). ``glob.glob(recursive=True)`` follows
  symlinked directories: a link to a parent directory listed the same file once per level (41
  times for one loop), and ``/proc/**`` (``/proc/self/root`` is ``/``) walked for ever. The walk
  stops with an error after ``MAX_GLOB_DIRS`` directories.
- The same file reached twice (``a.json ./a.json``, a symlink or a hard link) is checked once,
  under the first name given.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
import re

from zeroplan._util import InputError, display_path, expand_path

__all__ = ["expand_config_paths", "MAX_GLOB_DIRS"]

MAX_GLOB_DIRS = 200_000  # a whole root filesystem walks in well under that (no symlinked directory entered)
_GLOB_CHARS = re.compile(r"[*?\[]")


def _component_matches(pattern: str, name: str) -> bool:
    if name.startswith(".") and not pattern.startswith("."):
        return False  # glob's rule: a wildcard never matches a hidden name
    return fnmatch.fnmatchcase(name, pattern)


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """Does the relative path ``parts`` match ``pattern`` (components; ``**`` = zero or more directories)?
    Memoised on positions, so a pattern of many ``**`` costs len(pattern) × len(parts), not a power."""

    @functools.lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(pattern):
            return j == len(parts)
        if pattern[i] == "**":
            if i == len(pattern) - 1:  # a trailing ``**``: every file below (at least one name), hidden excepted
                return j < len(parts) and all(not p.startswith(".") for p in parts[j:])
            # ``**`` takes no directory, or one more (never the file itself, never a hidden one)
            return match(i + 1, j) or (len(parts) - j > 1 and not parts[j].startswith(".") and match(i, j + 1))
        return j < len(parts) and _component_matches(pattern[i], parts[j]) and match(i + 1, j + 1)

    return match(0, 0)


def _walk_glob(pat: str, shown: str) -> list[str]:
    """Files matching a ``**`` glob, sorted; symlinked directories are not entered."""
    if pat.endswith(os.sep):
        return []  # glob lists only directories for a pattern ending in a slash, and check reads files
    parts = pat.split(os.sep)
    first_magic = next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))
    root_parts = parts[:first_magic]
    pattern = [p for p in parts[first_magic:] if p not in ("", os.curdir)]  # a//b and a/./b are a/b
    root = os.sep.join(root_parts) if root_parts else "."
    if pat.startswith(os.sep) and not root:
        root = os.sep
    hidden_ok = any(p.startswith(".") for p in pattern)
    hits: list[str] = []
    visited = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        visited += 1
        if visited > MAX_GLOB_DIRS:
            raise InputError(f"{shown}: the glob walked over {MAX_GLOB_DIRS:,} directories without finishing; "
                             "expected a narrower glob (start it below the directory that holds the configs)")
        if not hidden_ok:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = os.path.relpath(dirpath, root)
        rel_parts = [] if rel == os.curdir else rel.split(os.sep)
        for name in filenames:
            if _matches(pattern, rel_parts + [name]):
                path = os.path.join(dirpath, name) if root_parts else os.path.join(*rel_parts, name)
                if os.path.isfile(path):
                    hits.append(path)
    return sorted(hits)


def _glob_files(pat: str, shown: str) -> list[str]:
    if "**" in pat.split(os.sep):
        return _walk_glob(pat, shown)
    return sorted(h for h in glob.glob(pat) if os.path.isfile(h))


def _literal_file(pat: str, shown: str) -> str:
    if not pat:
        raise InputError("DeepSpeed config path is empty (''); expected the path to a DeepSpeed config file")
    try:
        exists, is_dir = os.path.exists(pat), os.path.isdir(pat)
    except (OSError, ValueError) as exc:
        raise InputError(f"{shown}: cannot read DeepSpeed config: {exc}") from None
    if not exists:
        hint = " (to expand it as a glob, pass --glob)" if _GLOB_CHARS.search(pat) else ""
        raise InputError(f"{shown}: DeepSpeed config not found{hint}")
    if is_dir:
        raise InputError(f"{shown}: is a directory; give config files, or --glob '{shown.rstrip('/')}/*.json'")
    return pat


def expand_config_paths(patterns: list[str], *, expand_globs: bool = False) -> list[str]:
    """Paths → existing files, in order, each file once (by device and inode); see the module docstring.
    A glob matching nothing, a missing path or a directory is an InputError (exit 2)."""
    if not patterns:
        raise InputError("check needs at least one DeepSpeed config path")
    out: list[str] = []
    seen: set[tuple[int, int] | str] = set()
    for pat in patterns:
        shown = display_path(pat)
        pat = expand_path(pat)
        if expand_globs:
            if not pat:
                raise InputError("--glob pattern is empty (''); expected a glob such as 'configs/**/*.json'")
            hits = _glob_files(pat, shown)
            if not hits:
                raise InputError(f"{shown}: the glob matches no file")
        else:
            hits = [_literal_file(pat, shown)]
        for h in hits:
            try:
                st = os.stat(h)
                key: tuple[int, int] | str = (st.st_dev, st.st_ino)
            except (OSError, ValueError):
                key = os.path.realpath(h)  # the reader reports why it cannot be read
            if key not in seen:
                seen.add(key)
                out.append(h)
    return out
