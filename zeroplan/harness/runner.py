"""One rank's measurement run: build, wrap, train the steps (each: grad_accum_steps micro-batches
forward and backward, then one optimizer step), record each step, write the record."""

from __future__ import annotations

import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zeroplan.harness.allocator_trace import AllocatorTrace
from zeroplan.harness.comm import CommRecorder
from zeroplan.harness.data import rank_batch
from zeroplan.harness.engine import MicroBatch
from zeroplan.harness.engines import EngineKind, build_engine, check_supported
from zeroplan.harness.engines_table import training_as_run
from zeroplan.harness.mem_tracker_adapter import track_peak
from zeroplan.harness.memory import SavedActivations, model_state_bytes
from zeroplan.harness.model import build_model
from zeroplan.harness.nccl_log import attach_nccl_log, log_offset
from zeroplan.harness.record import MemoryRecord, RankRecord, RunDescription, StepRecord, write_record
from zeroplan.specs import (
    ActivationCheckpointing, BatchSpec, ModelSpec, Precision, StrategyKind, TrainingSpec,
)
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.training import measured_on

_DTYPES = {Precision.fp32: torch.float32, Precision.bf16_mixed: torch.bfloat16}


class InjectedFailure(RuntimeError):
    """Raised on purpose (--fail-rank) to test that a crashed rank is reported cleanly."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelSpec
    strategy: StrategyKind
    engine: EngineKind
    training: TrainingSpec
    batch: BatchSpec
    steps: int = 3
    seed: int = 0
    run_id: str = "local"
    fail_rank: int | None = None
    keep_unsharded_grads_on_accum: bool = False
    """The planner's StrategySpec knob (zeroplan.harness.engines.build_engine)."""
    parallel: ParallelSpec = ParallelSpec()
    """Tensor (sequence) and pipeline parallelism (zeroplan.harness.parallel_engines)."""
    deepspeed_file: dict | None = None
    """The ``--deepspeed-config`` JSON, checked against this run (zeroplan.harness.deepspeed_file)."""
    config_notes: tuple[str, ...] = ()
    memory_snapshot: bool = False
    """Write each rank's CPU allocations as a torch.cuda.memory._snapshot()-format pickle
    beside its record (zeroplan.harness.snapshot; ``measure --memory-snapshot``)."""
    """What the run took from an engine config file checked before it started (``--accelerate-config``)."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None) -> str:
    """Join the process group torchrun describes in the environment (idempotent)."""
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_backend()


@dataclass(frozen=True)
class Placement:
    """Where this rank runs and which launch it belongs to (RankRecord's schema-3 fields)."""

    launch_id: str
    local_rank: int | None
    node_rank: int | None
    nnodes: int | None
    hostname: str


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def agree_placement() -> Placement:
    """Rank 0 draws the launch id and every rank receives it (one broadcast, made before any
    recorded phase, so no record counts it); the rest is what torchrun put in the environment."""
    launch_id = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(launch_id, src=0)
    return Placement(launch_id=launch_id[0], local_rank=_env_int("LOCAL_RANK"), node_rank=_env_int("GROUP_RANK"),
                     nnodes=_env_int("GROUP_WORLD_SIZE"), hostname=socket.gethostname())


def run_rank(
    config: RunConfig, out_dir: Path | None, gather_full: bool = True, nccl_log: Path | None = None
) -> tuple[RankRecord, dict[str, torch.Tensor]]:
    """Train ``config.steps`` steps on this rank; return its record and (if ``gather_full``) the
    full parameters, an extra collective the oracle tests need and a memory benchmark does not.
    With ``nccl_log`` (the NCCL_DEBUG_FILE this process writes, see nccl_log.enable_coll_log) the
    record also gets NCCL's own count of the collectives, setup and step by step."""
    implementation = check_supported(config.strategy, config.engine, config.training.optimizer,
                                     config.batch.grad_accum_steps)
    dtype = _DTYPES[config.training.precision]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    placement = agree_placement()
    mesh, parallel, coordinates, names = None, config.parallel, {}, {}
    if not config.parallel.is_trivial:
        from zeroplan.harness import parallel_engines as pe

        implementation = pe.implementation_name(config.strategy, config.parallel)
        mesh = pe.mesh_for(config.parallel)
        coordinates, names = pe.coordinates(mesh), pe.group_names(mesh)
        # The request this rank answers: the planner plans each pipeline rank on its own.
        parallel = parallel.model_copy(update={"pipeline_rank": coordinates.get("pp", 0)})
    data_rank, data_size = coordinates.get("dp", rank), world_size // config.parallel.model_parallel_size
    description = RunDescription(
        run_id=config.run_id, model=config.model, strategy=config.strategy, engine=config.engine.value,
        implementation=implementation, world_size=world_size, training=measured_on(training_as_run(config.training, config.engine), device.type),
        batch=config.batch, keep_unsharded_grads_on_accum=config.keep_unsharded_grads_on_accum,
        steps=config.steps, parallel=parallel, torch_version=torch.__version__,
        backend=dist.get_backend(), device=str(device),
    )
    recorder = CommRecorder(names)
    # Started before the model exists, so the trace sees every tensor of the run.
    trace = AllocatorTrace(enabled=device.type == "cpu")
    with torch.device(device), trace:
        model = build_model(config.model, config.seed)
        model.set_activation_checkpointing(
            config.training.activation_checkpointing is ActivationCheckpointing.full
        )
        recorder.phase = "setup"
        setup_start = _offset(nccl_log)
        with recorder:
            if mesh is None:
                engine = build_engine(model, config.strategy, config.engine, dtype, config.training.optimizer,
                                      config.keep_unsharded_grads_on_accum, config.batch.micro_batch_size,
                                      config.batch.grad_accum_steps, config.deepspeed_file)
            else:
                engine = pe.build_parallel_engine(model, mesh, config.parallel, config.strategy, dtype,
                                                  config.training.optimizer, config.keep_unsharded_grads_on_accum,
                                                  config.batch.grad_accum_steps, config.batch.micro_batch_size,
                                                  config.batch.seq_len)
        notes = [*config.config_notes, *getattr(engine, "notes", [])]
        if notes:  # what came from an engine config file, what the harness kept
            description = description.model_copy(update={"notes": notes})
        stage3 = getattr(engine, "stage3_settings", None)
        if stage3 is not None:  # DeepSpeed at stage 3: the settings that decide its gathers
            description = description.model_copy(update={"deepspeed_stage3": stage3})
        setup_span = (setup_start, _offset(nccl_log))
        setup = list(recorder.records)
        steps: list[StepRecord] = []
        step_spans: list[tuple[int, int]] = []
        for step in range(config.steps):
            start = _offset(nccl_log)
            with trace.step(step):
                steps.append(_one_step(engine, config, step, data_rank, data_size, recorder))
            step_spans.append((start, _offset(nccl_log)))
            record = RankRecord(rank=rank, launch_id=placement.launch_id, local_rank=placement.local_rank,
                                node_rank=placement.node_rank, nnodes=placement.nnodes, hostname=placement.hostname,
                                description=description, mesh_coordinates=coordinates, setup_collectives=setup,
                                steps=steps, complete=step == config.steps - 1 and not trace.enabled)
            if nccl_log is not None:
                record = attach_nccl_log(record, nccl_log, setup_span, step_spans)
            if out_dir is not None:
                write_record(out_dir, record)
            if config.fail_rank == rank:
                raise InjectedFailure(f"rank {rank} failed on purpose after step {step} (--fail-rank)")
    if trace.enabled:  # the peaks exist once the trace has ended; only then is the record complete
        record = _with_allocator_peaks(record, trace)
        if out_dir is not None:
            write_record(out_dir, record)
            if config.memory_snapshot:
                from zeroplan.harness.snapshot import write_snapshot

                write_snapshot(out_dir / f"rank{rank:05d}.snapshot.pickle", trace.events())
    with torch.device(device):
        recorder.phase = "gather"
        full = engine.full_parameters() if gather_full else {}
    return record, full


def _with_allocator_peaks(record: RankRecord, trace: AllocatorTrace) -> RankRecord:
    peaks = trace.peaks()
    steps = [
        step.model_copy(update={"memory": step.memory.model_copy(update={
            "allocator_peak_bytes": peaks[step.step].peak_bytes,
            "allocator_live_bytes_by_operator": peaks[step.step].live_bytes_by_operator,
        })})
        for step in record.steps
    ]
    return record.model_copy(update={"steps": steps, "complete": True})


def _offset(nccl_log: Path | None) -> int:
    """Where NCCL's log ends now. NCCL writes a COLL line (line-buffered) while the call is
    enqueued, before the torch.distributed call returns, so the lines between two offsets are
    the calls made in between."""
    return 0 if nccl_log is None else log_offset(nccl_log)


def _one_step(engine, config: RunConfig, step: int, rank: int, world_size: int,
              recorder: CommRecorder) -> StepRecord:
    """One optimizer step; ``rank`` and ``world_size`` are the data-parallel ones (ranks of one
    tensor-parallel group or one pipeline take the same batch)."""
    batch = config.batch
    device = torch.get_default_device()
    micro_batches = [
        tuple(t.to(device) for t in rank_batch(config.model, step, world_size, rank, batch.micro_batch_size,
                                              batch.seq_len, config.seed, micro, batch.grad_accum_steps))
        for micro in range(batch.grad_accum_steps)
    ]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    recorder.records = []
    start = time.perf_counter()
    before = engine.model_state_tensors()
    extra = tuple(t for t in (*before.parameters, *before.gradients, *before.buffers) if t is not None)
    losses, saved_bytes = [], 0
    with track_peak(engine.module, engine.optimizer, extra, getattr(engine, "no_tracker_reason", None)) as peak, recorder:
        recorder.phase = "forward_backward"
        if getattr(engine, "runs_whole_step", False):
            # A pipeline schedule runs every micro-batch in one call, interleaved: each forward
            # of the rank's stage starts a micro-batch, and the largest is recorded.
            saved = SavedActivations(engine.model_state_tensors(), engine.module)
            starts = engine.inner.register_forward_pre_hook(lambda *_: saved.start_micro_batch())
            with saved.hooked():
                losses = engine.forward_backward_step(micro_batches)
            starts.remove()
            saved_bytes = saved.num_bytes
        else:
            for micro, (tokens, targets) in enumerate(micro_batches):
                if micro:
                    peak.next_micro_batch()
                # Saved activations are a per-micro-batch quantity (what the planner predicts):
                # the largest of the step's micro-batches is recorded.
                saved = SavedActivations(engine.model_state_tensors(), engine.module)
                with saved.hooked():
                    losses.append(engine.forward_backward(tokens, targets, MicroBatch(micro, batch.grad_accum_steps)))
                saved_bytes = max(saved_bytes, saved.num_bytes)
        recorder.phase = "step"
        engine.step()
        states = model_state_bytes(engine.model_state_tensors())
        recorder.phase = "zero_grad"
        engine.zero_grad()
    cuda_allocated = cuda_reserved = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        cuda_allocated, cuda_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    memory = MemoryRecord(
        source=peak.source, peak_bytes_by_category=peak.peak_bytes_by_category,
        peak_bytes=peak.peak_bytes, saved_activation_bytes=saved_bytes,
        cuda_max_allocated_bytes=cuda_allocated, cuda_max_reserved_bytes=cuda_reserved,
    )
    loss = float(torch.stack(losses).mean()) if losses else 0.0
    if hasattr(engine, "shared_loss"):
        loss = engine.shared_loss(loss)  # after the recording window: not one of the step's collectives
    return StepRecord(step=step, loss=loss if math.isfinite(loss) else None, wall_s=time.perf_counter() - start,
                      collectives=list(recorder.records), memory=memory, model_state=states)
