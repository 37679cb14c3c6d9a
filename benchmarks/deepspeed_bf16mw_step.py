"""DeepSpeed ZeRO-3's own engine as DeepSpeedExamples' training/bf16_master_weight baseline runs
it (the published rows dsx-bf16mw-6.86b-4gpu-baseline and -ckpt-baseline), on a model 1,024 times
smaller on gloo (4 CPU ranks): where the run's peak of live bytes falls (building the engine, a
step's forward, backward or optimizer step) and what is live there, scaled back by 1,024.

    python benchmarks/deepspeed_bf16mw_step.py [--checkpoint] [--breakdown] [--torch-linear] [--bf16full] [--record PATH]

--bf16full runs the example's configs/bf16_full.json instead of baseline.json: bf16
bf16_master_weights_and_grads and bf16_optimizer_states (DeepSpeed PR 7700) and torch_autocast in
bf16, the forward and the loss inside torch.autocast as train.py runs them (here on the CPU: the
CPU's autocast op lists, not CUDA's, which run softmax, layer_norm and the loss in fp32). It also
prints the dtypes the engine keeps: the module's parameters, ZeRO-3's master partitions (and
whether they are the 16-bit partitions themselves), its gradient partitions, the optimizer's
states and the reduce bucket (docs/memory-model.md, "DeepSpeed's bf16 master weights under
torch_autocast").

The loop binds the model's output to ``logits`` before the loss, as train.py does, so the loop
holds the logits through the backward and the step. --record also writes what is alive at the
peak, counted by (bytes, op, phase), and the bytes of the parameters ZeRO-3 holds gathered once
the loss is formed, per step (zeroplan.core.deepspeed_coordinator.loss_gathered_bytes,
zeroplan.core.uncast_loss).

--torch-linear puts torch's own F.linear back after deepspeed.initialize, as the row's DeepSpeed
(master of December 2025, before 0.19.4's PR 8189) left it for a model built outside zero.Init
(zeroplan.core.deepspeed_torch_linear).

The example's model (train.py's SimpleTransformerModel, written here from its description):
token and learned position embeddings, post-norm blocks of nn.MultiheadAttention called with
need_weights left True and a Linear-GELU-Linear FFN of 4h, an untied output Linear with bias and
nn.CrossEntropyLoss on the logits; random token ids and labels. The 6.86B rows' shape (hidden
4,096, 32 layers, 32 heads, vocabulary 50,000, batch 1 x 512) is scaled so that every weight and
every activation is 1,024 times smaller: hidden 128, 32 heads of 4, vocabulary 1,563, batch 1 x 16
(tokens x a width, heads x tokens^2 and tokens x vocabulary each shrink 1,024 times). The
example's configs/baseline.json holds (AdamW, bf16, stage 3, overlap_comm, contiguous_gradients,
stage3_param_persistence_threshold 0), with reduce_bucket_size 5e7 and DeepSpeed's defaults for
the stage-3 prefetch bucket (5e7), stage3_max_live_parameters, stage3_max_reuse_distance and
sub_group_size (1e9) over 1,024. As in train.py, the model is built in fp32 on the host and handed
to deepspeed.initialize, the peak statistics reset before the model is built, and each step runs
engine(input) -> loss -> loss.backward() -> engine.step().

Live bytes come from the profiler's allocator events (zeroplan.harness.allocator_trace); the CPU's
kernels are not CUDA's (the CPU's softmax, GELU and matmul keep no workspace the GPU would not).
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

# The published shapes, each scaled so that weights and activations shrink by the same factor:
# (scale, hidden, layers, heads, vocabulary, micro-batch, tokens). 254m: hidden 1,024, 12 layers,
# 16 heads, vocabulary 50,000, batch 4 x 512, over 16 (hidden 256, vocabulary 12,500, 128 tokens).
SHAPES = {"6.86b": (1024, 128, 32, 32, 1563, 1, 16), "254m": (16, 256, 12, 16, 12500, 4, 128)}
SCALE, HIDDEN, LAYERS, HEADS, VOCAB, MICRO_BATCH, SEQ = SHAPES["6.86b"]
STEPS = 3
WORLD = 4


def stage3() -> dict:
    """configs/baseline.json's zero_optimization, DeepSpeed's defaults for the rest, each size over SCALE."""
    return {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 5 * 10**7 // SCALE, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 5 * 10**7 // SCALE, "stage3_max_live_parameters": 10**9 // SCALE,
            "stage3_max_reuse_distance": 10**9 // SCALE, "sub_group_size": 10**9 // SCALE}


def use_shape(name: str, world: int) -> None:
    global SCALE, HIDDEN, LAYERS, HEADS, VOCAB, MICRO_BATCH, SEQ, WORLD
    SCALE, HIDDEN, LAYERS, HEADS, VOCAB, MICRO_BATCH, SEQ = SHAPES[name]
    WORLD = world
PHASES = ("zeroplan::forward", "zeroplan::backward", "zeroplan::optimizer_step")


def simple_transformer(hidden: int, heads: int, layers: int, vocab: int, seq: int, checkpoint: bool):
    """train.py's SimpleTransformerModel at the given shape; each block's ``probe`` attribute, None
    here, may be set to a function that its backward then calls with a moment's name
    (benchmarks/deepspeed_mha_pinned_records.py: once the attention's output gradient is made,
    "attention_backward", and once the block's input gradient is, "block_backward_end")."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
            self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            self.probe = None

        def forward(self, x):
            if x.requires_grad and self.probe is not None:
                x.register_hook(lambda grad: self.probe("block_backward_end"))
            attended = self.attention(x, x, x)[0]
            if attended.requires_grad and self.probe is not None:
                attended.register_hook(lambda grad: self.probe("attention_backward"))
            x = self.norm1(x + attended)
            return self.norm2(x + self.ff(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.pos_embedding = nn.Embedding(seq, hidden)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.output_proj = nn.Linear(hidden, vocab)

        def forward(self, ids):
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
            x = self.embedding(ids) + self.pos_embedding(positions)
            for layer in self.layers:
                x = run_checkpointed(layer, x, use_reentrant=False) if checkpoint else layer(x)
            return self.output_proj(x)

    return Model()


def _model(checkpoint: bool):
    return simple_transformer(HIDDEN, HEADS, LAYERS, VOCAB, SEQ, checkpoint)


# DeepSpeed 0.19.8 runtime/zero/partition_parameters.py lines 412-419 and 1090-1091: Init(module=...)
# swaps F.linear for zero3_linear_wrap, keeping torch's in linear_bk. Releases before 0.19.4 (PR 8189,
# 2026-07-31) made that swap only inside a zero.Init context, never for a model built outside one.
def restore_torch_linear() -> None:
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    torch.nn.functional.linear = InsertPostInitMethodToModuleSubClasses.linear_bk


def _rank(rank: int, options: argparse.Namespace, out: str) -> None:
    use_shape(options.shape, options.gpus)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    from zeroplan.harness.allocator_trace import AllocatorTrace, _replay

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    with AllocatorTrace() as trace:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = _model(options.checkpoint)
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                  "steps_per_print": 2**31 - 1, "bf16": {"enabled": True}, "zero_optimization": stage3(),
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                            "weight_decay": 0.01}},
                  "torch_autocast": {"enabled": False}}
        if options.bf16full:
            # configs/bf16_full.json: baseline.json plus these three switches.
            config["bf16"] |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
            config["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16"}
        with record_function("zeroplan::initialize"):
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                   dist_init_required=False)
        if options.torch_linear:
            restore_torch_linear()
        loss_fn = torch.nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(rank)
        gathered_at_loss: list[int] = []
        for step in range(STEPS):
            ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
            labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
            with trace.step(step):
                # train.py binds the model's output to ``logits`` before the loss, so the loop
                # holds the logits through loss.backward() and the step, to the next forward.
                with record_function(PHASES[0]), torch.autocast("cpu", torch.bfloat16, enabled=options.bf16full):
                    logits = engine(ids)
                    loss = loss_fn(logits.view(-1, VOCAB), labels.view(-1))
                gathered_at_loss.append(gathered_bytes(engine))
                with record_function(PHASES[1]):
                    loss.backward()
                with record_function(PHASES[2]):
                    engine.step()
    dtypes = engine_dtypes(engine) if rank == 0 else {}
    if rank == 0:
        events = trace.events()
        ranges = [(e.name, e.start_time_ns, e.end_time_ns)
                  for e in trace._profile.profiler.kineto_results.experimental_event_tree()
                  for e in _walk(e) if e.name.startswith("zeroplan::")]

        def phase_of(time_ns: int) -> str:
            inside = [(name, start) for name, start, end in ranges if start <= time_ns <= end]
            return ",".join(name.split("::")[1] for name, _ in sorted(inside, key=lambda r: r[1])) or "between"

        best, live, at = -1, [], 0
        peaks: dict[str, int] = {}
        for event, (alive, total) in zip(events, _replay(events)):
            phase = phase_of(event.time_ns)
            peaks[phase] = max(peaks.get(phase, 0), total)
            if total > best:
                best, live, at = total, [(a.size_bytes, a.operator, phase_of(a.time_ns)) for a in alive.values()], event.time_ns
        Path(out).write_text(json.dumps({"deepspeed": deepspeed.__version__, "dtypes": dtypes, "peaks": peaks, "peak": best,
                                         "peak_phase": phase_of(at), "live_at_peak": live,
                                         "gathered_at_loss": gathered_at_loss}))
    dist.destroy_process_group()


def gathered_bytes(engine) -> int:
    """The storage of every parameter ZeRO-3 holds gathered now (ds_status AVAILABLE), each
    all-gather buffer once (a coalesced gather's parameters share one): what the loss and its
    backward run beside, taken once the forward and the loss are formed."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    storages = {p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE}
    return sum(storages.values())


def engine_dtypes(engine) -> dict[str, str]:
    """The dtypes DeepSpeed's ZeRO-3 optimizer keeps (runtime/zero/stage3.py), after the last step."""
    optimizer = engine.optimizer
    masters = optimizer.fp32_partitioned_groups_flat
    states = {str(value.dtype) for state in optimizer.optimizer.state.values() for value in state.values()
              if hasattr(value, "dtype") and value.numel() > 1}
    return {"module_parameters": sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()}),
            "master_partitions": sorted({str(m.dtype) for m in masters}),
            "master_is_16bit_partition": all(m is f for m, f in zip(masters, optimizer.fp16_partitioned_groups_flat)),
            "gradient_partitions": str(optimizer.grad_partitions_flat_buffer.dtype),
            "optimizer_states": sorted(states),
            "reduce_bucket": sorted(str(dtype) for dtype in getattr(optimizer, "ipg_buckets", {}))}


def _count_live(live: list) -> dict[tuple[int, str, str], int]:
    """The tensors alive at the peak, counted by (bytes, the op that made it, its phase)."""
    counts: dict[tuple[int, str, str], int] = {}
    for size, op, phase in live:
        counts[(size, op, phase)] = counts.get((size, op, phase), 0) + 1
    return counts


def _walk(event):
    yield event
    for child in event.children:
        yield from _walk(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="store_true", help="checkpoint each block (use_reentrant=False), as "
                                                                   "train.py's --activation_checkpointing")
    parser.add_argument("--breakdown", action="store_true", help="the bytes live at the run's peak by the op that made them")
    parser.add_argument("--torch-linear", action="store_true",
                        help="leave torch's own F.linear in place, as every release before 0.19.4 did for a model "
                             "handed to deepspeed.initialize (DeepSpeed PR 8189)")
    parser.add_argument("--bf16full", action="store_true",
                        help="the example's configs/bf16_full.json: bf16 master weights, gradients and Adam states "
                             "under torch_autocast (DeepSpeed PR 7700)")
    parser.add_argument("--record", type=Path, default=None,
                        help="also write rank 0's result (dtypes, peaks by phase, the run's peak, unscaled bytes) "
                             "as JSON here (benchmarks/deepspeed-bf16mw-records)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="6.86b")
    parser.add_argument("--gpus", type=int, default=4, help="ranks (the row's GPUs)")
    parser.add_argument("--port", type=int, default=None,
                        help="the ranks' rendezvous port on 127.0.0.1 (default: a free one)")
    options = parser.parse_args()
    use_shape(options.shape, options.gpus)
    import torch.multiprocessing as mp

    out = str(Path(tempfile.mkdtemp()) / "result.json")
    if options.port is None:
        options.port = free_local_port()
    mp.spawn(_rank, args=(options, out), nprocs=WORLD)
    remove_deepspeed_shm_buffers(options.port)
    result = json.loads(Path(out).read_text())
    if options.record is not None:
        kept = {key: result[key] for key in ("deepspeed", "dtypes", "peaks", "peak", "peak_phase", "gathered_at_loss")}
        # What is alive at the peak, unscaled: [bytes, the op that made it, its phase, how many].
        kept["live_at_peak"] = [[size, op, phase, count] for (size, op, phase), count in sorted(
            _count_live(result["live_at_peak"]).items(), key=lambda kv: (-kv[0][0] * kv[1], kv[0]))]
        kept["shape"] = dict(zip(("scale", "hidden", "layers", "heads", "vocab", "micro_batch", "seq"), SHAPES[options.shape]))
        kept |= {"ranks": WORLD, "checkpoint": options.checkpoint, "torch_linear": options.torch_linear,
                 "bf16full": options.bf16full}
        options.record.parent.mkdir(parents=True, exist_ok=True)
        options.record.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    gib = 2**30
    print(f"DeepSpeed {result['deepspeed']}, {WORLD} gloo ranks, activation checkpointing "
          f"{'on' if options.checkpoint else 'off'}; live bytes x {SCALE} in GiB (the row's scale)")
    for phase, peak in sorted(result["peaks"].items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {phase:48s} {peak * SCALE / gib:7.2f}")
    print(f"  run's peak {result['peak'] * SCALE / gib:.2f} GiB, in {result['peak_phase']}")
    print("  gathered at the loss, each step: " + ", ".join(f"{b * SCALE / gib:.3f}" for b in result["gathered_at_loss"]) + " GiB")
    if options.bf16full:
        print("  engine dtypes: " + ", ".join(f"{k} {v}" for k, v in result["dtypes"].items()))
    if options.breakdown:
        by_op: dict[tuple[str, str, int], int] = {}
        for size, op, phase in result["live_at_peak"]:
            by_op[(op, phase, size)] = by_op.get((op, phase, size), 0) + 1
        for (op, phase, size), count in sorted(by_op.items(), key=lambda kv: -kv[0][2] * kv[1])[:30]:
            print(f"    {op:28s} made in {phase:32s} {count:4d} x {size * SCALE / 2**20:9.2f} MiB = "
                  f"{count * size * SCALE / gib:7.3f} GiB")


if __name__ == "__main__":
    main()
