"""Every planning command in examples/walkthroughs/*.md (```bash blocks) runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    (md.name, line.strip())
    for md in sorted((ROOT / "examples" / "walkthroughs").glob("*.md"))
    for block in re.findall(r"```bash\n(.*?)```", md.read_text(), re.S)
    for line in block.splitlines()
    if line.strip().startswith("zeroplan ")
]


def test_walkthroughs_have_commands():
    assert len(COMMANDS) >= 8


@pytest.mark.parametrize("name,cmd", COMMANDS)
def test_walkthrough_command_runs(name, cmd, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = [a.replace("ds_zero3.json", str(tmp_path / "ds_zero3.json")) for a in shlex.split(cmd)[1:]]
    r = CliRunner().invoke(app, argv)
    expected = (0, 1) if argv[0] == "check" else (0,)
    assert r.exit_code in expected, (name, cmd, r.output[-2000:])
    assert "Traceback" not in r.output
