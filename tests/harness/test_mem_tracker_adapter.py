"""Fails loudly when PyTorch's private memory trackers move or change shape."""

from __future__ import annotations

import torch

from zeroplan.harness.engine import make_adamw
from zeroplan.harness.mem_tracker_adapter import track_peak
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import harness_model


def test_private_trackers_are_where_the_adapter_expects_them() -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    for cls in (MemTracker, FSDPMemTracker):
        assert callable(getattr(cls, "get_tracker_snapshot"))
    assert callable(getattr(MemTracker, "track_external"))


def test_adapter_reports_peak_by_category_on_one_process() -> None:
    spec = harness_model("micro-llama")
    model = build_model(spec)
    optimizer = make_adamw(list(model.parameters()))
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    with track_peak(model, optimizer) as peak:
        next_token_loss(model(tokens), tokens).backward()
        optimizer.step()
    assert peak.source == "MemTracker", peak.source
    categories = peak.peak_bytes_by_category
    assert {"Parameter", "Gradient", "Optstate", "Activation", "Temp"} <= set(categories)
    assert categories["Parameter"] == param_bytes
    assert peak.peak_bytes == sum(categories.values())
