"""Pipeline parallelism: which blocks each stage holds, which stages each rank runs, how many
micro-batches' activations a rank keeps at its peak under each schedule, the bubble, and the
activations and gradients sent between stages.

Symbols: p the pipeline degree (ranks), v stages per rank (virtual stages), m micro-batches per
step (BatchSpec.grad_accum_steps: a pipeline runs the step's micro-batches through its stages),
L blocks, r a pipeline rank (0 = the first stage).
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from zeroplan.core.parallel.device_map import device_shares
from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.request import PlanRequest


@frozen
class Stage:
    """One pipeline stage: a run of consecutive blocks, and the embedding or the head if it is
    the first or the last."""

    index: int
    first_block: int
    num_blocks: int
    has_embedding: bool
    has_head: bool


# torchtitan 0.3.0 distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part: the
# embedding and the head (norm + output) count as input_weight and output_weight blocks
# (pipeline_parallel_first_stage_less_layers / _last_stage_less_layers, both 1 by default);
# the L + 2 "effective" blocks are spread evenly, the first (L + 2) mod S stages taking one more,
# and the first and last stages hold that many blocks less.
TORCHTITAN_EMBEDDING_WEIGHT = 1
TORCHTITAN_HEAD_WEIGHT = 1


def _torchtitan_block_counts(num_layers: int, stages: int) -> list[int]:
    effective = num_layers + TORCHTITAN_EMBEDDING_WEIGHT + TORCHTITAN_HEAD_WEIGHT
    base, extra = divmod(effective, stages)
    counts = [base + (1 if i < extra else 0) for i in range(stages)]
    counts[0] -= TORCHTITAN_EMBEDDING_WEIGHT
    counts[-1] -= TORCHTITAN_HEAD_WEIGHT
    # Its loop hands out blocks while any remain: a stage never holds more than are left.
    given, result = 0, []
    for count in counts:
        take = max(0, min(count, num_layers - given))
        result.append(take)
        given += take
    result[-1] += num_layers - given
    return result


# Megatron-LM core/transformer/transformer_block.py get_num_layers_to_build: L / (p v) blocks per
# stage (it asserts divisibility unless uneven first/last stages are configured); the remainder
# goes to the first stages here, so an uneven split is planned rather than refused.
def _even_block_counts(num_layers: int, stages: int) -> list[int]:
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


@lru_cache(maxsize=256)
def pipeline_stages(num_layers: int, stages: int, framework: Framework) -> tuple[Stage, ...]:
    """The stages in model order."""
    if framework is Framework.torchtitan:
        counts = _torchtitan_block_counts(num_layers, stages)
    else:
        counts = _even_block_counts(num_layers, stages)
    result, first = [], 0
    for index, count in enumerate(counts):
        result.append(Stage(index=index, first_block=first, num_blocks=count,
                            has_embedding=index == 0, has_head=index == stages - 1))
        first += count
    return tuple(result)


# torchtitan 0.3.0 distributed/pipeline_parallel.py stage_ids_this_rank: style "loop" (every
# multi-stage schedule but ZBV) gives rank r the stages r, r + p, r + 2p, ...; style "v"
# (ScheduleZBVZeroBubble) the stages r and 2p - 1 - r (benchmarks/pipeline-records/split).
def rank_stage_indices(parallel: ParallelSpec, rank: int) -> tuple[int, ...]:
    """Stage indices pipeline rank ``rank`` runs."""
    if parallel.pp_schedule.v_shape:
        return (rank, 2 * parallel.pp - 1 - rank)
    return tuple(rank + chunk * parallel.pp for chunk in range(parallel.virtual_stages))


def rank_stages(parallel: ParallelSpec, num_layers: int, framework: Framework, rank: int) -> tuple[Stage, ...]:
    stages = pipeline_stages(num_layers, parallel.stages, framework)
    return tuple(stages[i] for i in rank_stage_indices(parallel, rank))


def request_rank_stages(request: PlanRequest, rank: int) -> tuple[Stage, ...]:
    """rank_stages of the request's layout; under a device map, the one stage accelerate's split
    gives GPU ``rank`` (zeroplan.core.parallel.device_map), the head where the loss runs."""
    parallel = request.parallel
    if parallel.device_map is None:
        return rank_stages(parallel, request.model.num_layers, request.training.framework, rank)
    share = device_shares(request)[rank]
    return (Stage(index=rank, first_block=share.first_block, num_blocks=share.num_blocks,
                  has_embedding=share.has_embedding, has_head=share.has_head),)


# accelerate's split may leave a GPU no module (device_map_records: blocks_per_gpu with zeros, a
# balanced budget too small for the largest module, or sequential filling the first GPUs):
# transformers' forward never moves a tensor onto it, so its step allocates nothing there.
def device_map_gpu_is_empty(request: PlanRequest) -> bool:
    """Under a device map, whether the split gives the request's GPU no module at all."""
    parallel = request.parallel
    return (parallel.device_map is not None and parallel.pp > 1
            and device_shares(request)[parallel.pipeline_rank].weight_bytes == 0)


# Micro-batch chunks (one micro-batch through one of the rank's stages) whose saved activations
# are alive at the rank's peak, as torch 2.13's schedules (distributed/pipelining/schedules.py)
# run them: each rule is the one the schedule records of benchmarks/pipeline-records/schedule
# follow on every rank (docs/pipeline-measured.md), with its published form where there is one.
# - GPipe (Huang et al. 2019): every forward before any backward: m.
# - 1F1B (Narayanan et al. 2021, sec. 2.2.1): p - 1 - r warm-up forwards and one more before the
#   first backward: min(p - r, m).
# - Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2; ScheduleInterleaved1F1B's warm-up of
#   (v - 1) q + 2 (p - 1 - r) with q = m // max(1, m // p) micro-batches per round): one more
#   than the warm-up, at most v m. With p dividing m, rank 0 keeps L (1 + (p - 1)/(p v)) blocks'
#   worth (Korthikanti et al. 2022, sec. 4.2.3).
# - Looped BFS: every chunk's forward before the backwards: v m.
# - Interleaved zero bubble: a chunk's activations stay until its weight-gradient pass, which
#   the schedule delays: v min(p, m) on every rank (not 1F1B's peak, as ZB-H1 is on paper).
# - ZBV: min(2p, m + 1 + r).
# The plan search passes numpy's minimum and maximum to take an array of m at once (as
# zeroplan.core.timing.exposed_communication_s takes its arrays); the planner stays free of numpy.
def in_flight_chunks(parallel: ParallelSpec, rank: int, microbatches: int, minimum=min, maximum=max) -> int:
    p, v, m = parallel.pp, parallel.virtual_stages, microbatches
    schedule = parallel.pp_schedule
    if p == 1 or parallel.device_map is not None:
        # A device map runs each micro-batch's forward and backward through every GPU before
        # the next one starts (transformers' Trainer accumulates in a plain loop).
        return 1
    if schedule is PipelineSchedule.gpipe:
        return m
    if schedule is PipelineSchedule.one_f_one_b:
        return minimum(p - rank, m)
    if schedule is PipelineSchedule.interleaved_1f1b:
        per_round = m // maximum(1, m // p)
        return minimum((v - 1) * per_round + 2 * (p - 1 - rank) + 1, v * m)
    if schedule is PipelineSchedule.looped_bfs:
        return v * m
    if schedule is PipelineSchedule.zero_bubble:
        return v * minimum(p, m)
    return minimum(2 * p, m + 1 + rank)


# Narayanan et al. 2021, sec. 2.2.1: GPipe and 1F1B idle (p - 1) forward-and-backward slots of a
# step of m: a bubble of (p - 1)/m of the ideal time; interleaving v chunks divides it by v
# (sec. 2.2.2). Qi et al. 2024 (sec. 3.1): ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) against
# 1F1B's (p - 1)(T_F + T_B + T_W); with the input- and weight-gradient passes each as long as
# the forward (their sec. 2 assumption) that is a third; taken for ZBV too. Looped BFS divides
# GPipe's by v like interleaving (Lamy-Poirier 2023, sec. 3). None of these is measured here:
# the schedule records hold no idle slots for GPipe and 1F1B (docs/pipeline-measured.md).
def bubble_fraction(parallel: ParallelSpec, microbatches: int) -> Fraction:
    """Idle time of a step as a fraction of its busy time."""
    p, v, m = parallel.pp, parallel.virtual_stages, microbatches
    if p == 1:
        return Fraction(0)
    if parallel.device_map is not None:
        # One GPU computes at a time: each is busy for 1/p of the step, idle the rest.
        return Fraction(p - 1)
    bubble = Fraction(p - 1, m * v)
    if parallel.pp_schedule in (PipelineSchedule.zero_bubble, PipelineSchedule.zbv):
        bubble /= 3
    return bubble


# torch 2.13 distributed/pipelining/stage.py backward_maybe_with_nosync: every backward of an
# FSDP2 stage runs with set_requires_gradient_sync(False) and set_reshard_after_backward(False),
# and perform_reduce_grad (scheduled after the last micro-batch) reduce-scatters once: the
# stage's gradients accumulate unsharded and its units stay gathered from their first
# backward to the end of the step, whatever reshard_after_forward says (torchtitan 0.3.0
# distributed/fsdp.py turns reshard_after_forward off under a pipeline by default, too).
def pipeline_defers_fsdp_reduction(parallel: ParallelSpec, fsdp: bool) -> bool:
    """Whether FSDP keeps unsharded gradients and gathered units through the step and reduces
    once at its end (an FSDP strategy under a pipeline)."""
    return fsdp and parallel.pp > 1
