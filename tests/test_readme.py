"""The README's setup and test commands are what CI and scripts/setup run (its console examples
are rerun by tests/test_docs_console.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -q\n" in README and ".venv/bin/python -m pytest -q\n" in ci
    assert "./scripts/setup && .venv/bin/zeroplan fit llama-2-70b" in README
    assert "\nscripts/setup\n" in ci


def test_setup_installs_deepspeed_after_torch() -> None:
    setup = (ROOT / "scripts" / "setup").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_at = setup.index('"torch==2.13.0" -e ".[dev]"')
    deepspeed_at = setup.index('DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed==0.19.8"')
    assert torch_at < deepspeed_at < setup.index('-e ".[peers]"') < setup.index("scripts/install-frameworks")
    assert 'deepspeed = ["deepspeed==0.19.8"]' in pyproject


def test_peers_and_frameworks_install_without_a_version_conflict() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # llm-analysis 0.2.2 declares transformers<5 and huggingface-hub<0.15; transformers 4.56.2
    # (measured by zeroplan.frameworks) needs huggingface-hub>=0.34. So llm-analysis is installed
    # without its declared dependencies, and no extra pins transformers or huggingface-hub.
    assert not any(line.startswith(("transformers", "huggingface-hub", "llm-analysis")) for line in extras["peers"])
    setup = (ROOT / "scripts" / "setup").read_text()
    assert '--no-deps "llm-analysis==0.2.2"' in setup
    frameworks = (ROOT / "scripts" / "install-frameworks").read_text()
    assert '"transformers==4.56.2"' in frameworks and '"torchtune==0.6.1"' in frameworks
    assert '"torchtitan==0.3.0"' in frameworks
    assert '"huggingface-hub>=0.34,<1.0"' in frameworks
