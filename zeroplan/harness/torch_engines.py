"""PyTorch's own data-parallel engines behind the :class:`~zeroplan.harness.engine.Engine` interface.

* DDP: ``torch.nn.parallel.DistributedDataParallel`` (bucketed all-reduce, torch defaults).
* ZeRO-1: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (partitions whole parameters
  across ranks, then broadcasts each rank's updated parameters).
* FSDP2: ``torch.distributed.fsdp.fully_shard`` on each block, then on the root; shards every
  parameter on dim 0 (padded to a multiple of N) as DTensors.
* FSDP1: ``FullyShardedDataParallel`` wrapping each block, then the root (one FlatParameter per
  wrapped module).

Mixed precision: DDP and ZeRO-1 run under ``torch.autocast`` (fp32 parameters and gradients);
FSDP casts parameters to bf16 for compute and reduces gradients in fp32.

Gradient accumulation (K micro-batches per optimizer step), as the planner models each
(zeroplan/core/communication.py):

* DDP and ZeRO-1: the first K-1 micro-batches run under ``no_sync()``; gradients add up locally
  and the last micro-batch's backward all-reduces them (one all-reduce per step).
* FSDP2: by default every micro-batch's backward reduce-scatters its gradients and adds them to
  the sharded gradient (what torchtitan does; no unsharded gradient outlives a unit's
  backward). With ``keep_unsharded_grads_on_accum``, ``set_requires_gradient_sync(False)`` for
  the first K-1: unsharded gradients accumulate and are reduce-scattered once.
* FSDP1: the same two modes; the second is ``no_sync()``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.harness.engine import (
    MicroBatch, ModelStateTensors, TorchOptimizerSteps, accumulated_loss, autocast_to, device_type, make_optimizer,
    optimizer_class_and_kwargs, optimizer_state_tensors,
)
from zeroplan.harness.model import Block, Transformer, next_token_loss
from zeroplan.specs import Optimizer


class _Base(TorchOptimizerSteps):
    """Shared step logic: the wrapped module computes the loss, the optimizer steps."""

    compute_dtype: torch.dtype = torch.float32

    def forward_backward(
        self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, micro: MicroBatch = MicroBatch()
    ) -> torch.Tensor:
        with self._accumulating(micro):
            with autocast_to(self.compute_dtype):
                logits = self.module(tokens_BS)
            loss = next_token_loss(logits, targets_BS)
            # Backward needs only what the loss saved; holding the logits here would keep s*b*V
            # elements alive through backward that neither the reference engine nor the planner keeps.
            del logits
            accumulated_loss(loss, micro).backward()
        return loss.detach()

    def _accumulating(self, micro: MicroBatch) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's forward and backward (gradient synchronisation)."""
        return contextlib.nullcontext()


class DdpEngine(_Base):
    def __init__(self, model: Transformer, dtype: torch.dtype, optimizer: Optimizer, zero1: bool = False) -> None:
        self.compute_dtype = dtype
        # One rank has no one to all-reduce with: plain training, unwrapped (no bucket copies),
        # which is what the planner predicts at world size 1 (docs/memory-model.md, "One GPU").
        self.wrapped = dist.get_world_size() > 1
        self.module = nn.parallel.DistributedDataParallel(model) if self.wrapped else model
        if self.wrapped and dist.get_backend() == "fake":
            self.module.register_comm_hook(None, fake_group_all_reduce)
        self.inner = model
        if zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer_class, kwargs = optimizer_class_and_kwargs(optimizer)
            self.optimizer = ZeroRedundancyOptimizer(
                list(model.parameters()), optimizer_class=optimizer_class, **kwargs,
            )
        else:
            self.optimizer = make_optimizer(optimizer, list(model.parameters()))

    def _accumulating(self, micro: MicroBatch) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if micro.is_last or not self.wrapped else self.module.no_sync()

    def model_state_tensors(self) -> ModelStateTensors:
        states = super().model_state_tensors()
        # ZeroRedundancyOptimizer keeps its shard's states on an inner optimizer.
        inner = getattr(self.optimizer, "optim", None)
        if inner is not None:
            states.optimizer_states = optimizer_state_tensors(inner)
        return states

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.inner.named_parameters()}


class Fsdp2Engine(_Base):
    def __init__(
        self, model: Transformer, dtype: torch.dtype, optimizer: Optimizer, reshard_after_forward: bool,
        keep_unsharded_grads_on_accum: bool = False,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        self.module = model
        self.optimizer = make_optimizer(optimizer, list(model.parameters()))
        self.keep_unsharded = keep_unsharded_grads_on_accum

    def _accumulating(self, micro: MicroBatch) -> contextlib.AbstractContextManager:
        if self.keep_unsharded:
            self.module.set_requires_gradient_sync(micro.is_last)
        return contextlib.nullcontext()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().detach().clone() for name, p in self.module.named_parameters()}


class Fsdp1Engine(_Base):
    def __init__(
        self, model: Transformer, dtype: torch.dtype, optimizer: Optimizer, full_shard: bool,
        keep_unsharded_grads_on_accum: bool = False,
    ) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if full_shard else ShardingStrategy.SHARD_GRAD_OP
        mixed = None
        if dtype != torch.float32:
            mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.module = FullyShardedDataParallel(
            model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=mixed, device_id=device,
        )
        self.optimizer = make_optimizer(optimizer, list(self.module.parameters()))
        self.keep_unsharded = keep_unsharded_grads_on_accum

    def _accumulating(self, micro: MicroBatch) -> contextlib.AbstractContextManager:
        if self.keep_unsharded and not micro.is_last:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(self.module, writeback=False):
            inner = self.module.module
            return {
                _clean(name): p.detach().clone() for name, p in inner.named_parameters()
            }


def fake_group_all_reduce(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations by identity
    """DDP's all-reduce on a fake process group (one process acting as rank N of many: the
    simulator, and benchmarks/gpu_measure.py on a GPU). The fake group's C++ work carries no
    value for DDP to read back, so DDP's built-in hook fails; this one does what it does (divide
    the bucket by N in place, all-reduce it) with the all-reduce issued from Python, where the
    collective recorders see it, and hands the bucket back."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _clean(name: str) -> str:
    """FSDP1's parameter names carry its wrapper prefixes; strip them to the model's names."""
    return name.replace("_fsdp_wrapped_module.", "")
