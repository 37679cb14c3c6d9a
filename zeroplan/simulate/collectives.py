"""Record every collective the engine issues, as the dispatcher sees it.

FSDP2 and DDP call ``torch.distributed``'s collectives, which reach the dispatcher as
``torch.ops.c10d.*`` operators (``_c10d_functional.*`` for the traceable variants). A
TorchDispatchMode entered inside the fake-tensor mode sees each call first; it reads the
tensors' shapes and dtypes from the operator's schema (argument names say which tensors are
inputs and which outputs) and lets the call through to the fake process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroplan.simulate._torch_private import (
    COLLECTIVE_NAMESPACES,
    OpOverload,
    TorchDispatchMode,
    group_size_by_name,
    op_schema,
    process_group_size,
)
from zeroplan.simulate.record import CollectiveKind, CollectiveRecord, Phase

_KINDS = {
    "_allgather_base_": CollectiveKind.all_gather,
    "allgather_": CollectiveKind.all_gather,
    "allgather_coalesced_": CollectiveKind.all_gather,
    "allgather_into_tensor_coalesced_": CollectiveKind.all_gather,
    "all_gather_into_tensor": CollectiveKind.all_gather,
    "all_gather_into_tensor_coalesced": CollectiveKind.all_gather,
    "_reduce_scatter_base_": CollectiveKind.reduce_scatter,
    "reduce_scatter_": CollectiveKind.reduce_scatter,
    "reduce_scatter_tensor_coalesced_": CollectiveKind.reduce_scatter,
    "reduce_scatter_tensor": CollectiveKind.reduce_scatter,
    "reduce_scatter_tensor_coalesced": CollectiveKind.reduce_scatter,
    "allreduce_": CollectiveKind.all_reduce,
    "allreduce_coalesced_": CollectiveKind.all_reduce,
    "all_reduce": CollectiveKind.all_reduce,
    "all_reduce_coalesced": CollectiveKind.all_reduce,
    "broadcast_": CollectiveKind.broadcast,
    "broadcast": CollectiveKind.broadcast,
}
_NOT_COLLECTIVES = {"wait_tensor", "barrier", "monitored_barrier_"}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_size(bound: dict[str, object]) -> int:
    if "group_size" in bound:
        return int(bound["group_size"])
    size = process_group_size(bound.get("process_group"))
    if size is not None:
        return size
    name = bound.get("group_name")
    if name is not None:
        return group_size_by_name(str(name))
    return dist.get_world_size()


def describe(func: OpOverload, args: tuple, kwargs: dict, phase: Phase) -> CollectiveRecord:
    """Turn one collective call into a record, from the operator's schema."""
    schema = op_schema(func)
    bound = dict(kwargs)
    for argument, value in zip(schema.arguments, args):
        bound[argument.name] = value
    kind = _KINDS.get(schema.name.split("::")[-1], CollectiveKind.other)
    group_size = _group_size(bound)
    inputs = [t for name, value in bound.items() if "output" not in name for t in _tensors(value)]
    outputs = [t for name, value in bound.items() if "output" in name for t in _tensors(value)]
    in_elements = sum(t.numel() for t in inputs)
    if outputs:
        out_elements = sum(t.numel() for t in outputs)
    elif kind is CollectiveKind.all_gather:  # functional: returns a new, N times larger tensor
        out_elements = in_elements * group_size
    elif kind is CollectiveKind.reduce_scatter:  # functional: returns this rank's 1/N
        out_elements = in_elements // group_size
    else:  # in place (c10d all-reduce, broadcast) or same-sized result
        out_elements = in_elements
    sample = (inputs or outputs)[0]
    return CollectiveRecord(
        phase=phase, op=str(func), kind=kind, dtype=str(sample.dtype),
        element_bytes=sample.element_size(), input_elements=in_elements,
        output_elements=out_elements, group_size=group_size,
    )


class CollectiveRecorder(TorchDispatchMode):
    """Appends a :class:`CollectiveRecord` for each collective; set ``phase`` as the step
    advances."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = Phase.setup
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = op_schema(func).name.split("::")[-1]
            if name not in _NOT_COLLECTIVES:
                self.records.append(describe(func, args, kwargs, self.phase))
        return func(*args, **kwargs)
