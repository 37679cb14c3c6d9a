"""The planner beside the model-parallelism records: torchtitan's own tensor, sequence and
context parallelism (benchmarks/parallel-records) and torch's own pipeline schedules and
torchtitan's stage split (benchmarks/pipeline-records). Torch-free: reads committed records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.parallel.activations import micro_batch_bytes
from zeroplan.core.parallel.collectives import context_parallel_collectives, tensor_parallel_collectives
from zeroplan.core.parallel.expert import expert_parallel_collectives
from zeroplan.core.parallel.units import rank_parameter_elements
from zeroplan.core.plan import framework_activations
from zeroplan.frameworks.expert_record import ExpertParallelRecord
from zeroplan.frameworks.parallel_record import ParallelRecord
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, ModelSpec, PlanRequest, StrategySpec, TrainingSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.recipe_defaults import as_run
from zeroplan.validate.rows import FLAT_RESERVE

PRESET = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b", "405B": "llama-3.1-405b"}
"""torchtitan's Llama-3 flavours and the presets with their shapes."""
ACTIVATION_TARGET = 0.02
"""Saved activations per block: within 2 % of the framework's own code (the issue's target)."""
MODEL_PARALLEL_COLLECTIVES = ("tensor-parallel activations", "context-parallel K and V", "context-parallel K and V gradients")
"""The planner's per-block collectives a block record counts (FSDP's are the data-parallel planner's)."""


def parallel_request(record: ParallelRecord) -> PlanRequest:
    """The planner's request for what the record ran: torchtitan, FSDP2's bf16 blocks, the
    record's layout, batch, checkpointing and norm kernel."""
    a = record.activations
    training = TrainingSpec(
        framework=Framework.torchtitan, kernels=a.norm_formula if a else "cpu",
        activation_checkpointing=a.activation_checkpointing if a else "none",
    )
    batch = BatchSpec(seq_len=a.seq_len, micro_batch_size=a.micro_batch_size) if a else BatchSpec()
    return PlanRequest(
        model=get_model(PRESET[record.flavor]), training=as_run(training), batch=batch,
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), record.world_size),
        strategy=StrategySpec(kind="fsdp-full-shard"),
        # The harness's runs never enable torchtitan's async TP (its records have no such field),
        # so it is named off: a recorded run is planned as it ran, not as a configuration would run.
        parallel=ParallelSpec(tp=record.tp, cp=record.cp, sequence_parallel=record.sequence_parallel and record.tp > 1,
                              async_tp=False),
        assumptions=FLAT_RESERVE,
    )


def predicted_parameter_bytes(record: ParallelRecord) -> int:
    """Rank 0's parameter bytes at full depth, fp32 as torchtitan builds them: the
    tensor-parallel shard, sharded again by FSDP2 over dp_shard when the record has it."""
    request = parallel_request(record)
    if record.dp_shard == 1:
        return 4 * rank_parameter_elements(request)
    return model_state_bytes(request).parameter_bytes


def predicted_block_bytes(record: ParallelRecord) -> int:
    """What one block keeps for backward on rank 0."""
    return micro_batch_bytes(parallel_request(record), framework_activations).per_block


def measured_collectives(record: ParallelRecord, phase: str) -> dict[str, int]:
    """Output bytes per collective kind of one block in ``phase`` over the tp or cp group."""
    totals: dict[str, int] = {}
    for c in record.activations.block_collectives:
        if c.phase == phase and c.group_size in (record.tp, record.cp) and c.group_size > 1:
            totals[c.kind] = totals.get(c.kind, 0) + c.output_bytes * c.count
    return totals


def predicted_collectives(record: ParallelRecord, phase: str) -> dict[str, int]:
    """The planner's output bytes per collective kind of one block in ``phase``: an all-gather's
    output and an all-reduce's buffer are its S bytes, a reduce-scatter's output S/N."""
    request = parallel_request(record)
    blocks = request.model.num_layers
    totals: dict[str, int] = {}
    for c in tensor_parallel_collectives(request) + context_parallel_collectives(request):
        if c.phase.value != phase or c.what not in MODEL_PARALLEL_COLLECTIVES:
            continue
        per_block = c.buffer_bytes // blocks
        if c.op.value == "reduce_scatter":
            per_block //= c.group_size
        totals[c.op.value] = totals.get(c.op.value, 0) + per_block
    return totals


@dataclass(frozen=True)
class ParallelRow:
    """One activation record beside the planner."""

    name: str
    predicted_block_bytes: int
    measured_block_bytes: int
    collectives_equal: bool

    @property
    def error(self) -> float:
        return self.predicted_block_bytes / self.measured_block_bytes - 1


def parallel_rows(records: list[ParallelRecord]) -> list[ParallelRow]:
    rows = []
    for record in records:
        if record.activations is None or record.dp_shard != 1:
            continue
        equal = all(predicted_collectives(record, p) == measured_collectives(record, p) for p in ("forward", "backward"))
        rows.append(ParallelRow(record.name, predicted_block_bytes(record), record.activations.block_kept_bytes, equal))
    return rows


# --- expert parallelism ----------------------------------------------------------------------

EXPERT_MODEL = {("deepseek_v3", "16B"): "deepseek-v2-lite", ("qwen3", "30B-A3B"): "qwen3-30b-a3b"}
"""torchtitan's MoE flavours and the config.json under tests/fixtures/hf/ with their shapes
(torchtitan 0.3.0 models/deepseek_v3/__init__.py: "16B" is DeepSeek-V2-Lite; models/qwen3/
__init__.py: "30B-A3B" is Qwen3-30B-A3B)."""


def expert_model(record: ExpertParallelRecord, fixtures: Path) -> ModelSpec:
    return load_hf_config(fixtures / f"{EXPERT_MODEL[(record.family, record.flavor)]}.json")


def expert_request(record: ExpertParallelRecord, model: ModelSpec) -> PlanRequest:
    """The planner's request for what the record ran: torchtitan under FSDP2 (bf16 blocks, fp32
    parameters) over dp_shard ranks with ep of them per expert group, the record's batch, no
    checkpointing, the CPU's composite RMSNorm (what the fake run saved). For an activation
    record every block of the model is a MoE block: the record's per-block figure is one MoE
    block (its deep run has one MoE block more), and micro_batch_bytes' per-block term is the
    difference of one and two blocks of the request's model."""
    a = record.activations
    if a is not None:
        model = model.model_copy(update={"first_dense_layers": 0})
    batch = BatchSpec(seq_len=a.seq_len, micro_batch_size=a.micro_batch_size) if a else BatchSpec(seq_len=4096)
    training = TrainingSpec(framework=Framework.torchtitan, kernels="cpu",
                            activation_checkpointing=a.activation_checkpointing if a else "none")
    return PlanRequest(
        model=model, training=as_run(training), batch=batch, cluster=cluster_from_gpus(get_gpu("h100-80gb"), record.world_size),
        strategy=StrategySpec(kind="fsdp-full-shard"), parallel=ParallelSpec(ep=record.ep), assumptions=FLAT_RESERVE,
    )


def predicted_expert_all_to_all(request: PlanRequest) -> dict[str, tuple[int, int]]:
    """Per phase, the planner's (calls, bytes per call) of one MoE block's token all-to-alls."""
    result = {}
    for c in expert_parallel_collectives(request, moe_blocks=1):
        result[c.phase.value] = (c.calls, c.buffer_bytes // c.calls)
    return result


def measured_expert_all_to_all(record: ExpertParallelRecord) -> dict[str, tuple[int, int]]:
    """Per phase, the measured (calls, bytes per call) of one MoE block's token all-to-alls (the
    activation-sized ones: the int64 count exchange before each dispatch is left out)."""
    result = {}
    for phase in ("forward", "backward"):
        tokens = [c for c in record.block_all_to_all(phase) if c.dtype != "torch.int64"]
        sizes = {c.output_bytes for c in tokens}
        assert len(sizes) == 1, sizes
        result[phase] = (sum(c.count for c in tokens), sizes.pop())
    return result
