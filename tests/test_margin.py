"""The verdict's margin: the error band comes from the published runs (recomputed here from
benchmarks/published_memory/rows.csv, so it moves with the model and the data), and a
prediction whose range under it straddles the usable memory is called borderline."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from zeroplan.core.margin import (
    ALLOCATED_PEAK_ERROR_BAND, PEAK_ERROR_BAND, VARYING_LENGTHS_PEAK_ERROR_BAND, PeakErrorBand, borderline_words, error_band, is_borderline,
    peak_range_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import published_memory_accuracy  # noqa: E402

VALIDATION_DOC = Path(__file__).resolve().parents[1] / "docs" / "validation.md"


def test_the_band_is_what_the_published_runs_give_today() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        published_memory_accuracy.main([])
    for name, band in (("PEAK_ERROR_BAND", PEAK_ERROR_BAND), ("VARYING_LENGTHS_PEAK_ERROR_BAND", VARYING_LENGTHS_PEAK_ERROR_BAND),
                       ("ALLOCATED_PEAK_ERROR_BAND", ALLOCATED_PEAK_ERROR_BAND)):
        found = re.search(r"error band \(quartiles of measured / predicted over the (\d+) rows [^\n]*zeroplan\.core\.margin\."
                          + name + r"\): ([\d.]+) to ([\d.]+)", printed.getvalue())
        assert found, f"the accuracy script no longer prints its error band {name}"
        assert (int(found[1]), float(found[2]), float(found[3])) == (band.rows, band.low, band.high), (
            f"update zeroplan/core/margin.py {name} (and docs/validation.md) to what "
            "benchmarks/published_memory_accuracy.py prints")
    overall = re.search(r"compared \(completed, with a figure\): (\d+);.*\n.*median \|error\| ([\d.]+) %, "
                        r"median signed error ([+-][\d.]+) %", printed.getvalue())
    assert overall, "the accuracy script no longer prints its overall medians"
    row = f"| all compared | {overall[1]} | {overall[2]} % | {overall[3]} % |"
    assert row in VALIDATION_DOC.read_text(), f"docs/validation.md, 'Published peaks': rerun the script and update to {row}"


def test_borderline_is_the_usable_memory_inside_the_peaks_range() -> None:
    gib = 2**30
    low, high = peak_range_bytes(100 * gib)
    assert (low, high) == (int(100 * gib * PEAK_ERROR_BAND.low), int(100 * gib * PEAK_ERROR_BAND.high))
    assert is_borderline(100 * gib, high) and not is_borderline(100 * gib, high + 1)
    # A predicted OOM turns only where the range reaches below the usable memory.
    assert is_borderline(100 * gib, low) if low < 100 * gib else not is_borderline(100 * gib, 100 * gib - 1)


def test_a_fit_whose_whole_range_is_past_the_usable_memory_is_borderline() -> None:
    # Measured peaks above every prediction (low > 1): a plan at 99.9 % of usable fits as predicted,
    # and the middle half of published runs would not; it is no fit with room.
    gib = 2**30
    band = PeakErrorBand(low=1.01, high=1.24, rows=3)
    assert is_borderline(int(99.9 * gib), 100 * gib, band)
    assert is_borderline(int(81 * gib), 100 * gib, band) and not is_borderline(int(80 * gib), 100 * gib, band)
    # Predicted not to fit, and every run of the middle half peaked higher still: not borderline.
    assert not is_borderline(int(100.5 * gib), 100 * gib, band)
    band_below = PeakErrorBand(low=0.99, high=1.07, rows=3)
    assert is_borderline(int(100.5 * gib), 100 * gib, band_below) and is_borderline(int(99 * gib), 100 * gib, band_below)
    assert borderline_words(100 * gib, 100 * gib) == (
        f"borderline: {100 * PEAK_ERROR_BAND.low:.0f}-{100 * PEAK_ERROR_BAND.high:.0f} % of usable")


def test_a_borderline_recommendation_says_so(zeroplan_cli) -> None:
    # torchtitan's 8B at 2 x 10,752 tokens on 8 H100s, selective per-op recomputation:
    # shard-grad-op peaks at 76.9 of 78.7 GiB usable, full sharding with room below the band.
    flags = ("fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "torchtitan",
             "--seq-len", "10752", "--micro-batch", "2", "--activation-checkpointing", "selective-op",
             "--strategies", "fsdp-shard-grad-op,fsdp-full-shard")
    for view in ((), ("--detail",)):
        code, out, err = zeroplan_cli(*flags, *view)
        assert code == 0, err
        rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("fsdp-")}
        assert "yes*" in rows["fsdp-shard-grad-op"] and "yes" in rows["fsdp-full-shard"]
    # The detail view's verdict line, and the first screen's opening sentences.
    verdict = next(line for line in out.splitlines() if line.startswith("Verdict:"))
    assert re.search(r"Recommended: fsdp-shard-grad-op .*; borderline: \d+-\d+ % of usable for the middle half of published runs", verdict)
    code, out, _ = zeroplan_cli(*flags)
    opening = " ".join(out.split("\n\n")[0].split())
    assert re.search(r"^Fits\. Recommended: fsdp-shard-grad-op .* But borderline: \d+-\d+ % of usable for the middle half "
                     r"of published runs: it may not; fsdp-full-shard fits with room\.", opening), opening


def test_a_run_of_varying_lengths_is_judged_by_the_band_of_such_runs(monkeypatch) -> None:
    # Published runs of varying-length batches peak further below the expectation they are planned
    # at than runs of one length (their band's quartiles lie lower): each plan is judged by its own.
    import zeroplan.core.plan as planner
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.specs.strategy import StrategyKind

    bands = []
    monkeypatch.setattr(planner, "is_borderline", lambda peak, usable, band, *rest: bands.append(band) or False)
    for extra in ((), ("--varying-lengths", "3234.4,2547.5,91,4959")):
        args = build_parser().parse_args(["fit", "qwen2.5-0.5b", "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "2048",
                                          "--precision", "bf16-pure", "--framework", "hf", *extra])
        planner.plan(request_from_args(args, StrategyKind.ddp), largest_micro_batch=False, timed=False)
    assert bands == [PEAK_ERROR_BAND, VARYING_LENGTHS_PEAK_ERROR_BAND]
    assert VARYING_LENGTHS_PEAK_ERROR_BAND.low < PEAK_ERROR_BAND.low
    assert VARYING_LENGTHS_PEAK_ERROR_BAND.high < PEAK_ERROR_BAND.high
    # 5 % over the usable memory: within reach of the varying-length band only.
    gib = 2**30
    assert is_borderline(105 * gib, 100 * gib, error_band(True)) and not is_borderline(105 * gib, 100 * gib, error_band(False))


def test_a_fit_whose_allocated_peak_alone_may_reach_the_usable_memory_is_borderline() -> None:
    # A run of varying lengths whose reserve the planner over-predicts (its band lies lower) is
    # not safe where its allocated step alone, at the allocated peaks' measured error, reaches the
    # usable memory (ms-swift's Qwen-72B over two GPUs at 4096 tokens ran out at 99 % allocated).
    gib = 2**30
    band = VARYING_LENGTHS_PEAK_ERROR_BAND
    usable = 100 * gib
    # A fit whose reserve's band stops short of the usable memory.
    peak = int(usable / band.high) - 1
    reaches = int(usable / ALLOCATED_PEAK_ERROR_BAND.high) + 1
    assert not is_borderline(peak, usable, band)
    assert is_borderline(peak, usable, band, allocated_peak_bytes=reaches)
    assert not is_borderline(peak, usable, band, allocated_peak_bytes=reaches - 2)
    # Over the usable memory the verdict is a predicted OOM: the allocated peak's reach adds nothing.
    assert is_borderline(101 * gib, usable, band, allocated_peak_bytes=reaches) == is_borderline(101 * gib, usable, band)
    low = int(reaches * ALLOCATED_PEAK_ERROR_BAND.low)
    assert borderline_words(peak, usable, band, allocated_peak_bytes=reaches) == (
        f"borderline: the allocated peak alone at {100 * low / usable:.0f}-100 % of usable")


def test_no_published_run_that_completed_is_called_out_of_memory(monkeypatch) -> None:
    # The worst answer the planner can give (issue: "never call a completed run OOM"): every
    # development-set row whose run completed is planned to fit, by fit's whole verdict (the step,
    # the load, host RAM). A fit of a run that ran out is marked borderline instead (the script's
    # summary counts those).
    monkeypatch.chdir(published_memory_accuracy.ROOT)
    refused = []
    for row in published_memory_accuracy.load_rows():
        if row["outcome"] != "completed":
            continue
        result = published_memory_accuracy.predict(row)
        if "error" not in result and not result["fits"]:
            refused.append(row["id"])
    assert refused == [], f"completed runs predicted not to fit: {refused}"
