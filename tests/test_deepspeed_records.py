"""The planner's collectives against DeepSpeed 0.19.8's, as measured in benchmarks/deepspeed-records
(`python benchmarks/cpu_records.py --deepspeed`): per collective kind, bytes and calls per step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from zeroplan.core.communication import collectives
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import compare_record, request_for

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-records"
ZERO12_RUNS = sorted(p.name for p in RECORDS.iterdir() if "-zero1-" in p.name or "-zero2-" in p.name)


def test_every_zero12_record_is_checked() -> None:
    assert len(ZERO12_RUNS) == 5


@pytest.mark.parametrize("run", ZERO12_RUNS)
@pytest.mark.parametrize("rank", [0, 1])
def test_zero12_collectives_match_deepspeed(run: str, rank: int) -> None:
    record = read_record(RECORDS / run / f"rank{rank:05d}.json")
    predicted_bytes, predicted_calls = Counter(), Counter()
    for c in collectives(request_for(record.description)):
        predicted_bytes[c.op.value] += c.buffer_bytes_per_step
        predicted_calls[c.op.value] += c.calls * c.occurrences_per_step
    for step in record.steps:
        measured_bytes, measured_calls = Counter(), Counter()
        for call in step.collectives:
            measured_bytes[call.op] += call.num_bytes
            measured_calls[call.op] += 1
        assert measured_bytes == predicted_bytes
        assert measured_calls == predicted_calls


@pytest.mark.parametrize("run", ZERO12_RUNS)
def test_validate_rows_agree_to_the_byte(run: str) -> None:
    rows = compare_record(read_record(RECORDS / run / "rank00000.json"))
    communication = [r for r in rows if r.category == "communication"]
    assert {r.quantity for r in communication} == {"all_reduce bytes/step", "all_gather bytes/step"}
    assert all(r.predicted_bytes == r.measured_bytes for r in communication)
