"""Record every collective a rank issues, as the dispatcher sees it.

A TorchDispatchMode sees each call of an operator in the ``c10d`` namespace (eager
torch.distributed calls: ``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``,
``broadcast_``, ...) and in ``_c10d_functional`` (traceable collectives). In torch 2.13 with gloo,
DDP's C++ reducer also issues its bucket all-reduces through the dispatcher
(``c10d.allreduce_.default``), so they are recorded too; so is the one-off broadcast of bucket
indices when DDP rebuilds its buckets after the first step (tests/harness/test_comm.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeroplan.harness.record import CollectiveRecord

_NAMESPACES = ("c10d", "_c10d_functional")

# Raw operator name -> the collective it is. For gather/scatter ops the recorded element count
# is that of the full (unsharded) buffer, i.e. N times the shard.
_KIND = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "barrier": "barrier", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all", "send": "send", "recv_": "recv",
}


def _group_size(func: Any, args: tuple[Any, ...]) -> int:
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and hasattr(arg, "size"):
            return int(arg.size())
    if func.namespace == "_c10d_functional":  # these take the group size as an int
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and arg > 0:
                return arg
    # Helpers such as _verify_params_across_processes run on the default group.
    return torch.distributed.get_world_size()


class CommRecorder(TorchDispatchMode):
    """Collect a :class:`CollectiveRecord` per collective; ``phase`` labels what the runner is doing."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []
        self.phase = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace in _NAMESPACES and not func.name().endswith("wait_tensor"):
            self.records.append(self._describe(func, args))
        return func(*args, **(kwargs or {}))

    def _describe(self, func: Any, args: tuple[Any, ...]) -> CollectiveRecord:
        raw = func._schema.name.split("::")[-1]
        kind = _KIND.get(raw, raw)
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        if kind in ("all_gather", "reduce_scatter") and raw.startswith("_"):
            # (output, input): the full buffer is the larger one.
            tensors = [max(tensors[:2], key=lambda t: t.numel())]
        elif kind in ("all_gather", "reduce_scatter") and len(tensors) > 1 and raw.endswith("_"):
            # list forms: the outputs (all_gather) / inputs (reduce_scatter) form the full buffer.
            tensors = tensors[:-1] if kind == "all_gather" else tensors[1:]
        numel = sum(t.numel() for t in tensors)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"
        return CollectiveRecord(
            op=kind, raw_op=str(func), dtype=dtype, numel=numel, num_bytes=num_bytes,
            group_size=_group_size(func, args), phase=self.phase,
        )
