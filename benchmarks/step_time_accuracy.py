"""The planner's step time against published FSDP throughput (zeroplan/validate/data/
published_throughput.json, each row with its source): tokens/s/GPU predicted under the flat
hardware FLOPs utilisation (HFU) 0.4 (nothing fitted) and at the HFU the row's published MFU
implies (HFU = MFU x executed / model FLOPs), and under the roofline compute model
(--compute-model roofline, zeroplan.core.roofline), beside the published figure.

    python benchmarks/step_time_accuracy.py [PUBLISHED.json]
    python benchmarks/step_time_accuracy.py --write-default-efficiency
    python benchmarks/step_time_accuracy.py --per-row [--every-source]

The second form writes zeroplan/core/data/default_efficiency.json, the planner's default
efficiency (zeroplan.core.default_efficiency: one HFU per GPU generation x kernel class, fitted
on every published row), with the rows' file hash and sources. Its accuracy is printed
leave-one-source-out ("fitted default"), never in sample.

Errors are predicted / published - 1 on tokens/s/GPU (negative: the planner is too slow).
docs/validation.md, "Step time", discusses them; nothing here is tuned per row.

Then the calibrated figures (zeroplan.validate.step_calibration): each source (one publication's
table) of at least three rows calibrated as ``zeroplan calibrate step`` would on its row of
fewest GPUs, predicting its other rows; and, leave-one-source-out, the default HFU, an HFU
fitted per GPU generation x stack and the fitted default, one per GPU generation x kernel class
(the stack's attention kernel, compiled or not: zeroplan.core.default_efficiency), on the other sources, by GPU,
stack, kernel class, strategy, checkpointing and source. No figure includes a row its own fit saw.

--per-row prints, for each calibrated source over issue 30's target (median 5 %, max 15 %), its
rows' calibrated errors against what each ran and the anchor floor: every row of the source tried
as the anchor, a diagnostic of how far the model's residuals spread within the source (never an
accuracy figure: an anchor picked by its errors would be fitted to the rows it is scored on).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from zeroplan.errors import ZeroplanError
from zeroplan.core.default_efficiency import FLAT_HFU
from zeroplan.validate.step_calibration import RowError, SourceCalibration, calibration_study
from zeroplan.validate.step_time import (
    PUBLISHED_THROUGHPUT_FILE, StepTimeComparison, load_published_throughput, step_time_table,
)

HEADER = (
    "| run | fits | published tok/s/GPU | step (s) | predicted, flat HFU {hfu:g} | error | its MFU | published MFU "
    "| HFU it implies | predicted at it | error | executed / model FLOPs | comm (s) | exposed (s) | roofline | error |"
)


def format_row(c: StepTimeComparison) -> str:
    mfu = "-" if c.published_mfu is None else f"{c.published_mfu:.3f}"
    hfu = "-" if c.published_hfu is None else f"{c.published_hfu:.3f}"
    at_mfu = "-" if c.with_published_mfu_tokens_per_s_per_gpu is None else f"{c.with_published_mfu_tokens_per_s_per_gpu:,.0f}"
    at_mfu_error = "-" if c.with_published_mfu_error is None else f"{c.with_published_mfu_error:+.1%}"
    roofline = "-" if c.roofline_tokens_per_s_per_gpu is None else f"{c.roofline_tokens_per_s_per_gpu:,.0f}"
    roofline_error = "-" if c.roofline_error is None else f"{c.roofline_error:+.1%}"
    return (
        f"| {c.name} | {'yes' if c.fits else 'NO'} | {c.published_tokens_per_s_per_gpu:,.0f} | {c.published_step_s:.3f} "
        f"| {c.predicted_tokens_per_s_per_gpu:,.0f} | {c.tokens_per_s_error:+.1%} | {c.predicted_mfu:.3f} | {mfu} | {hfu} "
        f"| {at_mfu} | {at_mfu_error} | {c.flops_per_token_ratio:.3f} | {c.communication_s:.3f} "
        f"| {c.exposed_communication_s:.3f} | {roofline} | {roofline_error} |"
    )


def report(path: Path = PUBLISHED_THROUGHPUT_FILE) -> str:
    table = load_published_throughput(path)
    rows = step_time_table(table)
    header = HEADER.format(hfu=FLAT_HFU)
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    lines += [format_row(c) for c in rows]
    default_errors = [abs(c.tokens_per_s_error) for c in rows]
    mfu_errors = [abs(c.with_published_mfu_error) for c in rows if c.with_published_mfu_error is not None]
    roofline_errors = [abs(c.roofline_error) for c in rows if c.roofline_error is not None]
    lines.append("")
    lines.append(
        f"{len(rows)} rows; |error| at the flat HFU {FLAT_HFU:g}: median {statistics.median(default_errors):.1%}, "
        f"max {max(default_errors):.1%}"
        + (f"; at the HFU the published MFU implies: median {statistics.median(mfu_errors):.1%}, max {max(mfu_errors):.1%}" if mfu_errors else "")
        + (f"; roofline compute model: median {statistics.median(roofline_errors):.1%}, max {max(roofline_errors):.1%}"
           if roofline_errors else "")
    )
    lines += ["", "By GPU and checkpointing (median error; rows the planner says do not fit counted too):", "",
              "| GPU | checkpointing | rows | flat HFU | roofline | exposed > 0 | planner says no fit |",
              "|---|---|---:|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[StepTimeComparison]] = {}
    for row, comparison in zip(table.rows, rows):
        groups.setdefault((row.gpu, row.activation_checkpointing.value), []).append(comparison)
    for (gpu, policy), members in sorted(groups.items()):
        roofline = [c.roofline_error for c in members if c.roofline_error is not None]
        lines.append(
            f"| {gpu} | {policy} | {len(members)} | {statistics.median(c.tokens_per_s_error for c in members):+.1%} | "
            + (f"{statistics.median(roofline):+.1%}" if roofline else "-")
            + f" | {sum(c.exposed_communication_s > 0 for c in members)} | {sum(not c.fits for c in members)} |")
    lines.append("")
    lines.append("sources:")
    lines += sorted({f"  {c.source}" for c in rows})
    lines += ["", *calibrated_report(table)]
    lines += ["", *attention_rate_report(table)]
    return "\n".join(lines)


def _abs_figures(errors: list[float]) -> str:
    """median and max |error| of ``errors``, as the tables print them."""
    magnitudes = [abs(e) for e in errors]
    return f"{statistics.median(magnitudes):.1%} | {max(magnitudes):.1%}"


def calibrated_source_line(source: SourceCalibration, errors: list[RowError], source_hfus: list[float]) -> str:
    """One source's calibration; ``source_hfus``: the HFU calibrate step solves on each of its rows
    (the anchor's among them), to show where the anchor sits in its source: one row predicts the
    rest within its spread only where it sits near the middle."""
    predicted = [e.calibrated_error for e in errors if e.source == source.source and e.calibrated_error is not None]
    below = sum(hfu < source.hfu for hfu in source_hfus)
    return (f"| {source.label} | {source.gpu} | {len(predicted)} | {source.calibration_row} "
            f"({source.calibration_gpus} GPUs) | {source.hfu:.3f} | {statistics.median(source_hfus):.3f} "
            f"| {below} of {len(source_hfus)} | {_abs_figures(predicted)} |")


def calibrated_summary(errors: list[RowError]) -> str:
    """The one line the planner's calibrated band (zeroplan.calibrate.basis.CALIBRATED_BAND) quotes."""
    predicted = [abs(e.calibrated_error) for e in errors if e.calibrated_error is not None]
    sources = len({e.source for e in errors if e.calibrated_error is not None})
    return (f"calibrated on one row: {len(predicted)} rows of {sources} sources predicted; |error| median "
            f"{statistics.median(predicted):.1%}, max {max(predicted):.1%}")


def default_summary(errors: list[RowError]) -> str:
    """The line the flat band (zeroplan.calibrate.basis.FLAT_BAND) quotes."""
    default = [abs(e.default_error) for e in errors]
    loso = [abs(e.loso_error) for e in errors]
    return (f"uncalibrated, {len(errors)} rows: flat HFU {FLAT_HFU:g} |error| median {statistics.median(default):.1%}, "
            f"max {max(default):.1%}; HFU per GPU generation x stack fitted leave-one-source-out: median "
            f"{statistics.median(loso):.1%}, max {max(loso):.1%}")


def kernel_summary(errors: list[RowError]) -> str:
    """The line the fitted default's band (zeroplan.calibrate.basis.DEFAULT_BAND, the default
    attention rate's) quotes: the planner's default efficiency, one HFU per GPU generation x kernel
    class (zeroplan.core.default_efficiency), fitted leave-one-source-out (under 'kernel' the
    attention efficiency too: zeroplan.validate.step_calibration.held_out_fit)."""
    kernel = [abs(e.kernel_error) for e in errors]
    return (f"uncalibrated, {len(errors)} rows: fitted default (HFU per GPU generation x kernel class, attention kernel, "
            f"compiled or not) leave-one-source-out: median {statistics.median(kernel):.1%}, max {max(kernel):.1%}")


def previous_tie_break_lines(table) -> list[str]:  # type: ignore[no-untyped-def]
    """The same calibration with ties broken as before (the first listed of the fewest-GPU rows),
    where that picks another row: the figures under both rules."""
    from zeroplan.validate.step_calibration import tie_break_figures

    previous = tie_break_figures(table)
    lines = ["Anchored as before this rule (ties: the first listed; only the sources where it picks another row):", "",
             "| source | calibrated on | rows predicted | median abs error | max abs error |", "|---|---|---:|---:|---:|"]
    current = dict((s.label, s.calibration_row) for s in calibration_study(table)[0])
    for label, anchor, n, median, worst in previous.per_source:
        if current.get(label) != anchor:
            lines.append(f"| {label} | {anchor} | {n} | {median:.1%} | {worst:.1%} |")
    lines += ["", f"calibrated on one row, ties the first listed: {len(previous.errors)} rows; |error| median "
                  f"{statistics.median(previous.errors):.1%}, max {max(previous.errors):.1%}"]
    return lines


GROUPINGS = (("GPU", "gpu"), ("stack", "stack"), ("kernel class", "kernel_class"), ("strategy", "strategy"), ("checkpointing", "checkpointing"),
             ("source", "source"))


def calibrated_report(table) -> list[str]:  # type: ignore[no-untyped-def]
    sources, errors = calibration_study(table)
    errors = list(errors)
    labels = {e.source: e.label for e in errors}
    from zeroplan.validate.step_calibration import DEFAULT_ATTENTION_RATE, held_out_fit, source_of

    by_source: dict[str, list[float]] = {}
    for row in table.rows:
        # The HFUs solved as the anchor's was: under 'kernel', at the attention efficiencies fitted
        # without the row's source.
        implied = held_out_fit(DEFAULT_ATTENTION_RATE, table, source_of(row))[1]
        if row.name in implied:
            by_source.setdefault(source_of(row), []).append(implied[row.name])
    lines = ["Calibrated on one row (zeroplan calibrate step's HFU, solved on the source's row of fewest GPUs, "
             "ties: the smallest model at the source's median sequence length, zeroplan.validate.step_calibration."
             "calibration_row; scored on the source's other rows, never on the row it was solved on; beside it the "
             "median HFU calibrate step solves on each of the source's rows and how many of them solve below the "
             "anchor's, to show where the anchor sits in its source):", "",
             "| source | GPU | rows predicted | calibrated on | HFU | source's median HFU | rows below it "
             "| median abs error | max abs error |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [calibrated_source_line(source, errors, by_source[source.source]) for source in sources]
    lines += ["", calibrated_summary(errors), "", *previous_tie_break_lines(table), "",
              "Uncalibrated, leave-one-source-out: the flat HFU 0.4 (nothing fitted), an HFU per GPU generation "
              "x stack, and the fitted default (the planner's, per GPU generation x kernel class), each the median "
              "HFU calibrate step solves on the rows of that mechanism in the other sources (the held-out "
              "source's rows never in it):", "",
              "| by | value | rows | flat HFU 0.4: median abs error | max | per generation x stack: median abs error | max "
              "| fitted default: median abs error | max |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for title, field in GROUPINGS:
        groups: dict[str, list[RowError]] = {}
        for e in errors:
            groups.setdefault(getattr(e, field), []).append(e)
        for value, members in sorted(groups.items()):
            shown = labels.get(value, value) if field == "source" else value
            lines.append(f"| {title} | {shown} | {len(members)} | {_abs_figures([e.default_error for e in members])} "
                         f"| {_abs_figures([e.loso_error for e in members])} | {_abs_figures([e.kernel_error for e in members])} |")
    lines += ["", default_summary(errors), kernel_summary(errors)]
    return lines


def attention_rate_report(table) -> list[str]:  # type: ignore[no-untyped-def]
    """Each --attention-rate mode calibrated on one row per source and at the default HFU
    (zeroplan.validate.step_calibration.attention_rate_figures)."""
    from zeroplan.validate.step_calibration import ATTENTION_RATES, attention_rate_figures

    figures = [attention_rate_figures(mode, table) for mode in ATTENTION_RATES]
    lines = ["Attention at its own rate (--attention-rate; calibrated on each source's row of fewest GPUs that "
             "calibrate step does not refuse, scored on its other such rows):", "",
             "| source | " + " | ".join(f"{f.mode}: median | max" for f in figures) + " |",
             "|---|" + "---:|---:|" * len(figures)]
    labels = [label for label, *_ in figures[0].per_source]
    for label in labels:
        cells = []
        for f in figures:
            found = next(((n, med, mx) for name, n, med, mx in f.per_source if name == label), None)
            cells.append("- | -" if found is None else f"{found[1]:.1%} | {found[2]:.1%}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for f in figures:
        lines.append(f"attention rate {f.mode}: calibrated on one row, {len(f.calibrated)} rows: |error| median "
                     f"{statistics.median(f.calibrated):.1%}, max {max(f.calibrated):.1%}; flat HFU {FLAT_HFU:g}, "
                     f"{len(f.default)} rows: median {statistics.median(f.default):.1%}, max {max(f.default):.1%}; "
                     f"refused by calibrate step: {len(f.refused)} rows")
    lines += ["", *uncalibrated_by_source_lines(table, figures)]
    lines += ["", *attention_efficiency_lines(table)]
    lines.append("")
    for f in figures:
        lines.append(f"attention rate {f.mode}, uncalibrated, {len(f.kernel_class)} rows: fitted default (HFU per GPU "
                     f"generation x kernel class) leave-one-source-out: median {statistics.median(f.kernel_class):.1%}, "
                     f"max {max(f.kernel_class):.1%}")
    return lines


def uncalibrated_by_source_lines(table, figures) -> list[str]:  # type: ignore[no-untyped-def]
    """Each mode's fitted default (HFU per GPU generation x kernel class, and under 'kernel' the
    attention efficiency, fitted leave-one-source-out), by source."""
    from zeroplan.validate.step_calibration import source_label

    lines = ["Uncalibrated, by source (the fitted default of each --attention-rate, fitted on the other sources):", "",
             "| source | rows | " + " | ".join(f"{f.mode}: median | max" for f in figures) + " |",
             "|---|---:|" + "---:|---:|" * len(figures)]
    by_source: dict[str, list[int]] = {}
    for index, row in enumerate(table.rows):
        by_source.setdefault(source_label(row), []).append(index)
    for label, indices in by_source.items():
        cells = [_abs_figures([f.kernel_class[i] for i in indices]) for f in figures]
        lines.append(f"| {label} | {len(indices)} | " + " | ".join(cells) + " |")
    return lines


def attention_efficiency_lines(table) -> list[str]:  # type: ignore[no-untyped-def]
    """--attention-rate kernel's attention efficiency (zeroplan.core.attention_efficiency): each
    source that spans enough sequence lengths on its own rows, and the value each source is scored
    at (fitted without it)."""
    from zeroplan.validate.step_calibration import (
        attention_efficiency_fit, source_attention_efficiencies, source_label, source_of,
    )

    labels = {source_of(row): source_label(row) for row in table.rows}
    lines = ["Attention efficiency under --attention-rate kernel (the kernel's achieved rate over its published "
             "one, zeroplan.core.attention_efficiency; each source's own two-unknown fit, and the value its rows "
             "are scored at, fitted on the other sources):", "",
             "| source | kernel | on its own rows | fitted without it |", "|---|---|---:|---:|"]
    for source, kernel, e in source_attention_efficiencies(table):
        held_out = dict(attention_efficiency_fit(table, source)).get(kernel, 1.0)
        lines.append(f"| {labels[source]} | {kernel} | {e:.3f} | {held_out:.3f} |")
    every = ", ".join(f"{kernel} {e:.3f}" for kernel, e in attention_efficiency_fit(table)) or "none"
    lines += ["", f"attention efficiency fitted on every source (the planner's default): {every}"]
    return lines


def default_efficiency_report() -> list[str]:
    """The shipped default efficiency's mechanisms (the fit on every row: what the planner uses,
    not an accuracy figure) and whether the file is the fit of the current rows."""
    from zeroplan.core.default_efficiency import DEFAULT_EFFICIENCY_FILE, default_table
    from zeroplan.validate.step_calibration import default_efficiency_table

    shipped = default_table()
    current = shipped == default_efficiency_table()
    lines = [f"The planner's default efficiency ({DEFAULT_EFFICIENCY_FILE.name}, fitted on every row: the HFUs it uses, "
             f"in sample, not an accuracy figure; {'the fit of the current rows' if current else 'STALE: rerun ' + shipped.regenerate}):",
             "", "| attention rate | generation | attention kernel | compiled (untimed) | HFU | rows | sources |",
             "|---|---|---|---|---:|---:|---:|"]
    for mode, mechanisms in shipped.mechanisms.items():
        for m in mechanisms:
            compiled = "any" if m.compiled is None else ("yes" if m.compiled else "no")
            float8 = f" (float8 {m.float8})" if m.float8 else ""  # a float8 recipe's own mechanism
            lines.append(f"| {mode} | {m.generation}{float8} | {m.attention or 'any'} | {compiled} | {m.hfu:.3f} | {m.rows} | {m.sources} |")
    return lines


def per_row_report(table, every_source: bool = False) -> list[str]:  # type: ignore[no-untyped-def]
    """Each calibrated source over issue 30's target (every one with ``every_source``): its scored
    rows' calibrated errors against what each row ran, the HFU calibrate step solves on each (at
    the attention efficiencies fitted without the source), and the anchor floor (every row of
    the source tried as the anchor: a diagnostic of the model's spread within the source, not an
    accuracy figure)."""
    from zeroplan.validate.step_calibration import (
        DEFAULT_ATTENTION_RATE, TARGET_MAX, TARGET_MEDIAN, anchor_floor, held_out_fit, row_features, source_rows,
    )

    sources, errors = calibration_study(table)
    rows = {row.name: row for row in table.rows}
    lines = [f"Per row, the calibrated sources over the target (median {TARGET_MEDIAN:.0%}, max {TARGET_MAX:.0%})"
             + (" and the others" if every_source else "") + "; 'HFU' is what calibrate step solves on the row "
             "itself (the anchor's is the source's calibration), the error is the row predicted at the anchor's HFU:"]
    for source in sources:
        scored = [e for e in errors if e.source == source.source and e.calibrated_error is not None]
        magnitudes = [abs(e.calibrated_error) for e in scored]  # type: ignore[arg-type]
        if not every_source and statistics.median(magnitudes) <= TARGET_MEDIAN and max(magnitudes) <= TARGET_MAX:
            continue
        implied = held_out_fit(DEFAULT_ATTENTION_RATE, table, source.source)[1]
        floor = anchor_floor(table, source.source)
        lines += ["", f"{source.label} ({source.gpu}): calibrated on {source.calibration_row}, HFU {source.hfu:.3f}; "
                      f"|error| median {statistics.median(magnitudes):.1%}, max {max(magnitudes):.1%}", "",
                  "| row | ran | HFU | calibrated error |", "|---|---|---:|---:|"]
        ordered = sorted(source_rows(table)[source.source], key=lambda row: (row.model_spec.hidden_size, row.seq_len, row.num_gpus))
        by_name = {e.name: e for e in scored}
        for row in ordered:
            error = by_name.get(row.name)
            shown = "anchor" if row.name == source.calibration_row else (
                "refused" if error is None else f"{error.calibrated_error:+.1%}")
            hfu = f"{implied[row.name]:.3f}" if row.name in implied else "-"
            lines.append(f"| {row.name} | {row_features(rows[row.name])} | {hfu} | {shown} |")
        lines += ["", f"anchor floor (each of its {floor.anchors} rows tried as the anchor; a diagnostic, not an accuracy "
                      f"figure): the rule's anchor {floor.rule_median:.1%} / {floor.rule_max:.1%}; the lowest median any "
                      f"anchor gives {floor.best_median:.1%} (max {floor.best_median_max:.1%}); the lowest max "
                      f"{floor.best_max:.1%} (median {floor.best_max_median:.1%}); anchors meeting the target: "
                      f"{floor.meeting_target} of {floor.anchors}"]
    return lines


def write_default_efficiency() -> Path:
    """Fit the default efficiency on every published row and write it (atomically)."""
    from zeroplan.atomic import write_text_atomic
    from zeroplan.core.default_efficiency import DEFAULT_EFFICIENCY_FILE
    from zeroplan.validate.step_calibration import default_efficiency_table

    DEFAULT_EFFICIENCY_FILE.parent.mkdir(exist_ok=True)
    write_text_atomic(DEFAULT_EFFICIENCY_FILE, default_efficiency_table().model_dump_json(indent=2) + "\n")
    return DEFAULT_EFFICIENCY_FILE


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Published training throughput against zeroplan's step time: uncalibrated (leave-one-source-out), "
                    "calibrated from one row per source, and the fitted default efficiency's table.")
    parser.add_argument("rows", nargs="?", type=Path, default=PUBLISHED_THROUGHPUT_FILE,
                        help="a published-throughput JSON file (default: the project's own set)")
    parser.add_argument("--write-default-efficiency", action="store_true",
                        help="fit the default efficiency on the project's rows and write it")
    parser.add_argument("--per-row", action="store_true",
                        help="only each calibrated source over issue 30's target: its rows' calibrated errors against "
                             "what each ran, and the anchor floor")
    parser.add_argument("--every-source", action="store_true", help="with --per-row: every calibrated source")
    args = parser.parse_args(argv)
    if args.write_default_efficiency:
        print(f"wrote {write_default_efficiency()}")
        return 0
    if args.per_row:
        try:
            print("\n".join(per_row_report(load_published_throughput(args.rows), args.every_source)))
        except ZeroplanError as error:
            parser.exit(2, f"step_time_accuracy: {error}\n")
        return 0
    try:
        print(report(args.rows))
    except ZeroplanError as error:
        parser.exit(2, f"step_time_accuracy: {error}\n")
    if args.rows == PUBLISHED_THROUGHPUT_FILE:
        print("\n" + "\n".join(default_efficiency_report()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
