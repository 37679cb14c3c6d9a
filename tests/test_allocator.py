"""The caching-allocator model on small hand-built traces whose outcome PyTorch states:
the rules of c10/cuda/CUDACachingAllocator.cpp's header comment and functions
(zeroplan.allocator.source), and docs/source/notes/cuda.rst ("Optimizing memory usage with
PYTORCH_CUDA_ALLOC_CONF")."""

from __future__ import annotations

import pytest

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import replay
from zeroplan.allocator.rules import round_size
from zeroplan.allocator.trace import (
    AllocationTrace, AllocEvent, EmptyCacheEvent, FreeEvent, RecordStreamEvent, Stream, SyncEvent,
)
from zeroplan.errors import ZeroplanError
from zeroplan.units import KiB, MiB

DEFAULT = parse_alloc_conf("")
EXPANDABLE = parse_alloc_conf("expandable_segments:True")


def trace(*events) -> AllocationTrace:
    return AllocationTrace(events=events)


def alloc(ident: int, size: int, stream: int = Stream.compute) -> AllocEvent:
    return AllocEvent(id=ident, size_bytes=size, stream=stream)


def free(ident: int) -> FreeEvent:
    return FreeEvent(id=ident)


# Header comment: "Small requests are packed into 2MB buffers" (kSmallBuffer).
def test_small_request_reserves_a_2_mib_segment() -> None:
    result = replay(trace(alloc(0, KiB)), DEFAULT)
    assert result.reserved_peak_bytes == 2 * MiB
    assert result.allocated_peak_bytes == KiB  # rounded to 512 bytes: 1 KiB stays


# round_size: "all sizes are rounded to at least 512 bytes" (kMinBlockSize).
def test_sizes_round_to_512_bytes() -> None:
    assert round_size(1, DEFAULT) == 512
    assert round_size(513, DEFAULT) == 1024


# Header comment: "requests between 1MB and 10MB will allocate and split a 20MB block".
def test_mid_request_reserves_20_mib_and_shares_it() -> None:
    result = replay(trace(alloc(0, 5 * MiB), alloc(1, 5 * MiB), alloc(2, 5 * MiB)), DEFAULT)
    assert result.reserved_peak_bytes == 20 * MiB
    assert result.device_alloc_calls == 1


# get_allocation_size: from 10 MiB up, the request rounded to kRoundLarge (2 MiB).
def test_large_request_reserves_its_size_rounded_to_2_mib() -> None:
    assert replay(trace(alloc(0, 12 * MiB)), DEFAULT).reserved_peak_bytes == 12 * MiB
    assert replay(trace(alloc(0, 12 * MiB + 1)), DEFAULT).reserved_peak_bytes == 14 * MiB


# get_free_block + should_split: a cached block serves a smaller request of its stream and is
# split when more than 1 MiB remains; the remainder serves the next one.
def test_cached_block_is_split_and_reused() -> None:
    result = replay(trace(alloc(0, 100 * MiB), free(0), alloc(1, 40 * MiB), alloc(2, 40 * MiB)), DEFAULT)
    assert result.reserved_peak_bytes == 100 * MiB
    assert result.device_alloc_calls == 1


# cuda.rst, max_split_size_mb: "prevents the native allocator from splitting blocks larger
# than this size"; get_free_block: a request below it never takes such a block.
def test_max_split_size_keeps_large_blocks_whole() -> None:
    events = (alloc(0, 100 * MiB), free(0), alloc(1, 30 * MiB))
    assert replay(trace(*events), DEFAULT).reserved_peak_bytes == 100 * MiB
    assert replay(trace(*events), parse_alloc_conf("max_split_size_mb:64")).reserved_peak_bytes == 130 * MiB


# get_free_block: an oversize block serves a request of at least max_split_size only when it
# is less than max_non_split_rounding_mb (kLargeBuffer, 20 MiB) larger.
def test_oversize_block_serves_only_close_requests() -> None:
    config = parse_alloc_conf("max_split_size_mb:64")
    assert replay(trace(alloc(0, 100 * MiB), free(0), alloc(1, 90 * MiB)), config).reserved_peak_bytes == 100 * MiB
    assert replay(trace(alloc(0, 100 * MiB), free(0), alloc(1, 70 * MiB)), config).reserved_peak_bytes == 170 * MiB


# cuda.rst, roundup_power2_divisions: "the size 1200 lies between 1024 and 2048 and if we do
# 4 divisions between them, the values are 1024, 1280, 1536, and 1792 ... 1280 as the nearest
# ceiling of power-2 division" (the same example in roundup_power2_next_division's comment).
def test_roundup_power2_divisions_example() -> None:
    config = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * MiB, config) == 1280 * MiB
    assert replay(trace(alloc(0, 1200 * MiB)), config).reserved_peak_bytes == 1280 * MiB
    per_interval = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert round_size(1200 * MiB, per_interval) == 1280 * MiB  # [1024, 2048): 8 divisions of 128 MiB


# malloc: a failed cudaMalloc frees the cached unsplit blocks (release_cached_blocks) and retries.
def test_oom_succeeds_after_releasing_the_cache() -> None:
    events = trace(alloc(0, 60 * MiB), free(0), alloc(1, 80 * MiB))
    result = replay(events, DEFAULT, capacity_bytes=100 * MiB)
    assert result.completed and result.alloc_retries == 1 and result.device_free_calls == 1
    assert result.reserved_peak_bytes == 80 * MiB


def test_oom_when_live_tensors_leave_no_room() -> None:
    result = replay(trace(alloc(0, 60 * MiB), alloc(1, 50 * MiB)), DEFAULT, capacity_bytes=100 * MiB)
    assert not result.completed
    assert (result.oom_event_index, result.oom_request_bytes) == (1, 50 * MiB)


# Note [Expandable Segments]: one segment per stream grows by 20 MiB pages (large pool).
def test_expandable_segment_grows_by_pages() -> None:
    result = replay(trace(alloc(0, 30 * MiB), alloc(1, 30 * MiB)), EXPANDABLE)
    assert result.reserved_peak_bytes == 60 * MiB  # 40 MiB mapped, then 20 more appended


# Fragmentation (the OOM message's advice: "If reserved but unallocated memory is large try
# setting expandable_segments:True"): a split segment whose free parts are too small keeps its
# memory from a larger request; expandable segments unmap those pages and map them again.
def test_fragmentation_needs_more_capacity_without_expandable_segments() -> None:
    events = trace(alloc(0, 100 * MiB), free(0), alloc(1, 40 * MiB), alloc(2, 40 * MiB), free(1), alloc(3, 60 * MiB))
    default = oom_capacity(events, DEFAULT)
    expandable = oom_capacity(events, EXPANDABLE)
    assert default.unlimited.reserved_peak_bytes == 160 * MiB
    assert default.oom_capacity_bytes == 160 * MiB
    assert expandable.oom_capacity_bytes == 100 * MiB  # the allocated peak


# Header comment: "Once freed, blocks can be re-allocated on the same stream, but not on any other stream".
def test_streams_do_not_share_cached_blocks() -> None:
    events = trace(alloc(0, 12 * MiB, Stream.all_gather), free(0), alloc(1, 12 * MiB, Stream.compute))
    assert replay(events, DEFAULT).reserved_peak_bytes == 24 * MiB


# recordStream / insert_events: a block used on another stream is not reused until that
# stream's work is done (modelled as the next synchronisation).
def test_record_stream_delays_reuse_until_sync() -> None:
    held = (alloc(0, 12 * MiB), RecordStreamEvent(id=0, stream=Stream.all_gather), free(0))
    assert replay(trace(*held, alloc(1, 12 * MiB)), DEFAULT).reserved_peak_bytes == 24 * MiB
    assert replay(trace(*held, SyncEvent(), alloc(1, 12 * MiB)), DEFAULT).reserved_peak_bytes == 12 * MiB


# garbage_collect_cached_blocks: above threshold x allowed memory, old unsplit cached blocks are
# freed before cudaMalloc, so no synchronising retry is needed.
def test_garbage_collection_frees_before_the_retry() -> None:
    events = trace(alloc(0, 60 * MiB), free(0), alloc(1, 70 * MiB))
    plain = replay(events, DEFAULT, capacity_bytes=100 * MiB)
    collected = replay(events, parse_alloc_conf("garbage_collection_threshold:0.5"), capacity_bytes=100 * MiB)
    assert plain.completed and plain.alloc_retries == 1
    assert collected.completed and collected.alloc_retries == 0 and collected.device_free_calls == 1


def test_empty_cache_returns_unsplit_segments() -> None:
    result = replay(trace(alloc(0, 60 * MiB), free(0), EmptyCacheEvent(), alloc(1, 70 * MiB)), DEFAULT)
    assert result.reserved_peak_bytes == 70 * MiB


@pytest.mark.parametrize("text, field", [
    ("foo:1", "allocator_conf"), ("max_split_size_mb:10", "max_split_size_mb"),
    ("expandable_segments:yes", "expandable_segments"), ("garbage_collection_threshold:1", "garbage_collection_threshold"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions"), ("backend:cudaMallocAsync", "backend"),
])
def test_bad_config_is_refused_in_one_line(text: str, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        parse_alloc_conf(text)
    assert error.value.field == field and "allowed" in str(error.value) and "\n" not in str(error.value)


def test_config_parses_what_cuda_rst_shows() -> None:
    config = parse_alloc_conf("max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6")
    assert (config.max_split_size_bytes, config.expandable_segments, config.garbage_collection_threshold) == (128 * MiB, True, 0.6)


def test_free_of_unknown_id_is_refused() -> None:
    with pytest.raises(ZeroplanError, match="not allocated"):
        replay(trace(free(3)), DEFAULT)


# malloc -> release_available_cached_blocks: with max_split_size set, a failed cudaMalloc first
# frees just enough oversize cached blocks, before the synchronising free-everything retry.
def test_oversize_cached_block_is_freed_before_the_full_retry() -> None:
    config = parse_alloc_conf("max_split_size_mb:64")
    result = replay(trace(alloc(0, 100 * MiB), free(0), alloc(1, 80 * MiB)), config, capacity_bytes=150 * MiB)
    assert result.completed and result.alloc_retries == 0 and result.device_free_calls == 1
