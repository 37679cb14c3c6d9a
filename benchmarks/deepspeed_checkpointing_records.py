"""What DeepSpeed's own activation checkpointing (deepspeed.checkpointing.checkpoint, the reentrant
CheckpointFunction of runtime/activation_checkpointing/checkpointing.py) keeps between a forward
and its backward, per checkpointed block, under each of its settings, measured on gloo/CPU.

    python benchmarks/deepspeed_checkpointing_records.py [--dtype fp32|bf16] [--json]

Two ranks form one model-parallel group (a small mpu object, as deepspeed.checkpointing.configure
reads it: get_model_parallel_rank/world_size/group; each rank its own data-parallel group). Each
rank runs the same stack of 4 Megatron-like blocks (Linear h->4h, GELU, Linear 4h->h, residual
add; hidden 256, an input of 512 tokens x batch 2 laid out [s, b, h], identical on both ranks as a
tensor-parallel block's input is), every block called through deepspeed.checkpointing.checkpoint.
The blocks' weights are frozen, so a backward's peak holds activations and their gradients only
(the input requires grad, so every block runs its backward). The settings, each configured with
num_checkpoints 4:

    a  none                          d  checkpoint_in_cpu
    b  partition_activations          e  partition_activations + contiguous_checkpointing
    c  partition_activations               + checkpoint_in_cpu
       + checkpoint_in_cpu

Per rank and setting it reads, after the forward and before the backward, what each block's
autograd context (the CheckpointFunction ctx: deepspeed_saved_tensors, their saved_data, the RNG
states) holds, by distinct storage and device, and whether the block's input tensor still owns its
storage; it records the tensors gather_partitioned_activations hands each block's recomputation
(observed through a wrapper that only reads their sizes); and from the profiler's allocator events
(zeroplan.harness.allocator_trace) the live bytes above those held before the block input was made:
at the end of the forward (the last block's output still held) and at the backward's peak. The
input's gradient is compared with the same blocks run without checkpointing. On a CPU accelerator
"cpu" and the device are one memory, and get_accelerator().is_synchronized_device() is True, so
checkpoint_in_cpu takes the blocking path (no _ActivationOffloadEngine) and every .cpu()/.to('cpu')
of a CPU tensor returns that tensor itself.

What the source does with a block's input x (DeepSpeed 0.19.8, checkpointing.py): with neither
option the ctx keeps x itself (save_args_for_backward(*args)). With partition_activations it keeps
a clone of this rank's 1/mp slice (partition_activations), replaces x's storage by a 0-dim fp32
tensor (get_partitioned_activations_for_backward: arg.data = torch.empty([])), so the previous
block's output no longer holds the whole input, and in the backward gathers the whole input again
(gather_partitioned_activations) before recomputing the block; with checkpoint_in_cpu as well the
slice is moved by .cpu() (a copy on a GPU, none here), or, with contiguous_checkpointing, copied
into one of num_checkpoints per-slice buffers on the host. checkpoint_in_cpu alone copies x with
copy_to_device(args, cpu) and then empties x (get_cpu_activations_for_backward): where that copy is
x itself (a CPU accelerator) the kept "copy" is the emptied 0-dim tensor and the backward fails.
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
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers

WORLD = 2
LAYERS = 4
HIDDEN = 256
SEQ = 512
MICRO_BATCH = 2
RANGE_PREFIX = "ckpt::"
# label -> (what configure() is given, its name in the table)
SETTINGS = {
    "a": ({"partition_activations": False, "checkpoint_in_cpu": False, "contiguous_checkpointing": False}, "none"),
    "b": ({"partition_activations": True, "checkpoint_in_cpu": False, "contiguous_checkpointing": False}, "partition"),
    "c": ({"partition_activations": True, "checkpoint_in_cpu": True, "contiguous_checkpointing": False},
          "partition+cpu"),
    "d": ({"partition_activations": False, "checkpoint_in_cpu": True, "contiguous_checkpointing": False}, "cpu"),
    "e": ({"partition_activations": True, "checkpoint_in_cpu": True, "contiguous_checkpointing": True},
          "partition+contiguous+cpu"),
}


class ModelParallelUnit:
    """The mpu deepspeed.checkpointing.configure reads (get_model_parallel_rank/world_size/group;
    get_data_parallel_* for model_parallel_cuda_manual_seed): one model-parallel group of all ranks."""

    def __init__(self, mp_group, dp_group, rank: int, world: int) -> None:
        self._mp_group, self._dp_group, self._rank, self._world = mp_group, dp_group, rank, world

    def get_model_parallel_rank(self) -> int:
        return self._rank

    def get_model_parallel_world_size(self) -> int:
        return self._world

    def get_model_parallel_group(self):
        return self._mp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return self._dp_group


def _blocks(dtype):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN, dtype=dtype)
            self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN, dtype=dtype)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    torch.manual_seed(0)
    blocks = [Block() for _ in range(LAYERS)]
    for block in blocks:
        block.requires_grad_(False)
    return blocks


def _block_input(dtype):
    import torch

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator).to(dtype)
    return x.requires_grad_(True)


def _storage_bytes(tensor) -> tuple[int, int, str]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), str(tensor.device)


def _ctx_record(ctx, input_bytes: int) -> dict:
    """What one block's CheckpointFunction ctx holds once the forward has returned: the input
    tensor (its own storage: the whole input, or the 0-dim tensor left by arg.data =
    torch.empty([])) and the copy kept for the backward (saved_data: the partition, or a copy)."""
    import torch

    record = {"input_bytes": input_bytes, "size_vector_bytes": 0}
    for tensor in ctx.deepspeed_saved_tensors:
        if not torch.is_tensor(tensor):
            continue
        ptr, nbytes, device = _storage_bytes(tensor)
        if not tensor.is_floating_point():
            record["size_vector_bytes"] += nbytes  # the torch.tensor(arg.size()) kept beside an input
            continue
        record["input_storage_bytes"], record["input_device"] = nbytes, device
        saved = getattr(tensor, "saved_data", None)
        if saved is None:
            record["kept_bytes"], record["kept_device"], record["kept_is_input_storage"] = nbytes, device, True
        else:
            saved_ptr, saved_bytes, saved_device = _storage_bytes(saved)
            record["kept_bytes"], record["kept_device"] = saved_bytes, saved_device
            record["kept_is_input_storage"] = saved_ptr == ptr
    record["rng_state_bytes"] = sum(_storage_bytes(getattr(ctx, name))[1]
                                    for name in ("fwd_cpu_rng_state", "fwd_cuda_rng_state"))
    return record


def _held_by_contexts(contexts) -> int:
    """Bytes of the distinct storages all the blocks' contexts hold (inputs, their saved_data,
    size vectors, RNG states): a storage two blocks share (contiguous checkpointing's one size
    buffer) counted once."""
    import torch

    storages: dict[int, int] = {}
    for ctx in contexts:
        held = [ctx.fwd_cpu_rng_state, ctx.fwd_cuda_rng_state]
        for tensor in ctx.deepspeed_saved_tensors:
            if torch.is_tensor(tensor):
                held += [tensor] + ([tensor.saved_data] if getattr(tensor, "saved_data", None) is not None else [])
        for tensor in held:
            ptr, nbytes, _ = _storage_bytes(tensor)
            storages[ptr] = nbytes
    return sum(storages.values())


def _walk(event):
    yield event
    for child in event.children:
        yield from _walk(child)


def _live_bytes(trace, settings: list[str]) -> dict[str, dict]:
    """Per setting: live bytes (above those live just before its forward began, the block input
    made inside it) at the end of the forward, at the backward's peak and at its end; and for
    each block's backward (last block first) the live bytes as it starts and its peak."""
    from zeroplan.harness.allocator_trace import _replay

    events = trace.events()
    totals = [total for _, total in _replay(events)]
    ranges = {e.name[len(RANGE_PREFIX):]: (e.start_time_ns, e.end_time_ns)
              for e in trace._profile.profiler.kineto_results.experimental_event_tree()
              for e in _walk(e) if e.name.startswith(RANGE_PREFIX)}

    def live_at(time_ns: int) -> int:
        before = [total for event, total in zip(events, totals) if event.time_ns <= time_ns]
        return before[-1] if before else 0

    def peak_in(start_ns: int, end_ns: int) -> int:
        return max((total for event, total in zip(events, totals) if start_ns <= event.time_ns <= end_ns),
                   default=live_at(start_ns))

    live = {}
    for label in settings:
        forward, backward = ranges.get(f"{label}::forward"), ranges.get(f"{label}::backward")
        if forward is None or backward is None:
            continue
        base = live_at(forward[0] - 1)
        blocks = sorted((start, end) for name, (start, end) in ranges.items() if name.startswith(f"{label}::block"))
        live[label] = {"end_of_forward": live_at(forward[1]) - base,
                       "backward_peak": peak_in(*backward) - base,
                       "end_of_backward": live_at(backward[1]) - base,
                       "block_backward": [(live_at(start - 1) - base, peak_in(start, end) - base)
                                          for start, end in blocks]}
    return live


def _rank(rank: int, options: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import logging

    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    from zeroplan.harness.allocator_trace import AllocatorTrace

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    mp_group = dist.new_group(list(range(WORLD)))
    dp_groups = [dist.new_group([r]) for r in range(WORLD)]
    mpu = ModelParallelUnit(mp_group, dp_groups[rank], rank, WORLD)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[options.dtype]
    blocks = _blocks(dtype)

    # The input's gradient without checkpointing, to compare each setting's with.
    x = _block_input(dtype)
    y = x
    for block in blocks:
        y = block(y)
    y.sum().backward()
    reference_grad = x.grad.clone()
    del x, y

    # Observe (sizes only) what each block's recomputation is handed under partitioning.
    gathered: list[dict] = []
    original_gather = checkpointing.gather_partitioned_activations

    def observed_gather(tensors, device=None):
        inputs = original_gather(tensors, device=device)
        for tensor in inputs:
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                _, nbytes, where = _storage_bytes(tensor)
                gathered.append({"bytes": nbytes, "device": where})
        return inputs

    checkpointing.gather_partitioned_activations = observed_gather
    # Each block's backward (CheckpointFunction.backward: recomputation and its backward) in a
    # profiler range of its own; autograd looks the method up on the class at every call.
    original_backward = checkpointing.CheckpointFunction.backward
    current = {"label": ""}

    def ranged_backward(ctx, *grads):
        with record_function(f"{RANGE_PREFIX}{current['label']}::block{ctx.block_index}"):
            return original_backward(ctx, *grads)

    checkpointing.CheckpointFunction.backward = staticmethod(ranged_backward)
    records: dict[str, dict] = {}
    with AllocatorTrace() as trace:
        for label, (flags, _) in SETTINGS.items():
            deepspeed.checkpointing.configure(mpu, num_checkpoints=LAYERS, **flags)
            gathered.clear()
            current["label"] = label
            record: dict = {"error": None}
            x = y = None
            input_bytes = SEQ * MICRO_BATCH * HIDDEN * torch.finfo(dtype).bits // 8
            try:
                with record_function(f"{RANGE_PREFIX}{label}::forward"):
                    x = _block_input(dtype)
                    y, contexts = x, []
                    for index, block in enumerate(blocks):
                        y = deepspeed.checkpointing.checkpoint(block, y)
                        contexts.append(y.grad_fn)
                        y.grad_fn.block_index = index
                record["blocks"] = [_ctx_record(ctx, input_bytes) for ctx in contexts]
                record["held_by_contexts_bytes"] = _held_by_contexts(contexts)
                record["output_bytes"] = _storage_bytes(y)[1]
                del contexts
                with record_function(f"{RANGE_PREFIX}{label}::backward"):
                    y.sum().backward()
                record["grad_max_abs_diff"] = float((x.grad.float() - reference_grad.float()).abs().max())
            except Exception as error:  # a setting DeepSpeed cannot run here: record why, go on
                record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            record["gathered"] = list(gathered)
            records[label] = record
            deepspeed.checkpointing.reset()
            del x, y
    checkpointing.gather_partitioned_activations = original_gather
    checkpointing.CheckpointFunction.backward = original_backward
    live = _live_bytes(trace, list(SETTINGS))
    for label, record in records.items():
        record["live"] = live.get(label)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "synchronized_device": get_accelerator().is_synchronized_device(),
        "offload_engine_built": checkpointing._cpu_offload_engine is not None, "settings": records}))
    dist.barrier()
    dist.destroy_process_group()
    # DeepSpeed's CPU communication op can abort in the interpreter's teardown; the record is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _per_block(values: list[str]) -> str:
    """One figure if every block has it, else each block's."""
    return values[0] if len(set(values)) == 1 else "/".join(values)


def _figures(blocks: list[dict], key: str) -> str:
    return _per_block([f"{block[key]:,d}" for block in blocks])


def _table(results: list[dict]) -> list[str]:
    first = results[0]
    input_bytes = first["settings"]["a"]["blocks"][0]["input_bytes"]
    lines = [f"DeepSpeed {first['deepspeed']} activation checkpointing, torch {first['torch']}, {WORLD} gloo ranks in "
             f"one model-parallel group; {LAYERS} blocks, hidden {HIDDEN}, [s {SEQ}, b {MICRO_BATCH}, h], "
             f"block input {input_bytes:,} bytes",
             f"CPU accelerator: is_synchronized_device {first['synchronized_device']}, "
             f"async offload engine built: {first['offload_engine_built']}",
             "",
             "Kept per block between forward and backward, bytes (each block's CheckpointFunction ctx; one figure: all "
             f"{LAYERS} blocks alike):",
             "  kept: the activation kept for the backward (saved_data, else the input itself); input storage: what",
             "  the input tensor itself still owns (4: emptied by arg.data = torch.empty([])); same: kept IS that storage",
             f"{'setting':26s} {'rank':>4s} {'kept':>10s} {'kept/input':>10s} {'device':>6s} {'same':>5s} "
             f"{'input storage':>13s} {'size vec':>8s} {'rng state':>9s}"]
    for row, record in _setting_rows(results):
        blocks = record.get("blocks", [])
        if not blocks:
            continue
        ratios = _per_block([f"{b['kept_bytes'] / input_bytes:.3f}" for b in blocks])
        lines.append(f"{row} {_figures(blocks, 'kept_bytes'):>10s} "
                     f"{ratios:>10s} "
                     f"{','.join(sorted({b['kept_device'] for b in blocks})):>6s} "
                     f"{'yes' if all(b['kept_is_input_storage'] for b in blocks) else 'no':>5s} "
                     f"{_figures(blocks, 'input_storage_bytes'):>13s} {_figures(blocks, 'size_vector_bytes'):>8s} "
                     f"{_figures(blocks, 'rng_state_bytes'):>9s}")
    lines += ["",
              "Live bytes above those live before the forward (allocator events; the forward makes the first block's",
              "input and the last block's output is held through the backward); gathered: what each block's",
              "recomputation is handed by gather_partitioned_activations; grad: max |d input| against no checkpointing;",
              "ctxs+out: the distinct storages the blocks' contexts hold plus the last block's output",
              f"{'setting':26s} {'rank':>4s} {'ctxs+out':>11s} {'end of fwd':>11s} {'bwd peak':>11s} {'peak-fwd':>10s} "
              f"{'end of bwd':>11s} {'gathered per block':>22s}  grad / error"]
    for row, record in _setting_rows(results):
        live = record["live"] or {}
        gathered = sorted({(g["bytes"], g["device"]) for g in record["gathered"]})
        gathered_text = (f"{len(record['gathered'])} x " + ",".join(f"{b:,d} {d}" for b, d in gathered)
                         if gathered else "-")
        outcome = record["error"] or f"{record['grad_max_abs_diff']:.3g}"
        held = record.get("held_by_contexts_bytes")
        held_text = f"{held + record['output_bytes']:11,d}" if held is not None else f"{'-':>11s}"
        if live:
            figures = (f"{held_text} {live['end_of_forward']:11,d} {live['backward_peak']:11,d} "
                       f"{live['backward_peak'] - live['end_of_forward']:10,d} {live['end_of_backward']:11,d}")
        else:
            figures = f"{held_text} {'-':>11s} {'-':>11s} {'-':>10s} {'-':>11s}"
        lines.append(f"{row} {figures} {gathered_text:>22s}  {outcome}")
    lines += ["",
              "Each block's backward (recomputation and its backward; last block first): live bytes as it starts ->",
              "its peak, above those live before the forward",
              f"{'setting':26s} {'rank':>4s}  per block"]
    for row, record in _setting_rows(results):
        steps = (record["live"] or {}).get("block_backward", [])
        lines.append(f"{row}  " + ("   ".join(f"{start:,d} -> {peak:,d}" for start, peak in steps) or "-"))
    return lines


def _setting_rows(results: list[dict]):
    """(the row's setting and rank columns, that rank's record of the setting), setting by
    setting, each rank in turn: the order every table prints."""
    for label, (_, name) in SETTINGS.items():
        for rank, result in enumerate(results):
            yield f"{label + ' ' + name:26s} {rank:4d}", result["settings"][label]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json", action="store_true", help="print the ranks' records as JSON after the table")
    parser.add_argument("--port", type=int, default=None,
                        help="the ranks' rendezvous port on 127.0.0.1 (default: a free one)")
    options = parser.parse_args()
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp()
    if options.port is None:
        options.port = free_local_port()
    mp.spawn(_rank, args=(options, out_dir), nprocs=WORLD)
    remove_deepspeed_shm_buffers(options.port)
    results = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    print("\n".join(_table(results)))
    if options.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
    # Every figure is printed; DeepSpeed's CPU communication op can abort in the interpreter's
    # teardown ("terminate called without an active exception"), which would lose the exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
