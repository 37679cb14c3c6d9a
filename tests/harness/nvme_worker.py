"""Per-rank probe of ZeRO-Infinity's optimizer swapper under DeepSpeed's own engine (CPU, gloo,
DeepSpeed's async_io op, which needs libaio):

    torchrun --nproc-per-node 1 tests/harness/nvme_worker.py OUT_DIR SUB_GROUP_SIZE PIPELINE BUFFER_COUNT \
        [PARAM_BUFFER_SIZE MAX_IN_CPU]

drives deepspeed.initialize at stage 3 with offload_optimizer on NVMe (a swap folder under
OUT_DIR), sub_group_size SUB_GROUP_SIZE, pipeline_read/pipeline_write as PIPELINE says (none,
read, write, both) and buffer_count BUFFER_COUNT, on tiny-llama in fp32 (bf16-mixed with PARAM_BUFFER_SIZE) for two steps, and writes
the partition elements of each sub-group, the optimizer swapper's pinned pool (buffers and their
elements) and the most pool buffers it held at once during the steps; or, when the step fails,
the error's first line (the pipelined swapper asserts when the pool runs short). With
PARAM_BUFFER_SIZE and MAX_IN_CPU the parameters go to NVMe too (offload_param, buffer_count 5),
and the record adds the parameter swapper's pinned buffers, the pinned flat host buffer of the
first MAX_IN_CPU partition elements and the write-back buffer of the largest sub-group (or the
error of building it: a buffer smaller than a parameter's partition fails).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zeroplan.harness.deepspeed_engine import bucket_elements, deepspeed_config, import_deepspeed
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import init_distributed

MODEL, MICRO_BATCH, SEQ_LEN, STEPS = "tiny-llama", 1, 16, 2


def _bytes(tensors) -> int:  # type: ignore[no-untyped-def]
    return sum(t.numel() * t.element_size() for t in tensors)


def main(out: str, sub_group_size: int, pipeline: str, buffer_count: int, param_buffer_size: int = 0,
         max_in_cpu: int = 0) -> int:
    import torch.distributed as dist

    deepspeed = import_deepspeed()
    init_distributed("gloo")
    torch.manual_seed(0)
    preset = HARNESS_PRESETS[MODEL]
    model = build_model(preset)
    # Parameters on NVMe: bf16 (DeepSpeed's Init converts the parameters it offloads to a
    # low-precision dtype, and an fp32 module then fails its first matmul).
    dtype = torch.bfloat16 if param_buffer_size else torch.float32
    config = deepspeed_config(3, dtype, MICRO_BATCH, bucket_elements(model))
    config["zero_optimization"]["sub_group_size"] = sub_group_size
    config["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme", "nvme_path": str(Path(out, "swap")), "buffer_count": buffer_count,
        "pipeline_read": pipeline in ("read", "both"), "pipeline_write": pipeline in ("write", "both"),
    }
    if param_buffer_size:
        config["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": str(Path(out, "swap")), "buffer_count": 5,
            "buffer_size": param_buffer_size, "max_in_cpu": max_in_cpu,
        }
    rank = dist.get_rank()
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config, dist_init_required=False)
    except AssertionError as failure:
        record = {"rank": rank, "deepspeed": deepspeed.__version__, "param_buffer_size": param_buffer_size,
                  "error": str(failure).splitlines()[0]}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        return 0
    swapper = optimizer.optimizer_swapper
    pool = swapper.swap_buffer_manager
    held = {"now": 0, "most": 0, "in_step": False}
    allocate, free = pool.allocate, pool.free

    def counting_allocate(num_elems, count, dtype):  # type: ignore[no-untyped-def]
        buffers = allocate(num_elems, count, dtype)
        if buffers is not None:
            held["now"] += len(buffers)
            if held["in_step"]:  # the backward's gradient swap-out takes the whole pool (allocate_all)
                held["most"] = max(held["most"], held["now"])
        return buffers

    def counting_free(buffers):  # type: ignore[no-untyped-def]
        held["now"] -= len(buffers)
        return free(buffers)

    pool.allocate, pool.free = counting_allocate, counting_free
    tokens = torch.randint(0, preset.vocab_size, (MICRO_BATCH, SEQ_LEN + 1))
    error = None
    try:
        for _ in range(STEPS):
            engine.backward(next_token_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
            held["in_step"] = True
            engine.step()
            held["in_step"] = False
    except AssertionError as failure:
        error = str(failure).splitlines()[0] if str(failure) else "AssertionError"
    record = {
        "rank": rank, "world": dist.get_world_size(), "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "swapper": type(swapper).__name__, "sub_group_size": sub_group_size, "pipeline": pipeline,
        "buffer_count": buffer_count,
        "sub_group_elements": [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel],
        "pool_buffers": len(pool.all_buffers), "pool_buffer_elements": int(pool.all_buffers[0].numel()),
        "pool_bytes": sum(b.numel() * b.element_size() for b in pool.all_buffers),
        "most_buffers_held_in_step": held["most"], "error": error,
    }
    if param_buffer_size:
        swapper = next(p for p in engine.module.parameters()).nvme_swapper
        record.update({
            "param_buffer_size": param_buffer_size, "max_in_cpu": max_in_cpu,
            "param_swap_buffer_bytes": _bytes([swapper.buffers]),
            "param_flat_host_bytes": _bytes([t for t in optimizer.param_groups_fp16_flat_cpu_memory if t.numel() > 1]),
            "param_write_back_bytes": _bytes([swapper.partitioned_swap_buffer]),
        })
    Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *map(int, sys.argv[5:7])))
