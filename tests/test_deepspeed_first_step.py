"""DeepSpeed 0.14.2's ZeRO-3 step replayed from its constructed states through its first step,
which makes Adam's states, and a second (zeroplan.allocator.deepspeed_first_step): where it
applies, what the trace allocates, that its requested peak is the one-step trace's,
and that the planner's fast answers are the oracle's on it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zeroplan.allocator.deepspeed_first_step import first_step
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP
from zeroplan.allocator.schedule import record_step, step_inputs
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import checked_peak_terms, replayed
from zeroplan.specs import StrategyKind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from allocator_fast_sweep import compare  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "benchmarks" / "published_memory" / "configs" / "qwen1.5-0.5b.json")
FLAGS = ("--gpus 1 --gpu rtx-4090 --seq-len 2048 --precision fp16-mixed --framework hf --transformers-version 4.40.0 "
         "--torch-release 2.2 --deepspeed-release 0.14.2 --model-load full-per-rank --padded-batches yes")


def _request(extra: str = "", model: str = CONFIG):
    args = build_parser().parse_args(["fit", model, *FLAGS.split(), *extra.split()])
    return request_from_args(args, StrategyKind.zero3)


def _trace(request):
    states, terms = replayed(*checked_peak_terms(request))
    return states, terms, record_step(step_inputs(request, states, terms))


def test_it_applies_to_the_release_read_only() -> None:
    states, _ = checked_peak_terms(_request("--micro-batch 1"))
    assert first_step(_request("--micro-batch 1"), states) is not None
    other = _request("--micro-batch 1 --deepspeed-release 0.13.3")
    assert first_step(other, checked_peak_terms(other)[0]) is None
    bf16 = _request("--micro-batch 1 --precision bf16-mixed")
    assert first_step(bf16, checked_peak_terms(bf16)[0]) is None


def test_the_states_add_up_to_the_planners_and_adams_are_made_in_the_first_step() -> None:
    request = _request("--micro-batch 2 --activation-checkpointing full")
    states, terms, builder = _trace(request)
    made = first_step(request, states)
    assert made.flat_parameters == states.parameter_bytes
    assert sum(made.sub_group_masters) + made.master_rest + sum(made.lazy_states) == states.optimizer_state_bytes
    ops = builder.ops
    sizes = [size for kind, _, size, _ in ops if kind == ALLOC_OP]
    # The constructed states first, in the engine's order.
    assert sizes[:1 + len(made.sub_group_masters)] == [states.parameter_bytes, *made.sub_group_masters]
    freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
    kept = [i for i, (kind, ident, _, _) in enumerate(ops) if kind == ALLOC_OP and ident not in freed]
    # Never freed: the constructed states, then Adam's, made after the first step's backward
    # has freed its blocks' activations and before the second step's first allocation.
    adams = kept[-len(made.lazy_states):]
    assert [ops[i][2] for i in adams] == list(made.lazy_states)
    backward_frees = sum(1 for kind, *_ in ops[:adams[0]] if kind == FREE_OP)
    assert backward_frees > request.model.num_layers
    assert len(kept) == 1 + len(made.sub_group_masters) + (made.master_rest > 0) + 1 + len(made.lazy_states)


@pytest.mark.parametrize("micro_batch", [1, 3])
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_traces_requested_peak_is_the_one_step_traces(micro_batch: int, conf: str) -> None:
    # Only where the bytes lie moves: the second step holds what the one step held.
    request = _request(f"--micro-batch {micro_batch} --activation-checkpointing full --allocator-conf={conf}")
    states, terms, builder = _trace(request)
    one_step = record_step(replace(step_inputs(request, states, terms), deepspeed_first_step=None))
    assert builder.requested_peak_bytes == one_step.requested_peak_bytes
    # The states in fewer tensors (one flat buffer, a master per sub-group) round up less.
    assert builder.requested_peak_bytes <= builder.rounded_peak_bytes <= one_step.rounded_peak_bytes


@pytest.mark.parametrize("extra", ["--micro-batch 4 --activation-checkpointing full --allocator-conf=",
                                   "--micro-batch 4 --activation-checkpointing full --allocator-conf=expandable_segments:True",
                                   "--micro-batch 2 --allocator-conf=",
                                   "--micro-batch 3 --activation-checkpointing full --allocator-conf=max_split_size_mb:128"])
def test_the_fast_answers_are_the_oracles(extra: str) -> None:
    answers = compare(_request(extra))
    assert any(replayed for _, _, replayed in answers)
    assert all(same and difference == 0 for same, difference, _ in answers)


def test_other_releases_replay_the_optimizer_build_and_one_step() -> None:
    # Outside 0.14.2's fp16 first step the schedule replays the optimizer build measured on
    # 0.12.3's and 0.13.3's engines (zeroplan.core.deepspeed_stage3_setup), the flat parameters first.
    request = _request("--micro-batch 1 --deepspeed-release 0.13.3")
    states, terms, builder = _trace(request)
    inputs = step_inputs(request, states, terms)
    assert inputs.deepspeed_first_step is None and inputs.stage3_setup
    assert builder.ops[0][2] == states.parameter_bytes
