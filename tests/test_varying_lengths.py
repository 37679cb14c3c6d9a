"""Batches of varying length: the record statistics (zeroplan.core.length_records), the reserve
an epoch's record batches leave cached (zeroplan.allocator.varying_lengths), its place in the
breakdown, and --varying-lengths' refusals."""

from __future__ import annotations

import functools
import itertools
import math

import pytest

from zeroplan.allocator.rules import allocation_size
from zeroplan.allocator.eager_softmax_workspace import peak_tensors
from zeroplan.allocator.varying_lengths import (
    at_length, record_sizes, record_tensor_bytes, segment_size_cdf, varying_length_reserve_bytes,
)
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.length_records import (
    batch_length_cdf, batches_per_rank, expected_record_sum, regularized_gamma_p, sample_length_cdf,
)
from zeroplan.core.plan import memory_breakdown, peak_terms, pipeline_rank_breakdowns
from zeroplan.errors import ZeroplanError
from zeroplan.specs.lengths import LongSamples, VaryingLengths
from zeroplan.specs.strategy import StrategyKind

def terms_of(request):
    return peak_terms(request)[1]


PAGE = VaryingLengths(mean_tokens=3234.4, sd_tokens=2547.5, min_tokens=91, samples=4959)
"""ms-swift's benchmark dataset (cls-fudan-news-zh, docs/source/LLM/Benchmark.md)."""


def test_incomplete_gamma_matches_closed_forms() -> None:
    # P(1, x) = 1 - exp(-x); P(1/2, x) = erf(sqrt(x)); both branches (x below and above a + 1).
    for x in (0.1, 0.9, 1.5, 4.0, 30.0):
        assert regularized_gamma_p(1.0, x) == pytest.approx(1 - math.exp(-x), rel=1e-12)
        assert regularized_gamma_p(0.5, x) == pytest.approx(math.erf(math.sqrt(x)), rel=1e-12)
    assert regularized_gamma_p(2.0, 0.0) == 0.0


def test_shifted_gamma_has_the_published_mean() -> None:
    # The CDF's own mean (the integral of 1 - F from MIN) is the published mean.
    cdf = sample_length_cdf(PAGE)
    step = 32
    mean = PAGE.min_tokens + sum((1 - cdf(PAGE.min_tokens + t + step / 2)) * step for t in range(0, 60_000, step))
    assert mean == pytest.approx(PAGE.mean_tokens, rel=1e-3)


def test_expected_record_sum_matches_enumeration() -> None:
    # Three lengths of probability 0.5, 0.3, 0.2, four batches: every sequence enumerated.
    probabilities = {1: 0.5, 2: 0.3, 3: 0.2}
    cdf = [(1, 0.5), (2, 0.8), (3, 1.0)]
    records = longest = 0.0
    for sequence in itertools.product(probabilities, repeat=4):
        weight = math.prod(probabilities[x] for x in sequence)
        best, total = 0, 0
        for x in sequence:
            if x > best:
                best, total = x, total + x * x
        records += weight * total
        longest += weight * best * best
    assert expected_record_sum(cdf, 4, lambda x: x * x) == pytest.approx((records, longest), rel=1e-12)


def test_batches_drop_the_samples_above_seq_len_and_split_over_data_parallel_ranks() -> None:
    kept = PAGE.samples * sample_length_cdf(PAGE)(2048)
    assert batches_per_rank(PAGE, 2048, 2, 2) == math.ceil(kept / 4)
    cut = PAGE.model_copy(update={"long_samples": LongSamples.truncate})
    assert batches_per_rank(cut, 2048, 1, 1) == PAGE.samples
    # Cut samples put their mass at seq_len; a batch's length is the longest of its samples.
    assert batch_length_cdf(cut, 2048, 1)[-2][1] == pytest.approx(sample_length_cdf(PAGE)(2047))
    assert batch_length_cdf(PAGE, 2048, 4)[100][1] == pytest.approx(batch_length_cdf(PAGE, 2048, 1)[100][1] ** 4)


@functools.lru_cache(maxsize=None)
def _request(*extra: str):
    args = build_parser().parse_args(["fit", "qwen2.5-0.5b", "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "2048",
                                      "--precision", "bf16-pure", "--framework", "hf", *extra])
    return request_from_args(args, StrategyKind.ddp)


def test_reserve_is_a_segment_per_record_of_each_largest_loss_tensor() -> None:
    request = _request("--varying-lengths", "3234.4,2547.5,91,4959")
    states, terms = peak_terms(request)
    tensors = record_tensor_bytes(request, terms)
    # The reference loss: three fp32 logit tensors of b s V, all counted.
    assert len(tensors) == 3 and len(set(tensors)) == 1
    cdf, batches = batch_length_cdf(PAGE, 2048, 1), batches_per_rank(PAGE, 2048, 1, 1)

    def segment(t: int) -> int:
        return allocation_size(-(-tensors[0] * t // 2048 // 512) * 512)

    records, longest = expected_record_sum(segment_size_cdf(cdf, segment), batches, segment)
    extra = varying_length_reserve_bytes(request, terms, 0, 2**50, terms_of)
    assert extra == pytest.approx(3 * (records - longest), rel=1e-9)
    assert records > longest
    # A record whose request still fits its predecessor's segment (2 MiB steps: 3.4 tokens of a
    # 151,936-entry fp32 row) takes none: fewer segments than one a token.
    per_token, _ = expected_record_sum(cdf, batches, segment)
    assert records < 0.95 * per_token
    # Never past the usable memory: where the cache would outgrow it, a failing cudaMalloc frees it.
    assert varying_length_reserve_bytes(request, terms, 10, 10 + extra // 2, terms_of) == extra // 2
    # Expandable segments map a longer batch's pages into the same segment: nothing left behind.
    expandable = _request("--varying-lengths", "3234.4,2547.5,91,4959", "--allocator-conf", "expandable_segments:True")
    assert varying_length_reserve_bytes(expandable, terms_of(expandable), 0, 2**50, terms_of) == 0


@functools.lru_cache(maxsize=None)
def _device_map_request(*extra: str):
    """Qwen2.5-7B LoRA over two GPUs in one process (device_map 'auto'): GPU 0 holds the
    embedding and the first blocks, GPU 1 the rest and the loss."""
    args = build_parser().parse_args(["fit", "qwen2.5-7b", "--gpus", "2", "--gpu", "a100-80gb", "--seq-len", "2048",
                                      "--precision", "bf16-pure", "--framework", "hf", "--lora-rank", "8",
                                      "--device-map", "auto", "--varying-lengths", "3234.4,2547.5,91,4959", *extra])
    return request_from_args(args, StrategyKind.ddp)


def test_a_rank_without_the_loss_counts_its_backward_workspace_per_record() -> None:
    request = _device_map_request("--activation-checkpointing", "full")
    gpu0, gpu1 = request.at_pipeline_rank(0), request.at_pipeline_rank(1)
    terms = terms_of(gpu0)
    assert record_tensor_bytes(gpu0, terms) == []
    (size_at,) = record_sizes(gpu0, terms, terms_of)
    # Under transformers' profile the schedule allocates the workspace as one tensor.
    assert size_at(2048) == terms.workspace
    cdf, batches = batch_length_cdf(PAGE, 2048, 1), batches_per_rank(PAGE, 2048, 1, 1)

    def segment(t: int) -> int:
        return allocation_size(-(-terms.workspace * t // 2048 // 512) * 512)

    records, longest = expected_record_sum(segment_size_cdf(cdf, segment), batches, segment)
    assert varying_length_reserve_bytes(gpu0, terms, 0, 2**50, terms_of) == pytest.approx(records - longest, rel=1e-9)
    # The loss's GPU counts the loss's three tensors, as a single GPU does.
    assert len(record_sizes(gpu1, terms_of(gpu1), terms_of)) == 3
    # In the plan: GPU 0's reserve grows by it.
    zero, one = (breakdown for breakdown, _ in pipeline_rank_breakdowns(request))
    assert 0 < zero.varying_length_reserve_bytes < one.varying_length_reserve_bytes


def test_a_workspace_part_that_does_not_grow_with_the_length_is_kept_at_shorter_lengths() -> None:
    # QLoRA's dequantized weight is in the workspace at every length: the size at 512 tokens is
    # the planner's own there, not a quarter of the one at 2048.
    gpu0 = _device_map_request("--activation-checkpointing", "full", "--quantize", "nf4").at_pipeline_rank(0)
    terms = terms_of(gpu0)
    (size_at,) = record_sizes(gpu0, terms, terms_of)
    shorter = at_length(gpu0, 512)
    assert size_at(512) == terms_of(shorter).workspace > terms.workspace // 4


def test_without_full_recomputation_a_rank_without_the_loss_counts_nothing() -> None:
    gpu0 = _device_map_request("--activation-checkpointing", "none").at_pipeline_rank(0)
    assert record_sizes(gpu0, terms_of(gpu0), terms_of) == []


def test_peak_tensors_are_those_alive_at_the_most_bytes() -> None:
    # 10, 20 made; the 10 freed; 30 made (50 alive: the peak); the 20 freed; 5 made.
    assert peak_tensors((10, 20, ~0, 30, ~1, 5)) == (20, 30)


def test_segment_size_cdf_keeps_the_last_length_of_each_segment_size() -> None:
    # Lengths 1-3 share a segment, 4 and 5 another: a batch of 2 or 3 after one of 1 fits its segment.
    cdf = [(1, 0.1), (2, 0.3), (3, 0.5), (4, 0.8), (5, 1.0)]
    assert segment_size_cdf(cdf, lambda t: 1 if t <= 3 else 2) == [(3, 0.5), (5, 1.0)]
    assert segment_size_cdf(cdf, lambda t: t) == cdf


def test_breakdown_adds_the_reserve_and_its_terms_still_sum_to_the_peak() -> None:
    plain, _ = memory_breakdown(_request())
    varying, _ = memory_breakdown(_request("--varying-lengths", "3234.4,2547.5,91,4959"))
    assert plain.varying_length_reserve_bytes == 0
    assert varying.varying_length_reserve_bytes > 0
    assert varying.peak_bytes == plain.peak_bytes + varying.varying_length_reserve_bytes
    assert varying.reserved_peak_bytes == plain.reserved_peak_bytes + varying.varying_length_reserve_bytes
    assert sum(varying.peak_terms().values()) == varying.peak_bytes
    # Dumped where it is set; a breakdown without it dumps as before the field existed.
    assert "varying_length_reserve_bytes" in varying.model_dump()
    assert "varying_length_reserve_bytes" not in plain.model_dump()


@pytest.mark.parametrize("value, words", [
    ("3234,2547,91", "MEAN,SD,MIN,SAMPLES"),
    ("a,2547,91,4959", "expected numbers"),
    ("3234,0,91,4959", "must be positive"),
    ("3234,2547,91,4959,keep", "drop or truncate"),
    ("50,20,91,4959", "must exceed the shortest"),
])
def test_bad_values_are_one_line_naming_the_flag(value: str, words: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "qwen2.5-0.5b", "--varying-lengths", value])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--varying-lengths" in message and words in message


def test_spec_refuses_a_mean_at_the_minimum() -> None:
    with pytest.raises(ZeroplanError, match="batch.varying_lengths"):
        VaryingLengths(mean_tokens=91, sd_tokens=10, min_tokens=91, samples=10)


def test_record_sum_with_dropped_samples_hardly_depends_on_the_shape() -> None:
    # benchmarks/varying_length_shapes.py: at 2048 tokens, the whole-set lengths of ms-swift's
    # page as a gamma of the published moments, a gamma of shape 0.5 with its mean, or a
    # log-normal of its moments give the same expected growth per logit-sized tensor to 2 %,
    # nearly twice what the January rows grew (2.6-2.7 segments of 2048 tokens): the dataset's
    # shape is not what the term misses there.
    from pathlib import Path

    from tests.scripts import load_script

    shapes = load_script(Path(__file__).parents[1] / "benchmarks" / "varying_length_shapes.py")
    cdfs = (shapes.gamma_cdf(((shapes.MEAN - shapes.MIN) / shapes.SD) ** 2), shapes.gamma_cdf(0.5), shapes.lognormal_cdf())
    growth = [shapes.per_tensor_growth(cdf, 2048)[0] for cdf in cdfs]
    assert max(growth) / min(growth) < 1.02
    assert min(growth) > 1.8 * 2.7
