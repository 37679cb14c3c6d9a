"""One torchrun launch per world size for all the measured runs the harness tests read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness_runs import PARALLEL_RUNS, RUNS, ParallelRun, Run, launch_batch


@pytest.fixture(scope="session")
def measured(tmp_path_factory) -> Callable[[Run | ParallelRun], Path]:
    """run -> its output directory; the first request for a world size launches all its runs."""
    outs: dict[Run | ParallelRun, Path] = {}

    def out_dir(run: Run | ParallelRun) -> Path:
        if run not in outs:
            batch = [r for r in (*RUNS, *PARALLEL_RUNS) if r.nproc == run.nproc]
            outs.update(launch_batch(run.nproc, batch, tmp_path_factory.mktemp(f"runs-n{run.nproc}")))
        return outs[run]

    return out_dir
