"""The planner's DeepSpeed gradient and bucket terms against DeepSpeed's own engine, to the byte:
the committed records of benchmarks/deepspeed_accumulation_records.py (ZeRO-1/2/3, fp32 and
bf16-mixed, accumulation 1/2/4, contiguous_gradients and overlap_comm on and off, a whole-model
and a quarter-model reduce bucket, both ranks). Reads JSON only: DeepSpeed is not run here."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from zeroplan.core.deepspeed_accumulation import (
    _largest_partition_parameter_elements, _partition_parameter_elements,
    between_micro_steps_bytes, resident_bytes,
)
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.specs import BatchSpec, Precision, StateConvention, StrategyKind, TrainingSpec
from zeroplan.validate.rows import planner_request

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-accumulation-records"


@cache
def _runs() -> list[tuple[int, dict]]:
    runs = []
    for path in sorted(RECORDS.glob("records-*.json")):
        for rank, rank_runs in enumerate(json.loads(path.read_text())["ranks"]):
            # Stage 0 (DeepSpeed's unpartitioned optimizer) is tests/test_deepspeed_stage0.py's.
            runs += [(rank, run) for run in rank_runs if run["stage"]]
    return runs


def _request(run: dict):
    training = TrainingSpec(precision=Precision(run["precision"]), state_convention=StateConvention.deepspeed)
    batch = BatchSpec(micro_batch_size=run["micro_batch"], seq_len=run["seq_len"], grad_accum_steps=run["grad_accum"])
    request = planner_request(HARNESS_PRESETS[run["model"]], training, batch, StrategyKind(f"zero{run['stage']}"),
                              run["world_size"])
    zero = run["zero_optimization"]
    strategy = request.strategy.model_copy(update={
        "zero_bucket_elements": zero["reduce_bucket_size"],
        "deepspeed_contiguous_gradients": zero["contiguous_gradients"],
        "deepspeed_overlap_comm": zero["overlap_comm"],
    })
    return request.model_copy(update={"strategy": strategy})


def _name(item: tuple[int, dict]) -> str:
    rank, run = item
    return f"zero{run['stage']}-{run['precision']}-k{run['grad_accum']}-{run['variant']}-r{rank}"


def test_the_records_cover_the_grid() -> None:
    runs = [run for _, run in _runs()]
    assert {run["stage"] for run in runs} == {1, 2, 3}
    assert {run["grad_accum"] for run in runs} == {1, 2, 4}
    assert {run["variant"] for run in runs} == {"default", "no-contiguous", "overlap", "quarter-bucket"}
    assert {run["precision"] for run in runs} == {"fp32", "bf16-mixed"}


@pytest.mark.parametrize("item", _runs(), ids=_name)
def test_planner_equals_deepspeed_between_micro_steps_at_the_step_and_after(item) -> None:
    """The last recorded step (after the first: the gradient norm scalar exists from then on)."""
    rank, run = item
    request = _request(run)
    moments = run["steps"][-1]
    resident = resident_bytes(request)
    between = between_micro_steps_bytes(request, rank)
    micro = [name for name in moments if name.startswith("micro")]
    assert len(micro) == run["grad_accum"] - 1
    for name in micro:
        assert moments[name]["buffer_bytes"] == between, (name, moments[name]["buffers"])
    # The optimizer step reads the fp32 partition: zeroplan's gradient under this convention.
    gradient = model_state_bytes(request).gradient_bytes
    assert moments["at_step"]["buffer_bytes"] == resident + gradient, moments["at_step"]["buffers"]
    assert moments["after_step"]["buffer_bytes"] == resident, moments["after_step"]["buffers"]
    # Nothing the engine does not name: what is left is the script's own int64 token batch (and,
    # inside the step, the norm computation's scalars: 8 bytes at stages 1-2, 24 at stage 3,
    # gone after it).
    batch = run["grad_accum"] * run["world_size"] * run["micro_batch"] * (run["seq_len"] + 1) * 8
    in_step = 24 if run["stage"] == 3 else 8
    for name, moment in moments.items():
        assert moment["unnamed_tensor_bytes"] == batch + (in_step if name == "at_step" else 0), name


@pytest.mark.parametrize("item", [i for i in _runs() if i[1]["grad_accum"] > 1], ids=_name)
def test_the_peak_carries_what_deepspeed_keeps_between_micro_steps(item) -> None:
    """The planner's accumulated term plus its resident buffers is the largest rank's record."""
    rank, run = item
    request = _request(run)
    _, terms = peak_terms(request)
    between = max(between_micro_steps_bytes(request, r) for r in range(run["world_size"]))
    assert terms.accumulated_gradients + terms.resident_buffers == between
    assert between >= run["steps"][-1]["micro0"]["buffer_bytes"]


@pytest.mark.parametrize("numels, group", [
    ([5, 7, 3, 11, 2], 2), ([5, 7, 3, 11, 2], 3), ([5, 7, 3, 11, 2], 8), ([100], 4), ([1, 1, 1, 1], 16),
    ([3145728, 384, 147456, 49152, 49152, 147456, 384, 393216, 393216, 393216, 3145728], 7),
])
def test_the_largest_partition_shortcut_equals_every_rank(numels: list[int], group: int) -> None:
    every = max(_partition_parameter_elements(numels, group, rank) for rank in range(group))
    assert _largest_partition_parameter_elements(numels, group) == every


@pytest.mark.parametrize("overlap", [None, True, False])
def test_the_bucket_is_the_one_zeroplan_emits(overlap) -> None:
    """The ipg bucket the planner counts is the emitted config's reduce_bucket_size (the trainable
    elements rounded up to even for a model with an odd count), doubled where overlap_comm is on."""
    from zeroplan.core.deepspeed_accumulation import _tensor_numels, stage12_bucket_bytes
    from zeroplan.emit.formats import deepspeed_config

    run = {"precision": "bf16-mixed", "micro_batch": 1, "seq_len": 16, "grad_accum": 2, "model": "micro-llama",
           "stage": 1, "world_size": 2,
           "zero_optimization": {"reduce_bucket_size": 500_000_000, "contiguous_gradients": True, "overlap_comm": overlap}}
    request = _request(run)
    odd = request.model.model_copy(update={"hidden_size": 33, "num_heads": 1, "num_kv_heads": 1})
    request = request.model_copy(update={"model": odd})
    assert sum(_tensor_numels(request)) % 2 == 1
    zero = deepspeed_config(request)["zero_optimization"]
    assert zero["overlap_comm"] is bool(overlap)
    assert stage12_bucket_bytes(request) == (2 if overlap else 1) * zero["reduce_bucket_size"] * 2


@pytest.mark.parametrize("item", [i for i in _runs() if i[1]["stage"] == 1 and i[1]["grad_accum"] > 1
                                  and i[1]["zero_optimization"]["contiguous_gradients"]], ids=_name)
def test_stage_1_reduces_through_the_carried_bucket(item) -> None:
    """ZeRO-1 under accumulation: the ipg bucket DeepSpeed keeps between micro-steps (the record's
    ipg_buckets) is in the planner's accumulated term, and the last micro-step's block backward
    adds no second one (setup_buckets allocates only after the boundary's epilogue)."""
    rank, run = item
    request = _request(run)
    states, terms = peak_terms(request)
    carried = run["steps"][-1]["micro0"]["buffers"]["ipg_buckets"]
    gradients = run["steps"][-1]["micro0"]["buffers"]["param.grad"]
    assert terms.accumulated_gradients + terms.resident_buffers == carried + gradients + 4
    assert terms.block_transient_buffers == 0
