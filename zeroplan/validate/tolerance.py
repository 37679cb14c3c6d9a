"""The harness's tolerance: how far a measured record may be from the planner for
``zeroplan validate --check`` to pass it (docs/harness.md, "Tolerance").

Each bound is a target the project already holds its measurements to, not a figure fitted to
the rows it passes:

- model states (parameters, gradients, optimizer states, kept buffers, host states) and
  collective bytes: equal, up to 0.1 %, which admits only the optimizer's 4-byte step counters
  (DeepSpeed keeps one per flat partition, the planner one per unit: docs/harness.md) and
  nothing of the size of a tensor (docs/validation.md, "What agrees exactly, and why");
- saved activations: 2 %, the target of every saved-activation comparison (docs/validation.md,
  "Model parallelism": the CPU norm path and FlexAttention's eager max_scores stay inside it);
- the step's peak as an allocator counts it (CPU allocator, CUDA allocated): 5 %, the whole-step
  target of docs/validation.md ("Whole step", tests/test_framework_step.py).

``peak (tracked tensors)`` is not checked: it is MemTracker's count, a private PyTorch tool that
misses tensors it was not told of (the DeepSpeed rows of docs/validation.md); the CPU
allocator's own peak of the same step is the checked one."""

from __future__ import annotations

from zeroplan.validate.rows import COLLECTIVE_OPS, ComparisonRow

STATE_TOLERANCE = 0.001
ACTIVATION_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.05

TOLERANCE: dict[str, float | None] = {
    "parameters": STATE_TOLERANCE,
    "gradients": STATE_TOLERANCE,
    "optimizer states": STATE_TOLERANCE,
    "buffers (kept)": STATE_TOLERANCE,
    "host (offloaded)": STATE_TOLERANCE,
    "activations (saved)": ACTIVATION_TOLERANCE,
    "activations (saved, per micro-batch)": ACTIVATION_TOLERANCE,
    "peak (CPU allocator)": PEAK_TOLERANCE,
    "peak (CUDA allocated)": PEAK_TOLERANCE,
    "peak (tracked tensors)": None,
    **{f"{op} bytes/step": STATE_TOLERANCE for op in COLLECTIVE_OPS},
}
"""Relative bound per quantity of validate's rows; None: shown, not checked."""


def tolerance_of(quantity: str) -> float | None:
    """The relative bound of a row's quantity (a quantity this table does not name is refused:
    a new row must be given its bound here)."""
    if quantity not in TOLERANCE:
        raise KeyError(f"no tolerance for {quantity!r}: add it to zeroplan.validate.tolerance.TOLERANCE")
    return TOLERANCE[quantity]


def within(row: ComparisonRow) -> bool:
    """Whether the row is inside its bound: |measured - predicted| <= bound x predicted; a
    quantity predicted as 0 must be measured as 0."""
    bound = tolerance_of(row.quantity)
    if bound is None:
        return True
    return abs(row.measured_bytes - row.predicted_bytes) <= bound * row.predicted_bytes


def outside(rows: list[ComparisonRow]) -> list[ComparisonRow]:
    """The rows outside their bounds, in order."""
    return [row for row in rows if not within(row)]


def describe(row: ComparisonRow) -> str:
    """One line naming the run, rank and quantity, the ratio and the bound it passes."""
    ratio = f"{row.ratio:.4f}" if row.ratio is not None else f"{row.measured_bytes} B measured, none predicted"
    return (f"{row.run_id} rank {row.rank}: {row.quantity}: measured/predicted {ratio} is outside "
            f"1 +- {tolerance_of(row.quantity):g}")
