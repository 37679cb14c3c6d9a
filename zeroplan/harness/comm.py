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

try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch built without distributed
    _DTENSOR = None

_NAMESPACES = ("c10d", "_c10d_functional")
# Ops of those namespaces that move no data: waiting on a functional collective, and
# _wrap_tensor_autograd, which only wraps a functional collective's output for autograd
# (torch 2.13 distributed/_functional_collectives.py).
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})

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
    "all_to_all_single": "all_to_all", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


def _process_group(func: Any, args: tuple[Any, ...]) -> Any:
    """The call's ProcessGroup, or None. c10d ops receive it as a bare ScriptObject (so does
    the ReduceOp), which ``ProcessGroup.unbox`` turns back into the ProcessGroup (torch 2.13
    csrc/distributed/c10d/init.cpp); the functional ops name their group by a string (the
    last str argument, torch 2.13 distributed/_functional_collectives.py)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # a ReduceOp, not the group
                continue
    if func.namespace == "_c10d_functional":
        names = [arg for arg in args if isinstance(arg, str)]
        if names:
            try:
                return _resolve_process_group(names[-1])
            except (ValueError, RuntimeError, KeyError):
                return None
    return None


def _group_ranks(group: Any) -> list[int] | None:
    """Global ranks of ``group`` in group-rank order (None for no group, or one torch.distributed
    does not track)."""
    import torch.distributed as dist

    if group is None:
        return None
    try:
        return dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return None


def _group_size(func: Any, args: tuple[Any, ...], ranks: list[int] | None) -> int:
    if ranks is not None:
        return len(ranks)
    if func.namespace == "_c10d_functional":  # these take the group size as an int
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and arg > 0:
                return arg
    # Helpers such as _verify_params_across_processes run on the default group.
    return torch.distributed.get_world_size()


# c10d's point-to-point ops: send(Tensor[] tensors, ProcessGroup group, int dstRank, int tag)
# and recv_(Tensor[] tensors, ProcessGroup group, int srcRank, int tag) (torch 2.13
# csrc/distributed/c10d/Ops.cpp); the peer is a rank of that group.
_POINT_TO_POINT = ("send", "recv")


def _peer(args: tuple[Any, ...], ranks: list[int] | None) -> int | None:
    if len(args) < 3 or not isinstance(args[2], int):
        return None
    return ranks[args[2]] if ranks is not None and 0 <= args[2] < len(ranks) else args[2]


class CommRecorder(TorchDispatchMode):
    """Collect a :class:`CollectiveRecord` per collective; ``phase`` labels what the runner is doing."""

    def __init__(self, group_names: dict[tuple[int, ...], str] | None = None) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []
        self.phase = "other"
        self.group_names = group_names or {}
        """Global ranks of a process group -> the mesh dimension it is ('tp', 'dp', 'pp', 'world')."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Modes run before tensor subclasses: a DTensor op (loss_parallel's cross-entropy, an
        # implicit redistribution) would run its collectives after this mode has stepped aside.
        # Returning NotImplemented lets DTensor desugar first, and its collectives then come
        # back through this mode (torch 2.13 distributed/tensor/debug/_comm_mode.py,
        # CommDebugMode.__torch_dispatch__, does the same).
        if _DTENSOR is not None and any(issubclass(t, _DTENSOR) for t in types):
            return NotImplemented
        if func.namespace in _NAMESPACES and func.name().split("::")[-1].split(".")[0] not in _NOT_COLLECTIVES:
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
        ranks = _group_ranks(_process_group(func, args))
        point_to_point = kind in _POINT_TO_POINT
        if kind == "all_gather" and func.namespace == "_c10d_functional":
            # all_gather_into_tensor(input, group_size, group_name) allocates its output itself:
            # only the shard is an argument, the full buffer is group_size shards.
            size = _group_size(func, args, ranks)
            numel, num_bytes = numel * size, num_bytes * size
        return CollectiveRecord(
            op=kind, raw_op=str(func), dtype=dtype, numel=numel, num_bytes=num_bytes,
            # A send or recv moves data between its two ends, whatever group carries it.
            group_size=2 if point_to_point else _group_size(func, args, ranks),
            group=self.group_names.get(tuple(ranks)) if ranks is not None else None,
            group_ranks=ranks, peer=_peer(args, ranks) if point_to_point else None, phase=self.phase,
        )
