"""DeepSpeed ZeRO-3's parameter gathers under the deepspeed state convention
(zeroplan.core.deepspeed_coordinator's replay), against the committed records of DeepSpeed 0.19.8's own
engine: the emitted file's run (prefetch on, stage3_max_live_parameters bounded: the forward's
last modules stay gathered for their backward) and the harness's own config (prefetch off:
every parameter gathered twice). Reads JSON records only; no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.communication import collectives
from zeroplan.core.deepspeed_coordinator import (
    backward_gather_bytes, forward_gather_bytes, max_live_parameters, prefetch_bucket_elements,
)
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.harness.record import read_record
from zeroplan.specs.training import StateConvention
from zeroplan.validate.compare import compare_record, request_for

ROOT = Path(__file__).resolve().parents[1]
EMITTED = ROOT / "benchmarks" / "emitted-records" / "tiny-llama-zero3-deepspeed-n2"
HARNESS = [ROOT / "benchmarks" / "deepspeed-records" / f"tiny-llama-zero3-deepspeed-{p}-n2" for p in ("fp32", "bf16-mixed")]


def _rows(path: Path) -> dict[str, object]:
    return {row.quantity: row for row in compare_record(read_record(path))}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_emitted_run_gathers_what_the_planner_predicts(rank: int) -> None:
    path = EMITTED / f"rank{rank:05d}.json"
    row = _rows(path)["all_gather bytes/step"]
    assert row.measured_bytes == row.predicted_bytes
    # The record carries the settings the emitted file set, and they are the ones --emit writes.
    record = read_record(path)
    settings = json.loads((EMITTED / "deepspeed.json").read_text())["zero_optimization"]
    assert record.description.deepspeed_stage3.prefetch_bucket_size == settings["stage3_prefetch_bucket_size"]
    assert record.description.deepspeed_stage3.max_live_parameters == settings["stage3_max_live_parameters"]
    request = request_for(record.description)
    assert prefetch_bucket_elements(request) == settings["stage3_prefetch_bucket_size"]
    assert max_live_parameters(request) == settings["stage3_max_live_parameters"]


def _kept_bytes(request, whole: int) -> int:
    """What is gathered once, not twice, in the step (``whole``: the bytes of every parameter
    fetched per step): what the forward left gathered (or a prefetch at its end gathered) for
    the backward."""
    return 2 * whole - sum(forward_gather_bytes(request)) - sum(backward_gather_bytes(request))


def test_the_turnaround_keeps_the_last_modules_within_max_live() -> None:
    request = request_for(read_record(EMITTED / "rank00000.json").description)
    # tiny-llama: head 3,145,728 + final norm 384 + the last block 1,573,632 + the second last
    # block's down, up, gate, mlp_norm, o, v, k (1,425,792) stay gathered; its q (147,456) would
    # pass max_live.
    whole = sum(unit_gather_bytes(request, request.shard_group_size, 4))
    assert _kept_bytes(request, whole) == 6_145_536 * 4 and 6_145_536 <= max_live_parameters(request) < 6_145_536 + 147_456
    # What they hold is within the gathered units the buffer model counts under --emit's settings.
    assert _kept_bytes(request, whole) <= (1 + request.strategy.prefetch_units) * largest_unit_elements(request) * 4
    predicted = sum(c.buffer_bytes_per_step for c in collectives(request) if c.op.value == "all_gather")
    assert predicted == 2 * whole - _kept_bytes(request, whole)


@pytest.mark.parametrize("run", HARNESS, ids=lambda p: p.name)
def test_the_harness_config_prefetches_nothing_and_gathers_twice(run: Path) -> None:
    record = read_record(run / "rank00000.json")
    request = request_for(record.description)
    whole = sum(unit_gather_bytes(request, 2, 4 if record.description.training.precision.value == "fp32" else 2))
    assert prefetch_bucket_elements(request) == 0 and _kept_bytes(request, whole) == 0
    row = _rows(run / "rank00000.json")["all_gather bytes/step"]
    assert row.measured_bytes == row.predicted_bytes == 2 * whole


def _gathered(request) -> int:
    return sum(c.buffer_bytes_per_step for c in collectives(request) if c.op.value == "all_gather")


def test_persistent_parameters_are_never_gathered_per_step() -> None:
    request = request_for(read_record(EMITTED / "rank00000.json").description)
    everything = request.with_strategy(request.strategy.model_copy(update={"deepspeed_param_persistence_threshold": 10**9}))
    assert _gathered(everything) == 0
    norms = request.with_strategy(request.strategy.model_copy(update={"deepspeed_param_persistence_threshold": 384}))
    # The 9 norms (384 elements) persist; the prefetch scan then also keeps the second last
    # block's q: 3,145,728 + 1,572,864 + 1,179,648 + 245,760 + 147,456 elements.
    whole = sum(unit_gather_bytes(request, 2, 4)) - 9 * 384 * 4
    assert _kept_bytes(norms, whole) == 6_291_456 * 4
    assert _gathered(norms) == 2 * whole - 6_291_456 * 4


def test_the_reference_convention_is_unchanged() -> None:
    """Under the zero convention (the harness's own ZeRO-3 engine) every unit is gathered before
    its forward and again before its backward, whatever the DeepSpeed settings say."""
    request = request_for(read_record(EMITTED / "rank00000.json").description)
    reference = request.model_copy(update={"training": request.training.model_copy(
        update={"state_convention": StateConvention.zero})})
    whole = sum(unit_gather_bytes(reference, reference.shard_group_size, 4))
    gathered = sum(c.buffer_bytes_per_step for c in collectives(reference) if c.op.value == "all_gather")
    assert gathered == 2 * whole
