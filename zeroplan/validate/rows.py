"""The predicted-vs-measured row, and the planner request a run answers."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core.communication import collectives
from zeroplan.specs import ClusterSpec, GpuSpec, LinkSpec, MemoryAssumptions, PlanRequest, StrategySpec, ZeroGradientReduce
from zeroplan.specs.base import Frozen
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.recipe_defaults import as_run
from zeroplan.units import TiB

# The measured run's device only matters for fits/time, which validation does not compare;
# a notional device with ample memory keeps the request valid.
_MEASURED_LINK = LinkSpec(name="measured", bandwidth_bytes_per_s=1e9, latency_s=0.0)
MEASURED_DEVICE = GpuSpec(
    name="measured-device", display_name="measured device", memory_bytes=TiB, peak_bf16_flops_per_s=1e12,
    intra_node_link=_MEASURED_LINK, inter_node_link=_MEASURED_LINK, host_link=_MEASURED_LINK,
    source="notional: validation compares bytes only",
)
FLAT_RESERVE = MemoryAssumptions(allocator_conf=None)
"""The assumptions of a request that validation sets beside a measured or simulated run or a
published throughput: what it compares is the planner's bytes or seconds, not the verdict, so
the verdict's rule is the flat reserve, sparing each request the caching-allocator model's
replays (the model is compared with the allocators' own figures apart: docs/validation.md,
"The caching allocator")."""
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


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
    pipeline_rank: int | None = None
    """The pipeline rank the prediction is for (None without a pipeline)."""
    model: str = ""
    """The model's name (ModelSpec.name) the run trained."""

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else None


def planner_request(
    model, training, batch, strategy, world_size: int, keep_unsharded_grads_on_accum: bool = False,
    zero_gradient_reduce: ZeroGradientReduce = ZeroGradientReduce.bucket, parallel: ParallelSpec = ParallelSpec(),
) -> PlanRequest:
    """The planner request a measured or simulated run answers (one node of N devices); under a
    pipeline, the request of ``parallel.pipeline_rank`` (PlanRequest.at_pipeline_rank)."""
    cluster = ClusterSpec(gpu=MEASURED_DEVICE, num_nodes=1, gpus_per_node=world_size, cuda_context_bytes=0)
    spec = StrategySpec(kind=strategy, keep_unsharded_grads_on_accum=keep_unsharded_grads_on_accum,
                        zero_gradient_reduce=zero_gradient_reduce)
    request = PlanRequest(model=model, training=as_run(training), batch=batch, cluster=cluster, strategy=spec,
                          parallel=parallel.model_copy(update={"pipeline_rank": 0}), assumptions=FLAT_RESERVE)
    return request.at_pipeline_rank(parallel.pipeline_rank) if parallel.pp > 1 else request


def predicted_collective_bytes(request: PlanRequest) -> dict[str, int]:
    """Unsharded buffer bytes per step by collective op, as the planner predicts them."""
    totals: dict[str, int] = defaultdict(int)
    for collective in collectives(request):
        totals[collective.op.value] += collective.buffer_bytes_per_step
    return totals


def model_state_rows(base: dict, predicted, measured: tuple[int, int, int]) -> list[ComparisonRow]:
    """Rows for parameters, gradients and optimizer states; ``predicted`` is a MemoryBreakdown,
    ``measured`` the same three byte counts from a record."""
    quantities = ("parameters", "gradients", "optimizer states")
    expected = (predicted.parameter_bytes, predicted.gradient_bytes, predicted.optimizer_state_bytes)
    return [
        ComparisonRow(**base, category="memory", quantity=q, predicted_bytes=p, measured_bytes=m)
        for q, p, m in zip(quantities, expected, measured)
    ]


def peak_rows(base: dict, predicted, memory) -> list[ComparisonRow]:
    """Rows for the measured peaks a record has (the CPU allocator's, the tracked tensors', the
    CUDA allocator's),
    each beside the planner's allocated peak; ``predicted`` is a MemoryBreakdown, ``memory`` a
    step record's memory."""
    rows = []
    if memory.allocator_peak_bytes is not None:
        rows.append(ComparisonRow(**base, category="memory", quantity="peak (CPU allocator)",
                                  predicted_bytes=predicted.allocated_peak_bytes, measured_bytes=memory.allocator_peak_bytes))
    if memory.peak_bytes is not None:
        rows.append(ComparisonRow(**base, category="memory", quantity="peak (tracked tensors)",
                                  predicted_bytes=predicted.allocated_peak_bytes, measured_bytes=memory.peak_bytes))
    if memory.cuda_max_allocated_bytes is not None:
        # torch.cuda.max_memory_allocated over the step (the runner resets it first): what the
        # device's allocator itself handed out, rounding included.
        rows.append(ComparisonRow(**base, category="memory", quantity="peak (CUDA allocated)",
                                  predicted_bytes=predicted.allocated_peak_bytes, measured_bytes=memory.cuda_max_allocated_bytes))
    return rows


def collective_rows(base: dict, request: PlanRequest, measured: dict[str, int]) -> list[ComparisonRow]:
    """A row per collective op that was predicted or measured (unsharded buffer bytes/step)."""
    predicted = predicted_collective_bytes(request)
    return [
        ComparisonRow(**base, category="communication", quantity=f"{op} bytes/step",
                      predicted_bytes=predicted.get(op, 0), measured_bytes=measured.get(op, 0))
        for op in COLLECTIVE_OPS
        if predicted.get(op) or measured.get(op)
    ]
