"""The collectives tensor, context and pipeline parallelism add to one rank's step. Each sits on
the critical path (``blocking``): a block's matmuls wait for its tensor-parallel reductions and
its ring-attention exchange, a stage for its neighbour's activations."""

from __future__ import annotations

from zeroplan.core.collective import Collective, CollectiveOp, Phase, make_collective
from zeroplan.core.layout import element_bytes
from zeroplan.core.memo import request_keyed
from zeroplan.core.parallel.pipeline import request_rank_stages
from zeroplan.core.parallel.tensor import tensor_parallel_model
from zeroplan.core.parallel.expert import expert_parallel_collectives, moe_block_count
from zeroplan.core.params import ParamUnit
from zeroplan.core.parallel.ulysses import runs_ulysses, ulysses_collectives
from zeroplan.core.parallel.units import holds_embedding, holds_head, rank_block_count, rank_parameter_units
from zeroplan.core.profiles import profile
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.units import FP32_BYTES


def recomputes_collectives(request: PlanRequest) -> bool:
    """Whether the backward reruns the block's forward, collectives included."""
    return request.training.activation_checkpointing in (ActivationCheckpointing.full, ActivationCheckpointing.selective_op)


# The checkpointing policy enters the model-parallel collectives only through these two reads
# (tensor_parallel_collectives and context_parallel_collectives: recomputes_collectives;
# expert_parallel_collectives: full recomputation alone reruns the token all-to-alls), so
# policies that agree on both make the same collectives (the plan search shares their blocking
# calls between them).
def collective_recomputation(request: PlanRequest) -> tuple[bool, bool]:
    """(whether the backward reruns the blocks' tensor- and context-parallel collectives,
    whether it reruns the MoE blocks' token all-to-alls)."""
    return recomputes_collectives(request), request.training.activation_checkpointing is ActivationCheckpointing.full


def _activation_element_bytes(request: PlanRequest) -> int:
    return request.training.precision.compute_bytes


# Megatron-LM sec. 3 (Figure 4): each block all-reduces its attention and MLP outputs in the
# forward (g) and its inputs' gradients in the backward (f): two all-reduces each way of the
# s b h activations. With sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) each
# all-reduce becomes an all-gather before the block's matmuls and a reduce-scatter after them,
# in both directions. Recomputation runs the forward's collectives again inside the backward
# (sec. 5): full checkpointing, and torchtitan's selective-op, whose save list keeps matmul and
# attention outputs but not the collectives' (benchmarks/parallel-records count them in backward).
# Without sequence parallelism each column-parallel module's input gradient is a partial sum
# reduced on its own: Megatron-LM's fused QKV and fc1 reduce two per block, as does torchtitan
# (its wqkv is fused; benchmarks/parallel-records count two backward all-reduces per block);
# the reference model's separate q, k, v and gate, up (zeroplan/harness/model.py, under
# torch's ColwiseParallel plan) reduce five, as the harness measured on gloo
# (docs/validation.md, "Model parallelism"). Sequence parallelism gathers the input once
# (PrepareModuleInput), so its backward reduce-scatters two per block either way.
def input_gradient_reductions(request: PlanRequest) -> int:
    """Backward all-reduces of one block's column-parallel input gradients without SP."""
    if request.training.framework is not Framework.zeroplan:
        return 2
    return 3 + (2 if request.model.mlp.gated else 1)


def tensor_parallel_collectives(request: PlanRequest) -> list[Collective]:
    parallel = request.parallel
    tp = parallel.tp
    if tp == 1:
        return []
    e = _activation_element_bytes(request)
    tokens = request.batch.seq_len // parallel.cp * request.batch.micro_batch_size
    activation = tokens * request.model.hidden_size * e
    blocks = rank_block_count(request)
    accum = request.batch.grad_accum_steps
    recomputes = recomputes_collectives(request)
    forward_calls = 2 * blocks
    backward_calls = (2 if parallel.sequence_parallel else input_gradient_reductions(request)) * blocks
    backward_calls += forward_calls if recomputes else 0
    result: list[Collective] = []
    ops = ((CollectiveOp.all_gather, CollectiveOp.reduce_scatter) if parallel.sequence_parallel
           else (CollectiveOp.all_reduce,))
    for op in ops:
        for phase, calls in ((Phase.forward, forward_calls), (Phase.backward, backward_calls)):
            # --tp-comm-overlap (PerformanceAssumptions.tp_comm_overlap): hidden behind the phase's
            # compute like a data-parallel collective, instead of on the critical path.
            result.append(make_collective(op, phase, "tensor-parallel activations", [activation] * calls, tp, accum,
                                          False, e, blocking=not request.performance.tp_comm_overlap))
    if holds_embedding(request):
        # Vocabulary-parallel embedding: each rank looks up its rows, the partial sums reduced;
        # under sequence parallelism a reduce-scatter, whose backward all-gathers the output's
        # gradient again (measured by the harness on gloo, docs/validation.md).
        op = CollectiveOp.reduce_scatter if parallel.sequence_parallel else CollectiveOp.all_reduce
        result.append(make_collective(op, Phase.forward, "vocab-parallel embedding", [activation], tp, accum, False, e, blocking=True))
        if parallel.sequence_parallel:
            result.append(make_collective(CollectiveOp.all_gather, Phase.backward, "vocab-parallel embedding gradient",
                                          [activation], tp, accum, False, e, blocking=True))
    result += _norm_gradient_reductions(request)
    if holds_head(request):
        # The output projection's input gradient (all-reduce, or reduce-scatter after the
        # sequence-parallel all-gather), and the vocabulary-parallel cross-entropy's three fp32
        # per-token all-reduces (Megatron-LM core/tensor_parallel/cross_entropy.py: the max, the
        # target logit and the sum of exponentials).
        if parallel.sequence_parallel:
            result.append(make_collective(CollectiveOp.all_gather, Phase.forward, "output-projection input", [activation], tp, accum, False, e, blocking=True))
            result.append(make_collective(CollectiveOp.reduce_scatter, Phase.backward, "output-projection input gradient", [activation], tp, accum, False, e, blocking=True))
        else:
            result.append(make_collective(CollectiveOp.all_reduce, Phase.backward, "output-projection input gradient", [activation], tp, accum, False, e, blocking=True))
        result.append(make_collective(CollectiveOp.all_reduce, Phase.forward, "vocab-parallel loss statistics",
                                      [tokens * FP32_BYTES] * 3, tp, accum, False, FP32_BYTES, blocking=True))
    return result


# Sequence-parallel norms see a sequence shard, so their weights' gradients are partial sums
# over tp: Megatron-LM core/distributed/finalize_model_grads.py (_allreduce_layernorm_grads)
# all-reduces them once per step, as the harness's DTensor plan does (measured on gloo).
# torchtitan leaves it to FSDP (its sharding comment; benchmarks/parallel-records show it only
# with FSDP2 on top). It runs once, after backward, with the data-parallel step's collectives
# (exposed there), not inside a block: so not blocking.
def _norm_gradient_reductions(request: PlanRequest) -> list[Collective]:
    """The once-a-step all-reduce of the sequence-parallel norms' gradients (none without
    tensor or sequence parallelism, or where FSDP reduces them)."""
    parallel = request.parallel
    if (parallel.tp == 1 or not parallel.sequence_parallel
            or profile(request.training.framework).fsdp_reduces_norm_gradients_over_tp):
        return []
    norm_elements = _norm_elements(rank_parameter_units(request))
    if not norm_elements:
        return []
    grad_bytes = element_bytes(request.training.precision, request.convention).gradient
    return [make_collective(CollectiveOp.all_reduce, Phase.step, "sequence-parallel norm gradients",
                            [norm_elements * grad_bytes], parallel.tp, 1, False, grad_bytes)]


# Ring attention (Liu et al. 2023, sec. 3; Megatron-LM's context parallelism): each of the
# cp - 1 steps of a block's forward passes the local K and V on to the next rank, and the
# backward passes K, V and their gradients round again. A stack that all-gathers K and V
# instead (FrameworkProfile.context_parallel_gathers_kv: torchtitan 0.3.0, measured) issues two
# all-gathers of the whole-sequence K and V per block forward and two reduce-scatters of their
# gradients backward. Full recomputation runs the forward's again.
def context_parallel_collectives(request: PlanRequest) -> list[Collective]:
    parallel = request.parallel
    cp = parallel.cp
    if cp == 1:
        return []
    if runs_ulysses(request):
        # Megatron-DeepSpeed's cp is DeepSpeed-Ulysses: all-to-alls, not a ring.
        return ulysses_collectives(request)
    e = _activation_element_bytes(request)
    model = tensor_parallel_model(request.model, parallel.tp)
    tokens = request.batch.seq_len // cp * request.batch.micro_batch_size
    kv = tokens * model.kv_size * e
    blocks = rank_block_count(request)
    accum = request.batch.grad_accum_steps
    recomputes = recomputes_collectives(request)
    spans = _spans_nodes(request, stride=parallel.tp, group=cp)
    if profile(request.training.framework).context_parallel_gathers_kv:
        gathered = kv * cp
        result = [
            make_collective(CollectiveOp.all_gather, Phase.forward, "context-parallel K and V",
                            [gathered] * (2 * blocks), cp, accum, spans, e, blocking=True),
            make_collective(CollectiveOp.reduce_scatter, Phase.backward, "context-parallel K and V gradients",
                            [gathered] * (2 * blocks), cp, accum, spans, e, blocking=True),
        ]
        if recomputes:
            result.append(make_collective(CollectiveOp.all_gather, Phase.backward, "context-parallel K and V",
                                          [gathered] * (2 * blocks), cp, accum, spans, e, blocking=True))
        return result
    result = [
        make_collective(CollectiveOp.send, Phase.forward, "context-parallel K/V", [2 * kv] * ((cp - 1) * blocks),
                        2, accum, spans, e, blocking=True),
        make_collective(CollectiveOp.send, Phase.backward, "context-parallel K/V and gradients", [4 * kv] * ((cp - 1) * blocks),
                        2, accum, spans, e, blocking=True),
    ]
    if recomputes:
        result.append(make_collective(CollectiveOp.send, Phase.backward, "context-parallel K/V", [2 * kv] * ((cp - 1) * blocks),
                                      2, accum, spans, e, blocking=True))
    return result


# Narayanan et al. 2021, sec. 2.2: each stage sends its output activations to the next stage
# in the forward and receives their gradients back in the backward, one s b h tensor per
# micro-batch and stage boundary (1/t of it under sequence parallelism: the stage's output is
# sequence-sharded).
def pipeline_collectives(request: PlanRequest) -> list[Collective]:
    parallel = request.parallel
    if parallel.pp == 1:
        return []
    e = _activation_element_bytes(request)
    tokens = request.batch.seq_len // parallel.cp * request.batch.micro_batch_size
    activation = tokens * request.model.hidden_size * e
    if parallel.sequence_parallel:
        activation //= parallel.tp
    stages = request_rank_stages(request, parallel.pipeline_rank)
    sends_forward = sum(1 for stage in stages if not stage.has_head)
    sends_backward = sum(1 for stage in stages if not stage.has_embedding)
    accum = request.batch.grad_accum_steps
    spans = _spans_nodes(request, stride=request.cluster.world_size // parallel.pp, group=2)
    result = []
    if sends_forward:
        result.append(make_collective(CollectiveOp.send, Phase.forward, "pipeline activations", [activation] * sends_forward, 2, accum, spans, e, blocking=True))
    if sends_backward:
        result.append(make_collective(CollectiveOp.send, Phase.backward, "pipeline activation gradients", [activation] * sends_backward, 2, accum, spans, e, blocking=True))
    return result


def _norm_elements(units: tuple[ParamUnit, ...]) -> int:
    """Elements of the units' norm weights and biases."""
    # A rank's units are shared by every request of its layout (zeroplan.core.parallel.units
    # caches them) and the plan search asks for this of each: kept by the tuple's identity, the
    # entry holding the tuple (as zeroplan.core.model_states keeps the units' padded sizes).
    known = _NORM_ELEMENTS.get(id(units))
    if known is not None and known[0] is units:
        return known[1]
    if len(_NORM_ELEMENTS) >= 1024:
        _NORM_ELEMENTS.clear()
    count = sum(t.numel for unit in units for t in unit.tensors if t.name.endswith("norm.weight") or t.name.endswith("norm.bias"))
    _NORM_ELEMENTS[id(units)] = (units, count)
    return count


_NORM_ELEMENTS: dict[int, tuple[tuple[ParamUnit, ...], int]] = {}


def _spans_nodes(request: PlanRequest, stride: int, group: int) -> bool:
    """Whether the group of ``group`` ranks ``stride`` apart that holds rank 0 (the mesh puts tp
    innermost, pp outermost) crosses a node boundary."""
    return stride * (group - 1) >= request.cluster.gpus_per_node


def model_parallel_collectives(request: PlanRequest) -> list[Collective]:
    """The collectives tensor, context, pipeline and expert parallelism add to the rank's step."""
    parallel = request.parallel
    if parallel.tp == parallel.cp == parallel.pp == parallel.ep == 1:
        # Each kind's own first test (a degree of 1 adds none), without a cache's key.
        return []
    return list(_model_parallel_collectives(request))


# The plan search's communication phases take only the collectives that overlap compute, at
# three accumulation counts per rank class: without --tp-comm-overlap those are the norms'
# gradient reduction alone, so the blocking ones (every block's) are not built for them.
def overlapped_model_parallel_collectives(request: PlanRequest) -> list[Collective]:
    """The non-blocking ones of model_parallel_collectives, in its order."""
    if request.performance.tp_comm_overlap:
        return [c for c in model_parallel_collectives(request) if not c.blocking]
    return _norm_gradient_reductions(request)


# A plan asks for them for its step time and the plan search for each rank class's blocking
# calls and phases at micro-batches 1 and 2: the same requests (every field keys them).
@request_keyed()
def _model_parallel_collectives(request: PlanRequest) -> tuple[Collective, ...]:
    experts = expert_parallel_collectives(request, moe_block_count(rank_parameter_units(request)))
    return tuple(tensor_parallel_collectives(request) + context_parallel_collectives(request) + pipeline_collectives(request)
                 + experts)
