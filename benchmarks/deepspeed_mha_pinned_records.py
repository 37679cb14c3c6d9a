"""The gathered weights DeepSpeed ZeRO-3 releases but cannot free, recorded from DeepSpeed's own
engine on gloo (4 CPU ranks) running DeepSpeedExamples' bf16_master_weight model (post-norm
blocks of nn.MultiheadAttention and a Linear-GELU-Linear FFN, as benchmarks/deepspeed_bf16mw_step.py
builds it) in bf16 under ZeRO-3 with stage3_param_persistence_threshold 0, at two shapes:

- "small": hidden 128, 4 heads, 8 blocks, vocabulary 256, batch 1 x 16; a prefetch bucket of
  50,000 elements (a quarter of a block), stage3_max_live_parameters 1e6; with and without
  torch's non-reentrant block checkpoint, under stage3_max_reuse_distance 1e6 (five blocks) and 0;
- "6.86b/1024": the published 6.86B row's shape and config over 1,024 as
  benchmarks/deepspeed_bf16mw_step.py runs it (hidden 128, 32 heads, 32 blocks, vocabulary 1,563,
  batch 1 x 16; every stage-3 size of configs/baseline.json and DeepSpeed's defaults over 1,024),
  without checkpointing.

At each module's forward, after DeepSpeed's pre-forward hook has gathered its parameters, every
parameter's gathered storage is remembered by a weak reference (torch.multiprocessing.reductions
StorageWeakRef). A storage is "pinned" when ZeRO-3 has released its parameter (free_param swaps
param.data for an empty tensor, or a later gather for another storage) while something else still
holds the storage alive. Measured in the second step: the pinned bytes once the loss is computed,
the most pinned at any block's backward (a tensor hook on the attention's output and one on the
block's input) and after the backward, per module kind (the attention's in_proj_weight and
in_proj_bias; the FFN's nn.Linear weights and biases); per block what became of the
in_proj_weight its forward gathered; and the parameters gathered once the loss is computed.
zeroplan.core.deepspeed_mha_views plans them; tests/test_deepspeed_mha_views.py checks the
planner against the committed records.

With --torch-linear, torch's own F.linear is put back after deepspeed.initialize, as every DeepSpeed
release before 0.19.4 left it for a model built outside zero.Init (benchmarks/deepspeed_bf16mw_step.py
restore_torch_linear): the attention's out_proj weight is recorded too, and the records go to
benchmarks/deepspeed-mha-records/torch-linear.json, which zeroplan.core.deepspeed_torch_linear plans and
tests/test_deepspeed_torch_linear.py checks. Usage:

    python benchmarks/deepspeed_mha_pinned_records.py   # writes benchmarks/deepspeed-mha-records/records.json
    python benchmarks/deepspeed_mha_pinned_records.py --torch-linear   # writes .../torch-linear.json
    python benchmarks/deepspeed_mha_pinned_records.py --setting small-none-reuse-0 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))
from deepspeed_bf16mw_step import restore_torch_linear, simple_transformer  # noqa: E402

OUT = ROOT / "benchmarks" / "deepspeed-mha-records" / "records.json"
TORCH_LINEAR_OUT = ROOT / "benchmarks" / "deepspeed-mha-records" / "torch-linear.json"
SHAPES = {
    "small": {"hidden": 128, "heads": 4, "layers": 8, "vocab": 256, "micro_batch": 1, "seq": 16,
              "bucket": 50_000, "max_live": 1_000_000, "sub_group": 10**9},
    # benchmarks/deepspeed_bf16mw_step.py's SHAPES["6.86b"] and stage3().
    "6.86b/1024": {"hidden": 128, "heads": 32, "layers": 32, "vocab": 1563, "micro_batch": 1, "seq": 16,
                   "bucket": 5 * 10**7 // 1024, "max_live": 10**9 // 1024, "sub_group": 10**9 // 1024},
}
WORLD = 4
STEPS = 2
SETTINGS = (("small", "none", 1_000_000), ("small", "full", 1_000_000), ("small", "none", 0), ("small", "full", 0),
            ("6.86b/1024", "none", 10**9 // 1024))
"""(shape, activation checkpointing, stage3_max_reuse_distance) of each run."""


def _model(shape: dict, checkpoint: bool):
    return simple_transformer(shape["hidden"], shape["heads"], shape["layers"], shape["vocab"], shape["seq"], checkpoint)


def config(shape: dict, reuse: int) -> dict:
    """The run's DeepSpeed config."""
    return {"train_micro_batch_size_per_gpu": shape["micro_batch"], "gradient_accumulation_steps": 1,
            "steps_per_print": 2**31 - 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": shape["bucket"], "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": shape["bucket"],
                                  "stage3_max_live_parameters": shape["max_live"],
                                  "stage3_max_reuse_distance": reuse, "sub_group_size": shape["sub_group"]},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _kind(module_name: str, param_name: str) -> str | None:
    """The module kind a gathered parameter is recorded under (None: not recorded)."""
    if module_name.endswith(".attention") and param_name.startswith("in_proj"):
        return "attention_in_proj"
    if module_name.endswith(".attention") and param_name == "out_proj.weight":
        return "attention_out_proj"
    if ".ff." in module_name:
        return "ffn_linear"
    return None


def _own_parameters(module_name: str, module):
    """(name, parameter) of what the module's forward uses: its own, and under torch's
    nn.MultiheadAttention its out_proj's, whose forward never runs (the attention passes
    out_proj.weight and out_proj.bias to F.multi_head_attention_forward)."""
    yield from module.named_parameters(recurse=False)
    if module_name.endswith(".attention"):
        yield from module.out_proj.named_parameters(prefix="out_proj")


def _rank(rank: int, port: int, shape_name: str, checkpoint: bool, reuse: int, torch_linear: bool, out: str) -> None:
    shape = SHAPES[shape_name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.reductions import StorageWeakRef

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = _model(shape, checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(shape, reuse),
                                           dist_init_required=False)
    if torch_linear:
        restore_torch_linear()
    # (kind, parameter, weak reference to the storage it had at its module's forward, bytes)
    gathered: dict[int, tuple[str, torch.nn.Parameter, StorageWeakRef, int]] = {}

    def remember(module_name: str):
        def hook(module, args):
            for name, param in _own_parameters(module_name, module):
                kind = _kind(module_name, name)
                storage = param.data.untyped_storage()
                if kind is not None and param.data.numel():
                    gathered[storage.data_ptr()] = (kind, param, StorageWeakRef(storage), storage.nbytes())
        return hook

    # Registered after deepspeed.initialize: each runs after DeepSpeed's own pre-forward hook,
    # which has gathered the module's parameters by then.
    for name, module in engine.module.named_modules():
        module.register_forward_pre_hook(remember(name))

    def pinned() -> dict[str, int]:
        held: dict[str, int] = {}
        for pointer, (kind, param, ref, nbytes) in gathered.items():
            if not ref.expired() and param.data.untyped_storage().data_ptr() != pointer:
                held[kind] = held.get(kind, 0) + nbytes
        return held

    def in_projection_states() -> list[str]:
        """Per block, what became of the in_proj_weight its forward gathered: still the parameter's
        ("gathered"), released by ZeRO-3 but alive ("pinned"; "pinned, gathered again" where a
        prefetch has gathered the parameter anew), or freed."""
        states = []
        for layer in engine.module.layers:
            param = layer.attention.in_proj_weight
            current = param.data.untyped_storage().data_ptr() if param.data.numel() else None
            own = [(pointer, ref) for pointer, (_, p, ref, _) in gathered.items() if p is param]
            if any(pointer == current for pointer, _ in own):
                states.append("gathered")
            elif any(not ref.expired() for _, ref in own):
                states.append("pinned" if current is None else "pinned, gathered again")
            else:
                states.append("freed")
        return states

    most: dict[str, int] = {}

    def probe(moment: str) -> None:
        for kind, nbytes in pinned().items():
            most[kind] = max(most.get(kind, 0), nbytes)

    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(rank)
    vocab, batch = shape["vocab"], (shape["micro_batch"], shape["seq"])
    record: dict = {}
    for step in range(STEPS):
        measuring = step == STEPS - 1
        for layer in engine.module.layers:
            layer.probe = probe if measuring else None
        gathered.clear()
        most.clear()
        ids = torch.randint(0, vocab, batch, generator=generator)
        labels = torch.randint(0, vocab, batch, generator=generator)
        loss = loss_fn(engine(ids).view(-1, vocab), labels.view(-1))
        after_forward = pinned()
        states_after_forward = in_projection_states()
        gathered_names = [name for name, param in engine.module.named_parameters() if param.data.numel()]
        engine.backward(loss)
        after_backward = pinned()
        engine.step()
        if measuring:
            record = {"after_forward": after_forward, "most_in_backward": dict(most), "after_backward": after_backward,
                      "in_proj_after_forward": states_after_forward, "gathered_after_forward": gathered_names}
    if rank == 0:
        record.update(deepspeed=deepspeed.__version__, torch=torch.__version__, world=WORLD, shape_name=shape_name,
                      shape=shape, checkpointing="full" if checkpoint else "none", config=config(shape, reuse),
                      torch_linear=torch_linear)
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def run(shape_name: str, checkpointing: str, reuse: int, torch_linear: bool = False) -> dict:
    """One setting's record (rank 0's; every rank holds the same shapes)."""
    import torch.multiprocessing as mp

    out = str(Path(tempfile.mkdtemp()) / "record.json")
    port = free_local_port()
    try:
        mp.spawn(_rank, args=(port, shape_name, checkpointing == "full", reuse, torch_linear, out), nprocs=WORLD)
    finally:
        remove_deepspeed_shm_buffers(port)
    return json.loads(Path(out).read_text())


def setting_name(shape_name: str, checkpointing: str, reuse: int) -> str:
    return f"{shape_name}-{checkpointing}-reuse-{reuse}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default {OUT.name}, {TORCH_LINEAR_OUT.name} with --torch-linear")
    parser.add_argument("--torch-linear", action="store_true",
                        help="put torch's own F.linear back after deepspeed.initialize (DeepSpeed before 0.19.4, a "
                             "model built outside zero.Init)")
    parser.add_argument("--setting", choices=[setting_name(*setting) for setting in SETTINGS], action="append",
                        help="run only this setting (repeatable; default: every one)")
    options = parser.parse_args()
    chosen = [setting for setting in SETTINGS if options.setting is None or setting_name(*setting) in options.setting]
    records = {setting_name(*setting): run(*setting, torch_linear=options.torch_linear) for setting in chosen}
    options.out = options.out or (TORCH_LINEAR_OUT if options.torch_linear else OUT)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    for setting, record in records.items():
        print(f"{setting}: pinned after forward {record['after_forward']}, most in backward "
              f"{record['most_in_backward']}, after backward {record['after_backward']}; each block's in_proj_weight after the forward: "
              f"{'; '.join(record['in_proj_after_forward'])}")


if __name__ == "__main__":
    main()
