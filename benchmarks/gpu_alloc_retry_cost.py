"""What one caching-allocator retry costs on a GPU: the physical basis a time per retry needs
(docs/validation.md, "Step time": llm-foundry's slow anchors sit at the allocator's edge,
benchmarks/step_time_anchors.py). Not yet run: no GPU was lent when it was written.

PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc):
when cudaMalloc fails it calls release_cached_blocks (synchronize_and_free_events, then cudaFree
of every unsplit cached segment; cudaFree synchronizes the device), counts num_alloc_retries and
calls cudaMalloc again; the segments it freed must be cudaMalloc'ed again by the requests that
had reused them. So a retry costs a device synchronize (the queue drains: the GPU then idles
while the host refills it), N cudaFree and, afterwards, N cudaMalloc calls. This script times
each part on the device, for segments of several sizes and counts:

    python3 benchmarks/gpu_alloc_retry_cost.py --out "$OUT"   # on a GPU machine, under a minute

Writes <out>/alloc_retry_cost.json: per (segment MiB, count) the median seconds of one
cudaMalloc and one cudaFree of that size (from an empty cache), of a forced retry (the request
that makes the allocator free N cached segments, GPU idle, and with a queue of matmuls in
flight), and the num_alloc_retries each forced retry added (must be 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MIB = 2**20
SEGMENT_MIB = (20, 256, 1024)
COUNTS = (4, 16)
REPEATS = 5


def _timed(torch, action):  # type: ignore[no-untyped-def]
    """(seconds, result) of ``action`` between two device synchronizes."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = action()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def malloc_free_s(torch, size_bytes: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of one cudaMalloc and one cudaFree of ``size_bytes`` (the cache emptied
    first, so the allocator has to call the driver)."""
    mallocs, frees = [], []
    for _ in range(REPEATS):
        torch.cuda.empty_cache()
        seconds, block = _timed(torch, lambda: torch.empty(size_bytes, dtype=torch.uint8, device="cuda"))
        mallocs.append(seconds)
        del block
        seconds, _ = _timed(torch, torch.cuda.empty_cache)
        frees.append(seconds)
    return statistics.median(mallocs), statistics.median(frees)


def forced_retry_s(torch, size_bytes: int, count: int, queued: bool) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Seconds of the request that makes the allocator free ``count`` cached segments of
    ``size_bytes`` and retry, and the num_alloc_retries it added. ``queued``: a queue of matmuls
    in flight when it is made (the synchronize inside the retry waits for them)."""
    torch.cuda.empty_cache()
    cached = [torch.empty(size_bytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
    del cached  # the segments stay reserved, unused: the cache
    request = size_bytes + 64 * MIB  # larger than any cached segment: none can serve it
    free_bytes, _ = torch.cuda.mem_get_info()
    filler_bytes = free_bytes - request // 2  # leaves too little for the request without the cache
    filler = torch.empty(filler_bytes, dtype=torch.uint8, device="cuda")
    work = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) if queued else None
    before = torch.cuda.memory_stats()["num_alloc_retries"]
    torch.cuda.synchronize()
    if work is not None:
        for _ in range(50):
            torch.mm(work, work)  # queued on the stream, not waited for
    start = time.perf_counter()
    block = torch.empty(request, dtype=torch.uint8, device="cuda")
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats()["num_alloc_retries"] - before
    del block, filler, work
    torch.cuda.empty_cache()
    return seconds, retries


def measure() -> dict:
    import torch

    records = []
    for segment_mib in SEGMENT_MIB:
        size = segment_mib * MIB
        malloc_s, free_s = malloc_free_s(torch, size)
        for count in COUNTS:
            idle = [forced_retry_s(torch, size, count, queued=False) for _ in range(REPEATS)]
            queued = [forced_retry_s(torch, size, count, queued=True) for _ in range(REPEATS)]
            records.append({
                "segment_mib": segment_mib, "segments_freed": count, "cuda_malloc_s": malloc_s, "cuda_free_s": free_s,
                "retry_idle_s": statistics.median(s for s, _ in idle),
                "retry_queued_s": statistics.median(s for s, _ in queued),
                "retries_added": sorted({r for _, r in idle + queued}),
            })
            print(json.dumps(records[-1]), flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for alloc_retry_cost.json")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_alloc_retry_cost.py: no CUDA device (allowed: a machine with a GPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alloc_retry_cost.json").write_text(json.dumps(measure(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
