"""Measure DeepSpeed's BF16_Optimizer as Megatron-DeepSpeed runs it (bf16, ZeRO stage 1 with
fp32 gradient accumulation, the pipeline engine, the fork's two parameter groups), on gloo (2
CPU ranks), into benchmarks/megatron-deepspeed-records/records.json:

    python benchmarks/megatron_deepspeed_records.py [--out DIR]

The model is a small GPT-like PipelineModule (an embedding, two blocks of LayerNorm, fused QKV,
output projection, two MLP linears, all with biases, and a final LayerNorm and head) of
odd-sized tensors, so that the 2 x dp alignment pads; its parameters are split as the fork's
megatron/optimizer/__init__.py get_param_groups splits them (biases and 1-D tensors without
weight decay) and handed to torch's AdamW (foreach=False) as the client optimizer, as the fork
hands apex's FusedAdam (same states: exp_avg, exp_avg_sq). deepspeed.initialize wraps it in
BF16_Optimizer (runtime/engine.py _do_optimizer_sanity_check: bf16, stage 1, grad_accum_dtype
fp32). Two steps of train_batch with 2 micro-batches each run; then, by storage:

- the bf16 flat groups (bf16_groups_flat) and whether every module parameter lives inside them;
- the parameters' own .grad tensors (bf16) when the inner optimizer starts stepping (a step
  pre-hook) and after train_batch (BF16_Optimizer.zero_grad sets them to None);
- the fp32 flat gradient buffers (fp32_groups_gradients_flat) and fp32 master partitions;
- AdamW's state tensors;
- every tensor buffered_allreduce_fallback all-reduced (dtype, elements, and whether it is a
  flat gradient buffer itself or a copy), recorded by wrapping deepspeed.comm.all_reduce, and
  every flatten of a bucket (copy or view).

With ``--zero-optimizer`` (bf16 at DeepSpeed's default grad_accum_dtype, the ZeRO stage-1
optimizer under the same pipeline engine) it records instead, into records-zero1-bf16.json, what
that optimizer and the parameters' .grad hold before and after the pipeline's reduce (the end of
the step's backward), when the inner optimizer steps and after train_batch.

The record keeps each figure next to zeroplan.core.megatron_deepspeed.bf16_optimizer_bytes and
allreduce_copy_bytes for the same groups (tests/test_megatron_deepspeed.py compares them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.atomic import write_text_atomic
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers

NPROC, MICRO_BATCH, SEQ, ACCUM, STEPS = 2, 2, 8, 2, 2
VOCAB, HIDDEN, FFN = 67, 19, 45
OUT = ROOT / "benchmarks" / "megatron-deepspeed-records"


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word = torch.nn.Embedding(VOCAB, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens)


class Block(torch.nn.Module):
    """Megatron's pre-norm block in the shapes that matter to the optimizer (fused QKV)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / HIDDEN**0.5, dim=-1) @ v
        x = x + self.proj(att)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x)).float()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _param_groups(module: torch.nn.Module) -> list[dict]:
    """The fork's get_param_groups without lr scaling (megatron/optimizer/__init__.py:18-66)."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        (no_decay if name.endswith(".bias") or len(param.shape) == 1 else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _held(engine, optimizer, params, masters: set, states: set) -> dict:
    """Bytes the ZeRO optimizer and the parameters' .grad hold, by attribute, by storage
    (parameters, fp32 master partitions and Adam states apart)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from deepspeed_accumulation_records import _walk

    found: dict = {}
    for p in params:
        if p.grad is not None:
            found.setdefault(_storage(p.grad), "param.grad")
    seen = {id(engine.module), id(optimizer.optimizer), id(getattr(optimizer, "module", None)), id(optimizer)}
    for name, item in vars(optimizer).items():
        _walk(item, name, found, seen, 1)
    skip = {_storage(p) for p in params} | masters | states
    held: dict[str, int] = {}
    for key, path in found.items():
        if key not in skip:
            name = path.split("[")[0]
            held[name] = held.get(name, 0) + key[1]
    return dict(sorted(held.items()))


def _worker(rank: int, out: str, zero_optimizer: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(NPROC))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=NPROC)
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from zeroplan.harness.engine import optimizer_state_tensors

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the group started above
    torch.manual_seed(0)
    module = PipelineModule(layers=[Embed(), Block(), Block(), Head()], num_stages=1, loss_fn=_loss,
                            partition_method="uniform")
    groups = _param_groups(module)
    group_numels = [sum(p.numel() for p in g["params"]) for g in groups]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
    }
    if not zero_optimizer:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    if zero_optimizer:
        _zero_optimizer_record(rank, out, engine, module, group_numels)
        return
    bf16 = engine.optimizer
    assert isinstance(bf16, BF16_Optimizer), type(bf16)

    reduced: list[dict] = []
    flattened: list[dict] = []
    original_all_reduce, original_flatten = ds_comm.all_reduce, engine.flatten

    def all_reduce(tensor, *args, **kwargs):
        flats = {_storage(t) for t in bf16.fp32_groups_gradients_flat}
        reduced.append({"dtype": str(tensor.dtype), "elements": tensor.numel(),
                        "is_flat_gradient_buffer": _storage(tensor) in flats})
        return original_all_reduce(tensor, *args, **kwargs)

    def flatten(tensors):
        result = original_flatten(tensors)
        inputs = {_storage(t) for t in tensors}
        flattened.append({"tensors": len(tensors), "elements": result.numel(),
                          "copy": _storage(result) not in inputs})
        return result

    ds_comm.all_reduce = all_reduce
    engine.flatten = flatten
    params = list(module.parameters())

    def grad_bytes() -> dict:
        grads = [p.grad for p in params if p.grad is not None]
        return {"bytes": sum(t.numel() * t.element_size() for t in grads), "tensors": len(grads),
                "dtypes": sorted({str(t.dtype) for t in grads}),
                "own_storage": len({_storage(t) for t in grads}) == len(grads)}

    at_step: list[dict] = []
    bf16.optimizer.register_step_pre_hook(lambda *_: at_step.append(grad_bytes()))
    data = _batches(rank)
    steps = []
    for _ in range(STEPS):
        reduced.clear()
        flattened.clear()
        engine.train_batch(data_iter=data)
        steps.append({"all_reduces": [r for r in reduced if r["elements"] > 1], "flattens": list(flattened),
                      "parameter_grads_at_step": at_step.pop(), "parameter_grads_after_step": grad_bytes()})
    ds_comm.all_reduce = original_all_reduce

    flat_storages = {_storage(t) for t in bf16.bf16_groups_flat}
    record = {
        "rank": rank, "world_size": NPROC, "group_numels": group_numels,
        "parameters_in_flat_groups": all(_storage(p) in flat_storages for p in params),
        "bf16_flat_group_bytes": sum(t.untyped_storage().nbytes() for t in bf16.bf16_groups_flat),
        "bf16_flat_group_elements": [t.numel() for t in bf16.bf16_groups_flat],
        "fp32_gradient_buffer_bytes": sum(t.untyped_storage().nbytes() for t in bf16.fp32_groups_gradients_flat),
        "fp32_master_partition_bytes": sum(t.untyped_storage().nbytes() for t in bf16.fp32_groups_flat_partition),
        "optimizer_state_bytes": sum(t.untyped_storage().nbytes() for t in optimizer_state_tensors(bf16.optimizer)
                                     if t.dim() > 0),
        "immediate_grad_update": bool(bf16.immediate_grad_update),
        "steps": steps,
    }
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")
    _leave(rank)


def _leave(rank: int) -> None:
    """End a rank whose record is written. DeepSpeed's CPU communication op can abort in the
    interpreter's teardown ("terminate called without an active exception": a thread still
    joinable when its object is destroyed), which mp.spawn reports as the rank dying of SIGABRT
    although its record is complete; so once every rank has written, the process leaves without
    running that teardown."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _batches(rank: int):
    """Endless (tokens, next tokens) micro-batches, seeded per rank: the pipeline engine's data."""
    g = torch.Generator().manual_seed(1 + rank)
    while True:
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        yield tokens, torch.roll(tokens, -1, dims=1)


def _zero_optimizer_record(rank: int, out: str, engine, module, group_numels: list[int]) -> None:
    """bf16 at DeepSpeed's default grad_accum_dtype: the ZeRO stage-1 optimizer under the
    pipeline engine, what it holds at the end of the step's backward (before _exec_reduce_grads),
    after the reduce, when the inner optimizer steps and after train_batch."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from zeroplan.harness.engine import optimizer_state_tensors

    zero = engine.optimizer
    assert isinstance(zero, DeepSpeedZeroOptimizer), type(zero)
    params = list(module.parameters())
    masters = {_storage(t) for t in zero.single_partition_of_fp32_groups}
    moments: dict[str, dict] = {}

    def states() -> set:
        return {_storage(t) for t in optimizer_state_tensors(zero.optimizer) if t.dim() > 0}

    # The engine runs each schedule instruction through its class's _INSTRUCTION_MAP (bound with
    # MethodType), so the reduce is wrapped there, on this instance's copy of the map.
    from deepspeed.runtime.pipe import schedule

    instructions = dict(type(engine)._INSTRUCTION_MAP)
    original_reduce = instructions[schedule.ReduceGrads]

    def reduce_grads(self, *args, **kwargs):
        moments["before_reduce"] = _held(engine, zero, params, masters, states())
        result = original_reduce(self, *args, **kwargs)
        moments["after_reduce"] = _held(engine, zero, params, masters, states())
        return result

    instructions[schedule.ReduceGrads] = reduce_grads
    engine._INSTRUCTION_MAP = instructions
    zero.optimizer.register_step_pre_hook(lambda *_: moments.__setitem__("at_step", _held(engine, zero, params, masters,
                                                                                           states())))
    data = _batches(rank)
    steps = []
    for _ in range(STEPS):
        moments.clear()
        engine.train_batch(data_iter=data)
        moments["after_step"] = _held(engine, zero, params, masters, states())
        steps.append(dict(moments))
    record = {
        "rank": rank, "world_size": NPROC, "group_numels": group_numels,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "master_bytes": sum(n for _, n in masters), "optimizer_state_bytes": sum(n for _, n in states()),
        "reduce_bucket_size": int(zero.reduce_bucket_size), "steps": steps,
    }
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")
    _leave(rank)


def _run_ranks(out: Path, zero_optimizer: bool) -> list[dict]:
    """Spawn the NPROC gloo ranks, each writing its record under out/tmp; their records, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = free_local_port()
    os.environ["MASTER_PORT"] = str(port)
    try:
        mp.spawn(_worker, args=(str(tmp), zero_optimizer), nprocs=NPROC, join=True)
    finally:
        remove_deepspeed_shm_buffers(port)
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(NPROC)]
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return ranks


def main_zero_optimizer(out: Path = OUT) -> None:
    """The ZeRO stage-1 optimizer's record (records-zero1-bf16.json)."""
    ranks = _run_ranks(out, zero_optimizer=True)
    record = {"command": "python benchmarks/megatron_deepspeed_records.py --zero-optimizer",
              "deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__, "backend": "gloo",
              "ranks": ranks}
    write_text_atomic(out / "records-zero1-bf16.json", json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'records-zero1-bf16.json'}")


def main(out: Path = OUT) -> None:
    from zeroplan.core.megatron_deepspeed import (
        allreduce_copy_bytes,
        bf16_optimizer_bytes,
    )

    start = time.perf_counter()
    ranks = _run_ranks(out, zero_optimizer=False)
    planned = bf16_optimizer_bytes(tuple(ranks[0]["group_numels"]), NPROC, 8)
    record = {
        "command": "python benchmarks/megatron_deepspeed_records.py",
        "deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__, "backend": "gloo",
        "planned": {
            "parameter_bytes": planned.parameter_bytes, "gradient_bytes": planned.gradient_bytes,
            "gradient_buffer_bytes": planned.gradient_buffer_bytes,
            "optimizer_state_bytes": planned.optimizer_state_bytes, "group_elements": list(planned.group_elements),
            "partition_elements": planned.partition_elements,
            "allreduce_copy_bytes": allreduce_copy_bytes(planned.group_elements),
        },
        "ranks": ranks,
    }
    write_text_atomic(out / "records.json", json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'records.json'} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--zero-optimizer", action="store_true",
                        help="bf16 at DeepSpeed's default grad_accum_dtype: its ZeRO stage-1 optimizer")
    parsed = parser.parse_args()
    (main_zero_optimizer if parsed.zero_optimizer else main)(parsed.out)
