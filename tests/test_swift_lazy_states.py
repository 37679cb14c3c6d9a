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
    ids = [ident for kind, ident, _, _ in ops if kind == ALLOC_OP and ident >= 10**9]
    freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
    # Parameters and both states live on; two windows' gradients and two steps' temporaries
    # are freed, as are the later backwards' accumulation temporaries.
    kept = [ident for ident in ids if ident not in freed]
    assert len(kept) == 3 * parameters
    first_body = next(i for i, op in enumerate(ops) if op[1] < 10**9)
    states = kept[parameters:]
    positions = {op[1]: i for i, op in enumerate(ops) if op[0] == ALLOC_OP}
    assert min(positions[ident] for ident in states) > first_body
    up_front = LAZY.epoch_ops(steps, [48, 64, 48, 64], model, accum=2, lazy=False)
    first_body = next(i for i, op in enumerate(up_front) if op[1] < 10**9)
    assert sum(1 for op in up_front[:first_body] if op[0] == ALLOC_OP) == 4 * parameters
