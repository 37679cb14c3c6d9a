"""Why llm-foundry's one-row calibrations miss (docs/validation.md, "Step time", issue 30): the
rows they are anchored on (MPT-30B at 8,192 tokens on 8 GPUs, A100 80GB and H100; MPT-13B on 8
A100 40GB) solve HFUs 12-30 % below the same model's other rows. Three candidate mechanisms,
each checked against the rows with the planner's own quantities; nothing is fitted or changed.

    python benchmarks/step_time_anchors.py

1. A per-micro-batch fixed cost (FSDP FULL_SHARD re-gathers every unit for each micro-batch,
   forward and backward; hooks per unit per micro-batch; the optimizer step amortized over the
   accumulation): for two rows of one model on the same GPUs, solve the common HFU h and the cost
   c per micro-batch with published step = planner step at h + grad_accum x c. A cost that exists
   is positive and the same for rows of one model and GPU count.
2. Per-layer exposure of the gathers: each phase's collective seconds over its compute seconds
   (the llm-foundry blocks are uniform, so a phase ratio below 1 leaves every layer's gather
   hidden behind its own layer's compute).
3. Caching-allocator retries (num_alloc_retries: every cached block freed, a device
   synchronize, the request tried again): the allocator model's replay of the row's step on its
   usable memory, at the row's precision and with fp32 parameters and states (Composer's
   precision 'bf16' with FSDP mixed precision PURE may keep fp32 masters: whichever it did, the
   replay says which rows retry). Then how near each MPT-30B row on 8 A100 80GB is to the
   allocator's edge: what its step reserves without a device limit, and the replay's retries
   (and cudaFree calls) on the usable memory moved by a few GiB either way.
"""

from __future__ import annotations

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import replay
from zeroplan.allocator.schedule import step_ops
from zeroplan.calibrate.step import planned_step
from zeroplan.core.communication import Phase
from zeroplan.core.plan import (
    checked_peak_terms, max_micro_batch_size, peak_allocated_bytes, pipeline_rank_requests, replayed,
    under_allocator_model, usable_memory_bytes,
)
from zeroplan.specs import Precision
from zeroplan.validate.step_calibration import mode_implied_hfus, published_step_s, source_label
from zeroplan.validate.step_time import load_published_throughput

GIB = 2**30

MODE = "published"
"""The planner's default attention rate, which the calibrated figures time."""

PAIRS = (
    # Same model, GPUs, micro-batch count and per-micro-batch collectives; twice the tokens.
    ("mpt-30b a100 x8 s4096 b1x21 AC", "mpt-30b a100 x8 s8192 b1x21 AC"),
    ("mpt-30b h100 x8 s4096 b1x21 AC", "mpt-30b h100 x8 s8192 b1x21 AC"),
    # 8 GPUs accumulating against 16 GPUs that do not.
    ("mpt-13b a100-40gb x8 s2048 b4x16 AC", "mpt-13b a100-40gb x16 s2048 b10x1 AC"),
    ("mpt-13b a100-40gb x8 s8192 b1x16 AC", "mpt-13b a100-40gb x16 s2048 b10x1 AC"),
    ("mpt-7b a100-40gb x8 s2048 b12x4 AC", "mpt-7b a100-40gb x16 s2048 b16x1 AC"),
    ("mpt-30b h100 x8 s2048 b3x21 AC", "mpt-30b h100 x16 s2048 b10x3 AC"),
)

REPLAYED = (
    "mpt-30b a100 x8 s512 b12x21 AC", "mpt-30b a100 x8 s2048 b3x21 AC", "mpt-30b a100 x8 s4096 b1x21 AC",
    "mpt-30b a100 x8 s8192 b1x21 AC", "mpt-70b a100 x32 s2048 b2x16 AC",
    "mpt-13b a100-40gb x8 s2048 b4x16 AC", "mpt-13b a100-40gb x8 s8192 b1x16 AC", "mpt-13b a100-40gb x16 s2048 b10x1 AC",
    "mpt-7b a100-40gb x8 s2048 b12x4 AC",
)


def _step_s(row, hfu: float) -> float:  # type: ignore[no-untyped-def]
    return planned_step(row.request(hfu, attention_rate=MODE)).step_with_overlap_s


def per_micro_batch_cost(a, b) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(h, c): the common HFU and per-micro-batch seconds with which the planner reproduces both
    rows' published steps (bisection on h; c follows)."""
    def gap(hfu: float) -> float:
        return ((published_step_s(a) - _step_s(a, hfu)) / a.grad_accum_steps
                - (published_step_s(b) - _step_s(b, hfu)) / b.grad_accum_steps)

    low, high = 0.2, 1.0
    low_sign = gap(low) > 0
    for _ in range(40):
        mid = (low + high) / 2
        if (gap(mid) > 0) == low_sign:
            low = mid
        else:
            high = mid
    hfu = (low + high) / 2
    return hfu, (published_step_s(a) - _step_s(a, hfu)) / a.grad_accum_steps


def phase_ratios(row, hfu: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(forward, backward) collective seconds over that phase's compute seconds."""
    step = planned_step(row.request(hfu, attention_rate=MODE))
    forward = sum(c.seconds for c in step.collective_times if c.phase is Phase.forward)
    backward = sum(c.seconds for c in step.collective_times if c.phase is Phase.backward)
    return forward / step.forward_compute_s, backward / step.backward_compute_s


def allocator_replay(row, precision: Precision) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    """(allocated peak / usable, retries on the usable memory, largest micro-batch) under the
    allocator model with PyTorch's default settings (as zeroplan.allocator.planner replays it)."""
    base = row.request()
    request = under_allocator_model(base.model_copy(update={"training": base.training.model_copy(update={"precision": precision})}))
    rank = pipeline_rank_requests(request)[0]
    states, terms = checked_peak_terms(rank)
    allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
    usable = usable_memory_bytes(rank)
    ops = step_ops(rank, *replayed(states, terms))
    config = parse_alloc_conf("")
    shortfall = max(allocated - replay(ops, config).requested_peak_bytes, 0)
    return allocated / usable, replay(ops, config, usable - shortfall).alloc_retries, max_micro_batch_size(request)


EDGE_OFFSETS_GIB = (4, 2, 0, -2, -4, -6, -8)
"""Capacities around the usable memory the edge table replays at."""


def allocator_edge(row) -> str:  # type: ignore[no-untyped-def]
    """One table row: requested peak, unlimited reserved peak and capacity (GiB), then
    retries/cudaFree calls (OOM: the step runs out) at each of EDGE_OFFSETS_GIB."""
    request = under_allocator_model(row.request())
    rank = pipeline_rank_requests(request)[0]
    states, terms = checked_peak_terms(rank)
    allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
    ops = step_ops(rank, *replayed(states, terms))
    config = parse_alloc_conf("")
    unlimited = replay(ops, config)
    capacity = usable_memory_bytes(rank) - max(allocated - unlimited.requested_peak_bytes, 0)
    cells = []
    for offset in EDGE_OFFSETS_GIB:
        result = replay(ops, config, capacity + offset * GIB)
        cells.append(f"{result.alloc_retries}/{result.device_free_calls}" if result.completed else "OOM")
    return (f"| {row.name} | {unlimited.requested_peak_bytes / GIB:.1f} | {unlimited.reserved_peak_bytes / GIB:.1f} "
            f"| {capacity / GIB:.1f} | " + " | ".join(cells) + " |")


def main() -> int:
    table = load_published_throughput()
    rows = {row.name: row for row in table.rows}
    implied = mode_implied_hfus(MODE, table)
    print(f"1. Per-micro-batch cost c solved with a common HFU h on two rows (--attention-rate {MODE}):\n")
    print("| row a | row b | h | c (s per micro-batch) | grad_accum x c / a's step |\n|---|---|---:|---:|---:|")
    for a, b in PAIRS:
        hfu, cost = per_micro_batch_cost(rows[a], rows[b])
        share = cost * rows[a].grad_accum_steps / published_step_s(rows[a])
        print(f"| {a} | {b} | {hfu:.3f} | {cost:+.3f} | {share:+.1%} |")
    print("\n2. Collective seconds over compute seconds per phase, at each row's own solved HFU "
          "(llm-foundry rows; the largest, then the anchors):\n")
    print("| row | forward | backward |\n|---|---:|---:|")
    foundry = [row for row in table.rows if "llm-foundry" in source_label(row) and row.name in implied]
    ratios = {row.name: phase_ratios(row, implied[row.name]) for row in foundry}
    shown = sorted(ratios, key=lambda name: -max(ratios[name]))[:3]
    shown += [name for name in ("mpt-30b a100 x8 s8192 b1x21 AC", "mpt-30b h100 x8 s8192 b1x21 AC",
                                "mpt-13b a100-40gb x8 s2048 b4x16 AC") if name not in shown]
    for name in shown:
        print(f"| {name} | {ratios[name][0]:.3f} | {ratios[name][1]:.3f} |")
    print("\n3. The allocator model's replay of one step on the usable memory (retries: num_alloc_retries):\n")
    print("| row | solved HFU | precision | allocated / usable | retries | largest micro-batch |\n|---|---:|---|---:|---:|---:|")
    for name in REPLAYED:
        row = rows[name]
        for precision in dict.fromkeys((row.precision, Precision.bf16_mixed)):
            fraction, retries, largest = allocator_replay(row, precision)
            print(f"| {name} | {implied[name]:.3f} | {precision.value} | {fraction:.2f} | {retries} | {largest} |")
    print("\nHow near the allocator's edge each MPT-30B row on 8 A100 80GB runs (GiB; retries/cudaFree calls on the "
          "usable memory moved by the offset):\n")
    print("| row | requested peak | reserved, no limit | usable to the trace | "
          + " | ".join(f"{offset:+d}" for offset in EDGE_OFFSETS_GIB) + " |\n|---|---:|---:|---:|" + "---:|" * len(EDGE_OFFSETS_GIB))
    for name in REPLAYED[:4]:
        print(allocator_edge(rows[name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
