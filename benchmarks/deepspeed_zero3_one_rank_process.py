"""DeepSpeed ZeRO-3's own engine on one gloo rank, bf16, as Qwen's finetune/finetune_ds.sh runs a
full-parameter fine-tune on one GPU (ds_config_zero3.json: AdamW, sub_group_size 1e9,
stage3_max_live_parameters / max_reuse_distance 1e9, contiguous gradients, overlap_comm, the
'auto' buckets transformers fills from hidden_size, gradient clipping 1.0, gradient accumulation
8), replayed through zeroplan's caching-allocator model from the engine's creation on: what the
process holds once the engine's last empty_cache has run (stage3.py defragment, :519-553 at
v0.12.3), which is what nvidia-smi shows during training, beside the steps alone.

The model is Qwen-1.8B made 16 times narrower, as a transformers Llama (the same tensors per block
but for Qwen-1's fused c_attn and its bias): hidden 128, FFN 344 (5,504 / 16), 16 heads of 8,
24 blocks, vocabulary 9,496 (151,936 / 16), untied head, so every weight is 256 times smaller, and
16 tokens a micro-batch (256 / 16), so every tokens x width tensor is too (logits included). The
stage-3 settings are the config's over 256: sub_group_size 1e9 / 256 (two optimizer sub-groups, as
Qwen-1.8B's 1.84e9 elements make), max_live / reuse 1e9 / 256; transformers 4.32's 'auto' fill
(deepspeed.py trainer_config_finalize: reduce_bucket_size hidden^2, stage3_prefetch_bucket_size
0.9 hidden^2, stage3_param_persistence_threshold 10 hidden) of the scaled hidden is the same
fraction. The model is built inside zero.Init (transformers' from_pretrained under ZeRO-3) in
bf16; the loss is Qwen-1's own (modeling_qwen.py: CrossEntropyLoss of the bf16 shifted logits, no
upcast; the Trainer runs no autocast under DeepSpeed). The optimizer is torch's fused AdamW handed
in as the client optimizer: DeepSpeed's FusedAdam (what 'AdamW' in the config builds on CUDA) does
not build on the CPU, and both update in place with no temporaries of the states' size.

Sizes of 32 KiB and more are scaled by 256, smaller ones by 16. Measured (2 optimizer steps of 8
micro-batches each, replayed through zeroplan.allocator's default caching allocator, no device
limit), beside the planner's figures for Qwen-1.8B on one A100-80GB, zero3, bf16-mixed, hf 4.32,
torch 2.0, --deepspeed-release 0.13.3 and Qwen's config (--deepspeed-config, its 'auto' filled):
  256 tokens (--seq 16): sub-groups 1,009,057,792 and 829,128,704 elements (x256);
    DeepSpeed 0.12.3 from its last empty_cache: requested 33.04 GiB, reserved 35.70; steps alone
      (what was live at each step's start held as one block) reserved 34.95 and 34.89;
    DeepSpeed 0.13.3: requested 33.05, reserved 35.72 (steps alone 34.92, 34.89): its Adam states
      are made in the first step (18179807f, from 0.13.2), 0.12.3's at the build;
    planner: allocated 33.0, reserved 33.8 with the states allocated whole at the replay's start,
      35.7 with DeepSpeed's build replayed first (zeroplan.allocator.deepspeed_first_step: 35.67
      with Adam's states made in the first step, as 0.13.3, or at the build, as 0.12.3).
    The build's cached segments are the difference: the clone of each sub-group (1.88 and 1.54
    GiB, the first reused by the step's flat gradient copy) and the fp32 gradient buffer (3.76
    GiB) that grad_partitions_flat_buffer (3.42) is carved from.
  8192 tokens (--seq 512), 0.12.3: requested 39.22, reserved 42.65 (planner 35.2 and 40.3); at this
    length the CPU's attention and loss kernels stand for flash attention 2's and CUDA's, and 1.97
    GiB more is live at step 1's start than at step 0's (frees the profiler does not see, as in
    deepspeed_zero3_fp16_streams.py): not a like-for-like check of the activations.
Qwen's README measured 43.5 GiB (nvidia-smi) at 256 tokens: neither DeepSpeed release's own
allocations, its build included, come near it. Usage:

    python benchmarks/deepspeed_zero3_one_rank_process.py --deepspeed-src DIR [--steps 2] [--seq 16]

(DIR: `git archive v0.13.3 deepspeed op_builder accelerator` of microsoft/DeepSpeed.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

HIDDEN, FFN, HEADS, LAYERS, VOCAB, SCALE, ACCUM = 128, 344, 16, 24, 9496, 256, 8
STAGE3 = {"overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 10**9 // SCALE,
          "reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
          "stage3_param_persistence_threshold": 10 * HIDDEN, "stage3_max_live_parameters": 10**9 // SCALE,
          "stage3_max_reuse_distance": 10**9 // SCALE, "stage3_gather_16bit_weights_on_model_save": True,
          "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
MARKS = ("zs:empty_cache", "zs:optstep", "zs:norm", "zs:prepare")


def _run(options: argparse.Namespace, out: str) -> None:
    from deepspeed_zero3_lora_step import _import_old_deepspeed, mark_calls, mark_empty_cache, start_rank

    options.early_2024_recompute = False
    start_rank(0, 1, options)
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    from zeroplan.harness.allocator_trace import AllocatorTrace

    with AllocatorTrace() as trace:
        from transformers import LlamaConfig, LlamaForCausalLM

        deepspeed = _import_old_deepspeed(options.deepspeed_src)
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S

        acc = get_accelerator()
        mark_empty_cache(acc)
        # 0.13.3's NoGatherHandle.wait (partition_parameters.py:59) synchronizes the current stream,
        # which the CPU accelerator gives as None: a stand-in whose synchronize does nothing.
        if acc.current_stream() is None:
            acc.current_stream = lambda device=None: type("Stream", (), {"synchronize": lambda self: None})()

        mark_calls(S, "_optimizer_step", "zs:optstep")
        mark_calls(S, "_get_norm_groups", "zs:norm")
        mark_calls(S, "_prepare_fp32_grad_for_sub_group", "zs:prepare")
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM, "train_batch_size": ACCUM,
                  "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 2**31 - 1,
                  "zero_optimization": {"stage": 3, **STAGE3}}
        mc = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, attn_implementation="sdpa",
                         use_cache=False, tie_word_embeddings=False)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(mc)
        model.gradient_checkpointing_enable({"use_reentrant": True})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        sub_groups = [sum(p.partition_numel() for p in g) for g in engine.optimizer.fp16_groups]
        tokens = torch.randint(0, VOCAB, (1, options.seq), generator=torch.Generator().manual_seed(0))
        for step in range(options.steps):
            with record_function(f"zs:step{step}"):
                for _ in range(ACCUM):
                    logits = engine(input_ids=tokens).logits  # bf16: Qwen-1's loss takes them as they are
                    shift = logits[..., :-1, :].contiguous()
                    labels = tokens[..., 1:].contiguous()
                    loss = torch.nn.CrossEntropyLoss()(shift.view(-1, VOCAB), labels.view(-1))
                    del logits, shift
                    engine.backward(loss)
                    del loss
                    engine.step()
            print(f"step {step} done, sub-groups {sub_groups}, dtype {engine.optimizer.fp16_partitioned_groups_flat[0].dtype}",
                  flush=True)
    from deepspeed_zero3_allocator_replay import marked_ranges_and_events

    json.dump({**marked_ranges_and_events(trace), "sub_groups": sub_groups}, open(out, "w"))
    dist.destroy_process_group()


def _scaled(size: int) -> int:
    return size * SCALE if size >= 32 * 1024 else size * 16


def after(result: dict, start_ns: int, end_ns: int | None = None):
    """The events from ``start_ns`` on (to ``end_ns``) as an AllocationTrace, scaled, after one
    allocation holding what was live at ``start_ns``."""
    from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

    live: dict[int, tuple[int, int | None]] = {}
    out: list = []
    held = 0
    for time_ns, size, ptr, _ in result["events"]:
        if end_ns is not None and time_ns > end_ns:
            break
        previous = live.pop(ptr, None)
        if previous is not None and previous[1] is not None:
            out.append(FreeEvent(id=previous[1]))
        if size <= 0:
            continue
        if time_ns < start_ns:
            live[ptr] = (size, None)
            continue
        live[ptr] = (size, len(out))
        out.append(AllocEvent(id=len(out), size_bytes=_scaled(size), stream=0))
    held = 0
    at_start: dict[int, int] = {}
    for time_ns, size, ptr, _ in result["events"]:
        if time_ns >= start_ns:
            break
        at_start.pop(ptr, None)
        if size > 0:
            at_start[ptr] = size
    held = sum(_scaled(size) for size in at_start.values())
    return AllocationTrace(events=(AllocEvent(id=10**9, size_bytes=held, stream=0), *out), source="deepspeed, scaled"), held


def report(result: dict) -> None:
    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.allocator.replay import replay

    gib = 2**30
    ranges = result["ranges"]
    last_empty = max(e for s, e, n in ranges if n == "zs:empty_cache")
    steps = sorted((s, e) for s, e, n in ranges if n.startswith("zs:step"))
    print(f"sub-groups (elements, x{SCALE}): {[g * SCALE for g in result['sub_groups']]}")
    config = parse_alloc_conf("")
    rows = [("process from the engine's last empty_cache", last_empty, None)]
    rows += [(f"step {i} alone (what was live at its start held)", s, e) for i, (s, e) in enumerate(steps)]
    rows += [(f"from the last empty_cache to the end of step {i}", last_empty, e) for i, (s, e) in enumerate(steps)]
    for name, start, end in rows:
        trace, held = after(result, start, end)
        r = replay(trace, config)
        print(f"{name}: held at start {held / gib:.2f} GiB; requested peak {r.requested_peak_bytes / gib:.2f}, "
              f"reserved peak {r.reserved_peak_bytes / gib:.2f} GiB")
    # The large blocks made after the last empty_cache, in order, with the op that made them.
    print("allocations of 64 MiB and more (scaled) after the last empty_cache, before step 0 ends:")
    step0_end = steps[0][1]
    for time_ns, size, ptr, op in result["events"]:
        if last_empty <= time_ns <= step0_end and size > 0 and _scaled(size) >= 64 * 2**20:
            marks = [n for s, e, n in ranges if s <= time_ns <= e and n in MARKS]
            print(f"  {_scaled(size) / gib:6.2f} GiB  {op}  {marks}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed-src", help="an earlier DeepSpeed release's source tree (see the docstring)")
    p.add_argument("--seq", type=int, default=16, help="tokens a micro-batch (Qwen's 256 / 16)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps, each of 8 micro-batches")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--events", type=Path, help="reuse a run's events saved by --save-events")
    p.add_argument("--save-events", type=Path, help="keep the run's events here")
    o = p.parse_args()
    from deepspeed_zero3_lora_step import recorded_events

    data = recorded_events(o, p, lambda out: _run(o, out))
    report(data)
