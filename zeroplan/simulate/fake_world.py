"""One simulated rank of N: a fake process group, its device mesh, and byte counts of the
tensors a step leaves behind. Shared by zeroplan.simulate.run (the reference model) and
zeroplan.frameworks.step (the frameworks' own models); the private torch pieces they rest on
live in ``_torch_private``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from zeroplan.cli.parser import MAX_SIMULATED_WORLD_SIZE
from zeroplan.errors import ZeroplanError
from zeroplan.simulate import _torch_private as private

DEVICE = "cpu"
"""Fake tensors live on the CPU: no accelerator needed, none touched."""


def check_rank_of_world(world_size: int, rank: int, world_field: str = "world_size", rank_field: str = "rank") -> None:
    """Refuse, naming the field, a world a fake process group cannot play in seconds
    (MAX_SIMULATED_WORLD_SIZE, docs/input-bounds.md) or a rank outside it."""
    if world_size <= 0:
        raise ZeroplanError(world_field, f"must be a positive integer, got {world_size}")
    if world_size > MAX_SIMULATED_WORLD_SIZE:
        raise ZeroplanError(world_field, f"{world_size:,} ranks cannot be simulated (allowed: 1 to "
                                         f"{MAX_SIMULATED_WORLD_SIZE:,}; the planner answers larger worlds)")
    if not 0 <= rank < world_size:
        raise ZeroplanError(rank_field, f"must be in [0, {world_size}), got {rank}")


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """The default process group for the duration: ``world_size`` ranks, this one ``rank``;
    every collective returns at once without moving data."""
    if dist.is_initialized():
        raise RuntimeError("a simulated step needs its own fake process group; one is already initialised")
    dist.init_process_group(
        backend=private.FAKE_BACKEND, store=private.fake_store(), rank=rank, world_size=world_size,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def device_mesh(world_size: int):
    """A one-dimensional mesh over the fake group. Build it outside the fake-tensor mode: the
    mesh reads its rank tensor's values."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(DEVICE, (world_size,))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view counts its whole storage once; a
    tensor subclass that wraps inner tensors, e.g. torchao's NF4Tensor, counts their storages)."""
    seen: dict[int, int] = {}
    pending = list(tensors)
    while pending:
        tensor = pending.pop()
        inner = private.inner_tensors(tensor)
        if inner is not None:
            pending.extend(inner.values())
            continue
        seen[private.storage_key(tensor)] = tensor.untyped_storage().nbytes()
    return sum(seen.values())
