"""DeepSpeed's slicing of a gradient larger than its reduce bucket, found a run of whole
partitions at a time, against the slice-by-slice loop it replaces (stage_1_and_2.py
average_tensor and allreduce_and_scatter, as zeroplan/core/deepspeed_buckets.py cites them)."""

from __future__ import annotations

import random

import pytest

from zeroplan.core.deepspeed_buckets import (
    _sliced_all_reduce_calls, gradient_all_reduce_elements, shared_gradient_all_reduce_elements,
)


def _naive(offset: int, numel: int, partition: int, cap: int) -> list[int]:
    pieces, end = [], offset + numel
    while offset < end:
        bound = (offset // partition + 1) * partition
        pieces.append(min(end, bound) - offset)
        offset += pieces[-1]
    calls, filled = [], 0
    for piece in pieces:
        filled += piece
        if filled > cap:
            calls.append(filled)
            filled = 0
    if filled:
        calls.append(filled)
    return calls


@pytest.mark.parametrize("seed", range(300))
def test_runs_of_whole_partitions_give_the_slice_by_slice_calls(seed: int) -> None:
    rng = random.Random(seed)
    partition = rng.choice([1, 2, 3, 7, 64, 1000, rng.randint(1, 5000)])
    cap = rng.choice([1, partition - 1 or 1, partition, partition + 1, 3 * partition, rng.randint(1, 20_000)])
    offset, numel = rng.randint(0, 10 * partition), rng.randint(1, 50 * partition + 7)
    assert _sliced_all_reduce_calls(offset, numel, partition, cap) == _naive(offset, numel, partition, cap)


def test_a_tensor_over_a_million_partitions_is_cut_in_bucket_sized_calls() -> None:
    # Llama-3.1-405B's embedding (128,256 x 16,384) at 2^20 ranks, a 5e8-element bucket.
    numel, partition, cap = 128_256 * 16_384, 387_052, 500_000_000
    calls = _sliced_all_reduce_calls(12_345, numel, partition, cap)
    assert sum(calls) == numel and all(c > cap for c in calls[:-1]) and len(calls) == 5


@pytest.mark.parametrize("reverse", [False, True])
def test_the_shared_pass_is_the_pass_in_registration_order_or_its_reverse(reverse: bool) -> None:
    rng = random.Random(7)
    numels = tuple(rng.choice([0, 1, 3, 50, 400, 5000]) for _ in range(60))
    order = list(range(len(numels)))[::-1] if reverse else list(range(len(numels)))
    expected = gradient_all_reduce_elements(list(numels), order, 1000, 6)
    assert shared_gradient_all_reduce_elements(numels, reverse, 1000, 6) == tuple(expected)
    assert shared_gradient_all_reduce_elements(numels, not reverse, 1000, 6) != tuple(expected)
