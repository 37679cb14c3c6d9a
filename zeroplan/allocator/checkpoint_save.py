"""The checkpoint save after the step, recorded in the step's trace (zeroplan.core.checkpoint_save
says what it gathers and keeps): the root unit gathered for the whole save, each block unit
gathered, its chunks made, the unit freed, then the root's own chunks; everything freed once the
state dict is dropped."""

from __future__ import annotations

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.core.checkpoint_save import SaveUnits


def record_checkpoint_save(b: TraceBuilder, save: SaveUnits | None) -> None:
    """Append the save to ``b`` (a finished step: its gradients and temporaries freed); nothing without one."""
    if save is None:
        return
    root = b.alloc(save.held_bytes)
    kept: list[int] = []
    for gathered, keeps, moves in save.steps:
        unit = b.alloc(gathered)
        kept += b.alloc_parts(keeps)
        # Under offload_to_cpu each chunk goes to the host as soon as it is made.
        b.free(b.alloc(moves))
        b.free(unit)
    b.free(root)
    b.free(kept)
