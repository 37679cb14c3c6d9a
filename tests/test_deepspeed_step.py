"""DeepSpeed's ZeRO-1/2 step temporaries (zeroplan.core.deepspeed_step) against DeepSpeed's own
engine: the fp64 copies its gradient norm makes, recorded on gloo/CPU by
benchmarks/deepspeed_norm_records.py (benchmarks/deepspeed-norm-records/records.json; JSON only
here), and the allocator replay's view of the step (one tensor each, not per-unit parts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.allocator.trace import AllocEvent
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.core.deepspeed_step import NORM_COPY_BYTES, largest_partition_piece_elements, norm_copy_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.specs import StrategyKind

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-norm-records" / "records.json").read_text())


def _pieces(numels: list[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s gradient pieces: each tensor's overlap with its partition, in order."""
    partition = flat_group_elements(sum(numels), world) // world
    lo, hi = rank * partition, (rank + 1) * partition
    pieces, offset = [], 0
    for numel in numels:
        overlap = min(offset + numel, hi) - max(offset, lo)
        if overlap > 0:
            pieces.append(overlap)
        offset += numel
    return pieces


@pytest.mark.parametrize("run", RECORDS["runs"], ids=lambda r: f"zero{r['stage']}-{r['dtype']}-rank{r['rank']}")
def test_the_norm_casts_each_gradient_piece_of_the_partition_to_fp64(run: dict) -> None:
    # One fp64 copy per parameter overlapping the rank's partition, of the overlap's size.
    assert run["float64_copies"] == _pieces(run["numels"], run["world_size"], run["rank"])


def test_the_largest_copy_is_the_largest_piece_over_the_ranks() -> None:
    for stage in (1, 2):
        runs = [r for r in RECORDS["runs"] if r["stage"] == stage and r["dtype"] == "fp32"]
        largest = max(max(r["float64_copies"]) for r in runs)
        assert largest == largest_partition_piece_elements(runs[0]["numels"], runs[0]["world_size"]) == 34340


def _request(flags: str, kind: StrategyKind):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})


DEEPSPEED = "llama-2-7b --gpus 8 --micro-batch 1 --seq-len 1024 --state-convention deepspeed"


def test_the_step_temporary_is_the_norm_copy_under_fused_adam() -> None:
    request = _request(DEEPSPEED, StrategyKind.zero1)
    _, terms = peak_terms(request)
    assert terms.step_temporary == norm_copy_bytes(request) > 0
    assert norm_copy_bytes(request) % NORM_COPY_BYTES == 0
    # Offloaded or sharded-parameter steps are not this one.
    assert norm_copy_bytes(_request(DEEPSPEED, StrategyKind.zero3)) == 0
    assert norm_copy_bytes(_request(DEEPSPEED, StrategyKind.zero2_offload)) == 0
    assert norm_copy_bytes(_request("llama-2-7b --gpus 8 --micro-batch 1 --seq-len 1024", StrategyKind.zero1)) == 0


def test_the_replay_makes_the_step_gradient_and_temporary_whole() -> None:
    # DeepSpeed steps one flat fp32 gradient partition and makes the norm's copy one tensor at a
    # time: the trace allocates each as a single tensor, not in per-unit parts.
    request = _request(DEEPSPEED, StrategyKind.zero1)
    states, terms = peak_terms(request)
    sizes = [e.size_bytes for e in step_trace(request, states, terms).events if isinstance(e, AllocEvent)]
    assert terms.step_temporary in sizes and states.gradient_bytes in sizes
