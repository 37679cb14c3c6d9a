"""The planner must answer without torch installed (and never import it)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from zeroplan.cli.main import main
code = main(["fit", "llama-2-7b", "--gpus", "8", "--format", "json"])
assert code == 0, code
import zeroplan.core.plan, zeroplan.report.table, zeroplan.presets.models
assert "matplotlib" not in sys.modules
print("ok")
"""


def test_planner_runs_with_torch_blocked() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
