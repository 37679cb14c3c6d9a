"""The committed notebook runs clean from a fresh set-up, and matches its builder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _builder():
    spec = importlib.util.spec_from_file_location("build_compare_stages", NOTEBOOKS / "build_compare_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_notebook_is_what_the_builder_writes() -> None:
    committed = nbformat.read(NOTEBOOKS / "compare_stages.ipynb", as_version=4)
    built = _builder().build()
    assert [c.source for c in committed.cells] == [c.source for c in built.cells]
    assert any(c.get("outputs") for c in committed.cells if c.cell_type == "code"), "committed without outputs"


def test_compare_stages_notebook_executes(tmp_path) -> None:
    # From a directory that is not the notebook's: the notebook must not depend on where it runs.
    notebook = nbformat.read(NOTEBOOKS / "compare_stages.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "ZeRO-3 model states per GPU: 128.5 GiB" in text
    # The reconciliation table has rows for the committed records.
    tables = [o for o in outputs if o.output_type in ("execute_result", "display_data")
              and "measured_bytes" in o["data"].get("text/plain", "")]
    assert tables
    # Every row is shown (pandas elides rows as "..." beyond display.max_rows), and names its model.
    assert "..." not in tables[0]["data"]["text/plain"]
    assert tables[0]["data"]["text/plain"].lstrip().startswith("model")
    memory = [o for o in outputs if o.output_type == "execute_result" and "peak_gib" in o["data"].get("text/plain", "")]
    assert memory, "the memory table's columns are in GiB and named *_gib"
