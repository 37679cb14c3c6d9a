"""Rerun the README's `zeroplan ...` console examples and paste their current output in place
(tests/test_readme.py fails until this is run after a change to the model)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _rerun(match: re.Match[str]) -> str:
    command = match.group(1)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert main(shlex.split(command)[1:]) == 0, command
    return f"```console\n$ {command}\n{output.getvalue().rstrip()}\n```"


if __name__ == "__main__":
    text = README.read_text()
    write_text_atomic(README, re.sub(r"```console\n\$ (zeroplan [^\n]+)\n(.*?)\n```", _rerun, text, flags=re.S))
