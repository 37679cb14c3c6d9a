"""DeepSpeed ZeRO-3's own allocation sequence under Hugging Face LoRA, as the PEFT docs' Llama-2-70B
LoRA row runs it, replayed through zeroplan's caching-allocator model at the row's sizes, beside
the planner's own schedule for the row (zeroplan.allocator.schedule).

The engine runs on gloo (2 CPU ranks) on a Llama whose every large tensor is 1,024 times smaller
than the row's: hidden 256 and FFN 896 (Llama-2-70B's 8,192 and 28,672 over 32, so each weight is
1,024 times smaller), one KV head of 32 (eight of 128), vocabulary 1,000 (32,000 over 32), 80
blocks, and micro-batch 2 x 256 tokens (8 x 2,048 over 32), so each activation (tokens x a width)
is 1,024 times smaller too; DeepSpeed's stage-3 settings are its defaults over 1,024 (as
benchmarks/deepspeed_zero3_lora_step.py: stage3_param_persistence_threshold 4,096 keeps the tensors
whole that 1e5 does on 70B) and reduce_bucket_size 5e8 / 1,024; --persistence-threshold 2047
gathers LoRA's adapters so that the persistent parameters are the share of
stage3_max_live_parameters the row's are (PERSISTENT_SHARE), which sets how far step 2 prefetches. Rank 0's CPU
allocations and frees (the profiler's allocator events, zeroplan.harness.allocator_trace) in steps
1 and 2 are scaled by 1,024 and replayed, in their order, through zeroplan.allocator.replay on the
row's usable memory, after one allocation standing for what the row holds between steps (the
planner's: bf16 partitions over 8 ranks, buffers), in place of the 2-rank run's. Left out: the
causal masks transformers' SDPA path builds (flash attention 2, the row's, builds none). Tensors
not tokens x a width or a weight (LoRA's r-wide ones, norms' statistics) scale otherwise; they are
small beside the rest. The trace is the CPU's: gloo's all-gather temporaries are left out
(NCCL makes none), but dropout keeps a noise tensor of its input's dtype where CUDA keeps a bool
mask (LoRA's dropout on each adapted linear's input: about 1.2 GiB more at the row's sizes, in the
requested peak; the last line printed leaves these out and halves the noise, cpu_temporaries). A gathered buffer's use on the compute stream (free_param's record_stream) is
taken as done when DeepSpeed frees it. Usage:

    python benchmarks/deepspeed_zero3_allocator_replay.py --deepspeed-src DIR --early-2024-recompute \
        --persistence-threshold 2047

(DIR: DeepSpeed 0.13.3's source, the release of the row's date; see deepspeed_zero3_lora_step.py.)
"""

from __future__ import annotations

import argparse
import json
from bisect import bisect_right
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from deepspeed_zero3_lora_step import _import_old_deepspeed, start_rank  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, MICRO_BATCH, SEQ, STEPS = 256, 896, 80, 8, 1, 1000, 2, 256, 3
SCALE = 1024
STAGE3 = {"reduce_bucket_size": 488_282, "stage3_prefetch_bucket_size": 5 * 10**7 // SCALE,
          "stage3_max_live_parameters": 10**9 // SCALE, "stage3_max_reuse_distance": 10**9 // SCALE,
          "stage3_param_persistence_threshold": 4096}
ROW = ("llama-2-70b --gpus 8 --gpu h100-80gb --gpus-per-node 8 --micro-batch 8 --seq-len 2048 --grad-accum 4 "
       "--activation-checkpointing full --precision bf16-mixed --framework hf --lora-rank 8 "
       "--lora-targets q,k,v,o,gate,up,down --lora-alpha 16 --lora-dropout 0.1 --transformers-version 4.39.0 "
       "--deepspeed-release 0.13.3")
# The row's persistent parameters (DeepSpeed's default threshold 1e5 keeps the norms and LoRA's
# adapters narrower than it: zeroplan.core.deepspeed_coordinator.persistent_elements of ROW,
# 49,815,552) over its stage3_max_live_parameters (1e9). From the second step after the trace is
# recorded the coordinator's counter starts that many elements below zero (release_and_reset_all
# subtracts them, _post_step gathers them again outside the coordinator: 0.13.3 stage3.py:2021,
# :1986; coordinator lines 407-421, 478-483), so the prefetch runs that share beyond
# stage3_max_live_parameters. The scaled run's adapters shrink 32 times where max_live shrinks
# 1,024 times: at threshold 4,096 they are 1.59 of it (step 2 prefetches three blocks ahead where
# the row prefetches one); at --persistence-threshold 2047 only the norms and k/v's lora_B stay
# persistent, 0.084 of it, and the adapters are gathered as the row's 7,168-element-wide ones are not.
PERSISTENT_SHARE = 49_815_552 / 10**9
MASK_OPS = ("aten::le", "aten::eq", "aten::bitwise_and")
GATHER_RANGE = "zeroplan::allgather"
STEP_RANGE = "zeroplan::optimizer_step"


def stage3(options: argparse.Namespace) -> dict:
    """The run's stage-3 settings: STAGE3, with --persistence-threshold where given."""
    threshold = getattr(options, "persistence_threshold", None)
    return STAGE3 if threshold is None else {**STAGE3, "stage3_param_persistence_threshold": threshold}


def _every(roots) -> list:
    """Every profiler event of the tree."""
    out, stack = [], list(roots)
    while stack:
        event = stack.pop()
        out.append(event)
        stack.extend(event.children)
    return out


def marked_ranges_and_events(trace, prefix: str = "zs:") -> dict:  # type: ignore[no-untyped-def]
    """What an AllocatorTrace recorded: its profiler ranges named ``prefix``... as (start ns, end
    ns, name), sorted, and its allocations and frees as (time ns, bytes, address, operator)."""
    tree = trace._profile.profiler.kineto_results.experimental_event_tree()
    return {"ranges": sorted((e.start_time_ns, e.end_time_ns, e.name) for e in _every(tree) if e.name.startswith(prefix)),
            "events": [(a.time_ns, a.size_bytes, a.ptr, a.operator) for a in trace.events()]}


def _rank(rank: int, world: int, options: argparse.Namespace, out: str) -> None:
    start_rank(rank, world, options)
    import torch
    import torch.distributed as dist

    from torch.profiler import record_function

    from zeroplan.harness.allocator_trace import AllocatorTrace

    with AllocatorTrace() as trace:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed = _import_old_deepspeed(options.deepspeed_src) if options.deepspeed_src else __import__("deepspeed")
        deepspeed.init_distributed(dist_backend="gloo")
        # The coordinator's gathers run in its allgather stream's context (0.13.3
        # partitioned_param_coordinator.py:460 `with get_accelerator().stream(self.__allgather_stream)`
        # around all_gather_coalesced): marked so the replay puts what they allocate on that stream.
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as coordinator

        gather_name = "_PartitionedParameterCoordinator__all_gather_params_"
        gather = getattr(coordinator, gather_name)

        names: dict[int, str] = {}

        def marked_gather(self, params, *args, **kwargs):
            gathered = ",".join(sorted(names.get(id(p), "?") for p in params
                                       if p.ds_status == ZeroParamStatus.NOT_AVAILABLE))
            with record_function(f"{GATHER_RANGE}:{gathered}"):
                return gather(self, params, *args, **kwargs)

        setattr(coordinator, gather_name, marked_gather)
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                  "train_batch_size": MICRO_BATCH * world, "bf16": {"enabled": True}, "steps_per_print": 2**31 - 1,
                  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
                                        "offload_param": {"device": "none"},
                                        "stage3_gather_16bit_weights_on_model_save": True, **stage3(options)}}
        ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (transformers reads it through a weakref)
        model_config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attention_dropout=0.0,
                                   attn_implementation="sdpa", use_cache=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(model_config)  # under zero.Init
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        names.update((id(p), name.replace("base_model.model.model.", "")) for name, p in model.named_parameters())
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
        for step in range(STEPS):
            with record_function(f"step{step}"):
                engine.backward(engine(input_ids=tokens, labels=tokens).loss)
                with record_function(STEP_RANGE):
                    engine.step()
            if rank == 0:
                print(f"step {step} done", flush=True)
    if rank == 0:
        tree = trace._profile.profiler.kineto_results.experimental_event_tree()
        starts = sorted(e.start_time_ns for e in tree if e.name.startswith("step"))
        optimizer_steps = sorted((e.start_time_ns, e.end_time_ns) for e in _every(tree) if e.name == STEP_RANGE)
        gathers = sorted((e.start_time_ns, e.end_time_ns, e.name[len(GATHER_RANGE) + 1:]) for e in _every(tree)
                         if e.name.startswith(GATHER_RANGE))
        events = [(a.time_ns, a.size_bytes, a.ptr, a.operator) for a in trace.events()]
        Path(out).write_text(json.dumps({"deepspeed": deepspeed.__version__, "stage3": stage3(options), "step_starts": starts,
                                         "gathers": gathers, "optimizer_steps": optimizer_steps,
                                         "events": events}))
    dist.destroy_process_group()


def engine_trace(result: dict, first_step: int, end_step: int | None = None, cuda_like: bool = False):
    """The run's allocations from ``first_step`` on (to ``end_step``'s start where given), scaled,
    as an AllocationTrace (SDPA's masks left out; with ``cuda_like`` the CPU's own temporaries
    too, cpu_temporaries), and the bytes live at that step's start (the run's own, scaled)."""
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    start = result["step_starts"][first_step]
    end = result["step_starts"][end_step] if end_step is not None and end_step < len(result["step_starts"]) else None
    windows = result.get("gathers", [])
    window_starts = [window[0] for window in windows]

    steps = result.get("optimizer_steps", [])
    step_starts = [window[0] for window in steps]

    skipped = _collective_temporaries(result["events"])
    halved: set[int] = set()
    if cuda_like:
        dropped, halved = cpu_temporaries(result["events"])
        skipped |= dropped
    live: dict[int, tuple[int, int | None]] = {}  # ptr -> (size, trace id or None: from before / a mask)
    out: list = []
    next_id = 0
    for index, (time_ns, size, ptr, op) in enumerate(result["events"]):
        if end is not None and time_ns >= end:
            break
        previous = live.pop(ptr, None)
        if previous is not None and previous[1] is not None and time_ns >= start:
            out.append(FreeEvent(id=previous[1]))
        if size <= 0:
            continue
        if time_ns < start or op in MASK_OPS or index in skipped:
            live[ptr] = (size, None)
            continue
        live[ptr] = (size, next_id)
        size = size // 2 if index in halved else size
        out.append(AllocEvent(id=next_id, size_bytes=scaled(size, _inside(steps, step_starts, time_ns)),
                              stream=1 if _inside(windows, window_starts, time_ns) else 0))
        next_id += 1
    return AllocationTrace(events=tuple(out), source="deepspeed engine, scaled"), _live_at(result["events"], start)


# What the CPU run allocates that a CUDA run of the same step does not: aten::mm's own buffers
# (allocated and freed inside the CPU matmul; cuBLAS uses its workspace), the buffers of SDPA's CPU
# flash kernel (freed inside _scaled_dot_product_flash_attention_for_cpu) and the aten::where of
# its CPU path (the row runs flash attention 2, which allocates its output and log-sum-exp only);
# and dropout's noise, which torch's CPU dropout makes in the input's dtype (empty_like, then
# bernoulli_ and div_: aten/src/ATen/native/Dropout.cpp _dropout_impl) where CUDA's fused
# native_dropout keeps a bool mask: half its bytes in bf16.
def cpu_temporaries(events: list) -> tuple[set[int], set[int]]:
    """(indices of the CPU's own temporaries, indices of dropout's noise tensors)."""
    made: dict[int, int] = {}
    freed_by: dict[int, str] = {}
    for index, (_, size, ptr, op) in enumerate(events):
        if size > 0:
            made[ptr] = index
        elif ptr in made:
            freed_by[made.pop(ptr)] = op
    dropped: set[int] = set()
    noise: set[int] = set()
    for index, (_, size, _, op) in enumerate(events):
        if size <= 0:
            continue
        freer = freed_by.get(index, "")
        if ((op == "aten::mm" and freer == "aten::mm") or op == "aten::where"
                or (op == "aten::empty" and freer.startswith("aten::_scaled_dot_product_flash_attention_for_cpu"))):
            dropped.add(index)
        elif (op == "aten::empty_strided" and index + 1 < len(events) and events[index + 1][3] == "aten::div_"
              and freer in ("aten::dropout", "MulBackward0")):
            noise.add(index)
    return dropped, noise


# gloo's all-gather on the CPU (c10d::_allgather_base_) allocates two copies of the gathered
# buffer and frees them before it returns; NCCL's writes into the output DeepSpeed allocated.
def _collective_temporaries(events: list) -> set[int]:
    """Indices of the allocations a c10d or gloo collective frees (its own temporaries)."""
    made: dict[int, int] = {}
    out: set[int] = set()
    for index, (_, size, ptr, op) in enumerate(events):
        if size > 0:
            made[ptr] = index
        elif ptr in made:
            allocated = made.pop(ptr)
            if op.startswith(("c10d::", "gloo:")):
                out.add(allocated)
    return out


# Below 32 KiB the run's tensors are not tokens x a width (the narrowest, one KV head's 32 over 512
# tokens in bf16, is 32 KiB) nor a block weight: they are r-wide (LoRA's A outputs and weights,
# r x 256), norms' weights and statistics, scalars, whose one dimension that grows grows 32 times
# (tokens or the hidden size); so they are scaled by 32, as they stay in the small pool (under
# 1 MiB) at the row's sizes, not 1,024.
NARROW_BYTES = 32 * 1024
NARROW_SCALE = 32


# The optimizer step works on the flat partitions of the trainable parameters, LoRA's: r x (in +
# out) per adapter, 32 times more at the row's widths, over 8 ranks instead of 2.
STEP_SCALE = NARROW_SCALE * 2 // 8


def persistent_elements(threshold: int) -> int:
    """The scaled run's persistent elements (ds_numel <= threshold): norms and LoRA's adapters."""
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = [HIDDEN, HIDDEN]  # the two norms
    for out_features, in_features in ((HIDDEN, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, HIDDEN),
                                      (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)):
        shapes += [8 * in_features, out_features * 8]  # lora_A, lora_B at r 8
    return LAYERS * sum(n for n in shapes if n <= threshold) + HIDDEN  # and the final norm


def scaled(size: int, in_step: bool = False) -> int:
    if in_step:
        return size * STEP_SCALE
    return size * (NARROW_SCALE if size < NARROW_BYTES else SCALE)


def _inside(windows: list, starts: list[int], time_ns: int) -> bool:
    index = bisect_right(starts, time_ns) - 1
    return index >= 0 and time_ns <= windows[index][1]


def _live_at(events: list, time_ns: int) -> int:
    live: dict[int, int] = {}
    for t, size, ptr, op in events:
        if t >= time_ns:
            break
        live.pop(ptr, None)
        if size > 0 and op not in MASK_OPS:
            live[ptr] = size
    return sum(live.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-src", help="a DeepSpeed source tree to run instead of the installed release")
    parser.add_argument("--early-2024-recompute", action="store_true",
                        help="torch's non-reentrant recompute detaching every saved tensor, as early-2024 releases did")
    parser.add_argument("--events", type=Path, help="reuse a run's events saved by --save-events")
    parser.add_argument("--save-events", type=Path, help="keep the run's events here")
    parser.add_argument("--persistence-threshold", type=int,
                        help="the run's stage3_param_persistence_threshold (default 4,096; see PERSISTENT_SHARE)")
    parser.add_argument("--port", type=int, default=29571)
    options = parser.parse_args()

    if options.events:
        result = json.loads(options.events.read_text())
    else:
        import torch.multiprocessing as mp

        out = str(Path(tempfile.mkdtemp()) / "events.json")
        mp.spawn(_rank, args=(2, options, out), nprocs=2)
        result = json.loads(Path(out).read_text())
        if options.save_events:
            options.save_events.write_text(json.dumps(result))

    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.allocator.replay import replay
    from zeroplan.allocator.schedule import step_trace
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.feasibility import usable_memory_bytes
    from zeroplan.core.plan import memory_breakdown, peak_terms
    from zeroplan.specs.strategy import StrategyKind

    gib = 2**30
    request = request_from_args(build_parser().parse_args(["fit", *ROW.split()]), StrategyKind.zero3)
    breakdown, states = memory_breakdown(request)
    _, terms = peak_terms(request)
    between = states.parameter_bytes + states.optimizer_state_bytes + terms.resident_buffers
    capacity = usable_memory_bytes(request)
    config = parse_alloc_conf("")
    planner = replay(step_trace(request, *peak_terms(request)), config, capacity)
    held = AllocEvent(id=10**9, size_bytes=between, stream=0)
    outside = request.cluster.gpu.memory_bytes - capacity  # CUDA context and NCCL buffers, as published_memory_accuracy
    settings = result.get("stage3", STAGE3)
    share = persistent_elements(settings["stage3_param_persistence_threshold"]) / settings["stage3_max_live_parameters"]
    print(f"DeepSpeed {result['deepspeed']}; Llama-2-70B LoRA row's shapes over {SCALE}, 2 gloo ranks, "
          f"replayed x {SCALE} on {capacity / gib:.2f} GiB usable; stage3_param_persistence_threshold "
          f"{settings['stage3_param_persistence_threshold']:,}: persistent elements {share:.3f} of stage3_max_live_parameters "
          f"(the row's {PERSISTENT_SHARE:.3f}), which step 2 on prefetches beyond it")
    for label, first, end, cuda_like in (("step 1", 1, 2, False), ("step 2", 2, 3, False), ("steps 1-2", 1, None, False),
                                         ("step 2, the CPU's own temporaries left out", 2, 3, True)):
        engine, run_between = engine_trace(result, first, end, cuda_like)
        engine = AllocationTrace(events=(held, *engine.events), source=engine.source)
        replayed = replay(engine, config, capacity)
        print(f"  engine {label}: allocations {sum(isinstance(e, AllocEvent) for e in engine.events):,}; requested peak "
              f"{replayed.requested_peak_bytes / gib:.2f} GiB, reserved peak {replayed.reserved_peak_bytes / gib:.2f} GiB, "
              f"as nvidia-smi {(replayed.reserved_peak_bytes + outside) / gib:.2f} GiB (cudaMalloc calls "
              f"{replayed.device_alloc_calls}, completed {replayed.completed})")
    print(f"  held between steps: planner {between / gib:.2f} GiB (the 2-rank run's own, scaled: "
          f"{run_between * SCALE / gib:.2f})")
    print(f"  planner's schedule: allocated peak {breakdown.allocated_peak_bytes / gib:.2f} GiB, replay requested "
          f"{planner.requested_peak_bytes / gib:.2f}, reserved {planner.reserved_peak_bytes / gib:.2f} GiB, as nvidia-smi "
          f"{(planner.reserved_peak_bytes + outside) / gib:.2f} GiB "
          f"(allocations {sum(isinstance(e, AllocEvent) for e in step_trace(request, *peak_terms(request)).events):,}); "
          f"the row's screenshot: 64 GB")


if __name__ == "__main__":
    main()
