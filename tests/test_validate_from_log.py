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



def test_the_command_takes_the_runs_deepspeed_config(tmp_path: Path, capsys) -> None:
    """With --deepspeed-config the file's strategy is the run's, and its settings are planned."""
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}, "bf16": {"enabled": true}}')
    argv = ["validate", "--from-log", str(LOGS / "deepspeed.log"), "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
            "--framework", "hf", "--flat-reserve", "--deepspeed-config", str(config)]
    assert main(argv) == 0
    assert "Prediction: zero3" in capsys.readouterr().out
    assert main([*argv, "--strategies", "zero2"]) == 2
    assert "--strategies: zero2: the --deepspeed-config file runs zero3" in capsys.readouterr().err


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


# ---------------------------------------------------------------- torch.cuda.memory._snapshot() pickles

HARNESS = LOGS / "harness"


def _pickle(tmp_path: Path, snapshot) -> Path:
    import pickle

    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    return path


def test_the_harness_snapshot_replays_to_the_records_allocator_peak() -> None:
    """tests/fixtures/logs/harness: rank 0 of `zeroplan measure micro-llama --strategy zero3 --nproc 2
    --steps 2 --micro-batch 2 --seq-len 16 --memory-snapshot`, with its record: the snapshot's
    trace, replayed, peaks where the record's CPU-allocator peak does."""
    from zeroplan.harness.record import read_record

    log = read_log(HARNESS / "rank00000.snapshot.pickle")
    (reading,) = log.readings
    record = read_record(HARNESS / "rank00000.json")
    assert reading.figure == "allocated" and reading.lines > 1000
    assert reading.bytes == max(step.memory.allocator_peak_bytes for step in record.steps)


def test_a_cuda_shaped_snapshot_reads_allocated_reserved_and_active(tmp_path: Path) -> None:
    """The layout torch.cuda.memory._snapshot() returns, with a trace that began after a live
    block (a ring buffer that wrapped): the replay is anchored on the segments' sizes."""
    segments = [{"device": 0, "address": 0, "total_size": 6 * MiB, "allocated_size": 3 * MiB, "active_size": 3 * MiB,
                 "requested_size": 3 * MiB, "stream": 0, "segment_type": "large", "blocks": []}]
    trace = [{"action": "alloc", "addr": 10, "size": 2 * MiB, "stream": 0},
             {"action": "segment_alloc", "addr": 0, "size": 2 * MiB, "stream": 0},
             {"action": "alloc", "addr": 20, "size": 4 * MiB, "stream": 0},
             {"action": "free_requested", "addr": 20, "size": 4 * MiB, "stream": 0},
             {"action": "free_completed", "addr": 20, "size": 4 * MiB, "stream": 0}]
    figures = {r.figure: r for r in read_log(_pickle(tmp_path, {"segments": segments, "device_traces": [trace]})).readings}
    # replay: +2, +4, -4 -> highest 6, last 2; 3 MiB allocated at the end: 1 MiB live before the trace
    assert figures["allocated"].bytes == 7 * MiB and "anchored" in figures["allocated"].note
    assert figures["reserved"].bytes == 6 * MiB  # 4 MiB reserved before the trace, + 2
    assert figures["active"].bytes == 3 * MiB and "not a peak" in figures["active"].note


@pytest.mark.parametrize("snapshot, words", [
    ([1, 2], "not torch.cuda.memory._snapshot()'s dict"),
    ({"device_traces": [[{"action": "alloc", "addr": 1}]]}, "a alloc trace entry without a byte size"),
    ({"segments": [], "device_traces": [[]]}, "has no allocation event and no segment"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 8}], [{"action": "alloc", "addr": 1, "size": 8}]]},
     "traces 2 devices"),
])
def test_snapshots_it_cannot_read_are_refused_in_one_line(tmp_path: Path, snapshot, words: str) -> None:
    with pytest.raises(ZeroplanError, match=None) as caught:
        read_log(_pickle(tmp_path, snapshot))
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_pickle_that_names_a_class_is_refused_unrun(tmp_path: Path) -> None:
    import datetime

    with pytest.raises(ZeroplanError, match="is a pickle but not a memory snapshot: it names datetime.date"):
        read_log(_pickle(tmp_path, {"segments": [], "device_traces": [], "when": datetime.date(2026, 1, 1)}))


def test_validate_from_log_reads_the_harness_snapshot(tmp_path: Path, capsys) -> None:
    from zeroplan.harness.presets import HARNESS_PRESETS

    spec = HARNESS_PRESETS["micro-llama"]
    config = tmp_path / "micro-llama.json"
    import json

    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.ffn_hidden_size,
        "max_position_embeddings": spec.max_positions, "tie_word_embeddings": False, "hidden_act": "silu"}))
    argv = ["validate", "--from-log", str(HARNESS / "rank00000.snapshot.pickle"), str(config), "--gpus", "2",
            "--gpu", "a100-80gb", "--strategies", "zero3", "--precision", "fp32", "--micro-batch", "2", "--seq-len", "16",
            "--flat-reserve"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ": a torch.cuda.memory._snapshot() pickle" in out
    assert "  allocated: read 0.31 MiB (peak of " in out and " events, bytes; peak of the device_traces replay" in out
