"""Where the flat reserve's verdict (allocated peak + 5 %, `--flat-reserve`) and the
caching-allocator model's (the default: its replay at the usable memory) disagree, over a
sweep of the setups users ask about: models x frameworks x GPUs x micro-batch and sequence x
checkpointing, every strategy each framework runs on 8 GPUs.

Prints each disagreement (flat says fits and the allocator says OOM is the dangerous one), how
many of the flat reserve's recommendations the model runs out on and how many of those a plain
fit --flat-reserve cautions (core.plan.allocator_caution), and the distribution of OOM capacity / allocated
peak, which says how wide the band is in which the flat reserve can be wrong. Both verdicts come from the planner itself; nothing here is a GPU
measurement (docs/validation.md has those).

    python benchmarks/allocator_verdict_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

from zeroplan.cli.fit import add_fit_arguments, request_from_args
from zeroplan.cli.parser import OneLineParser
from zeroplan.core.plan import ALLOCATOR_CHECK_FRACTION, fit, under_allocator_model
from zeroplan.errors import ZeroplanError
from zeroplan.units import GiB

MODELS = (("llama-3.1-8b", "torchtitan"), ("llama-3.1-8b", "torchtune"), ("llama-3.1-8b", "hf"),
          ("llama-2-7b", "zeroplan"), ("llama-2-13b", "zeroplan"), ("llama-3.1-70b", "torchtitan"))
GPUS = ("a100-40gb", "a100-80gb", "h100-80gb", "a10g")
SHAPES = ((1, 2048), (2, 4096), (4, 4096), (8, 2048), (2, 8192))


def cases(quick: bool) -> list[list[str]]:
    models = MODELS[:2] if quick else MODELS
    gpus = GPUS[:2] if quick else GPUS
    out = []
    for model, framework in models:
        for gpu in gpus:
            for micro, seq in SHAPES:
                for checkpointing in ("full", "selective-op" if framework == "torchtitan" else "none"):
                    out.append([model, "--framework", framework, "--gpu", gpu, "--gpus", "8", "--micro-batch", str(micro),
                                "--seq-len", str(seq), "--activation-checkpointing", checkpointing])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models and two GPUs only")
    args = parser.parse_args()
    fit_parser = OneLineParser(prog="fit")
    add_fit_arguments(fit_parser)
    start = time.perf_counter()
    plans = skipped = 0
    flips, ratios, failing_shares = [], [], []
    recommended_out = cautioned = 0
    for argv in cases(args.quick):
        try:
            base = request_from_args(fit_parser.parse_args([*argv, "--flat-reserve"]))
        except ZeroplanError:
            skipped += 1  # e.g. a sequence past the model's positions
            continue
        flat = fit(base, suggest=False)
        # The OOM capacity bisected too: the ratios below are of the least memory each step needs.
        replayed = fit(under_allocator_model(base).with_exact_capacity(), suggest=False)
        if flat.recommended is not None:
            # The recommendation the flat reserve makes, and whether the plain fit's caution
            # (core.plan.allocator_caution, the band of ALLOCATOR_CHECK_FRACTION) catches it.
            recommended_out += not replayed.plan_for(flat.recommended).fits
            cautioned += bool(flat.allocator_caution)
        for a, b in zip(flat.plans, replayed.plans, strict=True):
            plans += 1
            memory = b.memory
            if memory.oom_capacity_bytes is not None:
                ratios.append(memory.oom_capacity_bytes / memory.allocated_peak_bytes)
                if not b.fits:
                    failing_shares.append(memory.allocated_peak_bytes / b.usable_memory_bytes)
            if a.fits != b.fits:
                flips.append((a, b, " ".join(argv)))
    elapsed = time.perf_counter() - start
    print(f"{plans} strategy plans ({skipped} setups refused), {elapsed:.0f} s")
    dangerous = sum(1 for a, _, _ in flips if a.fits)
    print(f"verdicts that differ: {len(flips)} ({dangerous} where the flat reserve says fits and the allocator OOM)")
    print(f"{'flat':>5s} {'alloc':>5s} {'strategy':18s} {'allocated':>9s} {'flat peak':>9s} {'oom-at':>7s} {'usable':>7s}  setup (GiB)")
    for a, b, setup in flips:
        print(f"{'fits' if a.fits else 'OOM':>5s} {'fits' if b.fits else 'OOM':>5s} {a.strategy.value:18s} "
              f"{b.memory.allocated_peak_bytes / GiB:9.2f} {a.memory.peak_bytes / GiB:9.2f} "
              f"{_gib(b.memory.oom_capacity_bytes):>7s} {a.usable_memory_bytes / GiB:7.2f}  {setup}")
    print(f"setups whose flat-reserve recommendation the allocator model runs out on: {recommended_out}; "
          f"cautioned by fit --flat-reserve: {cautioned}")
    ratios.sort()
    print(f"OOM capacity / allocated peak, over the {len(ratios)} plans whose allocated peak is within the usable "
          f"memory (the others' capacity is not bisected): median {statistics.median(ratios):.3f}, "
          f"90th percentile {ratios[int(0.9 * len(ratios))]:.3f}, "
          f"99th {ratios[int(0.99 * len(ratios))]:.3f}, max {ratios[-1]:.3f}")
    if failing_shares:
        print(f"the least allocated peak / usable memory of a step the model runs out on: {min(failing_shares):.3f} "
              f"({len(failing_shares)} such plans; under --flat-reserve the model is asked from "
              f"ALLOCATOR_CHECK_FRACTION = {ALLOCATOR_CHECK_FRACTION[0] / ALLOCATOR_CHECK_FRACTION[1]:.3f})")


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


if __name__ == "__main__":
    main()
