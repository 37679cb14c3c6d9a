"""Expert parallelism: the routed experts of each MoE block split ep ways, the tokens sent to the
rank holding their experts and back, as torchtitan 0.3.0 lays it out.

torchtitan 0.3.0 (config/configs.py expert_parallel_degree; distributed/parallel_dims.py) borrows
the ep ranks from the data-parallel ones: the sparse mesh ["pp", "dp_replicate", "efsdp", "ep"]
covers the ranks of the dense mesh's dp_shard x cp x tp, efsdp = dp_shard x cp x tp / ep, ep
innermost. Each rank holds num_experts / ep experts of every MoE block (its token dispatcher,
models/common/token_dispatcher.py, runs num_experts // ep local experts) and FSDP shards them
over efsdp (distributed/fsdp.py, apply_fsdp: the experts' per-parameter mesh is edp_mesh), the
rest of the block over the full dp_shard x cp group. Every other parameter is unchanged.

Symbols: E experts, k experts per token, h hidden, e bytes of an activation element, T tokens
of one micro-batch on the rank (s b / cp).
"""

from __future__ import annotations

from zeroplan.core.activations import routed_token_copies
from zeroplan.core.collective import Collective, CollectiveOp, Phase, make_collective
from zeroplan.core.layout import ShardLayout, padded_unit_elements
from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing

EXPERT_PREFIX = "mlp.experts."


def expert_leaf(tensor: ParamTensor) -> str:
    """What a routed expert's tensor is within its expert ('mlp.experts.<i>.<leaf>' -> '<leaf>')."""
    return tensor.name[len(EXPERT_PREFIX):].split(".", 1)[1]


def expert_index(tensor: ParamTensor) -> int | None:
    """The routed expert a tensor belongs to ('mlp.experts.<i>.<leaf>.weight'), else None."""
    if not tensor.name.startswith(EXPERT_PREFIX):
        return None
    index = tensor.name[len(EXPERT_PREFIX):].split(".", 1)[0]
    return int(index) if index.isdigit() else None


# torchtitan 0.3.0 distributed/fsdp.py (apply_fsdp, ep_degree > 1): the experts' grouped
# weights (models/common/moe.py GroupedExperts: w1_EFD, w3_EFD of E x f x h, w2_EDF of E x h x f)
# are FSDP-sharded over efsdp with Shard(0), the expert dimension, unless efsdp x ep exceeds
# the experts (then Shard(1), to avoid padding). Shard(1) of the grouped tensor holds what
# dim-0 shards of each expert's own matrix hold, so only Shard(0) needs the grouped shape.
def _grouped(tensors: list[ParamTensor], local: int) -> list[ParamTensor]:
    by_leaf: dict[str, ParamTensor] = {}
    for tensor in tensors:
        by_leaf.setdefault(expert_leaf(tensor), tensor)
    return [ParamTensor(name=f"{EXPERT_PREFIX}{leaf}", shape=(local, *tensor.shape),
                        shard_group_divisor=tensor.shard_group_divisor) for leaf, tensor in by_leaf.items()]


# torchtitan's ExpertParallel shards the grouped expert weights on their expert dimension
# (Shard(0) over the ep mesh): rank r of the ep group holds experts r E/ep .. (r + 1) E/ep - 1.
# Rank 0 is planned; every rank holds as many.
def expert_parallel_units(units: tuple[ParamUnit, ...], model: ModelSpec, ep: int, framework: Framework,
                          efsdp: int) -> tuple[ParamUnit, ...]:
    """The units as expert-parallel rank 0 holds them: of each MoE block's routed experts, the
    first E/ep, each marked to be data-parallel sharded over efsdp (the group divided by ep);
    under torchtitan's Shard(0) placement as its grouped E/ep x f x h tensors."""
    if ep == 1:
        return units
    local = model.num_experts // ep
    grouped = framework is Framework.torchtitan and efsdp * ep <= model.num_experts
    result = []
    for unit in units:
        tensors, experts = [], []
        for tensor in unit.tensors:
            index = expert_index(tensor)
            if index is None:
                tensors.append(tensor)
            elif index < local:
                experts.append(tensor.model_copy(update={"shard_group_divisor": ep}))
        if experts:
            # Registration order: the experts where the block had them (after the router).
            at = next(i for i, t in enumerate(tensors) if t.name == "mlp.router.weight") + 1
            tensors[at:at] = _grouped(experts, local) if grouped else experts
        result.append(ParamUnit(name=unit.name, tensors=tuple(tensors)))
    return tuple(result)


def moe_block_count(units: tuple[ParamUnit, ...]) -> int:
    """MoE blocks among ``units`` (those with a router)."""
    found = _MOE_BLOCKS.get(id(units))
    if found is not None and found[0] is units:
        return found[1]
    count = sum(1 for unit in units if any(t.name == "mlp.router.weight" for t in unit.tensors))
    if len(_MOE_BLOCKS) > _MOE_BLOCKS_LIMIT:
        _MOE_BLOCKS.clear()
    _MOE_BLOCKS[id(units)] = (units, count)
    return count


# Asked once per plan of every rank's units (zeroplan.core.parallel.collectives), which are
# themselves cached tuples (rank_parameter_units): their identity keys the count, and the entry
# keeps the tuple alive so the identity cannot be reused (as model_states._PADDED_ELEMENTS).
_MOE_BLOCKS: dict[int, tuple[tuple[ParamUnit, ...], int]] = {}
_MOE_BLOCKS_LIMIT = 4096


def _dispatch_buffer_bytes(request: PlanRequest) -> int:
    """One all-to-all's buffer on the rank: its T x k routed token copies (E x capacity under a
    capacity factor, padding included), h wide (balanced routing: every rank sends and receives
    as many)."""
    tokens = request.batch.seq_len // request.parallel.cp * request.batch.micro_batch_size
    copies = routed_token_copies(request.model, tokens)
    return copies * request.model.hidden_size * request.training.precision.compute_bytes


# torchtitan 0.3.0 models/common/token_dispatcher.py AllToAllTokenDispatcher: dispatch()
# all-to-alls the permuted routed copies to the ranks holding their experts (all_to_all_single
# over the ep group) and combine() all-to-alls the experts' outputs back; autograd runs the
# reverse all-to-all for each in backward (Megatron-LM's MoEAlltoAllTokenDispatcher the same).
# Full recomputation runs the forward's pair again. Each moves T k h e bytes, of which
# (ep - 1)/ep leave the rank (make_collective's ring count: (N - 1) chunks of S/N).
def expert_parallel_collectives(request: PlanRequest, moe_blocks: int) -> list[Collective]:
    ep = request.parallel.ep
    if ep == 1 or moe_blocks == 0:
        return []
    e = request.training.precision.compute_bytes
    buffer = _dispatch_buffer_bytes(request)
    accum = request.batch.grad_accum_steps
    recomputes = request.training.activation_checkpointing is ActivationCheckpointing.full
    forward_calls = 2 * moe_blocks * (2 if recomputes else 1)
    backward_calls = 2 * moe_blocks
    # ep is innermost in torchtitan's sparse mesh (tp is 1 under ep here): consecutive ranks.
    spans = ep > request.cluster.gpus_per_node
    return [
        make_collective(CollectiveOp.all_to_all, Phase.forward, "expert-parallel token dispatch and combine",
                        [buffer] * forward_calls, ep, accum, spans, e, blocking=True),
        make_collective(CollectiveOp.all_to_all, Phase.backward, "expert-parallel token gradients",
                        [buffer] * backward_calls, ep, accum, spans, e, blocking=True),
    ]


# The dispatch holds the permuted send buffer and the received buffer of one MoE block's
# routed copies at once (token_dispatcher.py: routed_input after _local_reorder, then the
# all_to_all_single output), and the combine the same in reverse; one block dispatches at a
# time, so 2 T k h e bytes are alive beside the saved activations. What the experts save for
# backward (their inputs, k copies per token) is the MoE block's mlp_input term already.
def expert_dispatch_bytes(request: PlanRequest) -> int:
    """Transient bytes of one MoE block's token dispatch on the rank (0 without ep)."""
    if request.parallel.ep == 1 or not request.model.is_moe:
        return 0
    return 2 * _dispatch_buffer_bytes(request)


def _unit_parts_elements(units: tuple[ParamUnit, ...], num_shards: int) -> tuple[list[int], list[int]]:
    """Per unit, the padded elements an all-gather over the full group moves (everything but
    the routed experts) and over efsdp (the routed experts)."""
    dense, experts = [], []
    for unit in units:
        own = tuple(t for t in unit.tensors if t.shard_group_divisor == 1)
        routed = tuple(t for t in unit.tensors if t.shard_group_divisor > 1)
        dense.append(padded_unit_elements(ParamUnit(name=unit.name, tensors=own), num_shards, ShardLayout.dim0))
        if routed:
            experts.append(padded_unit_elements(ParamUnit(name=unit.name, tensors=routed), num_shards, ShardLayout.dim0))
    return dense, experts


# torchtitan 0.3.0 distributed/fsdp.py gives the experts their own FSDP mesh (efsdp) inside
# each block's fully_shard: FSDP2 gathers and reduces them over efsdp ranks (ep apart: ep is
# innermost in the sparse mesh), the rest of the block over the full dp_shard x cp group. Each
# FSDP collective of the strategy is split into those two.
def split_expert_collectives(request: PlanRequest, units: tuple[ParamUnit, ...], result: list[Collective]) -> list[Collective]:
    """The data-parallel FSDP collectives of the rank's ``units`` with the experts' part over
    efsdp (unchanged without ep)."""
    ep = request.parallel.ep
    if ep == 1:
        return result
    group = request.shard_group_size
    efsdp = max(1, group // ep)
    dense, experts = _unit_parts_elements(units, group)
    gpus_per_node = request.cluster.gpus_per_node
    split = []
    for c in result:
        if c.op not in (CollectiveOp.all_gather, CollectiveOp.reduce_scatter) or c.what not in ("parameters", "gradients"):
            split.append(c)
            continue
        e = c.element_bytes
        split.append(make_collective(c.op, c.phase, c.what, [n * e for n in dense], c.group_size, c.occurrences_per_step,
                                     c.spans_nodes, e, c.ranks_per_node))
        if efsdp > 1 and experts:
            spans = ep * (efsdp - 1) >= gpus_per_node
            split.append(make_collective(c.op, c.phase, f"expert {c.what}", [n * e for n in experts], efsdp,
                                         c.occurrences_per_step, spans, e, max(1, min(efsdp, gpus_per_node // ep))))
    return split
