"""Turn one rank's measurement record into predicted-vs-measured rows."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core import deepspeed_offload
from zeroplan.core.activations import saved_logits_bytes
from zeroplan.core.deepspeed_accumulation import stage3_resident_bytes
from zeroplan.core.frameworks import framework_activation_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.harness.engines_table import EngineKind, training_as_run
from zeroplan.harness.record import HARNESS_DEEPSPEED_STAGE3, RankRecord, RunDescription, StepRecord
from zeroplan.specs import PlanRequest, StrategyKind, ZeroGradientReduce
from zeroplan.specs.training import StateConvention
from zeroplan.validate.gloo import gloo_allocated_peak_bytes
from zeroplan.validate.model_parallel import compare_model_parallel_record
from zeroplan.validate.rows import (
    COLLECTIVE_OPS, ComparisonRow, collective_rows, model_state_rows, peak_rows, planner_request,
)


# zeroplan's reference ZeRO reduces each unit through a buffer of its own size
# (zeroplan/harness/zero.py); ZeroRedundancyOptimizer keeps DDP's bucket copies; DeepSpeed's
# reduce bucket is the planner's default.
_ENGINE_GRADIENT_REDUCE = {
    ("zeroplan", StrategyKind.zero1): ZeroGradientReduce.per_unit,
    ("zeroplan", StrategyKind.zero2): ZeroGradientReduce.per_unit,
    ("torch", StrategyKind.zero1): ZeroGradientReduce.ddp_buckets,
}


def request_for(description: RunDescription) -> PlanRequest:
    """The planner request a measured run answers, with the engine's own buffering and
    optimizer loop."""
    # A record written before a field existed states none: the engine's own, as the runner records it.
    training = training_as_run(description.training, EngineKind(description.engine))
    request = planner_request(
        description.model, training, description.batch, description.strategy, description.world_size,
        keep_unsharded_grads_on_accum=description.keep_unsharded_grads_on_accum,
        zero_gradient_reduce=_ENGINE_GRADIENT_REDUCE.get(
            (description.engine, description.strategy), ZeroGradientReduce.bucket
        ),
        parallel=description.parallel,
    )
    if description.engine == "torch-fsdp1" and description.strategy is StrategyKind.fsdp_full_shard:
        # Each block wrapped, then the root (zeroplan/harness/torch_engines.py Fsdp1Engine).
        request = request.with_strategy(request.strategy.model_copy(update={"fsdp1_root_stays_gathered": True}))
    if description.engine == "deepspeed" and description.strategy.zero_stage == 3:
        # The gathers follow the run's own prefetch settings (zeroplan.core.deepspeed_coordinator).
        zero3 = description.deepspeed_stage3 or HARNESS_DEEPSPEED_STAGE3
        request = request.with_strategy(request.strategy.model_copy(update={
            "deepspeed_prefetch_bucket_elements": zero3.prefetch_bucket_size,
            "deepspeed_max_live_parameters": zero3.max_live_parameters,
            "deepspeed_param_persistence_threshold": zero3.param_persistence_threshold,
        }))
    return request


# One definition of gradients for the harness and the planner: the gradient values the optimizer
# steps from (and any .grad not yet reduced); the buffers gradients pass through on their way
# (DeepSpeed's reduce bucket, stage 3's gradient partition buffer) are buffers in both
# (zeroplan/harness/deepspeed_engine.py _held_buffers, zeroplan.core.deepspeed_accumulation).
def kept_buffer_bytes(request: PlanRequest) -> int:
    """The buffers a record's model states hold at the step, as the planner counts them:
    DeepSpeed stage 3's ipg bucket and gradient partition buffer (stage3_resident_bytes, without
    the kept scalars, which the record does not count), or under its optimizer offload the device
    staging buffer (zeroplan.core.deepspeed_offload); 0 elsewhere (stages 1-2 release their
    buckets by the step)."""
    kind = request.strategy.kind
    if deepspeed_offload.models_staging(request):
        return deepspeed_offload.device_staging_bytes(request)
    if (request.convention is not StateConvention.deepspeed or kind.zero_stage != 3 or kind.is_fsdp
            or kind.offloads_optimizer or kind.offloads_parameters):
        return 0
    return stage3_resident_bytes(request)


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
    if not description.parallel.is_trivial:
        return compare_model_parallel_record(record, request, step_index)
    step = record.steps[step_index]
    breakdown, predicted_states = memory_breakdown(request)
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    # The record's training spec carries the kernels of the device it ran on (cpu for every
    # committed record), so the prediction follows that device's dispatch.
    predicted_saved = framework_activation_bytes(request) + saved_logits_bytes(request.model, s, b)
    base = dict(
        run_id=description.run_id, strategy=description.strategy.value, engine=description.engine,
        world_size=description.world_size, rank=record.rank, model=request.model.name,
    )
    states = step.model_state
    rows = model_state_rows(base, breakdown, (states.parameters_bytes, states.gradients_bytes, states.optimizer_states_bytes))
    predicted_buffers = kept_buffer_bytes(request)
    if predicted_buffers or states.buffers_bytes:
        rows.append(ComparisonRow(**base, category="memory", quantity="buffers (kept)",
                                  predicted_bytes=predicted_buffers, measured_bytes=states.buffers_bytes))
    if predicted_states.host_bytes or states.host_bytes:
        rows.append(ComparisonRow(**base, category="memory", quantity="host (offloaded)",
                                  predicted_bytes=predicted_states.host_bytes, measured_bytes=states.host_bytes))
    rows.append(ComparisonRow(**base, category="memory", quantity="activations (saved)",
                              predicted_bytes=predicted_saved, measured_bytes=step.memory.saved_activation_bytes))
    peak = breakdown.allocated_peak_bytes
    if description.backend == "gloo":
        # The CPU allocator also sees what gloo's collectives copy (zeroplan.validate.gloo).
        peak = gloo_allocated_peak_bytes(request, peak)
    if description.device == "cpu":
        # A CPU run's "host" is the same memory as its "device": the offloaded states, allocated
        # once and kept, are under the one allocator's peak too.
        peak += predicted_states.host_bytes
    rows += peak_rows(base, breakdown.model_copy(update={"allocated_peak_bytes": peak}), step.memory)
    return rows + collective_rows(base, request, _measured_collectives(step))
