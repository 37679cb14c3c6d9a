"""Per-rank probe of the process groups DeepSpeed's ZeRO-3 runs its collectives on (CPU, gloo):

    torchrun --nproc-per-node 2 tests/harness/groups_worker.py OUT_DIR [DEEPSPEED_SOURCE]

drives zeroplan.harness.deepspeed_engine.DeepSpeedZero at stage 3 on micro-llama in fp32 for one
step (no mpu, as accelerate and transformers run it) and writes, per rank, each collective kind's
calls by the process group they ran on: "world" for the default group, else the group's name,
with each group's size. ProcessGroupNCCL opens one communicator per process group a collective
runs on (zeroplan.core.communicators). DEEPSPEED_SOURCE runs an earlier release from its source
tree instead of the installed one (e.g. 0.13.3: `git archive v0.13.3 deepspeed op_builder accelerator`
of microsoft/DeepSpeed), imported as benchmarks/deepspeed_zero3_lora_step.py does.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroplan.harness.comm import _KIND, _process_group
from zeroplan.harness.deepspeed_engine import DeepSpeedZero
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import init_distributed

MODEL, MICRO_BATCH, SEQ_LEN = "micro-llama", 2, 16


class GroupRecorder(TorchDispatchMode):
    """Counts each c10d collective by its kind and the process group it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.sizes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_default_group

            group = _process_group(func, args)
            if group is not None:
                name = "world" if group.group_name == _get_default_group().group_name else group.group_name
                kind = _KIND.get(func._schema.name.split("::")[-1], func._schema.name)
                self.calls[kind][name] += 1
                self.sizes[name] = dist.get_world_size(group) if name != "world" else dist.get_world_size()
        return func(*args, **(kwargs or {}))


def write_record(out: str) -> None:
    """Measure on the process group already started."""
    import torch.distributed as dist

    torch.manual_seed(0)
    preset = HARNESS_PRESETS[MODEL]
    engine = DeepSpeedZero(build_model(preset), 3, torch.float32, MICRO_BATCH)
    tokens = torch.randint(0, preset.vocab_size, (MICRO_BATCH, SEQ_LEN + 1))
    recorder = GroupRecorder()
    with recorder:
        loss = next_token_loss(engine.ds(tokens[:, :-1]), tokens[:, 1:])
        engine.ds.backward(loss)
        engine.step()
    record = {"rank": dist.get_rank(), "calls": {k: dict(v) for k, v in recorder.calls.items()},
              "group_sizes": recorder.sizes}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record), encoding="utf-8")


def main(out: str, deepspeed_source: str | None = None) -> int:
    import torch.distributed as dist

    if deepspeed_source:
        import os

        # The CPU accelerator's device count reads LOCAL_SIZE (else it asks numactl).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from deepspeed_zero3_lora_step import _import_old_deepspeed

        _import_old_deepspeed(deepspeed_source)
    init_distributed("gloo")
    write_record(out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
