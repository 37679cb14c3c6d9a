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

    python benchmarks/varying_length_rows.py [--replays 0] [--device-map-replays 0] [--draws 0]

With --draws N, N epochs of lengths drawn as the model assumes them (the record term's
distribution, not only its expectation) for every one-GPU row: where the page's growth over the
one step (measured - one step) falls among the epochs' growth (records - longest, each record
counted once per segment size, as zeroplan.allocator.varying_lengths counts them). Every run of
one page, max_length and tokenizer met the same lengths in the same order (the script seeds each
run alike and the kept set is the same), so the rows of one such group are one draw, not several.
With --throughput, January's published samples/s against those that December's run times give
for kept samples dropped or cut (throughput_check).
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

from benchmarks.gpu_varying_lengths import MEAN, MIN, SD, lengths_of  # noqa: E402
from benchmarks.published_memory_accuracy import argv_of, load_rows, predict  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, replay  # noqa: E402
from zeroplan.allocator.schedule import step_ops  # noqa: E402
from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.length_records import sample_length_cdf  # noqa: E402
from zeroplan.allocator.rules import allocation_size, round_size  # noqa: E402
from zeroplan.allocator.varying_lengths import record_sizes, varying_length_reserve_bytes  # noqa: E402
from zeroplan.core.plan import memory_breakdown, peak_terms  # noqa: E402
from zeroplan.specs.lengths import LongSamples, VaryingLengths  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

GIB = 2**30
SAMPLES, SAMPLED_ABOVE_2048 = 4959, 1000


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
    return lengths_of(seq_len, round(SAMPLES * sample_length_cdf(spec)(seq_len)), seed)


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


def epoch_records(lengths: VaryingLengths, seq_len: int, micro_batch: int, rng: random.Random) -> list[int]:
    """One epoch's record batch lengths, in the order met (each longer than every batch before):
    ``lengths.samples`` draws of core.length_records' shifted gamma, those above seq_len dropped
    or cut, in a random order (the Trainer's RandomSampler), micro-batches padded to their longest."""
    shape = ((lengths.mean_tokens - lengths.min_tokens) / lengths.sd_tokens) ** 2
    scale = lengths.sd_tokens**2 / (lengths.mean_tokens - lengths.min_tokens)
    drawn = (int(lengths.min_tokens + rng.gammavariate(shape, scale)) for _ in range(lengths.samples))
    if lengths.long_samples is LongSamples.drop:
        kept = [tokens for tokens in drawn if tokens <= seq_len]
    else:
        kept = [min(tokens, seq_len) for tokens in drawn]
    rng.shuffle(kept)
    records: list[int] = []
    for start in range(0, len(kept), micro_batch):
        tokens = max(kept[start:start + micro_batch])
        if not records or tokens > records[-1]:
            records.append(tokens)
    return records


def drawn_growth(request, records: list[int]) -> int:
    """Bytes one epoch's records leave cached beyond its longest batch's, as
    zeroplan.allocator.varying_lengths counts them: each tensor a new segment where its segment
    size exceeds every earlier record's."""
    if not records:
        return 0
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    total = 0
    for size_at in record_sizes(request, peak_terms(request)[1], lambda other: peak_terms(other)[1]):
        segments = sorted({allocation_size(round_size(size_at(tokens), config)) for tokens in records})
        total += sum(segments) - segments[-1]
    return total


def percentile_of(value: float, draws: list[float]) -> float:
    """Per cent of the draws below value (ties half)."""
    below = sum(d < value for d in draws) + 0.5 * sum(d == value for d in draws)
    return 100 * below / len(draws)


def draw_table(rows: list[dict[str, str]], draws: int) -> None:
    """Per one-GPU row: the page's growth over the one step against ``draws`` epochs' growth."""
    print(f"{'id':40s} {'growth: page':>12s} {'expected':>8s} {'epochs p10':>10s} {'p50':>6s} {'p90':>6s} "
          f"{'page at':>8s}  GiB")
    epochs: dict[tuple, list[list[int]]] = {}
    for row in rows:
        if "--device-map" in row["extra_flags"]:
            continue
        request = request_from_args(build_parser().parse_args(argv_of(with_flag(row))), StrategyKind.ddp)
        lengths, batch = request.batch.varying_lengths, request.batch
        key = (row["id"].split("-")[1], lengths, batch.seq_len, batch.micro_batch_size)
        if key not in epochs:
            rng = random.Random(f"{key}")
            epochs[key] = [epoch_records(lengths, batch.seq_len, batch.micro_batch_size, rng) for _ in range(draws)]
        growths = sorted(drawn_growth(request, records) / GIB for records in epochs[key])
        one_step = predict({**row, "extra_flags": without_flag(row["extra_flags"])})["predicted"] / GIB
        measured = float(row["measured_value"]) * int(row["unit_bytes"]) / GIB
        expected = varying_length_reserve_bytes(request, peak_terms(request)[1], 0, 2**62,
                                                lambda other: peak_terms(other)[1]) / GIB
        page = measured - one_step

        def q(p: float) -> float:
            return growths[min(len(growths) - 1, int(p * len(growths)))]

        print(f"{row['id']:40s} {page:12.2f} {expected:8.2f} {q(0.1):10.2f} {q(0.5):6.2f} {q(0.9):6.2f} "
              f"{percentile_of(page, growths):7.0f}%")


# The pages' published speeds of the Qwen LoRA runs at max_length 512-8192 (docs/source/LLM/Benchmark.md):
# December (cfcb672: 1,000 samples cut to max_length, minutes a run, model loading included) and
# January (4312aeb: samples/s, the kept samples over the Trainer's train_runtime).
DECEMBER_MINUTES = {"qwen-1_8b": (2.02, 2.07, 2.48, 3.73, 4.48), "qwen-7b": (2.52, 4.11, 7.01, 11.12, 13.63),
                    "qwen-14b": (3.94, 6.67, 11.73, 18.88, 23.61)}
JANUARY_SAMPLES_PER_S = {"qwen-1_8b": (9.88, 9.90, 8.77, 5.92, 4.19), "qwen-7b": (7.43, 6.51, 4.31, 2.05, 1.34),
                         "qwen-14b": (5.63, 4.36, 2.60, 1.17, 0.79)}
PAGE_LENGTHS = (512, 1024, 2048, 4096, 8192)


def length_moments(seq_len: int, long_samples: LongSamples) -> tuple[float, float]:
    """(E[L], E[L^2]) of a trained sample under the page's statistics (core.length_records' gamma),
    samples above seq_len dropped (of the kept ones) or cut to it."""
    cdf = sample_length_cdf(VaryingLengths(mean_tokens=MEAN, sd_tokens=SD, min_tokens=MIN, samples=SAMPLES))
    below = cdf(seq_len)
    first = second = 0.0
    before = 0.0
    for tokens in range(MIN, seq_len + 1):
        f = cdf(tokens)
        first += tokens * (f - before)
        second += tokens * tokens * (f - before)
        before = f
    if long_samples is LongSamples.drop:
        return first / below, second / below
    return first + seq_len * (1 - below), second + seq_len**2 * (1 - below)


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination of a 3 x 3 system."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    for i in range(3):
        pivot = max(range(i, 3), key=lambda r: abs(m[r][i]))
        m[i], m[pivot] = m[pivot], m[i]
        for r in range(3):
            if r != i:
                factor = m[r][i] / m[i][i]
                m[r] = [x - factor * y for x, y in zip(m[r], m[i])]
    return [m[i][3] / m[i][i] for i in range(3)]


def throughput_check() -> None:
    """Whether January's runs dropped or cut the samples above max_length, by their speed: the
    December runs (the same first 1,000 samples, cut) fit a time A + b sum(L) + c sum(L^2) per
    model (least squares over the five lengths), which then gives January's samples/s for kept
    samples dropped or cut."""
    print(f"{'model':10s} {'max_length':>10s} {'published':>9s} {'dropped':>8s} {'cut':>6s}  samples/s")
    for model, minutes in DECEMBER_MINUTES.items():
        cut = [length_moments(m, LongSamples.truncate) for m in PAGE_LENGTHS]
        design = [[1.0, 1000 * first, 1000 * second] for first, second in cut]
        seconds = [60 * t for t in minutes]
        normal = [[sum(r[i] * r[j] for r in design) for j in range(3)] for i in range(3)]
        _, per_token, per_token_sq = _solve3(normal, [sum(r[i] * t for r, t in zip(design, seconds)) for i in range(3)])
        for m, published in zip(PAGE_LENGTHS, JANUARY_SAMPLES_PER_S[model]):
            speeds = [1 / (per_token * first + per_token_sq * second)
                      for first, second in (length_moments(m, LongSamples.drop), length_moments(m, LongSamples.truncate))]
            print(f"{model:10s} {m:10d} {published:9.2f} {speeds[0]:8.2f} {speeds[1]:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=0, help="chained replays of swift-bm-qwen-7b-chat-lora-2048")
    parser.add_argument("--device-map-replays", type=int, default=0,
                        help="chained replays of GPU 0 (no loss) of the Qwen-72B device-map rows at 512-2048 tokens")
    parser.add_argument("--throughput", action="store_true",
                        help="January's published samples/s against December's speeds, samples dropped or cut")
    parser.add_argument("--draws", type=int, default=0,
                        help="epochs of drawn lengths a row: where each page's growth falls among them")
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
    if options.throughput:
        throughput_check()
    if options.draws:
        draw_table(rows, options.draws)
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
