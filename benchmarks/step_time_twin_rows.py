"""Twin rows: pairs of published rows of one source that ran the same computation, and whether
their published steps can both hold under any one efficiency. A diagnostic of the calibrated
misses (issue 30), in sample by construction (it reads the published figures it judges);
nothing in zeroplan changes and nothing here is fitted to a figure the planner reports.

Two rows are twins when they share the source, GPU, widths (hidden size, layers, MLP width),
sequence, GPU count, tensor and pipeline degrees, checkpointing and the tokens each GPU
processes per step (the same global batch), and differ only in how that batch is split into
micro-batches, or in the attention heads, or in nothing the planner times differently. Their
executed FLOPs per token are then equal (attention's s^2 term does not depend on the heads),
so the planner's two steps at one HFU differ only by what it prices between them (pipeline
bubble, per-call latency, memory-bound passes whose shape moves): the column 'planned ratio'.
Where the published ratio departs from it by more than issue 30's 15 % ceiling, no
single-HFU calibration of that source can meet the ceiling on both rows, whatever the anchor;
the planner's terms would have to change by the whole gap between two runs of one computation.

Siblings are rows that differ only in the GPU count (and the accumulation that keeps the
per-GPU micro-batch): their compute per GPU per micro-batch is equal, and more GPUs only add
communication, so the row of fewer GPUs cannot be slower per token unless its communication is.

One dimension at a time: pairs of one source that differ in one setup dimension alone (or in the
sequence and micro-batch at equal tokens per micro-batch), with the relative gap between the HFUs
calibrate step solves on the two: which dimension a source's calibrated misses follow.

The Megatron-LM 2020 DGX-2 (V100) table gets its two-unknown reading: its tensor-parallel rows
(TP 2, 4, 8) solved for one compute rate per executed FLOP and one multiple k of the planner's
tensor-parallel communication, the TP 1 row then compared with that rate.

python benchmarks/step_time_twin_rows.py   (~10 s)
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeroplan.calibrate.step import planned_step, solve_hfu  # noqa: E402
from zeroplan.validate.step_calibration import (  # noqa: E402
    DEFAULT_ATTENTION_RATE, published_step_s, source_label, source_of,
)
from zeroplan.validate.step_time import PublishedThroughput, load_published_throughput  # noqa: E402

CEILING = 0.15
"""Issue 30's largest calibrated |error| on any row."""


def _widths(row: PublishedThroughput) -> tuple[int, int, int]:
    model = row.request().model
    return model.hidden_size, model.num_layers, model.ffn_hidden_size


def _twin_key(row: PublishedThroughput) -> tuple:
    return (source_of(row), row.gpu, _widths(row), row.seq_len, row.num_gpus, row.tp, row.pp,
            row.activation_checkpointing, row.tokens_per_step_per_gpu, row.strategy, row.precision, row.compile,
            row.fused_cross_entropy, row.training_options, row.zero_options)


def _sibling_key(row: PublishedThroughput) -> tuple:
    return (source_of(row), row.gpu, _widths(row), row.seq_len, row.tp, row.pp, row.activation_checkpointing,
            row.micro_batch_size, row.strategy, row.precision, row.compile, row.fused_cross_entropy,
            row.training_options, row.zero_options)


def _planned_s(row: PublishedThroughput, hfu: float) -> float:
    return planned_step(row.request(hfu, attention_rate=DEFAULT_ATTENTION_RATE)).step_with_overlap_s


def _per_token_s(row: PublishedThroughput, step_s: float) -> float:
    return step_s / row.tokens_per_step_per_gpu


def _solved(row: PublishedThroughput) -> float | None:
    try:
        return solve_hfu(row.request(None, attention_rate=DEFAULT_ATTENTION_RATE), published_step_s(row))
    except Exception:  # noqa: BLE001 (a row the planner cannot reach at HFU 1)
        return None


def twin_pairs(rows) -> list[tuple[PublishedThroughput, PublishedThroughput, float, float]]:
    """(a, b, published step ratio b/a, planned step ratio b/a at a's solved HFU) per twin pair."""
    groups = defaultdict(list)
    for row in rows:
        groups[_twin_key(row)].append(row)
    pairs = []
    for members in groups.values():
        for a, b in itertools.combinations(members, 2):
            hfu = _solved(a)
            if hfu is None:
                continue
            pairs.append((a, b, published_step_s(b) / published_step_s(a), _planned_s(b, hfu) / _planned_s(a, hfu)))
    return pairs


def sibling_pairs(rows) -> list[tuple[PublishedThroughput, PublishedThroughput, float, float]]:
    """(fewer GPUs, more GPUs, published per-token ratio more/fewer, planned per-token ratio at
    the fewer-GPU row's solved HFU) for siblings."""
    groups = defaultdict(list)
    for row in rows:
        groups[_sibling_key(row)].append(row)
    pairs = []
    for members in groups.values():
        members.sort(key=lambda r: r.num_gpus)
        for a, b in itertools.combinations(members, 2):
            if a.num_gpus == b.num_gpus:
                continue
            hfu = _solved(a)
            if hfu is None:
                continue
            published = _per_token_s(b, published_step_s(b)) / _per_token_s(a, published_step_s(a))
            planned = _per_token_s(b, _planned_s(b, hfu)) / _per_token_s(a, _planned_s(a, hfu))
            pairs.append((a, b, published, planned))
    return pairs


DIMENSIONS = ("GPUs", "sequence", "micro-batch", "model", "recomputation", "tp", "pp", "heads", "attention kernel")
"""What a row's setup is read by, for pairs that differ in one of them alone."""


def _dimensions(row: PublishedThroughput) -> dict[str, object]:
    model = row.request().model
    return {"GPUs": row.num_gpus, "sequence": row.seq_len, "micro-batch": row.micro_batch_size,
            "model": _widths(row), "recomputation": row.activation_checkpointing, "tp": row.tp, "pp": row.pp,
            "heads": model.num_heads, "attention kernel": row.attention_implementation}


def _fixed(row: PublishedThroughput) -> tuple:
    return (source_of(row), row.gpu, row.strategy, row.precision, row.compile, row.fused_cross_entropy,
            row.training_options, row.zero_options)


def one_dimension_pairs(rows) -> dict[tuple[str, str], list[tuple[PublishedThroughput, PublishedThroughput, float]]]:
    """Per (source label, dimension): pairs of rows that differ in that dimension alone (the
    accumulation aside; 'sequence, same tokens' where the sequence and the micro-batch change with
    their product kept), each with |HFU_b / HFU_a - 1| of the HFUs calibrate step solves on them:
    what a calibration carried from one to the other misses, read off one dimension at a time."""
    solved = {row.name: _solved(row) for row in rows}
    found = defaultdict(list)
    groups = defaultdict(list)
    for row in rows:
        groups[_fixed(row)].append(row)
    for members in groups.values():
        for a, b in itertools.combinations(members, 2):
            if solved[a.name] is None or solved[b.name] is None:
                continue
            da, db = _dimensions(a), _dimensions(b)
            differ = {d for d in DIMENSIONS if da[d] != db[d]}
            if differ == {"sequence", "micro-batch"} and a.seq_len * a.micro_batch_size == b.seq_len * b.micro_batch_size:
                dimension = "sequence, same tokens"
            elif len(differ) == 1:
                dimension = differ.pop()
            else:
                continue
            found[(source_label(a), dimension)].append((a, b, abs(solved[b.name] / solved[a.name] - 1)))
    return found


def v100_reading(rows) -> list[str]:
    """The Megatron-LM 2020 DGX-2 table: step = c x executed FLOPs + k x the planner's
    tensor-parallel communication, solved on its TP 2 and TP 8 rows, checked on TP 4 and TP 1."""
    table = sorted((r for r in rows if r.name.startswith("megatron 2020")), key=lambda r: r.tp)
    if len(table) < 4:
        return []
    terms = []
    for row in table:
        step = planned_step(row.request(0.5, attention_rate=DEFAULT_ATTENTION_RATE))
        # The memory-bound passes and the optimizer step at the copy bandwidth where the planner
        # times them apart (0 on a GPU without a measured bandwidth: the rate covers them).
        fixed = step.memory_bound_s + step.optimizer_step_s
        terms.append((row, step.executed_flops, step.model_parallel_communication_s, published_step_s(row) - fixed))
    (_, f2, m2, t2), (_, f8, m8, t8) = terms[1], terms[3]
    # t = c f + k m, two equations.
    det = f2 * m8 - f8 * m2
    c = (t2 * m8 - t8 * m2) / det
    k = (f2 * t8 - f8 * t2) / det
    lines = [f"Megatron-LM 2020 DGX-2 (V100): step = c x executed FLOPs + k x planned TP communication, solved on "
             f"TP 2 and TP 8: {1 / c / 1e12:.1f} TFLOP/s executed, k = {k:.2f}",
             "", "| row | TP | executed TFLOP | planned TP comm (s) | published step less memory-bound (s) | c f + k m (s) | residual |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row, f, m, t in terms:
        fitted = c * f + k * m
        lines.append(f"| {row.name} | {row.tp} | {f / 1e12:.1f} | {m:.3f} | {t:.3f} | {fitted:.3f} | {fitted / t - 1:+.1%} |")
    return lines


def main() -> None:
    rows = load_published_throughput().rows
    print("Twin rows (one source, the same computation per GPU, split into other micro-batches or heads): "
          "published step ratio against the planner's at one HFU\n")
    print("| source | row a | row b | published b/a | planned b/a | gap |")
    print("|---|---|---|---:|---:|---:|")
    gaps = []
    for a, b, published, planned in twin_pairs(rows):
        gap = published / planned - 1
        gaps.append((source_label(a), abs(gap)))
        print(f"| {source_label(a)[:60]} | {a.name} | {b.name} | {published:.3f} | {planned:.3f} | {gap:+.1%} |")
    print()
    by_source = defaultdict(list)
    for source, gap in gaps:
        by_source[source].append(gap)
    for source, values in by_source.items():
        over = sum(g > CEILING for g in values)
        print(f"{source[:90]}: {len(values)} twin pairs, |gap| median {statistics.median(values):.1%}, "
              f"max {max(values):.1%}, {over} over {CEILING:.0%}")
    print("\nSiblings (the same model, sequence and per-GPU micro-batch on more GPUs): published per-token "
          "time ratio more/fewer GPUs against the planner's; below 1 published means the run on more GPUs "
          "was faster per token\n")
    print("| source | fewer GPUs | more GPUs | published | planned | gap |")
    print("|---|---|---|---:|---:|---:|")
    for a, b, published, planned in sibling_pairs(rows):
        if published < 1 <= planned or published / planned - 1 < -0.05:
            print(f"| {source_label(a)[:60]} | {a.name} | {b.name} | {published:.3f} | {planned:.3f} | "
                  f"{published / planned - 1:+.1%} |")
    print("\nOne dimension at a time (pairs of one source that differ in it alone; |HFU_b / HFU_a - 1| of the HFUs "
          "calibrate step solves on the two, in sample: what one row's calibration misses on the other where "
          "only that dimension moved)\n")
    print("| source | dimension | pairs | median | max | over 15 % |")
    print("|---|---|---:|---:|---:|---:|")
    for (source, dimension), pairs in sorted(one_dimension_pairs(rows).items()):
        values = [gap for _, _, gap in pairs]
        print(f"| {source[:60]} | {dimension} | {len(values)} | {statistics.median(values):.1%} | {max(values):.1%} | "
              f"{sum(v > CEILING for v in values)} |")
    print()
    for line in v100_reading(rows):
        print(line)


if __name__ == "__main__":
    main()
