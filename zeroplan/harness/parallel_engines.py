"""Tensor (and sequence) parallelism and pipeline parallelism, composed with a data-parallel
engine, built from PyTorch's own parallel APIs on the harness's model.

* Tensor parallelism: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput over the "tp"
  dimension of a 2-D DeviceMesh ("dp", "tp"), the plan torchtitan applies to its Llama
  (torchtitan 0.3.0 models/llama3/infra/parallelize.py, apply_tp), then FSDP2 ``fully_shard``
  of each block and the root over the "dp" dimension (apply_fsdp there). The output
  projection keeps its logits sharded over the vocabulary and the loss runs under
  ``loss_parallel()`` (torchtitan's default, loss_parallel unless disabled).
* Pipeline parallelism: the model cut into ``pp`` stages of consecutive blocks (the embedding
  with the first, the head with the last, the blocks split evenly as the planner's reference
  layout does), each run by ``torch.distributed.pipelining.PipelineStage`` under
  ScheduleGPipe or Schedule1F1B over the "pp" dimension of a 2-D mesh ("pp", "dp"); each
  stage wrapped in DDP or FSDP2 over "dp" (torchtitan 0.3.0 distributed/pipeline_parallel.py
  pipeline_llm builds its stages the same way: a deep copy with the other stages' modules
  dropped).

The mesh puts tp innermost and pp outermost (torchtitan 0.3.0 distributed/parallel_dims.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.harness.engine import (
    MicroBatch, ModelStateTensors, TorchOptimizerSteps, accumulated_loss, autocast_to, device_type,
    local_tensor as _local, make_optimizer, module_state_tensors,
)
from zeroplan.harness.model import Transformer, next_token_loss
from zeroplan.specs import Optimizer, StrategyKind
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule


def mesh_for(parallel: ParallelSpec):
    """The run's DeviceMesh: ("dp", "tp") for tensor parallelism, ("pp", "dp") for a pipeline."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if parallel.pp > 1:
        return init_device_mesh(device_type(), (parallel.pp, world // parallel.pp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh(device_type(), (world // parallel.tp, parallel.tp), mesh_dim_names=("dp", "tp"))


def group_names(mesh) -> dict[tuple[int, ...], str]:
    """Global ranks of this rank's group along each mesh dimension -> the dimension's name, and
    the whole world -> 'world' (CommRecorder labels each collective with it)."""
    names = {tuple(range(dist.get_world_size())): "world"}
    for name in mesh.mesh_dim_names:
        names[tuple(dist.get_process_group_ranks(mesh[name].get_group()))] = name
    return names


def coordinates(mesh) -> dict[str, int]:
    return {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names}


def apply_tensor_parallel(model: Transformer, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan 0.3.0 apply_tp on the harness's module names: the token table row-wise (split
    over the vocabulary), q, k, v and the MLP's first matrices column-wise, o and the MLP's last
    matrix row-wise, the output projection column-wise with its logits left sharded over the
    vocabulary for loss_parallel. With sequence parallelism the norms run on sequence shards
    (SequenceParallel) and each block's attention and MLP gather their input (PrepareModuleInput)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    residual = Shard(1) if sequence_parallel else Replicate()
    root = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "head.proj": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root["head.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    for block in model.blocks:
        mlp = block.mlp
        first, last = (("fc1",), "fc2") if hasattr(mlp, "fc1") else (("gate", "up"), "down")
        plan = {
            **{f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            "attn.o": RowwiseParallel(output_layouts=residual),
            **{f"mlp.{name}": ColwiseParallel() for name in first},
            f"mlp.{last}": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan.update({
                "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)


def _fully_shard(module: nn.Module, blocks, dp_mesh, dtype: torch.dtype, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """A loss_parallel loss is a replicated DTensor: its local value is the loss."""
    return _local(loss).detach()


class TensorParallelFsdp(TorchOptimizerSteps):
    """Tensor (and sequence) parallelism over "tp", FSDP2 over "dp"."""

    runs_whole_step = False

    def __init__(self, model: Transformer, mesh, parallel: ParallelSpec, dtype: torch.dtype, optimizer: Optimizer,
                 reshard_after_forward: bool, keep_unsharded_grads_on_accum: bool = False) -> None:
        self.mesh = mesh
        apply_tensor_parallel(model, mesh["tp"], parallel.sequence_parallel)
        _fully_shard(model, model.blocks, mesh["dp"], dtype, reshard_after_forward)
        self.module = model
        self.optimizer = make_optimizer(optimizer, list(model.parameters()))
        self.keep_unsharded = keep_unsharded_grads_on_accum

    def forward_backward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor,
                         micro: MicroBatch = MicroBatch()) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        if self.keep_unsharded:
            self.module.set_requires_gradient_sync(micro.is_last)
        # torch 2.13 distributed/tensor/parallel/loss.py: the cross-entropy of vocabulary-sharded
        # logits, and its backward, must both run inside loss_parallel().
        with loss_parallel():
            logits = self.module(tokens_BS)
            loss = next_token_loss(logits, targets_BS)
            del logits
            accumulated_loss(loss, micro).backward()
        return _scalar(loss)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().detach().clone() for name, p in self.module.named_parameters()}

    def shared_loss(self, loss: float) -> float:
        return loss


def even_block_split(num_layers: int, stages: int) -> list[range]:
    """Blocks per stage, the remainder to the first stages: the planner's reference split
    (Megatron-LM get_num_layers_to_build with L divisible by the stages)."""
    base, extra = divmod(num_layers, stages)
    ranges, first = [], 0
    for index in range(stages):
        count = base + (1 if index < extra else 0)
        ranges.append(range(first, first + count))
        first += count
    return ranges


class StageModule(nn.Module):
    """One pipeline stage of the harness's Transformer: its blocks (keyed by their index in the
    whole model, so parameter names stay those of the full model), with the embedding on the
    first stage and the head on the last."""

    def __init__(self, model: Transformer, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        if model.head.proj is None and (first != last):
            raise ValueError("tied embeddings cannot be split across pipeline stages")
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x, None)
        return x


_SCHEDULES = {PipelineSchedule.gpipe: "ScheduleGPipe", PipelineSchedule.one_f_one_b: "Schedule1F1B"}


class PipelineEngine(TorchOptimizerSteps):
    """One pipeline stage per rank under torch's schedule, DDP or FSDP2 over "dp"; the step's
    micro-batches all go through the schedule in one call (``runs_whole_step``)."""

    runs_whole_step = True
    # torch 2.13 distributed/_tools/mem_tracker.py refuses a module's second forward inside one
    # tracking window unless reset_mod_stats runs in between ("does not support memory tracking
    # for multiple iterative calls"), and the schedule runs every micro-batch's forward inside
    # one call: the CPU allocator trace is this engine's peak.
    no_tracker_reason = "MemTracker cannot follow a pipeline schedule's several forwards per step (torch 2.13)"

    def __init__(self, model: Transformer, mesh, parallel: ParallelSpec, strategy: StrategyKind, dtype: torch.dtype,
                 optimizer: Optimizer, microbatches: int, micro_batch_size: int, seq_len: int) -> None:
        from torch.distributed import pipelining

        self.mesh = mesh
        pp_rank, pp = mesh["pp"].get_local_rank(), parallel.pp
        splits = even_block_split(model.spec.num_layers, pp)
        stages = [StageModule(model, blocks, index == 0, index == pp - 1) for index, blocks in enumerate(splits)]
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        stage = stages[pp_rank]
        device = torch.device(device_type(), torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.compute_dtype = dtype
        self.inner = stage
        boundary = self._boundary_tensors(stages, micro_batch_size, seq_len, strategy)
        if strategy is StrategyKind.ddp:
            self.module = nn.parallel.DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
        else:
            _fully_shard(stage, list(stage.blocks.values()), mesh["dp"], dtype,
                         reshard_after_forward=strategy is StrategyKind.fsdp_full_shard)
            self.module = stage
        self.optimizer = make_optimizer(optimizer, list(stage.parameters()))
        # Shapes given up front (torch 2.13 pipelining/stage.py InferenceMode.STATIC): the
        # stage then skips the first step's metadata inference, whose extra backward through a
        # DDP module fills DDP's bucket-rebuild list twice and trips reducer.cpp's
        # "rebuilt parameter indices size is not same as original model parameters size".
        self.stage = pipelining.PipelineStage(
            self.module, pp_rank, pp, device, input_args=boundary[pp_rank], output_args=boundary[pp_rank + 1],
            # The gradients that cross each boundary have the activations' shapes; the tokens have none.
            input_grads=None if self.first else boundary[pp_rank], output_grads=None if self.last else boundary[pp_rank + 1],
            group=mesh["pp"].get_group(),
        )
        schedule_class = getattr(pipelining, _SCHEDULES[parallel.pp_schedule])
        # scale_grads=True (torch 2.13 pipelining/schedules.py): the schedule divides the summed
        # gradients by the micro-batch count, so the loss is each micro-batch's mean, unscaled,
        # and the gradient is that of the step's mean loss, as the other engines accumulate it.
        self.schedule = schedule_class(self.stage, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=True)
        self.microbatches = microbatches

    def _boundary_tensors(self, stages: list[StageModule], micro_batch_size: int, seq_len: int,
                          strategy: StrategyKind) -> list[torch.Tensor]:
        """What crosses each stage boundary for one micro-batch (tokens in, each stage's output),
        from one forward of the still unwrapped stages on zero tokens, in the dtype the run
        computes in (FSDP2's bf16 parameters, or DDP's autocast): shapes only, no collective."""
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        tensors = [tokens]
        autocast = autocast_to(self.compute_dtype) if strategy is StrategyKind.ddp else contextlib.nullcontext()
        with torch.no_grad(), autocast:
            x = tokens
            for stage in stages:
                x = stage(x)
                # FSDP2 computes in its param_dtype: what crosses the boundary has that dtype.
                dtype = self.compute_dtype if strategy is not StrategyKind.ddp and x.is_floating_point() else x.dtype
                tensors.append(torch.empty_like(x, dtype=dtype))
        return tensors

    def _loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits_BSV, targets_BS)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32 or not isinstance(self.module, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return autocast_to(self.compute_dtype)

    def forward_backward_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Every micro-batch of the step through the schedule (it splits the concatenated batch
        into ``microbatches`` chunks along dim 0); the last stage's losses, [] elsewhere."""
        tokens = torch.cat([t for t, _ in micro_batches])
        targets = torch.cat([t for _, t in micro_batches])
        losses: list[torch.Tensor] = []
        with self._autocast():
            if self.first and self.last:
                self.schedule.step(tokens, target=targets, losses=losses)
            elif self.first:
                self.schedule.step(tokens)
            elif self.last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
        return [loss.detach() for loss in losses]

    def shared_loss(self, loss: float) -> float:
        """The last stage's mean loss, on every rank of its pipeline (one broadcast over "pp",
        made after the step's recording window)."""
        group = self.mesh["pp"].get_group()
        value = torch.tensor([loss if self.last else 0.0], dtype=torch.float64)
        dist.broadcast(value, src=dist.get_process_group_ranks(group)[-1], group=group)
        return float(value.item())

    def model_state_tensors(self) -> ModelStateTensors:
        return module_state_tensors(self.inner, self.optimizer)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's full parameters (a collective over "dp" under FSDP2)."""
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in self.inner.named_parameters()}


def implementation_name(strategy: StrategyKind, parallel: ParallelSpec) -> str:
    from zeroplan.harness.engines_table import parallel_implementation

    return parallel_implementation(strategy, parallel.tp, parallel.sequence_parallel, parallel.pp,
                                   parallel.pp_schedule.value)


def build_parallel_engine(model: Transformer, mesh, parallel: ParallelSpec, strategy: StrategyKind,
                          dtype: torch.dtype, optimizer: Optimizer, keep_unsharded_grads_on_accum: bool,
                          microbatches: int, micro_batch_size: int, seq_len: int):
    if parallel.pp > 1:
        return PipelineEngine(model, mesh, parallel, strategy, dtype, optimizer, microbatches, micro_batch_size, seq_len)
    return TensorParallelFsdp(model, mesh, parallel, dtype, optimizer,
                              reshard_after_forward=strategy is StrategyKind.fsdp_full_shard,
                              keep_unsharded_grads_on_accum=keep_unsharded_grads_on_accum)

