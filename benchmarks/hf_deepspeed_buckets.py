"""The reduce ("ipg") bucket DeepSpeed 0.19.8 allocates under Hugging Face's two ways of running
it, measured from the libraries' own code on gloo/CPU (one rank): accelerate 1.10.1's
DeepSpeedPlugin without a config file (utils/dataclasses.py writes no bucket keys) and a
Trainer config whose bucket entries say "auto" (transformers 4.56.2 TrainingArguments ->
HfTrainerDeepSpeedConfig.trainer_config_finalize). The model is a tiny LlamaForCausalLM, far
smaller than either bucket, so the figures show whether the bucket follows the config or the
model. Stage 3 allocates it in __init__ (stage3.py); stage 2 at the first gradient hook
(stage_1_and_2.py setup_buckets), seen here as a torch.empty of reduce_bucket_size elements in
the backward (0: none). The
planner's figure for the same request is printed beside it (zeroplan.core.deepspeed_accumulation).
Usage:

    python benchmarks/hf_deepspeed_buckets.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers

HIDDEN = 64


def _auto_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"})
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "zero_optimization": zero}


def _config(way: str, stage: int, model) -> dict:
    if way == "accelerate-plugin":
        from accelerate.utils import DeepSpeedPlugin

        config = dict(DeepSpeedPlugin(zero_stage=stage, offload_optimizer_device="none",
                                      offload_param_device="none").deepspeed_config)
    else:
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir=tempfile.mkdtemp(), deepspeed=_auto_config(stage), report_to=[],
                                 per_device_train_batch_size=2, use_cpu=True)
        args.hf_deepspeed_config.trainer_config_finalize(args, model, 10)
        config = dict(args.hf_deepspeed_config.config)
    # The batch entries the Trainer/accelerate fill from their own arguments.
    config.update({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                   "steps_per_print": 2**31 - 1})
    return config


def measure(way: str, stage: int) -> tuple[dict, int, int, object]:
    import deepspeed
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    config = _config(way, stage, model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)

    size = int(config["zero_optimization"].get("reduce_bucket_size", 500_000_000))

    class BucketEmpties(TorchDispatchMode):
        # The backward's torch.empty calls of exactly reduce_bucket_size elements.
        found = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and out.numel() == size:
                BucketEmpties.found = out.numel()
            return out

    tokens = torch.randint(0, 256, (2, 16))
    if stage == 3:
        opt = engine.optimizer
        bucket = max(b.buffer.numel() for b in opt.ipg_buckets.values())
    else:
        with BucketEmpties():
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        bucket = BucketEmpties.found
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return config["zero_optimization"], bucket, trainable, model


def planned(model, stage: int, bucket_elements: int) -> int:
    """The planner's bucket for the same model under --framework hf (fp32, one GPU)."""
    from zeroplan.core.deepspeed_accumulation import _bucket_elements
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.hf_config import load_hf_config
    from zeroplan.specs import (
        BatchSpec,
        Framework,
        PlanRequest,
        StrategyKind,
        StrategySpec,
        TrainingSpec,
        cluster_from_gpus,
    )
    from zeroplan.specs.training import Precision

    path = Path(tempfile.mkdtemp()) / "config.json"
    model.config.to_json_file(path)
    kind = {2: StrategyKind.zero2, 3: StrategyKind.zero3}[stage]
    request = PlanRequest(model=load_hf_config(path), training=TrainingSpec(framework=Framework.hf, precision=Precision.fp32),
                          batch=BatchSpec(seq_len=16), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
                          strategy=StrategySpec(kind=kind, zero_bucket_elements=bucket_elements))
    return _bucket_elements(request)


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port()),
                       "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"tiny LlamaForCausalLM, hidden {HIDDEN}; DeepSpeed on gloo/CPU, one rank")
    print(f"{'way':20s} {'stage':>5s} {'reduce_bucket_size':>18s} {'ipg bucket (measured)':>22s} "
          f"{'planned':>12s} {'trainable':>10s}")
    for way in ("accelerate-plugin", "trainer-auto"):
        for stage in (2, 3):
            zero, bucket, trainable, model = measure(way, stage)
            size = int(zero.get("reduce_bucket_size", 500_000_000))
            print(f"{way:20s} {stage:5d} {size:18,d} {bucket:22,d} {planned(model, stage, size):12,d} {trainable:10,d}")
            extra = {k: v for k, v in zero.items() if k.startswith("stage3_")}
            if extra:
                print(f"{'':27s}{extra}")
    dist.destroy_process_group()
    remove_deepspeed_shm_buffers(int(os.environ["MASTER_PORT"]))


if __name__ == "__main__":
    main()
    # Every figure is printed; what follows is the interpreter's teardown of DeepSpeed's CPU
    # communication op, which once aborted a CI run after the table ("terminate called without
    # an active exception", SIGABRT) and lost the figures' exit status. Leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
