"""zeroplan's own memory measures, independent of PyTorch's private trackers."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

from zeroplan.harness.engine import ModelStateTensors
from zeroplan.harness.record import ModelStateBytes


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def model_state_bytes(states: ModelStateTensors) -> ModelStateBytes:
    """Sum unique storages per category; a storage shared by two tensors (a view, an alias such
    as an fp32 master that is the parameter shard itself) counts once, in the first category."""
    seen: set[tuple[int, int]] = set()

    def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            key = _storage_key(tensor)
            if key not in seen and key[1] > 0:
                seen.add(key)
                total += key[1]
        return total

    params = unique_bytes(states.parameters)
    grads = unique_bytes(states.gradients)
    optimizer = unique_bytes(states.optimizer_states)
    host = unique_bytes(states.host)
    buffers = unique_bytes(states.buffers)
    return ModelStateBytes(
        parameters_bytes=params, gradients_bytes=grads, optimizer_states_bytes=optimizer,
        total_bytes=params + grads + optimizer + buffers, host_bytes=host, buffers_bytes=buffers,
    )


class SavedActivations:
    """Unique storages autograd saves for backward, minus the model states it also saves."""

    def __init__(self, exclude: ModelStateTensors, module: torch.nn.Module | None = None) -> None:
        self._exclude = {
            t.untyped_storage().data_ptr() for t in exclude.parameters if t.untyped_storage().nbytes()
        }
        # Gathered parameters (ZeRO-3 refills a unit's buffer before use) are the module's
        # parameters at the time autograd saves them, not activations: look them up then.
        self._module = module
        self._seen: dict[tuple[int, int], int] = {}
        # The storage last seen at each address, weakly: a storage freed while the forward runs
        # (saved into a graph branch the forward drops) gives its address to the next one made,
        # which is another storage, not the same one seen again.
        self._at_address: dict[int, tuple[int, weakref.ref]] = {}
        self._storages = 0
        self._earlier: list[int] = []
        """Totals of the micro-batches before the current one (start_micro_batch)."""

    def _is_parameter_storage(self, data_ptr: int) -> bool:
        if data_ptr in self._exclude:
            return True
        if self._module is None:
            return False
        for parameter in self._module.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            try:
                storage = local.untyped_storage()
            except RuntimeError:  # a wrapper subclass without storage of its own
                continue
            if storage.nbytes() and storage.data_ptr() == data_ptr:
                return True
        return False

    @property
    def num_bytes(self) -> int:
        """The largest micro-batch's saved bytes (the only one without start_micro_batch)."""
        return max([*self._earlier, sum(self._seen.values())])

    def _key(self, storage: torch.UntypedStorage) -> tuple[int, int]:
        """The address, and which of the storages seen there: aliases of live memory (a view,
        another storage over the same block) share it, a storage that took a freed one's address
        does not."""
        address = storage.data_ptr()
        entry = self._at_address.get(address)
        if entry is None or entry[1]() is None:
            entry = (self._storages, weakref.ref(storage))
            self._storages += 1
            self._at_address[address] = entry
        return address, entry[0]

    def start_micro_batch(self) -> None:
        """Count what follows as another micro-batch. A pipeline schedule runs a step's
        micro-batches in one call, their forwards and backwards interleaved (1F1B): a storage
        freed by one micro-batch's backward and reused by another's forward has the same
        address, so each micro-batch needs counting on its own."""
        if self._seen:
            self._earlier.append(sum(self._seen.values()))
        self._seen = {}

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, torch.nn.Parameter):
                return tensor
            for inner in _plain_tensors(tensor):
                storage = inner.untyped_storage()
                if not self._is_parameter_storage(storage.data_ptr()):
                    self._seen[self._key(storage)] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with storage behind ``tensor``: itself, or for a wrapper subclass without
    storage of its own (a DTensor's local shard, a functional collective's
    AsyncCollectiveTensor; torch 2.13 utils/_python_dispatch.py is_traceable_wrapper_subclass)
    its inner tensors, recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)
    return [plain for value in inner if isinstance(value, torch.Tensor) for plain in _plain_tensors(value)]
