"""The planner modules (zeroplan.core) loaded by importing each framework measurement that must
share no formula with the planner, read in one fresh interpreter for all of them: starting
Python, torch and torchtitan once serves tests/test_parallel_records.py and
tests/test_expert_validation.py, which each check their own measurement."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ("zeroplan.frameworks.tensor_parallel", "zeroplan.frameworks.expert_parallel")

_PROGRAM = (
    "import importlib, json, sys\n"
    "loaded = {}\n"
    f"for name in {MEASUREMENTS!r}:\n"
    "    importlib.import_module(name)\n"
    "    loaded[name] = sorted(m for m in sys.modules if m.startswith('zeroplan.core'))\n"
    "print(json.dumps(loaded))\n"
)


@functools.cache
def planner_modules_loaded() -> dict[str, list[str]]:
    """Each measurement module -> the zeroplan.core modules loaded once it has been imported,
    the modules imported one after another in one interpreter. What a module imported before it
    loaded stays loaded, so a module's list holds at least what importing it alone loads: an
    empty list says it loads none."""
    result = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout)
