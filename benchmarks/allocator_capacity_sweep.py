"""The allocator model's two OOM-capacity searches side by side on random requests: the default
(one grown replay, confirmed or galloped from; allocator.capacity.verdict_capacity) against the
oracle (bisection over whole replays, MemoryAssumptions.exact_capacity). For each request both
run on the same step trace and the same usable memory; the sweep prints how often the verdicts
agree (they must: both are the replay at the usable memory), how often the capacities are the
same boundary, the largest difference where they are not, and the time each search took.

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

from pydantic import ValidationError

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES
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
from zeroplan.units import GiB, MiB

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


def compare(request: PlanRequest, rng: random.Random) -> tuple[bool, bool, int, float, float] | None:
    """(verdicts agree, same capacity, |difference| in bytes, default s, exact s) for one request
    at a usable memory drawn between 0.9 x its allocated peak and 1.3 x it."""
    try:
        states, terms = checked_peak_terms(request)
    except (ZeroplanError, ValidationError):
        return None
    allocated, _ = peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)
    usable = min(int(allocated * rng.uniform(0.98, 1.3)), usable_memory_bytes(request) * 4)
    exact_request = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    start = time.perf_counter()
    fast = allocator_verdict(request, states, terms, allocated, usable)
    middle = time.perf_counter()
    exact = allocator_verdict(exact_request, states, terms, allocated, usable)
    end = time.perf_counter()
    if fast.oom_capacity_bytes is None:
        return fast.fits == exact.fits, exact.oom_capacity_bytes is None, 0, middle - start, end - middle
    difference = abs(fast.oom_capacity_bytes - exact.oom_capacity_bytes)
    return fast.fits == exact.fits, difference == 0, difference, middle - start, end - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    while len(results) < args.requests:
        request = random_request(rng)
        outcome = compare(request, rng) if request is not None else None
        if outcome is not None:
            results.append(outcome)
    agree = sum(r[0] for r in results)
    same = sum(r[1] for r in results)
    differing = sorted(r[2] for r in results if not r[1])
    fast_s, exact_s = sum(r[3] for r in results), sum(r[4] for r in results)
    print(f"{len(results):,} random requests: verdicts agree {agree:,}; same OOM capacity {same:,} "
          f"({same / len(results):.2%}); where not ({len(differing):,}), |difference| median "
          f"{(differing[len(differing) // 2] if differing else 0) / MiB:,.0f} MiB, largest "
          f"{(differing[-1] if differing else 0) / MiB:,.0f} MiB ({(differing[-1] if differing else 0) / GiB:.2f} GiB); "
          f"grid {CAPACITY_STEP_BYTES // MiB} MiB")
    print(f"time in the capacity search and verdict: default {fast_s:.1f} s, exact {exact_s:.1f} s "
          f"(exact / default {exact_s / fast_s:.2f}x)")


if __name__ == "__main__":
    main()
