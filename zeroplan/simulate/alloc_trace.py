"""A run's storage allocations and frees, in order, from fake tensors on the CPU: the trace the
caching-allocator model (zeroplan.allocator) replays to predict what a GPU would reserve and
the memory at which it runs out, with no GPU.

Every operator's outputs pass through a dispatch mode; a storage seen for the first time is an
allocation of its bytes, and the moment its last reference goes (a weak reference's callback:
torch keeps one Python object per live storage) is its free. ``UntypedStorage.resize_`` is not
an operator, so it is wrapped, as torch's own MemTracker does
(torch/distributed/_tools/mem_tracker.py ``_track_resize``): a resize frees the old block and
allocates the new one, which is what the CUDA caching allocator does for it.

Streams: FSDP2 selects its streams with ``device_handle.stream(...)``, on the CPU torch.cpu's
StreamContext, which sets what ``torch.cpu.current_stream()`` returns, as torch.cuda's does on a
GPU (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: ``foreach_all_gather`` makes its
copy-in buffers on the all-gather copy-in stream; ``foreach_reduce`` its reduce-scatter input on
the current stream and its output on the reduce-scatter stream). An allocation is given the
stream current when it is made: 0 for the default stream, then 1, 2, ... in order of first use,
so the CUDA allocator's per-stream pools see what they would on a GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent
# A dispatch mode, pytree's leaves and DTensor's inner storages live in private torch modules.
from zeroplan.simulate._torch_private import TorchDispatchMode, get_untyped_storages, in_backward, tree_leaves

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
"""aten operators that call cuBLAS (linear decomposes to these)."""

HOPPER_CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""One cuBLAS handle's workspace on an sm90 GPU: torch/csrc/cuda/CublasHandlePool.cpp
getDefaultWorkspaceSize (4096 * 8 * 1024 bytes on sm90; CUBLAS_WORKSPACE_CONFIG overrides it),
allocated through the caching allocator the first time the handle multiplies. Measured on an
H200: two 32 MiB blocks never freed, one at the forward's first matmul and one at the backward's
(autograd runs backward on its own device thread, whose handle has its own workspace;
benchmarks/gpu-allocator-records)."""


class StorageTrace(TorchDispatchMode):
    """Records allocations and frees of the storages operators produce while entered.
    Higher-order operators (FlexAttention's flex_attention) pass through like any other: called,
    and their outputs recorded.
    ``cublas_workspace_bytes`` > 0 adds what a CUDA run allocates besides the tensors: one
    cuBLAS workspace at the first matmul of the forward thread and one at the first of
    autograd's backward thread."""

    supports_higher_order_operators = True

    def __init__(self, cublas_workspace_bytes: int = 0) -> None:
        super().__init__()
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self._workspaces: set[bool] = set()
        """Threads (in backward or not) whose handle has its workspace."""
        self.events: list[AllocEvent | FreeEvent] = []
        self._live: dict[int, tuple[int, int, weakref.ref]] = {}
        """id of the storage's Python object -> (trace id, bytes, weak reference)."""
        self._next_id = 0
        self._streams: dict[object, int] = {torch.cpu.current_stream(): 0}
        """Streams seen, numbered in order of first use (the default one 0)."""
        self.declines: type | None = None
        """A tensor subclass whose operators the trace declines (NotImplemented), so that the
        subclass's own dispatch runs and its local operators are recorded instead (DTensor's
        custom handlers, loss_parallel's, make temporaries no DTensor operator returns)."""
        self.paused = False
        """While set, operators run unrecorded (DTensor's sharding propagation runs its operators on
        fake tensors of the global shape to infer the output's: no allocation of the run's)."""

    def _stream_now(self) -> int:
        return self._streams.setdefault(torch.cpu.current_stream(), len(self._streams))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.declines is not None and any(issubclass(t, self.declines) for t in types):
            return NotImplemented
        if self.paused:
            return func(*args, **(kwargs or {}))
        if self.cublas_workspace_bytes and getattr(func, "__name__", "").split(".")[0] in _MATMULS:
            backward = in_backward()
            if backward not in self._workspaces:
                self._workspaces.add(backward)
                self.events.append(AllocEvent(id=self._next_id, size_bytes=self.cublas_workspace_bytes,
                                              stream=self._stream_now()))
                self._next_id += 1
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                # A wrapper subclass (DTensor) holds its memory in inner tensors; its own storage
                # is a shell the size of the global shape.
                for storage in get_untyped_storages(leaf):
                    self._see(storage)
        return out

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[2]() is storage:
            return
        self._track(storage, key)

    def _track(self, storage: torch.UntypedStorage, key: int) -> None:
        # Replacing a weak reference drops it, and with it its callback: only the storage's
        # current block is freed when it goes.
        ident, size = self._next_id, storage.nbytes()
        self._next_id += 1
        self._live[key] = (ident, size, weakref.ref(storage, lambda _ref: self._dropped(key, ident)))
        if size:
            self.events.append(AllocEvent(id=ident, size_bytes=size, stream=self._stream_now()))

    def _dropped(self, key: int, ident: int) -> None:
        entry = self._live.get(key)
        if entry is None or entry[0] != ident:
            return
        del self._live[key]
        if entry[1]:
            self.events.append(FreeEvent(id=ident))

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` changed size: its block is freed and a new one (if any) made."""
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[2]() is storage and entry[1]:
            self.events.append(FreeEvent(id=entry[0]))
        self._track(storage, key)

    def trace_id(self, storage: torch.UntypedStorage) -> int:
        """The trace id of a live storage's current block."""
        entry = self._live[id(storage)]
        if entry[2]() is not storage:
            raise KeyError("storage not recorded")
        return entry[0]

    def trace(self, source: str) -> AllocationTrace:
        """The events so far, each free matched to a live allocation."""
        return AllocationTrace(events=tuple(self.events), source=source)


@contextlib.contextmanager
def recording_storages(cublas_workspace_bytes: int = 0) -> Iterator[StorageTrace]:
    """Enter a StorageTrace and route UntypedStorage.resize_ through it."""
    recorder = StorageTrace(cublas_workspace_bytes)
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int):  # type: ignore[no-untyped-def]
        old = storage.nbytes()
        result = original(storage, size)
        if storage.nbytes() != old:
            recorder.resized(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        with recorder:
            yield recorder
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
