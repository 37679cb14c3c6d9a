"""zeroplan validate --from-log: the peak-memory lines of torchtitan, torchtune, the HF Trainer
and DeepSpeed are read as the figure and unit each stack prints (tests/fixtures/logs/README.md
says where each format comes from), compared with the prediction, and anything else refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.cli.main import main
from zeroplan.errors import ZeroplanError
from zeroplan.units import GiB, MiB
from zeroplan.validate.logs import read_log

LOGS = Path(__file__).resolve().parent / "fixtures" / "logs"


def test_torchtitan_reads_the_reserved_peak_in_gib() -> None:
    log = read_log(LOGS / "torchtitan.log")
    assert log.stack == "torchtitan"
    (reading,) = log.readings
    assert (reading.figure, reading.lines, reading.unit) == ("reserved", 3, "GiB")
    assert reading.bytes == int(43.02 * GiB)


def test_torchtune_reads_its_step_lines_not_the_init_stats() -> None:
    log = read_log(LOGS / "torchtune.log")
    figures = {r.figure: r for r in log.readings}
    assert set(figures) == {"allocated", "reserved", "active"}
    assert figures["allocated"].bytes == int(21.9049072265625 * GiB)
    assert figures["reserved"].bytes == int(24.408203125 * GiB) and figures["reserved"].lines == 3


def test_hf_adds_the_start_and_the_deltas_in_mib() -> None:
    (reading,) = read_log(LOGS / "hf_trainer.log").readings
    assert reading.figure == "allocated" and "MiB" in reading.unit
    assert reading.bytes == (0 + 15317 + 30650 + 9874) * MiB


def test_deepspeed_gb_are_gib_and_max_ca_is_rounded() -> None:
    figures = {r.figure: r for r in read_log(LOGS / "deepspeed.log").readings}
    assert figures["allocated"].bytes == int(21.36 * GiB)
    assert figures["reserved"].bytes == 25 * GiB and "rounded" in figures["reserved"].note


@pytest.mark.parametrize("name, words", [
    ("unknown_memory_line.log", "line 2: a memory line in none of the formats"),
    ("two_stacks.log", "line 2: a torchtune line in a log whose line 1 is torchtitan's"),
])
def test_unknown_and_mixed_lines_are_refused_naming_the_line(name: str, words: str) -> None:
    with pytest.raises(ZeroplanError, match=words):
        read_log(LOGS / name)


def test_an_init_only_torchtune_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "init.log"
    path.write_text("Memory stats after model init:\n\tGPU peak memory allocation: 4.21 GiB\n")
    with pytest.raises(ZeroplanError, match="line 2: torchtune's memory after model init, not a training peak"):
        read_log(path)


def test_the_command_compares_each_figure_with_the_prediction(capsys) -> None:
    argv = ["validate", "--from-log", str(LOGS / "deepspeed.log"), "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
            "--framework", "hf", "--strategies", "zero3", "--flat-reserve"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  allocated: read 21.36 GiB (peak of 3 lines, GB as printed, GiB in fact" in out
    assert "  reserved: read 25.00 GiB" in out and "allocated plus the flat 5% reserve" in out
    assert main([a if a != "zero3" else "zero2,zero3" for a in argv]) == 2
    assert "--strategies: names the one strategy the run used" in capsys.readouterr().err


# ---------------------------------------------------------------- published excerpts (published/README.md)

PUBLISHED = LOGS / "published"


@pytest.mark.parametrize("name, stack, figures", [
    ("torchtitan_pr1287.log", "torchtitan", {"reserved": (49.66, 3)}),
    ("torchtitan_pr3393.log", "torchtitan", {"reserved": (9.46, 3)}),
    ("torchtune_pr2406_mps.log", "torchtune", {"allocated": (54.96961975097656, 3), "reserved": (54.96961975097656, 3),
                                               "active": (47.32469987869263, 3)}),
    ("deepspeed_issue522_stage2.log", "deepspeed", {"allocated": (5.31, 2), "reserved": (7, 2)}),
    ("deepspeed_accelerate910_stage3.log", "deepspeed", {"allocated": (0.29, 2), "reserved": (0.31, 2)}),
])
def test_published_logs_are_read_as_printed(name: str, stack: str, figures: dict) -> None:
    log = read_log(PUBLISHED / name)
    assert log.stack == stack
    got = {r.figure: (r.bytes, r.lines) for r in log.readings}
    assert got == {figure: (int(gib * GiB), lines) for figure, (gib, lines) in figures.items()}


def test_a_published_max_ca_rounded_to_zero_is_read_as_the_ca_beside_it() -> None:
    """DeepSpeed prints Max_CA as round(max_memory_reserved / 1024**3): 'CA 0.31 GB  Max_CA 0 GB'
    is a reserved peak of 0.31 to 0.5 GiB, never the 0 it prints."""
    (reserved,) = [r for r in read_log(PUBLISHED / "deepspeed_accelerate910_stage3.log").readings if r.figure == "reserved"]
    assert reserved.bytes == int(0.31 * GiB) and "within 0.5 GiB" in reserved.note


def test_a_published_hf_block_without_before_init_is_read_with_a_note() -> None:
    (reading,) = read_log(PUBLISHED / "hf_trainer_log_metrics_docstring.log").readings
    assert reading.bytes == (230 + 693 + 7) * MiB and reading.lines == 4
    assert "no before_init_mem_gpu (transformers before 4.12)" in reading.note


@pytest.mark.parametrize("name, words", [
    ("torchtune_pr640_gpu_resources.log", "line 1: a torchtune Step line whose memory figure is not one of get_memory_stats'"),
    ("hf_trainer_pr13915_partial.log", "the HF Trainer's train metrics lack init_mem_gpu_alloc_delta"),
])
def test_published_logs_the_reader_cannot_take_are_refused_in_one_line(name: str, words: str) -> None:
    with pytest.raises(ZeroplanError, match=words) as caught:
        read_log(PUBLISHED / name)
    assert "\n" not in str(caught.value)
