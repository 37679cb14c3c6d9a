"""The planner under model parallelism beside torchtitan 0.3.0's own tensor, sequence and context
parallelism (benchmarks/parallel-records, written by benchmarks/parallel_records.py) and torch
2.13's own pipeline schedules (benchmarks/pipeline-records): saved activations per block,
predicted, measured, error; whether the per-block collectives agree; in-flight chunks per rank.

    python benchmarks/parallel_accuracy.py

Targets (docs/validation.md, "Model parallelism"): per block within 2 %, collective bytes equal,
in-flight chunks equal. The tests (tests/test_parallel_validation.py) assert the same figures.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan.core.parallel.pipeline import in_flight_chunks
from zeroplan.frameworks.parallel_record import load_parallel_records
from zeroplan.frameworks.pipeline_record import load_schedule_records
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.validate.parallel import ACTIVATION_TARGET, parallel_rows

HERE = Path(__file__).resolve().parent


def main() -> int:
    rows = parallel_rows(load_parallel_records(HERE / "parallel-records"))
    print(f"{'record':64s} {'predicted':>13s} {'measured':>13s} {'error':>8s}  collectives")
    for row in rows:
        print(f"{row.name:64s} {row.predicted_block_bytes:13,d} {row.measured_block_bytes:13,d} {row.error:+8.2%}  "
              f"{'equal' if row.collectives_equal else 'DIFFER'}")
    worst = max(rows, key=lambda r: abs(r.error))
    within = sum(abs(r.error) <= ACTIVATION_TARGET for r in rows)
    print(f"\n{within} of {len(rows)} records within {ACTIVATION_TARGET:.0%} per block; worst {worst.error:+.2%} ({worst.name}); "
          f"collectives equal in {sum(r.collectives_equal for r in rows)} of {len(rows)}")
    by_name = {s.torch_name: s for s in PipelineSchedule}
    schedules = [r for r in load_schedule_records(HERE / "pipeline-records") if r.error is None and r.schedule in by_name]
    agree = 0
    for record in schedules:
        parallel = ParallelSpec(pp=record.pp, pp_schedule=by_name[record.schedule], virtual_stages=record.stages_per_rank)
        planned = [in_flight_chunks(parallel, r, record.microbatches) for r in range(record.pp)]
        agree += planned == [r.peak_saved_chunks_measured for r in record.ranks]
    print(f"pipeline schedules: in-flight chunks equal on every rank in {agree} of {len(schedules)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
