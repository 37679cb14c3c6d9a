"""Pairing of benchmarks/published_memory_slopes.py: rows that describe one run but for the
micro-batch (or the sequence length) pair; rows that differ in anything else do not."""

import sys
from pathlib import Path

import pytest

from zeroplan.results import PeakMoment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from published_memory_slopes import Slope, find_pairs, slopes_of  # noqa: E402
from published_memory_accuracy import load_rows  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {row["id"]: row for row in load_rows()}


def ids(pairs):
    return {(p.axis, p.low["id"], p.high["id"]) for p in pairs}


def test_finds_the_published_micro_batch_and_sequence_pairs(rows):
    found = ids(find_pairs(list(rows.values())))
    assert ("micro_batch", "fq-3090-7b-lora-b4", "fq-3090-7b-lora-b6") in found
    assert ("micro_batch", "fq-3090-7b-lora-2048", "fq-3090-7b-lora-b4") in found
    assert ("seq_len", "fq-3090-7b-lora-512-alloc", "fq-3090-7b-lora-2048-alloc") in found
    # The 4090 table's batch-6 figure repeats the 3090 table's configuration and figure: one point.
    assert not any("fq-4090-7b-lora-b6" in pair for pair in found)
    # An allocated row never pairs with a reserved one, nor an OOM row (no figure) with anything.
    assert ("seq_len", "fq-3090-7b-lora-512-alloc", "fq-3090-7b-lora-2048") not in found
    assert not any(row_id.endswith("-oom") for pair in found for row_id in pair[1:])


def _with(row, **changes):
    return {**row, **changes}


@pytest.mark.parametrize("changes", [
    {"gpu": "a100-80gb"},
    {"strategy": "fsdp-shard-grad-op"},
    {"lora_rank": "16"},
    {"grad_accum": "2"},
    {"activation_checkpointing": "none"},
    {"metric": "allocated"},
    {"source": "https://example.org/another-source"},
    {"extra_flags": "--lora-targets q,v --lora-dropout 0.1 --transformers-version 4.38.2 --keep-outputs --peft-version 0.10.0"},
    {"seq_len": "1024"},
])
def test_refuses_rows_that_differ_in_anything_else(rows, changes):
    low, high = rows["fq-3090-7b-lora-b4"], rows["fq-3090-7b-lora-b6"]
    assert len(find_pairs([low, high])) == 1
    assert find_pairs([low, _with(high, **changes)]) == []


def test_flags_compare_as_parsed_options(rows):
    """The same flags in another order are the same run."""
    low, high = rows["fq-3090-7b-lora-b4"], rows["fq-3090-7b-lora-b6"]
    reordered = "--peft-version 0.10.0 --keep-outputs --lora-dropout 0.1 --transformers-version 4.38.2 --lora-targets q,k,v,o,gate,up,down"
    assert len(find_pairs([low, _with(high, extra_flags=reordered)])) == 1


def test_slope_is_per_extra_sample(rows):
    low, high = rows["fq-3090-7b-lora-b4"], rows["fq-3090-7b-lora-b6"]
    (slope,), failed = slopes_of(find_pairs([low, high]))
    assert failed == []
    gib = 2**30
    measured = (float(high["measured_value"]) - float(low["measured_value"])) * float(low["unit_bytes"]) / 2 / gib
    assert slope.measured_gib == pytest.approx(measured)
    assert slope.ratio == pytest.approx(slope.predicted_gib / measured)


def test_pairs_a_micro_batch_sweep_at_a_fixed_global_batch_on_its_own_axis(rows):
    found = ids(find_pairs(list(rows.values())))
    assert ("micro_batch@global", "swift-dec-qwen-7b-chat-lora-b2", "swift-dec-qwen-7b-chat-lora-b4") in found
    assert ("micro_batch@global", "swift-dec-qwen-7b-chat-lora-2048", "swift-dec-qwen-7b-chat-lora-b2") in found
    # Neither sweep pairs on the plain micro-batch axis: their grad_accum differs too.
    assert not any(axis == "micro_batch" and low.startswith("swift-") for axis, low, _ in found)


@pytest.mark.parametrize("grad_accum", ["5", "1"])
def test_refuses_a_micro_batch_pair_whose_global_batch_differs_or_that_does_not_accumulate(rows, grad_accum):
    low, high = rows["swift-dec-qwen-7b-chat-lora-b2"], rows["swift-dec-qwen-7b-chat-lora-b4"]
    assert len(find_pairs([low, high])) == 1
    assert find_pairs([low, _with(high, grad_accum=grad_accum)]) == []


def test_marks_a_pair_whose_predicted_peak_changes_moment(rows):
    """A pair whose two predicted peaks are at different moments of the step is marked (its
    slope is no one term's growth), and its ratio still computed."""
    (pair,) = find_pairs([rows["fq-3090-7b-lora-b4"], rows["fq-3090-7b-lora-b6"]])
    switch = Slope(pair, 2.0, 1.0, 1.0, ("block-backward", "loss-backward"))
    same = Slope(pair, 2.0, 1.0, 1.0, ("loss-backward", "loss-backward"))
    assert not switch.same_moment and same.same_moment
    assert switch.ratio == same.ratio == 0.5
    assert Slope(pair, 0.0, 1.0, 1.0, ("loss-backward",) * 2).ratio is None
    # The planned pair carries the planner's own moment names (PeakMoment values).
    (planned,), _ = slopes_of([pair])
    assert set(planned.moments) <= {moment.value for moment in PeakMoment}
