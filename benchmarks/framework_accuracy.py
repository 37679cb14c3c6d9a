"""The planner's framework profiles against records measured from the frameworks' own model code
(benchmarks/framework-records/*.json, written by benchmarks/framework_records.py or
`zeroplan simulate --framework`): what one block keeps for backward, predicted, measured, error.

    python benchmarks/framework_accuracy.py [DIR]

Target (docs/validation.md, "Framework profiles"): per block within 2 %. The whole-step peak
of the frameworks' code is not measured yet, so its 5 % target is unchecked.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from zeroplan.core.frameworks import framework_block_kept_bytes
from zeroplan.frameworks.record import FrameworkRecord, load_framework_records
from zeroplan.validate.rows import planner_request

DEFAULT_RECORDS = Path(__file__).resolve().parent / "framework-records"
BLOCK_TARGET = 0.02
PLANNED_WORLD_SIZE = 8
"""Ranks in the planner's request; what a block keeps does not depend on it."""


@dataclass(frozen=True)
class FrameworkRow:
    """One record beside the planner's prediction."""

    name: str
    predicted_block_bytes: int
    measured_block_bytes: int

    @property
    def block_error(self) -> float:
        """Relative error; 0 when both are 0 (offloaded blocks keep nothing on the device)."""
        if self.measured_block_bytes == 0:
            return 0.0 if self.predicted_block_bytes == 0 else float("inf")
        return (self.predicted_block_bytes - self.measured_block_bytes) / self.measured_block_bytes


def predicted_block_bytes(record: FrameworkRecord) -> int:
    """What the blocks the record's deeper forward adds keep, by their positions (1-based)."""
    # record.training states kernels: cpu (the records ran on the CPU), so the planner follows that path.
    request = planner_request(record.model, record.training, record.batch, record.strategy, PLANNED_WORLD_SIZE)
    first = record.built_layers + 1
    return sum(framework_block_kept_bytes(request, position) for position in range(first, first + record.added_layers))


def framework_rows(directory: Path = DEFAULT_RECORDS) -> list[FrameworkRow]:
    """Every record in ``directory`` beside the planner's figure for the same request."""
    return [
        FrameworkRow(record.name, predicted_block_bytes(record), record.block_kept_bytes)
        for record in load_framework_records(directory)
    ]


def print_framework_table(directory: Path = DEFAULT_RECORDS) -> None:
    if not directory.is_dir():
        print(f"\nFramework profiles: no records ({directory.name}/ does not exist)")
        return
    print("\nWhat one block keeps for backward, planner vs the framework's own code (MiB; target 2 %)")
    print(f"{'record':72s} {'predicted':>10s} {'measured':>10s} {'err %':>7s}")
    for row in framework_rows(directory):
        flag = "" if abs(row.block_error) <= BLOCK_TARGET else "  OVER TARGET"
        print(f"{row.name:72s} {row.predicted_block_bytes / 2**20:10.1f} {row.measured_block_bytes / 2**20:10.1f} "
              f"{100 * row.block_error:7.2f}{flag}")


if __name__ == "__main__":
    print_framework_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RECORDS)
