"""What `zeroplan fit` and `compare` import: the command's start is most of its time
(benchmarks/cli_latency.py), so the table and frame libraries and torch stay out of it; they
load only where asked (--format csv, validate --plot, the measurement commands)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "pandas", "matplotlib", "torch", "scipy")

# Loaded where they are used, never by these commands: each was part of the start for nothing
# (json for a file argument, difflib for a misspelt name, statistics where the default efficiency
# is fitted, shlex for --emit, megatron-core's terms for its own framework, the efficiency file's
# models for --efficiency FILE: the time-basis line comes from zeroplan.calibrate.basis; the
# config.json readers for the presets read from one, built only when asked for by name; the plan
# search's table).
LAZY = ("json", "difflib", "statistics", "shlex", "zeroplan.core.megatron", "zeroplan.calibrate.step",
        "zeroplan.presets.hf_config", "zeroplan.report.search_table")

# Models these commands never validate: their validators are built on first use (defer_build).
DEFERRED = ("zeroplan.calibrate.step:StepEfficiency", "zeroplan.answers:PlanSearchResult",
            "zeroplan.results:PlanCandidate", "zeroplan.core.roofline.step:RooflineStep",
            "zeroplan.allocator.capacity:AllocatorVerdict", "zeroplan.answers:FitReport",
            "zeroplan.results:StrategyPlan", "zeroplan.results:MemoryBreakdown", "zeroplan.core.timing:StepTime",
            "zeroplan.core.algorithms:CollectiveTime", "zeroplan.core.collective:Collective",
            "zeroplan.core.roofline.operations:Operation", "zeroplan.allocator.capacity:BandScan",
            "zeroplan.allocator.planner:PlannedVerdict", "zeroplan.allocator.replay:ReplayResult")


@pytest.mark.slow  # one interpreter per command
@pytest.mark.parametrize("argv", [
    ["fit", "llama-3.1-405b", "--gpus", "65536", "--gpu", "h100-80gb"],
    ["fit", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--detail"],
    ["compare", "llama-2-70b", "--gpus", "64", "--gpu", "h100-80gb"],
])
def test_fit_and_compare_import_no_frame_plot_or_torch_library_nor_what_they_do_not_use(argv: list[str]) -> None:
    program = (
        "import contextlib, io, sys\n"
        "from zeroplan.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main({argv!r}) == 0\n"
        f"print(' '.join(name for name in {HEAVY + LAZY!r} if name in sys.modules))\n"
        "import importlib\n"
        f"for module, name in (entry.split(':') for entry in {DEFERRED!r}):\n"
        "    assert not getattr(importlib.import_module(module), name).__pydantic_complete__, name\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{' '.join(argv)} imported {result.stdout.strip()}"


def test_the_command_skips_pydantic_plugin_discovery_where_the_user_has_not_chosen() -> None:
    from zeroplan.cli.main import skip_pydantic_plugin_discovery

    environ: dict[str, str] = {}
    skip_pydantic_plugin_discovery(environ)
    assert environ == {"PYDANTIC_DISABLE_PLUGINS": "__all__"}
    for chosen in ("", "logfire"):  # empty: every plugin loads; a name: all but that one
        environ = {"PYDANTIC_DISABLE_PLUGINS": chosen}
        skip_pydantic_plugin_discovery(environ)
        assert environ == {"PYDANTIC_DISABLE_PLUGINS": chosen}


def test_the_command_runs_numpy_on_one_blas_thread_where_the_user_has_not_chosen() -> None:
    from zeroplan.cli.main import single_blas_thread

    environ: dict[str, str] = {}
    single_blas_thread(environ)
    assert environ == {"OPENBLAS_NUM_THREADS": "1"}
    environ = {"OPENBLAS_NUM_THREADS": "8"}
    single_blas_thread(environ)
    assert environ == {"OPENBLAS_NUM_THREADS": "8"}


def test_pydantic_plugin_loader_is_stood_in_for_only_where_every_plugin_is_disabled() -> None:
    from zeroplan.cli import no_pydantic_plugins
    from zeroplan.cli.no_pydantic_plugins import LOADER, install

    for disabled in ("__all__", "1", "true"):
        modules: dict = {}
        assert install({"PYDANTIC_DISABLE_PLUGINS": disabled}, modules)
        assert modules == {LOADER: no_pydantic_plugins}
    for chosen in ({}, {"PYDANTIC_DISABLE_PLUGINS": ""}, {"PYDANTIC_DISABLE_PLUGINS": "logfire"}):
        modules = {}
        assert not install(chosen, modules)
        assert modules == {}
    already = object()
    modules = {LOADER: already}  # pydantic's own, imported before: kept
    assert not install({"PYDANTIC_DISABLE_PLUGINS": "__all__"}, modules)
    assert modules == {LOADER: already}


def test_the_stand_in_answers_as_pydantics_loader_does_with_every_plugin_disabled(monkeypatch) -> None:
    from pydantic.plugin import _loader

    from zeroplan.cli import no_pydantic_plugins

    monkeypatch.setenv("PYDANTIC_DISABLE_PLUGINS", "__all__")
    assert list(no_pydantic_plugins.get_plugins()) == list(_loader.get_plugins()) == []
    assert no_pydantic_plugins.PYDANTIC_ENTRY_POINT_GROUP == _loader.PYDANTIC_ENTRY_POINT_GROUP


@pytest.mark.slow  # one interpreter
def test_the_command_as_a_process_skips_the_plugin_loaders_imports_and_validates_as_before() -> None:
    # main() with no argv is the command (python -m zeroplan): it stands in for pydantic's loader.
    argv = ["fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb"]
    program = (
        "import contextlib, io, os, sys\n"
        "os.environ.pop('PYDANTIC_DISABLE_PLUGINS', None)\n"
        f"sys.argv = ['zeroplan', *{argv!r}]\n"
        "from zeroplan.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert main() == 0\n"
        "from zeroplan.cli import no_pydantic_plugins\n"
        "assert sys.modules['pydantic.plugin._loader'] is no_pydantic_plugins\n"
        "assert 'importlib.metadata' not in sys.modules\n"
        "print(out.getvalue(), end='')\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import contextlib
    import io

    from zeroplan.cli.main import main

    expected = io.StringIO()
    with contextlib.redirect_stdout(expected):
        assert main(argv) == 0
    assert result.stdout == expected.getvalue()


@pytest.mark.parametrize("at_exit", [False, True])
def test_the_command_ends_with_its_status_and_flushed_streams_and_runs_what_is_registered_at_exit(at_exit: bool) -> None:
    program = (
        "import atexit, sys\n"
        + ("atexit.register(lambda: print('ran at exit'))\n" if at_exit else "")
        + "from zeroplan.cli.main import exit_without_teardown\n"
        "print('answer', end='')\n"
        "sys.stderr.write('note')\n"
        "exit_without_teardown(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "answer" + ("ran at exit\n" if at_exit else ""), "note")


@pytest.mark.slow  # one interpreter per command
@pytest.mark.parametrize("argv", [
    ["fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb"],
    ["plan", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "64"],
])
def test_the_command_does_not_import_shutil(argv: list[str]) -> None:
    # argparse's HelpFormatter imports shutil for the terminal's width whenever it is made (at
    # every add_argument on a parser): the command's parsers take it from terminal_columns. As
    # the command runs (python -m zeroplan: pydantic's plugin discovery, whose zipfile would
    # import shutil, stood in for), -X importtime lists every module it imports.
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "zeroplan", *argv], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "zeroplan.cli.parser" in imported
    assert "shutil" not in imported


@pytest.mark.parametrize("columns", [None, "", "wide", "0", "-3", "57", "240"])
@pytest.mark.parametrize("fallback", [80, 100])
def test_terminal_columns_are_shutils(monkeypatch: pytest.MonkeyPatch, columns: str | None, fallback: int) -> None:
    import shutil

    from zeroplan.cli.parser import terminal_columns

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    for lines in (None, "0", "30"):  # shutil asks the terminal where either variable is unset
        if lines is None:
            monkeypatch.delenv("LINES", raising=False)
        else:
            monkeypatch.setenv("LINES", lines)
        assert terminal_columns(fallback) == shutil.get_terminal_size((fallback, 24)).columns


def test_the_parsers_help_formatter_is_as_wide_as_argparses(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from zeroplan.cli.parser import OneLineParser

    for columns in ("60", "200"):
        monkeypatch.setenv("COLUMNS", columns)
        ours = OneLineParser(prog="zeroplan")._get_formatter()
        theirs = argparse.ArgumentParser(prog="zeroplan")._get_formatter()
        assert (ours._width, ours._max_help_position) == (theirs._width, theirs._max_help_position)
