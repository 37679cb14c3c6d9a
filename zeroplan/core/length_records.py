"""The padded lengths an epoch of varying-length micro-batches reaches: how many batches run,
the distribution of a batch's padded length, and the expected sum, over the epoch's record
batches (each longer than every batch before it), of a size that grows with the length.

The caching allocator reuses a cached segment only for a request no larger than it, and never
merges two segments (c10/cuda/CUDACachingAllocator.cpp: get_free_block's best fit,
free_block's merge within one segment), so the tensors of a batch longer than any before get
new segments while the shorter batches' stay cached: what stays reserved after an epoch is a
sum over its record batches (zeroplan.allocator.varying_lengths). Pure arithmetic, no torch."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from zeroplan.specs.lengths import LongSamples, VaryingLengths

MAX_LENGTH_BINS = 4096
"""Lengths are taken in at most this many equal bins up to seq_len (at seq_len 2048, 1 token; at
32k, 8 tokens, 4.6 MiB of a 152k-vocabulary fp32 logit row each); the allocator's reserve then
counts a record once per segment size, 2 MiB steps (zeroplan.allocator.varying_lengths.segment_size_cdf)."""


# Numerical Recipes (Press et al., 3rd ed.) sec. 6.2: the regularised lower incomplete gamma
# function P(a, x), by its series below a + 1 and its continued fraction above.
def regularized_gamma_p(a: float, x: float) -> float:
    if x <= 0:
        return 0.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return min(1.0, total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    i = 0
    while True:
        i += 1
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15 or i > 10_000:
            break
    return max(0.0, 1.0 - math.exp(log_prefix) * h)


# The sample lengths as a gamma distribution shifted to start at the shortest sample, with the
# published mean and standard deviation (method of moments). Three statistics are all a
# dataset card gives (ms-swift's "3234.4±2547.5, min=91"); the family is an assumption, not
# read from any dataset: it is skewed to the right, as token lengths are, and starts at MIN.
def sample_length_cdf(lengths: VaryingLengths) -> Callable[[float], float]:
    """P(a sample has at most ``tokens`` tokens), before any are dropped or cut."""
    spread = lengths.mean_tokens - lengths.min_tokens
    shape = (spread / lengths.sd_tokens) ** 2
    scale = lengths.sd_tokens ** 2 / spread
    return lambda tokens: regularized_gamma_p(shape, (tokens - lengths.min_tokens) / scale)


# HF Trainer's DataLoader (drop_last False) over a RandomSampler: ceil(kept / batch) batches,
# each rank taking 1/dp of them (DistributedSampler).
def batches_per_rank(lengths: VaryingLengths, seq_len: int, micro_batch: int, data_parallel: int) -> int:
    kept = lengths.samples
    if lengths.long_samples is LongSamples.drop:
        kept = lengths.samples * sample_length_cdf(lengths)(seq_len)
    return max(1, math.ceil(kept / (micro_batch * data_parallel)))


# Kept per (lengths, seq_len, micro_batch), immutable: the plans of one dataset's runs (other
# models, strategies, GPU counts) ask for the same distribution, a gamma function at every bin.
@functools.lru_cache(maxsize=64)
def batch_length_cdf(lengths: VaryingLengths, seq_len: int, micro_batch: int) -> tuple[tuple[int, float], ...]:
    """(length, P(a batch's padded length is at most it)) at each bin edge up to seq_len: a batch
    is padded to the longest of its micro_batch samples (independent draws), so its CDF is the
    sample CDF to the power micro_batch; dropped samples condition the CDF on seq_len, cut ones
    put their mass at seq_len."""
    cdf = sample_length_cdf(lengths)
    below = cdf(seq_len)
    bins = min(seq_len, MAX_LENGTH_BINS)
    edges = sorted({max(1, math.ceil(seq_len * j / bins)) for j in range(1, bins + 1)})
    out = []
    for tokens in edges:
        if tokens >= seq_len:
            one = 1.0
        elif lengths.long_samples is LongSamples.drop:
            one = cdf(tokens) / below if below > 0 else 0.0
        else:
            one = cdf(tokens)
        out.append((tokens, min(1.0, one) ** micro_batch))
    return tuple(out)


def _geometric(f: float, batches: int) -> float:
    """1 + f + ... + f^(batches - 1): the expected number of batches at a length of CDF value f
    that are records, per unit of its probability."""
    if f <= 0.0:
        return 1.0
    if 1.0 - f < 1e-12:
        return float(batches)
    return -math.expm1(batches * math.log(f)) / (1.0 - f)


# Records of an i.i.d. sequence (Arnold, Balakrishnan and Nagaraja, "Records", 1998, ch. 2):
# batch i is a record at length l when it has length l and the i - 1 before it are shorter,
# probability p(l) F(l-)^(i-1); summed over the epoch's batches, p(l) (1 - F(l-)^n) / (1 - F(l-)).
# The epoch's longest batch is the last record; its length has CDF F^n.
def expected_record_sum(cdf: Sequence[tuple[int, float]], batches: int, size_of: Callable[[int], int]) -> tuple[float, float]:
    """(E[sum over the record batches of size_of(length)], E[size_of(the longest batch's length)])."""
    records = longest = 0.0
    before = 0.0
    for tokens, f in cdf:
        mass = f - before
        if mass > 0:
            size = size_of(tokens)
            records += size * mass * _geometric(before, batches)
            longest += size * (f ** batches - before ** batches)
        before = f
    return records, longest
