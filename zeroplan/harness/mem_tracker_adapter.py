"""The only module that touches PyTorch's private memory trackers.

``torch.distributed._tools.mem_tracker.MemTracker`` (any module) and
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (FSDP2 modules) are private
API: they may move or change between releases. tests/harness/test_mem_tracker_adapter.py fails
loudly when they do; the runner then records ``source='unavailable: ...'`` instead of guessing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class TrackedPeak:
    """Filled in when the tracking context exits."""

    source: str = "unavailable: not run"
    peak_bytes_by_category: dict[str, int] = field(default_factory=dict)
    peak_bytes: int | None = None
    next_micro_batch: Callable[[], None] = lambda: None
    """Call before every forward after the first: the trackers refuse a second forward of the
    root module in one context unless its per-module stats are reset (``reset_mod_stats``;
    the step's peak is kept)."""


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def track_peak(
    module: nn.Module, optimizer: torch.optim.Optimizer, extra_tensors: tuple[torch.Tensor, ...] = (),
    unavailable: str | None = None,
) -> Iterator[TrackedPeak]:
    """Track the peak tensor bytes by category of whatever runs inside the context.
    ``extra_tensors`` are state tensors that are neither module parameters nor optimizer state
    (reference ZeRO's flat shards, allocated before tracking starts): MemTracker would miss them.
    ``unavailable``: why no tracker can run here (recorded as the source)."""
    result = TrackedPeak()
    if unavailable is not None:
        result.source = f"unavailable: {unavailable}"
        yield result
        return
    try:
        if _is_fsdp2(module):
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            tracker = FSDPMemTracker(module, optimizer)
            result.source = "FSDPMemTracker"
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            tracker.track_external(module, optimizer, *extra_tensors)
            result.source = "MemTracker"
    except Exception as error:  # the private API moved: say so in the record
        result.source = f"unavailable: {type(error).__name__}: {error}"
        yield result
        return
    result.next_micro_batch = tracker.reset_mod_stats
    with tracker:
        yield result
    snapshot = tracker.get_tracker_snapshot("peak")
    device_snapshot = next(iter(snapshot.values()), {})
    for key, value in device_snapshot.items():
        name = getattr(key, "value", str(key))
        if name == "Total":
            result.peak_bytes = int(value)
        else:
            result.peak_bytes_by_category[name] = int(value)
