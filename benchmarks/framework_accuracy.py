"""The planner's framework profiles against records measured from the frameworks' own model code
(benchmarks/framework-records/*.json, written by `zeroplan simulate --framework`): per-block saved
activations and the whole-step allocated peak, predicted, measured and the error.

    python benchmarks/framework_accuracy.py [DIR]

Targets (issue "Framework profiles"): per block within 2 %, whole step within 5 %.
The records are read with their own record class (zeroplan.frameworks.record); this module
only needs, of each record, the request it measured and the two measured figures.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.core.plan import memory_breakdown

DEFAULT_RECORDS = Path(__file__).resolve().parent / "framework-records"


@dataclass(frozen=True)
class FrameworkRow:
    """One record beside the planner's prediction."""

    name: str
    predicted_block_bytes: int
    measured_block_bytes: int
    predicted_step_bytes: int
    measured_step_bytes: int | None

    @property
    def block_error(self) -> float:
        return (self.predicted_block_bytes - self.measured_block_bytes) / self.measured_block_bytes

    @property
    def step_error(self) -> float | None:
        if not self.measured_step_bytes:
            return None
        return (self.predicted_step_bytes - self.measured_step_bytes) / self.measured_step_bytes


def framework_rows(directory: Path = DEFAULT_RECORDS) -> list[FrameworkRow]:
    """Every record in ``directory`` beside the planner's figures for the same request."""
    from zeroplan.frameworks.record import load_records

    rows = []
    for record in load_records(directory):
        request = record.request
        breakdown, _ = memory_breakdown(request)
        rows.append(FrameworkRow(
            name=record.name,
            predicted_block_bytes=framework_layer_bytes(request),
            measured_block_bytes=record.saved_bytes_per_block,
            predicted_step_bytes=breakdown.allocated_peak_bytes,
            measured_step_bytes=record.allocated_peak_bytes,
        ))
    return rows


def print_framework_table(directory: Path = DEFAULT_RECORDS) -> None:
    if not directory.is_dir():
        print(f"\nFramework profiles: no records yet ({directory.name}/ does not exist)")
        return
    print("\nFramework profiles against the frameworks' own model code (MiB; error %; targets 2 % block, 5 % step)")
    print(f"{'record':48s} {'block pred':>11s} {'block meas':>11s} {'err %':>7s} {'step pred':>11s} {'step meas':>11s} {'err %':>7s}")
    for row in framework_rows(directory):
        step_meas = f"{row.measured_step_bytes / 2**20:11.1f}" if row.measured_step_bytes else f"{'-':>11s}"
        step_err = f"{100 * row.step_error:7.2f}" if row.step_error is not None else f"{'-':>7s}"
        print(
            f"{row.name:48s} {row.predicted_block_bytes / 2**20:11.1f} {row.measured_block_bytes / 2**20:11.1f} "
            f"{100 * row.block_error:7.2f} {row.predicted_step_bytes / 2**20:11.1f} {step_meas} {step_err}"
        )


if __name__ == "__main__":
    print_framework_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RECORDS)
