"""What one more sample adds to transformers 4.38's Llama step on the CPU, against the planner.

transformers 4.38.x builds the attention mask of every forward from a P x P boolean buffer
(P = max_position_embeddings; models/llama/modeling_llama.py:931-934 ``register_buffer("causal_mask",
torch.triu(...))``): ``_update_causal_mask`` (:1057-1095) returns, for SDPA and eager attention
(flash_attention_2 returns None, :1058-1061), ``self.causal_mask[None, None, :, :].repeat(batch_size,
1, 1, 1).to(dtype) * min_dtype`` (:1074), a b x 1 x P x P tensor in the embeddings' dtype, whatever
the sequence length, and LlamaModel.forward passes it to every decoder layer (:993, :1008-1016), so
under gradient checkpointing each layer's checkpoint holds it to that layer's backward. GemmaModel
4.38 the same (models/gemma/modeling_gemma.py:825, :969); 4.38's Mistral builds its mask with
``_prepare_4d_causal_attention_mask_for_sdpa`` instead (models/mistral/modeling_mistral.py:1004),
and 4.39 an s x s one. fsdp_qlora's benchmark rows ran 4.38.2 (benchmarks/published_memory/rows.csv,
``--transformers-version 4.38.2``) with ``attention_mask=None`` (its train.py:872-876 at 05ed9f2).

This runs the release's own LlamaForCausalLM (a narrow two-layer model of Llama-2's vocabulary and
positions, bf16, frozen with input gradients as PEFT enables them, non-reentrant checkpointing, the
output held through backward as fsdp_qlora's loop holds it) at micro-batch 1, 2 and 3, reads each
step's peak of live CPU tensor bytes from the allocator's own events
(zeroplan.harness.allocator_trace), and prints the growth per sample beside the planner's for the
same shapes (``zeroplan fit`` flags as the rows pass them, a rank-1 adapter on q standing for the
frozen model). transformers 4.38.2 must be importable (it is not the project's release): e.g.
``pip download --no-deps transformers==4.38.2`` and the wheel unpacked on PYTHONPATH (its runtime
check of the tokenizers release then needs relaxing; nothing here tokenizes). Usage:

    PYTHONPATH=<unpacked 4.38.2>:. python benchmarks/transformers438_causal_mask.py [SEQ [POSITIONS]]
    PYTHONPATH=<unpacked 4.38.2>:. python benchmarks/transformers438_causal_mask.py --record [OUT_FILE]

``--record`` measures the shapes RECORDED_SHAPES, whether the mask is alive after the forward
and after backward under each attention implementation and checkpoint (a weak reference to what
_update_causal_mask returned) and what each layer saves of the mask's shape without checkpointing
(saved-tensor hooks: under SDPA the b x 1 x s x s index copy LlamaSdpaAttention passes as
attn_mask, modeling_llama.py:660-662), and writes them to OUT_FILE (default
benchmarks/transformers438-causal-mask-records.json), which tests/test_transformers438_causal_mask.py
reads.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (ROOT, ROOT / "benchmarks"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from published_memory_accuracy import fit_parser  # noqa: E402

from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.core.plan import pipeline_rank_breakdowns  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

MIB = 2**20
HIDDEN, FFN, LAYERS, HEADS, VOCAB = 256, 688, 2, 4, 32000
BATCHES = (1, 2, 3)
RECORDED_SHAPES = ((512, 4096), (512, 2048), (256, 4096))
"""(sequence length, max_position_embeddings) of the record."""
DEFAULT_OUT = ROOT / "benchmarks" / "transformers438-causal-mask-records.json"


def measured_peaks(seq: int, positions: int) -> dict[int, int]:
    """Each micro-batch's peak of live CPU bytes in its second step, under transformers' own code."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroplan.harness.allocator_trace import AllocatorTrace

    if transformers.__version__ != "4.38.2":
        raise SystemExit(f"transformers 4.38.2 must be importable (found {transformers.__version__})")
    peaks = {}
    for b in BATCHES:
        torch.manual_seed(0)
        with AllocatorTrace() as trace:
            config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                                 max_position_embeddings=positions, use_cache=False)
            config._attn_implementation = "sdpa"
            model = LlamaForCausalLM(config).to(torch.bfloat16)
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            model.enable_input_require_grads()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            ids = torch.randint(0, VOCAB, (b, seq))
            for step in range(2):
                with trace.step(step):
                    output = model(ids, labels=ids, attention_mask=None)
                    output.loss.backward()
                    output = None
        peaks[b] = trace.peaks()[1].peak_bytes
    return peaks


def planned_peaks(seq: int, positions: int) -> dict[int, int]:
    """The planner's allocated peak for the same shapes and flags."""
    config = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "vocab_size": VOCAB,
              "max_position_embeddings": positions, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    peaks = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        for b in BATCHES:
            argv = ["fit", str(path), "--gpus", "1", "--gpu", "a100-80gb", "--micro-batch", str(b), "--seq-len", str(seq),
                    "--activation-checkpointing", "full", "--precision", "bf16-pure", "--framework", "hf",
                    "--lora-rank", "1", "--lora-targets", "q", "--transformers-version", "4.38.2", "--keep-outputs",
                    "--no-checkpoint-reentrant"]
            request = request_from_args(fit_parser().parse_args(argv), StrategyKind.ddp)
            breakdown, _ = max(pipeline_rank_breakdowns(request), key=lambda rank: rank[0].peak_bytes)
            peaks[b] = breakdown.allocated_peak_bytes
    return peaks


def _frozen_llama(implementation: str, **shape: int):
    """transformers' own two-layer Llama (bf16, every weight frozen, the embedding's output
    requiring its gradient as peft's enable_input_require_grads makes it), seeded, under the
    attention implementation asked."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=shape["num_attention_heads"], vocab_size=64,
                         use_cache=False, **shape)
    config._attn_implementation = implementation
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.enable_input_require_grads()
    return model


def mask_lifetimes() -> list[dict[str, object]]:
    """Whether the mask _update_causal_mask returned is alive after the forward (the output held)
    and after backward, under each attention implementation and checkpoint, at b 2, 8 tokens, P 16."""
    import gc
    import weakref

    import torch

    rows = []
    for implementation in ("sdpa", "eager"):
        for checkpoint in ("none", "non-reentrant", "reentrant"):
            model = _frozen_llama(implementation, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                  max_position_embeddings=16)
            if checkpoint != "none":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
            model.train()
            built = {}
            update = model.model._update_causal_mask

            def kept(*args, update=update, built=built, **kwargs):
                mask = update(*args, **kwargs)
                built["mask"] = weakref.ref(mask)
                built["shape"], built["dtype"] = list(mask.shape), str(mask.dtype)
                return mask

            model.model._update_causal_mask = kept
            ids = torch.randint(0, 64, (2, 8))
            output = model(ids, labels=ids, attention_mask=None)
            gc.collect()
            after_forward = built["mask"]() is not None
            output.loss.backward()
            gc.collect()
            rows.append({"attention": implementation, "checkpoint": checkpoint, "mask_shape": built["shape"],
                         "mask_dtype": built["dtype"], "alive_after_forward": after_forward,
                         "alive_after_backward": built["mask"]() is not None})
    return rows


def saved_layer_masks() -> list[dict[str, object]]:
    """What autograd saves of mask shape (b x 1 x s x s) in a forward without checkpointing, under
    each attention implementation, at b 2, 32 tokens, P 64, two layers: the tensors and their
    distinct storages' bytes (saved-tensor hooks)."""
    import torch

    rows = []
    for implementation in ("sdpa", "eager"):
        model = _frozen_llama(implementation, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              max_position_embeddings=64)
        model.train()
        saved = []

        def pack(tensor, saved=saved):
            if tensor.dim() == 4 and tuple(tensor.shape) == (2, 1, 32, 32):
                saved.append((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
            return tensor

        ids = torch.randint(0, 64, (2, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, labels=ids, attention_mask=None)
        storages = dict(saved)
        rows.append({"attention": implementation, "layers": 2, "micro_batch": 2, "seq_len": 32, "max_position_embeddings": 64,
                     "saved_masks": len(saved), "distinct_storages": len(storages),
                     "distinct_storage_bytes": sum(storages.values())})
    return rows


def record(out: Path) -> int:
    import torch
    import transformers

    shapes = []
    for seq, positions in RECORDED_SHAPES:
        peaks = measured_peaks(seq, positions)
        shapes.append({"seq_len": seq, "max_position_embeddings": positions,
                       "peak_bytes_by_micro_batch": {str(b): peaks[b] for b in BATCHES}})
        print(f"seq {seq}, P {positions}: " + ", ".join(f"b {b} {peaks[b] / MIB:.2f} MiB" for b in BATCHES))
    lifetimes = mask_lifetimes()
    for row in lifetimes:
        print(row)
    layer_masks = saved_layer_masks()
    for row in layer_masks:
        print(row)
    payload = {"transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
               "model": {"hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
                         "num_attention_heads": HEADS, "vocab_size": VOCAB, "dtype": "bfloat16", "attention": "sdpa",
                         "checkpoint": "non-reentrant"},
               "shapes": shapes, "mask_lifetimes": lifetimes, "saved_layer_masks": layer_masks}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--record":
        return record(Path(args[1]) if len(args) > 1 else DEFAULT_OUT)
    seq = int(args[0]) if args else 512
    positions = int(args[1]) if len(args) > 1 else 4096
    measured, planned = measured_peaks(seq, positions), planned_peaks(seq, positions)
    print(f"seq {seq}, max_position_embeddings {positions}, vocab {VOCAB}, bf16")
    print(f"{'micro-batch':>11s} {'measured MiB':>13s} {'planned MiB':>12s}")
    for b in BATCHES:
        print(f"{b:11d} {measured[b] / MIB:13.2f} {planned[b] / MIB:12.2f}")
    for low, high in zip(BATCHES, BATCHES[1:]):
        grown, planned_grown = measured[high] - measured[low], planned[high] - planned[low]
        print(f"per sample {low}->{high}: measured {grown / MIB:.2f} MiB, planned {planned_grown / MIB:.2f} MiB,"
              f" difference {(grown - planned_grown) / MIB:.2f} MiB (the b x 1 x P x P bf16 mask: {2 * positions**2 / MIB:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
