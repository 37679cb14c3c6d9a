"""Build notebooks/compare_stages.ipynb from the cells below and execute it in place, so the
committed notebook carries real outputs:

    python notebooks/build_compare_stages.py

To rerun the committed notebook from any directory without rebuilding it (nbclient, a dev
dependency, provides the command): ``.venv/bin/jupyter execute --inplace notebooks/compare_stages.ipynb``.

Every formula is imported from zeroplan; the cells only choose inputs and display results.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from zeroplan.atomic import write_text_atomic

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "compare_stages.ipynb"

CELLS: list[tuple[str, str]] = [
    ("markdown", """# Comparing DDP, ZeRO-1/2/3 and FSDP

Pick a model and a cluster; the planner (`zeroplan.core`, no torch) predicts each strategy's
per-GPU memory, its communication and its step time. The last section puts predictions beside
measurements recorded by the harness (`zeroplan measure`). Formulas: `docs/memory-model.md`
and `docs/communication-time.md`."""),
    ("code", """import pandas as pd
from zeroplan import fit, get_gpu, get_model
from zeroplan.frames import fit_report_frame
from zeroplan.report.plots import communication_figure, memory_stack_figure
from zeroplan.specs import (ActivationCheckpointing, BatchSpec, PlanRequest, StrategyKind,
                            StrategySpec, TrainingSpec, cluster_from_gpus)
from zeroplan.units import GiB

MODEL, GPU, NUM_GPUS = "llama-2-13b", "a100-80gb", 8
request = PlanRequest(
    model=get_model(MODEL),
    training=TrainingSpec(activation_checkpointing=ActivationCheckpointing.full),
    batch=BatchSpec(micro_batch_size=1, seq_len=4096),
    cluster=cluster_from_gpus(get_gpu(GPU), NUM_GPUS),
    strategy=StrategySpec(kind=StrategyKind.ddp),
)
report = fit(request)
print(report.verdict)"""),
    ("markdown", "## Memory per GPU (GiB)"),
    ("code", """frame = fit_report_frame(report)
memory_columns = [c for c in frame.columns if c.endswith("_bytes") and c not in ("sent_bytes_per_step",)]
memory_gib = (frame[memory_columns] / GiB).round(1)
memory_gib.columns = [c.removesuffix("_bytes") + "_gib" for c in memory_columns]
memory_gib.join(frame[["fits", "max_micro_batch_size"]])"""),
    ("code", """memory_stack_figure(report);"""),
    ("markdown", """## Communication per step

`volume` counts what each engine sends as the ZeRO paper does (2Ψ for DDP, 3Ψ for ZeRO-3 and for
DeepSpeed's ZeRO-1/2, which all-reduce their gradients where the paper reduce-scatters); `sent` the
bytes each GPU puts on the wire under ring collectives; times from the alpha-beta model."""),
    ("code", """comm = pd.DataFrame({
    "volume (x Psi)": frame.communication_volume_elements / report.num_parameters,
    "sent GB": frame.sent_bytes_per_step / 1e9,
    "comm s": frame.communication_s,
    "exposed s": frame.exposed_communication_s,
    "step s (overlap)": frame.step_with_overlap_s,
    "step s (no overlap)": frame.step_without_overlap_s,
})
comm.round(3)"""),
    ("code", """communication_figure(report);"""),
    ("markdown", """## Where the step goes

The ZeRO trade-off in time: each strategy's step with overlap, split into compute, what the
collectives and offload copies leave exposed, and the optimizer steps (the CPU's under offload).
Below it, the same plans with compute timed kernel by kernel (`compute_model="roofline"`: matrix
products, attention and memory-bound kernels at the GPU's measured ceilings, and the optimizer
step on the GPU), a lower bound on compute (docs/validation.md, "Step time, kernel by kernel")."""),
    ("code", """from zeroplan.report.plots import step_parts_s, step_time_figure
from zeroplan.specs import PerformanceAssumptions

steps = pd.DataFrame({p.strategy.value: step_parts_s(p.time) for p in report.plans}).T
steps["step s"] = [p.time.step_with_overlap_s for p in report.plans]
steps.loc[:, (steps != 0).any()].round(3)"""),
    ("code", """step_time_figure(report);"""),
    ("code", """roofline = fit(request.model_copy(update={"performance": PerformanceAssumptions(compute_model="roofline")}))
steps = pd.DataFrame({p.strategy.value: step_parts_s(p.time) for p in roofline.plans}).T
steps["step s"] = [p.time.step_with_overlap_s for p in roofline.plans]
display(steps.loc[:, (steps != 0).any()].round(3))
step_time_figure(roofline);"""),
    ("markdown", """## Will Llama-2-70B train on 8 x A100-80GB?"""),
    ("code", """big = request.model_copy(update={"model": get_model("llama-2-70b")})
answer = fit(big)
print(answer.verdict)
zero3 = answer.plan_for("zero3").memory
print(f"ZeRO-3 model states per GPU: {(zero3.parameter_bytes + zero3.gradient_bytes + zero3.optimizer_state_bytes) / GiB:.1f} GiB")
offload = answer.plan_for("zero3-offload")
print(f"ZeRO-3 + optimizer offload: peak {offload.memory.peak_bytes / GiB:.1f} GiB per GPU, "
      f"host RAM {offload.host_bytes_per_node / GiB:.0f} GiB per node")"""),
    ("markdown", """## Reconciliation against measured records

Records committed under `benchmarks/records/` come from real runs of the harness (CPU, gloo,
small models; see `benchmarks/records/README.md` for the commands). Each row is one quantity
of one run: the planner's prediction for the same request, the measurement, and their ratio."""),
    ("code", """from pathlib import Path
import zeroplan
from zeroplan.validate.compare import compare_record
from zeroplan.validate.load import load_records
from zeroplan.validate.report import comparison_frame

# Found from the package, so that the notebook runs from any directory.
records_dir = Path(zeroplan.__file__).resolve().parents[1] / "benchmarks" / "records"
records = [r for r in load_records([str(records_dir)]) if r.rank == 0]
rows = [row for record in records for row in compare_record(record)]
table = comparison_frame(rows)[["model", "strategy", "engine", "world_size", "quantity", "predicted_bytes", "measured_bytes", "ratio"]]
with pd.option_context("display.max_rows", None):  # every row, not pandas' first and last 5
    display(table.round(4))"""),
]


def build() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in CELLS:
        cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        notebook.cells.append(cell)
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout_s: int = 300) -> nbformat.NotebookNode:
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return notebook


if __name__ == "__main__":
    write_text_atomic(NOTEBOOK, nbformat.writes(execute(build())) + "\n")
    print(f"wrote {NOTEBOOK}")
