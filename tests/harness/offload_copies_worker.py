"""Per-rank count of the copies DeepSpeed's optimizer offload makes between its host buffers and
the rest (CPU, gloo):

    torchrun --nproc-per-node 2 tests/harness/offload_copies_worker.py OUT_DIR STAGE:ACCUM...

drives zeroplan.harness.deepspeed_engine.DeepSpeedZero with offload_optimizer at each STAGE (2 or
3) on micro-llama in bf16-mixed for optimizer steps of ACCUM micro-batches, and writes, per rank
and setting (rank{R}-stage{S}-accum{A}.json), for the second step,
the bytes every ``aten.copy_`` moved across the host boundary (exactly one of its two tensors in
one of the optimizer's host buffers), by direction and by phase (backward, step), the bytes of
copies inside the host buffers, and the rank's partition elements.

On the CPU accelerator the device is the host too: a copy DeepSpeed writes as ``.to(device)``
(stage3.py partition_grads, ``grad_buffer.to(grad_partition.device)``) returns the tensor itself
and is not seen; every ``copy_`` is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroplan.harness.deepspeed_engine import DeepSpeedZero
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import init_distributed

MODEL, MICRO_BATCH, SEQ_LEN = "micro-llama", 2, 16


def _host_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors DeepSpeed keeps on its offload device (stage_1_and_2.py / stage3.py names)."""
    tensors: list[torch.Tensor] = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "param_buffer_of_bit16_for_cpu_offload_groups"):
        for t in getattr(optimizer, name, None) or []:
            tensors.append(t)
            if t.grad is not None:
                tensors.append(t.grad)
    for name in ("temp_grad_buffer_for_cpu_offload", "grad_partitions_flat_buffer"):
        t = getattr(optimizer, name, None)
        if t is not None:
            tensors.append(t)
    tensors += list((getattr(optimizer, "accumulated_grads_in_cpu", None) or {}).values())
    return tensors


class CopyCounter(TorchDispatchMode):
    """Bytes of each aten.copy_ by whether it crosses the host buffers' boundary."""

    def __init__(self, optimizer) -> None:
        super().__init__()
        self.optimizer, self.phase = optimizer, "backward"
        self.bytes: dict[str, int] = {}

    def _is_host(self, tensor: torch.Tensor, hosts: set[int]) -> bool:
        return tensor.untyped_storage().data_ptr() in hosts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            destination, source = args[0], args[1]
            hosts = {t.untyped_storage().data_ptr() for t in _host_tensors(self.optimizer)}
            down, up = self._is_host(destination, hosts), self._is_host(source, hosts)
            kind = "host" if down and up else "down" if down else "up" if up else None
            if kind is not None:
                key = f"{self.phase} {kind}"
                self.bytes[key] = self.bytes.get(key, 0) + destination.numel() * destination.element_size()
        return func(*args, **(kwargs or {}))


def _measure(stage: int, accum: int) -> dict:
    preset = HARNESS_PRESETS[MODEL]
    torch.manual_seed(0)
    engine = DeepSpeedZero(build_model(preset), stage, torch.bfloat16, MICRO_BATCH, offload=True, grad_accum_steps=accum)
    optimizer = engine.zero_optimizer
    tokens = torch.randint(0, preset.vocab_size, (accum, MICRO_BATCH, SEQ_LEN + 1))
    # Two steps, the second counted: the lazily made host buffers (accumulated_grads_in_cpu) exist.
    for _ in range(2):
        counter = CopyCounter(optimizer)
        for micro in range(accum):
            counter.phase = "forward"
            with counter:
                loss = next_token_loss(engine.ds(tokens[micro, :, :-1]), tokens[micro, :, 1:])
            counter.phase = "backward"
            with counter:
                engine.ds.backward(loss)
            counter.phase = "step"
            with counter:
                engine.ds.step()
    elements = sum(t.numel() for t in (getattr(optimizer, "single_partition_of_fp32_groups", None)
                                       or optimizer.fp32_partitioned_groups_flat))
    return {"partition_elements": elements, "bytes": counter.bytes}


def write_records(out: str, settings: list[str]) -> None:
    """Measure each STAGE:ACCUM setting on the process group already started."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for setting in settings:
        stage, accum = (int(v) for v in setting.split(":"))
        record = {"rank": rank, "world": dist.get_world_size(), **_measure(stage, accum)}
        Path(out, f"rank{rank}-stage{stage}-accum{accum}.json").write_text(json.dumps(record), encoding="utf-8")


def main(out: str, settings: list[str]) -> int:
    import torch.distributed as dist

    init_distributed("gloo")
    write_records(out, settings)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
