"""The process groups DeepSpeed's ZeRO-3 runs a training step's collectives on, from its own engine
(tests/harness/groups_worker.py: micro-llama, fp32, 2 gloo ranks, no mpu as under accelerate),
saved as benchmarks/deepspeed-groups-records/<release>/rank<N>.json and checked against the NCCL
communicators zeroplan.core.communicators counts (tests/test_deepspeed_groups.py). Usage:

    python benchmarks/deepspeed_zero3_groups.py [--deepspeed-src DIR --release 0.13.3]

Without --deepspeed-src the installed release runs (0.19.8); DIR is an earlier release's source
tree (`git archive v0.13.3 deepspeed op_builder accelerator` of microsoft/DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "harness" / "groups_worker.py"
RECORDS = ROOT / "benchmarks" / "deepspeed-groups-records"


def run(release: str, source: str | None, ranks: int = 2) -> Path:
    """Run the probe on ``ranks`` gloo ranks and save its records under RECORDS/release."""
    out = RECORDS / release
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)])}
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(WORKER), scratch, *([source] if source else [])]
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        for rank in range(ranks):
            record = json.loads(Path(scratch, f"rank{rank}.json").read_text(encoding="utf-8"))
            record["deepspeed_release"] = release
            (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-src", help="an earlier DeepSpeed release's source tree")
    parser.add_argument("--release", help="the release the source tree is (required with --deepspeed-src)")
    options = parser.parse_args(argv)
    if options.deepspeed_src and not options.release:
        parser.error("--deepspeed-src needs --release")
    if options.release is None:
        import importlib.metadata

        options.release = importlib.metadata.version("deepspeed")
    out = run(options.release, options.deepspeed_src)
    record = json.loads((out / "rank0.json").read_text(encoding="utf-8"))
    print(f"DeepSpeed {options.release}: " + "; ".join(
        f"{kind} " + ", ".join(f"{calls} on {group}" for group, calls in sorted(groups.items()))
        for kind, groups in sorted(record["calls"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
