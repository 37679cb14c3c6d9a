"""One torchrun launch per world size for all the measured runs the harness tests read, launched in
the background when the session's first harness test starts; the tests that read them run last
(tests/conftest.py), the session's other tests run meanwhile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness_runs import AnyRun, BackgroundLaunches, DeepSpeedRun, ParallelRun, ProbeRun, Run

RUN_TYPES = (Run, ParallelRun, DeepSpeedRun, ProbeRun)


def known_world_sizes(items: list[pytest.Item]) -> list[int]:
    """The world sizes of the runs the session's tests read that their parameters name, in the
    order the tests come; a test that names none asks for its batch when it reads a run."""
    sizes: list[int] = []
    for item in items:
        if "measured" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        for value in params.values():
            if isinstance(value, RUN_TYPES) and value.nproc not in sizes:
                sizes.append(value.nproc)
    return sizes


@pytest.fixture(scope="session", autouse=True)
def background_launches(request, tmp_path_factory) -> Iterator[BackgroundLaunches]:
    """Started by the session's first harness test: the batches its tests will read are launched now."""
    launches = BackgroundLaunches(tmp_path_factory.mktemp("runs"), timeout_s=1200)
    for nproc in known_world_sizes(request.session.items):
        launches.ask(nproc)
    yield launches
    launches.stop()


@pytest.fixture(scope="session")
def measured(background_launches: BackgroundLaunches) -> Callable[[AnyRun], Path]:
    """run -> its output directory, once its world size's launch has ended."""

    def out_dir(run: AnyRun) -> Path:
        return background_launches.out_dirs(run.nproc)[run]

    return out_dir
