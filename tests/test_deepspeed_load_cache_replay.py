"""benchmarks/deepspeed_zero3_load_cache.py engine_from: the run's events from a start time as an
allocation trace, what is live at the start held as one block or (held_each) tensor by tensor,
each freed where the run frees it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from deepspeed_zero3_load_cache import engine_from  # noqa: E402

from zeroplan.allocator.trace import AllocEvent, FreeEvent  # noqa: E402

MiB = 2**20
# Two tensors live at t=10 (one freed at t=20), one made at t=30: sizes of 1 MiB and more are
# scaled by 256 (deepspeed_zero3_fp16_streams._scaled).
RESULT = {"ranges": [], "events": [(1, MiB, 100, "aten::empty"), (2, 2 * MiB, 200, "aten::empty"),
                                   (20, -MiB, 100, "aten::mul"), (30, 4 * MiB, 300, "aten::empty"),
                                   (40, -4 * MiB, 300, "aten::mul")]}


def test_held_as_one_block_keeps_what_the_run_frees() -> None:
    trace, held = engine_from(RESULT, 10, 50, True)
    assert held == 3 * 256 * MiB
    assert [type(e) for e in trace.events] == [AllocEvent, AllocEvent, FreeEvent]
    assert trace.events[0].size_bytes == held


def test_held_each_frees_each_tensor_where_the_run_does() -> None:
    trace, held = engine_from(RESULT, 10, 50, True, held_each=True)
    assert held == 3 * 256 * MiB
    events = trace.events
    assert [(type(e), getattr(e, "size_bytes", None)) for e in events] == [
        (AllocEvent, 256 * MiB), (AllocEvent, 512 * MiB), (FreeEvent, None), (AllocEvent, 1024 * MiB), (FreeEvent, None)]
    assert events[2].id == events[0].id and events[4].id == events[3].id
