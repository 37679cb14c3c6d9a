"""What the caching allocator keeps reserved after an epoch of micro-batches of varying length
(BatchSpec.varying_lengths), beyond the one step at seq_len the planner replays.

c10/cuda/CUDACachingAllocator.cpp (source.ALLOCATOR_SOURCE): get_free_block serves a request
from the smallest cached block of the stream at least as large; free_block merges a freed block
only with its neighbours inside one segment; segments go back to CUDA only in emptyCache and
when a cudaMalloc fails (release_cached_blocks, then the retry). Neither HF's Trainer (4.36:
no empty_cache in the training loop) nor ms-swift's trainer calls empty_cache. So a batch longer
than every batch before it (a record) cannot place its largest sequence-sized tensors in the
segments its shorter predecessors left (each smaller), gets new ones, and those stay cached:
after the epoch the largest such tensors hold one segment each per record length, the
longest one being the step at seq_len that the planner already replays.

On a rank that runs the loss, the loss's tensors are the largest that grow with the length (a
152k vocabulary's fp32 logits: 593 KiB a token, a 7B block's recompute workspace 176 KiB): the
smaller ones fit in the remainders of those segments, and are not counted. Of the loss's
tensors, those of the largest size are counted (the three fp32 ones of the reference loss); a
smaller one (a bf16 copy beside fp32 ones) fits in an older record's larger segment.

A rank without the loss (a device map's GPUs before the head's, a pipeline's earlier stages)
follows the same rules with its own largest tensors. Under full recomputation those are the
backward workspace's at its largest moment (the rebuilt block beside the residual stream's
gradients, schedule.workspace_peak_tensors: in the planner's schedules one allocation of 753 MiB
for Qwen-72B at 2,048 tokens, against 31 MiB for a block's checkpointed input). A record's
workspace fits no segment a shorter batch left and takes a new one; the saved inputs, allocated
in its forward, go into the older workspace segments, free then, and take segments of their own
only where they outgrow them (benchmarks/varying_length_rows.py --device-map-replays: the
expectation against the chained replay of the planner's traces). Without full recomputation the
saved tensors of every block are larger than the workspace and stay through the forward; that
case is not counted.

Once the reserve reaches what the device holds, a failing cudaMalloc frees every unsplit cached
segment (release_cached_blocks) and retries: the step at seq_len still completes, and the
reserved peak stays within the usable memory (so the term is at most what the one step leaves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.fsdp_schedule import loss_allocations
from zeroplan.allocator.rules import allocation_size, round_size
from zeroplan.allocator.schedule import workspace_peak_tensors
from zeroplan.core.length_records import batch_length_cdf, batches_per_rank, expected_record_sum
from zeroplan.core.peak import PeakTerms
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing

SizeAt = Callable[[int], int]
"""A tensor's bytes at a batch's padded length in tokens."""

EQUAL_SIZE_FRACTION = 0.99
"""A tensor counts when it is at least this fraction of the largest (the fp32 logits and their
gradient differ by a token's row where one is shifted)."""


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


def _proportional(tensor_bytes: int, seq_len: int) -> SizeAt:
    """A tensor of ``tensor_bytes`` at seq_len, as its size at another length: the loss's sbV
    tensors are proportional to it."""
    return lambda tokens: max(1, tensor_bytes * tokens // seq_len)


# The planner's workspace holds parts that do not grow with the length (QLoRA's dequantized
# weight, DoRA's weight norms) beside those that do: each tensor is taken as affine in the length,
# through its sizes at seq_len and at half of it, the planner's own at both (``terms_of``).
# Quadratic parts (eager attention's scores) are taken by that line: above them between the two
# lengths, below them under half.
def _affine(at_half: int, at_full: int, half: int, seq_len: int) -> SizeAt:
    return lambda tokens: max(1, at_half + (at_full - at_half) * (tokens - half) // (seq_len - half))


def at_length(request: PlanRequest, tokens: int) -> PlanRequest:
    """The request with its batches padded to ``tokens`` (the rank, the rest unchanged)."""
    return request.model_copy(update={"batch": request.batch.model_copy(update={"seq_len": tokens})})


def workspace_record_sizes(request: PlanRequest, terms: PeakTerms,
                           terms_of: Callable[[PlanRequest], PeakTerms]) -> list[SizeAt]:
    """A rank without the loss, under full recomputation: the largest tensors its backward
    workspace holds at once (schedule.workspace_peak_tensors) that grow with the length, one per
    segment a record batch adds, as their sizes at a length; none otherwise."""
    if request.training.activation_checkpointing is not ActivationCheckpointing.full:
        return []
    seq_len = request.batch.seq_len
    half = seq_len // 2
    full = sorted(workspace_peak_tensors(request, terms), reverse=True)
    if half < 1 or not full:
        # One-token batches: no length below seq_len, no records.
        return []
    shorter = at_length(request, half)
    halves = sorted(workspace_peak_tensors(shorter, terms_of(shorter)), reverse=True)
    grown = [(size, small) for size, small in zip(full, halves) if size > small]
    if not grown:
        return []
    largest = max(size for size, _ in grown)
    return [_affine(small, size, half, seq_len) for size, small in grown if size >= EQUAL_SIZE_FRACTION * largest]


def record_sizes(request: PlanRequest, terms: PeakTerms, terms_of: Callable[[PlanRequest], PeakTerms]) -> list[SizeAt]:
    """The tensors that take a new segment at each record batch, as their sizes at a length: the
    loss's largest where this rank runs the loss, else its workspace's (workspace_record_sizes)."""
    loss = record_tensor_bytes(request, terms)
    if loss:
        return [_proportional(size, request.batch.seq_len) for size in loss]
    return workspace_record_sizes(request, terms, terms_of)


def varying_length_reserve_bytes(request: PlanRequest, terms: PeakTerms, reserved_bytes: int, usable_bytes: int,
                                 terms_of: Callable[[PlanRequest], PeakTerms]) -> int:
    """Expected bytes the epoch's shorter record batches leave reserved beyond the one step at
    seq_len (``reserved_bytes``), at most what the usable memory leaves; 0 without
    BatchSpec.varying_lengths. ``terms_of``: the planner's PeakTerms of a request (this rank at
    another length, for a rank without the loss)."""
    batch = request.batch
    lengths = batch.varying_lengths
    if lengths is None:
        return 0
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    if config.expandable_segments:
        # Pages of one growing segment: a longer batch maps more pages in the same segment
        # (benchmarks/allocator_variable_length.py: no growth under expandable segments).
        return 0
    sizes = record_sizes(request, terms, terms_of)
    if not sizes:
        return 0
    seq_len = batch.seq_len
    cdf = batch_length_cdf(lengths, seq_len, batch.micro_batch_size)
    batches = batches_per_rank(lengths, seq_len, batch.micro_batch_size, request.data_parallel_size)
    extra = 0.0
    for size_at in sizes:
        # The segment a request of this tensor's size at `tokens` gets (get_allocation_size).
        def segment(tokens: int, size_at: SizeAt = size_at) -> int:
            return allocation_size(round_size(size_at(tokens), config))

        records, longest = expected_record_sum(segment_size_cdf(cdf, segment), batches, segment)
        extra += records - longest
    return max(0, min(int(extra), usable_bytes - reserved_bytes))
