"""What FSDP2 holds across micro-batches under torch's pipeline schedules, measured on gloo/CPU.

torchtitan (9dec370 parallelisms/parallelize_llama.py apply_fsdp; 0.3.0 distributed/fsdp.py)
shards every pipeline stage with fully_shard(reshard_after_forward=False) under a pipeline,
param_dtype bf16 and reduce_dtype fp32; torch's PipelineStage runs every backward with
gradient sync and reshard-after-backward off and reduces a stage at its last micro-batch
(stage.py backward_maybe_with_nosync). This runs that setup for real: pp ranks on gloo, each
stage two bias-free Linear(H, H) blocks, each block and the stage fully_shard-ed on a one-rank
data-parallel mesh (the all-gather and the reduction run, over one rank), torch's own
Schedule1F1B (one stage per rank) or ScheduleInterleaved1F1B (two, loop order r, r + pp), a
scalar loss on the last stage. Micro-batches are one 8 x H row block, so the activations are
negligible beside the parameters.

The measure is the process's resident memory (/proc/self/statm) with glibc's mmap threshold
fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor of the parameters' size is its own
mapping, returned at its free: read after every forward_one_chunk and backward_one_chunk of a
third step (the first two allocate the receive buffers and the sharded gradients), less the
reading before it. Each record keeps the rank's trace and the stages' parameter elements.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/fsdp_pipeline_held.py [--pp 4] [--hidden 2048]

Measured (torch 2.13, pp 4, H 2048, 4,194,304 elements per stage; tests/test_fsdp_pipeline_held.py
checks the records against zeroplan.core.parallel.units.accumulating_trainable_elements):
1F1B, m 4 and 8: every rank 2 B (the gathered bf16 stage, from its first forward) + 4 B (the fp32
accumulators, from its first backward) per element: 48 MiB, back to the start after the last
backward. Interleaved 1F1B, m 4 (one round): 2 B for both stages + 4 B for one stage at a time
(the later stage reduces and reshards at its fourth backward, before the earlier stage's first):
64 MiB; m 8 (two rounds): both stages' accumulators at once, 96 MiB.
FSDP2 does not run on CPU under torch 2.6.0 (foreach_all_gather calls Stream.record_event),
so the torch 1963fc8 of torchtitan 9dec370's runs is not measured here; its
backward_maybe_with_nosync and to_accumulated_grad_if_needed read the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zeroplan.harness.ports import free_local_port

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "pipeline-records" / "fsdp"
BLOCKS = 2
RUNS = (("1F1B", 4), ("1F1B", 8), ("Interleaved1F1B", 4), ("Interleaved1F1B", 8))
"""(schedule, micro-batches) at pp 4: one round and two rounds of the interleaved schedule."""


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, schedule: str, microbatches: int, hidden: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    per_rank = 1 if schedule == "1F1B" else 2
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages, elements = [], []
    for index in (rank + k * world for k in range(per_rank)):
        torch.manual_seed(index)
        part = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(BLOCKS)])
        for block in part:
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
        fully_shard(part, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
        elements.append(sum(p.numel() for p in part.parameters()))
        stages.append(PipelineStage(part, index, world * per_rank, torch.device("cpu"), group=mesh["pp"].get_group()))

    def loss_fn(output, target):
        return output.float().sum()

    if per_rank == 1:
        runner = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        runner = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    trace: list[tuple[str, int, int]] = []
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            original = getattr(stage, name)

            def wrapped(*args, _original=original, _name=name, _index=stage.stage_index, **kwargs):
                result = _original(*args, **kwargs)
                trace.append((_name.split("_")[0], _index, _resident_bytes()))
                return result

            setattr(stage, name, wrapped)
    batch = torch.zeros(microbatches, 8, hidden)
    holds_last = any(stage.is_last for stage in stages)

    def step() -> None:
        if rank == 0:
            runner.step(batch)
        elif holds_last:
            runner.step(target=batch)
        else:
            runner.step()

    for _ in range(2):
        step()
    trace.clear()
    dist.barrier()
    start = _resident_bytes()
    step()
    end = _resident_bytes()
    record = {
        "torch": torch.__version__, "schedule": schedule, "pp": world, "microbatches": microbatches,
        "rank": rank, "stage_elements": elements, "hidden": hidden,
        "peak_bytes": max(b for _, _, b in trace) - start, "end_bytes": end - start,
        "trace": [[name, index, b - start] for name, index, b in trace],
    }
    with open(Path(out) / f"{schedule}_pp{world}_m{microbatches}_rank{rank}.json", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--out", default=str(OUT))
    options = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        print("set MALLOC_MMAP_THRESHOLD_=65536 (glibc must map each tensor apart)", file=sys.stderr)
        return 2
    Path(options.out).mkdir(parents=True, exist_ok=True)
    for schedule, microbatches in RUNS:
        mp.spawn(_rank, args=(options.pp, schedule, microbatches, options.hidden, free_local_port(), options.out),
                 nprocs=options.pp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
