"""Measure which gradient buffers DeepSpeed's own ZeRO engine holds between the micro-steps of
gradient accumulation, by storage, on gloo (2 CPU ranks), into
benchmarks/deepspeed-accumulation-records/ (its README lists the commands that wrote the files).

    python benchmarks/deepspeed_accumulation_records.py [--stages 1,2,3] [--precisions fp32,bf16-mixed]
        [--accumulations 1,2,4] [--variants default,no-contiguous,overlap,quarter-bucket] [--name FILE]

For every ZeRO stage (0, DeepSpeed's unpartitioned optimizer; 1, 2, 3), precision (fp32,
bf16-mixed; fp16-mixed, planned at stage 0), accumulation (1, 2, 4) and ZeRO
setting (DeepSpeed's defaults as the harness sets them: contiguous_gradients on, overlap_comm
off, one reduce bucket of the whole model; contiguous_gradients off; overlap_comm on; a reduce
bucket of a quarter of the model) it builds the harness's DeepSpeed engine
(zeroplan.harness.deepspeed_engine.DeepSpeedZero) and runs two optimizer steps. After each
micro-step's backward (and DeepSpeed's step, which at a micro-step that is not the boundary only
counts it) it walks the engine: every tensor its ZeRO optimizer refers to (attributes, lists,
dicts, buckets) and every parameter's ``grad``/``grad_accum``, deduplicated by storage, with the
attribute path that first reached it (meta-device tensors, which DeepSpeed keeps as shapes,
hold no memory and are left out). Parameters, the fp32 master partition and AdamW's states
are set apart; what is left is the gradient and communication buffers. A walk of every tensor
the garbage collector knows checks that nothing else is held.

Moments recorded per step: ``micro<m>`` after micro-step m < K-1 (what persists into the next
micro-step), ``at_step`` when DeepSpeed's inner optimizer starts stepping (step pre-hook: what
the step sees), ``after_step`` after the boundary step and zero_grad (what persists into the
next step).

At stage 0 the engine all-reduces the gradients at the boundary's backward through buckets it
flattens and frees at once (runtime/engine.py allreduce_gradients -> allreduce_bucket): held at
no recorded moment, so each call's flat bucket is recorded (``allreduce_buckets``: its elements
and bytes, per step).

On the CPU, DeepSpeed's streams are the current stream, so overlap_comm changes which buffers
are allocated (the Python code decides that) but not when a side stream would let them go.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroplan.atomic import write_text_atomic
from zeroplan.harness.ports import free_local_port

PRECISIONS = ("fp32", "bf16-mixed")
DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
ACCUMULATIONS = (1, 2, 4)
VARIANTS = ("default", "no-contiguous", "overlap", "quarter-bucket")
MICRO_BATCH, SEQ_LEN, STEPS, NPROC = 2, 64, 2, 2


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _walk(value, path: str, found: dict, seen: set, depth: int = 0) -> None:
    """Every tensor reachable from ``value`` through DeepSpeed's own objects, first path wins."""
    if depth > 6 or id(value) in seen:
        return
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" and value.untyped_storage().nbytes() > 0:
            found.setdefault(_storage_key(value), path)
        if value.grad is not None:
            _walk(value.grad, path + ".grad", found, seen, depth + 1)
        return
    seen.add(id(value))
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", found, seen, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, torch.Tensor):
                _walk(key, f"{path}[key]", found, seen, depth + 1)
            _walk(item, f"{path}[{key!r}]" if isinstance(key, (int, str)) else f"{path}[.]", found, seen, depth + 1)
    elif type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__") and not isinstance(
            value, torch.nn.Module):
        for name, item in vars(value).items():
            _walk(item, f"{path}.{name}", found, seen, depth + 1)


def _live_storages() -> set:
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return {_storage_key(t) for t in tensors if t.device.type != "meta" and t.untyped_storage().nbytes() > 0}


def _snapshot(engine, baseline: set) -> dict:
    """Bytes the engine holds right now, by class, and the buffers by attribute path."""
    from zeroplan.harness.engine import optimizer_state_tensors

    opt = engine.zero_optimizer
    params = {_storage_key(t) for t in engine._parameters() if t.untyped_storage().nbytes() > 0}
    masters = {_storage_key(t) for t in engine._masters()}
    states = {_storage_key(t) for t in optimizer_state_tensors(engine.optimizer)}
    found: dict = {}
    seen: set = {id(engine.module), id(engine.optimizer), id(getattr(opt, "module", None))}
    for name, p in engine.module.named_parameters():
        for attr in ("grad", "grad_accum"):
            t = getattr(p, attr, None)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                found.setdefault(_storage_key(t), f"param.{attr}")
    for m in engine._masters():
        if m.grad is not None:
            found.setdefault(_storage_key(m.grad), "master.grad")
    seen.add(id(opt))
    for name, item in vars(opt).items():
        _walk(item, name, found, seen, 1)
    buffers: dict[str, int] = {}
    for key, path in found.items():
        if key in params or key in masters or key in states:
            continue
        # Collapse list indices: the path names the attribute, the bytes add up.
        name = path.split("[")[0]
        buffers[name] = buffers.get(name, 0) + key[1]
    everything = dict.fromkeys(_live_storages(), True)
    for p in engine.module.parameters():
        for attr in ("grad", "grad_accum"):
            t = getattr(p, attr, None)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                everything[_storage_key(t)] = True
    known = params | masters | states | set(found) | baseline
    unnamed = sum(nbytes for (ptr, nbytes) in everything if (ptr, nbytes) not in known)
    return {
        "parameter_bytes": sum(n for _, n in params),
        "master_bytes": sum(n for _, n in masters),
        "optimizer_state_bytes": sum(n for _, n in states - masters),
        "buffer_bytes": sum(buffers.values()),
        "buffers": dict(sorted(buffers.items())),
        "unnamed_tensor_bytes": unnamed,
    }


def _zero_overrides(variant: str, total: int) -> dict:
    if variant == "no-contiguous":
        return {"contiguous_gradients": False}
    if variant == "overlap":
        return {"overlap_comm": True}
    if variant == "quarter-bucket":
        quarter = total // 4
        return {"reduce_bucket_size": quarter + quarter % 2}
    return {}


def _run_one(rank: int, model_name: str, stage: int, precision: str, accumulation: int, variant: str) -> dict:
    from zeroplan.harness.data import rank_batch
    from zeroplan.harness.deepspeed_engine import DeepSpeedZero
    from zeroplan.harness.engine import MicroBatch
    from zeroplan.harness.model import build_model
    from zeroplan.harness.presets import HARNESS_PRESETS

    spec = HARNESS_PRESETS[model_name]
    dtype = DTYPES[precision]
    gc.collect()
    baseline = _live_storages()  # what earlier runs in this process left (not this engine's)
    model = build_model(spec)
    total = sum(p.numel() for p in model.parameters())
    # The harness's engine with this run's ZeRO settings over its own (as --deepspeed-config does,
    # without the file's refusal of overlap_comm, which this measurement is about).
    import zeroplan.harness.deepspeed_engine as dse

    original = dse.deepspeed_config

    def config(*args, **kwargs):
        built = original(*args, **kwargs)
        if stage or variant != "default":  # stage 0 reads none of the overrides' keys
            built["zero_optimization"].update(_zero_overrides(variant, total))
        return built

    dse.deepspeed_config = config
    try:
        engine = DeepSpeedZero(model, stage, dtype, MICRO_BATCH, grad_accum_steps=accumulation)
    finally:
        dse.deepspeed_config = original
    at_step: list[dict] = []
    engine.optimizer.register_step_pre_hook(lambda *_: at_step.append(_snapshot(engine, baseline)))
    buckets: list[dict] = []
    reduce = engine.ds.allreduce_bucket

    def allreduce_bucket(bucket, *args, **kwargs):
        flat = reduce(bucket, *args, **kwargs)
        buckets.append({"elements": flat.numel(), "bytes": flat.numel() * flat.element_size()})
        return flat

    engine.ds.allreduce_bucket = allreduce_bucket
    steps = []
    for step in range(STEPS):
        moments = {}
        buckets.clear()
        for m in range(accumulation):
            tokens, targets = rank_batch(spec, step, NPROC, rank, MICRO_BATCH, SEQ_LEN, micro_batch=m,
                                         grad_accum_steps=accumulation)
            engine.forward_backward(tokens, targets, MicroBatch(m, accumulation))
            if m < accumulation - 1:
                gc.collect()
                moments[f"micro{m}"] = _snapshot(engine, baseline)
        engine.step()
        engine.zero_grad()
        gc.collect()
        moments["at_step"] = at_step.pop()
        moments["after_step"] = _snapshot(engine, baseline)
        if stage == 0:
            moments["allreduce_buckets"] = list(buckets)
        steps.append(moments)
    zero = engine.config["zero_optimization"]
    return {
        "model": model_name, "stage": stage, "precision": precision, "grad_accum": accumulation, "variant": variant,
        "world_size": NPROC, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "parameters": total,
        "zero_optimization": {k: zero[k] for k in ("reduce_bucket_size", "contiguous_gradients", "overlap_comm")}
        if stage else {"stage": 0},
        "optimizer_class": type(engine.zero_optimizer).__name__,
        "steps": steps,
    }


def _worker(rank: int, model_name: str, grid: list, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(NPROC))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=NPROC)
    results = []
    for stage, precision, accumulation, variant in grid:
        start = time.perf_counter()
        results.append(_run_one(rank, model_name, stage, precision, accumulation, variant))
        if rank == 0:
            print(f"zero{stage} {precision:10s} K={accumulation} {variant:15s} {time.perf_counter() - start:5.1f} s",
                  flush=True)
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/deepspeed-accumulation-records"))
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--accumulations", default=",".join(map(str, ACCUMULATIONS)))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--name", default="records.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = [int(s) for s in args.stages.split(",")]
    grid = [(s, p, int(k), v) for s in stages for p in args.precisions.split(",")
            for k in args.accumulations.split(",") for v in args.variants.split(",")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_local_port())
    tmp = args.out / "tmp"
    tmp.mkdir(exist_ok=True)
    mp.spawn(_worker, args=(args.model, grid, str(tmp)), nprocs=NPROC, join=True)
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(NPROC)]
    command = "python benchmarks/deepspeed_accumulation_records.py " + " ".join(sys.argv[1:])
    record = {"command": command.strip(), "deepspeed": __import__("deepspeed").__version__,
              "torch": torch.__version__, "backend": "gloo", "ranks": ranks}
    name = args.name
    write_text_atomic(args.out / name, json.dumps(record, indent=1) + "\n")
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
