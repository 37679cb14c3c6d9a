"""Collectives issued per optimizer step by the data-parallel strategy (and, through
zeroplan.core.parallel.collectives, by tensor, context and pipeline parallelism), and the bytes
each rank sends under a ring (zeroplan.core.collective).

The ZeRO paper counts *volume* (sec. 7: 2*Psi for DDP, ZeRO-1 and ZeRO-2, 3*Psi for ZeRO-3);
a ring collective of an S-byte buffer over N ranks makes each rank *send* (N-1)/N*S bytes
for all-gather and reduce-scatter and 2*(N-1)/N*S for all-reduce (Patarasuk & Yuan 2009;
NCCL's docs/performance "algorithm bandwidth vs bus bandwidth"). Both are kept apart here.
"""

from __future__ import annotations

from collections import Counter

from zeroplan.core import deepspeed_buckets
from zeroplan.core.deepspeed_stage0 import allreduce_bucket_bytes, runs_deepspeed_stage0
from zeroplan.core.deepspeed_coordinator import backward_gather_bytes, forward_gather_bytes, models_deepspeed_gathers, replays_gathers
from zeroplan.core.collective import Collective, CollectiveOp, Phase, collective_of_sizes, make_collective, ring_sent_bytes
from zeroplan.core.layout import ElementBytes, element_bytes, gradient_wire_bytes
from zeroplan.core.memo import batch_keyed
from zeroplan.core.model_states import padded_unit_elements_of, unit_gather_bytes
from zeroplan.core.network import strided_ranks_per_node
from zeroplan.core.parallel.collectives import model_parallel_collectives
from zeroplan.core.parallel.expert import split_expert_collectives
from zeroplan.core.parallel.pipeline import pipeline_defers_fsdp_reduction
from zeroplan.core.parallel.units import rank_parameter_units, rank_trainable_units
from zeroplan.core.profiles import fsdp1_root_stays_gathered
from zeroplan.core.zero3_groups import hpz_parameter_collectives, mics_replica_all_reduce
from zeroplan.core.zeropp import qgz_collectives, qgz_spans_nodes
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind, ZeroGradientReduce
from zeroplan.specs.training import Precision
from zeroplan.units import ceil_div

__all__ = [
    "Collective", "CollectiveOp", "Phase", "collectives", "data_parallel_collectives", "ddp_bucket_sizes",
    "make_collective", "ring_sent_bytes",
]

# torch/nn/parallel/distributed.py: the first bucket is capped at 1 MiB
# (dist._DEFAULT_FIRST_BUCKET_BYTES) so communication starts early; the rest at bucket_cap_mb.
DDP_FIRST_BUCKET_BYTES = 2**20


def ddp_bucket_sizes(total_bytes: int, cap_bytes: int) -> list[int]:
    """DDP's gradient buckets: a 1 MiB first bucket, then buckets of the cap (approximating
    parameter boundaries, which DDP never splits)."""
    first = min(total_bytes, DDP_FIRST_BUCKET_BYTES)
    # Full buckets of the cap, then what is left (a 70B model's gradients fill ~11,000).
    full, left = divmod(total_bytes - first, cap_bytes)
    return [first] + [cap_bytes] * full + ([left] if left else [])


def ddp_bucket_counts(total_bytes: int, cap_bytes: int) -> Counter[int]:
    """ddp_bucket_sizes counted (size: buckets, in the order the buckets first meet each size),
    without listing the buckets (a 405B model's fp32 gradients fill ~62,000)."""
    first = min(total_bytes, DDP_FIRST_BUCKET_BYTES)
    full, left = divmod(total_bytes - first, cap_bytes)
    counts: Counter[int] = Counter()
    for size, buckets in ((first, 1), (cap_bytes, full), (left, 1 if left else 0)):
        if buckets:
            counts[size] += buckets
    return counts


def _gradient_buffers(request: PlanRequest, num_shards: int, bytes_per_element: int) -> list[int]:
    """The padded unsharded gradient buffer of every unit that has trainable parameters, in bytes."""
    return [elements * bytes_per_element for elements in padded_unit_elements_of(request, num_shards) if elements]


def _wire_bytes(request: PlanRequest) -> ElementBytes:
    return element_bytes(request.training.precision, request.convention)


# deepspeed/runtime/zero/stage_1_and_2.py step(): check_overflow -> has_overflow all-reduces one
# uint8 flag when check_grad_overflow (engine.py _configure_zero_optimizer: bf16 and fp16 yes,
# fp32 no); scaled_global_norm -> get_grad_norm_direct (or, offloaded,
# complete_grad_norm_calculation_for_cpu_offload) all-reduces one fp32 norm (compute_grad_norm=True).
OVERFLOW_FLAG_BYTES = 1
GRADIENT_NORM_BYTES = 4
# deepspeed 0.19.8 runtime/zero/stage3.py step -> _get_norm_groups -> get_grad_norm_direct:
# the per-tensor norms in get_norm_dtype() (zero/utils.py: fp64 where the device has it, as CUDA
# and the CPU do), summed, one dist.all_reduce (line 2469); _overflow_check_and_loss_scale_update
# checks overflow (a uint8 all-reduce, has_overflow line 3027) only under fp16. With the
# optimizer offloaded, complete_grad_norm_calculation_for_cpu_offload all-reduces one
# get_accelerator().FloatTensor (fp32, line 1989).
STAGE3_GRADIENT_NORM_BYTES = 8


def deepspeed_stage3_step_scalars(request: PlanRequest, group: int, spans_nodes: bool, per_node: int | None) -> list[Collective]:
    """The scalar all-reduces of DeepSpeed's stage 3 step."""
    norm = GRADIENT_NORM_BYTES if request.strategy.kind.offloads_optimizer else STAGE3_GRADIENT_NORM_BYTES
    result = [make_collective(CollectiveOp.all_reduce, Phase.step, "gradient norm", [norm],
                              group, 1, spans_nodes, norm, per_node)]
    if request.training.precision is Precision.fp16_mixed:
        result.append(make_collective(CollectiveOp.all_reduce, Phase.step, "overflow flag", [OVERFLOW_FLAG_BYTES],
                                      group, 1, spans_nodes, OVERFLOW_FLAG_BYTES, per_node))
    return result


def deepspeed_zero12_collectives(
    request: PlanRequest, group: int, reduce_per_step: int, spans_nodes: bool, per_node: int | None = None,
) -> list[Collective]:
    """DeepSpeed ZeRO-1/2 (and stage 2 with offload) with its default config: all-reduced
    gradient buckets, one all-gather of the flat group, two scalar all-reduces in the step.

    Stage 1 reduces at the accumulation boundary in parameter order (engine.py
    allreduce_gradients -> reduce_gradients); stage 2 in its backward hooks, in the order the
    gradients arrive (taken as reverse registration order), every micro-batch."""
    eb = _wire_bytes(request)
    gradient_bytes = gradient_wire_bytes(request)
    numels = tuple(t.numel for unit in rank_trainable_units(request) for t in unit.tensors)
    grad_elements = deepspeed_buckets.shared_gradient_all_reduce_elements(
        numels, request.strategy.kind.zero_stage == 2, request.strategy.zero_bucket_elements, group)
    flat = deepspeed_buckets.flat_group_elements(sum(numels), group)
    result = [
        make_collective(CollectiveOp.all_reduce, Phase.backward, "gradients", [n * gradient_bytes for n in grad_elements],
                    group, reduce_per_step, spans_nodes, gradient_bytes, per_node),
        make_collective(CollectiveOp.all_gather, Phase.step, "parameters", [flat * eb.compute_parameter],
                    group, 1, spans_nodes, eb.compute_parameter, per_node),
    ]
    if request.training.precision is not Precision.fp32:
        result.append(make_collective(CollectiveOp.all_reduce, Phase.step, "overflow flag", [OVERFLOW_FLAG_BYTES],
                                  group, 1, spans_nodes, OVERFLOW_FLAG_BYTES, per_node))
    result.append(make_collective(CollectiveOp.all_reduce, Phase.step, "gradient norm", [GRADIENT_NORM_BYTES],
                              group, 1, spans_nodes, GRADIENT_NORM_BYTES, per_node))
    return result


# megatron-core 0.16.1 distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup: the
# schedules run every micro-batch but the last under DDP's no_sync, so the gradient buffer
# (one bucket without overlap_grad_reduce) is reduced once a step, in its own dtype (fp32 under
# bf16: grad_reduce_in_fp32): all-reduced (start_grad_sync), or reduce-scattered in place under
# the distributed optimizer, which then all-gathers the updated 16-bit parameter buffer
# (start_param_sync; in the step without overlap_param_gather).
def megatron_collectives(request: PlanRequest, group: int, spans_nodes: bool, per_node: int | None) -> list[Collective]:
    """megatron-core's data-parallel collectives of one step."""
    from zeroplan.core.megatron import grad_buffer_element_bytes, grad_buffer_elements

    buffer = grad_buffer_elements(request)
    grad = grad_buffer_element_bytes(request.training.precision)
    param = request.training.precision.compute_bytes
    if not request.strategy.kind.zero_stage:
        return [make_collective(CollectiveOp.all_reduce, Phase.backward, "gradients", [buffer * grad], group, 1,
                                spans_nodes, grad, per_node)]
    return [
        make_collective(CollectiveOp.reduce_scatter, Phase.backward, "gradients", [buffer * grad], group, 1,
                        spans_nodes, grad, per_node),
        make_collective(CollectiveOp.all_gather, Phase.step, "parameters", [buffer * param], group, 1,
                        spans_nodes, param, per_node),
    ]


def collectives(request: PlanRequest) -> list[Collective]:
    """Every collective of one optimizer step of ``request``'s rank: the data-parallel
    strategy's over the ranks that hold the same parameters, then those tensor, context and
    pipeline parallelism add (zeroplan.core.parallel.collectives)."""
    return list(_scheduled_data_parallel_collectives(request)) + model_parallel_collectives(request)


# The data-parallel collectives in their phases read of the batch its accumulation alone: the
# requests of one strategy at different micro-batches and sequences share them (the same
# objects, whose prices core.algorithms.collective_cost keeps). The whole training keys them
# (DeepSpeed's ZeRO-3 gathers read the checkpointing policy: deepspeed_coordinator.replays_gathers).
@batch_keyed("grad_accum_steps")
def _scheduled_data_parallel_collectives(request: PlanRequest) -> tuple[Collective, ...]:
    return tuple(scheduled(request, c) for c in data_parallel_collectives(request))


# When a data-parallel collective runs is the stack's choice (zeroplan.core.stack_time):
# Megatron-LM without --overlap-grad-reduce reduces the gradients after the backward
# (megatron/core/distributed/distributed_data_parallel_config.py overlap_grad_reduce = False;
# finish_grad_sync then launches every bucket), and with --overlap-param-gather dispatches the
# distributed optimizer's parameter all-gather bucket by bucket in the next forward's pre-hooks
# (param_and_grad_buffer.py start_param_sync) instead of after the step.
# DeepSpeed's ZeRO-1/2 (what zero1, zero2 and zero2-offload run under --framework zeroplan and
# hf) reduce each full bucket from the gradient hooks on the reduction side stream only with
# zero_optimization.overlap_comm (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py average_tensor:
# ``stream = get_accelerator().current_stream()`` otherwise, so the backward waits for every
# bucket's reduction), and overlap_comm is false below stage 3 unless set (runtime/zero/config.py
# overlap_comm_valid; StrategySpec.deepspeed_overlap_comm).
def overlaps_grad_reduce(request: PlanRequest) -> bool:
    """PerformanceAssumptions.overlap_grad_reduce, or where unset the stack's default."""
    given = request.performance.overlap_grad_reduce
    if given is not None:
        return given
    if runs_deepspeed_stage_1_2(request):
        from zeroplan.core.deepspeed_accumulation import overlap_comm

        return overlap_comm(request)
    from zeroplan.core.stack_time import overlaps_grad_reduce as stack_default

    return stack_default(request.training.framework, request.strategy.kind)


def runs_deepspeed_stage_1_2(request: PlanRequest) -> bool:
    """Whether the request's data parallelism is DeepSpeed's ZeRO stage 1 or 2 (the reference
    transformer's and the hf stack's zero1, zero2, zero2-offload through DeepSpeed's reduce
    bucket; the reference per-unit ZeRO and torch's ZeroRedundancyOptimizer under DDP reduce
    from their backward hooks as DDP does)."""
    return (request.training.framework in (Framework.zeroplan, Framework.hf)
            and request.strategy.kind in (StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero2_offload)
            and request.strategy.zero_gradient_reduce is ZeroGradientReduce.bucket)


def scheduled(request: PlanRequest, collective: Collective) -> Collective:
    """``collective`` in the phase the request's overlap assumptions put it
    (PerformanceAssumptions.overlap_grad_reduce and overlap_param_gather)."""
    performance = request.performance
    if (collective.phase is Phase.backward and collective.what.startswith("gradient")
            and not overlaps_grad_reduce(request)):
        return collective.model_copy(update={"phase": Phase.step})
    if (performance.overlap_param_gather and collective.phase is Phase.step and collective.op is CollectiveOp.all_gather
            and collective.what == "parameters"):
        return collective.model_copy(update={"phase": Phase.forward})
    return collective


def data_parallel_collectives(request: PlanRequest) -> list[Collective]:
    """The data-parallel strategy's collectives. Its group is the ranks holding the same
    parameters (PlanRequest.state_group_size), tp ranks apart in the mesh (tp innermost)."""
    return list(_data_parallel_collectives(request))


# The data-parallel collectives move model states and buffers, which do not change with the
# micro-batch, the sequence or the checkpointing policy, only their count with the accumulation:
# the requests of one strategy at different micro-batches (fit, the largest micro-batch search)
# and policies (the plan search) share them.
@batch_keyed("grad_accum_steps", training_but=("activation_checkpointing",))
def _data_parallel_collectives(request: PlanRequest) -> tuple[Collective, ...]:
    return tuple(_uncached_data_parallel_collectives(request))


def _uncached_data_parallel_collectives(request: PlanRequest) -> list[Collective]:
    kind = request.strategy.kind
    world = request.state_group_size
    accum = request.batch.grad_accum_steps
    eb = _wire_bytes(request)
    tp = request.parallel.tp
    multi_node = world * tp > request.cluster.gpus_per_node
    # Members of the group on one node: a node's GPUs divided among its tensor-parallel groups.
    per_node = None if tp == 1 else max(1, min(world, request.cluster.gpus_per_node // tp))
    if world == 1:
        return []
    if request.training.framework is Framework.megatron:
        return megatron_collectives(request, world, multi_node, per_node)
    if runs_deepspeed_stage0(request):
        # DeepSpeed's stage 0: at the boundary's backward end, one all-reduce per flat bucket
        # of the model-dtype gradients (zeroplan.core.deepspeed_stage0.allreduce_bucket_bytes).
        e = element_bytes(request.training.precision, request.convention).compute_parameter
        return [make_collective(CollectiveOp.all_reduce, Phase.backward, "gradients", allreduce_bucket_bytes(request),
                                world, 1, multi_node, e, per_node)]
    if kind is StrategyKind.ddp or request.strategy.zero_gradient_reduce is ZeroGradientReduce.ddp_buckets:
        total = sum(u.numel for u in rank_trainable_units(request)) * eb.gradient
        buckets = ddp_bucket_counts(total, request.strategy.ddp_bucket_cap_bytes)
        # Accumulation runs under no_sync(): one all-reduce per optimizer step.
        result = [collective_of_sizes(CollectiveOp.all_reduce, Phase.backward, "gradients", buckets, world, 1, multi_node,
                                      eb.gradient, per_node)]
        if kind is StrategyKind.zero1:
            # torch/distributed/optim/zero_redundancy_optimizer.py, step -> _sync_params ->
            # _broadcast_params_from_rank: each rank broadcasts the parameters it owns, one
            # dist.broadcast per tensor (parameters_as_bucket_view=False, the default).
            tensors = [t.numel * eb.compute_parameter for unit in rank_trainable_units(request) for t in unit.tensors]
            result.append(make_collective(CollectiveOp.broadcast, Phase.step, "parameters", tensors, world, 1, multi_node, eb.compute_parameter, per_node))
        return result

    group = request.shard_group_size
    group_spans_nodes = group * tp > request.cluster.gpus_per_node
    # Parameters are gathered in the compute dtype; gradients travel in gradient_wire_bytes.
    gradient_bytes = gradient_wire_bytes(request)
    deferred = pipeline_defers_fsdp_reduction(request.parallel, kind.is_fsdp)
    reduce_per_step = 1 if (kind is StrategyKind.zero1 or request.strategy.keep_unsharded_grads_on_accum or deferred) else accum
    if kind.zero_stage in (1, 2) and request.strategy.zero_gradient_reduce is ZeroGradientReduce.bucket:
        return deepspeed_zero12_collectives(request, group, reduce_per_step, group_spans_nodes, per_node)
    grads = _gradient_buffers(request, group, gradient_bytes)
    # Under torchao's float8 all-gather these are already the cast sizes (the Float8Linear
    # weights at one byte: model_states.unit_gather_bytes).
    params = unit_gather_bytes(request, group, eb.compute_parameter)
    result = []
    if request.training.float8_all_gather and kind.is_fsdp:
        # precompute_float8_dynamic_scale_for_fsdp's amax all-reduce (zeroplan.core.float8_time).
        from zeroplan.core.float8_time import float8_scale_all_reduce

        result.append(float8_scale_all_reduce(request, group, group_spans_nodes, per_node))
    if kind.uses_hpz:
        backward = params[1:] if request.model.tied_embeddings else params
        result += hpz_parameter_collectives(request, params, backward, accum, group_spans_nodes, per_node)
    elif request.strategy.kind.zero_stage == 3:
        # Under a pipeline the units stay gathered after each backward (pipeline_defers_fsdp_reduction):
        # only the first forward gathers; full shard's forward reshards, so each backward gathers again.
        gathers_forward = 1 if deferred else accum
        backward = params
        if replays_gathers(request):
            # DeepSpeed's coordinator: persistent parameters are never gathered per step, what a
            # prefetch scan or the reuse distance keeps is not gathered again, and a recomputed
            # block is gathered for its recomputation (zeroplan.core.deepspeed_coordinator; every
            # micro-batch counted as the one after an optimizer step, whose prefetch runs furthest).
            params = [b for b in forward_gather_bytes(request) if b]
            backward = backward_gather_bytes(request)
        result.append(make_collective(CollectiveOp.all_gather, Phase.forward, "parameters", params, group, gathers_forward, group_spans_nodes, eb.compute_parameter, per_node))
        if kind is not StrategyKind.fsdp_shard_grad_op:
            if request.model.tied_embeddings and not kind.is_fsdp:
                # Reference ZeRO-3 (zeroplan/harness/zero.py): a tied embedding serves the head
                # too, so it stays gathered from the forward until its backward is done.
                backward = backward[1:]
            if fsdp1_root_stays_gathered(request) and kind is StrategyKind.fsdp_full_shard:
                # FSDP1's root stays gathered from the forward (profiles.fsdp1_root_stays_gathered):
                # its backward gathers the blocks only.
                blocks = [u.name.startswith("block.") for u in rank_parameter_units(request)]
                backward = [b for b, block in zip(backward, blocks, strict=True) if block]
            backward = [b for b in backward if b]  # a unit the turnaround kept whole gathers nothing
            result.append(make_collective(CollectiveOp.all_gather, Phase.backward, "parameters", backward, group, accum, group_spans_nodes, eb.compute_parameter, per_node))
        if models_deepspeed_gathers(request):
            result += deepspeed_stage3_step_scalars(request, group, group_spans_nodes, per_node)
    if kind.quantizes_communication and qgz_spans_nodes(request):
        # zero3-zeropp's qgZ: the hierarchical int4 all-to-all in place of the reduce-scatter.
        result += qgz_collectives(request, gradient_bytes, reduce_per_step)
    else:
        result.append(make_collective(CollectiveOp.reduce_scatter, Phase.backward, "gradients", grads, group, reduce_per_step, group_spans_nodes, gradient_bytes, per_node))
    if kind.zero_stage in (1, 2):
        # The step gathers what the optimizer updated: the trainable parameters only.
        stepped = _gradient_buffers(request, group, eb.compute_parameter)
        result.append(make_collective(CollectiveOp.all_gather, Phase.step, "parameters", stepped, group, 1, group_spans_nodes, eb.compute_parameter, per_node))
    result += mics_replica_all_reduce(request, grads, gradient_bytes)
    if kind is StrategyKind.hsdp and world > group:
        replicas = world // group
        shards = [ceil_div(b, group) for b in grads]
        # Rank r's replica group is r, r+G, r+2G, ...: one member per node when G fills a node.
        per_node = strided_ranks_per_node(group * tp, request.cluster.gpus_per_node)
        result.append(make_collective(CollectiveOp.all_reduce, Phase.backward, "gradient shards", shards, replicas, reduce_per_step, multi_node, gradient_bytes, per_node))
    return split_expert_collectives(request, rank_parameter_units(request), result)
