"""The fp64 copies DeepSpeed's ZeRO stage-1/2 step makes to take the gradient norm, recorded
from DeepSpeed's own engine on gloo/CPU (2 ranks): every tensor of dtype float64 the step's
operators return (a TorchDispatchMode around engine.step()), per rank, for stages 1 and 2 in fp32
and bf16. The model is an embedding-like 1000 x 64 weight ahead of two small linears, so rank 0's
partition lies inside the first tensor and rank 1's cuts it. tests/test_deepspeed_step.py checks
zeroplan.core.deepspeed_step against the committed records (reading JSON only). Usage:

    python benchmarks/deepspeed_norm_records.py   # writes benchmarks/deepspeed-norm-records/records.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "deepspeed-norm-records" / "records.json"
RUNS = [(1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]


def rank_main(stage: int, dtype: str, out: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    class Float64Outputs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # The casts themselves (aten._to_copy): what holds a gradient's elements in fp64.
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.float64:
                self.copies.append(out.numel())
            return out

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "bf16": {"enabled": dtype == "bf16"}, "gradient_clipping": 1.0, "steps_per_print": 2**31 - 1}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)
    tokens = torch.randint(0, 1000, (2, 5))
    engine.backward(engine(tokens).float().pow(2).mean())
    recorder = Float64Outputs()
    with recorder:
        engine.step()
    record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "stage": stage, "dtype": dtype,
              "numels": [p.numel() for p in model.parameters()], "float64_copies": recorder.copies}
    out.with_name(f"{out.stem}-{stage}-{dtype}-{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def main() -> int:
    import deepspeed

    OUT.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for stage, dtype in RUNS:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531",
                        __file__, "--rank-worker", str(stage), dtype], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        for rank in range(2):
            part = OUT.with_name(f"{OUT.stem}-{stage}-{dtype}-{rank}.json")
            runs.append(json.loads(part.read_text()))
            part.unlink()
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__, "runs": runs}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        rank_main(int(sys.argv[2]), sys.argv[3], OUT)
    else:
        raise SystemExit(main())
