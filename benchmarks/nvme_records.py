"""Measure DeepSpeed's NVMe optimizer swapper (zero3-nvme) and write the record the planner is
checked against (tests/test_nvme_record.py):

    python benchmarks/nvme_records.py [OUT_FILE]
        (default benchmarks/nvme-records/tiny-llama-swapper.json)

Needs DeepSpeed's async_io op, which builds on first use where libaio's headers are installed
(Debian: apt-get install libaio-dev); without it DeepSpeed refuses offload to NVMe. Each run
launches tests/harness/nvme_worker.py on one gloo rank: tiny-llama in fp32, sub_group_size 3e6
(four sub-groups of about 3.1M elements, each past DeepSpeed's 1 MiB swap minimum), two steps,
with the optimizer swapper unpipelined, pipelined on reads, on writes, on both, and on both
with a pool one sub-group short; then zero3-param-nvme (bf16-mixed) with the parameter buffers
the planner sizes and one element smaller. A few minutes on 2 cores once the op is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from zeroplan.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "nvme-records" / "tiny-llama-swapper.json"
WORKER = ROOT / "tests" / "harness" / "nvme_worker.py"
SUB_GROUP_SIZE = 3_000_000
RUNS = [("none", 4), ("read", 8), ("write", 8), ("both", 12), ("both", 8)]
"""(pipeline, buffer_count): the planner's count for each pipeline, then both on 8."""
LARGEST_PARTITION, MAX_IN_CPU = 3_145_728, 3_200_000
PARAM_RUNS = [LARGEST_PARTITION, LARGEST_PARTITION - 1]
"""offload_param.buffer_size of the zero3-param-nvme runs: the largest parameter partition (the
embedding's, on one rank), then one element short; max_in_cpu 3.2e6 keeps the first sub-group
on the host and sends the other three to NVMe."""


def run_worker(python: str, worker: Path, args: list[str], ranks: int = 1, **env: str) -> list[dict]:
    """``worker`` on ``ranks`` gloo ranks under torch.distributed.run (DeepSpeed's CPU accelerator),
    a scratch folder its first argument: the rank<N>.json each rank wrote there. A failed run's
    output tails go to stderr and the script exits with its status. Shared with mics_records.py."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(worker), tmp, *args]
        run = subprocess.run(command, env=dict(os.environ, **env, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT)),
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stdout[-3000:] + run.stderr[-3000:], file=sys.stderr)
            raise SystemExit(run.returncode)
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(ranks)]


def write_record(out: Path, record: dict) -> None:
    """``record`` as indented JSON at ``out``, its folder made. Shared with mics_records.py."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    runs = []
    for pipeline, buffers, extra in [(p, b, []) for p, b in RUNS] + [("none", 4, [str(size), str(MAX_IN_CPU)])
                                                                     for size in PARAM_RUNS]:
        runs += run_worker(sys.executable, WORKER, [str(SUB_GROUP_SIZE), pipeline, str(buffers), *extra])
        print(f"{pipeline} x {buffers} {' '.join(extra)}: {runs[-1].get('most_buffers_held_in_step')} buffers at most, "
              f"{runs[-1]['error']}")
    record = {
        "what": "DeepSpeed's optimizer swapper to NVMe: tiny-llama, fp32, torch AdamW, micro-batch 1, seq 16, two steps",
        "command": "python benchmarks/nvme_records.py (tests/harness/nvme_worker.py OUT 3000000 PIPELINE BUFFER_COUNT "
                   "[PARAM_BUFFER_SIZE 3200000] on one gloo rank, per run)",
        "deepspeed": runs[0]["deepspeed"], "torch": runs[0]["torch"], "backend": "gloo",
        "runs": runs,
    }
    write_record(out, record)
    return 0


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    sys.exit(main(sys.argv[1:]))
