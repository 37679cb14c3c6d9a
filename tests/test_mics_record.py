"""zero3-mics against MiCS measured under DeepSpeed's own engine (benchmarks/mics-records, made by
benchmarks/mics_records.py with DeepSpeed 0.18.9, the last release with runtime/zero/mics.py):
per-rank model states and every collective's bytes and group, to the byte. Reads a JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.deepspeed_accumulation import kept_scalar_bytes
from zeroplan.core.buffers import resident_buffer_bytes
from zeroplan.core.collective import CollectiveOp, Phase
from zeroplan.core.communication import collectives
from zeroplan.core.model_states import model_state_bytes
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.presets.gpus import get_gpu
from zeroplan.specs import (
    BatchSpec, PlanRequest, Precision, StateConvention, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)

RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "mics-records" / "micro-llama-mics2-n4.json"


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def request_(record) -> PlanRequest:
    return PlanRequest(
        model=HARNESS_PRESETS["micro-llama"], batch=BatchSpec(micro_batch_size=2, seq_len=16),
        training=TrainingSpec(precision=Precision.fp32, state_convention=StateConvention.deepspeed),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), record["world"], gpus_per_node=record["ranks_per_node"]),
        strategy=StrategySpec(kind=StrategyKind.zero3_mics, mics_shard_size=record["mics_shard_size"]),
    )


def _measured(step: dict, op: str, phase: str) -> list[dict]:
    return [c for c in step["collectives"] if c["op"] == op and c["phase"] == phase and c["dtype"] == "float32"]


def test_the_record_is_mics_on_its_shard_groups(record) -> None:
    assert record["deepspeed"] == "0.18.9" and record["backend"] == "gloo"
    assert {r["optimizer"] for r in record["ranks"]} == {"MiCS_Optimizer"}
    assert {r["partition_count"] for r in record["ranks"]} == {record["mics_shard_size"]}


def test_model_states_equal_the_planner_to_the_byte(record, request_) -> None:
    states = model_state_bytes(request_)
    units = 2 + HARNESS_PRESETS["micro-llama"].num_layers
    for rank in record["ranks"]:
        assert rank["parameter_partition_bytes"] == states.parameter_bytes
        # fp32 master + exp_avg + exp_avg_sq; DeepSpeed keeps one step counter, the planner one per unit.
        assert states.optimizer_state_bytes - (rank["master_bytes"] + rank["optimizer_state_bytes"]) == 4 * (units - 1)
        for step in rank["steps"]:
            # As stage 3 over M ranks (tests/harness/test_deepspeed.py): the fp32 partition AdamW
            # reads (the planner's gradients) plus the partition buffer and the reduce bucket
            # (stage3.py grad_partitions_flat_buffer, ipg bucket), which the planner counts as buffers
            # with the optimizer's kept scalars (the norm and overflow flags: not gradient storage).
            assert step["gradient_bytes"] == (states.gradient_bytes + resident_buffer_bytes(request_)
                                              - kept_scalar_bytes(request_))


@pytest.mark.parametrize("op, phase, what", [
    (CollectiveOp.all_gather, Phase.forward, "parameters"),
    (CollectiveOp.all_gather, Phase.backward, "parameters"),
    (CollectiveOp.reduce_scatter, Phase.backward, "gradients"),
    (CollectiveOp.all_reduce, Phase.backward, "gradient partitions (replicas)"),
])
def test_every_collective_equals_the_planner_to_the_byte(record, request_, op, phase, what) -> None:
    """Same bytes per step, over a group of the same ranks: the shard group ({0,1} or {2,3},
    inside a node of two) for the gathers and the reduce-scatter, the replica group ({0,2} or
    {1,3}, across the nodes) for the all-reduce (mics_utils.py _generate_mics_config)."""
    (planned,) = [c for c in collectives(request_) if c.op is op and c.phase is phase and c.what == what]
    shard = record["mics_shard_size"]
    for rank in record["ranks"]:
        r = rank["rank"]
        group = ([g * shard + i for g in range(record["world"] // shard) for i in [r % shard]]
                 if op is CollectiveOp.all_reduce else list(range(r - r % shard, r - r % shard + shard)))
        for step in rank["steps"]:
            (measured,) = _measured(step, op.value, phase.value)
            assert measured["group_ranks"] == group and len(group) == planned.group_size
            assert measured["bytes"] == planned.buffer_bytes * planned.occurrences_per_step
            node = {q // record["ranks_per_node"] for q in group}
            assert planned.spans_nodes == (len(node) > 1)


def test_nothing_else_moves_but_bookkeeping(record) -> None:
    """Besides the four collectives above, only what the planner leaves out: the gradient norm's
    one float64 all-reduce over the shard group (stage3.py get_grad_norm_direct, on MiCS's
    dp_process_group) and the int64 broadcasts of the trace check (zero/utils.py
    assert_ints_same_as_other_ranks), at most 1,240 bytes a step."""
    for rank in record["ranks"]:
        for step in rank["steps"]:
            rest = [c for c in step["collectives"] if c["dtype"] != "float32"]
            assert {(c["op"], c["dtype"]) for c in rest} == {("all_reduce", "float64"), ("broadcast", "int64")}
            assert sum(c["bytes"] for c in rest) <= 1240 + 8
            assert len(step["collectives"]) == len(rest) + 4
