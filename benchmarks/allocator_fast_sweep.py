"""The planner's allocator verdicts as fit() and plan() take them (zeroplan.allocator.planner:
answered from the replays of the same trace already made where those decide it) against the
oracle that replays every verdict's whole trace afresh (MemoryAssumptions.exact_allocator),
over random requests: models x frameworks x strategies (DDP, ZeRO-1/2/3, FSDP, HSDP, offload)
x tensor / pipeline / context parallelism x LoRA / QLoRA x micro-batch, sequence and
checkpointing x GPUs x PYTORCH_CUDA_ALLOC_CONF settings.

Each pipeline rank of each request is asked three times: on its usable memory, on a capacity
half-way between its allocated and its reserved peak (where a replay frees its cache and
retries, the band the shortcuts must leave to a replay), and whether it completes there
(allocator_fits, the largest-micro-batch search's question). Prints the count of verdicts
compared, how many are identical, and the largest |reserved peak difference|.

    python benchmarks/allocator_fast_sweep.py [--requests 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

from zeroplan.allocator.planner import allocator_fits, allocator_verdict
from zeroplan.cli.fit import add_fit_arguments, request_from_args
from zeroplan.cli.parser import OneLineParser
from zeroplan.core.plan import checked_peak_terms, peak_allocated_bytes, pipeline_rank_requests, replayed, usable_memory_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.specs import PlanRequest, StrategyKind
from zeroplan.units import MiB

MODELS = ("llama-2-7b", "llama-3.1-8b", "llama-2-13b", "mistral-7b", "gpt2-xl", "falcon-7b", "yi-34b",
          "llama-3.1-70b", "mixtral-8x7b", "stablelm-base-alpha-3b")
FRAMEWORKS = ("zeroplan", "zeroplan", "torchtitan", "torchtune", "hf", "litgpt", "megatron", "megatron-deepspeed")
GPUS = ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "a10g", "l40s", "v100-32gb", "rtx-4090")
CONFS = ("", "", "", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
         "garbage_collection_threshold:0.8")


def random_argv(rng: random.Random) -> list[str]:
    """One request's fit flags, drawn at random (many combinations are refused, and skipped)."""
    gpus = rng.choice((1, 2, 4, 8, 8, 16))
    argv = [rng.choice(MODELS), "--framework", rng.choice(FRAMEWORKS), "--gpu", rng.choice(GPUS), "--gpus", str(gpus),
            "--micro-batch", str(rng.choice((1, 1, 2, 3, 4, 6, 8, 12, 16))),
            "--seq-len", str(rng.choice((256, 512, 1024, 2048, 4096, 8192))),
            "--activation-checkpointing", rng.choice(("none", "full", "selective", "selective-op")),
            "--allocator-conf", rng.choice(CONFS)]
    if rng.random() < 0.3:
        argv += ["--grad-accum", str(rng.choice((2, 4)))]
    layout = rng.random()
    if layout < 0.15:
        argv += ["--tp", str(rng.choice((2, 4)))]
    elif layout < 0.25:
        argv += ["--pp", str(rng.choice((2, 4)))]
    elif layout < 0.32:
        argv += ["--cp", "2"]
    tune = rng.random()
    if tune < 0.15:
        argv += ["--lora-rank", "16"]
    elif tune < 0.25:
        argv += ["--lora-rank", "16", "--quantize", "nf4"]
    if rng.random() < 0.1:
        argv += ["--fsdp-cpu-offload"]
    if rng.random() < 0.1:
        argv += ["--precision", rng.choice(("fp32", "bf16-pure", "fp16-mixed"))]
    return argv


# zeroplan.allocator.deepspeed_first_step's requests: DeepSpeed's ZeRO-3 under hf, a 16-bit model,
# at each release the profile models.
FIRST_STEP_RELEASES = ("0.13.3", "0.14.2", "0.19.8")
FIRST_STEP_PRECISIONS = ("fp16-mixed", "bf16-mixed")


def first_step_argv(rng: random.Random) -> list[str]:
    """random_argv's draw made a DeepSpeed ZeRO-3 run under hf at a random release and 16-bit
    precision, without model parallelism (the later flags win; quantization, offload and layouts
    dropped; LoRA and accumulation kept)."""
    argv = random_argv(rng)
    keep: list[str] = []
    skip = 0
    for i, word in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if word in ("--tp", "--pp", "--cp", "--quantize", "--precision", "--framework"):
            skip = 1
            continue
        if word == "--fsdp-cpu-offload":
            continue
        keep.append(word)
    return keep + ["--framework", "hf", "--deepspeed-release", rng.choice(FIRST_STEP_RELEASES), "--precision",
                   rng.choice(FIRST_STEP_PRECISIONS)] + (["--model-load", "full-per-rank"] if rng.random() < 0.5 else [])


def random_requests(count: int, seed: int, first_step: bool = False) -> list[PlanRequest]:
    """``count`` requests the planner accepts, each with a strategy its framework runs
    (``first_step``: ZeRO-3 requests of first_step_argv)."""
    from zeroplan.core.profiles import framework_strategies

    rng = random.Random(seed)
    parser = OneLineParser(prog="fit")
    add_fit_arguments(parser)
    out: list[PlanRequest] = []
    while len(out) < count:
        try:
            if first_step:
                base = request_from_args(parser.parse_args(first_step_argv(rng)))
                request = base.with_strategy(base.strategy.model_copy(update={"kind": StrategyKind.zero3}))
                checked_peak_terms(request)
                out.append(request)
                continue
            base = request_from_args(parser.parse_args(random_argv(rng)))
            # Mostly a strategy the framework runs, else any (the opt-in ones: hpZ, ZeRO++, MiCS, NVMe).
            kinds = (list(framework_strategies(base.training.framework, base.cluster.world_size))
                     if rng.random() < 0.8 else list(StrategyKind))
            request = base.with_strategy(base.strategy.model_copy(update={"kind": rng.choice(kinds)}))
            checked_peak_terms(request)
        except ZeroplanError:
            continue
        out.append(request)
    return out


def exact(request: PlanRequest) -> PlanRequest:
    return request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_allocator": True})})


def compare(request: PlanRequest) -> list[tuple[bool, int, bool]]:
    """(verdicts identical, |reserved peak difference| in bytes, the oracle replayed: the
    allocated peak alone did not decide it) of each question asked of each of the request's
    pipeline ranks (the module's docstring)."""
    out = []
    for rank in pipeline_rank_requests(request):
        states, terms = replayed(*checked_peak_terms(rank))
        allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
        usable = usable_memory_bytes(rank)
        oracle = exact(rank)
        truth = allocator_verdict(oracle, states, terms, allocated, usable)
        fast = allocator_verdict(rank, states, terms, allocated, usable)
        out.append((truth == fast, abs((truth.reserved_peak_bytes or 0) - (fast.reserved_peak_bytes or 0)),
                    truth.reserved_peak_bytes is not None))
        if truth.reserved_peak_bytes is None or truth.reserved_peak_bytes - allocated < 4 * MiB:
            continue
        band = allocated + (truth.reserved_peak_bytes - allocated) // 2
        truth = allocator_verdict(oracle, states, terms, allocated, band)
        fast = allocator_verdict(rank, states, terms, allocated, band)
        out.append((truth == fast, abs(truth.reserved_peak_bytes - fast.reserved_peak_bytes), True))
        out.append((allocator_fits(rank, states, terms, allocated, band) == truth.fits, 0, True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deepspeed-first-step", action="store_true",
                        help="only DeepSpeed ZeRO-3 requests under hf at its releases, 16-bit (zeroplan.allocator.deepspeed_first_step)")
    args = parser.parse_args()
    start = time.perf_counter()
    requests = random_requests(args.requests, args.seed, args.deepspeed_first_step)
    compared = identical = replayed_count = 0
    largest = 0
    strategies, frameworks = set(), set()
    for request in requests:
        for same, difference, replayed_here in compare(request):
            compared += 1
            replayed_count += replayed_here
            identical += same
            largest = max(largest, difference)
        strategies.add(request.strategy.kind.value)
        frameworks.add(request.training.framework.value)
    print(f"strategies: {', '.join(sorted(strategies))}; frameworks: {', '.join(sorted(frameworks))}")
    print(f"{len(requests)} random requests ({len(strategies)} strategies, {len(frameworks)} frameworks; seed "
          f"{args.seed}), {compared} verdicts compared ({replayed_count} decided by a replay, the others by the allocated peak "
          f"alone), {time.perf_counter() - start:.0f} s")
    print(f"verdicts identical: {identical} of {compared}; max |reserved peak difference|: {largest} bytes")


if __name__ == "__main__":
    main()
