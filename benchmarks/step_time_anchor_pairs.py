"""Can one more mechanism carry a one-row calibration across a source? (issue 30; docs/validation.md,
"Step time", "The anchor and each row, two unknowns"). A diagnostic, in sample: nothing here is
fitted into the planner or scored as an accuracy figure.

The planner's step for a row, at HFU h, is linear in 1/h wherever its communication stays hidden:

    T(h) = a / h + b

a the matrix products' seconds at HFU 1, b the rest (attention at the kernel's rate, the
memory-bound kernels and the optimizer step at the copy bandwidth, exposed communication, host
and bubble time). A candidate mechanism adds one term of its own shape with one unknown x:

- memory-bound x k: the memory-bound kernels and the optimizer step (M, both at the GPU's copy
  bandwidth in the planner) take k times the planner's time: a / h + b + (k - 1) M;
- per step: a fixed cost c each step: a / h + b + c;
- per micro-batch: c for each of the rank's micro-batches n: a / h + b + n c;
- per block: c for each block of the rank and micro-batch (n x L): a / h + b + n L c;
- per block and step: c for each block of the rank, once a step (a per-tensor optimizer loop's
  shape): a / h + b + L c;
- model-parallel communication x k: the tensor-parallel collectives and pipeline sends the compute
  waits for (P, StepTime.model_parallel_communication_s, with the bubble's share of them) take k
  times the planner's time: a / h + b + (k - 1) P (1 + bubble); only rows with P > 0 solve it.

A calibration solves h on the source's anchor (zeroplan.validate.step_calibration.calibration_row)
and carries h and the mechanism to the other rows. If the mechanism is what separates the anchor's
HFU from the other rows', then the anchor and any other row, two published steps, solve the two
unknowns (1/h, x) and every row gives the same x. This prints, per source of at least three rows,
the x each row solves with the anchor: its median, quartiles and range, and how many rows solve an
h outside (0, 1] or an x below its neutral value (k < 1, c < 0: the mechanism would have to run
backwards). A spread of x as wide as its median says no single value of that mechanism carries the
anchor to the source's rows, whatever it is fitted to.

    python benchmarks/step_time_anchor_pairs.py          # a few seconds
    python benchmarks/step_time_anchor_pairs.py --rows   # each row's solutions too

Rows at whose steps the planner exposes communication between HFU 0.4 and 0.8 (T not linear in
1/h there) are left out and counted.
"""

from __future__ import annotations

import statistics
import sys

from zeroplan.calibrate.step import planned_step
from zeroplan.validate.step_calibration import (
    MIN_SOURCE_ROWS, DEFAULT_ATTENTION_RATE, calibration_row, published_step_s, source_label, source_rows,
)
from zeroplan.validate.step_time import PublishedThroughput, load_published_throughput

HFU_LOW, HFU_HIGH, HFU_CHECK = 0.4, 0.8, 0.55
"""The HFUs the planner's step is timed at to read a and b, and the one the line is checked at."""
LINEAR_TOLERANCE = 1e-3
"""Relative departure from the line at HFU_CHECK past which a row is left out."""

MECHANISMS = ("memory-bound x k", "per step (s)", "per micro-batch (s)", "per block (ms)", "per block and step (ms)",
              "model-parallel communication x k")
NEUTRAL = {"memory-bound x k": 1.0, "per step (s)": 0.0, "per micro-batch (s)": 0.0, "per block (ms)": 0.0,
           "per block and step (ms)": 0.0, "model-parallel communication x k": 1.0}


class Terms:
    """One row's step as the planner times it: T(h) = a / h + b, its memory-bound seconds M and
    the counts the fixed costs multiply."""

    def __init__(self, row: PublishedThroughput):
        def step(hfu: float):  # type: ignore[no-untyped-def]
            return planned_step(row.request(hfu, attention_rate=DEFAULT_ATTENTION_RATE))

        low, high, check = step(HFU_LOW), step(HFU_HIGH), step(HFU_CHECK)
        self.a = (low.step_with_overlap_s - high.step_with_overlap_s) / (1 / HFU_LOW - 1 / HFU_HIGH)
        self.b = high.step_with_overlap_s - self.a / HFU_HIGH
        line = self.a / HFU_CHECK + self.b
        self.linear = abs(check.step_with_overlap_s - line) <= LINEAR_TOLERANCE * line
        # Both at the copy bandwidth in the planner, whatever the HFU.
        self.memory_s = high.memory_bound_s + high.optimizer_step_s
        # The bubble is a fraction of the busy time, blocking collectives included.
        busy_s = high.compute_s + high.model_parallel_communication_s
        bubble = high.pipeline_bubble_s / busy_s if busy_s else 0.0
        self.model_parallel_s = high.model_parallel_communication_s * (1 + bubble)
        self.micro_batches = row.grad_accum_steps
        self.blocks = row.model_spec.num_layers // max(1, row.pp)
        self.published_s = published_step_s(row)

    def shape(self, mechanism: str) -> tuple[float, float]:
        """(the mechanism's term per unit of x, what x = 0 leaves of the published step past b)."""
        if mechanism == "memory-bound x k":
            return self.memory_s, self.published_s - self.b + self.memory_s
        if mechanism == "model-parallel communication x k":
            return self.model_parallel_s, self.published_s - self.b + self.model_parallel_s
        if mechanism == "per step (s)":
            return 1.0, self.published_s - self.b
        if mechanism == "per micro-batch (s)":
            return float(self.micro_batches), self.published_s - self.b
        if mechanism == "per block and step (ms)":
            return self.blocks / 1e3, self.published_s - self.b
        return self.micro_batches * self.blocks / 1e3, self.published_s - self.b  # per block, in ms


SEPARABLE = 0.1
"""Two rows tell the HFU from the mechanism only where the mechanism's term is a different share
of their matrix-product time: unit / a at least this far apart, relatively (a row of the anchor's
model and tokens per micro-batch scales both alike and solves nothing)."""


def pair_solution(anchor: Terms, row: Terms, mechanism: str) -> tuple[float, float] | None:
    """(h, x) at which the planner with the mechanism lasts both published steps; None where the
    two rows cannot tell them apart (SEPARABLE)."""
    anchor_unit, anchor_rest = anchor.shape(mechanism)
    row_unit, row_rest = row.shape(mechanism)
    anchor_share, row_share = anchor_unit / anchor.a, row_unit / row.a
    if abs(anchor_share - row_share) <= SEPARABLE * max(anchor_share, row_share):
        return None
    determinant = anchor.a * row_unit - row.a * anchor_unit
    inverse_hfu = (anchor_rest * row_unit - row_rest * anchor_unit) / determinant
    x = (anchor.a * row_rest - row.a * anchor_rest) / determinant
    return (1 / inverse_hfu if inverse_hfu > 0 else float("inf")), x


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    low, middle, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, middle, high


class SourcePairs:
    """One source's anchor and what each of its other rows solves with it, by mechanism."""

    def __init__(self, label: str, anchor: PublishedThroughput, anchor_terms: Terms, others: int,
                 kept: list[tuple[PublishedThroughput, Terms]]):
        self.label, self.anchor, self.others = label, anchor, others
        self.exposed = others - len(kept)
        self.linear = anchor_terms.linear
        self.alone_hfu = (anchor_terms.a / (anchor_terms.published_s - anchor_terms.b)
                          if anchor_terms.published_s > anchor_terms.b else float("inf"))
        self.pairs: dict[str, list[tuple[PublishedThroughput, tuple[float, float] | None]]] = {
            mechanism: [(row, pair_solution(anchor_terms, terms, mechanism)) for row, terms in kept] if self.linear else []
            for mechanism in MECHANISMS}

    def solved(self, mechanism: str) -> list[tuple[PublishedThroughput, tuple[float, float]]]:
        return [(row, s) for row, s in self.pairs[mechanism] if s is not None]

    def summary(self, mechanism: str) -> tuple[int, float, float, float, float, float, int, int] | None:
        """(not separable, median x, first and third quartiles, min, max, rows with h outside (0, 1],
        rows with x below neutral); None where no row solves it."""
        solved = self.solved(mechanism)
        xs = [x for _, (_, x) in solved]
        if not xs:
            return None
        low, middle, high = quartiles(xs)
        return (len(self.pairs[mechanism]) - len(solved), middle, low, high, min(xs), max(xs),
                sum(not 0 < h <= 1 for _, (h, _) in solved), sum(x < NEUTRAL[mechanism] for x in xs))


def source_pairs() -> list[SourcePairs]:
    """Every source of at least MIN_SOURCE_ROWS rows, its anchor and its pairs."""
    table = load_published_throughput()
    found = []
    for rows in source_rows(table).values():
        if len(rows) < MIN_SOURCE_ROWS:
            continue
        anchor_row = calibration_row(rows)
        anchor = Terms(anchor_row)
        others = [(row, Terms(row)) for row in rows if row is not anchor_row]
        found.append(SourcePairs(source_label(anchor_row), anchor_row, anchor, len(others),
                                 [(row, terms) for row, terms in others if terms.linear]))
    return found


def report(show_rows: bool = False) -> str:
    lines = ["| source | anchor | its h alone | rows | left out (exposed) | mechanism | not separable | x median | quartiles "
             "| range | rows with h outside (0, 1] | rows with x below neutral |",
             "|---|---|---:|---:|---:|---|---:|---:|---|---|---:|---:|"]
    row_lines: list[str] = []
    for source in source_pairs():
        if not source.linear:
            lines.append(f"| {source.label} | {source.anchor.name} | - | {source.others} | anchor exposes | | | | | | | |")
            continue
        for mechanism in MECHANISMS:
            summary = source.summary(mechanism)
            if summary is None:
                continue
            unseparable, middle, low, high, least, most, outside, below = summary
            lines.append(
                f"| {source.label} | {source.anchor.name} | {source.alone_hfu:.3f} | {source.others} | {source.exposed} "
                f"| {mechanism} | {unseparable} | {middle:.3g} | {low:.3g} to {high:.3g} | {least:.3g} to {most:.3g} "
                f"| {outside} | {below} |")
            if show_rows:
                row_lines += [f"| {source.label[:60]} | {row.name} | {mechanism} | {h:.3f} | {x:.3g} |"
                              for row, (h, x) in source.solved(mechanism)]
    if show_rows:
        lines += ["", "| source | row | mechanism | h | x |", "|---|---|---|---:|---:|", *row_lines]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(show_rows="--rows" in sys.argv[1:]))
