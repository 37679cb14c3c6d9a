"""The planner beside a harness run with tensor (sequence) or pipeline parallelism: each rank
against the request of its own pipeline rank (PlanRequest.at_pipeline_rank), memory by
category, and collective bytes per step by kind and by the mesh dimension they ran over
(data-parallel 'dp', tensor-parallel 'tp', the pipeline's sends and receives 'pp')."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core.activations import saved_logits_bytes
from zeroplan.core.communication import data_parallel_collectives
from zeroplan.core.parallel.activations import micro_batch_bytes
from zeroplan.core.parallel.collectives import pipeline_collectives, tensor_parallel_collectives
from zeroplan.core.parallel.tensor import tensor_parallel_model
from zeroplan.core.parallel.units import holds_head, rank_block_count
from zeroplan.core.plan import memory_breakdown, reference_activations
from zeroplan.harness.record import RankRecord, StepRecord
from zeroplan.specs import PlanRequest
from zeroplan.validate.rows import ComparisonRow, model_state_rows, peak_rows

GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")
"""Collective kinds compared per group (a pipeline's point-to-point calls included)."""


def measured_group_bytes(step: StepRecord) -> dict[tuple[str, str], int]:
    """(op, group) -> bytes per step as recorded (unsharded buffers; a send's or recv's tensor)."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for call in step.collectives:
        if call.op in GROUP_OPS:
            totals[(call.op, call.group or "other")] += call.num_bytes
    return totals


def predicted_group_bytes(request: PlanRequest) -> dict[tuple[str, str], int]:
    """(op, group) -> the planner's bytes per step for this rank: its data-parallel collectives
    over "dp", its tensor-parallel ones over "tp", its pipeline sends over "pp", and as its
    receives what its neighbours' requests send to it."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for group, found in (("dp", data_parallel_collectives(request)), ("tp", tensor_parallel_collectives(request)),
                         ("pp", pipeline_collectives(request))):
        for collective in found:
            totals[(collective.op.value, group)] += collective.buffer_bytes_per_step
    parallel = request.parallel
    if parallel.pp > 1:
        rank = parallel.pipeline_rank
        # Rank r receives the activations rank r - 1 sends forward and the gradients rank r + 1
        # sends back (one stage per rank: gpipe and 1f1b).
        for neighbour, phase in ((rank - 1, "forward"), (rank + 1, "backward")):
            if 0 <= neighbour < parallel.pp:
                for collective in pipeline_collectives(request.at_pipeline_rank(neighbour)):
                    if collective.phase.value == phase:
                        totals[("recv", "pp")] += collective.buffer_bytes_per_step
    return totals


def predicted_saved_per_micro_batch(request: PlanRequest) -> int:
    """What one micro-batch keeps for backward on this rank: its blocks' activations, and on
    the rank with the head the final norm's and projection's inputs and the loss's fp32
    log-softmax of its vocabulary columns (the reference model's terms, zeroplan.core)."""
    terms = micro_batch_bytes(request, reference_activations)
    saved = terms.per_block * rank_block_count(request)
    if holds_head(request):
        batch = request.batch
        model = tensor_parallel_model(request.model, request.parallel.tp)
        saved += terms.outside + saved_logits_bytes(model, batch.seq_len, batch.micro_batch_size)
    return saved


def compare_model_parallel_record(record: RankRecord, request: PlanRequest, step_index: int = -1) -> list[ComparisonRow]:
    """Rows for one rank at one step; ``request`` is the planner's for the rank's pipeline rank
    (zeroplan.validate.compare.request_for)."""
    description = record.description
    step = record.steps[step_index]
    breakdown, _ = memory_breakdown(request)
    pipeline_rank = description.parallel.pipeline_rank if description.parallel.pp > 1 else None
    base = dict(run_id=description.run_id, strategy=description.strategy.value, engine=description.engine,
                world_size=description.world_size, rank=record.rank, pipeline_rank=pipeline_rank,
                model=request.model.name)
    states = step.model_state
    rows = model_state_rows(base, breakdown, (states.parameters_bytes, states.gradients_bytes, states.optimizer_states_bytes))
    rows.append(ComparisonRow(**base, category="memory", quantity="activations (saved, per micro-batch)",
                              predicted_bytes=predicted_saved_per_micro_batch(request),
                              measured_bytes=step.memory.saved_activation_bytes))
    rows += peak_rows(base, breakdown, step.memory)
    predicted, measured = predicted_group_bytes(request), measured_group_bytes(step)
    for op, group in sorted(set(predicted) | set(measured), key=lambda k: (k[1], GROUP_OPS.index(k[0]))):
        rows.append(ComparisonRow(**base, category="communication", quantity=f"{op} bytes/step ({group})",
                                  predicted_bytes=predicted.get((op, group), 0), measured_bytes=measured.get((op, group), 0)))
    return rows
