"""Shared fixtures: a catalog-independent GPU so core tests do not depend on the catalog."""

from __future__ import annotations

import atexit
import gc
import subprocess
from pathlib import Path

import pytest

# Fixtures that launch torchrun (tests/harness/conftest.py, tests/harness/test_deepspeed.py): a test
# that uses one is slow. `pytest -m "not slow"` leaves them out; .ci/run runs everything.
SLOW_FIXTURES = frozenset({"measured", "runs"})
HARNESS = Path(__file__).resolve().parent / "harness"


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The harness's measured runs are launched in the background once the tests are collected
    # (tests/harness/conftest.py), at a lower CPU priority: the in-process tests come first,
    # which leave a core idle for them, then the harness's other tests (torchrun launches of
    # their own, which take both cores), then the tests that read the runs, each group in its
    # own order.
    items.sort(key=lambda item: ("measured" in getattr(item, "fixturenames", ()), item.path.is_relative_to(HARNESS)))


# What collection builds (the test modules, their tables computed at import) and what each test
# leaves alive (the planner's caches, shared fixtures) lives to the session's end, yet each of
# Python's full collections would walk it all again, about a fifth of the quick run: it is moved
# out of the collector's reach (gc.freeze) once collected and after each test, the young
# generations collected first. Inside a test the collector runs as it always does, and reference
# counting still frees what was frozen; a cycle a test left in the oldest generation is freed
# only at exit.
def pytest_collection_finish(session) -> None:
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails on a subprocess's exit status shows what the subprocess printed last: the
    CalledProcessError alone names the command, and a run on another machine leaves nothing else
    to find the cause by."""
    outcome = yield
    report = outcome.get_result()
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, subprocess.CalledProcessError):
        for name, text in (("stdout", error.stdout), ("stderr", error.stderr)):
            if isinstance(text, bytes):
                text = text.decode(errors="replace")
            if text:
                report.sections.append((f"failed subprocess {name} (last 4,000 characters)", text[-4000:]))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location) -> None:
    gc.collect(1)
    gc.freeze()


# Back in reach at the interpreter's exit, whose last collection frees it (and extensions check
# that it was freed); pytest's own collections at its end still find only what is not frozen.
atexit.register(gc.unfreeze)

from zeroplan.specs import GpuSpec, LinkSpec
from zeroplan.units import GiB


@pytest.fixture
def gpu_80gib() -> GpuSpec:
    link = LinkSpec(name="test link", bandwidth_bytes_per_s=100e9, latency_s=5e-6)
    return GpuSpec(
        name="test-80gib", display_name="Test 80 GiB", memory_bytes=80 * GiB,
        peak_bf16_flops_per_s=300e12, intra_node_link=link, inter_node_link=link,
        host_link=link, source="test fixture",
    )


@pytest.fixture
def zeroplan_cli(capsys):
    """Run ``zeroplan ARGV...`` in process: (exit status, stdout, stderr); argparse's own
    errors (SystemExit) give their status too."""
    from zeroplan.cli.main import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
