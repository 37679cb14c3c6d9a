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


def test_specs_do_not_load_the_planner() -> None:
    # The harness imports the specs; the planner's formulas must stay out of its process.
    program = "import sys, zeroplan.specs; assert not any(m.startswith('zeroplan.core') for m in sys.modules); print('ok')"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_lazy_top_level_api() -> None:
    import zeroplan

    assert zeroplan.fit.__module__ == "zeroplan.core.plan"
    assert zeroplan.get_model("gpt2").name == "gpt2"
