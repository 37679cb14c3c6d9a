"""Per-rank probe of ZeRO++'s hpZ under DeepSpeed's own engine (CPU, gloo):

    torchrun --nproc-per-node 4 tests/harness/hpz_worker.py OUT_DIR HPZ

drives zeroplan.harness.deepspeed_engine.DeepSpeedZero at stage 3 with zero_hpz_partition_size
HPZ on micro-llama in fp32 for two steps and writes, per rank, the bytes of the secondary
parameter partitions after the forward, after the backward and after the step, the primary
partition's elements (param.ds_tensor), and its optimizer-state tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zeroplan.harness.deepspeed_engine import DeepSpeedZero
from zeroplan.harness.engine import optimizer_state_tensors
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import init_distributed

MODEL, MICRO_BATCH, SEQ_LEN = "micro-llama", 2, 16


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def write_record(out: str, hpz: int) -> None:
    """Measure on the process group already started."""
    import torch.distributed as dist

    torch.manual_seed(0)
    preset = HARNESS_PRESETS[MODEL]
    engine = DeepSpeedZero(build_model(preset), 3, torch.float32, MICRO_BATCH, hpz_partition_size=hpz)
    tokens = torch.randint(0, preset.vocab_size, (MICRO_BATCH, SEQ_LEN + 1))
    steps = []
    for _ in range(2):
        loss = next_token_loss(engine.ds(tokens[:, :-1]), tokens[:, 1:])
        forward = _bytes(engine.secondary_parameter_tensors())
        engine.ds.backward(loss)
        backward = _bytes(engine.secondary_parameter_tensors())
        engine.step()
        steps.append({"after_forward": forward, "after_backward": backward,
                      "after_step": _bytes(engine.secondary_parameter_tensors())})
    rank = dist.get_rank()
    primary = sum(p.ds_tensor.numel() for p in engine.module.parameters())
    record = {"rank": rank, "world": dist.get_world_size(), "steps": steps, "primary_elements": primary,
              "optimizer_state_bytes": _bytes(engine._masters() + optimizer_state_tensors(engine.optimizer))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")


def main(out: str, hpz: int) -> int:
    import torch.distributed as dist

    init_distributed("gloo")
    write_record(out, hpz)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
