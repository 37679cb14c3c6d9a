"""What a measurement run records, one versioned JSON file per rank, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen

SCHEMA_VERSION = 1


class CollectiveRecord(Frozen):
    """One collective call on this rank."""

    op: str
    """all_reduce, all_gather, reduce_scatter, broadcast, barrier, ... (the raw name if unknown)."""
    raw_op: str
    """The dispatcher operator, e.g. 'c10d._reduce_scatter_base_.default'."""
    dtype: str
    """Element type, e.g. 'float32', 'bfloat16'."""
    numel: int = Field(ge=0)
    """Elements of the full buffer (for all_gather / reduce_scatter: N times one shard)."""
    num_bytes: int = Field(ge=0)
    """numel times the element size, in bytes."""
    group_size: int = Field(gt=0)
    """Ranks in the process group."""
    phase: str
    """What the runner was doing: 'setup', 'forward_backward', 'step', 'zero_grad', 'gather'."""


class MemoryRecord(Frozen):
    """Memory seen during one step (forward, backward, optimizer step)."""

    source: str
    """Who measured the by-category peak: 'MemTracker', 'FSDPMemTracker' (private PyTorch tools,
    through zeroplan.harness.mem_tracker_adapter) or 'unavailable: <reason>'."""
    peak_bytes_by_category: dict[str, int]
    """At the moment of the step's peak, logical bytes per category (the tracker's own
    category names, e.g. 'Parameter', 'Gradient', 'Optstate', 'Activation', 'Temp')."""
    peak_bytes: int | None
    """The step's peak of all tracked tensor bytes; None when no tracker ran."""
    saved_activation_bytes: int = Field(ge=0)
    """Own measure: unique storages autograd saved for backward (saved-tensor hook), excluding
    model-state storages."""
    cuda_max_allocated_bytes: int | None = None
    """torch.cuda.max_memory_allocated over the step (CUDA only)."""
    cuda_max_reserved_bytes: int | None = None
    """torch.cuda.max_memory_reserved over the step (CUDA only)."""


class ModelStateBytes(Frozen):
    """Unique storages of model states right after the optimizer step, before zero_grad."""

    parameters_bytes: int = Field(ge=0)
    gradients_bytes: int = Field(ge=0)
    optimizer_states_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    """Parameters + gradients + optimizer states (host_bytes not included)."""
    host_bytes: int = Field(default=0, ge=0)
    """States an offloading engine keeps in host memory (0 for the others)."""


class StepRecord(Frozen):
    step: int = Field(ge=0)
    """0-based; step 0 includes one-off allocations (a warm-up)."""
    loss: float
    wall_s: float = Field(ge=0)
    collectives: list[CollectiveRecord]
    memory: MemoryRecord
    model_state: ModelStateBytes


class RunDescription(Frozen):
    """The request-like description of the run: what the planner would be asked."""

    run_id: str
    model: ModelSpec
    strategy: StrategyKind
    engine: str
    """'zeroplan', 'torch', 'torch-fsdp1' or 'deepspeed'."""
    implementation: str
    """E.g. 'reference ZeRO stage 2', 'FSDP2 fully_shard(reshard_after_forward=True)'."""
    world_size: int = Field(gt=0)
    training: TrainingSpec
    batch: BatchSpec
    steps: int = Field(gt=0)
    torch_version: str
    backend: str
    device: str


class RankRecord(Frozen):
    schema_version: Literal[1] = SCHEMA_VERSION
    rank: int = Field(ge=0)
    description: RunDescription
    setup_collectives: list[CollectiveRecord]
    """Collectives issued while wrapping the model (DDP/FSDP broadcasts), before step 0."""
    steps: list[StepRecord]
    complete: bool
    """False while the run is in progress (the file is rewritten after every step)."""


def record_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank:05d}.json"


def write_record(out_dir: Path, record: RankRecord) -> Path:
    """Write atomically: a temp file in the same directory, fsync, then os.replace. A reader sees
    the old file or the new one, never half of one; other ranks' files are never touched."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(out_dir, record.rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(record.model_dump_json(indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_record(path: Path) -> RankRecord:
    return RankRecord.model_validate(json.loads(path.read_text(encoding="utf-8")))
