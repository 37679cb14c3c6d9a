"""Measure what litgpt's own LoRA GPT keeps for backward per block in eager mode, and write the records.

litgpt's finetune/lora.py builds litgpt/lora.py's GPT (its Config carries lora_r, lora_alpha,
lora_dropout and the lora_query/key/value/projection/mlp/head switches), marks only the adapters
trainable (mark_only_lora_as_trainable) and runs it eagerly in bf16-true. Here litgpt/config.py,
model.py and lora.py of a checkout at 9a1b82b are loaded without litgpt/__init__.py (which imports
lightning), the model is built at the model's full width on fake tensors with 1 and 2 layers,
cast to bf16 and put in training mode (the adapters' dropout runs), and every tensor autograd
saves is recorded by storage with saved-tensor hooks, as benchmarks/litgpt_eager_records.py does
for the full fine-tune (parameters, buffers and token ids are not activations). The per-layer
figure is the difference between the depths (the first block reads the frozen embedding, which
needs no gradient), and the full fine-tune's the same model's with lora_r 0, every parameter
trained; each saved tensor of the two-layer model's second block is listed with the
autograd node that saved it. Fake tensors take the CPU's kernels: the CPU's dropout multiplies by
a noise tensor in the input's dtype and keeps it (CUDA's fused native_dropout keeps a bool mask),
and native_layer_norm's mean and rstd are in the input's dtype.

The runs are the published litgpt LoRA rows' settings (config_hub/finetune at 00af8b0):
phi-2/lora.yaml (r 8, alpha 16, dropout 0.05, every switch on, micro-batch 4, 512 tokens) and
llama-3.2-1B/lora.yaml (r 32, alpha 16, dropout 0.05, query and value only, micro-batch 1, 512
tokens) on Llama 3.2 1B's widths (9a1b82b's config.py has no Llama 3.2 entry: its Llama-3-8B
entry with the 1B's n_embd, heads, groups, head size and MLP width), gemma-2b/lora.yaml (r 8,
alpha 16, dropout 0.1, every switch on, micro-batch 2, 512 tokens), and for contrast Phi-2 with
query and value only and no dropout.

Usage, with a checkout of litgpt at 9a1b82b:

    python benchmarks/litgpt_lora_records.py LITGPT_CHECKOUT [OUT_DIR [RECORD]]
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

from litgpt_compiled_records import load_litgpt, saved_tensor_listing
from zeroplan.atomic import write_text_atomic
from zeroplan.simulate import _torch_private as private

DEFAULT_OUT = Path(__file__).resolve().parent / "lora-litgpt-records"
LLAMA_32_1B = dict(n_embd=2048, n_head=32, n_query_groups=8, head_size=64, intermediate_size=8192)
# (record name, litgpt config name, overrides, LoRA settings, sequence length, micro-batch)
RUNS = [
    ("phi-2", "phi-2", {}, dict(lora_r=8, lora_alpha=16, lora_dropout=0.05, lora_query=True, lora_key=True,
                                lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True), 512, 4),
    ("llama-3.2-1b", "Llama-3-8B", LLAMA_32_1B,
     dict(lora_r=32, lora_alpha=16, lora_dropout=0.05, lora_query=True, lora_value=True), 512, 1),
    # gemma-2b/lora.yaml (r 8, alpha 16, dropout 0.1, every switch on, micro-batch 2, 512 tokens).
    ("gemma-2b", "gemma-2b", {}, dict(lora_r=8, lora_alpha=16, lora_dropout=0.1, lora_query=True, lora_key=True,
                                      lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True), 512, 2),
    # gemma2-2b/lora.yaml (r 8, alpha 16, dropout 0.1, every switch on, micro-batch 2, 512 tokens):
    # Gemma 2's block (four norms, attention logit soft-capping in an eager attention, model.py
    # 298-315) and the final logit soft-cap (model.py 101-102).
    ("gemma-2-2b", "Gemma-2-2b", {}, dict(lora_r=8, lora_alpha=16, lora_dropout=0.1, lora_query=True, lora_key=True,
                                          lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True), 512, 2),
    # For contrast: Phi-2 with query and value only and no dropout (the shared norm's output kept
    # once, by lora_A, and the scattered lora_B output).
    ("phi-2-qv-nodropout", "phi-2", {}, dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_query=True,
                                             lora_value=True), 512, 4),
]


# litgpt 9a1b82b utils.py:342-348, which lora.py imports (only its state-dict loading calls it).
def map_old_state_dict_weights(state_dict: dict, mapping: dict, prefix: str) -> dict:
    for checkpoint_name, attribute_name in mapping.items():
        full_checkpoint_name = prefix + checkpoint_name
        if full_checkpoint_name in state_dict:
            state_dict[prefix + attribute_name] = state_dict.pop(full_checkpoint_name)
    return state_dict


def load_lora(checkout: Path) -> types.ModuleType:
    """litgpt.lora from ``checkout`` (after load_litgpt has put litgpt.config and litgpt.model in place)."""
    load_litgpt(checkout)
    sys.modules["litgpt.utils"].map_old_state_dict_weights = map_old_state_dict_weights
    spec = importlib.util.spec_from_file_location("litgpt.lora", checkout / "litgpt" / "lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["litgpt.lora"] = module
    spec.loader.exec_module(module)
    sys.modules["litgpt"].lora = module
    return module


def saved_storages(lora: types.ModuleType, name: str, overrides: dict, settings: dict, seq_len: int,
                   micro_batch: int, n_layer: int) -> tuple[int, list[dict]]:
    """Bytes of the storages autograd saves in litgpt's LoRA GPT of ``n_layer`` layers, and each
    saved tensor of its last block with the node that saved it."""
    config = lora.Config.from_name(name, n_layer=n_layer, block_size=seq_len, **overrides, **settings)
    with torch.device("meta"):
        model = lora.GPT(config)
    if config.lora_r > 0:
        lora.mark_only_lora_as_trainable(model)
    model.to(dtype=torch.bfloat16)
    model.train()
    packed: dict[int, int] = {}
    last_block: set[int] = set()
    in_last = [False]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed[private.storage_key(tensor)] = tensor.untyped_storage().nbytes()
        if in_last[0]:
            last_block.add(private.storage_key(tensor))
        return tensor

    block = model.transformer.h[-1]
    block.register_forward_pre_hook(lambda *_: in_last.__setitem__(0, True))
    block.register_forward_hook(lambda *_: in_last.__setitem__(0, False))
    with private.fake_tensor_mode():
        model.to_empty(device="cpu")
        model.cos, model.sin = (t.to(torch.bfloat16) for t in model.rope_cache(device=torch.device("cpu")))
        idx = torch.randint(0, config.padded_vocab_size, (micro_batch, seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = model(idx)
        not_own = {private.storage_key(t) for t in (*model.parameters(), *model.buffers(), idx)}
        listing = saved_tensor_listing(logits, not_own, last_block.__contains__)
    listing.sort(key=lambda row: (row["storage"], row["node"], row["saved"]))
    return sum(n for key, n in packed.items() if key not in not_own), listing


def measure(lora: types.ModuleType, record: str, name: str, overrides: dict, settings: dict, seq_len: int,
            micro_batch: int) -> dict:
    start_s = time.perf_counter()
    one, _ = saved_storages(lora, name, overrides, settings, seq_len, micro_batch, 1)
    two, listing = saved_storages(lora, name, overrides, settings, seq_len, micro_batch, 2)
    # The same model with lora_r 0 and every parameter trained: the full fine-tune's block.
    full = [saved_storages(lora, name, overrides, {}, seq_len, micro_batch, n)[0] for n in (1, 2)]
    config = lora.Config.from_name(name, **overrides)
    return {
        "source": "litgpt lora.py GPT eager, bf16 module, adapters trainable, training mode, fake tensors "
                  "(CPU kernels), saved-tensor hooks by storage",
        "litgpt_commit": "9a1b82b", "torch_version": torch.__version__,
        "model": record, "litgpt_config": name, "overrides": overrides, "lora": settings,
        "seq_len": seq_len, "micro_batch_size": micro_batch,
        "n_embd": config.n_embd, "n_head": config.n_head, "n_query_groups": config.n_query_groups,
        "head_size": config.head_size, "intermediate_size": config.intermediate_size,
        "saved_bytes": [one, two], "per_layer_bytes": two - one, "rest_bytes": 2 * one - two,
        "full_saved_bytes": full, "full_per_layer_bytes": full[1] - full[0],
        "second_block_saved": listing,
        "second_block_storage_bytes": sum({r["storage"]: r["storage_bytes"] for r in listing}.values()),
        "wall_time_s": round(time.perf_counter() - start_s, 1),
    }


def main(checkout: Path, out: Path = DEFAULT_OUT, only: str | None = None) -> None:
    lora = load_lora(checkout)
    out.mkdir(parents=True, exist_ok=True)
    for record, name, overrides, settings, seq_len, micro_batch in RUNS:
        if only is not None and record != only:
            continue
        result = measure(lora, record, name, overrides, settings, seq_len, micro_batch)
        write_text_atomic(out / f"litgpt_{record}_lora_s{seq_len}_b{micro_batch}.json", json.dumps(result, indent=1) + "\n")
        print(f"{record} s {seq_len} b {micro_batch}: {result['per_layer_bytes']:,} bytes a layer "
              f"(full fine-tune {result['full_per_layer_bytes']:,}), "
              f"rest {result['rest_bytes']:,}  ({result['wall_time_s']} s)")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT,
         sys.argv[3] if len(sys.argv) > 3 else None)
