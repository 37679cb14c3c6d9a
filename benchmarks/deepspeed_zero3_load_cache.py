"""What DeepSpeed 0.14.2's ZeRO-3 engine allocates and frees BEFORE the first training step, and
whether the segments it leaves cached move the reserved peak of the steps after it: the gpjt
Qwen1.5-0.5B one-GPU rows (benchmarks/published_memory/rows.csv gpjt-qwen1.5-0.5b-zero3-*).

The engine runs on gloo (1 CPU rank, as the rows' one GPU) on Qwen1.5-0.5B made 16 times narrower:
hidden 64, FFN 176, 16 heads, 16 KV heads, vocabulary 9,496 (151,936 / 16), tied embeddings, its
24 blocks, and micro-batch B x 128 tokens (B x 2,048 / 16), so every weight and every tokens x
width tensor is 256 times smaller (sizes of 32 KiB and more are scaled back by 256, smaller ones by
16: benchmarks/deepspeed_zero3_fp16_streams.py). DeepSpeed's stage-3 settings are its defaults
over 256 (the rows' ds_config.json names only the stage). The model is built in fp32 outside
zero.Init, as the rows' script does (from_pretrained before TrainingArguments: the full-per-rank
load), optionally checkpointed (gradient_checkpointing_enable, use_reentrant True), and is handed
to deepspeed.initialize, which (engine.py:1096-1112 at v0.14.2) casts it with module.half() and
moves it with module.to(device): on the GPU the fp32 model stays on the host and the fp16 copies
are the GPU's first allocations; on the CPU module.half() makes the same fp16 copies in the same
order (nn.Module._apply), so the trace of the GPU starts at deepspeed.initialize, and what was
allocated before it (the fp32 model, the host's) is left out, its frees too.

Replayed through zeroplan's caching-allocator model, per stream as fp16_streams marks them:
  (a) steps 1..N after one allocation standing for what is live at step 1 (an empty cache, every
      state allocated first: the planner's start before allocator/deepspeed_first_step.py);
  (a0) steps 0..N after one allocation standing for what is live at step 0: the first step makes
      Adam's states (ops/adam/fused_adam.py:149-157; stage3.py initialize_optimizer_states makes
      none);
  (b) from deepspeed.initialize on (module.to, each parameter's partition, the flat 16-bit
      buffer, the fp32 masters' clones, the optimizer's gradient buffer, the ipg bucket and
      gradient partitions, each parameter gathered for its hook), then steps 0..N;
  (c) from defragment's empty_cache (stage3.py:550-551), each tensor live there allocated first
      and freed where the run frees it, then the optimizer's build and steps 0..N: where
      zeroplan.allocator.deepspeed_first_step starts its replay.
What initialize makes, scaled: 0.87 GiB of parameters whole, their partitions (one rank: as
large), the 0.87 GiB flat buffer, a 0.87 GiB clone and the 1.73 GiB fp32 master, a 1.73 GiB
gradient buffer freed at once, the 0.93 GiB ipg bucket and 0.87 GiB of gradient partitions;
its requested peak 4.98 GiB, reserved 5.83.

Measured (--without-cpu-only, 3 steps, reserved peak without a limit / on 23.5 GiB; GiB), with
--checkpointing at micro-batch 1 / 2 / 3 / 4 (published, the gpjt rows: 15.72 / 19.81 / 21.40 / ran
out; under expandable segments 13.60 / 17.07 / 20.32 / ran out):
  default     (a)  14.58 / 19.50 / 24.84 (20.49 on 23.5, one flush) / completes on 23.5
              (a0) 14.58 / 20.64 / 21.37 / runs out on 23.5
              (b)  15.37 / 21.72 / 22.30 / runs out on 23.5
  expandable  (a)  12.83 / 17.10 / 21.26 / completes (23.09)
              (a0) 12.53 / 15.98 / 21.74 / completes (23.11)
              (b)  13.15 / 16.60 / 22.36 / completes (23.13)
(c), reserved without a limit, default / expandable: micro-batch 1 14.77 / 12.53, 2 21.10 / 15.98,
3 21.69 / 21.74; without checkpointing 1 x 1,024 (--seq 64) 13.68 / 11.44 and 2 x 2,048 24.84 (22.52
on 23.5, one flush) / 21.22. The build's events after that empty_cache, in order: the flat buffer
(held), the 16-bit clone, the fp32 master, the clone freed, the gradient buffer made and freed, the
ipg bucket, the gradient partitions. --model llama-3-8b --world 8 --seq 65 (1 x 1,040, no
checkpointing; about 9 minutes on 2 loaded cores): (c) 46.23 / 40.26 on 78.93 GiB, (a0) 48.62 / 40.30.
Without checkpointing, micro-batch 2 on 23.5 GiB (published 21.15): (a) 22.96, (a0) 22.66, (b) 22.60;
micro-batch 3 runs out in all three (published: ran out).
So the first step's Adam states decide micro-batch 4's default verdict (as the run: out of memory),
and initialize's segments add 0.6 (expandable) to 1.1 GiB (default) to the steps' reserved peak
with checkpointing, none without.
--model llama-3-8b --world 8 --micro-batch 12 --checkpointing --capacity-gib 78.93 (the 8-GPU rows'
bs12, published 76.24; about 35 minutes on 2 loaded cores): initialize requests 15.08 GiB (the
whole fp16 module moved on, then partitioned) and reserves 26.45 under the default allocator
(15.12 under expandable segments); on 78.93 GiB (a) 70.67 after one flush, (a0) 77.79 without
one, (b) 72.95 after one flush (90.67 without a limit: the module's freed segments stay cached
until the flush); under expandable segments 69.19 / 69.37 / 69.30. Usage:

    python benchmarks/deepspeed_zero3_load_cache.py --deepspeed-src DIR --micro-batch 3 --checkpointing \
        --without-cpu-only --capacity-gib 23.5 [--save-events F | --events F]

(DIR: DeepSpeed 0.14.2's source tree, as for deepspeed_zero3_fp16_streams.py.)
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

HIDDEN, FFN, HEADS, KV, VOCAB, LAYERS = 64, 176, 16, 16, 9496, 24
SEQ, STEPS, SCALE = 128, 3, 256
STAGE3 = {"reduce_bucket_size": 5 * 10**8 // SCALE, "stage3_prefetch_bucket_size": 5 * 10**7 // SCALE,
          "stage3_max_live_parameters": 10**9 // SCALE, "stage3_max_reuse_distance": 10**9 // SCALE,
          "stage3_param_persistence_threshold": 10**5 // SCALE, "sub_group_size": 10**9 // SCALE}


def _rank(rank, world, options, out):
    from deepspeed_zero3_fp16_streams import transformers_440_loss
    from deepspeed_zero3_lora_step import _import_old_deepspeed, mark_calls, mark_empty_cache, start_rank
    start_rank(rank, world, options)
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function
    import contextlib

    from zeroplan.harness.allocator_trace import AllocatorTrace
    with (AllocatorTrace() if rank == 0 else contextlib.nullcontext()) as trace:
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        deepspeed = _import_old_deepspeed(options.deepspeed_src)
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S

        # The engine's device is torch.device('cpu', rank) (engine.py:980): on the CPU, unlike a
        # CUDA tensor moved to its own device, .to() of a CPU tensor to 'cpu:0' copies it, so
        # module.to(self.device) (engine.py:1112) would copy the module a second time after
        # module.half(). On the GPU module.half() runs on the host and module.to() makes the
        # GPU's first allocations, one per parameter in nn.Module._apply's order: on the CPU
        # module.half()'s copies are those, so the device is left without an index here.
        from deepspeed.runtime.engine import DeepSpeedEngine
        set_vars = DeepSpeedEngine._set_distributed_vars

        def _set_distributed_vars(self, args):
            set_vars(self, args)
            self.device = torch.device("cpu")
        DeepSpeedEngine._set_distributed_vars = _set_distributed_vars
        # defragment's empty_cache (stage3.py:550-551 at v0.14.2), after which the optimizer's
        # build starts: marked, for the (c) replay.
        mark_empty_cache(get_accelerator())
        mark_calls(C, "fetch_sub_module", "zs:allgather")
        mark_calls(S, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "zs:reduce")
        mark_calls(S, "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", "zs:reduce")
        mark_calls(S, "has_overflow", "zs:reduce")
        mb = options.micro_batch
        config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "train_batch_size": mb * world,
                  "fp16": {"enabled": True, "initial_scale_power": options.scale_power}, "steps_per_print": 2**31 - 1,
                  "zero_optimization": {"stage": 3, **STAGE3}}
        torch.manual_seed(0)
        if options.model == "llama-3-8b":
            # deepspeed_zero3_fp16_streams.py's Llama-3-8B, 16 times narrower, its 32 blocks.
            mc = LlamaConfig(vocab_size=8016, hidden_size=256, intermediate_size=896, num_hidden_layers=32,
                             num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
                             tie_word_embeddings=False)
            model = LlamaForCausalLM(mc)
        else:
            mc = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=KV, attn_implementation="sdpa",
                             use_cache=False, tie_word_embeddings=True)
            model = Qwen2ForCausalLM(mc)  # fp32, no zero.Init: the rows' full-per-rank load
        vocab = mc.vocab_size
        if options.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        with record_function("zs:init"):
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        tokens = torch.randint(0, vocab, (mb, options.seq), generator=torch.Generator().manual_seed(rank))

        for step in range(STEPS):
            with record_function(f"zs:step{step}"):
                loss = transformers_440_loss(engine, tokens, vocab)
                engine.backward(loss)
                del loss
                engine.step()
            if rank == 0:
                print(f"step {step} done overflow={engine.optimizer.overflow}", flush=True)
    if rank != 0:
        dist.destroy_process_group()
        return
    from deepspeed_zero3_allocator_replay import marked_ranges_and_events
    json.dump(marked_ranges_and_events(trace), open(out, "w"))
    dist.destroy_process_group()


def _skipped(result: dict) -> set:
    """fp16_streams.engine_steps' left-out allocations: gloo's and the CPU kernels' temporaries
    and the installed transformers' SDPA masks on the compute stream."""
    from deepspeed_zero3_allocator_replay import MASK_OPS, _collective_temporaries, cpu_temporaries
    from deepspeed_zero3_fp16_streams import _stream_of

    events, ranges = result["events"], result["ranges"]
    side = sorted((s, e, 1 if n == "zs:allgather" else 2) for s, e, n in ranges if n in ("zs:allgather", "zs:reduce"))
    starts = [x[0] for x in side]
    skipped = _collective_temporaries(events) | cpu_temporaries(events)[0]
    skipped |= {index for index, (time_ns, size, _, op) in enumerate(events)
                if size > 0 and op in MASK_OPS and _stream_of(side, starts, time_ns) == 0}
    return skipped


def engine_from(result: dict, start_ns: int, end_ns: int, held_start: bool, held_each: bool = False):
    """The run's allocations from start_ns to end_ns as an AllocationTrace (scaled, with their
    streams). held_start: what is live at start_ns is one allocation first (fp16_streams'
    engine_steps); else it is left out (the host's fp32 model before deepspeed.initialize).
    held_each: each tensor live at start_ns is its own allocation first, in the order made, and
    freed where the run frees it."""
    from deepspeed_zero3_fp16_streams import _scaled, _stream_of

    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    events, ranges = result["events"], result["ranges"]
    side = sorted((s, e, 1 if n == "zs:allgather" else 2) for s, e, n in ranges if n in ("zs:allgather", "zs:reduce"))
    starts = [x[0] for x in side]
    skipped = _skipped(result)
    live: dict[int, tuple[int, int | None]] = {}
    out: list = []
    if held_each:
        for index, (time_ns, size, ptr, _) in enumerate(events):
            if time_ns >= start_ns:
                break
            live.pop(ptr, None)
            if size > 0 and index not in skipped:
                live[ptr] = (size, None)
        for ptr, (size, _) in list(live.items()):
            live[ptr] = (size, len(out))
            out.append(AllocEvent(id=len(out), size_bytes=_scaled(size), stream=0))
    held_each_bytes = sum(event.size_bytes for event in out)
    for index, (time_ns, size, ptr, _) in enumerate(events):
        if time_ns > end_ns:
            break
        if held_each and time_ns < start_ns:
            continue
        previous = live.pop(ptr, None)
        if previous is not None and previous[1] is not None:
            out.append(FreeEvent(id=previous[1]))
        if size <= 0:
            continue
        if time_ns < start_ns or index in skipped:
            live[ptr] = (size, None)
            continue
        live[ptr] = (size, len(out))
        out.append(AllocEvent(id=len(out), size_bytes=_scaled(size), stream=_stream_of(side, starts, time_ns)))
    held = 0
    if held_each:
        held = held_each_bytes
    elif held_start:
        at_start: dict[int, int] = {}
        for index, (time_ns, size, ptr, _) in enumerate(events):
            if time_ns >= start_ns:
                break
            at_start.pop(ptr, None)
            if size > 0 and index not in skipped:
                at_start[ptr] = size
        held = sum(_scaled(size) for size in at_start.values())
        out = [AllocEvent(id=10**9, size_bytes=held, stream=0), *out]
    return AllocationTrace(events=tuple(out), source="deepspeed 0.14.2 (one rank), scaled"), held


def init_summary(result: dict) -> None:
    """The load phase's allocations (scaled), by operator, and what of them is live at step 0."""
    from deepspeed_zero3_fp16_streams import _scaled
    events, ranges = result["events"], result["ranges"]
    init = next((s, e) for s, e, n in ranges if n == "zs:init")
    step0 = min(s for s, e, n in ranges if n.startswith("zs:step"))
    made: Counter = Counter()
    count: Counter = Counter()
    live: dict[int, tuple[int, str]] = {}
    for time_ns, size, ptr, op in events:
        if time_ns > step0:
            break
        if size > 0:
            live[ptr] = (_scaled(size), op) if time_ns >= init[0] else (0, "before")
            if time_ns >= init[0]:
                made[op] += _scaled(size)
                count[op] += 1
        else:
            live.pop(ptr, None)
    gib = 2**30
    print("deepspeed.initialize's allocations (scaled), by operator: GiB made, count")
    for op, total in made.most_common(12):
        print(f"  {op:40s} {total / gib:8.3f} {count[op]:6d}")
    kept = Counter()
    for size, op in live.values():
        if op != "before":
            kept[op] += size
    print("live at step 0, by the operator that made it (GiB):",
          {op: round(b / gib, 3) for op, b in kept.most_common(8)})


def report(result: dict, capacity_bytes: int | None) -> None:
    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.allocator.replay import replay
    from deepspeed_zero3_fp16_streams import per_stream

    gib = 2**30
    ranges = result["ranges"]
    steps = sorted((s, e) for s, e, n in ranges if n.startswith("zs:step"))
    init = next((s, e) for s, e, n in ranges if n == "zs:init")
    init_summary(result)
    for conf in ("", "expandable_segments:True"):
        config = parse_alloc_conf(conf)
        print(f"PYTORCH_CUDA_ALLOC_CONF={conf!r} (streams: 0 compute, 1 allgather, 2 reduce)")
        runs = (("(a) empty cache, steps 1-last", engine_from(result, steps[1][0], steps[-1][1], True)),
                ("(a0) empty cache, steps 0-last", engine_from(result, steps[0][0], steps[-1][1], True)),
                ("(b) from initialize, steps 0-last", engine_from(result, init[0], steps[-1][1], False)),
                *((("(c) from the build's last empty_cache, steps 0-last",
                    engine_from(result, max(e for s, e, n in ranges if n == "zs:empty_cache" and e < steps[0][0]),
                                steps[-1][1], True, held_each=True)),)
                  if any(n == "zs:empty_cache" for _, _, n in ranges) else ()),
                ("(b-init) initialize alone", engine_from(result, init[0], init[1], False)))
        for name, (trace, held) in runs:
            r = replay(trace, config)
            line = (f"  {name}: held {held / gib:.2f}; requested {r.requested_peak_bytes / gib:.2f}, "
                    f"allocated {r.allocated_peak_bytes / gib:.2f}, reserved {r.reserved_peak_bytes / gib:.2f} "
                    f"(+{(r.reserved_peak_bytes - r.allocated_peak_bytes) / gib:.2f}); per stream {per_stream(trace, config)}")
            if capacity_bytes is not None:
                c = replay(trace, config, capacity_bytes)
                line += (f"; on {capacity_bytes / gib:.2f} GiB: completed {c.completed}, reserved "
                         f"{c.reserved_peak_bytes / gib:.2f}, flushes {c.device_refusals}")
            print(line)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed-src", help="DeepSpeed 0.14.2's source tree (fp16_streams' docstring)")
    p.add_argument("--early-2024-recompute", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--model", choices=("qwen1.5-0.5b", "llama-3-8b"), default="qwen1.5-0.5b",
                   help="llama-3-8b: deepspeed_zero3_fp16_streams.py's (its rows run 8 ranks: --world 8)")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--scale-power", type=int, default=8)
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--capacity-gib", type=float, help="also replay on this much memory (rtx-4090 plans 23.5 usable)")
    p.add_argument("--without-cpu-only", action="store_true", help="leave out the reduce stream's CPU-only "
                   "allocations (fp16_streams.without_cpu_only)")
    p.add_argument("--events", type=Path)
    p.add_argument("--save-events", type=Path)
    o = p.parse_args()
    import torch.multiprocessing as mp
    from deepspeed_zero3_lora_step import recorded_events

    data = recorded_events(o, p, lambda out: mp.spawn(_rank, args=(o.world, o, out), nprocs=o.world))
    if o.without_cpu_only:
        from deepspeed_zero3_fp16_streams import without_cpu_only
        data = without_cpu_only(data)
    report(data, int(o.capacity_gib * 2**30) if o.capacity_gib else None)
