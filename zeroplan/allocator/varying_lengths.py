"""What the caching allocator keeps reserved after an epoch of micro-batches of varying length
(BatchSpec.varying_lengths), beyond the one step at seq_len the planner replays.

c10/cuda/CUDACachingAllocator.cpp (source.ALLOCATOR_SOURCE): get_free_block serves a request
from the smallest cached block of the stream at least as large; free_block merges a freed block
only with its neighbours inside one segment; segments go back to CUDA only in emptyCache and
when a cudaMalloc fails (release_cached_blocks, then the retry). Neither HF's Trainer (4.36:
no empty_cache in the training loop) nor ms-swift's trainer calls empty_cache. So a batch longer
than every batch before it (a record) cannot place its largest sequence-sized tensors in the
segments its shorter predecessors left (each smaller), gets new ones, and those stay cached:
after the epoch the loss's largest tensors hold one segment each per record length, the
longest one being the step at seq_len that the planner already replays.

The loss's tensors are the largest that grow with the length (a 152k vocabulary's fp32 logits:
593 KiB a token, a 7B block's recompute workspace 176 KiB): the smaller ones fit in the
remainders of those segments, and are not counted. Of the loss's tensors, those of the largest
size are counted (the three fp32 ones of the reference loss); a smaller one (a bf16 copy beside
fp32 ones) fits in an older record's larger segment.

Once the reserve reaches what the device holds, a failing cudaMalloc frees every unsplit cached
segment (release_cached_blocks) and retries: the step at seq_len still completes, and the
reserved peak stays within the usable memory (so the term is at most what the one step leaves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.fsdp_schedule import loss_allocations
from zeroplan.allocator.rules import allocation_size, round_size
from zeroplan.core.length_records import batch_length_cdf, batches_per_rank, expected_record_sum
from zeroplan.core.peak import PeakTerms
from zeroplan.specs.request import PlanRequest

EQUAL_SIZE_FRACTION = 0.99
"""A loss tensor counts when it is at least this fraction of the largest (the fp32 logits and
their gradient differ by a token's row where one is shifted)."""


def record_tensor_bytes(request: PlanRequest, terms: PeakTerms) -> list[int]:
    """The loss's largest tensors at seq_len, one per segment a record batch adds: of the moment
    with the most bytes (loss_allocations), those of its largest size."""
    moments = loss_allocations(request, terms)
    if not moments:
        return []
    moment = max(moments, key=sum)
    largest = max(moment, default=0)
    return [size for size in moment if size >= EQUAL_SIZE_FRACTION * largest and size > 0]


# c10/cuda/CUDACachingAllocator.cpp get_free_block: a request is served by any cached block at
# least as large, so a batch longer than every earlier one still fits the segment its longest
# predecessor left when its request rounds (round_size) to no more than that segment
# (get_allocation_size: 2 MiB steps above 10 MiB, 3.4 tokens of a 151,936-entry fp32 logit row).
# What takes a new segment is a batch whose segment size exceeds every earlier one's: the length
# CDF taken at the last length of each segment size.
def segment_size_cdf(cdf: Sequence[tuple[int, float]], segment: Callable[[int], int]) -> list[tuple[int, float]]:
    """``cdf`` (length, P(batch length <= it)) at the last length of each distinct segment size."""
    out: list[tuple[int, float]] = []
    last = None
    for tokens, f in cdf:
        size = segment(tokens)
        if size == last:
            out[-1] = (tokens, f)
        else:
            out.append((tokens, f))
        last = size
    return out


def varying_length_reserve_bytes(request: PlanRequest, terms: PeakTerms, reserved_bytes: int, usable_bytes: int) -> int:
    """Expected bytes the epoch's shorter record batches leave reserved beyond the one step at
    seq_len (``reserved_bytes``), at most what the usable memory leaves; 0 without
    BatchSpec.varying_lengths."""
    batch = request.batch
    lengths = batch.varying_lengths
    if lengths is None:
        return 0
    tensors = record_tensor_bytes(request, terms)
    if not tensors:
        return 0
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    if config.expandable_segments:
        # Pages of one growing segment: a longer batch maps more pages in the same segment
        # (benchmarks/allocator_variable_length.py: no growth under expandable segments).
        return 0
    seq_len = batch.seq_len
    cdf = batch_length_cdf(lengths, seq_len, batch.micro_batch_size)
    batches = batches_per_rank(lengths, seq_len, batch.micro_batch_size, request.data_parallel_size)
    extra = 0.0
    for tensor in tensors:
        # The segment a request of this tensor's size at `tokens` gets (get_allocation_size).
        def segment(tokens: int, tensor: int = tensor) -> int:
            return allocation_size(round_size(max(1, tensor * tokens // seq_len), config))

        records, longest = expected_record_sum(segment_size_cdf(cdf, segment), batches, segment)
        extra += records - longest
    return max(0, min(int(extra), usable_bytes - reserved_bytes))
