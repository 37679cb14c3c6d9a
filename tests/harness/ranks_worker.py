"""Per-rank entry point for tests: several measured runs in one torchrun launch.

    torchrun --nproc-per-node 2 tests/harness/ranks_worker.py runs.json

runs.json is a list of {"name", "argv", "out", "save_parameters"}; each argv is parsed by the
real per-rank parser (``python -m zeroplan.harness``) and run by the real runner, one after the
other on one process group. Starting torch and gloo costs far more than a micro model's run,
so the harness tests batch their runs. An entry {"name", "probe", "args"} instead runs one of
the probes beside this file on the same process group with the arguments its own command
line takes ("hpz": hpz_worker.py OUT HPZ; "offload_copies": offload_copies_worker.py OUT
STAGE:ACCUM...; "groups": groups_worker.py OUT). A failing run prints one line naming it; exit 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zeroplan.harness.__main__ import build_parser, config_from_args, exit_rank, run_and_save
from zeroplan.harness.runner import init_distributed


def _run_probe(probe: str, args: list[str]) -> None:
    if probe == "hpz":
        import hpz_worker

        hpz_worker.write_record(args[0], int(args[1]))
    elif probe == "groups":
        import groups_worker

        groups_worker.write_record(args[0])
    elif probe == "offload_copies":
        import offload_copies_worker

        offload_copies_worker.write_records(args[0], args[1:])
    else:
        raise ValueError(f"unknown probe {probe!r}")


def main(spec_path: str) -> int:
    import torch.distributed as dist

    runs = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    init_distributed("gloo")
    for run in runs:
        try:
            if "probe" in run:
                _run_probe(run["probe"], run["args"])
                continue
            args = build_parser().parse_args([*run["argv"], "--out", run["out"]])
            run_and_save(config_from_args(args), Path(run["out"]), run["save_parameters"])
        except Exception as error:
            sys.stderr.write(f"zeroplan measure: run {run['name']} failed on rank {dist.get_rank()}: "
                             f"{type(error).__name__}: {error}\n")
            return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1]))
