"""The coarse step replay under an interleaved pipeline runs the in-flight chunks in the order
torch's ScheduleInterleaved1F1B runs them (zeroplan.allocator.schedule._in_flight_chunk_blocks):
each chunk over its own stage's blocks, the head stage's chunk last and first back."""

from __future__ import annotations

import functools

from zeroplan.allocator.schedule import _in_flight_chunk_blocks, step_trace
from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.parallel.pipeline import in_flight_chunks
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.specs.strategy import StrategyKind

BLOCKS = 126 // 8
"""The coarse schedule's block slots on a 405B pp 8 rank."""


@functools.cache
def _request(schedule: str, rank: int, microbatches: int = 8):
    args = build_parser().parse_args([
        "fit", "llama-3.1-405b", "--gpus", "512", "--gpu", "h100-80gb", "--micro-batch", "4", "--seq-len", "8192",
        "--grad-accum", str(microbatches), "--activation-checkpointing", "full", "--framework", "torchtitan",
        "--tp", "8", "--pp", "8", "--pp-schedule", schedule, "--unchunked-loss", "--torchtitan-release", "9dec370"])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard).at_pipeline_rank(rank)


def test_last_rank_holds_its_first_stages_round_then_one_head_chunk() -> None:
    # pp 8, m 8, v 2: rank 7 runs stages 7 (8 blocks) and 15 (7 blocks and the head); its warm-up
    # is one round of stage 7 (8 micro-batches), then stage 15's first micro-batch, whose loss
    # and backward come next (in_flight_chunks: 9).
    chunks = _in_flight_chunk_blocks(_request("interleaved-1f1b", 7), BLOCKS)
    assert chunks == (tuple(range(8)),) * 8 + (tuple(range(8, 15)),)


def test_rank_zero_runs_a_round_of_each_stage() -> None:
    request = _request("interleaved-1f1b", 0)
    chunks = _in_flight_chunk_blocks(request, BLOCKS)
    assert len(chunks) == in_flight_chunks(request.parallel, 0, 8) == 16
    # Stage 0 holds 7 blocks (the embedding counts as one), stage 8 holds 8.
    assert chunks == (tuple(range(7)),) * 8 + (tuple(range(7, 15)),) * 8


def test_two_rounds_alternate_the_stages() -> None:
    request = _request("interleaved-1f1b", 0, microbatches=16)
    chunks = _in_flight_chunk_blocks(request, BLOCKS)
    # q = 8 micro-batches a round; rank 0's warm-up (v - 1) q + 2 (p - 1) = 22 forwards and one
    # more: 8 of stage 0, 8 of stage 8, 7 of stage 0 again.
    assert len(chunks) == in_flight_chunks(request.parallel, 0, 16) == 23
    assert [c[0] for c in chunks] == [0] * 8 + [7] * 8 + [0] * 7


def test_other_schedules_keep_every_block_per_micro_batch() -> None:
    assert _in_flight_chunk_blocks(_request("1f1b", 7), BLOCKS) == ()


def test_the_trace_still_peaks_at_the_planners_allocated_peak() -> None:
    # The coarse schedule realises the planner's moments and nothing larger (the last rank, whose
    # chunks are of two sizes).
    request = _request("interleaved-1f1b", 7)
    trace = step_trace(request, *peak_terms(request))
    assert trace.requested_peak_bytes() == memory_breakdown(request)[0].allocated_peak_bytes
