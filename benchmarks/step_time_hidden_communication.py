"""A fraction of the communication the planner hides, added to the step (docs/validation.md,
"Mechanisms tried"; "What the misses follow": within one model and micro-batch llm-foundry's
large-scale H100 table grows its step with the GPU count though the planner exposes none of its
collectives). Side by side with the planner as it is; nothing in zeroplan changes.

The variant: a phase (forward, backward) whose compute c runs under non-blocking collectives of
k seconds, its busiest link busy b seconds (b >= k: host copies run on their own link), takes
max(b, c + f k) where the planner takes max(b, c). Where the compute outlasts the collectives
that adds f k, f of the hidden communication; where the collectives outlast the compute the
compute's delay hides under them until it reaches them. Blocking collectives (tensor-parallel,
pipeline sends) are on the critical path already and are not in it. f is:

- planner: 0.
- contention: 0.189 / 1.189 = 0.159 on every row, nothing fitted: the average compute slowdown
  under overlapped communication measured on A100 and H100 (Lee et al. 2025, "Characterizing
  Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114,
  abstract: 18.9 %). Compute slowed by s while k runs beside it takes c + k s / (1 + s): the
  variant at f = s / (1 + s), and benchmarks/step_time_mechanisms.py's contention variant.
- fitted: one f per GPU generation x stack (issue 30's rule 1). Each source of at least
  MIN_SOURCE_ROWS rows solves its f on its own rows: the f under which one HFU fits them best,
  the least spread of the HFUs calibrate step solves on them (source_f); a mechanism's f is the
  median over its sources (as zeroplan.core.attention_efficiency takes e), held at 0 or above
  (a hidden collective cannot speed the step up); a mechanism without such a source keeps f = 0.
- fitted-series: the same, each source's f solved on its GPU-count series alone (the spread
  within each series of rows that ran the same model, sequence, micro-batch, accumulation and
  layout on different GPU counts, so differ in their collectives and not their compute): what
  the large-scale table's drift with the GPU count asks for, without the width and micro-batch
  effects that move a source's HFU between its models.
- fitted+contention, fitted-series+contention: the fitted f where the mechanism has a fitted
  source other than the scored one, the published contention elsewhere.

Every figure is out of sample, as zeroplan.validate.step_calibration scores the planner: a
source's rows are scored at the f fitted without it and at the attention efficiencies fitted
without it (held at the planner's fit, not refitted under the variant). Calibrated: each
source of at least three rows solves its HFU under the variant on its rule's anchor
(calibration_row) and is scored on its other rows. Uncalibrated: the fitted default (an HFU per
GPU generation x kernel class, fitted on the other sources' rows solved under the variant)
leave-one-source-out. The f each source solves on its own rows is printed first, in sample
and labelled so.

    python benchmarks/step_time_hidden_communication.py     # ~1 min on 2 cores
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable

from zeroplan.calibrate.step import _at_hfu, bisect_hfu, timed_request
from zeroplan.core.collective import Phase
from zeroplan.core.communication import collectives
from zeroplan.core.default_efficiency import generation_of
from zeroplan.core.plan import pipeline_rank_requests
from zeroplan.core.timing import _batch_free_terms, step_time
from zeroplan.validate.step_calibration import (
    DEFAULT_ATTENTION_RATE, MIN_SOURCE_ROWS, TARGET_MAX, TARGET_MEDIAN, _with_attention_rate, attention_efficiency_fit,
    calibration_row, carried_calibration_hfu, kernel_mechanism_hfu, published_step_s, source_label, source_rows, stack_of,
)
from zeroplan.validate.step_time import PublishedThroughput, PublishedThroughputTable, load_published_throughput

CONTENTION = 0.189 / 1.189
"""f of Lee et al.'s 18.9 % compute slowdown under overlapped communication."""

VARIANTS = ("planner", "fitted", "fitted-series", "contention", "fitted+contention", "fitted-series+contention")

Efficiencies = tuple[tuple[str, float], ...]
Phases = tuple[tuple[float, float, float], ...]


@functools.lru_cache(maxsize=1)
def table() -> PublishedThroughputTable:
    return load_published_throughput()


def mechanism_of(row: PublishedThroughput) -> tuple[str, str]:
    """The row's GPU generation x stack."""
    return generation_of(row.gpu), stack_of(row)


# The variant, phase by phase: max(busy, c + f k) in place of max(busy, c).
def added_s(phases: Phases, f: float) -> float:
    """Seconds f of the overlapped collectives adds to a step of ``phases`` ((compute, collectives,
    busiest link) seconds of the forward and of the backward)."""
    return sum(max(busy, compute + f * collective) - max(busy, compute) for compute, collective, busy in phases)


@functools.lru_cache(maxsize=None)
def _timed(row: PublishedThroughput, efficiencies: Efficiencies):  # type: ignore[no-untyped-def]
    """Every pipeline rank of the row's request (the request alone without a pipeline), each with
    its collectives: the step is the slowest rank's (zeroplan.core.plan.pipeline_step_time)."""
    request = timed_request(_with_attention_rate(row.request(), DEFAULT_ATTENTION_RATE, efficiencies))
    return tuple((rank, tuple(collectives(rank))) for rank in pipeline_rank_requests(request))


@functools.lru_cache(maxsize=None)
def terms(row: PublishedThroughput, efficiencies: Efficiencies, hfu: float) -> tuple[tuple[float, float, Phases], ...]:
    """Per pipeline rank: (the planner's step, the step's tokens per GPU, its phases for added_s) at ``hfu``."""
    ranks = []
    for request, step_collectives in _timed(row, efficiencies):
        at = _at_hfu(request, hfu)
        time = step_time(at, step_collectives)
        free = _batch_free_terms(at, step_collectives)
        phases = tuple((compute, free.by_phase[phase], max(free.by_phase[phase], free.host_by_phase[phase]))
                       for compute, phase in ((time.forward_compute_s, Phase.forward), (time.backward_compute_s, Phase.backward)))
        ranks.append((time.step_with_overlap_s, time.tokens_per_s_per_gpu * time.step_with_overlap_s, phases))
    return tuple(ranks)


def step_s(row: PublishedThroughput, efficiencies: Efficiencies, hfu: float, f: float) -> float:
    """The slowest pipeline rank's step with f."""
    return max(step + added_s(phases, f) for step, _, phases in terms(row, efficiencies, hfu))


def tokens_per_s(row: PublishedThroughput, efficiencies: Efficiencies, hfu: float, f: float) -> float:
    return terms(row, efficiencies, hfu)[0][1] / step_s(row, efficiencies, hfu, f)


@functools.lru_cache(maxsize=None)
def solve(row: PublishedThroughput, efficiencies: Efficiencies, f: float) -> float | None:
    """The HFU at which the step with f lasts the published one, as calibrate step solves it
    (None: refused, the published step shorter than the variant's at HFU 1)."""
    measured = published_step_s(row)
    fastest = step_s(row, efficiencies, 1.0, f)
    if measured < fastest * (1 - 1e-12):
        return None
    return bisect_hfu(lambda hfu: step_s(row, efficiencies, hfu, f), measured, fastest)


def within_spread(groups: Iterable[list[float]]) -> float | None:
    """Root-mean-square deviation of the logarithms of each group's HFUs from their group's mean,
    over every group of two or more (None: no such group)."""
    squares, count = 0.0, 0
    for hfus in groups:
        if len(hfus) < 2:
            continue
        logs = [math.log(hfu) for hfu in hfus]
        mean = sum(logs) / len(logs)
        squares += sum((value - mean) ** 2 for value in logs)
        count += len(logs)
    return math.sqrt(squares / count) if count else None


F_GRID = tuple(round(-0.5 + 0.05 * i, 2) for i in range(51))
"""The f tried first (-0.5 to 2, so a source that wants none shows it), then refined around the best."""


def argmin_f(spread) -> float | None:  # type: ignore[no-untyped-def]
    """The f in F_GRID's range at which ``spread(f)`` is least (the grid, then golden-section
    search within a grid step of its best point); None where the spread does not move with f."""
    values = {f: spread(f) for f in F_GRID}
    finite = [value for value in values.values() if value < math.inf]
    if not finite or max(finite) - min(finite) < 1e-9:
        return None
    best = min(values, key=lambda f: (values[f], abs(f)))
    step = F_GRID[1] - F_GRID[0]
    low, high = max(F_GRID[0], best - step), min(F_GRID[-1], best + step)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if spread(left) <= spread(right):
            high = right
        else:
            low = left
    middle = (low + high) / 2
    return middle if spread(middle) <= values[best] else best


def series_key(row: PublishedThroughput) -> tuple:  # type: ignore[type-arg]
    """What a row ran but its GPU count."""
    return (row.model, row.seq_len, row.micro_batch_size, row.grad_accum_steps, row.activation_checkpointing.value,
            row.strategy.value, row.tp, row.pp, row.compile, row.attention_implementation.value)


# A source's f is the one under which one HFU fits its rows best: the least spread of the HFUs
# calibrate step solves on them (within the source, or within each of its GPU-count series),
# the spread a one-row calibration's errors come from. An f under which calibrate step refuses a
# row it solves at f = 0 is ruled out (dropping the row would shrink the spread by losing it).
@functools.lru_cache(maxsize=None)
def source_f(source: str, efficiencies: Efficiencies, series: bool) -> float | None:
    """f solved on ``source``'s own rows: all of them (at least MIN_SOURCE_ROWS) or its GPU-count
    series; None where they cannot tell it."""
    members = source_rows(table())[source]
    if not series and len(members) < MIN_SOURCE_ROWS:
        return None
    groups: dict[tuple, list[PublishedThroughput]] = {}  # type: ignore[type-arg]
    for row in members:
        groups.setdefault(series_key(row) if series else (), []).append(row)
    if not any(len(group) >= 2 for group in groups.values()):
        return None

    usable = [[row for row in group if solve(row, efficiencies, 0.0) is not None] for group in groups.values()]

    def spread(f: float) -> float:
        hfus = [[solve(row, efficiencies, f) for row in group] for group in usable]
        if any(hfu is None for group in hfus for hfu in group):
            return math.inf  # an f under which a row the planner times is faster than HFU 1 allows
        return within_spread(hfus) or 0.0  # type: ignore[arg-type]

    return argmin_f(spread)


def fitted_f(held_out: str | None, efficiencies: Efficiencies, series: bool) -> dict[tuple[str, str], float]:
    """f per GPU generation x stack: the median of its sources' own f, ``held_out``'s left out, at least 0."""
    by_mechanism: dict[tuple[str, str], list[float]] = {}
    for source, members in source_rows(table()).items():
        f = None if source == held_out else source_f(source, efficiencies, series)
        if f is not None:
            by_mechanism.setdefault(mechanism_of(members[0]), []).append(f)
    return {mechanism: max(0.0, statistics.median(values)) for mechanism, values in by_mechanism.items()}


def f_of(variant: str, fits: dict[tuple[str, str], float], row: PublishedThroughput) -> float:
    if variant == "planner":
        return 0.0
    if variant == "contention":
        return CONTENTION
    return fits.get(mechanism_of(row), CONTENTION if variant.endswith("+contention") else 0.0)


def figures(variant: str) -> dict:  # type: ignore[type-arg]
    """|error| of every calibrated row and of every row at the fitted default, by source."""
    rows = table().rows
    calibrated: dict[str, list[float]] = {}
    default: dict[str, list[float]] = {}
    refused = 0
    for source, members in source_rows(table()).items():
        efficiencies = attention_efficiency_fit(table(), source)
        fits = fitted_f(source, efficiencies, "series" in variant) if variant.startswith("fitted") else {}
        implied = {row.name: hfu for row in rows
                   if (hfu := solve(row, efficiencies, f_of(variant, fits, row))) is not None}
        refused += sum(row.name not in implied for row in members)
        usable = [row for row in members if row.name in implied]
        if len(members) >= MIN_SOURCE_ROWS and usable:
            anchor = calibration_row(usable)
            calibrated[source_label(anchor)] = [
                abs(tokens_per_s(row, efficiencies,
                                 carried_calibration_hfu(implied[anchor.name], anchor, row, source, implied, rows),
                                 f_of(variant, fits, row))
                    / row.published_tokens_per_s_per_gpu - 1) for row in usable if row.name != anchor.name]
        default[source_label(members[0])] = [
            abs(tokens_per_s(row, efficiencies, kernel_mechanism_hfu(source, implied, rows, row), f_of(variant, fits, row))
                / row.published_tokens_per_s_per_gpu - 1) for row in members]
    return {"calibrated": calibrated, "default": default, "refused": refused}


SUMMARY = (
    ("llm-foundry H100, calibrated", "calibrated", "llm-foundry 'H100 80GB BF16' table"),
    ("llm-foundry H100 large-scale, calibrated", "calibrated", "llm-foundry 'H100 80GB BF16 (Large Scale, >= 128 GPUs)' table"),
    ("llm-foundry A100 80GB, calibrated", "calibrated", "llm-foundry 'A100 80GB with 1600 Gbps"),
    ("fms-fsdp A100, calibrated", "calibrated", "fms-fsdp 'Training Throughput tokens/sec/GPU A100 80G"),
    ("Megatron-LM H100, calibrated", "calibrated", "megatron-lm 'Training Speed and Scalability'"),
    ("Megatron-LM H100, held out", "default", "megatron-lm 'Training Speed and Scalability'"),
    ("fms-fsdp H100, held out", "default", "fms-fsdp 'Training throughput tokens/sec/GPU H100"),
    ("torchtitan 'Results' (H200), held out", "default", "torchtitan 'Results' table"),
    ("torchtune, held out", "default", "torchtune 'Optimization flags' table"),
)
"""The summary docs/validation.md quotes ("Mechanisms tried"): its name, figure and source label."""


def summary_lines(results: dict) -> list[str]:  # type: ignore[type-arg]
    """The summary table: every row, then the sources SUMMARY names (median / max |error|)."""
    def cell(errors: list[float]) -> str:
        return f"{statistics.median(errors):.1%} / {max(errors):.1%}".replace("%", "") + " %"

    lines = ["| | " + " | ".join(VARIANTS) + " |", "|---|" + "---:|" * len(VARIANTS)]
    for key, title in (("calibrated", "every calibrated row"), ("default", "fitted default, leave-one-source-out")):
        lines.append(f"| {title} | " + " | ".join(
            cell([e for errors in results[v][key].values() for e in errors]) for v in VARIANTS) + " |")
    for title, key, label in SUMMARY:
        found = [next(errors for name, errors in results[v][key].items() if name.startswith(label)) for v in VARIANTS]
        lines.append(f"| {title} | " + " | ".join(cell(errors) for errors in found) + " |")
    return lines


def _cell(errors: list[float], target: bool = False) -> str:
    meets = target and statistics.median(errors) <= TARGET_MEDIAN and max(errors) <= TARGET_MAX
    return f"{statistics.median(errors):.1%} / {max(errors):.1%}{' (meets)' if meets else ''}"


def main() -> int:
    every = attention_efficiency_fit(table())
    print("f each source solves on its own rows (in sample, never scored; each figure below is at the f fitted "
          "without its source):")
    print()
    print("| source | GPU generation x stack | rows | f, all its rows | f, its GPU-count series |")
    print("|---|---|---:|---:|---:|")
    for source, members in source_rows(table()).items():
        generation, stack = mechanism_of(members[0])
        cells = ["-" if f is None else f"{f:+.3f}" for f in (source_f(source, every, False), source_f(source, every, True))]
        print(f"| {source_label(members[0])[:70]} | {generation} x {stack} | {len(members)} | {' | '.join(cells)} |")
    print()
    for series in (False, True):
        print(f"f per GPU generation x stack, fitted on every source{' (GPU-count series)' if series else ''} (in sample): "
              + ", ".join(f"{g} x {s} {f:.3f}" for (g, s), f in sorted(fitted_f(None, every, series).items())))
    results = {variant: figures(variant) for variant in VARIANTS}
    print()
    print("Calibrated on one row per source (median / max |error|; 'meets': median <= 5 %, max <= 15 %):")
    print()
    print("| source | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for label in results["planner"]["calibrated"]:
        print(f"| {label[:70]} | " + " | ".join(_cell(results[v]["calibrated"][label], True) for v in VARIANTS) + " |")
    for key, title in (("calibrated", "every calibrated row"), ("default", "fitted default, leave-one-source-out")):
        print(f"| {title} | " + " | ".join(
            _cell([e for errors in results[v][key].values() for e in errors]) for v in VARIANTS) + " |")
    print()
    print("Uncalibrated: the fitted default leave-one-source-out, by source (median / max |error|):")
    print()
    print("| source | rows | " + " | ".join(VARIANTS) + " |")
    print("|---|---:|" + "---:|" * len(VARIANTS))
    for label, errors in results["planner"]["default"].items():
        print(f"| {label[:70]} | {len(errors)} | " + " | ".join(_cell(results[v]["default"][label]) for v in VARIANTS) + " |")
    print()
    print("Summary (docs/validation.md, 'Mechanisms tried'):")
    print()
    print("\n".join(summary_lines(results)))
    print()
    print("Rows calibrate step refuses under each (their source's held-out fit): "
          + ", ".join(f"{v} {results[v]['refused']}" for v in VARIANTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
