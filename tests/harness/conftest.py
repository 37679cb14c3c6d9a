"""One torchrun launch per world size for all the measured runs the harness tests read, launched in
the background as soon as the session's tests are collected; the harness's tests run after the
session's other tests, and the tests that read the runs last (tests/conftest.py), so the launches
take the core that the in-process tests leave idle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness_runs import AnyRun, BackgroundLaunches, DeepSpeedRun, ParallelRun, ProbeRun, Run

RUN_TYPES = (Run, ParallelRun, DeepSpeedRun, ProbeRun)
LAUNCHES = pytest.StashKey[BackgroundLaunches]()


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


def _launches(config: pytest.Config) -> BackgroundLaunches:
    if LAUNCHES not in config.stash:
        config.stash[LAUNCHES] = BackgroundLaunches(timeout_s=1200)
    return config.stash[LAUNCHES]


def pytest_collection_finish(session: pytest.Session) -> None:
    """The batches the selected tests name are launched now, before the first test runs."""
    if session.config.option.collectonly:
        return
    for nproc in known_world_sizes(session.items):
        _launches(session.config).ask(nproc)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if LAUNCHES in session.config.stash:
        session.config.stash[LAUNCHES].stop()


@pytest.fixture(scope="session")
def measured(request) -> Callable[[AnyRun], Path]:
    """run -> its output directory, once its world size's launch has ended."""
    launches = _launches(request.config)

    def out_dir(run: AnyRun) -> Path:
        return launches.out_dirs(run.nproc)[run]

    return out_dir
