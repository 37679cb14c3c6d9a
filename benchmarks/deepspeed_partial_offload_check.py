"""DeepSpeed's own ZeRO-3 engine under offload_optimizer.ratio (ZeRO-Offload++'s Twin-Flow), on
one gloo CPU rank: which sub-groups it keeps on the device and which optimizer steps each, against
the rule zeroplan plans (zeroplan.core.deepspeed_partial_offload.first_host_sub_group).

    python benchmarks/deepspeed_partial_offload_check.py

The model is six Linear(64, 64) layers; sub_group_size 4,160 (a layer's weight and bias) makes
each layer one sub-group, DeepSpeed's default 1e9 the whole model one. On the CPU accelerator DeepSpeed's device name is "cpu", the same as
the host's, so every sub-group would read as offloaded (stage3.py:1105-1108 compares with the
accelerator's _name); the accelerator's name is set to "cpu:0" (a valid torch device, the same
memory) after the CPU Adam op is loaded, so that the sub-groups DeepSpeed keeps on the device are
told apart and stepped by its backup torch AdamW (stage3.py:1249-1258: ``cur_device == 'cpu'``
picks the CPU Adam). Printed per ratio: the device of each sub-group, which optimizer holds each
sub-group's fp32 partition's states after one training step (both make them at their first step), and whether
both agree with the first int((1 - ratio) x n) of its n sub-groups being on the device. Needs deepspeed
and its cpu_adam op (built on first use, about 80 s).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from zeroplan.core.deepspeed_partial_offload import first_host_sub_group  # noqa: E402
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers  # noqa: E402

LAYERS, WIDTH = 6, 64
SUB_GROUP = WIDTH * WIDTH + WIDTH
# (ratio, sub_group_size): six sub-groups, and DeepSpeed's default 1e9 (the whole model one sub-group).
CASES = ((0.5, SUB_GROUP), (0.3, SUB_GROUP), (0.8, SUB_GROUP), (0.9, SUB_GROUP), (0.5, 10**9))
DEVICE_NAME = "cpu:0"


def engine_sub_groups(ratio: float, sub_group_size: int) -> tuple[list[str], list[str], list[int]]:
    """(device of each sub-group, which optimizer holds its states, its partition elements)."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from torch import nn

    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    config = {"train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size,
                                    "offload_optimizer": {"device": "cpu", "ratio": ratio}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(1, WIDTH)).square().sum()  # one step: the optimizers make their states
    engine.backward(loss)
    engine.step()
    zero = engine.optimizer
    devices = [zero.subgroup_to_device[i] for i in range(len(zero.fp32_partitioned_groups_flat))]
    holders = []
    for flat in zero.fp32_partitioned_groups_flat:
        in_cpu_adam = flat in zero.optimizer.state and len(zero.optimizer.state[flat]) > 0
        backup = getattr(zero, "backup_optimizer", None)
        in_backup = backup is not None and flat in backup.state and len(backup.state[flat]) > 0
        holders.append({(True, False): "cpu-adam", (False, True): "torch-adamw"}.get((in_cpu_adam, in_backup), "?"))
    del engine, optimizer, torch, get_accelerator
    return devices, holders, [int(n) for n in zero.fp16_partitioned_groups_flat_numel]


def main() -> None:
    port = free_local_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_SIZE="1", DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    DeepSpeedCPUAdam(nn.Linear(1, 1).parameters())  # load (or build) the op under the accelerator's own name
    get_accelerator()._name = DEVICE_NAME
    rows = []
    try:
        for ratio, sub_group_size in CASES:
            devices, holders, numels = engine_sub_groups(ratio, sub_group_size)
            expected = first_host_sub_group(len(devices), ratio)
            on_device = [i for i, d in enumerate(devices) if d == DEVICE_NAME]
            stepped_there = [i for i, h in enumerate(holders) if h == "torch-adamw"]
            rows.append({"ratio": ratio, "sub_group_size": sub_group_size, "sub_groups": len(devices), "elements": numels, "devices": devices,
                         "states_held_by": holders, "zeroplan_device_sub_groups": expected,
                         "agrees": on_device == stepped_there == list(range(expected))})
    finally:
        remove_deepspeed_shm_buffers(port)
    print(json.dumps(rows, indent=1))
    sys.exit(0 if all(row["agrees"] for row in rows) else 1)


if __name__ == "__main__":
    main()
