"""zeroplan.allocator.fast_replay gives replay.replay's result (the oracle), with its fused loop
and with the schedule's repeated loop iterations applied in one step where the state proves
them repeats; benchmarks/allocator_fast_sweep.py compares the planner's verdicts at scale."""

from __future__ import annotations

import pytest

import zeroplan.allocator.fast_replay as fast_replay
from zeroplan.allocator.builder import TraceBuilder
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.fast_replay import replay_ops
from zeroplan.allocator.replay import replay
from zeroplan.allocator.trace import Stream
from zeroplan.units import MiB

CONFS = ("", "max_split_size_mb:128", "roundup_power2_divisions:4")


def _loop(saved_bytes: int, blocks: int = 12, crumbs: bool = False, saved_parts: tuple[int, ...] = ()) -> TraceBuilder:
    """A forward and backward like the planner's schedules: per block a gathered unit, a saved
    tensor (whole 2 MiB pages, or leaving a cached remainder in its segment with ``crumbs``), the
    unit freed; then the blocks in reverse, each saved tensor freed beside a workspace (allocated
    and freed at once). ``saved_parts``: the saved tensors instead."""
    b = TraceBuilder()
    b.alloc_parts([300 * MiB] * 4)
    saved = []
    for _ in range(blocks):
        b.mark()
        unit = b.alloc(64 * MiB, Stream.all_gather)
        saved.append(b.alloc_parts(list(saved_parts) or [saved_bytes + (MiB // 2 if crumbs else 0), 12 * MiB]))
        b.free(unit)
    # An allocation freed at once, across a mark (the two replayed apart).
    probe = b.alloc(8 * MiB)
    b.mark()
    b.free(probe)
    for block in reversed(range(blocks)):
        unit = b.alloc(64 * MiB, Stream.all_gather)
        b.free(b.alloc(40 * MiB))
        b.free(saved[block] + unit)
    return b


def _capacities(b: TraceBuilder, conf: str) -> list[int | None]:
    unlimited = replay(b.ops, parse_alloc_conf(conf))
    low, high = unlimited.allocated_peak_bytes, unlimited.reserved_peak_bytes
    return [None, high, high - 2 * MiB, (low + high) // 2, low, low - 2 * MiB]


@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("crumbs", [False, True])
def test_the_result_is_the_oracles_on_every_capacity(conf: str, crumbs: bool) -> None:
    b = _loop(40 * MiB, crumbs=crumbs)
    config = parse_alloc_conf(conf)
    for capacity in _capacities(b, conf):
        assert replay_ops(b.ops, config, capacity, b.marks) == replay(b.ops, config, capacity)
        assert replay_ops(b.ops, config, capacity) == replay(b.ops, config, capacity)


def test_repeated_iterations_are_applied_in_one_step_where_the_state_repeats(monkeypatch) -> None:
    # Whole pages per saved tensor: from the second iteration on the cached blocks are the same
    # at every mark, so the rest of the forward is applied at once. With a remainder cached in
    # every saved tensor's segment they never are, and every op is replayed.
    replayed: list[int] = []
    run = fast_replay._run
    monkeypatch.setattr(fast_replay, "_run", lambda device, ops, start, end, *rest:
                        replayed.append(end - start) or run(device, ops, start, end, *rest))
    config = parse_alloc_conf("")
    for crumbs, fewer in ((False, True), (True, False)):
        replayed.clear()
        b = _loop(40 * MiB, blocks=24, crumbs=crumbs)
        assert replay_ops(b.ops, config, None, b.marks) == replay(b.ops, config)
        assert (sum(replayed) < fast_replay._last_allocation_end(b.ops)) is fewer


# Loops whose cached blocks come back every iteration (whole pages), never (a remainder cached
# in every saved tensor's segment), every other iteration (a 7 MiB tensor, two to a 20 MiB
# segment) and every sixth (3 MiB): wherever the replay applies iterations at once or replays
# them, on capacities from well below the allocated peak to past the reserved peak.
@pytest.mark.parametrize(("saved_parts", "crumbs"), [((), False), ((), True), ((7 * MiB,), False), ((3 * MiB,), False)])
@pytest.mark.parametrize("conf", CONFS)
def test_looped_traces_give_the_oracles_result_on_every_capacity(saved_parts, crumbs, conf) -> None:
    b = _loop(40 * MiB, blocks=24, crumbs=crumbs, saved_parts=saved_parts)
    config = parse_alloc_conf(conf)
    unlimited = replay(b.ops, config)
    low, high = unlimited.allocated_peak_bytes - 600 * MiB, unlimited.reserved_peak_bytes + 2 * MiB
    for capacity in (None, *range(low, high, (high - low) // 37)):
        assert replay_ops(b.ops, config, capacity, b.marks) == replay(b.ops, config, capacity)


def test_a_repeat_that_would_pass_the_capacity_is_replayed() -> None:
    # On a capacity the forward's segments reach part-way, the iterations up to it are applied
    # at once and the one that would be refused is replayed (retrying, then running out).
    b = _loop(40 * MiB, blocks=24)
    config = parse_alloc_conf("")
    unlimited = replay(b.ops, config)
    for capacity in range(unlimited.allocated_peak_bytes - 600 * MiB, unlimited.reserved_peak_bytes + 1, 50 * MiB):
        assert replay_ops(b.ops, config, capacity, b.marks) == replay(b.ops, config, capacity)


def test_the_frees_after_the_last_allocation_are_not_replayed(monkeypatch) -> None:
    # The backward's last frees (the first block's workspace, saved tensors and unit): nothing a replay
    # reports moves with them, so it stops at the allocation before them, with the oracle's result.
    replayed: list[int] = []
    run = fast_replay._run
    monkeypatch.setattr(fast_replay, "_run", lambda device, ops, start, end, *rest:
                        replayed.append(end) or run(device, ops, start, end, *rest))
    b = _loop(40 * MiB, crumbs=True)
    config = parse_alloc_conf("")
    trailing = len(b.ops) - fast_replay._last_allocation_end(b.ops)
    assert trailing == 4
    for capacity in _capacities(b, ""):
        replayed.clear()
        assert replay_ops(b.ops, config, capacity, b.marks) == replay(b.ops, config, capacity)
        assert max(replayed) <= len(b.ops) - trailing


def test_settings_outside_the_fused_loop_replay_as_the_oracle() -> None:
    b = _loop(40 * MiB, crumbs=True)
    for conf in ("expandable_segments:True", "garbage_collection_threshold:0.6",
                 "expandable_segments:True,garbage_collection_threshold:0.6"):
        config = parse_alloc_conf(conf)
        for capacity in _capacities(b, conf):
            assert replay_ops(b.ops, config, capacity, b.marks) == replay(b.ops, config, capacity)


EXPANDABLE_CONFS = ("expandable_segments:True", "expandable_segments:True,max_split_size_mb:128",
                    "expandable_segments:True,roundup_power2_divisions:4")


# Expandable segments replay in their own loop (fast_replay._replay_expandable: DeviceAllocator's
# blocks, malloc's and free's steps inline, find_expandable_block and map_block inline): the
# oracle's result wherever pages are mapped, a refusal releases the cache (unmapping pages) and
# retries, or the step runs out.
@pytest.mark.parametrize(("saved_parts", "crumbs"), [((), False), ((), True), ((7 * MiB,), False), ((3 * MiB,), False)])
@pytest.mark.parametrize("conf", EXPANDABLE_CONFS)
def test_expandable_segments_give_the_oracles_result_on_every_capacity(saved_parts, crumbs, conf, monkeypatch) -> None:
    b = _loop(40 * MiB, blocks=24, crumbs=crumbs, saved_parts=saved_parts)
    config = parse_alloc_conf(conf)
    unlimited = replay(b.ops, config)
    low, high = unlimited.allocated_peak_bytes - 600 * MiB, unlimited.reserved_peak_bytes + 2 * MiB
    capacities = (None, *range(low, high, (high - low) // 37))
    expected = [replay(b.ops, config, capacity) for capacity in capacities]
    # The loop's own, not the oracle's.
    monkeypatch.setattr(fast_replay, "replay", lambda *args: pytest.fail("replayed by the oracle"))
    assert [replay_ops(b.ops, config, capacity, b.marks) for capacity in capacities] == expected
    assert any(not result.completed for result in expected) and any(result.alloc_retries for result in expected)


# Random steps on four streams with recorded streams (a block freed while another stream uses it
# waits for a synchronisation), synchronisations and emptied caches among the allocations and
# frees, on capacities from below the allocated peak to past the reserved peak.
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("conf", EXPANDABLE_CONFS)
def test_expandable_segments_with_streams_and_synchronisations(seed: int, conf: str) -> None:
    import random

    from zeroplan.allocator.replay import ALLOC_OP, EMPTY_OP, FREE_OP, RECORD_OP, SYNC_OP

    rng = random.Random(seed)
    ops, alive, ident = [], [], 0
    for _ in range(600):
        roll = rng.random()
        if roll < 0.5 or not alive:
            ident += 1
            size = rng.choice((rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(1, 64 * MiB)))
            ops.append((ALLOC_OP, ident, size, rng.choice((0, 0, 1, 2))))
            alive.append(ident)
        elif roll < 0.9:
            ops.append((FREE_OP, alive.pop(rng.randrange(len(alive))), 0, 0))
        elif roll < 0.95:
            ops.append((RECORD_OP, rng.choice(alive), 0, rng.randrange(4)))
        elif roll < 0.99:
            ops.append((SYNC_OP, 0, 0, 0))
        else:
            ops.append((EMPTY_OP, 0, 0, 0))
    config = parse_alloc_conf(conf)
    unlimited = replay(ops, config)
    low, high = unlimited.allocated_peak_bytes // 2, unlimited.reserved_peak_bytes + 4 * MiB
    for capacity in (None, *range(low, high, max((high - low) // 23, 1))):
        assert replay_ops(ops, config, capacity) == replay(ops, config, capacity)
