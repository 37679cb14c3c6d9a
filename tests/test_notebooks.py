"""The committed notebook runs clean from a fresh set-up, and matches its builder."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.scripts import load_script

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _builder():
    return load_script(NOTEBOOKS / "build_compare_stages.py")


def test_committed_notebook_is_what_the_builder_writes() -> None:
    committed = nbformat.read(NOTEBOOKS / "compare_stages.ipynb", as_version=4)
    built = _builder().build()
    assert [c.source for c in committed.cells] == [c.source for c in built.cells]
    assert any(c.get("outputs") for c in committed.cells if c.cell_type == "code"), "committed without outputs"


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> nbformat.NotebookNode:
    # From a directory that is not the notebook's: the notebook must not depend on where it runs.
    notebook = nbformat.read(NOTEBOOKS / "compare_stages.ipynb", as_version=4)
    path = tmp_path_factory.mktemp("notebook")
    # The kernel starts in that directory: a relative PYTHONPATH entry (`PYTHONPATH=.`) would
    # resolve there and import another checkout's zeroplan, so each entry is made absolute here.
    entries = [str(Path(entry).resolve()) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    with pytest.MonkeyPatch.context() as patch:
        if entries:
            patch.setenv("PYTHONPATH", os.pathsep.join(entries))
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(path)}}).execute()
    return notebook


def _text_outputs(notebook: nbformat.NotebookNode) -> list[list[tuple[str, str]]]:
    """Per code cell, each output's type and text (stream text, or the text/plain of a result or
    display); execution counts, metadata and images left out."""
    return [
        [(output.output_type, output.get("text", "") if output.output_type == "stream"
          else output.get("data", {}).get("text/plain", output.get("ename", "")))
         for output in cell.outputs]
        for cell in notebook.cells if cell.cell_type == "code"
    ]


def test_committed_outputs_are_a_fresh_execution(executed) -> None:
    committed = nbformat.read(NOTEBOOKS / "compare_stages.ipynb", as_version=4)
    for index, (saved, fresh) in enumerate(zip(_text_outputs(committed), _text_outputs(executed), strict=True)):
        assert saved == fresh, (
            f"code cell {index}: the committed notebook's saved outputs are stale; run "
            "`python notebooks/build_compare_stages.py` and commit notebooks/compare_stages.ipynb"
        )


def test_compare_stages_notebook_executes(executed) -> None:
    notebook = executed
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


def test_the_notebook_tells_the_story_in_order_with_its_figures(executed) -> None:
    """Why ZeRO saves memory, what it costs in communication, when it slows training, then the
    measurements; each section with its figures drawn by zeroplan.report.plots."""
    headings = [line for c in executed.cells if c.cell_type == "markdown" for line in c.source.splitlines()
                if line.startswith("## ")]
    story = ["## 1. Memory per GPU", "## 2. What it costs in communication", "## 3. When it slows training",
             "## 4. Validation against measurements", "## 5. From plan to running job, and back"]
    found = [next(i for i, h in enumerate(headings) if h.startswith(s)) for s in story]
    assert found == sorted(found)
    sources = "\n".join(c.source for c in executed.cells if c.cell_type == "code")
    for figure in ("memory_stack_figure", "network_communication_figure", "step_time_figure", "tradeoff_figure",
                   "validation_figure"):
        assert f"plots.{figure}(" in sources
    assert "matplotlib" not in sources  # the figures' code lives in zeroplan/report/plots.py
    images = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 6


def test_the_notebook_walks_plan_emit_run_validate(executed) -> None:
    """Section 5: fit --emit writes the DeepSpeed file, the run is the measure command on that file
    (its committed records were made from the same file, checked in the cell), and the records
    are compared with the plan."""
    cells = [c for c in executed.cells if c.cell_type == "code"][-4:]
    assert '"--emit", "plan-zero3"' in cells[0].source and '"--deepspeed-config", "plan-zero3/deepspeed.json"' in cells[1].source
    text = "".join(o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream")
    assert '"stage3_max_live_parameters": 6292224' in text
    assert "read: benchmarks/emitted-records/tiny-llama-zero3-deepspeed-n2" in text
    table = cells[2].outputs[0]["data"]["text/plain"]
    assert "parameters" in table and "all_gather bytes/step" in table and "buffers (kept)" in table
    # Every emitted run against the harness's tolerance (zeroplan/validate/tolerance.py).
    checked = cells[3].outputs[0]["data"]["text/plain"]
    for run in ("zero3-deepspeed", "fsdp-full-shard-accelerate", "fsdp-full-shard-torchtitan-overrides"):
        assert run in checked
    assert "buffers (kept)" in checked and "within" in checked
