"""What FSDP1 (use_orig_params=True, as Lightning's FSDPStrategy runs litgpt) holds at the
backward of a tied embedding: the question is whether the root unit has the head's gradient
(waiting since the loss), the embedding's gradient and their concatenated flat gradient alive
at once. A toy model whose tied embedding dominates (vocab 65,536 x hidden 64, 16 MiB in fp32,
one small block wrapped as its own unit), 2 ranks on gloo/CPU, two micro-batches (the first
under no_sync()), the CPU allocator traced as the harness does (zeroplan.harness.allocator_trace).
Prints the peak of the last micro-batch's backward and the blocks of the embedding's size or
more alive at it, by the operator that allocated them.

    python benchmarks/fsdp1_tied_embedding_backward.py [--untied]
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zeroplan.harness.ports import free_local_port

VOCAB, HIDDEN, SEQ, BATCH = 65_536, 64, 8, 1
TIED = "--untied" not in sys.argv
MiB = 2**20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.block = Block()
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if TIED:
            self.lm_head.weight = self.wte.weight  # tied, as Hugging Face's gemma

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.wte(tokens))))


def run(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from zeroplan.harness.allocator_trace import AllocatorTrace, _replay

    torch.manual_seed(0)
    trace = AllocatorTrace()
    with trace:
        model = FullyShardedDataParallel(Tied(), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                         auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                                         device_id=torch.device("cpu"))
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        for micro in range(2):
            context = model.no_sync() if micro == 0 else contextlib.nullcontext()
            with context, trace.step(micro):
                logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                del logits
                loss.backward()
    if rank == 0:
        peak = trace.peaks()[1]
        print("tied" if TIED else "untied (litgpt's GPT: lm_head its own nn.Linear, the checkpoint's copy of wte)")
        print(f"embedding (and head) each {VOCAB * HIDDEN * 4 / MiB:.1f} MiB fp32, logits {BATCH * SEQ * VOCAB * 4 / MiB:.1f} MiB")
        print(f"peak of the second micro-batch {peak.peak_bytes / MiB:.1f} MiB; live by operator:")
        for op, size in peak.live_bytes_by_operator.items():
            print(f"  {op:48s} {size / MiB:8.1f} MiB")
        # The large blocks alive at that peak, one by one.
        best, best_live = -1, {}
        for live, total in _replay(trace.events()):
            if total > best:
                best, best_live = total, dict(live)
        print(f"largest replayed total {best / MiB:.1f} MiB; blocks of 4 MiB or more alive then:")
        for allocation in sorted(best_live.values(), key=lambda a: a.time_ns):
            if allocation.size_bytes >= 4 * MiB:
                print(f"  {allocation.operator:48s} {allocation.size_bytes / MiB:8.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mp.spawn(run, args=(2, str(free_local_port())), nprocs=2)
