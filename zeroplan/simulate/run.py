"""Run one real training step of a full-size model on one simulated rank.

The model is ``zeroplan.harness.model.Transformer`` built under a fake-tensor mode (shapes and
dtypes, no data), wrapped by PyTorch's own FSDP2 (``fully_shard``) or DDP over a fake process
group of N ranks, then driven through forward, backward and one AdamW step. Nothing is
computed, so a 70B model at N=64 takes seconds on a laptop CPU; what the engine allocates and
which collectives it issues are exactly what the real code does on rank ``rank``.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from zeroplan.errors import ZeroplanError
from zeroplan.progress import steps
from zeroplan.harness.engine import local_tensor, make_adamw
from zeroplan.harness.model import Transformer, build_model, next_token_loss
from zeroplan.harness.torch_engines import fake_group_all_reduce
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.collectives import CollectiveRecorder
from zeroplan.simulate.fake_world import (
    DEVICE as _DEVICE, check_rank_of_world, device_mesh, fake_process_group, storage_bytes,
)
from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula
from zeroplan.simulate.record import ModelStateBytes, Phase, SimulationRecord
from zeroplan.specs import (
    ActivationCheckpointing,
    BatchSpec,
    ModelSpec,
    Optimizer,
    PlanRequest,
    Precision,
    StrategyKind,
    TrainingSpec,
    check_seq_len,
)
from zeroplan.specs.training import measured_on

SUPPORTED_STRATEGIES = (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.ddp)
SUPPORTED_PRECISIONS = (Precision.bf16_mixed, Precision.fp32)
SUPPORTED_CHECKPOINTING = (ActivationCheckpointing.none, ActivationCheckpointing.full)


def simulate(
    model: ModelSpec,
    strategy: StrategyKind | str,
    world_size: int,
    *,
    training: TrainingSpec | None = None,
    batch: BatchSpec | None = None,
    rank: int = 0,
    mem_tracker: bool = True,
    cuda_norm_formula: bool = False,
    show_progress: bool = False,
) -> SimulationRecord:
    """Simulate one forward, backward and AdamW step on ``rank`` of ``world_size`` ranks.

    ``mem_tracker`` also runs FSDP2's FSDPMemTracker (FSDP strategies, dense models; it makes
    the run 2x slower at 7B and 3x at 70B). ``cuda_norm_formula`` makes F.rms_norm save what
    torch's fused CUDA kernel saves (zeroplan.simulate.fused_rms_norm); the record then states
    ``kernels: cuda``, the only dispatch difference the planner models. ``show_progress`` draws
    the step's phases done on stderr when it is a terminal (zeroplan.progress). Errors in what
    is asked for raise :class:`ZeroplanError` naming the field.
    """
    training = training or TrainingSpec()
    batch = batch or BatchSpec()
    kind = _check(strategy, world_size, rank, training)
    check_seq_len(model, batch)
    start_s = time.perf_counter()
    notes = []
    if model.is_moe and mem_tracker:
        mem_tracker = False
        notes.append(
            "FSDPMemTracker skipped: MoE routing gives tensors of data-dependent size, which "
            "the tracker cannot count under fake tensors"
        )
    if kind is StrategyKind.ddp and mem_tracker:
        mem_tracker = False
        notes.append("FSDPMemTracker skipped: it tracks FSDP modules only")
    if batch.grad_accum_steps > 1:
        notes.append(f"one micro-batch simulated of grad_accum_steps={batch.grad_accum_steps}")
    norms = cuda_rms_norm_formula() if cuda_norm_formula else contextlib.nullcontext()
    with fake_process_group(world_size, rank), norms:
        with steps(len(STEP_PHASES), "simulate", enabled=show_progress) as bar:
            record_args = _run_step(model, kind, world_size, training, batch, mem_tracker, notes, bar)
    kernels_of = "cuda" if cuda_norm_formula else _DEVICE
    return SimulationRecord(
        torch_version=torch.__version__, model=model, strategy=kind, world_size=world_size,
        rank=rank, training=measured_on(training, kernels_of), batch=batch, wall_time_s=time.perf_counter() - start_s,
        notes=notes, **record_args,
    )


def simulate_request(request: PlanRequest, *, rank: int = 0, mem_tracker: bool = True) -> SimulationRecord:
    """:func:`simulate` for the same request object the planner reads."""
    return simulate(
        request.model, request.strategy.kind, request.cluster.world_size,
        training=request.training, batch=request.batch, rank=rank, mem_tracker=mem_tracker,
    )


def _check(strategy: StrategyKind | str, world_size: int, rank: int, training: TrainingSpec) -> StrategyKind:
    try:
        kind = StrategyKind(strategy)
    except ValueError:
        kind = None
    if kind not in SUPPORTED_STRATEGIES:
        allowed = ", ".join(k.value for k in SUPPORTED_STRATEGIES)
        raise ZeroplanError("strategy", f"{strategy!r} cannot be simulated (allowed: {allowed})")
    check_rank_of_world(world_size, rank)
    if training.precision not in SUPPORTED_PRECISIONS:
        allowed = ", ".join(p.value for p in SUPPORTED_PRECISIONS)
        raise ZeroplanError("training.precision", f"{training.precision.value!r} cannot be simulated (allowed: {allowed})")
    if training.activation_checkpointing not in SUPPORTED_CHECKPOINTING:
        allowed = ", ".join(a.value for a in SUPPORTED_CHECKPOINTING)
        raise ZeroplanError(
            "training.activation_checkpointing",
            f"{training.activation_checkpointing.value!r} cannot be simulated (allowed: {allowed})",
        )
    if training.optimizer is not Optimizer.adamw:
        raise ZeroplanError("training.optimizer", f"{training.optimizer.value!r} cannot be simulated (allowed: adamw)")
    return kind


STEP_PHASES = ("build", "materialise", "forward", "backward", "optimizer step")
"""The parts of a simulated step, in order; the progress bar advances after each."""


def _run_step(
    spec: ModelSpec, kind: StrategyKind, world_size: int, training: TrainingSpec,
    batch: BatchSpec, mem_tracker: bool, notes: list[str], bar,
) -> dict:
    def phase(name: str) -> None:
        """Mark the end of the phase before ``name`` (a 70B model's phases take seconds each)."""
        if name != STEP_PHASES[0]:
            bar.update()
        bar.set_description_str(f"simulate: {name}")

    phase("build")
    # Built on the meta device, then (FSDP) sharded there: FSDP2 chunks every parameter into
    # N pieces, which costs nothing on meta tensors and seconds on fake ones.
    with torch.device("meta"):
        model = build_model(spec)
    model.set_activation_checkpointing(training.activation_checkpointing is ActivationCheckpointing.full)
    parameter_count = sum(p.numel() for p in model.parameters())
    mixed = training.precision is Precision.bf16_mixed
    if kind.is_fsdp:
        module, mixed_precision = _fsdp2(model, device_mesh(world_size), kind, mixed)
    recorder = CollectiveRecorder()
    phase("materialise")
    # MoE routing (nonzero) has data-dependent output sizes: they become unbacked symbols.
    with private.fake_tensor_mode(data_dependent_shapes=spec.is_moe):
        # to_empty swaps every meta tensor for a fake one (FSDP2 re-pads its shards here).
        model.to_empty(device=_DEVICE)
        if not kind.is_fsdp:
            with recorder:
                module, mixed_precision = _ddp(model, mixed, notes)
        optimizer = make_adamw(list(module.parameters()))
        tracker = contextlib.nullcontext()
        if mem_tracker:
            tracker = private.fsdp_mem_tracker_class()(mod=module, optm=optimizer)
        tokens_BS = torch.randint(0, spec.vocab_size, (batch.micro_batch_size, batch.seq_len))
        autocast = (
            torch.autocast(device_type=_DEVICE, dtype=torch.bfloat16)
            if mixed and not kind.is_fsdp else contextlib.nullcontext()
        )
        saved = _SavedStorages()
        with tracker, recorder:
            phase("forward")
            recorder.phase = Phase.forward
            with autocast, saved.hooked():
                logits_BSV = module(tokens_BS)
            with saved.hooked():
                loss = next_token_loss(logits_BSV, tokens_BS)
            del logits_BSV
            phase("backward")
            recorder.phase = Phase.backward
            loss.backward()
            gradient_bytes = storage_bytes(local_tensor(p.grad) for p in module.parameters() if p.grad is not None)
            phase("optimizer step")
            recorder.phase = Phase.optimizer
            optimizer.step()
            bar.update()
        peak = private.mem_tracker_peak_bytes(tracker) if mem_tracker else None
        model_states = _model_states(module, optimizer, gradient_bytes)
    return dict(
        mixed_precision=mixed_precision, parameter_count=parameter_count,
        model_states=model_states, collectives=recorder.records, mem_tracker_peak_bytes=peak,
        saved_activation_bytes=saved.num_bytes,
    )


class _SavedStorages:
    """Distinct storages autograd saves while hooked (fake ones included), parameters excluded:
    FSDP2's unsharded parameters are nn.Parameters while a block runs."""

    def __init__(self) -> None:
        self._bytes_by_storage: dict[int, int] = {}
        # A storage saved into a graph branch the forward drops is freed while hooked, and its
        # address may pass to a storage saved after it: identities never given twice.
        self._identities = private.StorageIdentities()

    @property
    def num_bytes(self) -> int | None:
        """None when a size is symbolic (MoE routing's data-dependent shapes)."""
        sizes = self._bytes_by_storage.values()
        return sum(sizes) if all(isinstance(n, int) for n in sizes) else None

    def hooked(self) -> contextlib.AbstractContextManager:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not isinstance(tensor, nn.Parameter):
                self._bytes_by_storage[self._identities(tensor)] = tensor.untyped_storage().nbytes()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _fsdp2(model: Transformer, mesh, kind: StrategyKind, mixed: bool) -> tuple[nn.Module, str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # As the harness's FSDP2 engine: bf16 compute, fp32 gradient reduction; fp32 keeps the
    # default policy (no casts).
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    reshard = kind is StrategyKind.fsdp_full_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    described = f"fully_shard(reshard_after_forward={reshard}), MixedPrecisionPolicy(param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype})"
    return model, described


def _ddp(model: Transformer, mixed: bool, notes: list[str]) -> tuple[nn.Module, str]:
    with private.ddp_without_shape_check():
        module = nn.parallel.DistributedDataParallel(model)
    module.register_comm_hook(None, fake_group_all_reduce)
    notes.append(
        "DDP's first iteration puts every gradient in one bucket (torch skips bucketing until "
        "it has seen the backward order); the rebuilt steady-state buckets cannot be simulated "
        "because rebuilding reads tensor data. The all-reduced bytes are the same."
    )
    described = "DistributedDataParallel, torch.autocast(bfloat16)" if mixed else "DistributedDataParallel, fp32"
    return module, described


def _model_states(module: nn.Module, optimizer: torch.optim.Optimizer, gradient_bytes: int) -> ModelStateBytes:
    states = list(optimizer.state.values())
    return ModelStateBytes(
        parameter_bytes=storage_bytes(local_tensor(p) for p in module.parameters()),
        gradient_bytes=gradient_bytes,
        exp_avg_bytes=storage_bytes(local_tensor(s["exp_avg"]) for s in states),
        exp_avg_sq_bytes=storage_bytes(local_tensor(s["exp_avg_sq"]) for s in states),
        step_bytes=storage_bytes(local_tensor(s["step"]) for s in states),
    )
