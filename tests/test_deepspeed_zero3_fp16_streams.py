"""benchmarks/deepspeed_zero3_fp16_streams.py's steps as replayed: the installed transformers'
SDPA causal masks (made on the compute stream, their frees not in the profiler's events) are left
out of a step and of what is held at its start, as transformers 4.40 builds none for the run's
input; has_overflow's isinf bools on the reduce stream (the same aten::eq) stay."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_script
from zeroplan.allocator.trace import AllocEvent, FreeEvent

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "deepspeed_zero3_fp16_streams.py"
MIB = 2**20


def _run() -> dict:
    """Two steps: each makes a (b, q, k) mask on the compute stream that the events never free and
    an activation it frees; the first an optimizer state kept, the second an isinf bool on the
    reduce stream."""
    events = [
        (100, MIB, 1, "aten::eq"), (110, MIB, 2, "aten::empty"), (120, -MIB, 2, "aten::empty"),
        (130, MIB, 6, "aten::empty_strided"),
        (200, MIB, 3, "aten::eq"), (210, 2 * MIB, 4, "aten::empty"), (230, MIB, 5, "aten::eq"),
        (235, -MIB, 5, "aten::eq"), (240, -2 * MIB, 4, "aten::empty"),
    ]
    ranges = [(90, 150, "zs:step0"), (190, 250, "zs:step1"), (225, 236, "zs:reduce")]
    return {"events": events, "ranges": ranges}


def test_masks_are_left_out_and_the_overflow_check_kept() -> None:
    script = load_script(SCRIPT)
    trace, held = script.engine_steps(_run(), 1, 1)
    allocs = [e for e in trace.events if isinstance(e, AllocEvent)]
    # step 0's mask is not held at step 1's start (its state is); step 1's is not allocated in it
    assert held == MIB * script.SCALE
    assert [(e.size_bytes, e.stream) for e in allocs[1:]] == [(2 * MIB * script.SCALE, 0), (MIB * script.SCALE, 2)]
    assert sum(isinstance(e, FreeEvent) for e in trace.events) == 2
