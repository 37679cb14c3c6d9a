"""The Muon optimizer's state bytes and step temporaries, recorded from the frameworks' own code
on CPU: torch.optim.Muon (torch/optim/_muon.py) for one matrix at a time, and DeepSpeed's engine
with its MuonWithAuxAdam (the "Muon" optimizer type) under ZeRO stages 1 and 2 on gloo, 2 ranks,
bf16. tests/test_muon.py checks zeroplan.core.muon against the committed records (reading JSON
only).

torch.optim.Muon: for each shape and gradient dtype, the bytes of the momentum buffer it keeps
and the peak of the bytes its second step's operators allocate beyond what existed before it (a
TorchDispatchMode counting every new storage until it is freed): Newton-Schulz's temporaries.

DeepSpeed: a tiny model named as Hugging Face names its layers (embed_tokens, layers.*, norm,
lm_head), sized so that the Muon group's partition bound cuts a matrix, so that deepspeed.initialize tags each parameter use_muon by its own rule; after one
step, per rank: every parameter's use_muon, and for each flat group its use_muon, its partition's
elements, the whole elements of the parameters in the partition, and the numel and element size
of each state tensor the step left (optimizer.state) and of the staged momentum
(_muon_pending_momentum), and the bytes of each storage its averaged_gradients hold between the
backward and the step. torch.compile is disabled (TORCHDYNAMO_DISABLE) so the CPU run does
not compile muon_update; the states it leaves do not depend on that. With --bf16-pure the engine
runs DeepSpeed's bf16 master weights, gradients and optimizer states under torch_autocast (what
zeroplan's bf16-pure precision stands for under DeepSpeed: specs.deepspeed_config.bf16_autocast),
and the records go to bf16-pure-records.json. Usage:

    python benchmarks/muon_records.py               # writes benchmarks/muon-records/records.json
    python benchmarks/muon_records.py --bf16-pure   # writes benchmarks/muon-records/bf16-pure-records.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

OUT = Path(__file__).resolve().parent / "muon-records" / "records.json"
BF16_PURE_OUT = OUT.with_name("bf16-pure-records.json")
BF16_PURE = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
             "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
"""DeepSpeed's low-precision master partition and Adam states (runtime/base_optimizer.py
_configure_master_weights: bf16_optimizer_states needs bf16_master_weights_and_grads; on the GPU
without offload), under the torch_autocast zeroplan plans them with."""
SHAPES = [(64, 256), (256, 64), (128, 128), (48, 80)]
STAGES = [1, 2]


def live_bytes_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        """The bytes of the storages the operators inside have made and not yet freed, and
        their peak. A storage an operator returns that one of its inputs owns (a view, an
        in-place result) is not new."""

        def __init__(self) -> None:
            super().__init__()
            self.live_bytes = 0
            self.peak_bytes = 0
            self._seen: set[int] = set()

        def _free(self, key: int, nbytes: int) -> None:
            self._seen.discard(key)
            self.live_bytes -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for tensor in tree_flatten(out)[0]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or key in inputs or key in self._seen:
                    continue
                self._seen.add(key)
                self.live_bytes += nbytes
                weakref.finalize(storage, self._free, key, nbytes)
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return out

    return LiveBytes()


def torch_records() -> list[dict]:
    import torch

    torch.manual_seed(0)
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            weight = torch.nn.Parameter(torch.randn(*shape, dtype=dtype))
            weight.grad = torch.randn_like(weight)
            optimizer = torch.optim.Muon([weight], lr=0.02)
            optimizer.step()  # the first step makes the momentum buffer
            mode = live_bytes_mode()
            with mode:
                optimizer.step()
            state = optimizer.state[weight]
            records.append({"shape": list(shape), "grad_bytes": weight.grad.element_size(),
                            "state": {k: [v.numel(), v.element_size()] for k, v in state.items() if torch.is_tensor(v)},
                            "step_peak_bytes": mode.peak_bytes, "left_bytes": mode.live_bytes})
    return records


def rank_main(stage: int, out: Path, bf16_pure: bool = False) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(32, 48, bias=False)
            self.k_proj = nn.Linear(32, 16, bias=False)
            self.o_proj = nn.Linear(48, 32, bias=True)
            self.up_proj = nn.Linear(32, 96, bias=False)
            self.down_proj = nn.Linear(96, 32, bias=False)
            self.input_layernorm = nn.LayerNorm(32)

        def forward(self, x):
            h = self.input_layernorm(x)
            x = x + self.o_proj(self.q_proj(h)) + self.k_proj(h).sum(-1, keepdim=True)
            return x + self.down_proj(torch.relu(self.up_proj(x)))

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 32)
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            self.norm = nn.LayerNorm(32)
            self.lm_head = nn.Linear(32, 100, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Tiny()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "steps_per_print": 2**31 - 1, **(BF16_PURE if bf16_pure else {})}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)
    tokens = torch.randint(0, 100, (2, 5))
    engine.backward(engine(tokens).float().pow(2).mean())
    zero = engine.optimizer
    # The storages each group's averaged_gradients hold between the backward's end and the step.
    held = [sorted({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in zero.averaged_gradients[i]}.values())
            for i in range(len(zero.bit16_groups))]
    engine.step()
    inner = zero.optimizer
    groups = []
    for i, group in enumerate(inner.param_groups):
        flat = group["params"][0]
        staged = zero._muon_pending_momentum.get(i)
        groups.append({
            "use_muon": bool(group["use_muon"]), "partition_elements": flat.numel(),
            "params_in_partition": [p.numel() for p in zero.params_in_partition[i]],
            "group_params": [p.numel() for p in zero.bit16_groups[i]],
            "state": {k: [v.numel(), v.element_size()] for k, v in inner.state[flat].items() if torch.is_tensor(v)},
            "staged_momentum": None if staged is None else [staged[0].numel(), staged[0].element_size()],
            "held_storages_bytes": held[i],
        })
    record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "stage": stage,
              "use_muon": {n: bool(p.use_muon) for n, p in model.named_parameters()},
              "shapes": {n: list(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()},
              "groups": groups}
    out.with_name(f"{out.stem}-{stage}-{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def main(bf16_pure: bool = False) -> int:
    import deepspeed
    import torch

    out = BF16_PURE_OUT if bf16_pure else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
    for stage in STAGES:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                        __file__, "--rank-worker", str(stage), *(["--bf16-pure"] if bf16_pure else [])],
                       check=True, env=env)
        for rank in range(2):
            part = out.with_name(f"{out.stem}-{stage}-{rank}.json")
            runs.append(json.loads(part.read_text()))
            part.unlink()
    records = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
    if not bf16_pure:
        records["torch_muon"] = torch_records()
    out.write_text(json.dumps({**records, "deepspeed_runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        pure = "--bf16-pure" in sys.argv
        rank_main(int(sys.argv[2]), BF16_PURE_OUT if pure else OUT, pure)
    else:
        raise SystemExit(main("--bf16-pure" in sys.argv))
