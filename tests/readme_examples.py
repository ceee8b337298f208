"""Keep the README's command excerpts true.

Blocks in README.md look like::

    <!-- example: zeroplan estimate --model llama-2-7b --gpus 8 -->
    ```console
    $ zeroplan estimate --model llama-2-7b --gpus 8
    ...output...
    ```

`python tests/readme_examples.py` re-runs every example through the CLI (terminal width 100,
no colour) and rewrites the blocks; tests/test_readme.py fails when a block is stale.
Optional ``| head -N`` after the command keeps the first N lines of the output.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- example: (?P<cmd>.+?) -->\n)```console\n.*?```\n", re.S)
# timings vary run to run: the test checks that every line WITHOUT digits still appears
VARIES = re.compile(r"(<!-- example-varies: (?P<cmd>.+?) -->\n)```console\n(?P<body>.*?)```\n", re.S)


def run_example(cmd: str) -> str:
    from typer.testing import CliRunner

    from zeroplan.cli import app

    head = None
    if "| head -" in cmd:
        cmd, _, n = cmd.partition("| head -")
        head = int(n.strip())
    argv = shlex.split(cmd)
    assert argv[0] == "zeroplan", cmd
    env = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = CliRunner().invoke(app, argv[1:], catch_exceptions=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    lines = [ln.rstrip() for ln in result.output.splitlines()]
    if head is not None:
        lines = lines[:head] + ["..."]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def sync(text: str) -> str:
    def repl(m: re.Match) -> str:
        cmd = m.group("cmd").strip()
        shown = cmd.split("| head -")[0].strip()
        return f"{m.group(1)}```console\n$ {shown}\n{run_example(cmd)}\n```\n"

    return VARIES.sub(repl, BLOCK.sub(repl, text))


def examples(text: str) -> list[str]:
    return [m.group("cmd").strip() for m in BLOCK.finditer(text)]


def varying_examples(text: str) -> list[tuple[str, str]]:
    return [(m.group("cmd").strip(), m.group("body")) for m in VARIES.finditer(text)]


def stable_lines(body: str) -> list[str]:
    """The excerpt's lines that contain no digit (headers, labels), without the $ line."""
    lines = body.splitlines()[1:]
    return [ln.strip() for ln in lines if ln.strip() and ln.strip() != "..." and not re.search(r"[0-9]", ln)]


if __name__ == "__main__":
    old = README.read_text()
    new = sync(old)
    if new != old:
        from zeroplan._util import atomic_write_text

        atomic_write_text(README, new)
        print(f"updated {len(examples(new))} examples in README.md")
    else:
        print("README.md examples are up to date")
    sys.exit(0)
