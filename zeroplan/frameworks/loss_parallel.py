"""What torch's loss_parallel() cross-entropy holds on one tensor-parallel rank, measured from
torch's own handlers (torch/distributed/tensor/parallel/loss.py) on a fake process group.

torchtitan 9dec370's train.py runs ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0,
1))`` on the output projection's vocab-sharded DTensor logits under loss_parallel(), then ``del
pred`` and backward. DTensor runs those operators through custom handlers that work on the local
shard; the temporaries they make never surface as DTensor outputs, so a dispatch mode that
stops at DTensor's operators (zeroplan.simulate.alloc_trace.StorageTrace) does not see them.
The mode here declines DTensor's operators (NotImplemented), so that DTensor's dispatch runs
under it and every local operator's output storage is counted, each until its last reference
goes. Real CPU tensors at a small shape: the moments are whole multiples of one fp32 local-logit
tensor (tokens x vocab / tp x 4 bytes), whatever the shape.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossParallelPeaks:
    """Live bytes of the loss's own tensors, above what was live before it (the logits' bf16
    shard, made by the model, is counted in the forward: train.py deletes it before backward)."""

    local_logit_fp32_bytes: int
    """One fp32 tensor of the rank's logits shard: the unit of the two figures."""
    forward_peak_bytes: int
    """From the bf16 logits to the loss, ``del pred`` included."""
    backward_peak_bytes: int
    """loss.backward() down to the logits' gradient (the bf16 cast of its fp32 gradient)."""
    large_events: tuple[int, ...] = ()
    """The storages of at least a bf16 local-logit tensor, in order: +bytes where one is made,
    -bytes where it goes (the allocator schedule's order: zeroplan.allocator.fsdp_schedule
    run_torchtitan_loss_parallel)."""


def measure_loss_parallel(tokens: int = 2048, vocab_size: int = 32768, tp: int = 8) -> LossParallelPeaks:
    """torchtitan 9dec370 train.py's loss on rank 0 of ``tp`` fake ranks, the logits sharded on
    the vocabulary as apply_tp's ColwiseParallel(output_layouts=Shard(-1)) leaves them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from zeroplan.simulate.fake_world import fake_process_group

    if vocab_size % tp:
        raise ValueError(f"vocab_size {vocab_size} must divide into tp={tp} shards")
    with fake_process_group(tp, 0):
        mesh = init_device_mesh("cpu", (tp,))
        # The model's output, one sequence of `tokens` (its shape does not change a byte per logit).
        logits = distribute_tensor(torch.randn(1, tokens, vocab_size, dtype=torch.bfloat16), mesh, [Shard(2)])
        logits.requires_grad_()
        labels = torch.randint(0, vocab_size, (1, tokens))
        counter = _LocalStorages(DTensor, large=2 * tokens * (vocab_size // tp))
        with counter, loss_parallel():
            pred = logits * 1  # a storage of its own, as the output projection's is
            loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
            del pred
            forward = counter.take_peak()
            loss.backward()
            backward = counter.take_peak()
        del loss
    return LossParallelPeaks(local_logit_fp32_bytes=4 * tokens * (vocab_size // tp), forward_peak_bytes=forward,
                             backward_peak_bytes=backward, large_events=tuple(counter.large_events))


class _LocalStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the storages of every plain CPU tensor an operator returns, each until its last
    reference goes; declines tensor subclasses (DTensor) so that their own dispatch, and with it
    their local operators, runs under the mode."""

    def __init__(self, subclass: type, large: int = 0) -> None:
        super().__init__()
        self.subclass = subclass
        self.large = large
        self.large_events: list[int] = []
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, self.subclass) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and type(leaf) is torch.Tensor and leaf.device.type == "cpu":
                self._see(leaf.untyped_storage())
        return out

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        entry = self.live.get(key)
        if entry is not None and entry[1]() is storage:
            return
        size = storage.nbytes()
        self.live[key] = (size, weakref.ref(storage, lambda _ref: self._free(key, size)))
        if self.large and size >= self.large:
            self.large_events.append(size)
        self.now += size
        self.peak = max(self.peak, self.now)

    def _free(self, key: int, size: int) -> None:
        if self.live.pop(key, None) is not None:
            self.now -= size
            if self.large and size >= self.large:
                self.large_events.append(-size)

    def take_peak(self) -> int:
        """The peak since the last call, which starts the next phase from what is live now."""
        peak, self.peak = self.peak, self.now
        return peak
