"""ZeRO-3 with a second level of groups: ZeRO++'s hpZ and MiCS (docs/memory-model.md, "ZeRO++
hpZ and MiCS"; docs/communication-time.md, "hpZ and MiCS").

hpZ (Wang et al. 2023, ZeRO++ sec. 3.2; deepspeed 0.19.8 zero_hpz_partition_size) keeps every
model state sharded over all N data-parallel ranks, as ZeRO-3, and adds a secondary copy of the
parameters split over H ranks (a node): each rank holds 1/H of it besides its 1/N primary shard.
Gathers that find the secondary copy run inside the H ranks instead of across all N.

MiCS (Zhang et al. 2022; DeepSpeed's runtime/zero/mics.py until its removal, deepspeed 0.19.8
runtime/config.py _REMOVED_ZERO_CONFIG_KEYS) shards every model state over M ranks only
(PlanRequest.shard_group_size is M, so the ZeRO-3 terms apply unchanged with N = M) and
replicates them across the N/M groups; what it adds is the all-reduce of the gradient
partitions across the replicas.

Formulas only: no torch.
"""

from __future__ import annotations

from zeroplan.core.collective import Collective, CollectiveOp, Phase, make_collective
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.core.network import strided_ranks_per_node
from zeroplan.core.layout import element_bytes
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.units import ceil_div


# deepspeed 0.19.8 runtime/zero/partition_parameters.py Init._partition_param_sec: each parameter
# padded to a multiple of N (_aligned_size) is cut into H pieces of tensor_size // H elements in
# the parameter's own dtype (torch.empty(secondary_partition_size, dtype=param.dtype)); a rank
# keeps its piece (rank_in_group of the hpZ group). Trainable parameters drop theirs after the
# optimizer step (stage3.py _post_step -> invalidate_secondary_tensor) and rebuild them as the
# next forward releases each parameter (partition -> _partition -> _partition_param_sec); frozen
# ones keep theirs. Alive from the forward through the step: counted with the resident buffers.
def hpz_secondary_partition_bytes(request: PlanRequest) -> int:
    """Bytes of the secondary parameter partition one rank holds under zero3-hpz (0 otherwise):
    sum over units of the unit gathered over N, in the compute dtype, divided by H."""
    hpz = request.hpz_group_size
    if not request.strategy.kind.uses_hpz:
        return 0
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    return sum(ceil_div(b, hpz) for b in unit_gather_bytes(request, request.shard_group_size, compute))


# deepspeed 0.19.8 runtime/zero/partition_parameters.py all_gather_coalesced: a gather uses the
# secondary copy whenever the parameter has one (use_secondary_tensor), over
# zero_param_process_group, H ranks, with the H pieces (partition_sz = ds_numel x
# num_of_groups): the same padded unit as the primary gather, over H ranks. The secondary copy
# is missing only at the first forward after a step (invalidate_secondary_tensor), so per step:
# one forward gather over N, then (accumulation - 1) forward and every backward gather over H.
def hpz_forward_gathers_over_all_ranks(grad_accum_steps: int) -> tuple[int, int]:
    """(forward gathers over the N ranks, forward gathers inside the hpZ group) per step."""
    return 1, grad_accum_steps - 1


def hpz_parameter_collectives(request: PlanRequest, params: list[int], backward: list[int], accum: int,
                              spans_nodes: bool, per_node: int | None) -> list[Collective]:
    """zero3-hpz's parameter all-gathers of one step: ``params`` the units gathered in the
    forward and ``backward`` those gathered again in the backward (padded for N, compute dtype)."""
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    hpz, world = request.hpz_group_size, request.shard_group_size
    hpz_spans_nodes = hpz > request.cluster.gpus_per_node
    over_world, inside = hpz_forward_gathers_over_all_ranks(accum)

    def gather(what: str, phase: Phase, units: list[int], group: int, occurrences: int, spans: bool,
               ranks_per_node: int | None = None) -> list[Collective]:
        if request.strategy.kind.quantizes_communication:
            # zero3-zeropp: qwZ quantizes every gather, the secondary ones included
            # (zeroplan.core.zeropp); the units in elements.
            from zeroplan.core.zeropp import qwz_gathers

            return qwz_gathers(what, phase, [b // compute for b in units], group, occurrences, spans, ranks_per_node)
        return [make_collective(CollectiveOp.all_gather, phase, what, units, group, occurrences, spans, compute,
                                ranks_per_node)]

    result = gather("parameters", Phase.forward, params, world, over_world, spans_nodes, per_node)
    if inside:
        result += gather("parameters (hpZ group)", Phase.forward, params, hpz, inside, hpz_spans_nodes)
    result += gather("parameters (hpZ group)", Phase.backward, backward, hpz, accum, hpz_spans_nodes)
    return result


# Measured to the byte (benchmarks/mics-records, DeepSpeed 0.18.9 on gloo; tests/test_mics_record.py):
# deepspeed/runtime/zero/mics.py (the last releases that had it) MiCS_Optimizer.partition_grads
# -> allreduce_mics_shard_grads: at the gradient-accumulation boundary only, the rank's gradient
# partition buffers (reduce-scattered inside its shard group, in the model dtype) are divided by
# the replicas and all-reduced over param_repli_group: the ranks holding the same shard, one
# in each shard group (mics_utils.py _generate_mics_config: shard_groups[:, i]).
def mics_replica_all_reduce(request: PlanRequest, gradients: list[int], wire_bytes: int) -> list[Collective]:
    """The all-reduce of every unit's gradient partition across the N/M replicas, once per step
    (none when one shard group holds all the ranks)."""
    shard, ranks = request.shard_group_size, request.state_group_size
    if request.strategy.kind is not StrategyKind.zero3_mics or ranks == shard:
        return []
    partitions = [ceil_div(b, shard) for b in gradients]
    per_node = strided_ranks_per_node(shard, request.cluster.gpus_per_node)
    multi_node = ranks > request.cluster.gpus_per_node
    return [make_collective(CollectiveOp.all_reduce, Phase.backward, "gradient partitions (replicas)", partitions,
                            ranks // shard, 1, multi_node, wire_bytes, per_node)]
