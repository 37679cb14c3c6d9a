"""Why the planner's traces' loop iterations do not repeat in the allocator's state, and what
repeating them would skip. zeroplan.allocator.fast_replay applies a loop iteration (the ops
between two TraceBuilder.marks) that repeats the one before in one step where the allocator's
cached blocks prove it acts the same; this walks the same traces with the oracle's allocator
(replay.run_ops on a DeviceAllocator, no capacity), period by period, and at each mark
compares, per pool and stream the period allocates in, the cached blocks that a request of the
period could be served from (at least its least rounded request: smaller ones are never
chosen by best fit) at the period's end against its start, over one iteration and over two.

Prints, per trace kind (ops, marks) and in all: the events handed to replays, those in periods
whose ops repeat the one before (at most what applying repeats could skip), and of those
periods how many leave every pool's servable blocks as they found them ('same'), and else how
the first differing pool and stream changed: 'grown' (blocks made, none lost), 'taken' (blocks lost, none made), 'shrunk' (one
block, shrunk from its front), 'moved' (as many made as lost, of the same sizes), 'mixed'; with
whether the period frees a request of that pool and stream ('+frees').

    python benchmarks/allocator_repeat_periods.py [--api] [--requests 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from bisect import bisect_left
from collections import Counter, defaultdict
from pathlib import Path

from zeroplan.allocator.device import DeviceAllocator
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, Ops, run_ops
from zeroplan.allocator.rules import SMALL_SIZE_BYTES, round_size
from zeroplan.allocator.state import SIZE_MASK, SIZE_SHIFT, STREAM_SHIFT

sys.path.insert(0, str(Path(__file__).resolve().parent))


def traces_of_fit(requests) -> list[tuple[Ops, list[int], object]]:
    """The traces fit() replays for ``requests`` (ops, marks, allocator setting), as the planner
    builds them."""
    import zeroplan.allocator.planner as planner
    from zeroplan.core.plan import fit

    out = []
    replay_ops = planner.replay_ops

    def recording(ops, config, capacity_bytes=None, marks=()):
        out.append((ops, list(marks), config))
        return replay_ops(ops, config, capacity_bytes, marks)

    planner.forget_replays()
    planner.replay_ops = recording
    try:
        for request in requests:
            fit(request)
    finally:
        planner.replay_ops = replay_ops
    return out


def period_groups(ops: Ops, start: int, end: int, config) -> dict[tuple[bool, int], list[int]] | None:
    """Per (small pool, stream) the period allocates in: [least rounded request, whether it frees
    one of them]; None where it frees what it did not allocate or does more than allocate and
    free."""
    alive: dict[int, tuple[bool, int]] = {}
    groups: dict[tuple[bool, int], list[int]] = {}
    for kind, ident, size_bytes, stream in ops[start:end]:
        if kind == ALLOC_OP:
            size = round_size(size_bytes, config)
            group = size <= SMALL_SIZE_BYTES, stream
            known = groups.setdefault(group, [size, 0])
            known[0] = min(known[0], size)
            alive[ident] = group
        elif kind == FREE_OP and ident in alive:
            groups[alive.pop(ident)][1] = 1
        else:
            return None
    return groups or None


def servable(keys: list[int], stream: int, least: int) -> list[int]:
    return keys[bisect_left(keys, (stream << STREAM_SHIFT) | (least << SIZE_SHIFT)):bisect_left(keys, (stream + 1) << STREAM_SHIFT)]


def change_kind(old: list[int], new: list[int]) -> str:
    gone, made = set(old) - set(new), set(new) - set(old)
    sizes = lambda keys: sorted((key >> SIZE_SHIFT) & SIZE_MASK for key in keys)  # noqa: E731
    if not gone:
        return "grown"
    if not made:
        return "taken"
    if len(gone) == len(made) == 1:
        (was,), (now,) = gone, made
        grew = (now & SIZE_MASK) - (was & SIZE_MASK)
        if grew > 0 and sizes(gone)[0] - sizes(made)[0] == grew:
            return "shrunk"
    if sizes(gone) == sizes(made):
        return "moved"
    return "mixed"


def repeats_of(ops: Ops, start: int, end: int) -> bool:
    """Whether the period ops[start:end] repeats the one before it (ids shifted)."""
    length = end - start
    if start - length < 0:
        return False
    first = next((i for i in range(start - length, start) if ops[i][0] == ALLOC_OP), None)
    if first is None:
        return False
    shift = ops[first + length][1] - ops[first][1]
    return all(ops[i + length] == (kind, ident + shift, size, stream)
               for i, (kind, ident, size, stream) in enumerate(ops[start - length:start], start - length))


def walk(ops: Ops, marks: list[int], config) -> tuple[Counter, int]:
    """Each repeated period's verdict (module docstring) over one and two iterations, and the
    events of the one-iteration periods that repeat the one before (at most what applying
    repeats could skip)."""
    device = DeviceAllocator(config)
    live: dict = {}
    snapshots: list[tuple[int, list[int], list[int]]] = []
    at = 0
    verdicts: Counter = Counter()
    repeated = 0
    for mark in marks:
        run_ops(device, ops[:mark], at, live)
        at = mark
        snapshots.append((mark, list(device.large_pool.keys), list(device.small_pool.keys)))
    for back, name in ((1, "one iteration"), (2, "two iterations")):
        for index in range(back, len(snapshots)):
            start, large_before, small_before = snapshots[index - back]
            end, large_after, small_after = snapshots[index]
            if not repeats_of(ops, start, end):
                continue
            if back == 1:
                repeated += end - start
            groups = period_groups(ops, start, end, config)
            if groups is None:
                verdicts[f"{name}: not alloc/free of its own"] += 1
                continue
            verdict = "same"
            for (small, stream), (least, frees) in sorted(groups.items()):
                before, after = (small_before, small_after) if small else (large_before, large_after)
                old, new = servable(before, stream, least), servable(after, stream, least)
                if old != new:
                    pool = "small" if small else "large"
                    verdict = f"{pool} pool stream {stream} {change_kind(old, new)}{' +frees' if frees else ''}"
                    break
            verdicts[f"{name}: {verdict}"] += 1
    return verdicts, repeated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", action="store_true", help="api_throughput.py's 60 requests (fit's traces)")
    parser.add_argument("--requests", type=int, default=200, help="else this many of allocator_fast_sweep.py's draws")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.api:
        from api_throughput import requests
        batch = requests()
    else:
        from allocator_fast_sweep import random_requests
        batch = random_requests(args.requests, args.seed)
    kinds: dict[tuple[int, int], Counter] = defaultdict(Counter)
    events: Counter = Counter()
    seen = set()
    for ops, marks, config in traces_of_fit(batch):
        if not marks or config.expandable_segments or config.garbage_collection_threshold:
            continue
        key = (len(ops), len(marks))
        events[key, "replays"] += 1
        events[key, "events"] += len(ops)
        identity = (tuple(ops), config)
        if identity in seen:
            continue  # the same trace again (another capacity): counted once below
        seen.add(identity)
        verdicts, looped = walk(ops, marks, config)
        events[key, "loop"] += looped
        events[key, "traces"] += 1
        kinds[key].update(verdicts)
    total: Counter = Counter()
    for key in sorted(kinds, key=lambda k: -events[k, "events"]):
        print(f"trace of {key[0]} ops, {key[1]} marks: {events[key, 'replays']} replays, {events[key, 'traces']} distinct, "
              f"{events[key, 'loop'] / max(events[key, 'traces'], 1):.0f} of its events in periods that repeat the one before")
        for verdict, count in sorted(kinds[key].items()):
            print(f"    {count:6d}  {verdict}")
        total.update(kinds[key])
    handed = sum(value for (key, what), value in events.items() if what == "events")
    looped = sum(events[key, "loop"] * events[key, "replays"] / max(events[key, "traces"], 1) for key in kinds)
    print(f"in all: {handed:,} events handed to replays, {looped:,.0f} of them in periods that repeat the one before "
          f"({looped / max(handed, 1):.0%})")
    for verdict, count in sorted(total.items()):
        print(f"    {count:6d}  {verdict}")


if __name__ == "__main__":
    main()
