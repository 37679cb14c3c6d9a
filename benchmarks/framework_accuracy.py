"""The planner's framework profiles against records measured from the frameworks' own model code
(benchmarks/framework-records/*.json, written by benchmarks/framework_records.py or
`zeroplan simulate --framework`): what one block keeps for backward, predicted, measured, error.

    python benchmarks/framework_accuracy.py --finetune   (the LoRA/QLoRA records)
    python benchmarks/framework_accuracy.py --hf-fsdp1   (hf under accelerate's FSDP1,
        benchmarks/framework-fsdp1-step-records, planned as --fsdp-version 1 plans it)
    python benchmarks/framework_accuracy.py --hf-fsdp1-qlora-offload   (PEFT QLoRA, and LoRA
        and QLoRA with CPU offload, under accelerate's FSDP1,
        benchmarks/framework-fsdp1-qlora-offload-step-records: the --fsdp-version 1 plan where it
        is not refused, and the FSDP2 plan that stands in for it)
    python benchmarks/framework_accuracy.py [DIR [STEP_DIR]]

Targets (docs/validation.md, "Framework profiles"): per block within 2 %; the whole-step
allocated peak (benchmarks/framework-step-records/*.json, written by
benchmarks/framework_step_records.py or `zeroplan simulate --framework ... --whole-step`)
within 5 % of FSDPMemTracker's peak of the framework's own code under its own FSDP2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from zeroplan.core.frameworks import framework_block_kept_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.frameworks.record import FrameworkRecord, load_framework_records
from zeroplan.frameworks.step_record import FrameworkStepRecord, load_step_records
from zeroplan.validate.rows import planner_request

DEFAULT_RECORDS = Path(__file__).resolve().parent / "framework-records"
DEFAULT_STEP_RECORDS = Path(__file__).resolve().parent / "framework-step-records"
HF_FSDP1_STEP_RECORDS = Path(__file__).resolve().parent / "framework-fsdp1-step-records"
BLOCK_TARGET = 0.02
STEP_TARGET = 0.05
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


def _print_table(directory: Path, what: str, title: str, header: str, lines) -> None:
    """``lines(directory)`` yields (text, error, target) per record; each over target is flagged."""
    if not directory.is_dir():
        print(f"\n{what}: no records ({directory.name}/ does not exist)")
        return
    print(f"\n{title}")
    print(header)
    for text, error, target in lines(directory):
        print(text + ("" if abs(error) <= target else "  OVER TARGET"))


def print_framework_table(directory: Path = DEFAULT_RECORDS) -> None:
    def lines(directory: Path):
        for row in framework_rows(directory):
            yield (f"{row.name:72s} {row.predicted_block_bytes / 2**20:10.1f} {row.measured_block_bytes / 2**20:10.1f} "
                   f"{100 * row.block_error:7.2f}", row.block_error, BLOCK_TARGET)

    _print_table(directory, "Framework profiles",
                 "What one block keeps for backward, planner vs the framework's own code (MiB; target 2 %)",
                 f"{'record':72s} {'predicted':>10s} {'measured':>10s} {'err %':>7s}", lines)


@dataclass(frozen=True)
class StepRow:
    """One whole-step record beside the planner's allocated peak for the same request."""

    name: str
    predicted_peak_bytes: int
    predicted_moment: str
    measured_peak_bytes: int
    measured_phase: str

    @property
    def error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes


def step_request(record: FrameworkStepRecord):
    """The planner request a whole-step record answers (its world size, no CUDA context); a
    record of accelerate's FSDP1 is asked as ``--fsdp-version 1`` asks it."""
    request = planner_request(record.model, record.training, record.batch, record.strategy, record.world_size)
    if record.fsdp_version == 1:
        request = request.with_strategy(request.strategy.model_copy(update={"fsdp1_root_stays_gathered": True}))
    return request


def step_rows(directory: Path = DEFAULT_STEP_RECORDS) -> list[StepRow]:
    """Every whole-step record beside the planner's allocated peak (before the allocator's
    reserve, the CUDA context and NCCL's buffers: what FSDPMemTracker counts)."""
    rows = []
    for record in load_step_records(directory):
        breakdown, _ = memory_breakdown(step_request(record))
        rows.append(StepRow(record.name, breakdown.allocated_peak_bytes, breakdown.peak_moment.value,
                            record.peak_bytes, record.peak_phase.value))
    return rows


def print_step_table(directory: Path = DEFAULT_STEP_RECORDS) -> None:
    def lines(directory: Path):
        for row in step_rows(directory):
            yield (f"{row.name:76s} {row.predicted_peak_bytes / 2**30:9.2f} {row.predicted_moment:>15s} "
                   f"{row.measured_peak_bytes / 2**30:9.2f} {row.measured_phase:>9s} {100 * row.error:7.2f}",
                   row.error, STEP_TARGET)

    _print_table(directory, "Whole step",
                 "Whole-step allocated peak, planner vs the framework's own code under its own FSDP2 (GiB; target 5 %)",
                 f"{'record':76s} {'predicted':>9s} {'moment':>15s} {'measured':>9s} {'phase':>9s} {'err %':>7s}", lines)


def print_hf_fsdp1_table(directory: Path | None = None) -> None:
    """hf's whole steps under accelerate's FSDP1 beside the planner's allocated peak as
    --fsdp-version 1 plans them, and as the FSDP2 default would (what planning FSDP1 changes)."""
    from zeroplan.errors import ZeroplanError

    def lines(directory: Path):
        for record in load_step_records(directory):
            fsdp2 = planner_request(record.model, record.training, record.batch, record.strategy, record.world_size)
            planned2 = memory_breakdown(fsdp2)[0]
            error2 = planned2.allocated_peak_bytes / record.peak_bytes - 1
            try:
                planned = memory_breakdown(step_request(record))[0]
            except ZeroplanError as refused:
                # What --fsdp-version 1 refuses is planned as FSDP2 (the stand-in a user gets).
                yield (f"{record.name:84s} {record.peak_bytes / 2**30:9.2f} {'refused':>9s} {'':7s} {'':>20s} "
                       f"{100 * error2:9.2f}  ({refused.field})", error2, STEP_TARGET)
                continue
            error = planned.allocated_peak_bytes / record.peak_bytes - 1
            yield (f"{record.name:84s} {record.peak_bytes / 2**30:9.2f} {planned.allocated_peak_bytes / 2**30:9.2f} "
                   f"{100 * error:7.2f} {planned.peak_moment.value:>20s} {100 * error2:9.2f}", error, STEP_TARGET)

    _print_table(directory or HF_FSDP1_STEP_RECORDS, "Whole step under FSDP1",
                 "Whole-step allocated peak, planner vs hf under accelerate's FSDP1 (GiB; target 5 %); "
                 "fsdp2 % = the same record planned as FSDP2",
                 f"{'record':84s} {'measured':>9s} {'planned':>9s} {'err %':>7s} {'moment':>20s} {'fsdp2 %':>9s}", lines)


HF_FSDP1_QLORA_STEP_RECORDS = Path(__file__).resolve().parent / "framework-fsdp1-qlora-offload-step-records"
FINETUNE_RECORDS = Path(__file__).resolve().parent / "framework-finetune-records"
FINETUNE_STEP_RECORDS = Path(__file__).resolve().parent / "framework-finetune-step-records"


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--finetune", "--hf-fsdp1", "--hf-fsdp1-qlora-offload"))
    if sys.argv[1:2] == ["--hf-fsdp1"]:
        print_hf_fsdp1_table()
    elif sys.argv[1:2] == ["--hf-fsdp1-qlora-offload"]:
        print_hf_fsdp1_table(HF_FSDP1_QLORA_STEP_RECORDS)
    elif sys.argv[1:2] == ["--finetune"]:
        # LoRA and QLoRA (zeroplan/frameworks/lora.py's runs; docs/finetuning.md).
        print_framework_table(FINETUNE_RECORDS)
        print_step_table(FINETUNE_STEP_RECORDS)
    else:
        print_framework_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RECORDS)
        print_step_table(Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_STEP_RECORDS)
