"""Score zeroplan against published real-GPU peak-memory measurements.

Loads benchmarks/published_memory/rows.csv (one row per published figure; the columns are
described in benchmarks/published_memory/README.md), builds for each row the PlanRequest the
command line would (zeroplan.cli.fit.request_from_args on `zeroplan fit` flags), plans the
row's strategy and compares the predicted figure that matches the row's metric:

- allocated (torch.cuda.max_memory_allocated, or the "active" peak) and tool-peak (a tool's
  unlabelled "peak memory"): MemoryBreakdown.allocated_peak_bytes;
- reserved (torch.cuda.max_memory_reserved): reserved_peak_bytes from the caching-allocator
  model (the default; peak_bytes where the model gives none);
- nvidia-smi: the reserved figure plus the cluster's CUDA context (512 MiB by default) and,
  for multi-GPU runs under a framework profile, NCCL's buffers.

Each row is planned with zeroplan's default settings (the allocator model, not
--flat-reserve), and the OOM verdict is `fits` of that plan. Nothing is tuned: the figures
are printed as they come. Usage:

    python benchmarks/published_memory_accuracy.py [--rows PATH] [--csv OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.cli.fit import check_options_apply, request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.feasibility import usable_memory_bytes  # noqa: E402
from zeroplan.core.margin import error_band as error_band_of, is_borderline, margin_words  # noqa: E402
from zeroplan.core.model_load import load_fits_gpu  # noqa: E402
from zeroplan.core.plan import host_memory_fits, pipeline_rank_breakdowns, rank_host_bytes  # noqa: E402
from zeroplan.errors import ZeroplanError  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

ROWS = ROOT / "benchmarks" / "published_memory" / "rows.csv"
GIB = 2**30


def load_rows(path: Path = ROWS) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def argv_of(row: dict[str, str]) -> list[str]:
    """The `zeroplan fit` flags a row describes."""
    argv = [
        "fit", row["model"], "--gpus", row["num_gpus"], "--gpu", row["gpu"], "--gpus-per-node", row["gpus_per_node"],
        "--micro-batch", row["micro_batch"], "--seq-len", row["seq_len"], "--grad-accum", row["grad_accum"],
        "--activation-checkpointing", row["activation_checkpointing"], "--precision", row["precision"],
        "--framework", row["framework"], "--tp", row["tp"], "--pp", row["pp"], "--cp", row["cp"],
    ]
    if row["gpu_memory_gib"]:
        argv += ["--gpu-memory-gib", row["gpu_memory_gib"]]
    if int(row["lora_rank"] or 0):
        argv += ["--lora-rank", row["lora_rank"]]
    if row["quantize"] not in ("", "none"):
        argv += ["--quantize", row["quantize"]]
    if row["dora"] == "yes":
        argv += ["--dora"]
    return argv + shlex.split(row["extra_flags"])


# The command line's parser, built once: parsing leaves it as it was, and building it (every
# subcommand's options) took a fifth of the script's time, once per row.
@functools.lru_cache(maxsize=1)
def fit_parser() -> argparse.ArgumentParser:
    return build_parser()


def predict(row: dict[str, str]) -> dict[str, object]:
    """Plan one row: predicted allocated/reserved bytes, the figure matching its metric and
    the verdict; or the one-line reason it cannot be planned."""
    if row["expressible"].startswith("no"):
        return {"error": row["expressible"].removeprefix("no:").strip()}
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = fit_parser().parse_args(argv_of(row))
        check_options_apply(args)
        request = request_from_args(args, StrategyKind(row["strategy"]))
        ranks = pipeline_rank_breakdowns(request)
    except ZeroplanError as error:
        return {"error": str(error)}
    except SystemExit:
        return {"error": stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else "argument error"}
    breakdown, states = max(ranks, key=lambda rank: rank[0].peak_bytes)
    reserved = _reserved(breakdown)
    usable = usable_memory_bytes(request)
    context = request.cluster.gpu.memory_bytes - usable  # CUDA context, and NCCL buffers where modelled
    metric = row["metric"]
    figure = {
        "allocated": breakdown.allocated_peak_bytes,
        "tool-peak": breakdown.allocated_peak_bytes,
        "reserved": reserved,
        "nvidia-smi": reserved + context,
    }[metric]
    return {
        "allocated": breakdown.allocated_peak_bytes, "reserved": reserved, "predicted": figure,
        # The moment of the step the allocated peak is at (benchmarks/published_memory_slopes.py
        # compares two rows' figures as one slope only where it is the same).
        "moment": breakdown.peak_moment.value,
        # Each GPU's figure of the row's metric (a pipeline's or a device map's ranks, rank 0 first).
        "per_gpu": [_reserved(b) + (context if metric == "nvidia-smi" else 0) if metric in ("reserved", "nvidia-smi")
                    else b.allocated_peak_bytes for b, _ in ranks],
        # fit's verdict: the step on the GPU, the whole module moved there at load where the row's
        # load does that (zeroplan.core.model_load), and the node's host RAM where the row gives it.
        "fits": (breakdown.peak_bytes <= usable and load_fits_gpu(request, usable)
                 and host_memory_fits(request, rank_host_bytes(request, states)) is not False),
        # A fit the loop's gradients and states, made inside an epoch of varying lengths, may
        # turn (zeroplan.allocator.lazy_states): borderline in the verdict.
        "split_segment": breakdown.lazy_state_segment_bytes,
        # What fit's verdict says beside it where the measured error could turn it (core.margin;
        # the caching allocator's turn within the band is not scanned here).
        "margin": _margin(breakdown, usable, request.batch.varying_lengths is not None),
    }


def _reserved(breakdown) -> int:
    """The reserved peak: the allocator model's, or the flat reserve's peak where it gives none."""
    return breakdown.reserved_peak_bytes if breakdown.reserved_peak_bytes is not None else breakdown.peak_bytes


def published_per_gpu(row: dict[str, str]) -> list[float]:
    """Each GPU's published figure in GiB where the row's notes quote them ('published per GPU
    a+b GiB'; the row's own figure is the larger); empty elsewhere."""
    if "published per GPU " not in row["notes"]:
        return []
    return [float(x) for x in row["notes"].split("published per GPU ")[1].split(" GiB")[0].split("+")]


def _margin(breakdown, usable: int, varying_lengths: bool) -> str:
    """core.margin's words for the verdict where it is borderline, else ''."""
    band = error_band_of(varying_lengths)
    fits = breakdown.peak_bytes <= usable
    if not is_borderline(breakdown.peak_bytes, usable, band, breakdown.lazy_state_segment_bytes,
                         breakdown.allocated_peak_bytes):
        return ""
    return margin_words(breakdown.peak_bytes, usable, band, None, fits, breakdown.lazy_state_segment_bytes,
                        breakdown.allocated_peak_bytes)


def _short(words: str) -> str:
    """The margin's words up to their first reason's detail."""
    return words.split(" (")[0].split(",")[0]


def feature_of(row: dict[str, str]) -> str:
    if row["quantize"] not in ("", "none"):
        return "qlora" + ("+dora" if row["dora"] == "yes" else "")
    if int(row["lora_rank"] or 0):
        return "lora" + ("+dora" if row["dora"] == "yes" else "")
    return "full"


def parallelism_of(row: dict[str, str]) -> str:
    parts = []
    if int(row["num_gpus"]) == 1:
        parts.append("1-gpu")
    elif "--device-map" in row["extra_flags"]:
        # One process over the GPUs, no data parallelism (zeroplan.core.parallel.device_map).
        parts.append("device-map")
    else:
        parts.append(row["strategy"])
    for axis in ("tp", "pp", "cp"):
        if int(row[axis]) > 1:
            parts.append(axis)
    return "+".join(parts)


def median(values: list[float]) -> str:
    return f"{statistics.median(values):+.1f}" if values else "-"


def summary(title: str, groups: dict[str, list[float]]) -> None:
    print(f"\n{title}")
    print(f"  {'group':32s} {'n':>3s} {'median |err| %':>15s} {'median err %':>13s}")
    for key in sorted(groups):
        errors = groups[key]
        abs_median = f"{statistics.median([abs(e) for e in errors]):.1f}"
        print(f"  {key:32s} {len(errors):3d} {abs_median:>15s} {median(errors):>13s}")


def error_band(out_rows: list[dict], varying_lengths: bool | None, metric: str = "reserved") -> tuple[float, float, int]:
    """The quartiles of measured / predicted over the compared rows whose metric is ``metric``
    (the reserved peak: what the allocator model's verdict rests on), of runs planned with
    --varying-lengths or of runs without (None: both), and how many rows they are over."""
    ratios = [row["measured_gib"] / row["predicted_gib"] for row in out_rows
              if row["metric"] == metric and row["error_pct"] != ""
              and (varying_lengths is None or row["varying_lengths"] == varying_lengths)]
    quartiles = statistics.quantiles(ratios, n=4)
    return round(quartiles[0], 3), round(quartiles[2], 3), len(ratios)


def rows_from_the_repository(options: argparse.Namespace) -> list[dict[str, str]]:
    """The rows of ``options.rows``, read from the repository's root (the rows name their config
    files, models and DeepSpeed configs, relative to it; ``options.csv`` made absolute first)."""
    rows = load_rows(options.rows.resolve())
    if getattr(options, "csv", None) is not None:
        options.csv = options.csv.resolve()
    os.chdir(ROOT)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument("--csv", type=Path, help="also write the per-row results here")
    options = parser.parse_args(argv)
    rows = rows_from_the_repository(options)
    started = time.perf_counter()
    results = []
    for row in rows:
        result = predict(row)
        results.append((row, result))
    elapsed = time.perf_counter() - started

    print(f"{'id':40s} {'metric':10s} {'measured':>9s} {'predicted':>9s} {'err %':>7s} {'outcome':>9s} {'fits':>5s}  (GiB)")
    by = {name: defaultdict(list) for name in ("stack", "metric", "feature", "parallelism", "grade")}
    agree = disagree = 0
    unexpressed = []
    out_rows = []
    for row, result in results:
        if "error" in result:
            unexpressed.append((row["id"], result["error"]))
            continue
        measured = float(row["measured_value"]) * float(row["unit_bytes"]) if row["measured_value"] else None
        error = None
        if measured is not None and row["outcome"] == "completed":
            error = 100.0 * (result["predicted"] - measured) / measured
            for name, key in (("stack", row["stack"]), ("metric", row["metric"]), ("feature", feature_of(row)),
                              ("parallelism", parallelism_of(row)), ("grade", row["grade"])):
                by[name][key].append(error)
        predicted_ok = result["fits"] == (row["outcome"] == "completed")
        agree += predicted_ok
        disagree += not predicted_ok
        print(f"{row['id']:40s} {row['metric']:10s} "
              f"{(measured / GIB if measured is not None else float('nan')):9.2f} {result['predicted'] / GIB:9.2f} "
              f"{(f'{error:+.1f}' if error is not None else '-'):>7s} {row['outcome']:>9s} {('yes' if result['fits'] else 'no'):>5s}"
              f"{'' if predicted_ok else '  <- outcome disagrees'}"
              f"{'  (' + _short(result['margin']) + ')' if result['margin'] else ''}")
        out_rows.append({"id": row["id"], "stack": row["stack"], "metric": row["metric"],
                         "measured_gib": measured / GIB if measured is not None else "",
                         "predicted_gib": result["predicted"] / GIB, "allocated_gib": result["allocated"] / GIB,
                         "reserved_gib": result["reserved"] / GIB, "error_pct": error if error is not None else "",
                         "outcome": row["outcome"], "fits": result["fits"],
                         "varying_lengths": "--varying-lengths" in row["extra_flags"]})

    every = [e for errors in by["stack"].values() for e in errors]
    print(f"\nrows: {len(rows)}; planned: {len(rows) - len(unexpressed)}; compared (completed, with a figure): {len(every)}; "
          f"not expressible: {len(unexpressed)}; planning took {elapsed:.1f} s")
    if every:
        print(f"all compared rows: median |error| {statistics.median([abs(e) for e in every]):.1f} %, "
              f"median signed error {statistics.median(every):+.1f} % (positive: zeroplan predicts more)")
    low, high, count = error_band(out_rows, varying_lengths=False)
    print(f"error band (quartiles of measured / predicted over the {count} rows reporting the reserved peak, "
          f"one length a run, zeroplan.core.margin.PEAK_ERROR_BAND): {low:.3f} to {high:.3f}")
    low, high, count = error_band(out_rows, varying_lengths=True)
    print(f"error band (quartiles of measured / predicted over the {count} rows reporting the reserved peak, "
          f"planned with --varying-lengths, zeroplan.core.margin.VARYING_LENGTHS_PEAK_ERROR_BAND): {low:.3f} to {high:.3f}")
    low, high, count = error_band(out_rows, varying_lengths=None, metric="allocated")
    print(f"error band (quartiles of measured / predicted over the {count} rows reporting the allocated peak, "
          f"zeroplan.core.margin.ALLOCATED_PEAK_ERROR_BAND): {low:.3f} to {high:.3f}")
    summary("by stack", by["stack"])
    summary("by metric (allocated and tool-peak against the allocated peak; reserved against the allocator model's reserved peak)", by["metric"])
    summary("by feature", by["feature"])
    summary("by parallelism", by["parallelism"])
    summary("by grade", by["grade"])
    print(f"\nfits/OOM outcome agreement: {agree} of {agree + disagree} planned rows"
          f" (OOM rows: {sum(1 for r, res in results if 'error' not in res and r['outcome'] == 'oom')})")
    borderline = [(r["id"], res["fits"] == (r["outcome"] == "completed")) for r, res in results
                  if "error" not in res and res["margin"]]
    print(f"borderline verdicts (core.margin): {len(borderline)}, of which the published outcome disagrees: "
          f"{sum(not ok for _, ok in borderline)}")
    split = [r["id"] for r, res in results if "error" not in res and res["split_segment"]]
    print(f"fits borderline by the gradients and optimizer states made inside the epoch (zeroplan.allocator.lazy_states): "
          f"{len(split)}{' (' + ', '.join(split) + ')' if split else ''}")
    print("\nper GPU, where a row's notes quote each GPU's published figure (the row scores the larger):")
    for row, result in results:
        published = published_per_gpu(row)
        if "error" in result or not published:
            continue
        print(f"  {row['id']:40s} " + "; ".join(
            f"GPU {rank} {measured:.2f} vs {predicted / GIB:.2f} ({100 * (predicted / GIB - measured) / measured:+.1f} %)"
            for rank, (measured, predicted) in enumerate(zip(published, result["per_gpu"]))))
    print(f"\nnot expressible ({len(unexpressed)}):")
    reasons = defaultdict(list)
    for row_id, reason in unexpressed:
        reasons[reason].append(row_id)
    for reason, ids in sorted(reasons.items(), key=lambda item: -len(item[1])):
        print(f"  {len(ids):3d}  {reason}  [{', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}]")
    if options.csv:
        with open(options.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(out_rows[0]))
            writer.writeheader()
            writer.writerows(out_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
