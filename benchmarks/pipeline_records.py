"""Record torchtitan's pipeline stage split and torch's pipeline schedules.

    python benchmarks/pipeline_records.py [OUT_DIR [split|schedule]]
        (default benchmarks/pipeline-records, both kinds)

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
from zeroplan.frameworks.pipeline import MULTI_STAGE, SINGLE_STAGE, V_STYLE, schedule_record, split_record
from zeroplan.frameworks.pipeline_record import SCHEDULE_DIR, SPLIT_DIR

DEFAULT_OUT = Path(__file__).resolve().parent / "pipeline-records"

FLAVOURS = ("8B", "70B", "405B")
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
    (out / SPLIT_DIR).mkdir(parents=True, exist_ok=True)
    for flavour in FLAVOURS:
        for pp in SPLIT_PP:
            for schedule in SPLIT_SCHEDULES:
                started = time.perf_counter()
                record = split_record(flavour, pp, schedule)
                write_text_atomic(out / SPLIT_DIR / record.file_name, record.model_dump_json(indent=1) + "\n")
                print(f"{record.name:45s} {record.error or 'ok'}  ({time.perf_counter() - started:.1f} s)")


def write_schedule(out: Path) -> None:
    (out / SCHEDULE_DIR).mkdir(parents=True, exist_ok=True)
    for schedule, pp, stages_per_rank, microbatches in schedule_cases():
        record = schedule_record(schedule, pp, stages_per_rank, microbatches)
        write_text_atomic(out / SCHEDULE_DIR / record.file_name, record.model_dump_json(indent=1) + "\n")
        peaks = [r.peak_in_flight_until_weight_grad for r in record.ranks]
        print(f"{record.name:45s} {record.error or peaks}")


def main(out: Path = DEFAULT_OUT, kinds: set[str] | None = None) -> None:
    # torchtitan warns for every schedule built with fewer micro-batches than stages; those
    # configurations are recorded on purpose.
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    if not kinds or "split" in kinds:
        write_split(out)
    if not kinds or "schedule" in kinds:
        write_schedule(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, set(sys.argv[2:]) or None)
