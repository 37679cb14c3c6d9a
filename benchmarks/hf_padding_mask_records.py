"""Measure what transformers' own LlamaModel saves for backward with and without padding in the
batch, and write the records zeroplan.core.hf_padding_mask is checked against
(tests/test_hf_padding_mask.py):

    python benchmarks/hf_padding_mask_records.py [OUT_FILE]
        (default benchmarks/hf-padding-mask-records/records.json)

Saved-tensor hooks on a bf16 LlamaModel (transformers, torch on the CPU), SDPA and eager
attention, multi-head, grouped and multi-query K/V, one and two blocks, at s 80 and 72; one
sample of the padded batch ends in 20 padding tokens. Every storage autograd keeps except the
parameters is summed once. The mask decision and repeat_kv are Python (the same on CUDA); on
CUDA the masked call runs the memory-efficient kernel, which saves the same K, V and mask (docs/
memory-model.md, "Padded batches under SDPA"). About 10 seconds on 2 cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "hf-padding-mask-records" / "records.json"
# (heads, kv_heads, head_dim, layers, seq_len, attention); the last is Llama-3.2-3B's attention
# shape (24 heads, 8 K/V heads, width 128) in one block with a narrow MLP.
CASES = [(4, kv, 48, layers, s, attention) for attention in ("sdpa", "eager") for kv in (4, 2, 1)
         for layers in (1, 2) for s in (80, 72)] + [(24, 8, 128, 1, 64, "sdpa")]
BATCH, PAD_TOKENS, FFN, VOCAB = 2, 20, 256, 64


def saved_bytes(heads: int, kv_heads: int, head_dim: int, layers: int, s: int, attention: str, padded: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters left out."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=FFN, num_hidden_layers=layers, vocab_size=VOCAB, attention_dropout=0.0,
                         use_cache=False)
    config._attn_implementation = attention
    model = LlamaModel(config).to(torch.bfloat16).train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, VOCAB, (BATCH, s))
    mask = torch.ones(BATCH, s, dtype=torch.long)
    if padded:
        mask[1, s - PAD_TOKENS:] = 0
    storages: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, attention_mask=mask)
    return sum(storages.values())


def measure() -> list[dict]:
    import torch
    import transformers

    records = []
    for heads, kv_heads, head_dim, layers, s, attention in CASES:
        args = (heads, kv_heads, head_dim, layers, s, attention)
        records.append({
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers, "micro_batch": BATCH,
            "seq_len": s, "attention": attention, "compute_bytes": 2,
            "unpadded_saved_bytes": saved_bytes(*args, padded=False), "padded_saved_bytes": saved_bytes(*args, padded=True),
            "torch": torch.__version__, "transformers": transformers.__version__,
        })
    return records


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    records = measure()
    out.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(f"{r['attention']:5} heads {r['heads']:2} kv {r['kv_heads']:2} layers {r['layers']} s {r['seq_len']}: "
              f"padding adds {r['padded_saved_bytes'] - r['unpadded_saved_bytes']:,} saved bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
