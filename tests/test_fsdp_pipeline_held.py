"""FSDP2 under torch's pipeline schedules on gloo (benchmarks/fsdp_pipeline_held.py): every rank
holds its stages gathered in bf16 through the step and fp32 accumulators for the stages whose
backwards overlap; the records' peaks against the stages zeroplan counts
(zeroplan.core.parallel.units.accumulating_trainable_elements, core/buffers.py
backward_held_buffer_bytes)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.layout import gradient_wire_bytes
from zeroplan.core.parallel.units import accumulating_trainable_elements, rank_trainable_elements
from zeroplan.specs.strategy import StrategyKind

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline-records" / "fsdp"
GATHERED_BYTES = 2
"""MixedPrecisionPolicy(param_dtype=bf16): the gathered stage."""
ACCUMULATOR_BYTES = 4
"""reduce_dtype fp32: to_accumulated_grad_if_needed's accumulators."""
SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b"}


def _records() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(RECORDS.glob("*.json"))]


@functools.cache
def _request(schedule: str, pp: int, microbatches: int):
    args = build_parser().parse_args([
        "fit", "llama-3.1-8b", "--gpus", str(2 * pp), "--gpu", "h100-80gb", "--micro-batch", "1", "--seq-len", "2048",
        "--grad-accum", str(microbatches), "--framework", "torchtitan", "--pp", str(pp), "--pp-schedule", schedule])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def test_the_records_cover_both_schedules_at_one_and_two_rounds() -> None:
    runs = {(r["schedule"], r["microbatches"]) for r in _records()}
    assert runs == {("1F1B", 4), ("1F1B", 8), ("Interleaved1F1B", 4), ("Interleaved1F1B", 8)}
    assert len(_records()) == 16


@pytest.mark.parametrize("record", _records(), ids=lambda r: f"{r['schedule']}-m{r['microbatches']}-r{r['rank']}")
def test_peak_is_the_gathered_stages_and_the_accumulating_ones(record: dict) -> None:
    stage = record["stage_elements"][0]
    assert all(e == stage for e in record["stage_elements"])
    gathered = GATHERED_BYTES * sum(record["stage_elements"])
    accumulating = round((record["peak_bytes"] - gathered) / (ACCUMULATOR_BYTES * stage))
    # Within 1 %: the rest is the step's small tensors (8 x H micro-batches, the loss).
    assert record["peak_bytes"] == pytest.approx(gathered + accumulating * ACCUMULATOR_BYTES * stage, rel=0.01)
    # zeroplan's rule on the same schedule, pipeline degree and micro-batches: every stage of the
    # rank accumulates at once, or (interleaved, one round) one stage at a time.
    at = _request(SCHEDULES[record["schedule"]], record["pp"], record["microbatches"]).at_pipeline_rank(record["rank"])
    all_stages = accumulating_trainable_elements(at) == rank_trainable_elements(at)
    assert accumulating == (len(record["stage_elements"]) if all_stages else 1)
    assert gradient_wire_bytes(at) == ACCUMULATOR_BYTES
    # Reduced and resharded at each stage's last backward: nothing is left after the step.
    assert abs(record["end_bytes"]) < 0.01 * record["peak_bytes"]
