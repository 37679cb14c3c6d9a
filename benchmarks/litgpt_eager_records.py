"""Measure what litgpt's own GPT keeps for backward per block in eager mode, and write the records.

litgpt's finetune scripts (00af8b0 finetune/full.py, lora.py) and lightning-thunder 3770bf0
benchmark_litgpt.py without --compile run litgpt's GPT eagerly. Here litgpt's GPT (litgpt/config.py
and litgpt/model.py of a checkout at 9a1b82b, loaded as benchmarks/litgpt_compiled_records.py
loads them, without litgpt/__init__.py, which imports lightning) is built at the model's full
width on fake tensors with 1 and 2 layers, cast to bf16 (bf16-true: Fabric's HalfPrecision and
benchmark_litgpt.py's model.to(torch.bfloat16) both cast the module), and every tensor autograd
saves is recorded with saved-tensor hooks, by storage (a saved view keeps its base whole; the
parameters, buffers and token ids are not activations). The per-layer figure is the difference
between the depths; each saved tensor of the one-layer model is listed with the autograd node
that saved it. Fake tensors take the CPU's kernels: native_layer_norm's mean and rstd in the
input's dtype (CUDA keeps them in fp32) and the CPU flash kernel, whose output takes the query's
layout as CUDA's flash kernel does.

Usage, with a checkout of litgpt at 9a1b82b:

    python benchmarks/litgpt_eager_records.py LITGPT_CHECKOUT [OUT_DIR]

A few seconds a model on 2 cores.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import torch

from litgpt_compiled_records import load_litgpt, saved_tensor_listing
from zeroplan.atomic import write_text_atomic
from zeroplan.simulate import _torch_private as private

DEFAULT_OUT = Path(__file__).resolve().parent / "eager-litgpt-records"
# (litgpt config name, sequence length, micro-batch): the GPT-NeoX block of the published
# stablecode and StableLM rows (litgpt config.py defaults: LayerNorm, parallel_residual without
# shared_attention_norm, biases, GptNeoxMLP, rotary_percentage 0.25), Pythia's, and for contrast
# Phi-2 (one shared norm), Llama-2-7B (RMSNorm, MHA) and Llama-3-8B (grouped K/V heads).
RUNS = [
    ("stablecode-completion-alpha-3b", 2048, 1), ("stablecode-completion-alpha-3b", 4096, 1),
    ("stablelm-base-alpha-3b", 512, 1), ("pythia-1.4b", 2048, 1),
    ("phi-2", 512, 1), ("Llama-2-7b-hf", 1024, 1), ("Llama-3-8B", 1024, 1),
]


def saved_storages(litgpt_model: types.ModuleType, name: str, seq_len: int, micro_batch: int,
                   n_layer: int) -> tuple[int, list[dict]]:
    """Bytes of the storages autograd saves in litgpt's GPT of ``n_layer`` layers, and each saved
    tensor with the node that saved it."""
    config = litgpt_model.Config.from_name(name, n_layer=n_layer, block_size=seq_len)
    with torch.device("meta"):
        model = litgpt_model.GPT(config)
    model.to(dtype=torch.bfloat16)
    packed: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed[private.storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with private.fake_tensor_mode():
        model.to_empty(device="cpu")
        # The rope cache is made at construction on the meta device: rebuilt as GPT.reset_parameters does.
        model.cos, model.sin = (t.to(torch.bfloat16) for t in model.rope_cache(device=torch.device("cpu")))
        idx = torch.randint(0, config.padded_vocab_size, (micro_batch, seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = model(idx)
        not_own = {private.storage_key(t) for t in (*model.parameters(), *model.buffers(), idx)}
        listing = saved_tensor_listing(logits, not_own)
    return sum(n for key, n in packed.items() if key not in not_own), listing


def measure(litgpt_model: types.ModuleType, name: str, seq_len: int, micro_batch: int) -> dict:
    start_s = time.perf_counter()
    one, listing = saved_storages(litgpt_model, name, seq_len, micro_batch, 1)
    two, _ = saved_storages(litgpt_model, name, seq_len, micro_batch, 2)
    config = litgpt_model.Config.from_name(name)
    return {
        "source": "litgpt GPT eager, bf16 module, fake tensors (CPU kernels), saved-tensor hooks by storage",
        "litgpt_commit": "9a1b82b", "torch_version": torch.__version__,
        "model": name, "seq_len": seq_len, "micro_batch_size": micro_batch,
        "n_embd": config.n_embd, "n_head": config.n_head, "n_query_groups": config.n_query_groups,
        "head_size": config.head_size, "rope_n_elem": config.rope_n_elem, "intermediate_size": config.intermediate_size,
        "norm_class_name": config.norm_class_name, "parallel_residual": config.parallel_residual,
        "shared_attention_norm": config.shared_attention_norm, "mlp_class_name": config.mlp_class_name,
        "saved_bytes": [one, two], "per_layer_bytes": two - one, "rest_bytes": 2 * one - two,
        "one_layer_saved": listing, "wall_time_s": round(time.perf_counter() - start_s, 1),
    }


def main(checkout: Path, out: Path = DEFAULT_OUT) -> None:
    litgpt_model = load_litgpt(checkout)
    out.mkdir(parents=True, exist_ok=True)
    for name, seq_len, micro_batch in RUNS:
        record = measure(litgpt_model, name, seq_len, micro_batch)
        write_text_atomic(out / f"litgpt_{name}_eager_s{seq_len}_b{micro_batch}.json", json.dumps(record, indent=1) + "\n")
        print(f"{name} s {seq_len} b {micro_batch}: {record['per_layer_bytes']:,} bytes a layer, "
              f"rest {record['rest_bytes']:,}  ({record['wall_time_s']} s)")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT)
