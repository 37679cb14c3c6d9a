"""One loader shared by the tests that read a repository script (benchmarks/, scripts/,
notebooks/) as a module: its printed tables, its records, what it writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """The script at ``path``, run as the module named by its stem (registered in sys.modules
    first, as an import would, so that its dataclasses can find their module)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
