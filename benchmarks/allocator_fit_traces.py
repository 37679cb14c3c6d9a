"""What the caching-allocator model's share of a default `fit()` is made of, on the traces it
builds and replays over benchmarks/api_throughput.py's 60 requests (recorded from one pass after
api_throughput's warm-up, by wrapping zeroplan.allocator.planner's own record_step and
replay_ops): how many traces, how many events each replay is handed and runs (fast_replay
applies repeated loop iterations at once and stops at the last allocation), by trace kind (ops,
marks); how many traces are alike (identical ops, identical with every size rounded up to 512
bytes, identical from the first mark to the backward's end with ids renumbered from there, ops
shared from the start with an earlier trace), which bounds what a cache across traces could
skip; and the CPU seconds of one pass of the builds and of the replays (least of --repeats).

With --instructions, the instructions (valgrind's callgrind, PYTHONHASHSEED=0) of one pass of
the builds, of the replays, and of a bare Python walk over the same ops (each op unpacked, an
allocation put in a dict, a free taken out: about the least any per-event replay in Python
does), each a child's count less that of a child that only loads the recorded traces.

    python benchmarks/allocator_fit_traces.py [--repeats 5] [--instructions]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

from zeroplan.allocator.replay import ALLOC_OP, FREE_OP


def record(path: str) -> None:
    """One pass of fit() over api_throughput's requests after its warm-up, each trace built
    (its StepInputs) and each replay (ops, setting, capacity, marks) written to ``path``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from api_throughput import requests

    from zeroplan.allocator import planner
    from zeroplan.core.plan import fit

    batch = requests()
    for request in batch[:3]:
        fit(request)
    built, replayed = [], []
    record_step, replay_ops = planner.record_step, planner.replay_ops

    def recording_build(inputs):
        built.append(inputs)
        return record_step(inputs)

    def recording_replay(ops, config, capacity, marks):
        replayed.append((ops, config, capacity, marks))
        return replay_ops(ops, config, capacity, marks)

    planner.record_step, planner.replay_ops = recording_build, recording_replay
    try:
        for request in batch:
            fit(request)
    finally:
        planner.record_step, planner.replay_ops = record_step, replay_ops
    with open(path, "wb") as out:
        pickle.dump((built, replayed), out)


def walk(ops) -> None:
    """The bare walk: each op unpacked, an allocation put in a dict, a free taken out."""
    live = {}
    for kind, ident, size, _ in ops:
        if kind == ALLOC_OP:
            live[ident] = size
        else:
            live.pop(ident, None)


def one_pass(path: str, what: str) -> None:
    """Load the recorded traces and run one pass of ``what`` (none, build, replay, walk)."""
    from zeroplan.allocator.fast_replay import replay_ops
    from zeroplan.allocator.schedule import record_step

    with open(path, "rb") as source:
        built, replayed = pickle.load(source)
    gc.disable()
    if what == "build":
        for inputs in built:
            record_step(inputs)
    elif what == "replay":
        for ops, config, capacity, marks in replayed:
            replay_ops(ops, config, capacity, marks)
    elif what == "walk":
        for ops, _, _, _ in replayed:
            walk(ops)


def instructions(path: str, what: str) -> int:
    """callgrind's count of a child running one_pass(path, what) (the fewer of two runs)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", path, what]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    counts = []
    for _ in range(2):
        result = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command], check=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        counts.append(int(re.search(r"Collected : (\d+)", result.stderr).group(1)))
    return min(counts)


def events_run(replayed) -> list[int]:
    """The events fast_replay's loop runs in each replay (fast_replay._run's spans)."""
    from zeroplan.allocator import fast_replay

    spans = []
    run = fast_replay._run

    def counting(device, ops, start, end, *rest):
        spans[-1] += end - start
        return run(device, ops, start, end, *rest)

    fast_replay._run = counting
    try:
        for ops, config, capacity, marks in replayed:
            spans.append(0)
            fast_replay.replay_ops(ops, config, capacity, marks)
    finally:
        fast_replay._run = run
    return spans


def body(ops, marks) -> tuple | None:
    """The ops from the first mark to the first free of an id allocated before it (the
    backward's end), ids renumbered from the first allocated there; None without marks."""
    if not marks:
        return None
    start = marks[0]
    base = min((ident for kind, ident, _, _ in ops[start:] if kind == ALLOC_OP), default=0)
    end = next((i for i in range(start, len(ops)) if ops[i][0] == FREE_OP and ops[i][1] < base), len(ops))
    return tuple((kind, ident - base if ident >= base else ident, size, stream) for kind, ident, size, stream in ops[start:end])


def shared_prefix(ops, earlier) -> int:
    """The most ops from the start that ``ops`` shares with any earlier trace."""
    best = 0
    for other in earlier:
        n = min(len(other), len(ops))
        at = 0
        while at < n and other[at] == ops[at]:
            at += 1
        best = max(best, at)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="passes timed (the least kept)")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead of timing")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_pass(*args.child)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "traces.pickle")
        record(path)
        with open(path, "rb") as source:
            built, replayed = pickle.load(source)
        handed = sum(len(ops) for ops, _, _, _ in replayed)
        spans = events_run(replayed)
        print(f"{len(built)} traces built, {len(replayed)} replays: {handed:,} events handed, {sum(spans):,} run")
        kinds: Counter = Counter()
        ran: Counter = Counter()
        for (ops, _, _, marks), span in zip(replayed, spans):
            kinds[len(ops), len(marks)] += 1
            ran[len(ops), len(marks)] += span
        for (ops_count, marks_count), count in sorted(kinds.items(), key=lambda item: -ran[item[0]]):
            print(f"  {count:4d} replays of {ops_count:,} ops, {marks_count} marks: {ran[ops_count, marks_count]:,} events run "
                  f"({100 * ran[ops_count, marks_count] / sum(spans):.1f} %)")
        traces = [ops for ops, _, _, _ in replayed]
        rounded = {tuple((k, i, -(-s // 512), st) for k, i, s, st in ops) for ops in traces}
        bodies = [body(ops, marks) for ops, _, _, marks in replayed]
        seen: set = set()
        repeated_bodies = 0
        for found in bodies:
            if found is not None and found in seen:
                repeated_bodies += 1
            seen.add(found)
        prefixes = sum(shared_prefix(ops, traces[:at]) for at, ops in enumerate(traces))
        print(f"  distinct: {len(set(map(tuple, traces)))} of {len(traces)}; with sizes rounded to 512 bytes {len(rounded)}; "
              f"bodies (first mark to the backward's end, ids renumbered) seen before: {repeated_bodies}; "
              f"ops shared from the start with an earlier trace: {prefixes:,} of {handed:,}")
        if args.instructions:
            counts = {what: instructions(path, what) for what in ("none", "build", "replay", "walk")}
            events = {"replay": sum(spans)}
            for what in ("build", "replay", "walk"):
                spent = counts[what] - counts["none"]
                run = f"{spent / events[what]:,.0f} an event run, " if what == "replay" else ""
                print(f"  {what:6s} one pass: {spent / 1e6:,.0f} million instructions ({run}{spent / handed:,.0f} an event handed)")
            return
        from zeroplan.allocator.fast_replay import replay_ops
        from zeroplan.allocator.schedule import record_step

        gc.disable()
        for name, work in (("builds", lambda: [record_step(inputs) for inputs in built]),
                           ("replays", lambda: [replay_ops(*replay) for replay in replayed])):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.process_time()
                work()
                best = min(best, time.process_time() - start)
            print(f"  {name:8s} one pass {1e3 * best:7.1f} ms of CPU (least of {args.repeats})")
        gc.enable()


if __name__ == "__main__":
    main()
