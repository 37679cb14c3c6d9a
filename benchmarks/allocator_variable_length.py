"""How much the caching allocator reserves after micro-batches of varying length, in zeroplan's
own replay (zeroplan.allocator), against the one step at the longest length the planner replays.

An unpacked dataset pads each batch to its longest sample (torchtune's padded_collate), so a run
sees a new sequence length nearly every micro-batch, and torch.cuda.max_memory_reserved, which
only grows without empty_cache, is the reserve after all of them. The published torchtune rows of
2024 (`ttdoc-lora-*`, `tt-1185-*`: alpaca, at most 512 tokens, reserved peaks after hundreds of
micro-batches) are under-predicted by the one-step replay. This chains the planner's own step
traces (schedule.step_ops) at lengths drawn uniformly from 64 to the row's 512, ending with one
at 512, the model states allocated once, and replays them under the default allocator and under
expandable segments. The lengths are an illustration, not the dataset's distribution (no
zeroplan input carries one), so the figures bound the mechanism, they are not predictions.
Usage:

    python benchmarks/allocator_variable_length.py [--steps 40] [--trials 3]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, Ops, replay  # noqa: E402
from zeroplan.allocator.schedule import step_ops  # noqa: E402
from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.plan import peak_terms  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

GIB = 2**30
ROWS = {
    # benchmarks/published_memory/rows.csv, ttdoc-lora-qv-r8 (measured 14.50 GiB reserved).
    "ttdoc-lora-qv-r8": "llama-2-7b --lora-rank 8 --lora-targets q,v --grad-accum 64",
    # tt-1185-default (16.39 GiB; 10.83 under expandable segments).
    "tt-1185": "llama-3-8b --lora-rank 8 --lora-targets q,k,v,o,gate,up,down --quantize nf4 --grad-accum 16",
}
COMMON = ("--gpus 1 --gpu a100-80gb --micro-batch 2 --activation-checkpointing full --precision bf16-pure "
          "--framework torchtune --unchunked-loss --keep-outputs --optimizer-loop foreach")


def step(flags: str, seq_len: int) -> Ops:
    args = build_parser().parse_args(["fit", *flags.split(), *COMMON.split(), "--seq-len", str(seq_len)])
    request = request_from_args(args, StrategyKind.ddp)
    return step_ops(request, *peak_terms(request))


def resident_ids(ops: Ops) -> set[int]:
    """What a step allocates and never frees (the model states, carried gradients)."""
    freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
    return {ident for kind, ident, _, _ in ops if kind == ALLOC_OP and ident not in freed}


def chained(flags: str, lengths: list[int]) -> Ops:
    """The model states once, then each length's step without them (ids kept apart)."""
    first = step(flags, lengths[-1])
    kept = resident_ids(first)
    ops: Ops = [op for op in first if op[1] in kept]
    for index, seq_len in enumerate(lengths, start=1):
        one = step(flags, seq_len)
        states = resident_ids(one)
        ops += [(kind, ident + index * 10**7, size, stream) for kind, ident, size, stream in one if ident not in states]
    return ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trials", type=int, default=3)
    options = parser.parse_args(argv)
    for row, flags in ROWS.items():
        for conf in ("", "expandable_segments:True"):
            config = parse_alloc_conf(conf)
            one = replay(step(flags, 512), config)
            rng = random.Random(0)
            chains = []
            for _ in range(options.trials):
                lengths = [rng.randint(64, 512) for _ in range(options.steps)] + [512]
                chains.append(replay(chained(flags, lengths), config).reserved_peak_bytes / GIB)
            print(f"{row:18s} {conf or 'default':26s} one step at 512: {one.reserved_peak_bytes / GIB:6.2f} GiB reserved; "
                  f"after {options.steps} steps of 64-512: " + ", ".join(f"{c:.2f}" for c in chains))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
