"""Turn one rank's measurement record into predicted-vs-measured rows."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core.activations import activation_bytes, saved_logits_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.harness.record import RankRecord, RunDescription, StepRecord
from zeroplan.specs import PlanRequest
from zeroplan.validate.rows import COLLECTIVE_OPS, ComparisonRow, planner_request, predicted_collective_bytes


def request_for(description: RunDescription) -> PlanRequest:
    """The planner request a measured run answers."""
    return planner_request(description.model, description.training, description.batch, description.strategy, description.world_size)


def _measured_collectives(step: StepRecord) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for call in step.collectives:
        if call.op in COLLECTIVE_OPS:
            totals[call.op] += call.num_bytes
    return totals


def compare_record(record: RankRecord, step_index: int = -1) -> list[ComparisonRow]:
    """Rows for one rank at one step (by default the last, after warm-up)."""
    description = record.description
    request = request_for(description)
    step = record.steps[step_index]
    breakdown, _ = memory_breakdown(request)
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    predicted_saved = activation_bytes(request.model, request.training, s, b) + saved_logits_bytes(request.model, s, b)
    base = dict(
        run_id=description.run_id, strategy=description.strategy.value, engine=description.engine,
        world_size=description.world_size, rank=record.rank,
    )
    rows = [
        ComparisonRow(**base, category="memory", quantity="parameters",
                      predicted_bytes=breakdown.parameter_bytes, measured_bytes=step.model_state.parameters_bytes),
        ComparisonRow(**base, category="memory", quantity="gradients",
                      predicted_bytes=breakdown.gradient_bytes, measured_bytes=step.model_state.gradients_bytes),
        ComparisonRow(**base, category="memory", quantity="optimizer states",
                      predicted_bytes=breakdown.optimizer_state_bytes, measured_bytes=step.model_state.optimizer_states_bytes),
        ComparisonRow(**base, category="memory", quantity="activations (saved)",
                      predicted_bytes=predicted_saved, measured_bytes=step.memory.saved_activation_bytes),
    ]
    if step.memory.peak_bytes is not None:
        rows.append(ComparisonRow(**base, category="memory", quantity="peak (tracked tensors)",
                                  predicted_bytes=breakdown.allocated_peak_bytes, measured_bytes=step.memory.peak_bytes))
    predicted_ops = predicted_collective_bytes(request)
    measured_ops = _measured_collectives(step)
    for op in COLLECTIVE_OPS:
        if predicted_ops.get(op) or measured_ops.get(op):
            rows.append(ComparisonRow(**base, category="communication", quantity=f"{op} bytes/step",
                                      predicted_bytes=predicted_ops.get(op, 0), measured_bytes=measured_ops.get(op, 0)))
    return rows
