"""One torchrun launch per world size for all the measured runs the harness tests read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness_runs import (
    DEEPSPEED_RUNS,
    PARALLEL_RUNS,
    RUNS,
    AnyRun,
    DeepSpeedRun,
    ProbeRun,
    launch_batch,
)

from zeroplan.harness.extension_locks import check_no_stale_extension_lock


@pytest.fixture(scope="session")
def measured(tmp_path_factory) -> Callable[[AnyRun], Path]:
    """run -> its output directory; the first request for a world size launches all its runs."""
    outs: dict[AnyRun, Path] = {}

    def out_dir(run: AnyRun) -> Path:
        if run not in outs:
            batch = [r for r in (*RUNS, *PARALLEL_RUNS, *DEEPSPEED_RUNS) if r.nproc == run.nproc]
            if any(isinstance(r, DeepSpeedRun | ProbeRun) for r in batch):
                # A stale JIT build lock would make DeepSpeed's runs wait out the whole time limit.
                check_no_stale_extension_lock()
            outs.update(launch_batch(run.nproc, batch, tmp_path_factory.mktemp(f"runs-n{run.nproc}"), timeout_s=1200))
        return outs[run]

    return out_dir
