"""Collectives issued per optimizer step, and the bytes each rank sends under a ring.

The ZeRO paper counts *volume* (sec. 7: 2*Psi for DDP, ZeRO-1 and ZeRO-2, 3*Psi for ZeRO-3);
a ring collective of an S-byte buffer over N ranks makes each rank *send* (N-1)/N*S bytes
for all-gather and reduce-scatter and 2*(N-1)/N*S for all-reduce (Patarasuk & Yuan 2009;
NCCL's docs/performance "algorithm bandwidth vs bus bandwidth"). Both are kept apart here.
"""

from __future__ import annotations

from enum import Enum

from zeroplan.core.layout import ElementBytes, element_bytes, gradient_wire_bytes
from zeroplan.core.model_states import padded_unit_elements_of
from zeroplan.core.network import strided_ranks_per_node
from zeroplan.core.params import parameter_units
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.units import ceil_div

# torch/nn/parallel/distributed.py: the first bucket is capped at 1 MiB
# (dist._DEFAULT_FIRST_BUCKET_BYTES) so communication starts early; the rest at bucket_cap_mb.
DDP_FIRST_BUCKET_BYTES = 2**20


class CollectiveOp(str, Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"


class Phase(str, Enum):
    forward = "forward"
    backward = "backward"
    step = "step"


class Collective(Frozen):
    """One kind of collective in a step, summed over the units or buckets it runs on."""

    op: CollectiveOp
    """The collective."""
    phase: Phase
    """When it runs."""
    what: str
    """Which tensors it moves, e.g. 'gradients' or 'parameters'."""
    group_size: int
    """Ranks taking part."""
    element_bytes: int
    """Bytes of one element on the wire (the dtype)."""
    buffer_bytes: int
    """S summed over the calls of one occurrence: the unsharded buffer (all-gather output,
    reduce-scatter input, all-reduce buffer)."""
    calls: int
    """Separate calls in one occurrence (units or buckets), for the latency term."""
    occurrences_per_step: int
    """Times it happens per optimizer step (grad_accum_steps for per-micro-batch ones)."""
    spans_nodes: bool
    """Whether the group crosses a node boundary (inter-node links then bound the ring)."""
    sent_bytes_per_call_sum: int
    """Bytes one rank sends in one occurrence under a ring, summed over its calls."""
    ranks_per_node: int | None = None
    """Members of the group on each node it spans (NICs it can use); None: consecutive ranks,
    min(group_size, GPUs per node)."""

    @property
    def volume_elements_per_step(self) -> int:
        """The ZeRO paper's volume (sec. 7.2.1): an all-reduce counts twice its buffer."""
        factor = 2 if self.op is CollectiveOp.all_reduce else 1
        return factor * self.buffer_bytes_per_step // self.element_bytes

    @property
    def buffer_bytes_per_step(self) -> int:
        return self.buffer_bytes * self.occurrences_per_step

    @property
    def sent_bytes_per_step(self) -> int:
        return self.sent_bytes_per_call_sum * self.occurrences_per_step


# Ring all-gather / reduce-scatter: N-1 rounds, each sending one 1/N chunk of the S-byte buffer.
def ring_sent_bytes(op: CollectiveOp, buffer_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for one collective of an S-byte buffer over a ring of N ranks."""
    chunk = ceil_div(buffer_bytes, group_size)
    rounds = group_size - 1
    if op is CollectiveOp.all_reduce:
        return 2 * rounds * chunk
    return rounds * chunk


def _collective(
    op: CollectiveOp, phase: Phase, what: str, buffers: list[int], group_size: int,
    occurrences: int, spans_nodes: bool, element_bytes: int, ranks_per_node: int | None = None,
) -> Collective:
    return Collective(
        op=op, phase=phase, what=what, group_size=group_size, element_bytes=element_bytes,
        buffer_bytes=sum(buffers),
        calls=len(buffers), occurrences_per_step=occurrences, spans_nodes=spans_nodes,
        sent_bytes_per_call_sum=sum(ring_sent_bytes(op, s, group_size) for s in buffers),
        ranks_per_node=ranks_per_node,
    )


def ddp_bucket_sizes(total_bytes: int, cap_bytes: int) -> list[int]:
    """DDP's gradient buckets: a 1 MiB first bucket, then buckets of the cap (approximating
    parameter boundaries, which DDP never splits)."""
    first = min(total_bytes, DDP_FIRST_BUCKET_BYTES)
    sizes = [first]
    rest = total_bytes - first
    while rest > 0:
        sizes.append(min(rest, cap_bytes))
        rest -= sizes[-1]
    return sizes


def _unit_buffers(request: PlanRequest, num_shards: int, bytes_per_element: int) -> list[int]:
    """The padded unsharded buffer of every unit, in bytes."""
    return [elements * bytes_per_element for elements in padded_unit_elements_of(request, num_shards)]


def _wire_bytes(request: PlanRequest) -> ElementBytes:
    return element_bytes(request.training.precision, request.convention)


def collectives(request: PlanRequest) -> list[Collective]:
    """Every collective of one optimizer step of ``request``."""
    kind = request.strategy.kind
    world = request.cluster.world_size
    accum = request.batch.grad_accum_steps
    eb = _wire_bytes(request)
    multi_node = request.cluster.num_nodes > 1
    if world == 1:
        return []
    if kind is StrategyKind.ddp:
        total = sum(u.numel for u in parameter_units(request.model)) * eb.gradient
        buckets = ddp_bucket_sizes(total, request.strategy.ddp_bucket_cap_bytes)
        # Accumulation runs under no_sync(): one all-reduce per optimizer step.
        return [_collective(CollectiveOp.all_reduce, Phase.backward, "gradients", buckets, world, 1, multi_node, eb.gradient)]

    group = request.shard_group_size
    group_spans_nodes = group > request.cluster.gpus_per_node
    # Parameters are gathered in the compute dtype; gradients travel in gradient_wire_bytes.
    gradient_bytes = gradient_wire_bytes(request)
    grads = _unit_buffers(request, group, gradient_bytes)
    params = _unit_buffers(request, group, eb.compute_parameter)
    reduce_per_step = 1 if (kind is StrategyKind.zero1 or request.strategy.keep_unsharded_grads_on_accum) else accum
    result = []
    if request.strategy.kind.zero_stage == 3:
        result.append(_collective(CollectiveOp.all_gather, Phase.forward, "parameters", params, group, accum, group_spans_nodes, eb.compute_parameter))
        if kind is not StrategyKind.fsdp_shard_grad_op:
            backward = params
            if request.model.tied_embeddings and not kind.is_fsdp:
                # Reference ZeRO-3 (zeroplan/harness/zero.py): a tied embedding serves the head
                # too, so it stays gathered from the forward until its backward is done.
                backward = params[1:]
            result.append(_collective(CollectiveOp.all_gather, Phase.backward, "parameters", backward, group, accum, group_spans_nodes, eb.compute_parameter))
    result.append(_collective(CollectiveOp.reduce_scatter, Phase.backward, "gradients", grads, group, reduce_per_step, group_spans_nodes, gradient_bytes))
    if request.strategy.kind.zero_stage in (1, 2):
        result.append(_collective(CollectiveOp.all_gather, Phase.step, "parameters", params, group, 1, group_spans_nodes, eb.compute_parameter))
    if kind is StrategyKind.hsdp and world > group:
        replicas = world // group
        shards = [ceil_div(b, group) for b in grads]
        # Rank r's replica group is r, r+G, r+2G, ...: one member per node when G fills a node.
        per_node = strided_ranks_per_node(group, request.cluster.gpus_per_node)
        result.append(_collective(CollectiveOp.all_reduce, Phase.backward, "gradient shards", shards, replicas, reduce_per_step, multi_node, gradient_bytes, per_node))
    return result
