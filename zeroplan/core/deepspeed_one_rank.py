"""DeepSpeed ZeRO-3 on one rank (a partition world of 1): the coordinator fetches every module as
it does on N ranks, but nothing is gathered, so no gathered buffer is ever allocated, on the
allgather stream or any other.

DeepSpeed 0.14.2 runtime/zero/partition_parameters.py:1159-1167 (all_gather_coalesced): with
``self.num_partitions == 1`` it returns ``_no_gather_coalesced(params)`` (:769-779), whose
NoGatherHandle / NoGatherCoalescedHandle (:44-62, :64-78) set ``param.data =
param.ds_tensor.data.to(device, non_blocking=True).view(param.ds_shape)``: the partition is the
whole tensor, already on the device (not so under offload_param: gathers_nothing), so ``.to``
returns it and ``.view`` makes no storage. The
release points ``param.data`` back at an empty tensor; the partition stays (counted with the
parameters). 0.19.8 keeps the same branch (zeroplan.core.deepspeed_coordinator.loss_gathered_bytes).

What a module's backward still allocates is autograd's: each parameter's gradient, full size in
the model dtype, until its AccumulateGrad hook (stage3.py:1221-1240 at v0.14.2,
__add_grad_to_ipg_bucket) copies it into the resident ipg bucket and points ``param.grad`` at
the bucket's slice, freeing autograd's tensor. Those gradients are made on the compute stream.

Measured on DeepSpeed 0.14.2's own engine with one gloo rank
(benchmarks/deepspeed_zero3_fp16_streams.py --world 1 --layers 4 --checkpointing --micro-batch 4):
nothing is allocated in the coordinator's fetches (no allgather-stream allocation at all), where
the planner kept its replay's gathered parameters on that stream; the reduce stream holds the
bucket flushes' flat copies, the epilogue's included (deepspeed_reduce_stream).

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_coordinator import models_deepspeed_gathers
from zeroplan.core.layout import gradient_wire_bytes
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest


# partition_parameters.py:1166-1167 and :54-55 at v0.14.2 (0.13.3 :1163 and :54-55 the same): the
# handle's ``.to(device)`` copies a partition that is not on the device, so with the parameters
# offloaded (offload_param) each fetch still makes a device copy: gathered as on N ranks.
def gathers_nothing(request: PlanRequest) -> bool:
    """Whether the request's ZeRO-3 gathers are DeepSpeed's plain ones over a partition world of
    one rank, its partitions on the device: no gathered buffer exists."""
    return (models_deepspeed_gathers(request) and request.shard_group_size == 1
            and not request.strategy.kind.offloads_parameters)


def _module_gradient_bytes(request: PlanRequest, blocks_only: bool) -> list[int]:
    """Each module's trainable gradients together (its weight and bias: one backward node makes
    both before their hooks run), in the model dtype; a module is a tensor name's dotted prefix
    within its unit."""
    wire = gradient_wire_bytes(request)
    out: list[int] = []
    for unit in rank_trainable_units(request):
        if blocks_only and not unit.name.startswith("block."):
            continue
        modules: dict[str, int] = {}
        for tensor in unit.tensors:
            if tensor.trainable:
                prefix = tensor.name.rsplit(".", 1)[0]
                modules[prefix] = modules.get(prefix, 0) + tensor.numel * wire
        out += modules.values()
    return out


def largest_module_gradient_bytes(request: PlanRequest, blocks_only: bool = False) -> int:
    """The most autograd's gradients of one module's backward hold before their hooks copy them
    into the bucket: every module's, or (``blocks_only``) the blocks' modules' (0 where none)."""
    return max(_module_gradient_bytes(request, blocks_only), default=0)
