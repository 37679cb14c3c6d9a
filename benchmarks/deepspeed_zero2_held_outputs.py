"""The loop of the DeepSpeed Muon blog's demo (delock/deepspeed_finetune_demo finetune_llama.py
at 18f3df1: `outputs = model_engine(**batch); loss = outputs.loss; model_engine.backward(loss);
model_engine.step()`, the output object bound until the next batch rebinds it) run on DeepSpeed
0.19.8's own ZeRO-2 engine over transformers 4.56.2's own Qwen2ForCausalLM, on gloo (2 CPU
ranks), against the same loop that drops the output object before the backward; each beside
the planner's allocated peak for the same request without and with --keep-outputs
(zeroplan.core.kv_cache.kept_outputs_bytes). The published rows are
ds-blog-muon-qwen2.5-3b-adamw-zero2 and -muon-zero2.

The model is a small Qwen2 of the blog model's kind (tied embedding, q/k/v biases, grouped KV
heads, SwiGLU, RMSNorm) whose vocabulary is 74 times its width, as Qwen2.5-3B's 151,936 over
2,048 is, built in bf16 (from_pretrained's torch_dtype in the demo) with transformers' default
checkpointing (gradient_checkpointing_enable()) and use_cache False; eager attention (no
flash-attn on the CPU); the demo's DeepSpeed config (bf16, stage 2, AdamW, gradient clipping
1.0) with its buckets scaled to the model (reduce and allgather 1e5 elements, given to the
planner too). Every sample has the length of the batch (the demo pads to max_length), the
first half of its labels -100 (the instruction the demo masks).

Live bytes come from the profiler's allocator events (zeroplan.harness.allocator_trace), from
before the model is built; the peak is taken over the training steps (forward, backward, step).
Usage:

    python benchmarks/deepspeed_zero2_held_outputs.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers

WORLD = 2
MICRO_BATCH, SEQ = 4, 64
STEPS = 3
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 344,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4736,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "use_cache": False,
}
DEEPSPEED = {
    "train_batch_size": MICRO_BATCH * WORLD, "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1, "steps_per_print": 2**31 - 1, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 100000, "allgather_bucket_size": 100000},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
}
PHASES = ("zeroplan::forward", "zeroplan::backward", "zeroplan::optimizer_step")


def _rank(rank: int, port: int, hold: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    from zeroplan.harness.allocator_trace import AllocatorTrace

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    with AllocatorTrace() as trace:
        import deepspeed
        from transformers import AutoModelForCausalLM, Qwen2Config

        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), torch_dtype=torch.bfloat16,
                                                 attn_implementation="eager")
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DEEPSPEED,
                                               dist_init_required=False)
        generator = torch.Generator().manual_seed(rank)
        for step in range(STEPS):
            ids = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ), generator=generator)
            labels = ids.clone()
            labels[:, : SEQ // 2] = -100
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
            with trace.step(step):
                with record_function(PHASES[0]):
                    outputs = engine(**batch)
                    loss = outputs.loss
                    if not hold:
                        del outputs
                with record_function(PHASES[1]):
                    engine.backward(loss)
                with record_function(PHASES[2]):
                    engine.step()
    if rank == 0:
        Path(out).write_text(json.dumps({"deepspeed": deepspeed.__version__,
                                         "peaks": {step: peak.peak_bytes for step, peak in trace.peaks().items()}}))
    dist.destroy_process_group()


def planned(keep_outputs: bool) -> int:
    """The planner's allocated peak for the same request."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import pipeline_rank_breakdowns
    from zeroplan.specs.strategy import StrategyKind

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "deepspeed.json").write_text(json.dumps(DEEPSPEED))
    argv = ["fit", str(folder / "config.json"), "--gpus", str(WORLD), "--gpus-per-node", str(WORLD), "--gpu", "a100-40gb",
            "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ), "--activation-checkpointing", "full",
            "--precision", "bf16-mixed", "--framework", "hf", "--attention", "eager",
            "--deepspeed-config", str(folder / "deepspeed.json")] + (["--keep-outputs"] if keep_outputs else [])
    request = request_from_args(build_parser().parse_args(argv), StrategyKind.zero2)
    return max(breakdown.allocated_peak_bytes for breakdown, _ in pipeline_rank_breakdowns(request))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-run":
        import torch.multiprocessing as mp

        hold, out = sys.argv[2] == "hold", sys.argv[3]
        port = free_local_port()
        mp.spawn(_rank, args=(port, hold, out), nprocs=WORLD)
        remove_deepspeed_shm_buffers(port)
        return
    print(f"{WORLD} gloo ranks, Qwen2 hidden {CONFIG['hidden_size']}, vocabulary {CONFIG['vocab_size']}, "
          f"{CONFIG['num_hidden_layers']} blocks, micro-batch {MICRO_BATCH} x {SEQ}; allocated peak in bytes")
    for hold in (False, True):
        out = str(Path(tempfile.mkdtemp()) / "result.json")
        subprocess.run([sys.executable, __file__, "--rank-run", "hold" if hold else "drop", out], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.loads(Path(out).read_text())
        measured = max(result["peaks"].values())
        predicted = planned(hold)
        print(f"  outputs {'held through backward and step' if hold else 'dropped before backward':32s} "
              f"DeepSpeed {result['deepspeed']}: {measured:>11,d}  planned{' --keep-outputs' if hold else '':15s} "
              f"{predicted:>11,d}  ({100 * (predicted - measured) / measured:+.1f} %)  per step {sorted(result['peaks'].items())}")


if __name__ == "__main__":
    main()
