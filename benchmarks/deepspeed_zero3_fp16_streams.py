"""DeepSpeed 0.14.2's own ZeRO-3 step (fp16, the stage-3 defaults a config naming only the stage
gets, as the gpjt Llama-3-8B rows' ds_config.json) with the stream each allocation would be made
on, replayed through zeroplan's caching-allocator model per stream.

The engine runs on gloo (8 CPU ranks, as the rows' 8 GPUs, so each partition is the rows' over the
same world) on a Llama-3-8B made 16 times narrower: hidden 256, FFN 896, 8 heads of 32, 2 KV heads,
vocabulary 8,016 (128,256 / 16), so every weight is 256 times smaller, and micro-batch 12 x 128
tokens (12 x 2,048 / 16), so every tokens x width tensor is too (logits included); --layers blocks
(the rows' 32 by default; fewer to run faster). DeepSpeed's settings are its defaults over 256
(reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters and
stage3_max_reuse_distance 1e9, stage3_param_persistence_threshold 1e5, sub_group_size 1e9). The
model is built in fp32 outside zero.Init (the rows' full-per-rank load), checkpointed as
transformers 4.40's gradient_checkpointing_enable() (use_reentrant True), and its loss is 4.40's
LlamaForCausalLM one (logits.float(), the shifted copy, cross entropy). fp16's loss scale starts
at 2^--scale-power so that no step is skipped for overflow (the rows' 30 steps settle likewise).

Streams: the CPU accelerator has none (is_synchronized_device), so the calls that run in a side
stream's context on CUDA are marked and what they allocate is put on that stream:
  allgather: the coordinator's fetch_sub_module (0.14.2 partitioned_param_coordinator.py:303-309,
    the wait()'s torch.cat of each parameter, and :460, all_gather_coalesced's flat buffer);
  reduce: stage3.py __add_grad_to_ipg_bucket (:1236), __reduce_and_partition_ipg_grads (:1265:
    reduce_scatter_coalesced's torch.cat, comm/coalesced_collectives.py) and has_overflow (:2140-2143:
    torch.isinf / torch.isnan of the whole gradient partition).
gloo's own temporaries and the CPU kernels' (deepspeed_zero3_allocator_replay) are left out.
Sizes of 32 KiB and more are scaled by 256, smaller ones by 16. Usage:

    python benchmarks/deepspeed_zero3_fp16_streams.py --deepspeed-src DIR [--layers 8] [--micro-batch 12]
        [--capacity-gib 78.93] [--save-events F | --events F]

(DIR: DeepSpeed 0.14.2's source tree, its csrc left out: deepspeed/comm/torch.py's build_shm_op
must answer None, as it does where the CPU op cannot be built.)

Measured with --checkpointing --layers 8 (steps 1-2 of 0-2, no device limit), beside the planner's
own schedule for the same request (Llama-3-8B's widths with 8 blocks, 8 GPUs, zero3, micro-batch
12 x 2,048, full checkpointing, fp16, hf 4.40, DeepSpeed 0.14.2, full-per-rank):
  default allocator: engine requested 46.52 GiB, reserved 70.47 (compute stream 43.62 / 63.49,
    allgather 3.93 / 5.08, reduce 1.84 / 1.90); planner requested 45.47, reserved 65.08 (compute
    43.60 / 61.25, allgather 2.90 / 2.90, reduce 0.92 / 0.92), with the loss in transformers 4.40's
    order and the reduce stream planned (46.54 before, nothing on the reduce stream).
  expandable segments: engine reserved 56.02 (+9.50 over requested); planner 53.34 (+7.87; +1.0 before).
With --layers 32 (the rows' depth), micro-batch 12: requested 60.59 (planner 59.72), reserved 86.19
without a device limit (84.27 without the reduce stream's CPU-only allocations below); on the row's
78.93 GiB usable, after one flush, 70.67 for step 1 and over steps 1-2 alike (published 76.24).
With --micro-batch 13: 74.89 for step 1 and over steps 1-2, one flush (the row ran out: not
reproduced). The installed transformers' SDPA causal masks are left out (engine_steps: 4.40 builds
none for this input); counted, each step's stayed held into the next (their frees are not in the
profiler's events) and steps 1-2 ran out at micro-batch 13 (75.10 for step 1). Steps 1 and 2 then
differ only in the coordinator's coalescing on the allgather stream (requested peak 3.79 and 3.98).
The reduce stream's second flat-copy-sized block is made inside the reduce-scatter call after
reduce_scatter_coalesced's div_ and freed with it (gloo's staging of its input; NCCL writes into the
buffer's own chunk), and the CPU's isinf makes an fp16 abs of the partition first: both the CPU
backend's, not CUDA's.
From the optimizer build (--checkpointing --layers 8, the run replayed from the engine's last
empty_cache, its build included: zeroplan.allocator.deepspeed_first_step): reserved 66.66 GiB to the
end of step 0, 69.10 to step 1, 69.11 to step 2, where steps 1-2 alone (what was live at step 1's
start held as one block) reserve 70.29 in the same run: the build's free segments, reused by the
forward, leave fewer to make (requested 46.63 against 46.34).
With --world 1 --layers 4 --checkpointing --micro-batch 4 (one rank, a partition world of 1): no
allocation at all inside the coordinator's fetches (partition_parameters.py:1166-1167 hands them
to _no_gather_coalesced: zeroplan.core.deepspeed_one_rank), the compute stream 41.78 GiB requested
(48.44 reserved, 43.93 under expandable segments), the reduce stream 1.79 with its CPU-only
allocations left out (0.92 and 0.70 GiB flat copies, the second the epilogue's, and the 1.79 GiB
overflow checks; 2.72 reserved, 1.80 under expandable segments), step 1 alike step 2.
The compute stream's extra segments are the loss's: transformers 4.40's fp16 logits (6,012 MiB)
cached where no fp32 request fits, and a second fp32-logits-sized segment (12,024 MiB) that the
loss's backward asks for after a shifted-logits request (11,930 MiB here; 12,018 at 2,048 tokens)
took the free 12,024 block: the planner's loss moments (allocator/fsdp_schedule.py run_loss)
allocated and freed each moment whole and made neither; the schedule now runs them tensor by tensor
in the release's order (zeroplan.core.transformers_release.ordered_loss_tensors).
"""

import argparse
import importlib
import json
import sys
from bisect import bisect_right
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
HIDDEN, FFN, HEADS, KV, VOCAB = 256, 896, 8, 2, 8016
MB, SEQ, STEPS, SCALE = 12, 128, 3, 256
STAGE3 = {"reduce_bucket_size": 5 * 10**8 // SCALE, "stage3_prefetch_bucket_size": 5 * 10**7 // SCALE,
          "stage3_max_live_parameters": 10**9 // SCALE, "stage3_max_reuse_distance": 10**9 // SCALE,
          "stage3_param_persistence_threshold": 10**5 // SCALE, "sub_group_size": 10**9 // SCALE}
RANGES = ("zs:allgather", "zs:reduce", "zs:optstep", "zs:step")

def _rank(rank, world, options, out):
    from deepspeed_zero3_lora_step import _import_old_deepspeed, mark_calls, mark_empty_cache, start_rank
    start_rank(rank, world, options)
    import torch, torch.distributed as dist
    from torch.profiler import record_function
    from zeroplan.harness.allocator_trace import AllocatorTrace
    import contextlib
    ctx = AllocatorTrace() if rank == 0 else contextlib.nullcontext()
    with ctx as trace:
        from transformers import LlamaConfig, LlamaForCausalLM
        deepspeed = _import_old_deepspeed(options.deepspeed_src)
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        type(acc).is_fp16_supported = lambda self: True
        # The engine's last empty_cache (stage3.py defragment) marks where what the process holds
        # during training starts (--from-build).
        mark_empty_cache(acc)
        # What the docstring asks of the source tree (no shared-memory op), whatever op_builder says.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S
        # 0.14.2 coordinator :303-309 (wait's cat) and :460 (all_gather_coalesced): allgather stream
        mark_calls(C, "fetch_sub_module", "zs:allgather")
        # stage3.py :1236 (bucket copy), :1265 (reduce-scatter, partition_grads), :2140 (has_overflow)
        mark_calls(S, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "zs:reduce")
        mark_calls(S, "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", "zs:reduce")
        mark_calls(S, "has_overflow", "zs:reduce")
        mark_calls(S, "_optimizer_step", "zs:optstep")
        mb = options.micro_batch
        config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "train_batch_size": mb * world,
                  "fp16": {"enabled": True, "initial_scale_power": options.scale_power}, "steps_per_print": 2**31 - 1,
                  "zero_optimization": {"stage": 3, **STAGE3}}
        mc = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=options.layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV, attn_implementation="sdpa", use_cache=False,
                         tie_word_embeddings=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(mc)  # fp32, no zero.Init: the row's full-per-rank load
        if options.checkpointing:
            model.gradient_checkpointing_enable()  # use_reentrant True, as transformers 4.40's default
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        tokens = torch.randint(0, VOCAB, (mb, options.seq), generator=torch.Generator().manual_seed(rank))
        for step in range(STEPS):
            with record_function(f"zs:step{step}"):
                loss = transformers_440_loss(engine, tokens, VOCAB)
                engine.backward(loss)
                del loss
                engine.step()
            if rank == 0:
                print(f"step {step} done overflow={engine.optimizer.overflow} scale={engine.optimizer.loss_scale}", flush=True)
    if rank == 0:
        from deepspeed_zero3_allocator_replay import marked_ranges_and_events
        json.dump(marked_ranges_and_events(trace), open(out, "w"))
    dist.destroy_process_group()


def transformers_440_loss(engine, tokens, vocab: int):  # type: ignore[no-untyped-def]
    """transformers 4.40's causal-LM loss (LlamaForCausalLM / Qwen2ForCausalLM.forward): the logits
    made fp32, shifted, made contiguous, cross-entropy; the fp32 logits stay in the model's output
    until the Trainer's compute_loss returns."""
    import torch

    logits = engine(input_ids=tokens).logits.float()
    shift = logits[..., :-1, :].contiguous()
    labels = tokens[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(shift.view(-1, vocab), labels.view(-1))

def _stream_of(side: list, starts: list, time_ns: int) -> int:
    """The side stream whose marked call was running at ``time_ns`` (0: the compute stream)."""
    index = bisect_right(starts, time_ns) - 1
    for j in range(index, max(index - 50, -1), -1):
        if side[j][0] <= time_ns <= side[j][1]:
            return side[j][2]
    return 0


def _scaled(size: int) -> int:
    return size * SCALE if size >= 32 * 1024 else size * 16


def engine_steps(result: dict, first: int, last: int):
    """Steps first..last of the run as an AllocationTrace (scaled, with their streams), after one
    allocation holding what was live at the first one's start (scaled)."""
    from deepspeed_zero3_allocator_replay import MASK_OPS, _collective_temporaries, cpu_temporaries

    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    events, ranges = result["events"], result["ranges"]
    steps = sorted((s, e) for s, e, n in ranges if n.startswith("zs:step"))
    side = sorted((s, e, 1 if n == "zs:allgather" else 2) for s, e, n in ranges if n in ("zs:allgather", "zs:reduce"))
    starts = [x[0] for x in side]
    skipped = _collective_temporaries(events) | cpu_temporaries(events)[0]
    # The installed transformers' SDPA path builds a boolean causal mask every forward
    # (masking_utils: le, eq, bitwise_and) whose frees the profiler does not record, so each
    # step's stays in the events; transformers 4.40's, the rows', builds none for this input
    # (4.40.0 modeling_llama.py:1073-1079: _update_causal_mask returns None where SDPA's
    # is_causal serves; modeling_attn_mask_utils.py:263-273, _ignore_causal_mask_sdpa, for no
    # attention mask, :275-285 for one of all ones). Left out on the compute stream, as
    # deepspeed_zero3_allocator_replay does (the reduce stream's eq is has_overflow's isinf).
    skipped |= {index for index, (time_ns, size, _, op) in enumerate(events)
                if size > 0 and op in MASK_OPS and _stream_of(side, starts, time_ns) == 0}
    start, end = steps[first][0], steps[last][1]
    live: dict[int, tuple[int, int | None]] = {}
    out: list = []
    for index, (time_ns, size, ptr, _) in enumerate(events):
        if time_ns > end:
            break
        previous = live.pop(ptr, None)
        if previous is not None and previous[1] is not None:
            out.append(FreeEvent(id=previous[1]))
        if size <= 0:
            continue
        if time_ns < start or index in skipped:
            live[ptr] = (size, None)
            continue
        live[ptr] = (size, len(out))
        out.append(AllocEvent(id=len(out), size_bytes=_scaled(size), stream=_stream_of(side, starts, time_ns)))
    at_start: dict[int, int] = {}
    for index, (time_ns, size, ptr, _) in enumerate(events):
        if time_ns >= start:
            break
        at_start.pop(ptr, None)
        if size > 0 and index not in skipped:
            at_start[ptr] = size
    held = sum(_scaled(size) for size in at_start.values())
    trace = AllocationTrace(events=(AllocEvent(id=10**9, size_bytes=held, stream=0), *out), source="deepspeed 0.14.2, scaled")
    return trace, held


def per_stream(trace, config) -> dict[int, tuple[float, float]]:
    """Each stream's (requested, reserved) peak in GiB, replayed alone (streams share no block)."""
    from zeroplan.allocator.replay import replay
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent

    out = {}
    for stream in sorted({e.stream for e in trace.events if isinstance(e, AllocEvent)}):
        ids = {e.id for e in trace.events if isinstance(e, AllocEvent) and e.stream == stream}
        events = tuple(e for e in trace.events if e.id in ids)
        result = replay(AllocationTrace(events=events, source=trace.source), config)
        out[stream] = (round(result.requested_peak_bytes / 2**30, 2), round(result.reserved_peak_bytes / 2**30, 2))
    return out


def _cpu_only(op: str, size: int) -> bool:
    """A reduce-stream allocation the CPU backend makes and CUDA's does not: isinf's fp16 abs of the
    partition, and the flat buffer's staging copy inside gloo's reduce-scatter (an empty_strided of
    the buffer's size after reduce_scatter_coalesced's div_; NCCL writes into the buffer's chunk)."""
    return op == "aten::abs" or (op == "aten::empty_strided" and _scaled(size) >= 2**26)


def without_cpu_only(result: dict) -> dict:
    """The run's events less the reduce stream's CPU-only allocations (_cpu_only) and their frees."""
    events, ranges = result["events"], result["ranges"]
    side = sorted((s, e, 1 if n == "zs:allgather" else 2) for s, e, n in ranges if n in ("zs:allgather", "zs:reduce"))
    starts = [x[0] for x in side]
    out, dropped = [], set()
    for time_ns, size, ptr, op in events:
        if size > 0 and _cpu_only(op, size) and _stream_of(side, starts, time_ns) == 2:
            dropped.add(ptr)
            continue
        if size < 0 and ptr in dropped:
            dropped.discard(ptr)
            continue
        out.append((time_ns, size, ptr, op))
    return {"events": out, "ranges": ranges}


def from_build(result: dict, last: int):
    """The run from the engine's last empty_cache before step 0 (its optimizer build:
    zeroplan.allocator.deepspeed_first_step) to the end of step ``last``, as an AllocationTrace
    (scaled, with their streams) after one allocation holding what was live at that empty_cache."""
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    ranges, events = result["ranges"], result["events"]
    steps = sorted((s, e) for s, e, n in ranges if n.startswith("zs:step"))
    start = max(e for s, e, n in ranges if n == "zs:empty_cache" and e < steps[0][0])
    side = sorted((s, e, 1 if n == "zs:allgather" else 2) for s, e, n in ranges if n in ("zs:allgather", "zs:reduce"))
    starts = [x[0] for x in side]
    live: dict[int, int | None] = {}
    at_start: dict[int, int] = {}
    out: list = []
    for time_ns, size, ptr, _ in events:
        if time_ns > steps[last][1]:
            break
        made = live.pop(ptr, None)
        if made is not None:
            out.append(FreeEvent(id=made))
        if time_ns < start:
            at_start.pop(ptr, None)
            if size > 0:
                at_start[ptr] = size
            continue
        if size > 0:
            live[ptr] = len(out)
            out.append(AllocEvent(id=len(out), size_bytes=_scaled(size), stream=_stream_of(side, starts, time_ns)))
    held = sum(_scaled(size) for size in at_start.values())
    return AllocationTrace(events=(AllocEvent(id=10**9, size_bytes=held, stream=0), *out), source="deepspeed 0.14.2, scaled"), held


def report(result: dict, capacity_bytes: int | None = None) -> None:
    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.allocator.replay import replay

    gib = 2**30
    last = sum(1 for _, _, n in result["ranges"] if n.startswith("zs:step")) - 1
    if capacity_bytes is not None:
        config = parse_alloc_conf("")
        runs = (("as run", result), ("the reduce stream's CPU-only allocations left out", without_cpu_only(result)))
        for name, events in runs:
            for first, end in ((1, 1), (1, last)):
                replayed = replay(engine_steps(events, first, end)[0], config, capacity_bytes)
                print(f"on {capacity_bytes / gib:.2f} GiB, {name}, steps {first}-{end}: completed {replayed.completed}, "
                      f"reserved peak {replayed.reserved_peak_bytes / gib:.2f}, cache flushes {replayed.device_refusals}")
    if any(n == "zs:empty_cache" for _, _, n in result["ranges"]):
        for end in range(last + 1):
            trace, held = from_build(result, end)
            replayed = replay(trace, parse_alloc_conf(""))
            print(f"from the optimizer build to the end of step {end} (default allocator): held at its start "
                  f"{held / gib:.2f} GiB; requested peak {replayed.requested_peak_bytes / gib:.2f}, reserved peak "
                  f"{replayed.reserved_peak_bytes / gib:.2f}")
    for conf in ("", "expandable_segments:True"):
        config = parse_alloc_conf(conf)
        print(f"PYTORCH_CUDA_ALLOC_CONF={conf!r} (streams: 0 compute, 1 allgather, 2 reduce)")
        for first, end in ((1, 1), (last, last), (1, last)):
            trace, held = engine_steps(result, first, end)
            replayed = replay(trace, config)
            print(f"  steps {first}-{end}: held at start {held / gib:.2f} GiB; requested peak "
                  f"{replayed.requested_peak_bytes / gib:.2f}, reserved peak {replayed.reserved_peak_bytes / gib:.2f} "
                  f"(+{(replayed.reserved_peak_bytes - replayed.requested_peak_bytes) / gib:.2f}); per stream "
                  f"(requested, reserved) {per_stream(trace, config)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed-src", help="DeepSpeed 0.14.2's source tree (see the docstring)")
    p.add_argument("--early-2024-recompute", action="store_true")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing, as the batch-size rows")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--micro-batch", type=int, default=MB, help="the rows' micro-batch (12 completed, 13 ran out)")
    p.add_argument("--scale-power", type=int, default=8)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--port", type=int, default=29613)
    p.add_argument("--capacity-gib", type=float, help="also replay steps 1 and 1-last on this much memory "
                   "(the rows' a100-80gb plans 78.93 usable)")
    p.add_argument("--events", type=Path, help="reuse a run's events saved by --save-events")
    p.add_argument("--save-events", type=Path, help="keep the run's events here")
    o = p.parse_args()
    import torch.multiprocessing as mp
    from deepspeed_zero3_lora_step import recorded_events

    data = recorded_events(o, p, lambda out: mp.spawn(_rank, args=(o.world, o, out), nprocs=o.world))
    report(data, int(o.capacity_gib * 2**30) if o.capacity_gib else None)
