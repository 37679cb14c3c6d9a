"""zero3-nvme's optimizer swapper against DeepSpeed's own (benchmarks/nvme-records, made by
benchmarks/nvme_records.py): the sub-groups, the pinned pool to the byte, the buffers the
pipelined swapper holds at once, and its failure on a pool one sub-group short. The record's
sub_group_size is 3e6 (DeepSpeed's 1e9 makes one sub-group of a small model, with nothing to
pipeline), so the planner is asked at that size; the zero3-param-nvme runs add the parameter
swapper's host buffers and DeepSpeed's refusal of a buffer smaller than a partition. Reads a
JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core import nvme
from zeroplan.core.params import parameter_units
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.presets.gpus import get_gpu
from zeroplan.specs import (
    BatchSpec, PlanRequest, Precision, StateConvention, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)

RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "nvme-records" / "tiny-llama-swapper.json"


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


(RECORD_SUB_GROUP_SIZE,) = {run["sub_group_size"] for run in json.loads(RECORD.read_text(encoding="utf-8"))["runs"]
                            if "sub_group_size" in run}


@pytest.fixture(scope="module")
def optimizer_runs(record) -> list[dict]:
    return [run for run in record["runs"] if "param_buffer_size" not in run]


def _request(run: dict, kind: StrategyKind = StrategyKind.zero3_nvme, precision: Precision = Precision.fp32) -> PlanRequest:
    """The run's request at the record's sub_group_size (each run that names one names the same)."""
    pipeline = run["pipeline"]
    return PlanRequest(
        model=HARNESS_PRESETS["tiny-llama"], batch=BatchSpec(micro_batch_size=1, seq_len=16),
        training=TrainingSpec(precision=precision, state_convention=StateConvention.deepspeed),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), run["world"]),
        strategy=StrategySpec(kind=kind, nvme_pipeline_read=pipeline in ("read", "both"),
                              nvme_pipeline_write=pipeline in ("write", "both"),
                              deepspeed_sub_group_elements=RECORD_SUB_GROUP_SIZE),
    )


def test_the_record_ran_each_swapper(optimizer_runs) -> None:
    swappers = {run["pipeline"]: run["swapper"] for run in optimizer_runs}
    assert swappers["none"] == "PartitionedOptimizerSwapper"
    assert {swappers[p] for p in ("read", "write", "both")} == {"PipelinedOptimizerSwapper"}


def test_sub_groups_and_pool_equal_the_planner_to_the_byte(optimizer_runs) -> None:
    for run in optimizer_runs:
        request = _request(run)
        assert nvme.sub_group_partition_elements(request) == run["sub_group_elements"]
        largest = max(run["sub_group_elements"])
        assert run["pool_buffer_elements"] == nvme.io_aligned_elements(largest, nvme.FP32_BYTES)
        if run["error"] is None:
            # Each run's buffer_count is the planner's: the pool it pins is the planner's bytes.
            assert run["buffer_count"] == nvme.optimizer_swap_buffer_count(request) == run["pool_buffers"]
            assert run["pool_bytes"] == nvme.optimizer_swap_buffer_bytes(request)


def test_the_pipelined_swapper_holds_the_sub_groups_the_planner_counts(optimizer_runs) -> None:
    """4 buffers per sub-group for AdamW (master, exp_avg, exp_avg_sq, gradient), times the
    sub-groups in flight: 1, 2 with reads or writes pipelined, 3 with both."""
    for run in optimizer_runs:
        if run["error"] is None:
            request = _request(run)
            held = nvme.swap_buffers_per_sub_group(request.training.optimizer) * nvme.sub_groups_in_flight(request)
            assert run["most_buffers_held_in_step"] == held


def test_a_pool_one_sub_group_short_fails_as_the_planner_says(optimizer_runs) -> None:
    (short,) = [run for run in optimizer_runs if run["error"] is not None]
    assert (short["pipeline"], short["buffer_count"]) == ("both", 8)
    assert "ran out of swap buffers" in short["error"]


def test_parameter_swapper_host_buffers_equal_the_planner(record, monkeypatch) -> None:
    """zero3-param-nvme at the record's max_in_cpu, with the planner's buffer_size rule (the
    largest partition, when DeepSpeed's 1e8 default is set aside): the 5-buffer pool and the
    flat host buffer to the byte; the write-back buffer within DeepSpeed's per-parameter
    alignment of the planner's per-sub-group one (512 bf16 elements here)."""
    (run,) = [r for r in record["runs"] if r.get("param_buffer_size") and r["error"] is None]
    monkeypatch.setattr(nvme, "PARAM_MAX_IN_CPU", run["max_in_cpu"])
    monkeypatch.setattr(nvme, "PARAM_BUFFER_ELEMENTS", 1)
    request = _request(run, StrategyKind.zero3_param_nvme, Precision.bf16_mixed)
    assert nvme.parameter_buffer_elements(request) == run["param_buffer_size"]
    pool = nvme.PARAM_BUFFER_COUNT * nvme.io_aligned_elements(run["param_buffer_size"], 2) * 2
    assert run["param_swap_buffer_bytes"] == pool
    assert run["param_flat_host_bytes"] == min(sum(run["sub_group_elements"]), run["max_in_cpu"]) * 2
    planned = nvme.parameter_swap_host_bytes(request)
    measured = run["param_swap_buffer_bytes"] + run["param_flat_host_bytes"] + run["param_write_back_bytes"]
    assert 0 <= measured - planned <= 1024
    assert run["pool_bytes"] == nvme.optimizer_swap_buffer_bytes(request)


def test_a_parameter_buffer_smaller_than_a_partition_is_refused(record) -> None:
    """partition_parameters.py get_buffer: why the planner sizes offload_param.buffer_size to the
    largest partition when DeepSpeed's default is smaller."""
    (short,) = [r for r in record["runs"] if r.get("param_buffer_size") and r["error"] is not None]
    largest = max(t.numel for unit in parameter_units(HARNESS_PRESETS["tiny-llama"]) for t in unit.tensors)
    assert short["error"] == f"More elements {largest} than buffer size {largest - 1}"
