"""The fits column's cell and the notes that explain its words, shared by fit's summary and the
detail table."""

from __future__ import annotations

from zeroplan.answers import FitReport
from zeroplan.results import StrategyPlan


def fits_cell(plan: StrategyPlan) -> str:
    """yes, no, "host" (fits on the GPU, not in the node's host RAM) or "load" (the step fits,
    the whole module moved onto the GPU at load does not), "*" where borderline."""
    if plan.fits:
        cell = "host" if plan.host_fits is False else "yes"
    else:
        cell = "load" if plan.runs_out_at_load and plan.memory.peak_bytes <= plan.usable_memory_bytes else "no"
    return cell + ("*" if plan.borderline else "")


def fits_cell_notes(report: FitReport) -> list[str]:
    """A sentence for each of the cell's words the report shows."""
    cells = {fits_cell(p).rstrip("*") for p in report.plans}
    notes = []
    if "host" in cells:
        load = any(p.fits and p.host_fits is False and p.load_sets_host_peak for p in report.plans)
        notes.append("fits = host: fits on the GPU, but " + ("what its ranks hold at load (each the whole model)"
                                                             if load else "its offloaded states")
                     + " exceed the node's host RAM.")
    if "load" in cells:
        notes.append("fits = load: the step fits, but DeepSpeed's engine moves the whole model onto each GPU before "
                     "ZeRO-3 partitions it (--model-load full-per-rank; docs/memory-model.md, \"Host memory\").")
    return notes
