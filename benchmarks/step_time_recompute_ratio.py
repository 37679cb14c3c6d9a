"""Do rows with full recomputation solve a different HFU than rows without, and would one ratio
between them carry a one-row calibration? (issue 30; docs/validation.md, "The sources still over
the target, row by row"). A diagnostic: nothing here is fitted into the planner.

Every llm-foundry anchor ran without recomputation, and on all four of its bf16 tables the rows
with it solve HFUs 17-27 % above the rows without (the planner already counts the recomputed
forward's FLOPs, early stop included: zeroplan.core.flops). llm-foundry's own README shows it too:
its HFU column (MFU x 4/3 under checkpointing) is higher on its checkpointed rows. This prints, per
source with rows of both kinds, the median HFU `calibrate step` solves on each (under the planner's
default attention rate, at the attention efficiencies fitted without the source), their ratio r,
and the one-row calibration with the anchor's HFU carried to the rows of the other kind at r, r
fitted leave-one-source-out as the median of the other sources' ratios: over every source
('every stack'), or over the sources of the scored source's stack only ('per stack'; 1 where it
has none). --rows lists the rows still over 15 % under the per-stack variant.

    python benchmarks/step_time_recompute_ratio.py [--rows]      # ~20 s
"""

from __future__ import annotations

import statistics
import sys

from zeroplan.validate.step_calibration import (
    DEFAULT_ATTENTION_RATE, TARGET_MAX, calibration_study, held_out_fit, held_out_tokens_per_s, source_label, source_rows,
    stack_of,
)
from zeroplan.validate.step_time import load_published_throughput


def _figures(errors: list[float]) -> str:
    return f"{statistics.median(errors):.1%} / {max(errors):.1%}"


def main(argv: list[str]) -> int:
    table = load_published_throughput()
    rows = {row.name: row for row in table.rows}
    by_source = source_rows(table)
    ratios: dict[str, float] = {}
    lines = ["| source | rows with / without | median HFU with | without | ratio |", "|---|---:|---:|---:|---:|"]
    for source, members in by_source.items():
        implied = held_out_fit(DEFAULT_ATTENTION_RATE, table, source)[1]
        full = [implied[r.name] for r in members if r.name in implied and r.activation_checkpointing.value == "full"]
        none = [implied[r.name] for r in members if r.name in implied and r.activation_checkpointing.value == "none"]
        if full and none:
            ratios[source] = statistics.median(full) / statistics.median(none)
            lines.append(f"| {source_label(members[0])} | {len(full)} / {len(none)} | {statistics.median(full):.3f} "
                         f"| {statistics.median(none):.3f} | {ratios[source]:.3f} |")
    sources, errors = calibration_study(table)
    lines += ["", "Calibrated on one row (median / max |error|): as the planner carries it, and with the anchor's HFU "
                  "carried across recomputation at r fitted without the source (every stack; per stack):", "",
              "| source | planner | r, every stack | every stack | r, per stack | per stack |", "|---|---:|---:|---:|---:|---:|"]
    totals: dict[str, list[float]] = {"planner": [], "every": [], "stack": []}
    over: list[str] = []
    for calibration in sources:
        anchor = rows[calibration.calibration_row]
        efficiencies = held_out_fit(DEFAULT_ATTENTION_RATE, table, calibration.source)[0]
        fitted = {
            "every": statistics.median([v for k, v in ratios.items() if k != calibration.source] or [1.0]),
            "stack": statistics.median([v for k, v in ratios.items() if k != calibration.source
                                        and stack_of(by_source[k][0]) == calibration.stack] or [1.0]),
        }
        scored = {"planner": [], "every": [], "stack": []}
        for e in errors:
            if e.source != calibration.source or e.calibrated_error is None:
                continue
            row = rows[e.name]
            scored["planner"].append(abs(e.calibrated_error))
            for variant, r in fitted.items():
                kinds = (anchor.activation_checkpointing.value, row.activation_checkpointing.value)
                factor = r if kinds == ("none", "full") else 1 / r if kinds == ("full", "none") else 1.0
                hfu = min(1.0, e.calibrated_hfu * factor)  # type: ignore[operator]
                error = held_out_tokens_per_s(row, hfu, DEFAULT_ATTENTION_RATE, efficiencies) / e.published_tokens_per_s_per_gpu - 1
                scored[variant].append(abs(error))
                if variant == "stack" and abs(error) > TARGET_MAX:
                    over.append(f"| {calibration.label} | {e.name} | {e.calibrated_error:+.1%} | {error:+.1%} |")
        for key in totals:
            totals[key] += scored[key]
        lines.append(f"| {calibration.label} | {_figures(scored['planner'])} | {fitted['every']:.3f} | {_figures(scored['every'])} "
                     f"| {fitted['stack']:.3f} | {_figures(scored['stack'])} |")
    lines += ["", "every calibrated row: " + "; ".join(f"{name} {_figures(values)}" for name, values in
                                                      (("planner", totals["planner"]), ("every stack", totals["every"]),
                                                       ("per stack", totals["stack"])))]
    if "--rows" in argv:
        lines += ["", "Rows over 15 % with r per stack:", "", "| source | row | planner | per stack |", "|---|---|---:|---:|", *over]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
