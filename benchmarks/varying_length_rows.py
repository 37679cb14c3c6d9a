"""ms-swift's benchmark rows, December 2023 (`swift-dec-*`: samples above max_length cut) and
January 2024 (`swift-bm-*`: dropped), each batch padded to its own longest sample, scored as one
step of max_length and as rows.csv has them, with --varying-lengths
(zeroplan.allocator.varying_lengths), and the expected record sum against the chained replay of
the planner's own step traces.

The page (docs/source/LLM/Benchmark.md at the rows' commit) gives its dataset's statistics:
cls-fudan-news-zh, 3234.4 +- 2547.5 tokens, min 91; 4,959 samples (the dataset table of the
same commit); scripts/benchmark/test_memory_time/run_single.py takes 1,000 of them above
max_length 2048 (train_dataset_sample: sft.py selects random_state.permutation(1000), the
first 1,000 in a shuffled order), the whole set up to it; the December script 1,000 always. Every run of the script seeds
its sampler alike (RandomState(42)), so rows of one max_length share one data order: each
measured figure is one draw of the epoch's records, the model gives their expectation.
Usage:

    python benchmarks/varying_length_rows.py [--replays 0] [--device-map-replays 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.published_memory_accuracy import argv_of, load_rows, predict  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, replay  # noqa: E402
from zeroplan.allocator.schedule import step_ops  # noqa: E402
from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.length_records import sample_length_cdf  # noqa: E402
from zeroplan.allocator.varying_lengths import varying_length_reserve_bytes  # noqa: E402
from zeroplan.core.plan import memory_breakdown, peak_terms  # noqa: E402
from zeroplan.specs.lengths import VaryingLengths  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

GIB = 2**30
MEAN, SD, MIN, SAMPLES, SAMPLED_ABOVE_2048 = 3234.4, 2547.5, 91, 4959, 1000


def flag_of(row: dict[str, str]) -> str:
    """The flag a user of each page's script passes: January (`swift-bm-*`) drops longer samples
    (truncation_strategy 'delete') from the whole set up to 2048 tokens, from 1,000 above;
    December (`swift-dec-*`, run_single.py @cfcb672) cuts them (truncation_left) in 1,000."""
    if row["id"].startswith("swift-dec"):
        return f" --varying-lengths {MEAN},{SD},{MIN},{SAMPLED_ABOVE_2048},truncate"
    samples = SAMPLES if int(row["seq_len"]) <= 2048 else SAMPLED_ABOVE_2048
    return f" --varying-lengths {MEAN},{SD},{MIN},{samples}"


def without_flag(extra_flags: str) -> str:
    """The row's flags without --varying-lengths: the one step of max_length."""
    words = extra_flags.split()
    return " ".join(w for i, w in enumerate(words) if w != "--varying-lengths" and (i == 0 or words[i - 1] != "--varying-lengths"))


def with_flag(row: dict[str, str]) -> dict[str, str]:
    return row if "--varying-lengths" in row["extra_flags"] else {**row, "extra_flags": row["extra_flags"] + flag_of(row)}


def chained_reserved(flags: list[str], seq_len: int, lengths: list[int], rank: int = 0) -> float:
    """The planner's step traces at ``lengths`` one after another (the model states once), replayed,
    on pipeline rank (a device map's GPU) ``rank``."""
    def ops_at(tokens: int):
        args = build_parser().parse_args([*flags, "--seq-len", str(tokens)])
        request = request_from_args(args, StrategyKind.ddp).at_pipeline_rank(rank)
        return step_ops(request, *peak_terms(request))

    cache: dict[int, list] = {}
    first = ops_at(seq_len)
    freed = {ident for kind, ident, _, _ in first if kind == FREE_OP}
    kept = {ident for kind, ident, _, _ in first if kind == ALLOC_OP and ident not in freed}
    ops = [op for op in first if op[1] in kept]
    for index, tokens in enumerate(lengths, start=1):
        one = cache.get(tokens) or cache.setdefault(tokens, ops_at(tokens))
        ops += [(kind, ident + index * 10**7, size, stream) for kind, ident, size, stream in one if ident not in kept]
    return replay(ops, parse_alloc_conf("")).reserved_peak_bytes / GIB


def dropped_set_lengths(seq_len: int, seed: int) -> list[int]:
    """One epoch's lengths in the January script's order: the whole set's samples up to seq_len
    (longer ones dropped), drawn from the gamma of the page's statistics."""
    spec = VaryingLengths(mean_tokens=MEAN, sd_tokens=SD, min_tokens=MIN, samples=SAMPLES)
    kept = round(SAMPLES * sample_length_cdf(spec)(seq_len))
    shape, scale = ((MEAN - MIN) / SD) ** 2, SD**2 / (MEAN - MIN)
    rng = random.Random(seed)
    lengths: list[int] = []
    while len(lengths) < kept:
        tokens = int(MIN + rng.gammavariate(shape, scale))
        if tokens <= seq_len:
            lengths.append(tokens)
    return lengths


def replayed_growth(row: dict[str, str], rank: int, replays: int) -> tuple[list[float], float, float, int]:
    """(chained replays' reserved peaks, the one step's replayed alone, the model's expected growth
    with --varying-lengths, not capped at the usable memory as the plan's is, the epoch's
    batches) for ``row`` on pipeline rank ``rank``, all GiB but the batches."""
    seq_len = int(row["seq_len"])
    flags = argv_of({**row, "extra_flags": without_flag(row["extra_flags"])})
    flags = [flag for i, flag in enumerate(flags) if flag != "--seq-len" and (i == 0 or flags[i - 1] != "--seq-len")]
    figures = [chained_reserved(flags, seq_len, dropped_set_lengths(seq_len, seed), rank) for seed in range(replays)]
    one_step = chained_reserved(flags, seq_len, [seq_len], rank)
    request = request_from_args(build_parser().parse_args(argv_of(with_flag(row))), StrategyKind.ddp).at_pipeline_rank(rank)
    growth = varying_length_reserve_bytes(request, peak_terms(request)[1], 0, 2**62, lambda other: peak_terms(other)[1])
    return figures, one_step, growth / GIB, len(dropped_set_lengths(seq_len, 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=0, help="chained replays of swift-bm-qwen-7b-chat-lora-2048")
    parser.add_argument("--device-map-replays", type=int, default=0,
                        help="chained replays of GPU 0 (no loss) of the Qwen-72B device-map rows at 512-2048 tokens")
    options = parser.parse_args(argv)
    rows = [row for row in load_rows() if row["id"].startswith(("swift-bm", "swift-dec"))
            and not row["expressible"].startswith("no") and row["measured_value"]]
    before: dict[str, list[float]] = {"swift-bm": [], "swift-dec": []}
    after: dict[str, list[float]] = {"swift-bm": [], "swift-dec": []}
    print(f"{'id':40s} {'measured':>8s} {'one step':>17s} {'--varying-lengths':>17s}  GiB")
    for row in rows:
        plain = predict({**row, "extra_flags": without_flag(row["extra_flags"])})
        varying = predict(with_flag(row))
        measured = float(row["measured_value"]) * int(row["unit_bytes"]) / GIB
        errors = [100 * (p["predicted"] / GIB - measured) / measured for p in (plain, varying)]
        page = row["id"][:9] if row["id"].startswith("swift-dec") else "swift-bm"
        before[page].append(errors[0])
        after[page].append(errors[1])
        print(f"{row['id']:40s} {measured:8.2f} {plain['predicted'] / GIB:8.2f} {errors[0]:+7.1f}% "
              f"{varying['predicted'] / GIB:8.2f} {errors[1]:+7.1f}%")
    for page in before:
        for name, errors in (("one step", before[page]), ("--varying-lengths", after[page])):
            print(f"{page:9s} {name:18s} {len(errors)} rows: median |error| {statistics.median(map(abs, errors)):.1f} %, "
                  f"signed {statistics.median(errors):+.1f} %")
    for name, pages in (("one step", before), ("--varying-lengths", after)):
        errors = [error for page in pages.values() for error in page]
        print(f"both      {name:18s} {len(errors)} rows: median |error| {statistics.median(map(abs, errors)):.1f} %, "
              f"signed {statistics.median(errors):+.1f} %, within 10 %: {sum(abs(e) <= 10 for e in errors)}")
    if options.replays:
        row = next(r for r in rows if r["id"] == "swift-bm-qwen-7b-chat-lora-2048")
        figures, _, _, kept = replayed_growth(row, 0, options.replays)
        model = memory_breakdown(request_from_args(build_parser().parse_args(argv_of(with_flag(row))), StrategyKind.ddp))[0]
        print(f"swift-bm-qwen-7b-chat-lora-2048: chained replays of {kept} lengths: "
              + ", ".join(f"{f:.2f}" for f in sorted(figures))
              + f" GiB (mean {statistics.mean(figures):.2f}); the model's expectation {model.peak_bytes / GIB:.2f}; measured 27.74")
    if options.device_map_replays:
        # One process over two GPUs: GPU 0 holds the embedding and blocks 0-38 and no loss, so its
        # term is its backward workspace's (zeroplan.allocator.varying_lengths.workspace_record_sizes);
        # GPU 1 the rest and the loss. Growth: over the one step at max_length, replayed alone.
        print(f"{'device map':44s} {'measured':>8s} {'one step':>8s} {'growth: measured':>16s} {'model':>6s} "
              f"{'replays (min-max)':>20s}  GiB")
        for row in rows:
            if not row["id"].startswith("swift-bm-qwen-72b-chat-lora-") or not row["id"].endswith("-2gpu"):
                continue
            published = row["notes"].split("published per GPU ")[1].split(" GiB")[0].split("+")
            for rank in (0, 1):
                figures, one_step, growth, _ = replayed_growth(row, rank, options.device_map_replays)
                measured = float(published[rank])
                mean = statistics.mean(figures)
                print(f"{row['id'] + f' GPU {rank}':44s} {measured:8.2f} {one_step:8.2f} {measured - one_step:16.2f} "
                      f"{growth:6.2f} {mean - one_step:8.2f} ({min(figures) - one_step:.2f}-{max(figures) - one_step:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
