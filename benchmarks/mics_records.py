"""Measure MiCS (zero3-mics) under DeepSpeed's own engine and write the record the planner is
checked against (tests/test_mics_record.py):

    python benchmarks/mics_records.py PYTHON [OUT_FILE]
        (default benchmarks/mics-records/micro-llama-mics2-n4.json)

PYTHON is an interpreter whose DeepSpeed still has runtime/zero/mics.py: DeepSpeed 0.19 removed
MiCS (0.19.8 runtime/config.py _REMOVED_ZERO_CONFIG_KEYS), so the project's own environment cannot
run it. The record was made with a throwaway virtual environment outside the repository that
reuses the project's torch and installs DeepSpeed 0.18.9 (the last release with mics.py) over it:

    python -m venv /tmp/ds-old
    python -c "import site; print(site.getsitepackages()[0])" \\
        > /tmp/ds-old/lib/python3.11/site-packages/zz_project_venv.pth   # the project's torch 2.13
    /tmp/ds-old/bin/pip install wheel
    DS_BUILD_OPS=0 /tmp/ds-old/bin/pip install --no-deps --no-build-isolation deepspeed==0.18.9
    python benchmarks/mics_records.py /tmp/ds-old/bin/python

It launches tests/harness/mics_worker.py on 4 gloo ranks with mics_shard_size 2 and
NDEV_PER_NODE=2 (two "nodes" of two ranks: shard groups {0,1} and {2,3} inside a node, replica
groups {0,2} and {1,3} across them), micro-llama in fp32, two steps; about 4 minutes on 2 cores.
The record keeps, per rank, the model-state bytes and each step's collectives summed by
(op, phase, dtype, group).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nvme_records import run_worker, write_record

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "mics-records" / "micro-llama-mics2-n4.json"
WORKER = ROOT / "tests" / "harness" / "mics_worker.py"
RANKS, SHARD, RANKS_PER_NODE = 4, 2, 2


def summarise(collectives: list[dict]) -> list[dict]:
    """Collectives summed by (op, phase, dtype, group ranks), in first-seen order."""
    sums: dict[tuple, dict] = {}
    for c in collectives:
        key = (c["op"], c["phase"], c["dtype"], tuple(c["group_ranks"] or []))
        entry = sums.setdefault(key, {"op": c["op"], "phase": c["phase"], "dtype": c["dtype"],
                                      "group_ranks": c["group_ranks"], "calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += c["bytes"]
    return list(sums.values())


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    python, out = argv[0], Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    ranks = run_worker(python, WORKER, [str(SHARD)], RANKS, NDEV_PER_NODE=str(RANKS_PER_NODE))
    first = ranks[0]
    record = {
        "what": "MiCS under DeepSpeed's own engine: micro-llama, fp32, AdamW, micro-batch 2, seq 16, two steps",
        "command": "NDEV_PER_NODE=2 " + " ".join(["python", "-m", "torch.distributed.run", "--nproc-per-node",
                                                  str(RANKS), "tests/harness/mics_worker.py", "OUT", str(SHARD)]),
        "deepspeed": first["deepspeed"], "torch": first["torch"], "backend": "gloo",
        "world": first["world"], "mics_shard_size": first["mics_shard_size"], "ranks_per_node": RANKS_PER_NODE,
        "note": ("gloo has no coalescing manager: the worker issues MiCS's coalesced all-gather as its member "
                 "all_gather_into_tensor calls (same tensors, same group), see mics_worker._gather_one_by_one"),
        "ranks": [{
            "rank": r["rank"], "optimizer": r["optimizer"], "partition_count": r["partition_count"],
            "parameter_partition_bytes": r["parameter_partition_bytes"], "master_bytes": r["master_bytes"],
            "optimizer_state_bytes": r["optimizer_state_bytes"],
            "steps": [{"gradient_bytes": s["gradient_bytes"], "collectives": summarise(s["collectives"])}
                      for s in r["steps"]],
        } for r in ranks],
    }
    write_record(out, record)
    return 0


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    sys.exit(main(sys.argv[1:]))
