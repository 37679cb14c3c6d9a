"""Count the bf16 copies of the frozen head that lit-gpt's LoRA forward saves under autocast.

lit-gpt 8641822 (the commit tutorials/resource-tables.md names) finetune/lora.py runs
``model(input_ids, lm_head_chunk_size=128)`` under lightning's MixedPrecision (bf16-mixed: an
fp32 module under torch.autocast). This builds lit-gpt's own LoRA GPT (lit_gpt/lora.py) at a
small width, runs that forward on the CPU under torch.autocast(bfloat16) and lists every tensor
autograd saves, by storage: each 128-token slice's head matmul saves its own bf16 copy of the
head weight (zeroplan.core.framework_loss.litgpt_autocast_head_copies). Usage, with a checkout of
lit-gpt at 8641822 and lightning 2.1 importable:

    python benchmarks/litgpt_autocast_head_copies.py LIT_GPT_CHECKOUT [TOKENS]
"""

from __future__ import annotations

import sys

import torch

VOCAB, WIDTH = 4096, 256


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    # lit_gpt/__init__.py refuses to import unless pip's metadata names lightning 2.1 with all its
    # requirements; the check is the only thing skipped (nothing of the model depends on it).
    import lightning_utilities.core.imports as imports

    answer = imports.RequirementCache.__bool__
    imports.RequirementCache.__bool__ = (  # type: ignore[method-assign]
        lambda self: str(getattr(self, "requirement", "")).startswith("lightning>=") or answer(self))
    from lit_gpt.lora import GPT, Config, mark_only_lora_as_trainable

    config = Config.from_name("stablelm-base-alpha-3b", n_layer=2, n_embd=WIDTH, n_head=4, padded_vocab_size=VOCAB,
                              vocab_size=VOCAB, r=8, alpha=16, dropout=0.05, to_query=True, to_value=True)
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    model.max_seq_length = tokens
    saved: dict[int, tuple[int, torch.dtype]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes(), tensor.dtype)
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(torch.randint(0, VOCAB, (1, tokens)), lm_head_chunk_size=128)
    head = 2 * VOCAB * WIDTH
    copies = sum(1 for nbytes, dtype in saved.values() if dtype is torch.bfloat16 and nbytes == head)
    print(f"{tokens} tokens: {len(logits)} head slices; distinct saved bf16 storages of 2 V h = {head} bytes: {copies}")
    print(f"head weight: {model.lm_head.linear.weight.dtype}, requires_grad {model.lm_head.linear.weight.requires_grad}")


if __name__ == "__main__":
    main()
