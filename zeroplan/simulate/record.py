"""What one simulated training step records, as a versioned, frozen pydantic record.

The harness has no shared record type for collectives and per-category bytes yet, so the
simulator keeps its own small one here; ``schema_version`` changes whenever a field's meaning
does.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field, field_validator

from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import recorded_before_kernels

SCHEMA_VERSION = 1


class Phase(str, Enum):
    """When in the step a collective was issued."""

    setup = "setup"
    """Wrapping the model (DDP broadcasts the rank-0 weights)."""
    forward = "forward"
    backward = "backward"
    optimizer = "optimizer"


class CollectiveKind(str, Enum):
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_reduce = "all_reduce"
    broadcast = "broadcast"
    other = "other"


class CollectiveRecord(Frozen):
    """One collective call as the dispatcher saw it on the simulated rank."""

    phase: Phase
    """Part of the step that issued it."""
    op: str
    """The torch operator, e.g. 'c10d._allgather_base_.default'."""
    kind: CollectiveKind
    """What the operator does."""
    dtype: str
    """Element type of the communicated buffer, e.g. 'torch.bfloat16'."""
    element_bytes: int = Field(gt=0)
    """Bytes per element."""
    input_elements: int = Field(ge=0)
    """Elements this rank contributes (all-gather: its shard; reduce-scatter: the full buffer;
    all-reduce and broadcast: the buffer, which is reduced or overwritten in place)."""
    output_elements: int = Field(ge=0)
    """Elements this rank receives into (all-gather: the full buffer; reduce-scatter: its
    shard; all-reduce and broadcast: the same buffer)."""
    group_size: int = Field(gt=0)
    """Ranks in the process group the collective ran over."""

    @property
    def input_bytes(self) -> int:
        return self.input_elements * self.element_bytes

    @property
    def output_bytes(self) -> int:
        return self.output_elements * self.element_bytes

    @property
    def buffer_bytes(self) -> int:
        """The unsharded buffer: the larger of input and output (the collective's 'volume' in
        the ZeRO paper's sense, before any ring (N-1)/N factor)."""
        return max(self.input_bytes, self.output_bytes)


class ModelStateBytes(Frozen):
    """Bytes of model states one rank holds, from the tensors' storages (deduplicated)."""

    parameter_bytes: int = Field(ge=0)
    """Parameters as the engine stores them (FSDP2: the padded dim-0 shard)."""
    gradient_bytes: int = Field(ge=0)
    """Gradients held after backward (FSDP2: the sharded gradients)."""
    exp_avg_bytes: int = Field(ge=0)
    """AdamW first moments after one optimizer step."""
    exp_avg_sq_bytes: int = Field(ge=0)
    """AdamW second moments after one optimizer step."""
    step_bytes: int = Field(ge=0)
    """AdamW per-parameter step counters (0-dim fp32 tensors)."""

    @property
    def optimizer_state_bytes(self) -> int:
        return self.exp_avg_bytes + self.exp_avg_sq_bytes + self.step_bytes

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes


class SimulationRecord(Frozen):
    """One forward, backward and AdamW step of a full-size model on one simulated rank."""

    schema_version: int = SCHEMA_VERSION
    """Bumped when a field changes meaning."""
    torch_version: str
    """torch.__version__ that ran the step."""
    model: ModelSpec
    """The architecture simulated."""
    strategy: StrategyKind
    """ddp, fsdp-full-shard or fsdp-shard-grad-op."""
    world_size: int = Field(gt=0)
    """N: ranks in the fake process group."""
    rank: int = Field(ge=0)
    """The rank this process played."""
    training: TrainingSpec
    """Precision, optimizer, activation checkpointing."""
    _training_kernels = field_validator("training", mode="before")(recorded_before_kernels)
    batch: BatchSpec
    """Micro-batch size and sequence length of the step."""
    mixed_precision: str
    """How the engine was configured for the precision, in torch's own terms."""
    parameter_count: int = Field(gt=0)
    """Elements of all unsharded parameters (each shared tensor counted once)."""
    model_states: ModelStateBytes
    """Per-rank model-state bytes by category."""
    collectives: list[CollectiveRecord]
    """Every collective of the recorded step, in issue order."""
    mem_tracker_peak_bytes: dict[str, int] | None = None
    """FSDP2's FSDPMemTracker at the peak of the step, per category (FSDP only; None when
    not run)."""
    saved_activation_bytes: int | None = Field(default=None, ge=0)
    """Distinct storages autograd saved for backward in the forward and the loss, parameters
    excluded (None where a size is data-dependent, MoE, or in records written before it was
    measured)."""
    wall_time_s: float = Field(ge=0)
    """Seconds the simulation took, model construction included."""
    notes: list[str] = Field(default_factory=list)
    """Caveats specific to this run."""

    def collective_bytes(self, kind: CollectiveKind, phase: Phase | None = None) -> int:
        """Sum of buffer_bytes over the collectives of one kind (and optionally one phase)."""
        return sum(
            c.buffer_bytes for c in self.collectives
            if c.kind is kind and (phase is None or c.phase is phase)
        )

    def collective_count(self, kind: CollectiveKind, phase: Phase | None = None) -> int:
        return sum(
            1 for c in self.collectives if c.kind is kind and (phase is None or c.phase is phase)
        )
