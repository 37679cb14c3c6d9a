"""torchtitan's chunked loss: its two largest moments, the last chunk's head reduce-scatter and
the first chunk's cross-entropy backward, against the framework's own steps
(benchmarks/framework-step-records, zeroplan.frameworks.step)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.allocator.fsdp_schedule import loss_allocations
from zeroplan.core.framework_loss import (
    framework_logits_pieces, torchtitan_chunk_cross_entropy_bytes, torchtitan_chunk_cross_entropy_parts,
    torchtitan_chunked_loss_bytes, torchtitan_hidden_chunk_copies_bytes,
)
from zeroplan.core.plan import checked_peak_terms, pipeline_rank_requests
from zeroplan.frameworks.step_record import FrameworkStepRecord
from zeroplan.specs.parallel import ParallelSpec

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RECORDS = BENCHMARKS / "framework-step-records"


def _accuracy():
    sys.path.insert(0, str(BENCHMARKS))
    import framework_accuracy

    return framework_accuracy


def _request(name: str, **training):
    record = FrameworkStepRecord.model_validate_json((RECORDS / name).read_text(encoding="utf-8"))
    request = _accuracy().step_request(record)
    if training:
        request = request.model_copy(update={"training": request.training.model_copy(update=training)})
    return record, request


LONG = "torchtitan_llama-3.1-8b_fsdp-full-shard_n8_bf16-mixed_ac=full_s16384_b4.json"
SHORT = "torchtitan_llama-3.1-8b_fsdp-full-shard_n8_bf16-mixed_ac=full_s8192_b2.json"


def test_the_hidden_state_chunks_are_charged_as_copies() -> None:
    # The framework's own step at s16384 b4 held eight 64 MiB bf16 chunks (b s h / 8 each); at
    # b = 1 they are views, charged all the same so that the term stays affine in b.
    _, four = _request(LONG)
    _, one = _request("torchtitan_llama-3.1-8b_fsdp-full-shard_n8_bf16-mixed_ac=selective-op_s32768_b1.json")
    assert torchtitan_hidden_chunk_copies_bytes(four) == 8 * 64 * 2**20
    assert torchtitan_hidden_chunk_copies_bytes(one) == 2 * 32768 * 4096


def test_with_more_rows_a_chunk_than_the_hidden_size_the_cross_entropy_backward_is_the_larger_moment() -> None:
    # 8B: h 4096; s16384 b4 has 8192 rows a chunk, s8192 b2 2048.
    _, long = _request(LONG)
    _, short = _request(SHORT)
    assert torchtitan_chunk_cross_entropy_bytes(long) > torchtitan_chunked_loss_bytes(long)
    assert torchtitan_chunk_cross_entropy_bytes(short) < torchtitan_chunked_loss_bytes(short)


@pytest.mark.parametrize("name", [LONG, "torchtitan_llama-3.1-8b_fsdp-full-shard_n8_bf16-mixed_ac=selective-op_s32768_b1.json"])
def test_the_long_context_steps_peak_in_the_loss_and_the_planner_finds_it_there(name: str) -> None:
    accuracy = _accuracy()
    record, request = _request(name)
    breakdown = accuracy.memory_breakdown(request)[0]
    assert record.peak_phase.value == "loss" and breakdown.peak_moment.value == "loss-backward"
    assert abs(breakdown.allocated_peak_bytes - record.peak_bytes) <= accuracy.STEP_TARGET * record.peak_bytes


@pytest.mark.parametrize("compile_", [False, True])
def test_the_allocator_schedule_allocates_the_cross_entropy_moment_tensor_by_tensor(compile_: bool) -> None:
    _, request = _request(LONG, compile=compile_)
    pieces = framework_logits_pieces(request)
    _, terms = checked_peak_terms(request)
    parts = loss_allocations(request, terms)
    assert [sum(p) for p in parts] == list(pieces)
    assert parts[1] == torchtitan_chunk_cross_entropy_parts(request) and len(parts[1]) > 1
    # Eager: 16 bytes a logit (bf16 logits and gradient, three fp32 tensors); compiled: 4.
    rows_vocab = 4 * 16384 // 8 * request.model.vocab_size
    # (first the chunk's logits and the cross-entropy's tensors; then the fp32 gradient buffer,
    # the eight hidden-state chunk copies and the gathered head)
    cross_entropy = parts[1][:3 if compile_ else 5]
    assert sum(cross_entropy) - (0 if not compile_ else 8 * 4 * 16384 // 8) == (4 if compile_ else 16) * rows_vocab


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"cp": 2}, {"pp": 2}])
def test_the_allocated_tensors_add_up_to_the_moments_on_a_model_parallel_rank(parallel: dict) -> None:
    # The moments are this rank's (zeroplan.core.parallel.activations.rank_logits_pieces): the
    # cross-entropy moment's tensors must be sized the same way, not as the whole replica's.
    _, request = _request(LONG)
    request = request.model_copy(update={"parallel": ParallelSpec(**parallel)})
    for rank in pipeline_rank_requests(request):
        _, terms = checked_peak_terms(rank)
        assert [sum(p) for p in loss_allocations(rank, terms)] == list(terms.logits_pieces)
