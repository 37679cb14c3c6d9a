"""Gradients and optimizer states made inside an epoch of varying lengths
(zeroplan.allocator.lazy_states): the loops that make them there, the segment a run may need
beyond its step, and the borderline verdict it gives a fit with no room for that segment."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.lazy_states import largest_gradient_bytes, lazy_state_segment_bytes, makes_states_in_epoch
from zeroplan.allocator.rules import SMALL_SIZE_BYTES, allocation_size, round_size
from zeroplan.allocator.varying_lengths import record_tensor_bytes
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.margin import PEAK_ERROR_BAND, borderline_words, is_borderline, margin_words, split_segment_words
from zeroplan.core.plan import peak_terms, plan
from zeroplan.specs.strategy import StrategyKind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import published_memory_accuracy  # noqa: E402

GIB = 2**30
PAGE = ("--varying-lengths", "3234.4,2547.5,91,1000,truncate")
"""ms-swift's December page: its dataset's statistics, 1,000 samples cut to max_length."""


@functools.lru_cache(maxsize=None)
def _request(*extra: str, strategy: StrategyKind = StrategyKind.ddp, model: str = "qwen2.5-0.5b"):
    args = build_parser().parse_args(["fit", model, "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "2048",
                                      "--precision", "bf16-pure", *extra])
    return request_from_args(args, strategy)


def _segment(request) -> int:
    """The segment of the step's largest request: a fp32 logit-sized loss tensor at seq_len."""
    states, terms = peak_terms(request)
    return allocation_size(round_size(max(record_tensor_bytes(request, terms)), parse_alloc_conf("")))


def _split(request, one_step: int, usable: int) -> int:
    states, terms = peak_terms(request)
    return lazy_state_segment_bytes(request, states, terms, one_step, usable)


def test_the_segment_counts_where_the_room_cannot_hold_one_more() -> None:
    request = _request("--framework", "hf", *PAGE)
    segment = _segment(request)
    # 151,936 vocabulary entries x 2,048 tokens x 4 bytes, in 2 MiB steps.
    assert segment == allocation_size(151_936 * 2048 * 4) == 1_245_708_288
    usable = 70 * GIB
    assert _split(request, usable - segment + 1, usable) == segment
    assert _split(request, usable - segment, usable) == 0
    # Every batch at seq_len: the step's own loss tensors hold those segments.
    plain = _request("--framework", "hf")
    assert _split(plain, usable - 1, usable) == 0


def test_only_loops_that_make_them_inside_the_epoch_count() -> None:
    usable = 70 * GIB
    for framework in ("hf", "torchtune", "litgpt", "zeroplan"):
        # litgpt builds no Qwen2 (q, k, v biases): a Llama shape.
        assert makes_states_in_epoch(_request("--framework", framework, *PAGE, model="tinyllama-1.1b")), framework
    # torchtitan (not read for this), DeepSpeed's engine (its partitions made at initialisation)
    # and an optimizer stepped in the backward are not modelled as making them there.
    for request in (_request("--framework", "torchtitan", *PAGE, model="tinyllama-1.1b"), _request("--framework", "hf", *PAGE, strategy=StrategyKind.zero2),
                    _request("--framework", "torchtune", "--optimizer-in-backward", *PAGE)):
        assert not makes_states_in_epoch(request)
        assert _split(request, usable - 1, usable) == 0


def test_gradients_of_the_small_pool_cannot_split_a_loss_segment() -> None:
    usable = 70 * GIB
    full = _request("--framework", "hf", *PAGE)
    # The full model's largest gradient: the 151,936 x 896 embedding in bf16.
    assert largest_gradient_bytes(full, peak_terms(full)[0]) == 151_936 * 896 * 2
    lora = _request("--framework", "hf", "--lora-rank", "8", *PAGE)
    assert largest_gradient_bytes(lora, peak_terms(lora)[0]) <= SMALL_SIZE_BYTES
    assert _split(lora, usable - 1, usable) == 0


def test_expandable_segments_leave_no_segment_to_split() -> None:
    request = _request("--framework", "hf", "--allocator-conf", "expandable_segments:True", *PAGE)
    assert _split(request, 70 * GIB - 1, 70 * GIB) == 0


def test_a_fit_that_may_need_one_more_segment_is_borderline_whatever_the_band() -> None:
    # 50 % of usable: far from every band, and still borderline with a segment to split.
    assert not is_borderline(50 * GIB, 100 * GIB)
    assert is_borderline(50 * GIB, 100 * GIB, split_segment_bytes=4 * GIB)
    # A predicted OOM stays judged by the band alone.
    assert not is_borderline(150 * GIB, 100 * GIB, split_segment_bytes=4 * GIB)
    assert "4.64 GiB segment" in split_segment_words(4_978_638_848)
    assert split_segment_words(GIB) != borderline_words(50 * GIB, 100 * GIB)


def test_a_fit_borderline_for_both_reasons_names_both() -> None:
    segment = margin_words(50 * GIB, 100 * GIB, PEAK_ERROR_BAND, None, True, 4 * GIB)
    assert segment == split_segment_words(4 * GIB)
    near = margin_words(99 * GIB, 100 * GIB, PEAK_ERROR_BAND, None, True, 0)
    assert near.startswith(borderline_words(99 * GIB, 100 * GIB)) and "segment" not in near
    both = margin_words(99 * GIB, 100 * GIB, PEAK_ERROR_BAND, None, True, 4 * GIB)
    assert both.startswith(near) and "4.00 GiB segment" in both
    # An OOM is judged by the band alone: no segment to name.
    assert "segment" not in margin_words(101 * GIB, 100 * GIB, PEAK_ERROR_BAND, None, False, 4 * GIB)
    assert margin_words(50 * GIB, 100 * GIB, PEAK_ERROR_BAND, None, True, 0) == ""


def _row_plan(row_id: str):
    row = next(row for row in published_memory_accuracy.load_rows() if row["id"] == row_id)
    args = build_parser().parse_args(published_memory_accuracy.argv_of(row))
    return plan(request_from_args(args, StrategyKind(row["strategy"])), largest_micro_batch=False, timed=False)


# About 0.7 s (two 7B plans replayed through the allocator model).
@pytest.mark.slow
def test_the_ms_swift_qwen_7b_full_fine_tune_at_8192_is_no_plain_fit() -> None:
    # ms-swift's December page: at max_length 8192 the run ran out of memory; the step fits
    # (79.5 of 79.5 GiB with the epoch's records), and one more 4.64 GiB loss segment has no room.
    ran_out = _row_plan("swift-dec-qwen-7b-chat-full-8192-oom")
    assert ran_out.fits and ran_out.borderline
    assert ran_out.memory.lazy_state_segment_bytes == allocation_size(151_936 * 8192 * 4)
    assert ran_out.memory.model_dump()["lazy_state_segment_bytes"] == ran_out.memory.lazy_state_segment_bytes
    # At 4096 (completed, 77.13 GiB measured) the room holds one more 2.32 GiB segment.
    completed = _row_plan("swift-dec-qwen-7b-chat-full-4096")
    assert completed.fits and not completed.borderline
    assert completed.memory.lazy_state_segment_bytes == 0
    assert "lazy_state_segment_bytes" not in completed.memory.model_dump()
