"""Record torchtitan's pipeline stage split and torch's pipeline schedules.

    python benchmarks/pipeline_records.py [OUT_DIR [split|schedule]]
        (default benchmarks/pipeline-records, both kinds)
    python benchmarks/pipeline_records.py --tables
        (the markdown tables of docs/pipeline-measured.md, from the committed records)

Split records (OUT_DIR/split): torchtitan 0.3.0's own split of its Llama-3 8B, 70B and 405B
flavours (built on the meta device) for pp 2, 4, 8, 16 under a loop single-stage schedule
(1F1B), a loop two-stage one (Interleaved1F1B) and a V one (ZBVZeroBubble); GPipe splits as
1F1B does, LoopedBFS and InterleavedZeroBubble as Interleaved1F1B, DualPipeV as ZBVZeroBubble
(torchtitan distributed/pipeline_parallel.py: only single- vs multi-stage and loop vs V enter).

Schedule records (OUT_DIR/schedule): every schedule torch 2.13 offers for training with pp 2, 4,
8 and m = pp, 2 pp, 4 pp, 8 and 16 micro-batches; two stages per rank for the multi-stage ones
and four for the looped multi-stage ones (V schedules take exactly two). Needs torch and
torchtitan; about a minute on 2 cores (zeroplan.frameworks.pipeline).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.pipeline_record import (
    MULTI_STAGE,
    SCHEDULE_DIR,
    SINGLE_STAGE,
    SPLIT_DIR,
    V_STYLE,
    load_schedule_records,
    load_split_records,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "pipeline-records"

FLAVOURS = ("8B", "70B", "405B")
NUM_LAYERS = {"8B": 32, "70B": 80, "405B": 126}
"""torchtitan 0.3.0 models/llama3/__init__.py n_layers of each flavour (the records hold the
figure read from the built config; a test compares)."""
SPLIT_PP = (2, 4, 8, 16)
SPLIT_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
SCHEDULE_PP = (2, 4, 8)


def schedule_cases() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, stages per rank, micro-batches) for every schedule record."""
    cases = []
    for pp in SCHEDULE_PP:
        counts = sorted({pp, 2 * pp, 4 * pp, 8, 16})
        for schedule in SINGLE_STAGE + MULTI_STAGE:
            if schedule in SINGLE_STAGE:
                per_rank = (1,)
            elif schedule in V_STYLE:
                per_rank = (2,)
            else:
                per_rank = (2, 4)
            for stages_per_rank in per_rank:
                cases.extend((schedule, pp, stages_per_rank, m) for m in counts)
    return cases


def write_split(out: Path) -> None:
    from zeroplan.frameworks.pipeline import split_record

    (out / SPLIT_DIR).mkdir(parents=True, exist_ok=True)
    for flavour in FLAVOURS:
        for pp in SPLIT_PP:
            for schedule in SPLIT_SCHEDULES:
                started = time.perf_counter()
                record = split_record(flavour, pp, schedule)
                write_text_atomic(out / SPLIT_DIR / record.file_name, record.model_dump_json(indent=1) + "\n")
                print(f"{record.name:45s} {record.error or 'ok'}  ({time.perf_counter() - started:.1f} s)")
            # Four stages per rank where torchtitan's pipeline_parallel_layers_per_stage gives it:
            # ceil(effective layers / layers per stage) stages (layers + 2 for embedding and output).
            effective = NUM_LAYERS[flavour] + 2
            if pp >= 4:
                record = split_record(flavour, pp, "Interleaved1F1B", layers_per_stage=max(1, effective // (4 * pp)))
                write_text_atomic(out / SPLIT_DIR / record.file_name, record.model_dump_json(indent=1) + "\n")
                print(f"{record.name:45s} {record.error or f'ok, {record.stages_per_rank} stages per rank'}")


def write_schedule(out: Path) -> None:
    from zeroplan.frameworks.pipeline import schedule_record

    (out / SCHEDULE_DIR).mkdir(parents=True, exist_ok=True)
    for schedule, pp, stages_per_rank, microbatches in schedule_cases():
        record = schedule_record(schedule, pp, stages_per_rank, microbatches)
        write_text_atomic(out / SCHEDULE_DIR / record.file_name, record.model_dump_json(indent=1) + "\n")
        peaks = [r.peak_in_flight_until_weight_grad for r in record.ranks]
        print(f"{record.name:45s} {record.error or peaks}")


def tables(out: Path = DEFAULT_OUT) -> str:
    """The markdown tables of docs/pipeline-measured.md, from the committed records (no torch)."""
    lines = ["| model | pp | layers per stage | stage 0 | middle stages (min - max) | last stage | heaviest rank, v=2 loop | heaviest rank, v=2 V |",
             "|---|---|---|---|---|---|---|---|"]
    splits = {(r.flavour, r.pp, r.schedule): r for r in load_split_records(out) if r.layers_per_stage is None}
    for flavour in FLAVOURS:
        for pp in (4, 8, 16):
            one = splits[(flavour, pp, "1F1B")]
            middle = [s.total_elements for s in one.stages[1:-1]] or [0]
            heavy = []
            for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
                record = splits[(flavour, pp, schedule)]
                if record.error:
                    heavy.append(f"refused: {record.error}")
                    continue
                top = max(record.ranks, key=lambda r: r.param_elements)
                heavy.append(f"rank {top.rank} {top.stage_indices}: {top.param_elements:,}")
            lines.append(
                f"| {flavour} | {pp} | {','.join(str(s.layers) for s in one.stages)} | {one.stages[0].total_elements:,} "
                f"| {min(middle):,} - {max(middle):,} | {one.stages[-1].total_elements:,} | {heavy[0]} | {heavy[1]} |")
    lines += ["", "| schedule | pp | m | v | peak in-flight chunks per rank 0..pp-1 (until B/W) | until B/I, where it differs | idle IR slots per rank |",
              "|---|---|---|---|---|---|---|"]
    schedules = {(r.schedule, r.pp, r.stages_per_rank, r.microbatches): r for r in load_schedule_records(out)}
    for pp, m in ((4, 8), (8, 16)):
        for schedule in SINGLE_STAGE + MULTI_STAGE:
            v = 1 if schedule in SINGLE_STAGE else 2
            record = schedules[(schedule, pp, v, m)]
            if record.error:
                lines.append(f"| {schedule} | {pp} | {m} | {v} | refused: {record.error} | | |")
                continue
            until_w = [r.peak_in_flight_until_weight_grad for r in record.ranks]
            until_i = [r.peak_in_flight_until_input_grad for r in record.ranks]
            idle = [r.ir_idle_slots for r in record.ranks]
            lines.append(f"| {schedule} | {pp} | {m} | {v} | {' '.join(map(str, until_w))} "
                         f"| {' '.join(map(str, until_i)) if until_i != until_w else ''} "
                         f"| {' '.join(map(str, idle)) if None not in idle else 'not in IR'} |")
    return "\n".join(lines)


def main(out: Path = DEFAULT_OUT, kinds: set[str] | None = None) -> None:
    # torchtitan (its logger is the root logger: tools/logging.py) warns for every schedule built
    # with fewer micro-batches than stages; those configurations are recorded on purpose.
    logging.getLogger().setLevel(logging.ERROR)
    if not kinds or "split" in kinds:
        write_split(out)
    if not kinds or "schedule" in kinds:
        write_schedule(out)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--tables",))
    if sys.argv[1:] == ["--tables"]:
        print(tables())
        sys.exit(0)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, set(sys.argv[2:]) or None)
