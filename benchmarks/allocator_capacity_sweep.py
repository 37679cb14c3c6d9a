"""The allocator model's default answer beside the oracle on random requests: the default replays
the step once on the usable memory (its verdict, and what it reserves there) and, where it runs
out, once more without a limit (what it would reserve); the oracle (MemoryAssumptions.
exact_capacity) also bisects the OOM capacity, the least memory the step completes on. Both run
on the same step trace and usable memory; the sweep prints how often the verdicts agree (they
must: both are the replay on the usable memory), how often the default peak keeps its own rule
(at most the usable memory exactly when the step fits), how far the default peak lies from the
bisected capacity, and the time each took.

Requests are drawn at random over presets cut to 2-12 blocks (a replay's cost grows with the
blocks; the allocator's behaviour per block does not change with their number), strategies,
micro-batches, sequences, checkpointing, accumulation, LoRA/QLoRA fine-tunes, tensor and
pipeline parallelism, both allocator settings, and GPUs whose usable memory lands anywhere
from below the allocated peak to above the reserved one.

    python benchmarks/allocator_capacity_sweep.py [--requests 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import NamedTuple

from pydantic import ValidationError

from zeroplan.allocator.planner import allocator_verdict
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.core.plan import checked_peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, MemoryAssumptions, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.parallel import ParallelSpec

MODELS = ("llama-3.1-8b", "llama-2-7b", "mistral-7b", "gpt2-xl", "llama-2-13b")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "zero2-offload",
              "zero3-offload")
CONFS = ("", "expandable_segments:True")


def random_request(rng: random.Random) -> PlanRequest | None:
    """One request drawn at random, or None where the draw is not a valid request."""
    model = get_model(rng.choice(MODELS))
    model = model.model_copy(update={"num_layers": rng.randint(2, 12)})
    gpus = rng.choice((1, 2, 4, 8, 16))
    lora = rng.random() < 0.2
    tp = rng.choice((1, 1, 1, 2, 4)) if not lora else 1
    pp = rng.choice((1, 1, 1, 2)) if not lora and gpus // tp >= 2 else 1
    finetune = FineTuneSpec(lora_rank=rng.choice((8, 16, 64)), quantize=rng.choice(("none", "nf4"))) if lora else FineTuneSpec()
    try:
        return PlanRequest(
            model=model, cluster=cluster_from_gpus(get_gpu(rng.choice(("a100-80gb", "h100-80gb", "a10g"))), gpus),
            strategy=StrategySpec(kind=rng.choice(STRATEGIES)),
            training=TrainingSpec(activation_checkpointing=rng.choice(("none", "full", "selective")), finetune=finetune),
            batch=BatchSpec(micro_batch_size=rng.choice((1, 2, 4, 8)), seq_len=rng.choice((512, 1024, 2048, 4096)),
                            grad_accum_steps=rng.choice((1, 1, 2)) if pp == 1 else 2 * pp),
            parallel=ParallelSpec(tp=tp, sequence_parallel=tp > 1, pp=pp),
            assumptions=MemoryAssumptions(allocator_conf=rng.choice(CONFS)),
        )
    except (ZeroplanError, ValidationError):
        return None


class Outcome(NamedTuple):
    verdicts_agree: bool
    peak_keeps_rule: bool
    """fits is (peak <= usable memory)."""
    peak_over_capacity: float | None
    """Default peak / bisected OOM capacity (None where nothing was replayed)."""
    default_s: float
    exact_s: float


def compare(request: PlanRequest, rng: random.Random) -> Outcome | None:
    """The default answer and the oracle's for one request at a usable memory drawn between
    0.98 x its allocated peak and 1.3 x it."""
    try:
        states, terms = checked_peak_terms(request)
    except (ZeroplanError, ValidationError):
        return None
    allocated, _ = peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)
    usable = min(int(allocated * rng.uniform(0.98, 1.3)), usable_memory_bytes(request) * 4)
    exact_request = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    start = time.perf_counter()
    default = allocator_verdict(request, states, terms, allocated, usable)
    middle = time.perf_counter()
    exact = allocator_verdict(exact_request, states, terms, allocated, usable)
    end = time.perf_counter()
    peak = default.reserved_peak_bytes if default.reserved_peak_bytes is not None else allocated
    ratio = None if exact.oom_capacity_bytes is None else peak / exact.oom_capacity_bytes
    return Outcome(default.fits == exact.fits, default.fits == (peak <= usable), ratio, middle - start, end - middle)


def _quantile(values: list[float], q: float) -> float:
    return values[min(int(q * len(values)), len(values) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results: list[Outcome] = []
    while len(results) < args.requests:
        request = random_request(rng)
        outcome = compare(request, rng) if request is not None else None
        if outcome is not None:
            results.append(outcome)
    agree = sum(r.verdicts_agree for r in results)
    kept = sum(r.peak_keeps_rule for r in results)
    ratios = sorted(r.peak_over_capacity for r in results if r.peak_over_capacity is not None)
    equal = sum(abs(x - 1) < 1e-12 for x in ratios)
    default_s, exact_s = sum(r.default_s for r in results), sum(r.exact_s for r in results)
    print(f"{len(results):,} random requests: verdicts agree {agree:,}; peak at most the usable memory exactly when "
          f"the step fits {kept:,}")
    if ratios:
        print(f"default peak / bisected OOM capacity over {len(ratios):,} replayed: equal {equal:,} ({equal / len(ratios):.1%}); "
              f"min {ratios[0]:.3f}, 5th pct {_quantile(ratios, 0.05):.3f}, median {_quantile(ratios, 0.5):.3f}, "
              f"95th pct {_quantile(ratios, 0.95):.3f}, max {ratios[-1]:.3f}")
    print(f"time: default {default_s:.1f} s, with the capacity bisected {exact_s:.1f} s "
          f"(bisected / default {exact_s / default_s:.1f}x)")


if __name__ == "__main__":
    main()
