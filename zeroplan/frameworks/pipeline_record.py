"""What torchtitan's own pipeline split and torch's own pipeline schedules produced (torch-free:
the planner's tests read the committed records without torch).

Two kinds of record: a ``PipelineSplitRecord`` (which modules and how many parameter elements
torchtitan puts on each pipeline stage and rank) and a ``PipelineScheduleRecord`` (each rank's
action order as torch's schedule builds and executes it, and how many micro-batches' forward
activations it keeps alive at once). The helpers that read an order string are plain Python,
so that a test can recount a record's peaks from its own stored order.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from zeroplan.frameworks.record import SCHEMA_VERSION, NamedRecord, load_records
from zeroplan.specs.base import Frozen


SINGLE_STAGE = ("GPipe", "1F1B")
"""torch 2.13's training schedules with one stage per rank (PipelineScheduleSingle)."""
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Its schedules with several stages per rank (PipelineScheduleMulti)."""
V_STYLE = ("ZBVZeroBubble", "DualPipeV")
"""Schedules torchtitan 0.3.0 maps to ranks V-style (distributed/pipeline_parallel.py
_get_pp_rank_to_stage_indices_mapping); the others loop."""

IDLE = "_"
"""An idle slot in an order string (the schedule IR's ``None``)."""


class StageSplit(Frozen):
    """One pipeline stage of the split: its modules and parameter elements, by module kind."""

    stage_index: int = Field(ge=0)
    modules: list[str]
    """The module names torchtitan assigned ('tok_embeddings', 'layers.0', ..., 'norm', 'lm_head')."""
    layers: int = Field(ge=0)
    """Decoder blocks on the stage."""
    embedding_elements: int = Field(ge=0)
    block_elements: int = Field(ge=0)
    """Parameter elements of all the stage's decoder blocks together."""
    norm_elements: int = Field(ge=0)
    output_elements: int = Field(ge=0)
    """The output projection (lm_head)."""
    total_elements: int = Field(ge=0)
    """Parameter elements of the split-off module as torchtitan built it (counted directly)."""


class RankSplit(Frozen):
    """The stages one pipeline rank builds and their parameter elements together."""

    rank: int = Field(ge=0)
    stage_indices: list[int]
    """In the order torchtitan builds them on the rank."""
    param_elements: int = Field(ge=0)


class PipelineSplitRecord(NamedRecord):
    """torchtitan's stage split of one Llama-3 flavour for one pipeline degree and schedule."""

    schema_version: int = SCHEMA_VERSION
    torch_version: str
    framework_version: str
    """'torchtitan 0.3.0'."""
    how_made: str
    """The calls that produced the figures."""
    flavour: str
    """torchtitan's model_registry flavour ('8B', '70B', '405B')."""
    num_layers: int = Field(ge=1)
    model_param_elements: int = Field(ge=1)
    """Parameter elements of the whole (unsplit) model, counted on the same meta model."""
    pp: int = Field(ge=2)
    schedule: str
    """The pipeline_parallel_schedule name the split was made for (it decides the stages per
    rank and how stages map to ranks)."""
    layers_per_stage: int | None = None
    """pipeline_parallel_layers_per_stage (None, its default: one stage per rank for a
    single-stage schedule, two for a multi-stage one)."""
    stages_per_rank: int | None = Field(default=None, ge=1)
    """None only where torchtitan refused before deciding it."""
    style: str
    """'loop' (rank r holds r, r + pp, ...) or 'v' (rank r holds r and 2 pp - 1 - r)."""
    input_weight: int
    """pipeline_parallel_first_stage_less_layers (the embedding counted as that many layers)."""
    output_weight: int
    """pipeline_parallel_last_stage_less_layers (norm + lm_head counted as that many layers)."""
    stages: list[StageSplit] = Field(default_factory=list)
    ranks: list[RankSplit] = Field(default_factory=list)
    error: str | None = None
    """torchtitan's own refusal, where it refused this configuration (then nothing else is set)."""

    @property
    def name(self) -> str:
        stem = f"split_llama3-{self.flavour.lower()}_pp{self.pp}_{self.schedule.lower()}"
        return stem + (f"_lps{self.layers_per_stage}" if self.layers_per_stage else f"_v{self.stages_per_rank}")


class RankSchedule(Frozen):
    """One rank's order in one schedule, and the peaks read from it and measured running it."""

    rank: int = Field(ge=0)
    stage_indices: list[int]
    ir_order: str
    """The schedule's own ``pipeline_order[rank]`` (compute actions, '_' for an idle slot),
    space-separated as torch prints them ('1F0', '5I2', '5W2', '(1F6;6B2)OVERLAP_F_B', ...).
    REDUCE_GRAD entries are left out."""
    executed_order: str
    """The compute calls this rank's ``schedule.step()`` actually made on its stages, in order:
    forward_one_chunk -> 'sF m', backward_one_chunk -> 'sB m' (full) or 'sI m' (input only),
    backward_weight_one_chunk -> 'sW m', written 'sXm' like the IR."""
    ir_slots: int | None = Field(default=None, ge=0)
    """Entries of the IR order, idle ones included; None where the schedule's IR drops its
    idle slots (the single-stage schedules: torch's _add_reduce_grad skips None)."""
    ir_idle_slots: int | None = Field(default=None, ge=0)
    """The '_' entries (None as above)."""
    peak_in_flight_until_input_grad: int = Field(ge=0)
    """Most (stage, micro-batch) forward chunks at once whose B or I had not yet run, read
    from ``executed_order``."""
    peak_in_flight_until_weight_grad: int = Field(ge=0)
    """The same until B or W: what keeps the saved activations the weight gradient reads."""
    peak_in_flight_ir: int = Field(ge=0)
    """``peak_in_flight_until_weight_grad`` read from the IR order instead."""
    ir_matches_executed: bool
    """Whether the IR's compute actions, idle slots dropped and overlapped pairs expanded, are
    exactly the executed ones in the same order."""
    peak_saved_chunks_measured: int = Field(ge=0)
    """Most forward chunks whose autograd-saved activation tensors were alive at once while the
    step ran (saved-tensor hooks; each chunk of the probe stage saves exactly one)."""
    fake_run_order_matches: bool
    """Whether the same rank's step on fake tensors (FakeTensorMode, a 4096-wide probe) made
    exactly the same compute calls in the same order."""
    peak_saved_bytes_fake: int = Field(ge=0)
    """Most bytes of autograd-saved activations alive at once in that fake-tensor run."""


class PipelineScheduleRecord(NamedRecord):
    """torch's pipeline schedule for one (schedule, pp, stages per rank, micro-batches)."""

    schema_version: int = SCHEMA_VERSION
    torch_version: str
    how_made: str
    schedule: str
    """The name get_schedule_class accepts ('1F1B', 'Interleaved1F1B', ...)."""
    schedule_class: str
    pp: int = Field(ge=2)
    stages_per_rank: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    fake_chunk_bytes: int = Field(ge=1)
    """Bytes one forward chunk of the fake-tensor probe saves for backward."""
    ranks: list[RankSchedule] = Field(default_factory=list)
    error: str | None = None
    """torch's own refusal, where the schedule refused this configuration."""
    notes: list[str] = Field(default_factory=list)

    @property
    def name(self) -> str:
        return f"schedule_{self.schedule.lower()}_pp{self.pp}_v{self.stages_per_rank}_m{self.microbatches}"


def parse_order(order: str) -> list[tuple[int, str, int] | None]:
    """An order string as (stage, kind, micro-batch) tuples in execution order; None for '_'.
    An overlapped pair '(1F6;6B2)OVERLAP_F_B' becomes its two actions, first to last."""
    actions: list[tuple[int, str, int] | None] = []
    for token in order.split():
        if token == IDLE:
            actions.append(None)
            continue
        inner = token[1:token.index(")")].split(";") if token.startswith("(") else [token]
        for item in inner:
            for position, char in enumerate(item):
                if char.isalpha():
                    break
            actions.append((int(item[:position]), item[position], int(item[position + 1:])))
    return actions


def compute_actions(order: str) -> list[tuple[int, str, int]]:
    """The order's actions without its idle slots."""
    return [action for action in parse_order(order) if action is not None]


def peak_in_flight(order: str, released_by: str) -> int:
    """Most (stage, micro-batch) chunks at once that have run F but none of the kinds in
    ``released_by`` ('BI': until input gradient, 'BW': until weight gradient)."""
    alive: set[tuple[int, int]] = set()
    peak = 0
    for action in parse_order(order):
        if action is None:
            continue
        stage, kind, micro = action
        if kind == "F":
            alive.add((stage, micro))
            peak = max(peak, len(alive))
        elif kind in released_by:
            alive.discard((stage, micro))
    return peak


SPLIT_DIR = "split"
SCHEDULE_DIR = "schedule"
"""Sub-directories of a pipeline records directory holding each kind."""


def load_split_records(directory: Path) -> list[PipelineSplitRecord]:
    """Every split record under ``directory``/split, sorted by file name."""
    return load_records(Path(directory) / SPLIT_DIR, PipelineSplitRecord, "pipeline split record")


def load_schedule_records(directory: Path) -> list[PipelineScheduleRecord]:
    """Every schedule record under ``directory``/schedule, sorted by file name."""
    return load_records(Path(directory) / SCHEDULE_DIR, PipelineScheduleRecord, "pipeline schedule record")
