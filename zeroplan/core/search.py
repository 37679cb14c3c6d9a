"""Search model-parallel layout x strategy x activation checkpointing x micro-batch x
accumulation x offload x HSDP group for the fastest configuration that fits
(docs/communication-time.md, "Plan search").

A layout is tp x cp x pp (and the pipeline schedule) with the data-parallel degree what is left
of the world. Per group (layout, strategy, checkpointing, shard group) the scalar planner is
evaluated at a few micro-batch and accumulation values to get exact coefficients, once per
class of pipeline ranks that hold the same kind of stages (the first, the last, the ones in
between): each peak moment is affine in the micro-batch b (separately for accumulation 1 and
> 1) plus the in-flight micro-batch count times an affine per-chunk term; each phase's
data-parallel communication and host time is affine in the accumulation steps a (separately
for a = 1 and > 1 where one fit misses: ZeRO-2 offload copies gradients every micro-batch only
when it accumulates); the blocking
(model-parallel) collectives are a times their per-micro-batch seconds at that b; compute is
a times an affine function of b (fitted from b in {1, 2}); the pipeline bubble follows step_time's rule. The sweep then runs over
(b, a) with numpy and keeps, as ``plan`` does, the pipeline rank nearest to running out. Every group checks
its coefficients against the scalar planner at a point it did not fit them on, and falls back
to the scalar planner if they disagree; the winner and every Pareto row are planned again with
the scalar planner (every pipeline rank) before they are shown. A branch and bound fits only the
groups whose lower bounds on peak and step time (memory_lower_bound, peak_lower_bounds,
step_time_lower_bound) leave them a chance to fit and to rank or join the Pareto front of the
configurations found so far, the groups taken fastest bound first (search, _Incumbents).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError

from zeroplan.core import deepspeed_coordinator
from zeroplan.core.algorithms import _call_sizes, call_pricing
from zeroplan.core.communication import Phase, collectives, data_parallel_collectives, scheduled
from zeroplan.core.feasibility import pipeline_usable_bytes, usable_memory_bytes
from zeroplan.core.memo import KeptAnswers
from zeroplan.core.model_load import load_fits_gpu
from zeroplan.core.parallel.collectives import (
    collective_recomputation, model_parallel_collectives, overlapped_model_parallel_collectives,
)
from zeroplan.core.layout import gradient_wire_bytes
from zeroplan.core.parallel.pipeline import in_flight_chunks, pipeline_defers_fsdp_reduction, request_rank_stages
from zeroplan.core.parallel.activations import pipeline_receive_buffer_bytes
from zeroplan.core.parallel.units import accumulating_trainable_elements
from zeroplan.core.peak import FIRST_LAYER_SHARES, TOTAL_MOMENTS, PeakTerms, moment_totals, with_terms
from zeroplan.core.plan import (
    allocator_answer, host_memory_fits, memory_breakdown, micro_batch_terms, nearest_rank, nearest_rank_memory,
    peak_terms, pipeline_step_time, rank_memories, reference_engine,
)
from zeroplan.core.collector import cyclic_gc_paused
from zeroplan.core.compiled import runs_checkpointing
from zeroplan.progress import progress, steps
from zeroplan.core.profiles import check_framework_strategies, framework_strategies, profile, torchtitan_keeps_stage_outputs
from zeroplan.core.timing import (
    StepTime,
    collective_time_s,
    compute_time_s,
    cpu_optimizer_time_s,
    gpu_optimizer_time_s,
    exposed_communication_s,
    host_link_share_bytes_per_s,
    host_transfer_bytes,
    model_flops_utilization,
    rank_flops,
)
from zeroplan.core.search_space import CONTEXT_PARALLEL_DEGREES, INTERLEAVED_VIRTUAL_STAGES, LONG_SEQUENCE, LayoutSpace
from zeroplan.errors import ZeroplanError
from zeroplan.answers import PlanSearchResult
from zeroplan.results import PeakMoment, PlanCandidate
from zeroplan.specs.base import kept_copy
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import (MODEL_PARALLEL_FRAMEWORKS, PIPELINE_STRATEGIES, ParallelSpec, PipelineSchedule,
                                     pipeline_microbatch_rule)
from zeroplan.specs.framework import launch_allocator_conf
from zeroplan.specs.request import PlanRequest, revalidated
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing

TIME_TOLERANCE_S = 1e-9
"""Largest difference between a vectorised and a scalar step time taken as agreement."""
BYTE_TOLERANCE = 1
"""Largest difference between a vectorised and a scalar peak taken as agreement."""

@dataclass
class _RankClass:
    """Pipeline ranks that hold the same kind of stages (block counts, embedding, head): the
    same model states, buffers, collectives and per-chunk activations; they differ only in how
    many micro-batch chunks they keep in flight, which falls with the rank (in_flight_chunks),
    so the first rank of the class peaks for it."""

    rank: int
    """The class's first pipeline rank."""
    request: PlanRequest
    """The group's request at that rank."""
    usable_bytes: int = 0
    """The class's usable memory (its ranks open the same NCCL communicators: _rank_classes)."""
    moment_intercepts: dict[bool, np.ndarray] = field(default_factory=dict)
    moment_slopes: dict[bool, np.ndarray] = field(default_factory=dict)
    """Each moment, less the in-flight chunks' k-dependent activations, affine in b."""
    activation_moments: np.ndarray | None = None
    """Which moments hold the activations (1) and which do not (0)."""
    first_layer_blocks: dict[bool, int] = field(default_factory=dict)
    first_layer_shares: np.ndarray | None = None
    """_first_layer_mask: each moment's blocks' shares of the activations."""
    activation_intercept: dict[bool, int] = field(default_factory=dict)
    activation_slope: dict[bool, int] = field(default_factory=dict)
    """PeakTerms.activation_blocks and the activations, affine in b: the first layer's moment
    holds first_layer_activation_bytes of them, a floor, added exactly per b."""
    chunk_intercept: int = 0
    chunk_slope: int = 0
    """Bytes one in-flight chunk keeps, affine in b (0 when the count never changes)."""
    host_fits: dict[bool, bool] = field(default_factory=dict)
    """Whether the host memory holds the rank and the GPU its load, per accumulation (neither moves with b)."""
    accumulators_fitted: dict[bool, int] = field(default_factory=dict)
    """The deferred FSDP gradient accumulators (_accumulator_bytes) at the accumulations fitted."""
    accumulators_by_rounds: dict[bool, int] = field(default_factory=dict)
    """_accumulator_bytes for one round of the interleaved schedule (False) and for more (True):
    the only way it depends on the accumulation (_accumulators_at)."""
    receives: dict[int, tuple[int, int]] | None = None
    """Per accumulation: _receive_bytes, left out of the fitted coefficients (None: no pipeline
    receive buffers)."""
    phase_intercepts_s: dict[bool, np.ndarray] = field(default_factory=dict)
    phase_slopes_s: dict[bool, np.ndarray] = field(default_factory=dict)
    """Each phase's seconds affine in a, apart for one micro-batch a step (False) and more
    (True), as the moments are (_phase_coefficients)."""
    cpu_optimizer_s: float = 0.0
    """The optimizer steps once per step: offload's on the CPU (zeroplan.core.timing.cpu_optimizer_time_s)
    and the GPU's memory-bound one (gpu_optimizer_time_s)."""
    blocking_s: dict = field(default_factory=dict)
    """Per micro-batch size: the blocking collectives' seconds of one micro-batch (and per sweep,
    under the bytes of its distinct micro-batch sizes, the array of them: _blocking_at)."""
    blocking_structure: list | None = None
    """_blocking_structure of the class (None: each b timed by the scalar planner)."""
    call_seconds: dict = field(default_factory=dict)
    """Seconds of one blocking call per (group, size), shared by the layout's groups."""


@dataclass
class _Group:
    """One (layout, strategy, checkpointing, shard group) and its exact coefficients."""

    request: PlanRequest
    usable_bytes: int
    """Pipeline rank 0's usable memory (each rank has its own: plan.nearest_rank), against which
    the bounds on rank 0's peak rule configurations out."""
    usable_spread_bytes: int = 0
    """The most one pipeline rank's usable memory exceeds another's: the peak reported (the rank
    nearest to running out) is at least rank 0's peak less this."""
    classes: list[_RankClass] = field(default_factory=list)
    forward_s_per_micro: float = 0.0
    backward_s_per_micro: float = 0.0
    forward_s_per_pass: float = 0.0
    backward_s_per_pass: float = 0.0
    """Seconds each micro-batch's pass costs whatever its size (the roofline's weight reads,
    FSDP's copies, the embedding gradient's table): compute = (per pass + per micro x b) x passes."""
    model_flops_per_micro: float = 0.0
    """Model FLOPs (PaLM's MFU count) of one micro-batch of one sequence, per model-parallel rank."""
    scalar_only: bool = False
    cache: dict[tuple[int, int], tuple[int, bool, StepTime, int]] = field(default_factory=dict)
    """The scalar planner's (peak, fits, step time, usable memory) by (micro-batch, accumulation)."""
    family: dict = field(default_factory=dict, repr=False)
    layout_cache: dict = field(default_factory=dict, repr=False)
    """What the group shares with its family and its layout (_build_group)."""
    fitted: bool = False
    """Whether _fit_group has run."""
    timed: bool = False
    """Whether _compute_coefficients has run."""
    ruled_out: bool = False
    """The search found that nothing of the group fits without fitting it (its memory lower
    bound, or every peak bound, passes the usable memory)."""
    rank_requests: dict = field(default_factory=dict, repr=False)
    """The request at each pipeline rank asked of (_rank_request), one object each: the
    planner's caches hash a request once per object (zeroplan.specs.base.Frozen)."""


def _rank_request(group: _Group, rank: int) -> PlanRequest:
    """The group's request at pipeline ``rank`` (its own without a pipeline), built once."""
    request = group.request
    if request.parallel.pipeline_rank == rank:
        return request  # its own rank (every group's request is rank 0's, as its layout was built)
    at = group.rank_requests.get(rank)
    if at is None:
        at = group.rank_requests[rank] = request.at_pipeline_rank(rank)
    return at


def _at(request: PlanRequest, micro: int, accum: int) -> PlanRequest:
    # A request already at (micro, accum) is its own answer (a quarter of the plan search's
    # calls): requests are immutable, and the same object keeps its hash (Frozen.__hash__)
    # and meets itself in the planner's caches.
    if request.batch.micro_batch_size == micro and request.batch.grad_accum_steps == accum:
        return request
    # The bounds, the fit and its check ask for the same request at the same point several times
    # each: built once, it is the same object every time, which the planner's caches meet by
    # identity (zeroplan.core.parallel.units.rank_parameter_units keeps its last request's).
    key = (request, micro, accum)
    at = _AT_POINT.entries.get(key)
    if at is None:
        batch = kept_copy(request.batch, micro_batch_size=micro, grad_accum_steps=accum)
        at = request.model_copy(update={"batch": batch})
        _AT_POINT.put(key, at)
    return at


_AT_POINT = KeptAnswers(4096)
"""_at's requests by (request, micro-batch, accumulation)."""


def scalar_evaluate(request: PlanRequest) -> tuple[int, bool, float]:
    """(peak bytes, fits on GPU and host, step time with overlap) from the scalar planner: as
    ``plan`` reports it, the pipeline rank nearest to running out (plan.nearest_rank)."""
    peak, fits, time = scalar_plan(request)
    return peak, fits, time.step_with_overlap_s


def scalar_plan(request: PlanRequest) -> tuple[int, bool, StepTime]:
    """scalar_evaluate with the whole step time (compute, exposed communication, host)."""
    peak, fits, time, _ = _scalar_plan_usable(request)
    return peak, fits, time


def _scalar_plan_usable(request: PlanRequest) -> tuple[int, bool, StepTime, int]:
    """scalar_plan and the usable memory of the rank it reports."""
    at, breakdown, states, usable = nearest_rank_memory(rank_memories(request))
    fits = (breakdown.peak_bytes <= usable and load_fits_gpu(at, usable)
            and host_memory_fits(at, states.host_bytes) is not False)
    return breakdown.peak_bytes, fits, pipeline_step_time(at, tuple(collectives(at))), usable


def _moments(states, terms: PeakTerms, grad_accum_steps: int) -> np.ndarray:
    """The peak moments, the loss's once per piece of the loss (plan.moment_totals)."""
    return np.array(moment_totals(states, terms, grad_accum_steps), dtype=np.int64)


def _terms(request: PlanRequest, family: dict, layout_cache: dict) -> tuple:
    """peak_terms of ``request`` (a pipeline rank at some b and a), from two halves computed
    once each: the model states and buffers, which depend on the strategy, shard group and
    accumulation but not on b or checkpointing (``family``: one strategy and shard group of
    the layout), and the activations, loss and workspace, which depend on b, a,
    checkpointing and the engine's autocast but not otherwise on the strategy (``layout_cache``: the layout). The group's check
    against memory_breakdown would catch a term that broke this. One exception: DeepSpeed
    ZeRO-3's gathered parameters, where its coordinator is replayed, depend on checkpointing
    (the recompute's gathers are in the trace), so there the states are kept per checkpointing."""
    rank, a = request.parallel.pipeline_rank, request.batch.grad_accum_steps
    state_key = ("state", rank, a)
    if deepspeed_coordinator.replays_gathers(request):
        state_key += (request.training.activation_checkpointing,)
    activation_key = _activation_key(request)
    if state_key not in family:
        states, terms = peak_terms(request)
        family[state_key] = (states, terms)
        layout_cache.setdefault(activation_key, {name: getattr(terms, name) for name in _MICRO_BATCH_TERMS})
    elif activation_key not in layout_cache:
        # Only the micro-batch's own terms are new (peak_terms' checks ran for the family's
        # first request and run again in the group's check against memory_breakdown).
        layout_cache[activation_key] = micro_batch_terms(request)
    states, state_terms = family[state_key]
    return states, with_terms(state_terms, layout_cache[activation_key])


def _activation_key(request: PlanRequest) -> tuple:
    """What a request's activation terms (plan.micro_batch_terms) depend on: the layout's
    pipeline rank, checkpointing, b, a and the engine: of the reference model's strategy what
    plan.reference_engine names (its dtypes under autocast), which its cache keys on too; else
    (a framework's own terms, or FSDP1's root gathered at the loss) the strategy's FSDP units."""
    engine = reference_engine(request) or (request.strategy.kind, request.shard_group_size, request.convention)
    return ("activations", request.parallel.pipeline_rank, request.training.activation_checkpointing,
            request.batch.micro_batch_size, request.batch.grad_accum_steps, engine)


_MICRO_BATCH_TERMS = ("activations", "logits", "workspace", "logits_pieces", "logits_gradient")
"""The PeakTerms fields plan.micro_batch_terms computes."""


# Each mask depends on its count of moments alone; a search asks for them a few hundred times,
# at a handful of counts, and only reads them: built once per count, kept read-only.
@functools.lru_cache(maxsize=64)
def _activation_mask(count: int) -> np.ndarray:
    # peak_moments: activations are alive at a block's backward and at the loss's moments, not
    # at the end of backward nor in the optimizer step (the order of _moments). The first layer's
    # holds one block's share of them, and only without a pipeline (PeakTerms.activation_blocks):
    # no chunk in flight or receive buffer there; its share is added exactly (_first_layer_bytes).
    return _read_only_mask([1 if m is PeakMoment.block_backward else 0 for m in TOTAL_MOMENTS], 1, count)


@functools.lru_cache(maxsize=64)
def _first_layer_mask(count: int) -> np.ndarray:
    # peak_moments: the first layer's pieces alone hold blocks' shares of the activations
    # (peak.FIRST_LAYER_SHARES, in TOTAL_MOMENTS' order).
    shares = iter(FIRST_LAYER_SHARES)
    return _read_only_mask([next(shares) if m is PeakMoment.first_layer_backward else 0 for m in TOTAL_MOMENTS], 0, count)


@functools.lru_cache(maxsize=64)
def _held_mask(count: int) -> np.ndarray:
    # peak_moments: the backward-held buffers are alive at a block's backward (the first layer's
    # too), at the end of backward and at the loss's moments, not in the optimizer step nor at
    # the checkpoint save after it (the order of _moments).
    values = [0 if m in (PeakMoment.optimizer_step, PeakMoment.checkpoint_save) else 1 for m in TOTAL_MOMENTS]
    return _read_only_mask(values, 1, count)


def _read_only_mask(values: list[int], loss: int, count: int) -> np.ndarray:
    """``values`` over TOTAL_MOMENTS, then ``loss`` at each of the loss's pieces up to ``count``
    moments, as a read-only array (it is shared between the callers of a kept mask)."""
    mask = np.array(values + [loss] * (count - len(values)), dtype=np.int64)
    mask.flags.writeable = False
    return mask


def _first_layer_bytes(activations, blocks: int, count: int) -> np.ndarray:
    """Per moment (rows) and activations (columns, or one int): the first layer's pieces' share
    of the activations (peak.first_layer_activation_bytes), 0 elsewhere or where the moment is
    not modelled."""
    shares = _first_layer_mask(count)
    values = np.asarray(activations, dtype=np.int64)
    if not blocks:
        return np.zeros(shares.shape + values.shape, dtype=np.int64)
    per_block = values // blocks
    return np.where(shares.reshape(shares.shape + (1,) * values.ndim) > 0,
                    shares.reshape(shares.shape + (1,) * values.ndim) * per_block + blocks - 1, 0)


def _accumulator_bytes(request: PlanRequest, accum: int) -> int:
    """The unsharded gradient accumulators a pipeline's deferred FSDP reduction holds at ``accum``
    micro-batches (zeroplan.core.parallel.units.accumulating_trainable_elements: an interleaved
    schedule of one round accumulates one stage's at a time, of more rounds all of them)."""
    if not pipeline_defers_fsdp_reduction(request.parallel, request.strategy.kind.is_fsdp):
        return 0
    return accumulating_trainable_elements(_at(request, 1, accum)) * gradient_wire_bytes(request)


def _receive_bytes(request: PlanRequest, accum: int) -> tuple[int, int]:
    """The receive buffers torch's pipeline stages keep at ``accum`` micro-batches, one per
    micro-batch (zeroplan.core.parallel.activations.pipeline_receive_buffer_bytes), at b = 1
    and 2 (affine in b): they grow with the accumulation, not with the chunks in flight, so
    they are kept apart from the fitted coefficients and added per accumulation."""
    return (pipeline_receive_buffer_bytes(_at(request, 1, accum)), pipeline_receive_buffer_bytes(_at(request, 2, accum)))


def _accumulators_at(cls: _RankClass, accum: int) -> int:
    """_accumulator_bytes of the class's request at ``accum`` micro-batches, computed once per
    number of rounds: units.accumulating_trainable_elements reads the accumulation only as
    whether the interleaved schedule runs one round of it (accum // pp <= 1) or more (a sweep
    asks hundreds of accumulations, each a request copy and a walk over the rank's units)."""
    several = accum // cls.request.parallel.pp > 1
    if several not in cls.accumulators_by_rounds:
        cls.accumulators_by_rounds[several] = _accumulator_bytes(cls.request, accum)
    return cls.accumulators_by_rounds[several]


def _accumulators_by_rounds(cls: _RankClass, accum: np.ndarray) -> np.ndarray:
    """_accumulators_at at each accumulation of ``accum``: one value for one round of the
    interleaved schedule, one for more, taken at the first accumulation of each."""
    several = accum // cls.request.parallel.pp > 1
    result = np.zeros(accum.shape, dtype=np.int64)
    for flag in (False, True):
        rows = several == flag
        if rows.any():
            result[rows] = _accumulators_at(cls, int(accum[rows][0]))
    return result


_PHASES = tuple(Phase)


def _phase_seconds(request: PlanRequest) -> np.ndarray:
    """Per phase: the overlappable collective seconds (the data-parallel ones, and the once-a-step
    sequence-parallel norm-gradient all-reduce), then host-link seconds (2 x len(Phase) values).
    The blocking ones are timed apart (_blocking_seconds)."""
    comm = {phase: 0.0 for phase in Phase}
    # collectives(request)'s non-blocking ones, in its order, the blocking ones left unbuilt.
    for collective in [scheduled(request, c) for c in data_parallel_collectives(request)] + overlapped_model_parallel_collectives(request):
        if not collective.blocking:
            comm[collective.phase] += collective_time_s(request, collective)
    link = host_link_share_bytes_per_s(request)
    host = host_transfer_bytes(request)
    return np.array([comm[p] for p in _PHASES] + [host[p] / link for p in _PHASES], dtype=np.float64)


def _phase_coefficients(request: PlanRequest) -> tuple[dict[bool, np.ndarray], dict[bool, np.ndarray]]:
    """(intercepts, slopes) of each phase's seconds in the accumulation steps a, for a = 1
    (False) and for a > 1 (True). Where the seconds are affine in a through a = 1 (the fit at
    a = 1 and 2 gives a = 4's to rounding), that one fit for every a; otherwise a = 1's own
    value and a fit at a = 2 and 4 past it (the group's check at 3 tests it): a copy may run
    only when a step accumulates, as DeepSpeed ZeRO-2 offload's per-micro-batch gradient copies
    (deepspeed_offload_time.stage2_gradient_bytes: f E at a = 1, (f - m) E + 2 a m E past it)."""
    one, two, four = (_phase_seconds(_at(request, 1, a)) for a in (1, 2, 4))
    slope = two - one
    start = one - slope
    if np.allclose(start + slope * 4, four, rtol=PHASE_ROUNDING, atol=0):
        return {False: start, True: start}, {False: slope, True: slope}
    slope = (four - two) / 2
    return {False: one, True: two - 2 * slope}, {False: np.zeros_like(one), True: slope}


PHASE_ROUNDING = 1e-13
"""Relative difference _phase_coefficients takes as rounding: a phase's seconds are sums of a
few hundred terms at most, each to double precision (about 1e-16)."""


def _blocking_seconds(request: PlanRequest, micro: int) -> float:
    """Seconds of the blocking (tensor-, context- and pipeline-parallel) collectives of one
    micro-batch of ``micro`` sequences: each repeats once per micro-batch, so a step's are
    the accumulation steps times this. Their calls' sizes grow with b and NCCL's algorithm
    with the size, so this is the scalar planner's own figure at each b."""
    return sum(collective_time_s(request, c) for c in model_parallel_collectives(_at(request, micro, 1)) if c.blocking)


def _blocking_structure(request: PlanRequest) -> list | None:
    """The blocking collectives of one micro-batch as (what identifies the collective's calls,
    its call sizes per sequence, its call pricing): every call's size is b times that
    (activations of b sequences). None when a size is not (then each b is timed by
    _blocking_seconds)."""
    one = [c for c in model_parallel_collectives(_at(request, 1, 1)) if c.blocking]
    two = [c for c in model_parallel_collectives(_at(request, 2, 1)) if c.blocking]
    if len(one) != len(two):
        return None
    result = []
    for c1, c2 in zip(one, two):
        sizes1, sizes2 = _call_sizes(c1), _call_sizes(c2)
        if c1.occurrences_per_step != 1 or [(2 * s, n) for s, n in sizes1] != list(sizes2):
            return None
        # What identifies one call's price besides its size (the key of the layout's call cache).
        identity = (c1.op, c1.group_size, c1.ranks_per_node, c1.spans_nodes, c1.element_bytes)
        result.append((identity, sizes1, call_pricing(request, c1)))
    return result


def _call_price(identity: tuple, pricing, message_bytes: int, call_cache: dict) -> float:
    """Seconds of one call of ``message_bytes`` of the collective ``identity`` names (its
    pricing's), once per search (``call_cache``: the layouts' of the same _pricing_inputs)."""
    key = (identity, message_bytes)
    if key not in call_cache:
        call_cache[key] = pricing.call_seconds(message_bytes)[1]
    return call_cache[key]


def _structured_blocking_table(structure: list, distinct: tuple[tuple[int, ...], np.ndarray, bytes], call_cache: dict) -> np.ndarray:
    """_blocking_seconds from the structure at each of the distinct micro-batch sizes of a sweep
    (_distinct): each call of S bytes timed once per search (_call_price) by the call pricing
    collective_cost itself uses, summed as collective_cost sums its calls (per collective, then
    over them), over numpy arrays; each call size's prices at those sizes kept once
    (``call_cache``), shared by the layouts, rank classes and checkpointing policies whose
    blocking collectives make the same calls."""
    values, _, token = distinct
    total = np.zeros(len(values))
    for identity, sizes, pricing in structure:
        seconds = np.zeros(len(values))
        for size, calls in sizes:
            key = ("prices", identity, size, token)
            if key not in call_cache:
                call_cache[key] = np.array([_call_price(identity, pricing, size * micro, call_cache) for micro in values])
            seconds += calls * call_cache[key]
        total += seconds
    return total


def _rank_classes(request: PlanRequest) -> list[int]:
    """The first pipeline rank of each class of ranks holding the same kind of stages and the
    same usable memory (the same NCCL communicators), by rank."""
    parallel = request.parallel
    if parallel.pp == 1:
        return [0]
    seen, firsts = set(), []
    usables = pipeline_usable_bytes(request)
    for rank in range(parallel.pp):
        stages = request_rank_stages(request, rank)
        signature = (tuple((s.num_blocks, s.has_embedding, s.has_head) for s in stages), usables[rank])
        if signature not in seen:
            seen.add(signature)
            firsts.append(rank)
    return firsts


def _fit_class(request: PlanRequest, family: dict, layout_cache: dict) -> _RankClass | None:
    """The class's coefficients: memory from the scalar planner's terms at b in {1, 2} and a in
    {1, 2}, communication once per strategy and shard group (``family``: the data-parallel
    collectives and host copies do not depend on checkpointing; the group's check would catch
    it if they did); None when they are not exact."""
    parallel = request.parallel
    rank = parallel.pipeline_rank
    cls = _RankClass(rank=rank, request=request, usable_bytes=usable_memory_bytes(request))
    k = {a: in_flight_chunks(parallel, rank, a) for a in (1, 2)}
    fitted = {}
    for a in (1, 2):
        for b in (1, 2):
            at = _at(request, b, a)
            states, terms = _terms(at, family, layout_cache)
            moments = _moments(states, terms, a)
            # The pipeline's receive buffers grow with the accumulation, not with the chunks in
            # flight: fitted apart (_receive_bytes), added back per accumulation.
            received = pipeline_receive_buffer_bytes(at)
            # The first layer's activations are one block's share, a floor of the activations:
            # left out of the fit and added back exactly per b (_class_values).
            moments = moments - _first_layer_bytes(terms.activations, terms.activation_blocks, len(moments))
            cls.first_layer_blocks[a > 1] = terms.activation_blocks
            fitted[a, b] = (moments - _activation_mask(len(moments)) * received, states.host_bytes,
                            terms.activations - received)
    if k[1] != k[2]:
        # Activations = k x (one chunk's bytes) + the rest, for k chunks in flight; one chunk's
        # bytes from the two accumulations' k at each b.
        chunk = []
        for b in (1, 2):
            diff = fitted[2, b][2] - fitted[1, b][2]
            if diff % (k[2] - k[1]):
                return None
            chunk.append(diff // (k[2] - k[1]))
        cls.chunk_slope = chunk[1] - chunk[0]
        cls.chunk_intercept = chunk[0] - cls.chunk_slope
    cls.activation_moments = _activation_mask(len(fitted[1, 1][0]))
    cls.first_layer_shares = _first_layer_mask(len(fitted[1, 1][0]))
    cls.accumulators_fitted = {False: _accumulator_bytes(request, 1), True: _accumulator_bytes(request, 2)}
    cls.receives = {} if any(_receive_bytes(request, 1)) else None
    for accumulating, a in ((False, 1), (True, 2)):
        (one, host_bytes, _), (two, _, _) = fitted[a, 1], fitted[a, 2]
        chunk_one, chunk_two = cls.chunk_intercept + cls.chunk_slope, cls.chunk_intercept + 2 * cls.chunk_slope
        one = one - k[a] * chunk_one * cls.activation_moments
        two = two - k[a] * chunk_two * cls.activation_moments
        cls.moment_slopes[accumulating] = two - one
        cls.moment_intercepts[accumulating] = one - (two - one)
        activations_one, activations_two = fitted[a, 1][2], fitted[a, 2][2]
        cls.activation_slope[accumulating] = activations_two - activations_one
        cls.activation_intercept[accumulating] = activations_one - (activations_two - activations_one)
        # A load that runs out on the GPU (zeroplan.core.model_load) rules out every micro-batch
        # as the host does: neither moves with it.
        cls.host_fits[accumulating] = (host_memory_fits(request, host_bytes) is not False
                                       and load_fits_gpu(request, cls.usable_bytes))
    if ("phases", rank) not in family:
        family["phases", rank] = _phase_coefficients(request)
    cls.phase_intercepts_s, cls.phase_slopes_s = family["phases", rank]
    cls.cpu_optimizer_s = _optimizer_seconds(request, family)
    if not parallel.is_trivial:
        cls.blocking_structure, cls.call_seconds, cls.blocking_s = _blocking_caches(request, layout_cache)
    return cls


def _optimizer_seconds(request: PlanRequest, family: dict) -> float:
    """Offload's CPU optimizer step and the GPU's (a pipeline rank's): once per optimizer step,
    whatever the micro-batch, so once per strategy, shard group and rank (``family``)."""
    key = ("optimizer", request.parallel.pipeline_rank)
    if key not in family:
        family[key] = cpu_optimizer_time_s(request) + gpu_optimizer_time_s(request)
    return family[key]


def _blocking_caches(request: PlanRequest, layout_cache: dict) -> tuple[list | None, dict, dict]:
    """(_blocking_structure, the layout's seconds per blocking call, the seconds per micro-batch
    size) of a pipeline rank under a checkpointing policy, shared by the layout's groups."""
    rank, policy = request.parallel.pipeline_rank, request.training.activation_checkpointing
    # Policies that rerun the same collectives (none and selective: neither reruns a block's
    # collectives) make the same blocking calls: one structure for them.
    reruns = collective_recomputation(request)
    if ("structure", rank, reruns) not in layout_cache:
        layout_cache["structure", rank, reruns] = _blocking_structure(request)
    structure = layout_cache["structure", rank, reruns]
    # Policies whose blocking calls are the same (same collectives, same sizes) share their
    # seconds per micro-batch; without a structure each policy is timed on its own.
    calls = policy if structure is None else tuple((identity, tuple(sizes)) for identity, sizes, _ in structure)
    return structure, layout_cache.setdefault("call seconds", {}), layout_cache.setdefault(("blocking", rank, calls), {})


def _blocking_at(request: PlanRequest, structure: list | None, call_seconds: dict, per_size: dict,
                 distinct: tuple[tuple[int, ...], np.ndarray, bytes]) -> np.ndarray:
    """Seconds of the blocking collectives of one micro-batch at each micro-batch size of a
    sweep (``distinct``: _distinct of its micro-batches), laid out as the sweep: the structure's
    (_structured_blocking_table), else the scalar planner's own (_blocking_seconds);
    ``per_size`` keeps them (the layout's, per rank and calls: _blocking_caches), per sweep as
    _per_value keeps its arrays."""
    if structure is None:
        return _per_value(distinct, per_size, lambda b: _blocking_seconds(request, b))
    values, inverse, token = distinct
    if token not in per_size:
        per_size[token] = _structured_blocking_table(structure, distinct, call_seconds)
    return per_size[token][inverse]


def _build_group(request: PlanRequest, family: dict | None = None, layout_cache: dict | None = None) -> _Group:
    """``family``: what groups of the same layout, strategy and shard group share (model states,
    buffers, data-parallel communication); ``layout_cache``: what every group of the layout
    shares (activations, compute, blocking collectives per checkpointing policy)."""
    group = _start_group(request, family, layout_cache)
    _fit_group(group)
    return group


def _usable_bytes_and_spread(request: PlanRequest) -> tuple[int, int]:
    """(pipeline rank 0's usable memory, the most one rank's exceeds another's)."""
    usables = pipeline_usable_bytes(request)
    return usables[0], max(usables) - min(usables)


def _start_group(request: PlanRequest, family: dict | None = None, layout_cache: dict | None = None) -> _Group:
    """The group, its coefficients left to _compute_coefficients (compute) and _fit_group (memory
    and communication): the search computes them only for the groups its bounds do not rule
    out (memory_lower_bound, step_time_lower_bound)."""
    family = {} if family is None else family
    layout_cache = {} if layout_cache is None else layout_cache
    usable, spread = _usable_bytes_and_spread(request)
    return _Group(request=request, usable_bytes=usable, usable_spread_bytes=spread, family=family,
                  layout_cache=layout_cache)


def _compute_coefficients(group: _Group) -> None:
    """The group's compute coefficients (the layout's FLOPs per policy, compute_time_s at two
    micro-batch sizes); once."""
    if group.timed:
        return
    group.timed = True
    request, layout_cache = group.request, group.layout_cache
    policy = request.training.activation_checkpointing
    for micro in (1, 2):
        if ("flops", policy, micro) not in layout_cache:
            layout_cache["flops", policy, micro] = rank_flops(_at(request, micro, 1))
    one_pass = layout_cache["flops", policy, 1]
    # Compute is affine in b: the FLOPs are proportional to it, the memory-bound kernels
    # (zeroplan.core.timing.memory_bound_time_s) and the roofline's weight reads have a part
    # each micro-batch pays whatever its size (FSDP's copies, autocast's casts). Two sizes give
    # both coefficients; where a roofline kernel changes bound between sizes the group's check
    # (_fit_group) falls back to the scalar planner.
    forward_one, backward_one = compute_time_s(one_pass, _at(request, 1, 1))
    forward_two, backward_two = compute_time_s(layout_cache["flops", policy, 2], _at(request, 2, 1))
    group.forward_s_per_pass, group.backward_s_per_pass = 2 * forward_one - forward_two, 2 * backward_one - backward_two
    group.forward_s_per_micro, group.backward_s_per_micro = forward_two - forward_one, backward_two - backward_one
    group.model_flops_per_micro = one_pass.model_flops


def _scalar_only_by_rule(request: PlanRequest) -> bool:
    """Whether the group's memory is not affine in what the sweep varies, so the scalar planner
    answers every configuration of it."""
    # liger's chunk is a power of two in b*s (frameworks.fused_linear_cross_entropy_chunk_rows),
    # so its loss moments are not affine in the micro-batch: the scalar planner only.
    if request.training.fused_linear_cross_entropy:
        return True
    # Under torchtitan 9dec370 a pipeline stage keeps every micro-batch's output to the step's
    # end (activations.pipeline_stage_output_bytes): m outputs, not the chunks in flight.
    return (request.parallel.pp > 1 and request.training.framework is Framework.torchtitan
            and torchtitan_keeps_stage_outputs(request.training))


def _fit_group(group: _Group) -> None:
    """The group's exact coefficients of memory and communication per rank class, checked
    against the scalar planner at a point they were not fitted on (scalar planner only where
    they disagree); once."""
    if group.fitted:
        return
    group.fitted = True
    _compute_coefficients(group)
    request, family, layout_cache = group.request, group.family, group.layout_cache
    if _scalar_only_by_rule(request):
        group.scalar_only = True
        return
    for rank in _rank_classes(request):
        cls = _fit_class(_rank_request(group, rank), family, layout_cache)
        if cls is None:
            group.scalar_only = True
            return
        group.classes.append(cls)
    # Check the coefficients where they were not fitted, on each class's first rank (the one
    # that peaks for its class): every class's peak, and the peak and time of the class that
    # peaks; disagreement: scalar planner only.
    micro, accum = np.array([5]), np.array([3])
    values = _class_values(group, micro, accum)
    peak, _, seconds = _peaking(group, *values)
    allocated = values[0]
    scalar = [memory_breakdown(_at(cls.request, 5, 3))[0] for cls in group.classes]
    top = nearest_rank([b.peak_bytes for b in scalar], [cls.usable_bytes for cls in group.classes])
    at = _at(group.classes[top].request, 5, 3)
    scalar_s = pipeline_step_time(at, tuple(collectives(at))).step_with_overlap_s
    agree = all(abs(int(allocated[c, 0]) - b.allocated_peak_bytes) <= BYTE_TOLERANCE for c, b in enumerate(scalar))
    agree &= abs(int(peak[0]) - scalar[top].peak_bytes) <= BYTE_TOLERANCE and abs(float(seconds[0]) - scalar_s) <= TIME_TOLERANCE_S
    group.scalar_only = not agree


def _per_value(distinct: tuple[tuple[int, ...], np.ndarray, bytes], known: dict, compute) -> np.ndarray:
    """``compute(v)`` for each distinct value of an array (``distinct``: _distinct's values as
    ints, its inverse shaped as the array, and the values' bytes), laid out as the array;
    ``known`` keeps every value computed (shared by the groups that share it), so each is
    computed once, and the values' array under their bytes: the layout's groups sweep the same
    splits, so each finds the array the first built instead of looking up its values one by one."""
    values, inverse, token = distinct
    table = known.get(token)
    if table is None:
        for v in values:
            if v not in known:
                known[v] = compute(v)
        table = known[token] = np.array([known[v] for v in values])
    return table[inverse]


def _distinct(values: np.ndarray) -> tuple[tuple[int, ...], np.ndarray, bytes]:
    """np.unique of ``values`` (positive integers, as a tuple) with its inverse and its bytes (what
    _per_value keys its arrays by), computed once per sweep and shared by every rank class.
    Micro-batches and accumulations are small counts, so a table of which values occur replaces
    np.unique's sort where it is not much larger than the array. Kept by the array's contents
    (_DISTINCT) where it is short: the groups of a layout sweep the same splits, and the bounds
    and the sweep each ask of them, a few hundred times a search for a few dozen arrays."""
    if values.size > DISTINCT_KEPT_SIZE:
        return _uncached_distinct(values)
    key = (values.dtype.str, values.shape, values.tobytes())
    known = _DISTINCT.entries.get(key)
    if known is None:
        known = _uncached_distinct(values)
        known[1].flags.writeable = False  # shared by every caller: read (indexed by) only
        _DISTINCT.put(key, known)
    return known


_DISTINCT = KeptAnswers(256)
"""_distinct's answers by (dtype, shape, bytes) of the array."""
DISTINCT_KEPT_SIZE = 1024
"""Longest array whose _distinct is kept (what _DISTINCT holds stays a few MiB)."""


def _uncached_distinct(values: np.ndarray) -> tuple[tuple[int, ...], np.ndarray, bytes]:
    largest = int(values.max()) if values.size else 0
    if largest > 4 * values.size + 1024:
        distinct, inverse = np.unique(values, return_inverse=True)
        distinct = distinct.astype(np.int64)
        return tuple(distinct.tolist()), inverse.reshape(values.shape), distinct.tobytes()
    present = np.zeros(largest + 1, dtype=bool)
    present[values] = True
    position = np.cumsum(present) - 1
    distinct = np.flatnonzero(present).astype(np.int64)
    return tuple(distinct.tolist()), position[values], distinct.tobytes()


def _class_values(group: _Group, micro: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank class (rows) and configuration: allocated peak bytes, step seconds, host fits."""
    parallel = group.request.parallel
    accumulating = accum > 1
    micro64 = micro.astype(np.int64)
    passes = (micro * accum).astype(np.float64)
    accum_f = accum.astype(np.float64)
    forward_s = group.forward_s_per_micro * passes + group.forward_s_per_pass * accum_f
    backward_s = group.backward_s_per_micro * passes + group.backward_s_per_pass * accum_f
    # bubble_fraction: (p - 1)/(m v) of the busy time, m the accumulation steps.
    bubble = (parallel.pp - 1) / (accum_f * parallel.virtual_stages) if parallel.pp > 1 else np.zeros(micro.shape)
    n = len(_PHASES)
    distinct_micro = _distinct(micro) if not parallel.is_trivial else None
    distinct_accum = _distinct(accum) if any(cls.receives is not None for cls in group.classes) else None
    shape = (len(group.classes), micro.size)
    allocated = np.zeros(shape, dtype=np.int64)
    seconds = np.zeros(shape, dtype=np.float64)
    host_ok = np.ones(shape, dtype=bool)
    for c, cls in enumerate(group.classes):
        # Without a pipeline one chunk is in flight whatever the accumulation (in_flight_chunks).
        count = (in_flight_chunks(parallel, cls.rank, accum.astype(np.int64), minimum=np.minimum, maximum=np.maximum)
                 if parallel.pp > 1 else 1)
        in_flight = (count * (cls.chunk_intercept + cls.chunk_slope * micro64)).astype(np.int64)
        accumulators = _accumulators_by_rounds(cls, accum) if parallel.pp > 1 and parallel.virtual_stages > 1 else None
        receives = None
        if cls.receives is not None:
            at_b = _per_value(distinct_accum, cls.receives, lambda a, r=cls.request: _receive_bytes(r, a)).astype(np.int64)
            receives = at_b[..., 0] + (at_b[..., 1] - at_b[..., 0]) * (micro64 - 1)
        for flag in (False, True):
            rows = accumulating == flag
            moments = (cls.moment_intercepts[flag][:, None] + cls.moment_slopes[flag][:, None] * micro64[None, rows]
                       + cls.activation_moments[:, None] * in_flight[None, rows])
            if accumulators is not None:
                extra = accumulators[rows].astype(np.int64) - cls.accumulators_fitted[flag]
                moments = moments + _held_mask(len(cls.activation_moments))[:, None] * extra[None, :]
            if receives is not None:
                moments = moments + cls.activation_moments[:, None] * receives[rows][None, :]
            blocks = cls.first_layer_blocks[flag]
            if blocks:
                # _first_layer_bytes, its shares per moment taken once per class.
                per_block = (cls.activation_intercept[flag] + cls.activation_slope[flag] * micro64[rows]) // blocks
                moments = moments + cls.first_layer_shares[:, None] * per_block[None, :] \
                    + (cls.first_layer_shares[:, None] > 0) * (blocks - 1)
            allocated[c, rows] = moments.max(axis=0)
            if not cls.host_fits[flag]:
                host_ok[c, rows] = False
        phases = _phase_rows(cls, accumulating, accum_f)
        comm = dict(zip(_PHASES, phases[:n]))
        host = dict(zip(_PHASES, phases[n:]))
        exposed = exposed_communication_s(forward_s, backward_s, comm, host, maximum=np.maximum)
        if parallel.is_trivial:
            blocking = np.zeros(micro.shape)
        else:
            blocking = accum_f * _blocking_at(cls.request, cls.blocking_structure, cls.call_seconds, cls.blocking_s,
                                              distinct_micro)
        # step_time: compute, the blocking collectives, the bubble over both, what the compute
        # does not hide, the CPU step.
        busy = forward_s + backward_s + blocking
        seconds[c] = forward_s + backward_s + blocking + bubble * busy + exposed + cls.cpu_optimizer_s
    return allocated, seconds, host_ok


def _phase_rows(cls: _RankClass, accumulating: np.ndarray, accum_f: np.ndarray) -> list:
    """Each phase's seconds (_phase_seconds' order) at each accumulation (_phase_coefficients):
    a number where they are the same at every accumulation (one fit, no slope: most
    strategies' host copies and step-phase collectives, none or once a step), which the sweep's
    sums broadcast to the same figures, else the array."""
    rows = []
    for start, slope, start_more, slope_more in zip(
            cls.phase_intercepts_s[False].tolist(), cls.phase_slopes_s[False].tolist(),
            cls.phase_intercepts_s[True].tolist(), cls.phase_slopes_s[True].tolist()):
        if (start, slope) == (start_more, slope_more):
            rows.append(start + slope if slope == 0 else start + slope * accum_f)
        else:
            rows.append(np.where(accumulating, start_more + slope_more * accum_f, start + slope))
    return rows


def _vectorised(group: _Group, micro: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peak bytes, fits, step seconds) for arrays of micro-batch and accumulation steps: the
    pipeline rank class nearest to running out (as ``plan``: plan.nearest_rank), its time."""
    return _peaking(group, *_class_values(group, micro, accum))


def _peaking(group: _Group, allocated: np.ndarray, seconds: np.ndarray, host_ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_vectorised from the rank classes' values (_class_values)."""
    # int(allocated * fraction) truncates toward zero, as astype does.
    peaks = allocated + (allocated.astype(np.float64) * group.request.assumptions.allocator_reserve_fraction).astype(np.int64)
    headroom = np.array([cls.usable_bytes for cls in group.classes], dtype=np.int64)[:, None] - peaks
    peaking = headroom.argmin(axis=0)
    columns = np.arange(allocated.shape[1])
    fits = (headroom[peaking, columns] >= 0) & host_ok[peaking, columns]
    # Every pipeline rank waits for the slowest (plan.pipeline_step_time); the memory is the rank nearest to running out.
    return peaks[peaking, columns], fits, seconds.max(axis=0)


def memory_lower_bound(group: _Group, accum: np.ndarray) -> int | None:
    """A peak (allocated + reserve) no configuration of the group reaches below, at any of the
    accumulation counts ``accum`` and any micro-batch: the first pipeline rank's largest moment
    at micro-batch 1 and the fewest accumulation steps. Each moment's bytes grow with the
    micro-batch (activations, logits, workspace: the sweep's slopes) and with the accumulation
    steps (the chunks in flight, the gradients held across micro-batches), and the peak is the
    largest over the pipeline ranks, so no configuration of the group peaks below it. From
    the same model-state and activation terms the fit shares across the family and the layout
    (_terms), so a group the search then fits costs nothing more. None where the loss's
    moments are not affine in the micro-batch (liger's chunks: no bound taken)."""
    request = group.request
    if request.training.fused_linear_cross_entropy:
        return None
    first = _rank_request(group, 0)
    fewest = int(accum.min())
    # The model states and buffers at accumulation 1 or 2 (those of every accumulation past 1,
    # as the fit takes them: its check at 3 confirms it), so the family shares them with the
    # fit; the activations at the fewest steps, shared by the layout's strategies.
    state_at = _at(first, 1, min(fewest, 2))
    states, terms = _terms(state_at, group.family, group.layout_cache)
    if fewest > 2:
        # _terms gave state_at's activations: those at the fewest steps in their place.
        at = _at(first, 1, fewest)
        key = _activation_key(at)
        if key not in group.layout_cache:
            group.layout_cache[key] = micro_batch_terms(at)
        terms = with_terms(terms, group.layout_cache[key])
    allocated = max(moment_totals(states, terms, fewest))
    return allocated + int(allocated * request.assumptions.allocator_reserve_fraction)


TIME_BOUND_SLACK_S = 1e-6
"""What step_time_lower_bound leaves below its figure: more than the vectorised sweep and the
scalar planner may differ by (TIME_TOLERANCE_S) and than the rounding of their sums."""


# step_time: step = compute + blocking + bubble x (compute + blocking) + exposed + the CPU's and
# the GPU's optimizer steps, every term at least 0 (exposed_communication_s: each phase's link
# time past its compute, and the step phase's collectives and copies). Compute is the group's
# affine fit in the micro-batch (_compute_coefficients): the sweep uses it as it is, and under the flat-HFU
# compute model the scalar planner's compute_time_s is affine in b per micro-batch (executed
# FLOPs in proportion to b, memory-bound kernels with a part each pass pays whatever its size).
def step_time_lower_bound(group: _Group, micro: np.ndarray, accum: np.ndarray, collectives: bool = True) -> np.ndarray | None:
    """Per configuration (``micro``, ``accum``): seconds below which neither the sweep nor the
    scalar planner times its step, whichever pipeline rank peaks: compute, the blocking
    collectives of the rank class with the fewest, the pipeline bubble over both, and the
    least optimizer step of the rank classes; exposed communication taken as 0. None where no
    bound is taken: the roofline compute model (a kernel may change its bound between micro-batch
    sizes) and compiled blocks (compile_saved_seconds is taken off compute, which is clamped at
    0), whose compute need not be affine in b, and the groups the scalar planner answers by rule.
    ``collectives`` False: compute and the bubble over it alone (a looser bound, at no cost)."""
    request = group.request
    if (request.performance.compute_model == "roofline" or request.training.compile
            or _scalar_only_by_rule(request)):
        return None
    _compute_coefficients(group)
    parallel = request.parallel
    accum_f = accum.astype(np.float64)
    passes = (micro * accum).astype(np.float64)
    compute = ((group.forward_s_per_micro + group.backward_s_per_micro) * passes
               + (group.forward_s_per_pass + group.backward_s_per_pass) * accum_f)
    # bubble_fraction: (p - 1)/(m v) of the busy time, m the accumulation steps.
    bubble = (parallel.pp - 1) / (accum_f * parallel.virtual_stages) if parallel.pp > 1 else 0.0
    if not collectives:
        return compute * (1 + bubble) - TIME_BOUND_SLACK_S
    blocking, optimizer = None, None
    distinct = None if parallel.is_trivial else _distinct(micro)
    for at in _class_requests(group):
        optimizer = min(_optimizer_seconds(at, group.family), optimizer if optimizer is not None else np.inf)
        if parallel.is_trivial:
            continue
        structure, call_seconds, per_size = _blocking_caches(at, group.layout_cache)
        per_micro = _blocking_at(at, structure, call_seconds, per_size, distinct)
        blocking = accum_f * per_micro if blocking is None else np.minimum(blocking, accum_f * per_micro)
    blocking = 0.0 if blocking is None else blocking
    return (compute + blocking) * (1 + bubble) + optimizer - TIME_BOUND_SLACK_S


def _class_requests(group: _Group) -> list[PlanRequest]:
    """The request at each rank class's first pipeline rank (the group's own without a pipeline),
    the classes kept in the layout's cache."""
    request = group.request
    if request.parallel.pp == 1:
        return [request]
    if "rank classes" not in group.layout_cache:
        group.layout_cache["rank classes"] = _rank_classes(request)
    return [_rank_request(group, rank) for rank in group.layout_cache["rank classes"]]


def peak_lower_bounds(group: _Group, micro: np.ndarray, accum: np.ndarray) -> np.ndarray | None:
    """Per configuration: a peak (allocated + reserve) it does not reach below, the first
    pipeline rank's largest moment at its own micro-batch and accumulation (the peak is the
    largest over the ranks), as memory_lower_bound takes it at one configuration: the model
    states at accumulation 1 or 2 (those of every accumulation past 1), the activations at the
    configuration's. Without a pipeline, the peak the sweep finds. None where memory_lower_bound
    takes no bound."""
    request = group.request
    if request.training.fused_linear_cross_entropy:
        return None
    first = _rank_request(group, 0)
    fraction = request.assumptions.allocator_reserve_fraction
    states = {}
    result = []
    for b, a in zip(micro.tolist(), accum.tolist()):
        if min(a, 2) not in states:
            states[min(a, 2)] = _terms(_at(first, 1, min(a, 2)), group.family, group.layout_cache)
        state_bytes, state_terms = states[min(a, 2)]
        at = _at(first, b, a)
        key = _activation_key(at)
        if key not in group.layout_cache:
            group.layout_cache[key] = micro_batch_terms(at)
        allocated = max(moment_totals(state_bytes, with_terms(state_terms, group.layout_cache[key]), a))
        result.append(allocated + int(allocated * fraction))
    return np.array(result, dtype=np.int64)


def _bounded_out(group: _Group, micro: np.ndarray, accum: np.ndarray, peak_bound: int | None,
                 incumbents: "_Incumbents", compute_seconds: np.ndarray | None) -> np.ndarray | bool:
    """Whether the group's configurations can enter neither the ranking nor the Pareto front
    of the fitting ones found so far (``incumbents``), from bounds tried cheapest first: compute
    alone (``compute_seconds``: step_time_lower_bound without collectives, as the search ordered
    the groups by; None where no time bound is taken), then the step's collectives and optimizer step (step_time_lower_bound), then each
    configuration's own peak bound (peak_lower_bounds), which also sets aside the
    configurations that cannot fit; where none can, those peak bounds (the group cannot fit).
    The bounds are on pipeline rank 0's peak, judged against its own usable memory; the peak the
    ranking and the front compare is the rank nearest to running out, at least rank 0's less
    the spread of the ranks' usable memory."""
    if compute_seconds is None:
        return False
    reported_bound = None if peak_bound is None else peak_bound - group.usable_spread_bytes
    if incumbents.excludes(reported_bound, compute_seconds):
        return True
    seconds = step_time_lower_bound(group, micro, accum)
    if incumbents.excludes(reported_bound, seconds):
        return True
    peaks = peak_lower_bounds(group, micro, accum)
    if peaks is None:
        return False
    may_fit = peaks <= group.usable_bytes
    if not may_fit.any():
        return peaks
    return incumbents.excludes(peaks[may_fit] - group.usable_spread_bytes, seconds[may_fit])


def evaluate(group: _Group, micro: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peak bytes, fits, step seconds): vectorised, or the scalar planner where it must."""
    _compute_coefficients(group)
    if not group.scalar_only:
        _fit_group(group)
    if not group.scalar_only:
        return _vectorised(group, micro, accum)
    peaks, fits, seconds = [], [], []
    for b, a in zip(micro.tolist(), accum.tolist()):
        if (b, a) not in group.cache:
            group.cache[(b, a)] = _scalar_plan_usable(_at(group.request, b, a))
        peak, fit, time, _ = group.cache[(b, a)]
        peaks.append(peak), fits.append(fit), seconds.append(time.step_with_overlap_s)
    return np.array(peaks, dtype=np.int64), np.array(fits, dtype=bool), np.array(seconds, dtype=np.float64)
def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _shard_groups(kind: StrategyKind, ranks: int) -> list[int | None]:
    """HSDP: every group size that divides the ranks holding the same parameters (dp x cp),
    strictly between 1 and all of them."""
    if kind is not StrategyKind.hsdp:
        return [None]
    return [d for d in divisors(ranks) if 1 < d < ranks]


_FLAGS = {"tp": "--tp", "pp": "--pp", "cp": "--cp"}


def layout_requests(base: PlanRequest, space: LayoutSpace) -> list[PlanRequest]:
    """``base`` under every model-parallel layout of ``space`` the rules of
    zeroplan.specs.parallel.check_parallel accept (a layout they refuse is skipped): tp over the
    divisors of the GPUs per node (sequence parallel on when tp > 1), pp over the divisors of
    the GPUs (1F1B, and interleaved 1F1B with two stages per rank), cp 1 (2 and 4 too from
    LONG_SEQUENCE tokens on). A degree ``space`` fixes that yields no layout is refused in one
    line naming its flag and the values that would."""
    framework = base.training.framework
    fixed = {name: getattr(space, name) for name in _FLAGS if getattr(space, name) is not None}
    if not space.model_parallel or framework.value not in MODEL_PARALLEL_FRAMEWORKS:
        for name, value in fixed.items():
            if value > 1:
                if not space.model_parallel:
                    raise ZeroplanError(_FLAGS[name], f"{value} with {space.data_parallel_only_by} (allowed: 1)")
                raise ZeroplanError(
                    _FLAGS[name], f"{value}: model parallelism is not modelled for {framework.value} "
                    f"(allowed: 1, or --framework {' or '.join(MODEL_PARALLEL_FRAMEWORKS)})",
                )
        if space.model_parallel:
            # A schedule or a bound the search would not read (the user expects it to act).
            for flag, given in (("--pp-schedule", "pp_schedules" in space.model_fields_set), ("--max-tp", space.max_tp is not None)):
                if given:
                    raise ZeroplanError(flag, f"model parallelism is not modelled for {framework.value} (allowed: leave "
                                              f"it out, or --framework {' or '.join(MODEL_PARALLEL_FRAMEWORKS)})")
        return [base.with_parallel(ParallelSpec())]
    world, per_node = base.cluster.world_size, base.cluster.gpus_per_node
    result = _layouts(base, space)
    if not result and fixed:
        for name, value in fixed.items():
            degrees = divisors(per_node) if name == "tp" else divisors(world)
            # Each alternative is tried without this error path: asking layout_requests again
            # would, with another fixed degree that yields nothing, recurse without end.
            allowed = [d for d in degrees if d != value and _layouts(base, space.model_copy(update={name: d}))]
            if value not in allowed:
                raise ZeroplanError(
                    _FLAGS[name], f"{value} gives no layout of {world} GPUs ({per_node} per node) for this model "
                    f"and --seq-len (allowed: {', '.join(map(str, allowed)) or 'none with the other degrees given'})",
                )
        raise ZeroplanError(
            ", ".join(_FLAGS[n] for n in fixed), "these degrees together give no layout of "
            f"{world} GPUs (allowed: tp x cp x pp dividing {world}, tp dividing {per_node})",
        )
    return result


def _layouts(base: PlanRequest, space: LayoutSpace) -> list[PlanRequest]:
    """Every layout of ``space`` the rules accept (layout_requests' enumeration, no errors)."""
    world, per_node = base.cluster.world_size, base.cluster.gpus_per_node
    tps = [space.tp] if space.tp is not None else [d for d in divisors(per_node) if d <= (space.max_tp or per_node)]
    long_sequence = base.batch.seq_len >= LONG_SEQUENCE
    cps = [space.cp] if space.cp is not None else [1, *(CONTEXT_PARALLEL_DEGREES if long_sequence else ())]
    pps = [space.pp] if space.pp is not None else divisors(world)
    result = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                for schedule in (PipelineSchedule.one_f_one_b,) if pp == 1 else space.pp_schedules:
                    try:
                        spec = ParallelSpec(tp=tp, sequence_parallel=tp > 1, cp=cp, pp=pp, pp_schedule=schedule,
                                            virtual_stages=INTERLEAVED_VIRTUAL_STAGES if schedule.interleaved and pp > 1 else 1)
                        # Built at pp micro-batches, which every schedule runs: the search moves
                        # each layout to its own (micro-batch, accumulation) splits, and drops
                        # those the schedule refuses (_schedulable).
                        batch = kept_copy(base.batch, grad_accum_steps=pp)
                        result.append(revalidated(base, parallel=spec, batch=batch))
                    except (ZeroplanError, ValidationError):
                        continue  # a layout the rules refuse: not searched
    return result


def _pricing_inputs(request: PlanRequest) -> tuple:
    """What a collective's call pricing (zeroplan.core.algorithms.call_pricing) reads of the
    request besides the collective itself (its op, group, ranks per node, whether it spans
    nodes: the identity _blocking_structure keys its calls by): the GPU, the GPUs per node, the
    NCCL algorithm and bandwidth assumed."""
    return (request.cluster.gpu, request.cluster.gpus_per_node, request.performance.algorithm, request.performance.bandwidth)


def _layout_groups(layout: PlanRequest, kinds: tuple[StrategyKind, ...], prices: dict | None = None) -> list[_Group]:
    """Every (strategy, checkpointing, shard group) the framework runs under one layout.
    ``prices``: the blocking calls' seconds shared by the layouts of one search (per
    _pricing_inputs; the layouts make the same calls at many sizes)."""
    prof = profile(layout.training.framework)
    result = []
    prices = {} if prices is None else prices
    layout_cache: dict = {"call seconds": prices.setdefault(_pricing_inputs(layout), {})}
    for kind in kinds:
        if layout.parallel.pp > 1 and kind.value not in PIPELINE_STRATEGIES:
            continue  # zeroplan.specs.parallel.check_parallel refuses it under a pipeline
        for shard in _shard_groups(kind, layout.state_group_size):
            # The same strategy and training objects for every layout (kept_copy): the planner's
            # caches key on them and meet one object by identity, not an equal copy field by field.
            strategy = kept_copy(layout.strategy, kind=kind, shard_group_size=shard)
            try:
                strategic = layout.with_strategy(strategy)
            except (ZeroplanError, ValidationError):
                continue  # a combination the rules refuse: not searched
            family: dict = {}
            for policy in prof.checkpointing:
                if policy is ActivationCheckpointing.selective_layer and layout.training.selective_layer_interval > layout.model.num_layers:
                    continue  # it would checkpoint no block: the same as none
                if not runs_checkpointing(layout.training, policy, layout.parallel):
                    continue  # compiled under a policy that was not measured (zeroplan.core.compiled)
                training = kept_copy(strategic.training, activation_checkpointing=policy)
                result.append(_start_group(strategic.model_copy(update={"training": training}), family, layout_cache))
    return result


def on_flat_reserve(request: PlanRequest) -> PlanRequest:
    """The request judged on its allocated peak plus the flat reserve: millions of
    configurations cannot each be replayed through the caching-allocator model, so the search
    judges on the flat reserve and asks the model about each configuration it reports (_answered)."""
    return request.with_allocator_conf(None)


def groups(
    base: PlanRequest, strategies: tuple[StrategyKind, ...] | None = None, space: LayoutSpace | None = None,
    global_batch_size: int | None = None,
) -> list[_Group]:
    """Every (layout, strategy, checkpointing, shard group) the request's framework runs: the
    request's own layout, or every layout of ``space`` (those whose data-parallel ranks divide
    ``global_batch_size`` when it is given)."""
    base = on_flat_reserve(base)
    framework = base.training.framework
    world = base.cluster.world_size
    kinds = framework_strategies(framework, world) if strategies is None else strategies
    check_framework_strategies(framework, kinds, world)
    layouts = [base] if space is None else layout_requests(base, space)
    result = []
    prices: dict = {}
    for layout in layouts:
        if global_batch_size is None or global_batch_size % layout.data_parallel_size == 0:
            result += _layout_groups(layout, kinds, prices)
    for group in result:
        _fit_group(group)
    return result


def batch_splits(global_batch_size: int, data_parallel_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (micro-batch, accumulation) with micro * accum * ranks == the global batch."""
    if global_batch_size % data_parallel_size:
        raise ZeroplanError(
            "global-batch",
            f"{global_batch_size} is not a multiple of the {data_parallel_size} data-parallel ranks "
            f"(allowed: multiples of {data_parallel_size})",
        )
    per_rank = global_batch_size // data_parallel_size
    micro = np.array(divisors(per_rank), dtype=np.int64)
    return micro, per_rank // micro


def _candidate(group: _Group, micro: int, accum: int, peak: int, seconds: float, time: StepTime | None = None,
               usable_bytes: int | None = None) -> PlanCandidate:
    """``usable_bytes``: that of the pipeline rank reported (rank 0's where not given)."""
    _compute_coefficients(group)
    r = group.request
    p = r.parallel
    parts = {} if time is None else dict(
        compute_s=time.compute_s, exposed_communication_s=time.exposed_communication_s,
        host_transfer_s=time.host_transfer_s, cpu_optimizer_s=time.cpu_optimizer_s,
        optimizer_step_s=time.optimizer_step_s, model_parallel_communication_s=time.model_parallel_communication_s,
        pipeline_bubble_s=time.pipeline_bubble_s)
    return PlanCandidate(
        **parts,
        strategy=r.strategy.kind, activation_checkpointing=r.training.activation_checkpointing,
        shard_group_size=r.shard_group_size, micro_batch_size=micro, grad_accum_steps=accum,
        peak_bytes=peak, usable_memory_bytes=group.usable_bytes if usable_bytes is None else usable_bytes,
        step_time_s=seconds,
        # step_time: a model-parallel group's ranks share its tokens.
        tokens_per_s_per_gpu=micro * accum * r.batch.seq_len / p.model_parallel_size / seconds,
        model_flops_utilization=model_flops_utilization(
            group.model_flops_per_micro * micro * accum, seconds, r.cluster.gpu.peak_bf16_flops_per_s,
        ),
        tp=p.tp, sequence_parallel=p.sequence_parallel, cp=p.cp, pp=p.pp, pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages, dp=r.data_parallel_size,
    )


def _verified(group: _Group, micro: int, accum: int) -> PlanCandidate | None:
    """The scalar planner's answer for one configuration (None if it does not fit)."""
    peak, fits, time, usable = _scalar_plan_usable(_at(group.request, micro, accum))
    return _candidate(group, micro, accum, peak, time.step_with_overlap_s, time, usable) if fits else None


def pareto_indices(peak: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both peak and time, by increasing peak."""
    order = np.lexsort((seconds, peak))
    front, best = [], np.inf
    for i in order.tolist():
        if seconds[i] < best:
            front.append(i)
            best = seconds[i]
    return np.array(front, dtype=np.int64)


def _schedulable(
    all_groups: list[_Group], splits: list[tuple[np.ndarray, np.ndarray]], global_batch_size: int,
) -> tuple[list[_Group], list[tuple[np.ndarray, np.ndarray]]]:
    """The groups and splits less the accumulation counts a group's pipeline schedule refuses
    (pipeline_microbatch_rule: torch's 1F1B needs a micro-batch per stage, interleaved 1F1B a
    count its rounds divide, megatron-core's interleaved schedule a multiple of pp); a group left
    without a split is dropped."""
    kept_groups, kept_splits = [], []
    # The rule reads the layout, the framework and the count alone: asked once per layout and
    # splits, not once per group (a layout's strategies and policies share both).
    ruled: dict[tuple, np.ndarray] = {}
    for group, (micro, accum) in zip(all_groups, splits):
        parallel = group.request.parallel
        if parallel.pp > 1:
            framework = group.request.training.framework.value
            key = (parallel, framework, accum.tobytes())
            runs = ruled.get(key)
            if runs is None:
                runs = ruled[key] = np.array([pipeline_microbatch_rule(parallel, framework, int(a)) is None
                                              for a in accum.tolist()], dtype=bool)
            micro, accum = micro[runs], accum[runs]
        if len(micro):
            kept_groups.append(group)
            kept_splits.append((micro, accum))
    if not kept_groups:
        raise ZeroplanError(
            "global-batch", f"{global_batch_size} gives no accumulation count the pipeline schedules searched run "
            "(allowed: a batch with at least pp micro-batches per data-parallel rank, e.g. a larger --global-batch)",
        )
    return kept_groups, kept_splits


def _splits(all_groups: list[_Group], global_batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each group's (micro-batch, accumulation) splits over its layout's data-parallel ranks."""
    by_ranks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    result = []
    for group in all_groups:
        ranks = group.request.data_parallel_size
        if ranks not in by_ranks:
            by_ranks[ranks] = batch_splits(global_batch_size, ranks)
        result.append(by_ranks[ranks])
    return result


def _searched_groups(
    base: PlanRequest, global_batch_size: int, strategies: tuple[StrategyKind, ...] | None, space: LayoutSpace | None,
) -> tuple[list[_Group], int]:
    """The groups of every layout whose data-parallel ranks divide the global batch, and how
    many layouts that is; the one-line batch error when none does."""
    base = on_flat_reserve(base)
    layouts = [base] if space is None else layout_requests(base, space)
    usable = [r for r in layouts if global_batch_size % r.data_parallel_size == 0]
    if not usable:
        smallest = min(r.data_parallel_size for r in layouts)
        if len(layouts) == 1:
            batch_splits(global_batch_size, smallest)
        raise ZeroplanError(
            "global-batch", f"{global_batch_size} splits over the data-parallel ranks of none of the "
            f"{len(layouts)} layouts (allowed: multiples of {smallest})",
        )
    framework = base.training.framework
    world = base.cluster.world_size
    kinds = framework_strategies(framework, world) if strategies is None else strategies
    check_framework_strategies(framework, kinds, world)
    prices: dict = {}
    all_groups = [g for layout in usable for g in _layout_groups(layout, kinds, prices)]
    if not all_groups:
        raise ZeroplanError(
            "strategies", f"none of {', '.join(k.value for k in kinds)} runs under the layouts searched "
            f"(allowed under pipeline parallelism: {', '.join(PIPELINE_STRATEGIES)})",
        )
    return all_groups, len(usable)


def search(
    base: PlanRequest, global_batch_size: int, strategies: tuple[StrategyKind, ...] | None = None, top: int = 10,
    space: LayoutSpace | None = None, show_progress: bool = False, prune: bool = True, answer_pareto: bool = True,
) -> PlanSearchResult:
    """Rank every fitting configuration of ``base`` at ``global_batch_size`` by step time: under
    the request's own layout, or under every layout of ``space``. ``show_progress`` draws the
    groups done on stderr when it is a terminal and the search runs past a second (zeroplan.progress).
    ``prune``: branch and bound (the same ranking and Pareto front): leave unfitted the groups
    memory_lower_bound shows cannot fit, and those step_time_lower_bound and memory_lower_bound
    show can enter neither the ranking nor the Pareto front (their configurations are counted
    as bounded out); False fits every group (the exhaustive search, as tests/test_search_pruning.py
    compares). ``answer_pareto`` False: the Pareto rows that are not also ranked are left without
    the caching-allocator model's answer (allocator_fits None), for a caller that shows the
    ranked rows alone (zeroplan plan's first screen); each answer is a replay of every pipeline
    rank's step."""
    if base.parallel.device_map is not None:
        # The search's vectorised step time and bounds read pipeline bubbles and in-flight
        # micro-batches of torch's schedules, not a device map's one-GPU-at-a-time step.
        raise ZeroplanError("parallel.device_map", "is planned by fit and compare, not searched "
                            "(allowed: no device map in a plan search)")
    with cyclic_gc_paused():
        return _search(base, global_batch_size, strategies, top, space, show_progress, prune, answer_pareto)


class _Incumbents:
    """The fitting configurations the search has evaluated so far (peak, step seconds): the
    bar a group's bounds must pass to be worth evaluating."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.peaks = np.zeros(0, dtype=np.int64)
        self.seconds = np.zeros(0, dtype=np.float64)

    def add(self, peaks: np.ndarray, seconds: np.ndarray) -> None:
        self.peaks = np.concatenate([self.peaks, peaks])
        self.seconds = np.concatenate([self.seconds, seconds])
        self._bar = None

    _bar: tuple | None = None
    """(the top-th fastest time, the peaks sorted, the running fastest time by peak) of the
    configurations found, from the last add to the next (most groups are tested between two)."""

    def _bars(self) -> tuple:
        if self._bar is None:
            kth = np.partition(self.seconds, self.top - 1)[self.top - 1] if 0 < self.top <= self.seconds.size else None
            by_peak = np.argsort(self.peaks, kind="stable")
            running = np.concatenate([[np.inf], np.minimum.accumulate(self.seconds[by_peak])])
            self._bar = kth, self.peaks[by_peak], running
        return self._bar

    def excludes(self, peak_bound: int | np.ndarray | None, seconds_bound: np.ndarray) -> bool:
        """Whether no configuration of a group can enter the ranking (``top`` fastest, by time,
        then peak, then the order of the groups) nor the Pareto front (pareto_indices), when
        each peaks at ``peak_bound`` or more (one for all, or one each) and takes at least
        ``seconds_bound`` (one each): every one is slower than the ``top`` fastest already
        found, and one found beats it on peak and is no slower, or peaks no higher and is faster
        (so it comes before it in pareto_indices' order and is no slower: it is off the front). The
        configurations found are a subset of all, so the ranking's last time only falls and the
        front only moves towards them."""
        if 0 < self.top and self.seconds.size < self.top:
            return False
        kth, sorted_peaks, running = self._bars()
        if kth is not None and (seconds_bound <= kth).any():
            return False
        if seconds_bound.size == 0:
            return True
        if not self.peaks.size:
            return False
        peaks = np.broadcast_to(np.asarray(0 if peak_bound is None else peak_bound, dtype=np.int64), seconds_bound.shape)
        # The fastest found at each peak or below, by peak: the fastest found below a bound p
        # is the running minimum up to the last peak < p, no higher up to the last <= p.
        fastest_lower = running[np.searchsorted(sorted_peaks, peaks, side="left")]
        fastest_no_higher = running[np.searchsorted(sorted_peaks, peaks, side="right")]
        return bool(np.all((fastest_lower <= seconds_bound) | (fastest_no_higher < seconds_bound)))


def _search(base: PlanRequest, global_batch_size: int, strategies: tuple[StrategyKind, ...] | None, top: int,
            space: LayoutSpace | None, show_progress: bool, prune: bool, answer_pareto: bool = True) -> PlanSearchResult:
    all_groups, layouts = _searched_groups(base, global_batch_size, strategies, space)
    all_groups, splits = _schedulable(all_groups, _splits(all_groups, global_batch_size), global_batch_size)
    results: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * len(all_groups)
    bounded_out = 0
    with steps(2 * len(all_groups), "plan: groups", enabled=show_progress) as bar:
        pending = []
        for g, (group, (micro, accum)) in enumerate(zip(all_groups, splits)):
            bound = memory_lower_bound(group, accum) if prune else None
            if bound is not None and bound > group.usable_bytes:
                # The memory lower bound passes the usable memory, so nothing of the group fits:
                # it can enter neither the ranking nor the Pareto front nor the count of those that
                # fit; its configurations are counted as searched, none as fitting, as the sweep
                # would find.
                group.ruled_out = True
                bar.update(2)
            else:
                seconds = step_time_lower_bound(group, micro, accum, collectives=False) if prune else None
                pending.append((-np.inf if seconds is None else float(seconds.min()), g, bound, seconds))
                bar.update()
        # The groups that may be fastest first, so that the bar the others must pass rises early;
        # those without a time bound first of all.
        pending.sort(key=lambda item: item[0])
        incumbents = _Incumbents(top)
        for _, g, bound, seconds in pending:
            micro, accum = splits[g]
            left_out = prune and _bounded_out(all_groups[g], micro, accum, bound, incumbents, seconds)
            if isinstance(left_out, np.ndarray):
                # No configuration fits (each peak bound passes the usable memory): searched,
                # none fitting, as for the memory lower bound above.
                all_groups[g].ruled_out = True
            elif left_out:
                bounded_out += micro.size
            else:
                results[g] = peak, fit, s = evaluate(all_groups[g], micro, accum)
                incumbents.add(peak[fit], s[fit])
            bar.update()
    # The evaluated groups in the order of the groups, so ties fall as the exhaustive search's
    # (those ruled out hold no fitting configuration: counted as searched, none fitting; where
    # every group is, nothing fits).
    kept = [g for g, result in enumerate(results) if result is not None]
    index_a = np.concatenate([np.full(splits[g][0].shape, g) for g in kept] or [np.zeros(0, dtype=np.int64)])
    micro_a, accum_a = (np.concatenate([splits[g][k] for g in kept] or [np.zeros(0, dtype=np.int64)]) for k in range(2))
    peak_a, fit_a, seconds_a = (np.concatenate([results[g][k] for g in kept] or [np.zeros(0, dtype=dtype)])
                                for k, dtype in enumerate((np.int64, bool, np.float64)))
    searched = sum(micro.size for micro, _ in splits)
    fitting = np.flatnonzero(fit_a)
    # Fastest first; among equal times the smaller peak.
    order = fitting[np.lexsort((peak_a[fitting], seconds_a[fitting]))]

    checked: dict[int, PlanCandidate | None] = {}

    def verified(i: int) -> PlanCandidate | None:
        """The scalar planner's answer, or None when it disagrees with the sweep; once per
        configuration (the fastest is on the Pareto front too)."""
        if i not in checked:
            checked[i] = verified_afresh(i)
        return checked[i]

    def verified_afresh(i: int) -> PlanCandidate | None:
        candidate = _verified(all_groups[int(index_a[i])], int(micro_a[i]), int(accum_a[i]))
        if candidate is None:
            return None
        if abs(candidate.peak_bytes - int(peak_a[i])) > BYTE_TOLERANCE or abs(candidate.step_time_s - float(seconds_a[i])) > TIME_TOLERANCE_S:
            return None
        return candidate

    front = fitting[pareto_indices(peak_a[fitting], seconds_a[fitting])] if len(fitting) else fitting
    ranked = tuple(verified(i) for i in order[:top].tolist())
    pareto = tuple(verified(i) for i in front.tolist())
    if any(c is None for c in ranked + pareto):
        # The vectorised sweep and the scalar planner disagree: rank with the scalar one.
        for group in all_groups:
            group.scalar_only = True
        return search_with_groups(base, global_batch_size, all_groups, splits, top, layouts, show_progress, answer_pareto)
    def request_of(i: int) -> PlanRequest:
        return _at(all_groups[int(index_a[i])].request, int(micro_a[i]), int(accum_a[i]))

    asked: dict[PlanRequest, tuple[bool, int]] = {}
    ranked = _answered(ranked, [request_of(i) for i in order[:top].tolist()], base, asked)
    pareto = _answered(pareto, [request_of(i) for i in front.tolist()], base, asked, ask=answer_pareto)
    best = ranked[0] if ranked else None
    caution = allocator_caution(ranked, base)
    return PlanSearchResult(
        global_batch_size=global_batch_size, seq_len=base.batch.seq_len, num_gpus=base.cluster.world_size,
        layouts_searched=layouts, groups_searched=len(all_groups),
        configurations_evaluated=searched, configurations_fitting=len(fitting), configurations_bounded_out=bounded_out,
        ranked=ranked, pareto=pareto, best=best, explanation=explain(best, ranked, searched, global_batch_size) + caution,
        allocator_caution=caution,
    )


def search_with_groups(
    base: PlanRequest, global_batch_size: int, all_groups: list[_Group], splits: list[tuple[np.ndarray, np.ndarray]],
    top: int, layouts: int = 1, show_progress: bool = False, answer_pareto: bool = True,
) -> PlanSearchResult:
    """The same ranking with every group on the scalar planner."""
    rows = []
    swept = progress(zip(all_groups, splits), len(all_groups), "plan: groups (scalar planner)", enabled=show_progress)
    for group, (micro, accum) in swept:
        if group.ruled_out:
            continue  # cannot fit (memory_lower_bound): no row, on either planner
        peak, fit, s = evaluate(group, micro, accum)
        rows += [(s[k], group, int(micro[k]), int(accum[k]), int(peak[k])) for k in range(len(micro)) if fit[k]]
    rows.sort(key=lambda r: (r[0], r[4]))
    candidates = [_candidate(g, b, a, p, s, *g.cache[(b, a)][2:]) for s, g, b, a, p in rows]
    asked: dict[PlanRequest, tuple[bool, int]] = {}
    ranked = _answered(tuple(candidates[:top]), [_at(g.request, b, a) for _, g, b, a, _ in rows[:top]], base, asked)
    if candidates:
        front = pareto_indices(np.array([c.peak_bytes for c in candidates]), np.array([c.step_time_s for c in candidates]))
        pareto = _answered(tuple(candidates[i] for i in front.tolist()),
                           [_at(rows[i][1].request, rows[i][2], rows[i][3]) for i in front.tolist()], base, asked,
                           ask=answer_pareto)
    else:
        pareto = ()
    best = ranked[0] if ranked else None
    evaluated = sum(len(micro) for micro, _ in splits)
    caution = allocator_caution(ranked, base)
    return PlanSearchResult(
        global_batch_size=global_batch_size, seq_len=base.batch.seq_len, num_gpus=base.cluster.world_size,
        layouts_searched=layouts, groups_searched=len(all_groups),
        configurations_evaluated=evaluated, configurations_fitting=len(candidates), ranked=ranked,
        pareto=pareto, best=best, explanation=explain(best, ranked, evaluated, global_batch_size) + caution,
        allocator_caution=caution,
    )


def modelled_allocator_conf(base: PlanRequest) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF fit would judge the search's configurations under: the
    request's own, else the framework launcher's for its node count (launch_allocator_conf), else
    PyTorch's defaults."""
    if base.assumptions.allocator_conf is not None:
        return base.assumptions.allocator_conf
    return launch_allocator_conf(base.training.framework, base.cluster.num_nodes) or ""


def _answered(candidates: tuple[PlanCandidate, ...], requests: list[PlanRequest], base: PlanRequest,
              asked: dict[PlanRequest, tuple[bool, int]], ask: bool = True) -> tuple[PlanCandidate, ...]:
    """The reported candidates with the caching-allocator model's verdict and peak on each
    (zeroplan.core.plan.allocator_answer), under the PYTORCH_CUDA_ALLOC_CONF fit would judge
    them under (modelled_allocator_conf):
    the search ranks on the flat reserve, but a configuration it shows says what the model
    finds. ``asked`` keeps the answers a table shares with another (ranked and Pareto); ``ask``
    False: only those, the other candidates left unasked (allocator_fits None)."""
    conf = modelled_allocator_conf(base)
    out = []
    for candidate, request in zip(candidates, requests):
        modelled = request.with_allocator_conf(conf)
        if modelled not in asked:
            if not ask:
                out.append(candidate)
                continue
            asked[modelled] = allocator_answer(modelled)
        fits, peak = asked[modelled]
        out.append(candidate.model_copy(update={"allocator_fits": fits, "allocator_peak_bytes": peak}))
    return tuple(out)


def allocator_caution(ranked: tuple[PlanCandidate, ...], base: PlanRequest) -> str:
    """Where the caching-allocator model finds the best configuration's step (``ranked``,
    fastest first, each answered by _answered) running out of memory though the flat reserve
    ranked it as fitting: what it would reserve, and the first of the others shown whose step
    the model lets complete; '' otherwise."""
    if not ranked or ranked[0].allocator_fits is not False:
        return ""
    best = ranked[0]
    conf = modelled_allocator_conf(base)
    settings = f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "default settings"
    caution = (f" Caution: for #1, PyTorch's caching allocator (modelled, {settings}) runs out of the "
               f"{best.usable_memory_bytes / 2**30:.1f} GiB usable (it would reserve {best.allocator_peak_bytes / 2**30:.1f} "
               f"GiB on a larger GPU; the flat {base.assumptions.allocator_reserve_fraction:.0%} reserve is too little here)")
    completing = next((rank for rank, c in enumerate(ranked[1:], start=2) if c.allocator_fits), None)
    if completing is not None:
        caution += f"; under the model #{completing} completes"
    elif len(ranked) > 1:
        caution += f"; under the model none of #2 to #{len(ranked)} completes"
    return caution + "; zeroplan fit takes a configuration's verdict on the allocator model (docs/validation.md)."


def layout_name(c: PlanCandidate) -> str:
    """'tp 8 (sp) x pp 4 (1f1b) x dp 2', the degrees above 1 and dp; 'dp N' for data parallelism alone."""
    parts = []
    if c.tp > 1:
        parts.append(f"tp {c.tp}{' (sp)' if c.sequence_parallel else ''}")
    if c.cp > 1:
        parts.append(f"cp {c.cp}")
    if c.pp > 1:
        schedule = c.pp_schedule.value + (f", v {c.virtual_stages}" if c.virtual_stages > 1 else "")
        parts.append(f"pp {c.pp} ({schedule})")
    return " x ".join([*parts, f"dp {c.dp}"])


def explain(best: PlanCandidate | None, ranked: tuple[PlanCandidate, ...], evaluated: int, global_batch_size: int) -> str:
    if best is None:
        return (
            f"Nothing fits: none of the {evaluated} configurations at global batch {global_batch_size} "
            f"fits on the GPU (try more GPUs, a shorter --seq-len or a smaller model)."
        )
    runner = next((c for c in ranked[1:] if c.strategy is not best.strategy), None)
    than = ""
    if runner is not None:
        gain = runner.step_time_s / best.step_time_s - 1
        than = (
            f", {gain:.1%} faster than the best {runner.strategy.value}" if gain >= 0.0005
            else f", tied on time with {runner.strategy.value} ({runner.peak_bytes / 2**30:.1f} GiB)"
        )
    layout = f"{layout_name(best)}, " if best.parallel.model_parallel_size > 1 else ""
    return (
        f"Best: {layout}{best.strategy.value}, activation checkpointing {best.activation_checkpointing.value}, "
        f"micro-batch {best.micro_batch_size} x {best.grad_accum_steps} accumulation: "
        f"{best.step_time_s:.3f} s per step, {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"{best.peak_bytes / 2**30:.1f} GiB of {best.usable_memory_bytes / 2**30:.1f} GiB usable{than}."
    )
