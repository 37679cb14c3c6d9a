"""FSDP2's second traced step copied from the first (allocator/builder.py TraceBuilder.repeat_step,
allocator/fsdp_schedule.py record_fsdp_step): the same ops, marks, ids, peaks and sizes as
recording the second step call by call, for the frameworks' FSDP2 schedules; and a step that does
not free all it makes is recorded call by call instead."""

from __future__ import annotations

import pytest

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.allocator.fsdp_schedule import record_fsdp_step
from zeroplan.allocator.schedule import step_inputs
from zeroplan.cli.fit import add_fit_arguments, request_from_args
from zeroplan.cli.parser import OneLineParser
from zeroplan.core.plan import checked_peak_terms, replayed
from zeroplan.specs import StrategyKind

ARGVS = (
    ["llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "4", "--seq-len", "1024"],
    ["llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "16", "--seq-len", "1024",
     "--activation-checkpointing", "full"],
    ["llama-3.1-8b", "--framework", "torchtitan", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "2",
     "--seq-len", "2048"],
    ["llama-3.1-8b", "--framework", "torchtune", "--gpus", "4", "--gpu", "h100-80gb", "--micro-batch", "2",
     "--seq-len", "1024", "--activation-checkpointing", "full"],
    ["llama-2-7b", "--framework", "hf", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "2", "--seq-len", "2048",
     "--grad-accum", "4"],
    ["llama-2-7b", "--framework", "torchtune", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "2", "--seq-len", "512",
     "--fsdp-cpu-offload"],
    ["llama-2-7b", "--gpus", "16", "--gpu", "a100-80gb", "--micro-batch", "1", "--seq-len", "4096", "--lora-rank", "16"],
    ["llama-3.1-8b", "--framework", "litgpt", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "2",
     "--seq-len", "2048", "--grad-accum", "2"],
    # FSDP's no_sync accumulation: each step two micro-batches, the unsharded gradients held.
    ["llama-2-7b", "--framework", "litgpt", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "2",
     "--seq-len", "1024", "--grad-accum", "4", "--keep-unsharded-grads-on-accum"],
    ["llama-2-7b", "--framework", "hf", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "2",
     "--seq-len", "1024", "--grad-accum", "4", "--torch-release", "2.1"],
)


def _inputs(argv: list[str], kind: str):
    parser = OneLineParser(prog="fit")
    add_fit_arguments(parser)
    base = request_from_args(parser.parse_args(argv))
    request = base.with_strategy(base.strategy.model_copy(update={"kind": StrategyKind(kind)}))
    x = step_inputs(request, *replayed(*checked_peak_terms(request)))
    assert x.fsdp is not None
    return x


def _recorded(x, copy_second_step: bool) -> tuple:
    b = TraceBuilder()
    record_fsdp_step(x, x.fsdp, b, copy_second_step)
    return (b.ops, b.marks, b.next_id, b.requested_peak_bytes, b.rounded_peak_bytes, b.largest_request_bytes(),
            b._alive, b._alive_rounded, b._sizes)


@pytest.mark.parametrize("kind", ["fsdp-full-shard", "hsdp"])
@pytest.mark.parametrize("argv", ARGVS, ids=lambda argv: " ".join(argv[:1] + argv[2:]))
def test_the_copied_second_step_is_the_recorded_one(argv: list[str], kind: str) -> None:
    x = _inputs(argv, kind)
    copied, recorded = _recorded(x, True), _recorded(x, False)
    assert copied == recorded
    assert len(recorded[0]) > 100  # two steps of a real schedule, not an empty trace


def test_a_step_that_keeps_more_than_it_made_once_is_not_copied() -> None:
    b = TraceBuilder()
    b.alloc(1000)
    start = b.step_start()
    kept = b.alloc(3000)
    b.free(b.alloc(7000))
    once = b.once_start()
    b.alloc_parts([500, 600])
    once_end = len(b.ops), b.next_id
    ops = list(b.ops)
    # The step keeps 3,000 bytes beyond the once-made states: a second step would not start
    # where the first did, so it is not copied, and the peaks are the trace's so far.
    assert not b.repeat_step(start, once, once_end)
    assert b.ops == ops and b.next_id == 5
    assert b.requested_peak_bytes == 1000 + 3000 + 7000
    b.free(kept)
    # Freed inside the step: copied, the once-made states left out, ids shifted past the step.
    b2 = TraceBuilder()
    b2.alloc(1000)
    start = b2.step_start()
    b2.free(b2.alloc(7000))
    once = b2.once_start()
    b2.alloc_parts([500, 600])
    once_end = len(b2.ops), b2.next_id
    assert b2.repeat_step(start, once, once_end)
    assert b2.ops[5:] == [(0, 4, 7000, 0), (1, 4, 0, 0)]
    assert b2.next_id == 5
    # The second step's 7,000 bytes meet the 1,100 the first made once.
    assert b2.requested_peak_bytes == 1000 + 1100 + 7000
