"""What DeepSpeed 0.14.2's deferred frees of gathered parameters could add on a GPU: a sensitivity,
not a model (the lag is a timing of the CUDA run that no CPU run gives).

On CUDA, free_param (0.14.2 runtime/zero/partition_parameters.py:280-289) calls
param.data.record_stream(current stream) before dropping a released parameter's gathered buffer,
which the coordinator allocated on its allgather stream (partitioned_param_coordinator.py:460): the
caching allocator lowers allocated_bytes at the free but keeps the block active (active_bytes is
lowered in free_block) and out of reuse until the compute stream's recorded event completes
(c10/cuda/CUDACachingAllocator.cpp free -> insert_events; process_events -> free_block), or until a
failed cudaMalloc's retry synchronises every event (release_cached_blocks ->
synchronize_and_free_events). How long that is depends on how far the CPU runs ahead of the compute
stream: in the forward nothing in DeepSpeed bounds it (the coordinator's CPU wait, :302-314, is on
events of the allgather stream, which never waits on the compute stream); in the backward the
reduce stream's events bound it to three bucket flushes (stage3.py:1260-1263). On the CPU
accelerator (is_synchronized_device) none of this happens, so the engine's sequence saved by
deepspeed_zero3_fp16_streams.py frees each buffer at once. Here each allgather-stream block's free
is instead put K allgather-stream allocations later (K: the CPU's lead, in gathers; a step of the
rows' 32 blocks makes 460), and the step replayed: the requested peak is then what active_bytes
would show (the gpjt rows' "allocated" figure is active_bytes.all.peak), the reserved peak what the
blocks kept from reuse add. The retry's synchronisation is not modelled (a capacity replay that
flushes keeps the deferred blocks: pessimistic there).

Seen on the saved 32-block events (steps 1-1, the reduce stream's CPU-only allocations left out):
micro-batch 12, K 0 / 30 / 60: active peak 60.59 / 63.39 / 65.03 GiB (published 63.35), reserved on
78.93 GiB 70.67 / 72.52 / 74.47 (published 76.24); micro-batch 13: 64.08 / 66.87 / 68.51 active,
74.89 / 76.75 / 78.70 reserved, completing (the row ran out). Usage:

    python benchmarks/deepspeed_zero3_record_stream_lag.py --events F [--lags 0,30,60] [--capacity-gib 78.93]

(F: deepspeed_zero3_fp16_streams.py --checkpointing --layers 32 --save-events F.)
"""
import argparse
import json
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import deepspeed_zero3_fp16_streams as streams  # noqa: E402

ALLGATHER = 1  # deepspeed_zero3_fp16_streams' stream numbers: 0 compute, 1 allgather, 2 reduce


def deferred(trace, lag: int):
    """``trace`` with each allgather-stream block's free moved ``lag`` allgather-stream
    allocations later (the rest at the end)."""
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    stream = {e.id: e.stream for e in trace.events if isinstance(e, AllocEvent)}
    out, pending, gathers = [], deque(), 0
    for event in trace.events:
        if lag and isinstance(event, FreeEvent) and stream.get(event.id) == ALLGATHER:
            pending.append((gathers + lag, event))
            continue
        if isinstance(event, AllocEvent) and event.stream == ALLGATHER:
            gathers += 1
            while pending and pending[0][0] <= gathers:
                out.append(pending.popleft()[1])
        out.append(event)
    out += [event for _, event in pending]
    return AllocationTrace(events=tuple(out), source=f"{trace.source}, allgather frees {lag} gathers late")


def main() -> None:
    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.allocator.replay import replay
    from zeroplan.allocator.trace import AllocEvent

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--lags", default="0,30,60", help="comma-separated K values")
    parser.add_argument("--capacity-gib", type=float, default=78.93)
    options = parser.parse_args()
    gib = 2**30
    trace, _ = streams.engine_steps(streams.without_cpu_only(json.loads(options.events.read_text())), 1, 1)
    config = parse_alloc_conf("")
    gathers = sum(1 for e in trace.events if isinstance(e, AllocEvent) and e.stream == ALLGATHER)
    print(f"allgather-stream allocations in step 1: {gathers}")
    for lag in (int(k) for k in options.lags.split(",")):
        late = deferred(trace, lag)
        free = replay(late, config)
        capped = replay(late, config, int(options.capacity_gib * gib))
        print(f"K {lag:4d}: active peak {free.requested_peak_bytes / gib:6.2f} GiB, reserved {free.reserved_peak_bytes / gib:6.2f}"
              f" without a limit; on {options.capacity_gib:.2f}: completed {capped.completed}, reserved"
              f" {capped.reserved_peak_bytes / gib:6.2f}, cache flushes {capped.device_refusals}")


if __name__ == "__main__":
    main()
