"""What a measurement run records, one versioned JSON file per rank, written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from zeroplan.atomic import write_text_atomic
from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.training import recorded_before_kernels

SCHEMA_VERSION = 4
"""1: the first layout; 2 adds ``RankRecord.nccl_log`` (None in every version-1 record) and the CPU
allocator peak in ``MemoryRecord``; 3 adds where the rank ran and which launch it belongs to
(``RankRecord.launch_id``, ``local_rank``, ``node_rank``, ``nnodes``, ``hostname``; None in older
records), so that the records of several nodes can be merged; 4 adds model parallelism:
``RunDescription.parallel`` (the ParallelSpec of the request this rank answers, its
pipeline_rank included; no model parallelism in older records), ``RankRecord.mesh_coordinates``
and, per collective, the group it ran on (``group``, ``group_ranks``) and a point-to-point
call's ``peer`` (None in older records)."""


MAX_RANKS = 2**20
"""Bound of a record's ranks, world size and node count: the command line's MAX_COUNT
(docs/input-bounds.md), far above any real job; 10^9 nodes is a damaged record."""


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
    """Ranks in the process group (2 for a point-to-point send or recv: the two ends)."""
    group: str | None = None
    """The mesh dimension the process group is ('dp', 'tp', 'pp'), 'world', or None when the
    run has no device mesh or the group is none of these (and in records before schema 4)."""
    group_ranks: list[int] | None = None
    """Global ranks of the process group, in group-rank order (None before schema 4)."""
    peer: int | None = None
    """send / recv only: the global rank of the other end (None before schema 4)."""
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
    peak_bytes: int | None = Field(ge=0)
    """The step's peak of all tracked tensor bytes; None when no tracker ran."""
    saved_activation_bytes: int = Field(ge=0)
    """Own measure: unique storages autograd saved for backward (saved-tensor hook), excluding
    model-state storages; with gradient accumulation, the largest over the step's micro-batches."""
    cuda_max_allocated_bytes: int | None = Field(default=None, ge=0)
    """torch.cuda.max_memory_allocated over the step (CUDA only)."""
    cuda_max_reserved_bytes: int | None = Field(default=None, ge=0)
    """torch.cuda.max_memory_reserved over the step (CUDA only)."""
    allocator_peak_bytes: int | None = Field(default=None, ge=0)
    """CPU only: the step's peak of live tensor bytes as the CPU allocator counts them (every
    tensor of the process, whoever made it; zeroplan.harness.allocator_trace). Filled in when
    the run ends, so a rank that fails leaves it None."""
    allocator_live_bytes_by_operator: dict[str, int] = Field(default_factory=dict)
    """At that peak, live bytes by the operator that allocated them (the largest few)."""


class ModelStateBytes(Frozen):
    """Unique storages of model states right after the optimizer step, before zero_grad."""

    parameters_bytes: int = Field(ge=0)
    gradients_bytes: int = Field(ge=0)
    optimizer_states_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    """Parameters + gradients + optimizer states + buffers (host_bytes not included)."""
    host_bytes: int = Field(default=0, ge=0)
    """States an offloading engine keeps in host memory (0 for the others)."""
    buffers_bytes: int = Field(default=0, ge=0)
    """Communication and staging buffers kept across the step (DeepSpeed's reduce buckets, stage
    3's gradient partition buffer, offload's device staging buffer); 0 for engines that keep
    none, and in records made before the field, whose gradients_bytes included them."""


class StepRecord(Frozen):
    step: int = Field(ge=0)
    """0-based; step 0 includes one-off allocations (a warm-up)."""
    loss: float | None
    """This rank's mean loss over the step's micro-batches; None where it was not finite (JSON
    has no NaN): on a fake process group (benchmarks/gpu_measure.py) collectives move no data,
    so a ZeRO-3 rank computes with gathered buffers nothing filled, and its loss means nothing."""
    wall_s: float = Field(ge=0)
    collectives: list[CollectiveRecord]
    memory: MemoryRecord
    model_state: ModelStateBytes


class DeepSpeedStage3Settings(Frozen):
    """The ZeRO-3 settings of a DeepSpeed run that decide its parameter gathers
    (zeroplan.core.deepspeed_coordinator), as the engine was configured (elements)."""

    prefetch_bucket_size: int = Field(ge=0)
    max_live_parameters: int = Field(ge=0)
    param_persistence_threshold: int = Field(ge=0)


HARNESS_DEEPSPEED_STAGE3 = DeepSpeedStage3Settings(
    prefetch_bucket_size=0, max_live_parameters=10**9, param_persistence_threshold=0)
"""What the harness's own DeepSpeed config sets (zeroplan/harness/deepspeed_engine.py
deepspeed_config): a DeepSpeed record without deepspeed_stage3 ran under it."""


class RunDescription(Frozen):
    """The request-like description of the run: what the planner would be asked."""

    run_id: str
    model: ModelSpec
    strategy: StrategyKind
    engine: str
    """'zeroplan', 'torch', 'torch-fsdp1' or 'deepspeed'."""
    implementation: str
    """E.g. 'reference ZeRO stage 2', 'FSDP2 fully_shard(reshard_after_forward=True)'."""
    world_size: int = Field(gt=0, le=MAX_RANKS)
    training: TrainingSpec
    _training_kernels = field_validator("training", mode="before")(recorded_before_kernels)
    batch: BatchSpec
    """grad_accum_steps is the number of micro-batches each step ran."""
    keep_unsharded_grads_on_accum: bool = False
    """The planner's StrategySpec knob: full gradients accumulated locally and reduced once per
    step (FSDP no_sync) instead of reduce-scattered every micro-batch."""
    steps: int = Field(gt=0)
    parallel: ParallelSpec = ParallelSpec()
    """Tensor (sequence) and pipeline parallelism, as the planner's PlanRequest.parallel states it,
    with ``pipeline_rank`` this rank's pipeline rank (no model parallelism before schema 4)."""
    torch_version: str
    backend: str
    device: str
    deepspeed_stage3: DeepSpeedStage3Settings | None = None
    """DeepSpeed at stage 3: its prefetch, live-parameter and persistence settings; None in other
    runs and in DeepSpeed records made before the field (the harness's own config then,
    HARNESS_DEEPSPEED_STAGE3)."""
    notes: list[str] = Field(default_factory=list)
    """How the engine was configured where a file set it (``--deepspeed-config``): which
    settings came from the file and which the harness kept; empty otherwise (and in older records)."""


class NcclCollective(Frozen):
    """One collective as NCCL's own log reports it (a ``NCCL_DEBUG_SUBSYS=COLL`` line), read by
    zeroplan.harness.nccl_log, never by the dispatch mode."""

    name: str
    """NCCL's operation name: 'AllReduce', 'AllGather', 'ReduceScatter', 'Broadcast', 'Reduce',
    'Send', 'Recv', ..."""
    op: str
    """The same collective in CollectiveRecord's vocabulary ('all_reduce', ...), the name if unknown."""
    op_count: int = Field(ge=0)
    """The communicator's opCount when the call was enqueued (logged in hex)."""
    count: int = Field(ge=0)
    """NCCL's count argument: per-rank send count for AllGather, per-rank receive count for
    ReduceScatter, the buffer length otherwise."""
    datatype: int
    """ncclDataType_t value."""
    dtype: str
    """The datatype as a torch-style name ('float32', 'bfloat16', ...), 'unknown(<n>)' if not known."""
    red_op: int
    """ncclRedOp_t value (0 Sum, 1 Prod, 2 Max, 3 Min, 4 Avg, >= 5 a created PreMulSum)."""
    root: int
    """Root rank (Broadcast, Reduce) or peer (Send, Recv); 0 otherwise."""
    comm: str
    """The communicator's address as logged: tells communicators (DDP's, a subgroup's) apart."""
    nranks: int = Field(gt=0)
    numel: int = Field(ge=0)
    """Elements of the full buffer, CollectiveRecord's convention (AllGather, ReduceScatter:
    count times nranks)."""
    num_bytes: int | None = Field(default=None, ge=0)
    """numel times the datatype's size; None for an unknown datatype."""
    cuda_device: int | None = None
    """The CUDA device in the line's '[d]' prefix."""
    line: int = Field(ge=1)
    """1-based line number in the log file."""


class NcclSpan(Frozen):
    """The part of the NCCL log written during one phase (setup, or one step)."""

    start_byte: int = Field(ge=0)
    end_byte: int = Field(ge=0)
    collectives: list[NcclCollective]
    malformed_lines: list[str]
    """Lines that start like a COLL call line but do not parse (e.g. cut off by a crash)."""


class OpTotals(Frozen):
    calls: int = Field(ge=0)
    num_bytes: int = Field(ge=0)


class NcclCheck(Frozen):
    """Dispatch-mode count against NCCL's log for one phase."""

    phase: str
    """'setup' or 'step <k>'."""
    dispatch: dict[str, OpTotals]
    nccl: dict[str, OpTotals]
    agrees: bool
    disagreements: list[str]
    """One sentence per difference: calls or bytes of one op, total bytes, unparsed lines."""


class NcclLogRecord(Frozen):
    """A second, independent count of this rank's collectives, from NCCL's own log."""

    file: str
    """The NCCL_DEBUG_FILE this rank wrote."""
    setup: NcclSpan
    steps: list[NcclSpan]
    checks: list[NcclCheck]
    """Setup first, then one per step."""
    communicators: dict[str, int]
    """Communicator address -> nranks, for every communicator seen in setup or steps."""
    agrees: bool
    """Every check agrees."""


class RankRecord(Frozen):
    schema_version: Literal[1, 2, 3, 4] = SCHEMA_VERSION
    rank: int = Field(ge=0, lt=MAX_RANKS)
    """The global rank, 0 .. world_size - 1 (names the file: rank00007.json)."""
    launch_id: str | None = None
    """Shared by every rank of one launch and by no other launch: rank 0 draws it and sends it to
    the others when the run starts. Tells apart runs that share a --run-id when the records of
    several nodes are merged (None before schema 3)."""
    local_rank: int | None = Field(default=None, ge=0, lt=MAX_RANKS)
    """The rank on its node (torchrun's LOCAL_RANK)."""
    node_rank: int | None = Field(default=None, ge=0, lt=MAX_RANKS)
    """The node (torchrun's GROUP_RANK: --node-rank, or SLURM_NODEID under --slurm)."""
    nnodes: int | None = Field(default=None, gt=0, le=MAX_RANKS)
    """Nodes in the launch (torchrun's GROUP_WORLD_SIZE)."""
    hostname: str | None = None
    """The machine the rank ran on (socket.gethostname())."""
    description: RunDescription
    mesh_coordinates: dict[str, int] = Field(default_factory=dict)
    """This rank's place on the device mesh, by dimension name ('pp', 'dp', 'tp'); empty for a
    purely data-parallel run (and before schema 4)."""
    setup_collectives: list[CollectiveRecord]
    """Collectives issued while wrapping the model (DDP/FSDP broadcasts), before step 0."""
    steps: list[StepRecord]
    complete: bool
    """False while the run is in progress (the file is rewritten after every step)."""
    nccl_log: NcclLogRecord | None = None
    """NCCL backend only: the collectives NCCL logged, per phase, and their check against
    ``setup_collectives`` / ``steps[k].collectives`` (zeroplan.harness.nccl_log)."""


def record_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank:05d}.json"


def write_record(out_dir: Path, record: RankRecord) -> Path:
    """Write atomically: a temp file in the same directory, fsync, then os.replace. A reader sees
    the old file or the new one, never half of one; other ranks' files are never touched."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(record_path(out_dir, record.rank), record.model_dump_json(indent=1))


def read_record(path: Path) -> RankRecord:
    # Strict: a record is written by the harness, so "2" for a count or "yes" for a flag is a
    # damaged or hand-edited file, not something to coerce (JSON strings still name enums).
    return RankRecord.model_validate_json(path.read_text(encoding="utf-8"), strict=True)
