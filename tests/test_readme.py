"""The README shows real output: rerun its console examples and compare."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from zeroplan.cli.main import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
EXAMPLES = re.findall(r"```console\n\$ (zeroplan [^\n]+)\n(.*?)\n```", README, flags=re.S)


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("command,expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_readme_output_is_current(capsys, command: str, expected: str) -> None:
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip() == expected.rstrip()


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -q" in README and ".venv/bin/python -m pytest -q" in ci


def test_readme_installs_deepspeed_as_ci_does() -> None:
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    command = 'DS_BUILD_OPS=0 .venv/bin/python -m pip install --no-build-isolation "deepspeed==0.19.8"'
    assert command in README and command.replace("install ", "install --quiet ", 1) in ci
    assert 'deepspeed = ["deepspeed==0.19.8"]' in pyproject


def test_readme_installs_the_peer_estimator_as_ci_does() -> None:
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    command = '.venv/bin/python -m pip install -e ".[peers]"'
    assert command in README and command.replace("install ", "install --quiet ", 1) in ci
