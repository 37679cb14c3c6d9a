"""Turn one rank's measurement record into predicted-vs-measured rows."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core.activations import activation_bytes, saved_logits_bytes
from zeroplan.core.communication import collectives
from zeroplan.core.plan import memory_breakdown
from zeroplan.harness.record import RankRecord, RunDescription, StepRecord
from zeroplan.specs import ClusterSpec, GpuSpec, LinkSpec, PlanRequest, StrategySpec
from zeroplan.specs.base import Frozen
from zeroplan.units import TiB

# The measured run's device only matters for fits/time, which validation does not compare;
# a notional device with ample memory keeps the request valid.
_MEASURED_LINK = LinkSpec(name="measured", bandwidth_bytes_per_s=1e9, latency_s=0.0)
MEASURED_DEVICE = GpuSpec(
    name="measured-device", display_name="measured device", memory_bytes=TiB, peak_bf16_flops_per_s=1e12,
    intra_node_link=_MEASURED_LINK, inter_node_link=_MEASURED_LINK, host_link=_MEASURED_LINK,
    source="notional: validation compares bytes only",
)
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")


class ComparisonRow(Frozen):
    """One quantity of one run, predicted and measured."""

    run_id: str
    strategy: str
    engine: str
    world_size: int
    rank: int
    category: str
    """'memory' or 'communication'."""
    quantity: str
    """E.g. 'parameters', 'activations (saved)', 'all_gather bytes/step'."""
    predicted_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else None


def request_for(description: RunDescription) -> PlanRequest:
    """The planner request a measured run answers."""
    cluster = ClusterSpec(gpu=MEASURED_DEVICE, num_nodes=1, gpus_per_node=description.world_size, cuda_context_bytes=0)
    return PlanRequest(
        model=description.model, training=description.training, batch=description.batch,
        cluster=cluster, strategy=StrategySpec(kind=description.strategy),
    )


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
    predicted_ops: dict[str, int] = defaultdict(int)
    for collective in collectives(request):
        predicted_ops[collective.op.value] += collective.buffer_bytes_per_step
    measured_ops = _measured_collectives(step)
    for op in COLLECTIVE_OPS:
        if predicted_ops.get(op) or measured_ops.get(op):
            rows.append(ComparisonRow(**base, category="communication", quantity=f"{op} bytes/step",
                                      predicted_bytes=predicted_ops.get(op, 0), measured_bytes=measured_ops.get(op, 0)))
    return rows
