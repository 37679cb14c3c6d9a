"""DeepSpeed ZeRO-3's own engine under Hugging Face QLoRA as the PEFT docs' 70B QLoRA row runs it
(bitsandbytes nf4 with double quantization, bnb_4bit_quant_storage bf16, LoRA on every block
linear, reentrant gradient checkpointing with the input's gradient enabled, bf16), on a 4-block
Llama on gloo (2 CPU ranks): what DeepSpeed counts for each packed weight (ds_numel, ds_persist),
each step's peak of live CPU bytes, and the planner's allocated peak for the same request.

    python benchmarks/deepspeed_zero3_qlora_step.py [--bf16-base] [--non-reentrant]

The model is deepspeed_zero3_lora_step.py's (hidden 256, FFN 896, 8 heads over one KV head of 32,
vocabulary 512, micro-batch 2 x 512) with the stage-3 settings it scales by 1,024
(stage3_param_persistence_threshold 4,096). It is saved and loaded back with from_pretrained and a
BitsAndBytesConfig, as transformers loads a QLoRA model (no zero.Init for a quantized model), and
runs the installed releases (DeepSpeed 0.19.8, bitsandbytes 0.50.2, transformers 4.56.2, peft
0.17.1), which the planner's defaults stand for. The planned figure is for the GPU's dispatch path
and for the CPU's the run took (Kernels cpu: dropout's noise in the input's dtype). Left out of the
engine's figure: what transformers' SDPA path builds for its causal mask (every step's: the earlier
ones' frees are the profiler's blind spot) and SDPA's CPU kernel's aten::where; flash attention 2,
the row's, builds neither.

Also printed: the non-persistent parameters gathered at each block's down_proj backward. From
0.19.3 (deepspeedai/DeepSpeed a31eb3165, "Z3: Support for activation ckpt with frozen params") a
frozen parameter fetched in a checkpoint's recompute is attributed to the last module whose
backward is active (partitioned_param_coordinator.py fetch_sub_module: update_recompute_parameters)
and released with that module's backward (release_sub_module). Under torch's non-reentrant
checkpoint the recompute runs inside a block module's backward; under the reentrant one it runs in
CheckpointFunction.backward, outside any block module's, and the owner is an outer module: each
recomputed block's frozen weights then stay gathered to the end of the backward, as the planner's
coordinator replay holds them (deepspeed_coordinator.holds_recomputed_frozen; the PEFT rows ran
DeepSpeed 0.13.3 and 0.14.0, which have no such attribution). Measured here with --bf16-base: 1.89, 3.43, 5.10 and 6.77 MB gathered at
blocks 3 to 0 (one block's weights, 1.67 MB, more at each), against 0.09 to 0.25 MB with
--non-reentrant; with the 4-bit base the packed model (1.7 MB) is within the scaled
stage3_max_reuse_distance, so the reuse scan keeps it gathered either way, and with
stage3_max_live_parameters and stage3_max_reuse_distance at a quarter (1e9 / 4,096) the blocks
still hold 0.45, 0.85, 1.26 and 1.67 MB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from deepspeed_zero3_lora_step import (  # noqa: E402
    FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, MICRO_BATCH, STAGE3, VOCAB, start_rank, zero3_config,
)

SEQ, STEPS = 512, 3
LEFT_OUT_OPS = ("aten::le", "aten::eq", "aten::bitwise_and", "aten::where")


def _rank(rank: int, world: int, options: argparse.Namespace, checkpoint: str, out: str) -> None:
    start_rank(rank, world, options)
    import torch
    import torch.distributed as dist

    from zeroplan.harness.allocator_trace import STEP_RANGE_PREFIX, AllocatorTrace, _replay

    with AllocatorTrace() as trace:
        import deepspeed
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo")
        config = zero3_config(world)
        ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (transformers reads it through a weakref)
        # PEFT's examples/sft/train.py with --use_4bit_quantization, --use_nested_quant and
        # --bnb_4bit_quant_storage_dtype bfloat16, the model loaded in that dtype.
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=None if options.bf16_base else quantization,
                                                     dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config.use_cache = False
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        model.gradient_checkpointing_enable({"use_reentrant": not options.non_reentrant})
        model.enable_input_require_grads()
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        counted = {name.split("layers.0.")[1]: (p.ds_numel, bool(p.ds_persist), type(p).__name__)
                   for name, p in model.named_parameters() if "layers.0." in name and "base_layer" in name}
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        gathered: list[tuple[str, int]] = []

        def note(tag: str) -> None:
            gathered.append((tag, sum(p.numel() * p.element_size() for p in model.parameters()
                                      if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE and not p.ds_persist)))

        for name, module in model.named_modules():
            if name.endswith("mlp.down_proj.base_layer"):
                block = name.split("layers.")[1].split(".")[0]
                module.register_full_backward_pre_hook(lambda m, g, block=block: note(block))
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
        for step in range(STEPS):
            gathered.clear()
            with trace.step(step):
                engine.backward(engine(input_ids=tokens, labels=tokens).loss)
                engine.step()
    if rank == 0:
        events = trace.events()
        best, live = -1, []
        for _, (alive, total) in zip(events, _replay(events)):
            if total > best:
                best, live = total, [(a.size_bytes, a.operator) for a in alive.values()]
        starts = sorted(e.start_time_ns for e in trace._profile.profiler.kineto_results.experimental_event_tree()
                        if e.name.startswith(STEP_RANGE_PREFIX))
        assert starts
        Path(out).write_text(json.dumps({
            "deepspeed": deepspeed.__version__, "counted": counted, "peak": best, "gathered": gathered,
            "left_out": sum(size for size, op in live if op in LEFT_OUT_OPS),
            "step_peaks": {k: v.peak_bytes for k, v in trace.peaks().items()}}))
    dist.destroy_process_group()


def planned_bytes(path: Path, kernels: str) -> int:
    """The planner's allocated peak for the run's request (zero3, --framework hf, 2 ranks, the run's
    stage-3 settings), on a GPU's dispatch path or the CPU's."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import memory_breakdown
    from zeroplan.specs.strategy import StrategyKind
    from zeroplan.specs.training import Kernels

    # SDPA's CPU kernel saves what flash attention 2 saves (deepspeed_zero3_lora_step.planned_bytes).
    flags = (f"--gpus 2 --gpu a100-40gb --micro-batch {MICRO_BATCH} --seq-len {SEQ} --precision bf16-mixed --framework hf "
             "--lora-rank 8 --quantize nf4 --double-quant --lora-targets q,k,v,o,gate,up,down --lora-alpha 16 "
             "--lora-dropout 0.1 --activation-checkpointing full --attention flash").split()
    request = request_from_args(build_parser().parse_args(["fit", str(path), *flags]), StrategyKind.zero3)
    strategy = request.strategy.model_copy(update={
        "zero_bucket_elements": STAGE3["reduce_bucket_size"],
        "deepspeed_prefetch_bucket_elements": STAGE3["stage3_prefetch_bucket_size"],
        "deepspeed_max_live_parameters": STAGE3["stage3_max_live_parameters"],
        "deepspeed_max_reuse_distance": STAGE3["stage3_max_reuse_distance"],
        "deepspeed_param_persistence_threshold": STAGE3["stage3_param_persistence_threshold"]})
    request = request.model_copy(update={"strategy": strategy,
                                         "training": request.training.model_copy(update={"kernels": Kernels(kernels)})})
    return memory_breakdown(request)[0].allocated_peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--non-reentrant", action="store_true", help="torch's non-reentrant checkpoint (the Trainer's "
                        "gradient_checkpointing_kwargs use_reentrant False) instead of transformers' default reentrant one")
    parser.add_argument("--bf16-base", action="store_true", help="LoRA on a bf16 base (no quantization; zero.Init then "
                        "partitions it as transformers loads it), for comparison")
    parser.add_argument("--port", type=int, default=29581)
    options = parser.parse_args()
    options.early_2024_recompute = False  # start_rank's option: torch's recompute as installed
    import torch
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    checkpoint = tempfile.mkdtemp()
    model_config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(model_config).to(torch.bfloat16).save_pretrained(checkpoint)
    out = str(Path(tempfile.mkdtemp()) / "result.json")
    mp.spawn(_rank, args=(2, options, checkpoint, out), nprocs=2)
    result = json.loads(Path(out).read_text())
    path = Path(checkpoint) / "config.json"
    mb = 1e6
    base = "LoRA on a bf16 base" if options.bf16_base else "QLoRA (nf4, double quantization, bf16 storage)"
    print(f"DeepSpeed {result['deepspeed']}, {base}, {'non-' if options.non_reentrant else ''}reentrant checkpointing; "
          f"micro-batch {MICRO_BATCH} x seq {SEQ}; stage3_param_persistence_threshold "
          f"{STAGE3['stage3_param_persistence_threshold']:,}")
    for name, (numel, persist, kind) in sorted(result["counted"].items()):
        print(f"  block 0 {name}: {kind}, ds_numel {numel:,}{', persistent' if persist else ''}")
    for step, peak in sorted(result["step_peaks"].items(), key=lambda kv: int(kv[0])):
        print(f"  step {step}: peak of live CPU bytes {peak / mb:.2f} MB")
    print(f"  at the run's peak {result['peak'] / mb:.2f} MB, {result['left_out'] / mb:.2f} of them the SDPA path's masks and "
          f"where: {(result['peak'] - result['left_out']) / mb:.2f} MB")
    print("  gathered non-persistent parameters at each block's down_proj backward, step 2: "
          + ", ".join(f"block {block} {size / mb:.2f} MB" for block, size in result["gathered"]))
    if not (options.bf16_base or options.non_reentrant):
        print(f"  planned allocated peak (zeroplan, same request): {planned_bytes(path, 'cuda') / mb:.2f} MB; on the CPU's "
              f"dispatch path the run took: {planned_bytes(path, 'cpu') / mb:.2f} MB")


if __name__ == "__main__":
    main()
