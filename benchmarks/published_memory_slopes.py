"""Score zeroplan's slopes against published GPU measurements: what one more sample (or 1k more
tokens) adds to the peak, measured against predicted.

A level-only score (benchmarks/published_memory_accuracy.py) can hide a wrong per-sample term
behind a right constant. Here every pair of rows of benchmarks/published_memory/rows.csv that
describe the same run except for the micro-batch size, or except for the sequence length, gives
a measured slope and zeroplan's slope of the same figure:

- the pair's rows have one stack, one source and one metric, both completed with a figure, and
  their `zeroplan fit` command lines, parsed by the command line's own parser from
  published_memory_accuracy.argv_of (so the flags column is compared as parsed options, not as
  text), differ in `micro_batch` alone, or in `seq_len` alone, with the same strategy;
- a sweep of the micro-batch at a fixed global batch (micro_batch x grad_accum the same, both
  accumulating: ms-swift's and BigScience's tables) is paired too, on its own axis
  ("micro_batch at fixed global batch"), since its rows differ in grad_accum as well;
- of rows that repeat another row's whole configuration and figure (a table quoting another's
  run) the first is kept;
- where a configuration was published at more than two values, consecutive values are paired
  (each slope is then a separate interval; --all-pairs pairs every two values).

Where the predicted allocated peak is at another moment of the step at the two rows (the loss's
backward at one, a block's at the other), the predicted slope is a switch between moments, not
one term's growth: such pairs are marked, and each summary gives the median over the others too.

The slope is GiB per extra sample (micro-batch pairs) or GiB per 1k extra tokens of the
micro-batch (micro_batch x seq_len; sequence pairs), the ratio predicted / measured (above 1:
zeroplan adds more per sample than the run did). Predictions come from
published_memory_accuracy.predict (the figure matching the row's metric, and the allocated peak
beside it); nothing is planned here by any other route. Usage:

    python benchmarks/published_memory_slopes.py [--rows PATH] [--all-pairs] [--csv OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (ROOT, ROOT / "benchmarks"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from published_memory_accuracy import (  # noqa: E402
    ROWS, argv_of, feature_of, fit_parser, predict, rows_from_the_repository,
)

GIB = 2**30
AXES = ("micro_batch", "micro_batch@global", "seq_len")
"""The pairing axes: the micro-batch alone, the micro-batch with grad_accum at a fixed global
batch (both rows accumulating), and the sequence length alone."""
# The row fields that describe the run outside its `fit` command line: a pair shares them.
SHARED_FIELDS = ("stack", "source", "strategy", "metric")


def parsed_options(row: dict[str, str]) -> dict[str, object] | None:
    """The row's `zeroplan fit` options as the command line's parser reads them; None where the
    row is not expressible or its flags do not parse."""
    if row["expressible"].startswith("no"):
        return None
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return dict(vars(fit_parser().parse_args(argv_of(row))))
    except SystemExit:
        return None


def _hashable(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, set):
        return tuple(sorted(map(repr, value)))
    return value


def config_key(row: dict[str, str], options: dict[str, object], axis: str) -> tuple | None:
    """What two rows must share to be paired along ``axis``: every parsed option but those the
    axis varies, and the shared row fields (with the global batch at a fixed global batch);
    None where the row does not take part in that axis."""
    varied = {"micro_batch": {"micro_batch"}, "micro_batch@global": {"micro_batch", "grad_accum"},
              "seq_len": {"seq_len"}}[axis]
    shared = tuple(row[field] for field in SHARED_FIELDS)
    if axis == "micro_batch@global":
        if options["grad_accum"] <= 1:
            return None
        shared += (options["micro_batch"] * options["grad_accum"],)
    return (shared, tuple(sorted((name, _hashable(value)) for name, value in options.items() if name not in varied)))


def axis_field(axis: str) -> str:
    """The row field an axis steps along."""
    return "seq_len" if axis == "seq_len" else "micro_batch"


def measured_bytes(row: dict[str, str]) -> float | None:
    if row["outcome"] != "completed" or not row["measured_value"]:
        return None
    return float(row["measured_value"]) * float(row["unit_bytes"])


@dataclass(frozen=True)
class Pair:
    axis: str
    low: dict[str, str]
    high: dict[str, str]

    @property
    def step(self) -> float:
        """The pair's step in the axis's unit: samples, or 1k tokens of the micro-batch."""
        field = axis_field(self.axis)
        low, high = int(self.low[field]), int(self.high[field])
        if field == "micro_batch":
            return float(high - low)
        return int(self.low["micro_batch"]) * (high - low) / 1000.0


def find_pairs(rows: list[dict[str, str]], all_pairs: bool = False) -> list[Pair]:
    """Every pair of rows describing one run but for micro_batch, or but for seq_len (module
    docstring); consecutive values unless ``all_pairs``."""
    parsed = [(row, parsed_options(row)) for row in rows]
    usable = [(row, options) for row, options in parsed if options is not None and measured_bytes(row) is not None]
    pairs = []
    for axis in AXES:
        groups: dict[tuple, list[dict[str, str]]] = defaultdict(list)
        for row, options in usable:
            key = config_key(row, options, axis)
            if key is not None:
                groups[key].append(row)
        for members in groups.values():
            by_value: dict[int, dict[str, str]] = {}
            for row in members:
                # A repeat of the same configuration at the same value: the first row stands
                # for it (a table quoting another's figure is one measurement).
                by_value.setdefault(int(row[axis_field(axis)]), row)
            values = sorted(by_value)
            if all_pairs:
                spans = [(a, b) for i, a in enumerate(values) for b in values[i + 1:]]
            else:
                spans = list(zip(values, values[1:]))
            pairs += [Pair(axis, by_value[a], by_value[b]) for a, b in spans]
    return pairs


@dataclass(frozen=True)
class Slope:
    pair: Pair
    measured_gib: float
    predicted_gib: float
    predicted_allocated_gib: float
    moments: tuple[str, str]
    """The predicted allocated peak's moment at the low and the high row."""

    @property
    def same_moment(self) -> bool:
        """Whether both predicted peaks are at one moment of the step: only then is the
        predicted slope one term's growth rather than a switch between moments."""
        return self.moments[0] == self.moments[1]

    @property
    def ratio(self) -> float | None:
        """predicted / measured slope; None where the measured slope is not positive."""
        return self.predicted_gib / self.measured_gib if self.measured_gib > 0 else None


def slopes_of(pairs: list[Pair]) -> tuple[list[Slope], list[tuple[Pair, str]]]:
    """Each pair's measured and predicted slopes, and the pairs a row of which did not plan."""
    cache: dict[str, dict[str, object]] = {}

    def planned(row: dict[str, str]) -> dict[str, object]:
        if row["id"] not in cache:
            cache[row["id"]] = predict(row)
        return cache[row["id"]]

    out, failed = [], []
    for pair in pairs:
        low, high = planned(pair.low), planned(pair.high)
        if "error" in low or "error" in high:
            failed.append((pair, str(low.get("error") or high.get("error"))))
            continue
        step = pair.step
        out.append(Slope(
            pair,
            (measured_bytes(pair.high) - measured_bytes(pair.low)) / step / GIB,
            (high["predicted"] - low["predicted"]) / step / GIB,
            (high["allocated"] - low["allocated"]) / step / GIB,
            (str(low["moment"]), str(high["moment"])),
        ))
    return out, failed


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def summarise(title: str, slopes: list[Slope], key) -> None:
    groups: dict[str, list[Slope]] = defaultdict(list)
    for slope in slopes:
        groups[key(slope)].append(slope)
    print(f"\n{title}")
    print(f"  {'group':52s} {'pairs':>5s} {'median ratio':>12s} {'min':>6s} {'max':>6s}"
          f" {'median meas':>11s} {'median pred':>11s} {'same-moment pairs':>17s} {'their median':>12s}")
    for name in sorted(groups):
        members = groups[name]
        ratios = [s.ratio for s in members if s.ratio is not None]
        same = [s.ratio for s in members if s.ratio is not None and s.same_moment]
        print(f"  {name:52s} {len(members):5d} {_median(ratios):>12s}"
              f" {(f'{min(ratios):.2f}' if ratios else '-'):>6s} {(f'{max(ratios):.2f}' if ratios else '-'):>6s}"
              f" {_median([s.measured_gib for s in members]):>11s} {_median([s.predicted_gib for s in members]):>11s}"
              f" {len(same):17d} {_median(same):>12s}")


def unit_of(axis: str) -> str:
    return "GiB/1k tok" if axis == "seq_len" else "GiB/sample"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument("--all-pairs", action="store_true", help="pair every two values, not consecutive ones")
    parser.add_argument("--csv", type=Path, help="also write the per-pair slopes here")
    options = parser.parse_args(argv)
    rows = rows_from_the_repository(options)
    slopes, failed = slopes_of(find_pairs(rows, options.all_pairs))

    print(f"{'low row':44s} {'high row':44s} {'metric':10s} {'unit':10s} {'meas':>7s} {'pred':>7s}"
          f" {'ratio':>6s} {'pred alloc':>10s}  predicted peak moment")
    for s in slopes:
        print(f"{s.pair.low['id']:44s} {s.pair.high['id']:44s} {s.pair.low['metric']:10s} {unit_of(s.pair.axis):10s}"
              f" {s.measured_gib:7.3f} {s.predicted_gib:7.3f} {(f'{s.ratio:.2f}' if s.ratio is not None else '-'):>6s}"
              f" {s.predicted_allocated_gib:10.3f}  {s.moments[0] if s.same_moment else ' -> '.join(s.moments)}")
    with_ratio = [s for s in slopes if s.ratio is not None]
    print(f"\npairs: {len(slopes)} planned ({sum(s.pair.axis == 'micro_batch' for s in slopes)} in micro-batch,"
          f" {sum(s.pair.axis == 'micro_batch@global' for s in slopes)} in micro-batch at a fixed global batch,"
          f" {sum(s.pair.axis == 'seq_len' for s in slopes)} in sequence length), {len(slopes) - len(with_ratio)}"
          f" without a positive measured slope (no ratio), {len(failed)} with a row that does not plan")
    if with_ratio:
        same = [s.ratio for s in with_ratio if s.same_moment]
        print(f"all pairs: median ratio predicted / measured slope {statistics.median(s.ratio for s in with_ratio):.3f};"
              f" over the {len(same)} whose predicted peak is at one moment at both rows: {_median(same)}")
    axis_name = {"micro_batch": "per sample", "micro_batch@global": "per sample, fixed global batch",
                 "seq_len": "per 1k tokens"}
    summarise("by axis and metric (the allocated peak's slope is the planner's terms alone; the reserved and"
              " nvidia-smi ones add the caching allocator's)", slopes,
              lambda s: f"{axis_name[s.pair.axis]} {s.pair.low['metric']}")
    summarise("by axis and stack", slopes, lambda s: f"{axis_name[s.pair.axis]} {s.pair.low['stack']}")
    summarise("by axis and feature", slopes, lambda s: f"{axis_name[s.pair.axis]} {feature_of(s.pair.low)}")
    summarise("by feature, per sample (both micro-batch axes)", [s for s in slopes if s.pair.axis != "seq_len"],
              lambda s: feature_of(s.pair.low))
    summarise("by axis, stack, feature and metric", slopes,
              lambda s: f"{axis_name[s.pair.axis]} {s.pair.low['stack']} {feature_of(s.pair.low)} {s.pair.low['metric']}")
    allocated = [s for s in slopes if s.pair.low["metric"] == "allocated"]
    summarise("allocated peak alone (pairs whose metric is the allocated peak), by axis, stack and feature", allocated,
              lambda s: f"{axis_name[s.pair.axis]} {s.pair.low['stack']} {feature_of(s.pair.low)}")
    if failed:
        print("\npairs with a row that does not plan:")
        for pair, error in failed:
            print(f"  {pair.low['id']} / {pair.high['id']}: {error[:100]}")
    if options.csv:
        with open(options.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["low_id", "high_id", "axis", "stack", "feature", "metric", "step",
                             "measured_slope_gib", "predicted_slope_gib", "ratio", "predicted_allocated_slope_gib",
                             "low_moment", "high_moment"])
            for s in slopes:
                writer.writerow([s.pair.low["id"], s.pair.high["id"], s.pair.axis, s.pair.low["stack"],
                                 feature_of(s.pair.low), s.pair.low["metric"], s.pair.step, s.measured_gib,
                                 s.predicted_gib, "" if s.ratio is None else s.ratio, s.predicted_allocated_gib,
                                 *s.moments])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
