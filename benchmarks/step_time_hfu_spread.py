"""What the HFU ``zeroplan calibrate step`` solves on a row tracks within one published source
(issue 30: one HFU per source cannot fit llm-foundry's tables; docs/validation.md, "What the HFU
tracks within a source"). A diagnostic: nothing in zeroplan changes and nothing is fitted.

    python benchmarks/step_time_hfu_spread.py            # ~40 s on 2 cores
    python benchmarks/step_time_hfu_spread.py --sources llm-foundry Rebalancing

For each source of at least three rows, the rows calibrate step does not refuse are split by
activation checkpointing, and the HFU each solves (under the default attention rate, at the
attention efficiencies fitted without the source: zeroplan.validate.step_calibration.held_out_fit,
as the calibrated figures are scored) is rank-correlated (Spearman) with what the row ran: the
model's width and layers, the sequence, the tokens of one micro-batch, the micro-batch, the
accumulation steps and the GPUs. Then every row with recomputation beside the rows without it
that ran the same tokens per micro-batch in the same table: the ratio of their HFUs, with both
widths (recomputation and the micro-batch's tokens move together on these tables; matched on the
tokens, what is left of the step between them). Last, the tile and wave quantization of the
rank's block products (step_time_mechanisms.wave_multipliers: the largest tiles with and without
the weight gradient's reduction split, and the best of the guide's eight tiles), each source's
anchor against the median of its rows.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FEATURES = {
    "h": lambda row: row.model_spec.hidden_size,
    "layers": lambda row: row.model_spec.num_layers,
    "sequence": lambda row: row.seq_len,
    "tokens/micro-batch": lambda row: row.micro_batch_size * row.seq_len,
    "micro-batch": lambda row: row.micro_batch_size,
    "accumulation": lambda row: row.grad_accum_steps,
    "GPUs": lambda row: row.num_gpus,
}


def ranks(values: list[float]) -> list[float]:
    """Ranks from 0, ties at their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranked = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranked[order[position]] = (start + end) / 2
        start = end + 1
    return ranked


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None where either side is constant."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    covariance = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return covariance / spread if spread else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="What the HFU calibrate step solves tracks within one published source.")
    parser.add_argument("--sources", nargs="*", default=["llm-foundry", "Rebalancing", "model-parallel weak-scaling"],
                        help="substrings of the source labels to print (default: the sources over issue 30's target)")
    args = parser.parse_args(argv)

    from step_time_mechanisms import GUIDE_TILES, LARGEST_TILES, wave_multipliers
    from zeroplan.validate import step_calibration as sc
    from zeroplan.validate.step_time import load_published_throughput

    table = load_published_throughput()
    chosen = {source: rows for source, rows in sc.source_rows(table).items()
              if len(rows) >= sc.MIN_SOURCE_ROWS and any(s in sc.source_label(rows[0]) for s in args.sources)}
    implied_by_source = {source: sc.held_out_fit(sc.DEFAULT_ATTENTION_RATE, table, source)[1] for source in chosen}

    print("HFU solved on each row, by checkpointing, and its rank correlation with what the row ran:\n")
    print("| source | checkpointing | rows | median HFU | interquartile | " + " | ".join(FEATURES) + " |")
    print("|---|---|---:|---:|---|" + "---:|" * len(FEATURES))
    for source, rows in chosen.items():
        implied = implied_by_source[source]
        for policy in ("none", "full", "selective"):
            group = [row for row in rows if row.name in implied and row.activation_checkpointing.value == policy]
            if len(group) < 4:
                continue
            hfus = [implied[row.name] for row in group]
            low, _, high = statistics.quantiles(hfus, n=4)
            cells = []
            for feature in FEATURES.values():
                rho = spearman([float(feature(row)) for row in group], hfus)
                cells.append("-" if rho is None else f"{rho:+.2f}")
            print(f"| {sc.source_label(rows[0])[:60]} | {policy} | {len(group)} | {statistics.median(hfus):.3f} "
                  f"| {low:.3f}-{high:.3f} | " + " | ".join(cells) + " |")

    print("\nRows with recomputation against rows without at the same tokens per micro-batch (one table):\n")
    print("| source | tokens/micro-batch | with: h (HFU) | without: h (HFU) | median ratio |")
    print("|---|---:|---|---|---:|")
    ratios_all: list[float] = []
    for source, rows in chosen.items():
        implied = implied_by_source[source]
        by_tokens: dict[int, tuple[list, list]] = {}
        for row in rows:
            if row.name in implied and row.activation_checkpointing.value in ("none", "full"):
                pair = by_tokens.setdefault(row.micro_batch_size * row.seq_len, ([], []))
                pair[0 if row.activation_checkpointing.value == "full" else 1].append(row)
        for tokens, (with_, without) in sorted(by_tokens.items()):
            if not with_ or not without:
                continue
            ratios = [implied[a.name] / implied[b.name] for a in with_ for b in without]
            ratios_all += ratios

            def shown(group: list) -> str:  # type: ignore[type-arg]
                return ", ".join(f"{r.model_spec.hidden_size} ({implied[r.name]:.3f})" for r in group)

            print(f"| {sc.source_label(rows[0])[:60]} | {tokens:,} | {shown(with_)} | {shown(without)} "
                  f"| {statistics.median(ratios):.3f} |")
    if ratios_all:
        print(f"\nevery matched pair: {len(ratios_all)}, HFU with / without recomputation median "
              f"{statistics.median(ratios_all):.3f}, range {min(ratios_all):.3f}-{max(ratios_all):.3f}")

    print("\nTile and wave quantization of the rank's block products (time over full waves, forward / backward), "
          "the anchor against its source's rows:\n")
    print("| source | anchor | largest tiles: anchor | rows' median | largest, weight gradient split: anchor | rows' median "
          "| any of the guide's tiles: anchor | rows' median |")
    print("|---|---|---|---|---|---|---|---|")
    models = (("largest", LARGEST_TILES, False), ("split", LARGEST_TILES, True), ("any", GUIDE_TILES, False))
    for source, rows in chosen.items():
        implied = implied_by_source[source]
        usable = [row for row in rows if row.name in implied]
        anchor = sc.calibration_row(usable)
        cells = []
        for _, tiles, split in models:
            forward, backward = wave_multipliers(anchor.request(), tiles, split)
            pairs = [wave_multipliers(row.request(), tiles, split) for row in usable]
            cells += [f"{forward:.3f} / {backward:.3f}",
                      f"{statistics.median(p[0] for p in pairs):.3f} / {statistics.median(p[1] for p in pairs):.3f}"]
        print(f"| {sc.source_label(rows[0])[:60]} | {anchor.name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
