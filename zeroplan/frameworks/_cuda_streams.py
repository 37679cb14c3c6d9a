"""Stand-ins for the CUDA stream calls torchtune 0.6.1's activation offloading makes, so that
its own code runs on a CPU-only fake run (torch and torchtune needed).

training/_activation_offloading.py OffloadActivations calls torch.cuda.default_stream(),
torch.cuda.Stream(), torch.cuda.stream(s) and a stream's wait_stream, wait_event and
record_event. Those only order work on a GPU; which tensors stay alive, and so what stays on
the device, is decided by its own dictionaries (``tracker``, ``fwd_stash``), which run
unchanged. What the stand-ins cannot show (copies overlapping compute, the caching allocator's
per-stream reuse, record_stream's delayed frees) is listed in docs/frameworks.md. Everything
replaced is in this one file; tests/test_framework_measure.py fails if torchtune reaches for
anything else of CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


class HostStream:
    """A CUDA stream that orders nothing: every call returns at once."""

    def wait_stream(self, stream: HostStream) -> None:
        del stream

    def wait_event(self, event: object) -> None:
        del event

    def record_event(self) -> object:
        return object()


@contextlib.contextmanager
def host_cuda_streams() -> Iterator[None]:
    """torch.cuda's stream calls replaced by HostStream while entered."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "default_stream", lambda device=None: HostStream()))
        stack.enter_context(mock.patch.object(torch.cuda, "Stream", lambda *args, **kwargs: HostStream()))
        stack.enter_context(mock.patch.object(torch.cuda, "stream", lambda stream: contextlib.nullcontext()))
        yield
