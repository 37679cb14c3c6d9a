"""benchmarks/swift_full_lazy_states.py: the epoch it replays makes the gradients in each
accumulation window's first backward and frees them after the step, and the AdamW states at the
first step, or all of them before the first batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP

LAZY = load_script(Path(__file__).parents[1] / "benchmarks" / "swift_full_lazy_states.py")
FLAGS = ["fit", "qwen-1.8b", "--gpu", "a100-80gb", "--activation-checkpointing", "full", "--precision", "bf16-pure",
         "--framework", "hf", "--transformers-version", "4.36", "--torch-release", "2.1", "--grad-accum", "2"]


def _model():
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.specs.strategy import StrategyKind

    return request_from_args(build_parser().parse_args([*FLAGS, "--seq-len", "64"]), StrategyKind.ddp).model


# About 0.1 s (two lengths' planner steps): over the quick suite's budget for one test.
@pytest.mark.slow
def test_lazy_epoch_makes_gradients_per_window_and_states_at_the_first_step() -> None:
    model = _model()
    wte, blocks, tail = LAZY.qwen1_parameters(model)
    parameters = len(wte) + sum(map(len, blocks)) + len(tail)
    steps = LAZY.Steps(FLAGS)
    ops = LAZY.epoch_ops(steps, [48, 64, 48, 64], model, accum=2, lazy=True)
    ids = [ident for kind, ident, _, _ in ops if kind == ALLOC_OP and ident >= LAZY.MODEL_STATE_IDS]
    freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
    # Parameters and both states live on; two windows' gradients and two steps' temporaries
    # are freed, as are the later backwards' accumulation temporaries.
    kept = [ident for ident in ids if ident not in freed]
    assert len(kept) == 3 * parameters
    first_body = next(i for i, op in enumerate(ops) if op[1] < LAZY.MODEL_STATE_IDS)
    states = kept[parameters:]
    positions = {op[1]: i for i, op in enumerate(ops) if op[0] == ALLOC_OP}
    assert min(positions[ident] for ident in states) > first_body
    up_front = LAZY.epoch_ops(steps, [48, 64, 48, 64], model, accum=2, lazy=False)
    first_body = next(i for i, op in enumerate(up_front) if op[1] < LAZY.MODEL_STATE_IDS)
    assert sum(1 for op in up_front[:first_body] if op[0] == ALLOC_OP) == 4 * parameters


def test_segments_at_oom_name_what_splits_the_segment_the_request_needed() -> None:
    # A 1 GiB loss tensor's segment, freed, then split by a 0.75 GiB state made later: a second
    # 1 GiB request on 1.5 GiB can neither use it nor have it released.
    gib = 2**30
    ops = [(ALLOC_OP, 1, gib, 0), (FREE_OP, 1, 0, 0), (ALLOC_OP, 2, 3 * gib // 4, 0), (ALLOC_OP, 3, gib, 0)]
    lines = LAZY.segments_at_oom(ops, {1: "loss", 2: "state", 3: "loss"}, 3 * gib // 2)
    assert lines == ["  at the failed 1.00 GiB request (1.00 GiB reserved), the segments of at least half its size:",
                     "    segment 1.00 GiB: free 0.25 (largest 0.25); state 0.75"]
    # With room for a second segment nothing runs out.
    assert LAZY.segments_at_oom(ops, {}, 2 * gib) == []
