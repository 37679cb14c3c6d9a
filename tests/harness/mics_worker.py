"""Per-rank probe of MiCS under DeepSpeed's own engine (CPU, gloo), for a DeepSpeed release that
still has runtime/zero/mics.py (0.19 removed it; benchmarks/mics_records.py says which one ran):

    NDEV_PER_NODE=2 torchrun --nproc-per-node 4 tests/harness/mics_worker.py OUT_DIR SHARD

drives zeroplan.harness.deepspeed_engine.DeepSpeedZero at stage 3 with mics_shard_size SHARD on
micro-llama in fp32 for two steps and writes, per rank, the model-state bytes it holds (its
parameter partition, the fp32 gradient partition handed to the optimizer, the fp32 master and
AdamW's states) and every collective it issued per step and phase, with the global ranks of
its group (zeroplan.harness.comm.CommRecorder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zeroplan.harness.comm import CommRecorder
from zeroplan.harness.deepspeed_engine import DeepSpeedZero
from zeroplan.harness.engine import optimizer_state_tensors
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import init_distributed

MODEL, MICRO_BATCH, SEQ_LEN, STEPS = "micro-llama", 2, 16, 2


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Handles:
    """The handles of the member all-gathers, waited together like a coalesced one."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


def _gather_one_by_one(self, output_tensors, input_tensors, group=None, async_op=False):  # type: ignore[no-untyped-def]
    """gloo has no coalescing (ProcessGroupGloo: 'does not implement startCoalescing'), which
    DeepSpeed's TorchBackend.all_gather_coalesced opens for MiCS's flat all-gather
    (mics.py _flat_all_gather_with_coalescing_manager); this issues the same member
    all_gather_into_tensor calls, same tensors and group, one at a time."""
    handles = [torch.distributed.all_gather_into_tensor(o, i, group=group, async_op=async_op)
               for o, i in zip(output_tensors, input_tensors)]
    return _Handles(handles) if async_op else None


def main(out: str, shard: int) -> int:
    import deepspeed
    import torch.distributed as dist

    from deepspeed.comm.torch import TorchBackend

    TorchBackend.all_gather_coalesced = _gather_one_by_one
    init_distributed("gloo")
    torch.manual_seed(0)
    preset = HARNESS_PRESETS[MODEL]
    engine = DeepSpeedZero(build_model(preset), 3, torch.float32, MICRO_BATCH, mics_shard_size=shard)
    assert type(engine.zero_optimizer).__name__ == "MiCS_Optimizer", type(engine.zero_optimizer)
    tokens = torch.randint(0, preset.vocab_size, (MICRO_BATCH, SEQ_LEN + 1))
    steps = []
    for _ in range(STEPS):
        recorder = CommRecorder()
        with recorder:
            recorder.phase = "forward"
            loss = next_token_loss(engine.ds(tokens[:, :-1]), tokens[:, 1:])
            recorder.phase = "backward"
            engine.ds.backward(loss)
            recorder.phase = "step"
            engine.step()
        steps.append({
            "gradient_bytes": _bytes(engine._step_gradients),
            "collectives": [{"op": r.op, "phase": r.phase, "dtype": r.dtype, "numel": r.numel, "bytes": r.num_bytes,
                             "group_ranks": r.group_ranks} for r in recorder.records],
        })
        engine.zero_grad()
    rank = dist.get_rank()
    parameters = list(engine.module.parameters())
    record = {
        "rank": rank, "world": dist.get_world_size(), "mics_shard_size": shard,
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "optimizer": type(engine.zero_optimizer).__name__,
        "partition_count": engine.zero_optimizer.partition_count,
        "parameter_partition_bytes": _bytes([p.ds_tensor for p in parameters]),
        "master_bytes": _bytes(engine._masters()),
        "optimizer_state_bytes": _bytes(optimizer_state_tensors(engine.optimizer)),
        "steps": steps,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
