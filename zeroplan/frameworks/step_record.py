"""What one fake-tensor training step of a framework's own model, wrapped by its own FSDP2 code,
measured on one simulated rank (torch-free: the planner's tests read the committed records)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from zeroplan.frameworks.record import ReleaseRecord, finetune_tag, load_records
from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import recorded_before_kernels


class StepPhase(str, Enum):
    """The part of the step a running peak was reached in."""

    forward = "forward"
    """The model's forward (HF's loss is inside it: model(labels=...))."""
    loss = "loss"
    """The loss computed outside the model (torchtune's CEWithChunkedOutputLoss)."""
    backward = "backward"
    optimizer = "optimizer"
    """optimizer.step()."""


class AllocatorFigures(Frozen):
    """What the caching-allocator model (zeroplan.allocator) makes of a run's allocation trace."""

    alloc_conf: str
    """The PYTORCH_CUDA_ALLOC_CONF replayed ("" for the defaults)."""
    cublas_workspace_bytes: int = Field(ge=0)
    """Each cuBLAS handle's workspace added to the trace (forward and backward threads)."""
    events: int = Field(ge=0)
    requested_peak_bytes: int = Field(ge=0)
    """The most bytes the run's storages held at once (what an allocated peak counts)."""
    reserved_peak_bytes: int = Field(ge=0)
    """What the allocator would reserve (torch.cuda.max_memory_reserved) on a device with room."""
    oom_capacity_bytes: int = Field(ge=0)
    """The least device memory on which both steps complete under the allocator's retry rules."""


class FrameworkStepRecord(ReleaseRecord):
    """One forward, loss, backward and AdamW step of a framework's full-depth model."""

    model: ModelSpec
    """The architecture, built at its full depth."""
    strategy: StrategyKind
    """fsdp-full-shard or fsdp-shard-grad-op (the framework's reshard_after_forward)."""
    world_size: int = Field(gt=0)
    """N: ranks in the fake process group."""
    rank: int = Field(ge=0)
    """The rank this process played."""
    training: TrainingSpec
    """Framework, precision and activation-checkpointing policy, as the planner reads them."""
    _training_kernels = field_validator("training", mode="before")(recorded_before_kernels)
    batch: BatchSpec
    """Micro-batch size and sequence length of the step."""
    sharding: str
    """How the framework's own code wrapped the model (fully_shard units, mixed-precision policy)."""
    fsdp_version: Literal[1, 2] = 2
    """Which torch FSDP wrapped it: 2, fully_shard (every framework's recipe); 1,
    FullyShardedDataParallel (accelerate's fsdp_version 1, zeroplan.frameworks.hf_fsdp1_step)."""
    optimizer: str
    """The optimizer as constructed (class, dtype of the parameters it updates, fused or not)."""
    peak_bytes: int = Field(gt=0)
    """FSDP2's FSDPMemTracker total at the step's peak (under FSDP1, the most bytes of live
    storages): every tensor this rank holds at once (allocated bytes, before the caching
    allocator's rounding and reserve)."""
    peak_by_category: dict[str, int]
    """The tracker's categories at that peak ('sharded_param', 'act', 'optstate', ...)."""
    peak_phase: StepPhase
    """The phase in which the running peak first reached ``peak_bytes``."""
    running_peak_bytes: dict[StepPhase, int]
    """The tracker's peak so far at the end of each phase run."""
    parameter_bytes: int = Field(ge=0)
    """Sharded parameters this rank stores (padded dim-0 shards)."""
    gradient_bytes: int = Field(ge=0)
    """Sharded gradients after backward."""
    optimizer_state_bytes: int = Field(ge=0)
    """AdamW's exp_avg, exp_avg_sq and step after one step."""
    allocator: AllocatorFigures | None = None
    """With ``simulate --allocator-conf``: the caching-allocator model's replay of the storages
    the run allocated and freed (both steps, from the sharded states on)."""
    wall_time_s: float = Field(ge=0)
    """Seconds the run took, model construction included."""
    notes: list[str] = Field(default_factory=list)
    """Caveats specific to this run."""

    @property
    def model_state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def name(self) -> str:
        t, b = self.training, self.batch
        return (f"{t.framework.value}:{self.model.name}:{self.strategy.value}:n{self.world_size}:{t.precision.value}{finetune_tag(t)}:"
                f"ac={t.activation_checkpointing.value}{'+optim-in-bwd' if t.optimizer_in_backward else ''}"
                f"{'+unchunked-loss' if t.unchunked_loss else ''}{'+cpu-offload' if t.fsdp_cpu_offload else ''}"
                f"{'+dpo' if t.objective.value == 'dpo' else ''}:"
                f"s{b.seq_len}:b{b.micro_batch_size}{f'x{b.grad_accum_steps}' if b.grad_accum_steps > 1 else ''}"
                f"{'' if self.fsdp_version == 2 else ':fsdp1'}")


def load_step_records(directory: Path) -> list[FrameworkStepRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, FrameworkStepRecord, "framework step record")
