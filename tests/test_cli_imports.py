"""What `zeroplan fit` and `compare` import: the command's start is most of its time
(benchmarks/cli_latency.py), so the table and frame libraries and torch stay out of it; they
load only where asked (--format csv, validate --plot, the measurement commands)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "pandas", "matplotlib", "torch", "scipy")


@pytest.mark.slow  # one interpreter per command
@pytest.mark.parametrize("argv", [
    ["fit", "llama-3.1-405b", "--gpus", "65536", "--gpu", "h100-80gb"],
    ["fit", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--detail"],
    ["compare", "llama-2-70b", "--gpus", "64", "--gpu", "h100-80gb"],
])
def test_fit_and_compare_import_no_frame_plot_or_torch_library(argv: list[str]) -> None:
    program = (
        "import contextlib, io, sys\n"
        "from zeroplan.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main({argv!r}) == 0\n"
        f"print(' '.join(name for name in {HEAVY!r} if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{' '.join(argv)} imported {result.stdout.strip()}"
