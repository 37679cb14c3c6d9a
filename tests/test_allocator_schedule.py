"""The planner's schedule as an allocation trace (zeroplan.allocator.schedule): its requested
peak is the planner's allocated peak, and the allocator model replays it."""

from __future__ import annotations

import pytest

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.schedule import split_bytes, step_trace
from zeroplan.allocator.trace import AllocEvent, Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.specs import StrategyKind

TITAN = "llama-3.1-8b --framework torchtitan --gpus 8 --gpu h100-80gb --micro-batch 2 --seq-len 8192 --activation-checkpointing selective-op"
CASES = [
    (TITAN, StrategyKind.fsdp_full_shard),
    (TITAN, StrategyKind.ddp),
    ("llama-2-7b --gpus 8 --micro-batch 1 --seq-len 2048", StrategyKind.zero3),
    ("llama-2-7b --gpus 8 --micro-batch 2 --seq-len 1024 --grad-accum 4 --activation-checkpointing full", StrategyKind.zero2),
    ("llama-3.1-8b --framework torchtitan --gpus 8 --micro-batch 1 --seq-len 4096", StrategyKind.fsdp_shard_grad_op),
]


def _request(flags: str, kind: StrategyKind):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})


def _trace(request):
    return step_trace(request, *peak_terms(request))


@pytest.mark.parametrize("flags, kind", CASES)
def test_trace_peak_is_the_planners_allocated_peak(flags: str, kind: StrategyKind) -> None:
    request = _request(flags, kind)
    trace = step_trace(request, *peak_terms(request))
    assert trace.requested_peak_bytes() == memory_breakdown(request)[0].allocated_peak_bytes


def test_fsdp_units_use_the_collective_streams() -> None:
    trace = _trace(_request(TITAN, StrategyKind.fsdp_full_shard))
    streams = {e.stream for e in trace.events if isinstance(e, AllocEvent)}
    assert streams == {Stream.compute, Stream.all_gather, Stream.reduce_scatter}


def test_allocator_reserves_at_least_the_allocated_peak() -> None:
    trace = _trace(_request(TITAN, StrategyKind.fsdp_full_shard))
    for text in ("", "expandable_segments:True"):
        verdict = oom_capacity(trace, parse_alloc_conf(text))
        assert verdict.unlimited.completed
        assert verdict.unlimited.requested_peak_bytes <= verdict.oom_capacity_bytes <= verdict.unlimited.reserved_peak_bytes + 2**21


def test_split_bytes_keeps_the_total() -> None:
    assert sum(split_bytes(1001, [3, 1, 0, 6])) == 1001
    assert split_bytes(0, [1]) == []
