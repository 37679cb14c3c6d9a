"""FSDP2's unsharded parameters under torchao's float8 all-gather, measured on gloo (CPU).

A tiny two-linear block (and a norm) converted with torchao's convert_to_float8_training
(tensorwise, enable_fsdp_float8_all_gather on or off), wrapped with fully_shard (fp32 shards,
bf16 param_dtype, as torchtitan), precompute_float8_dynamic_scale_for_fsdp run once. After
unshard() it reads every FSDPParam's all-gather outputs (the unsharded storage the module's
parameters view), then runs the forward under saved_tensors_hooks to list what each Float8Linear
saves for its backward (dtype and bytes of the storage). Prints one JSON line per rank 0.

  python benchmarks/float8_all_gather_memory.py
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from zeroplan.harness.ports import free_local_port

DIM, HIDDEN, WORLD = 256, 512, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


def _storage_bytes(t: torch.Tensor) -> int:
    inner = getattr(t, "_data", None)
    t = inner if inner is not None else t
    return t.untyped_storage().nbytes()


def _rank(rank: int, all_gather: bool, port: str, out: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    torch.manual_seed(0)
    model = Block()
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                reshard_after_forward=True)
    if all_gather:
        precompute_float8_dynamic_scale_for_fsdp(model)
    model.unshard()
    state = model._get_fsdp_state()
    group = state._fsdp_param_group
    unsharded = {}
    gathered_ptrs = set()
    for index, p in enumerate(group.fsdp_params):
        outputs = p.all_gather_outputs
        gathered_ptrs.update(o.untyped_storage().data_ptr() for o in outputs)
        unsharded[f"{index}:{tuple(p._orig_size)}"] = {
            "param_type": type(p._unsharded_param).__name__,
            "outputs": [(str(o.dtype), tuple(o.shape), o.untyped_storage().nbytes()) for o in outputs],
        }
    saved = []

    def pack(t: torch.Tensor):
        inner = getattr(t, "_data", t)
        # Whether the saved tensor is a view of FSDP's gathered storage (no copy of its own).
        shares = inner.untyped_storage().data_ptr() in gathered_ptrs
        saved.append((type(t).__name__, str(inner.dtype), tuple(t.shape), _storage_bytes(t), shares))
        return t

    forward_ran = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(4, DIM, dtype=torch.bfloat16))
    except Exception as exc:  # fp8 matmul may have no CPU kernel
        forward_ran = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if rank == 0:
        out.append({"all_gather": all_gather, "unsharded": unsharded, "forward": forward_ran, "saved": saved})
        print(json.dumps(out[-1]))
    dist.destroy_process_group()


def main() -> None:
    for all_gather in (False, True):
        mp.spawn(_rank, args=(all_gather, str(free_local_port()), []), nprocs=WORLD)


if __name__ == "__main__":
    sys.exit(main())
