"""What a step's 4-bit matmuls leave alive after its backward, measured with bitsandbytes' own
Linear4bit on CPU, against zeroplan.core.finetune.activations.previous_step_matmul_inputs_bytes.

A small litgpt-shaped QLoRA model (a frozen embedding; per block an RMSNorm, a 4-bit fused qkv
with a LoRA on it, causal attention, a 4-bit output projection, an RMSNorm, 4-bit fc_1 and fc_2
reading the same input, SiLU-gated product, a 4-bit down projection; a final RMSNorm and a 4-bit
head run on 128-token slices, as litgpt/lora.py GPT.forward runs it with lm_head_chunk_size=128)
takes one training step: forward, loss, backward. The step's output stays referenced, as litgpt's
fit() keeps `logits` until its next forward has returned (finetune/lora.py lines 304-308). Every
tensor MatMul4Bit receives as its input is followed by a weak reference; the bytes of those still
alive after backward are the measurement, once with the installed bitsandbytes (0.50.2: its
forward keeps ``ctx.tensors = (None, B)``) and once with the line releases before 0.43.2 ran
(``(A, B)``: zeroplan/frameworks/lora.py matmul_4bit_keeps_input). Usage:

    python benchmarks/bnb_ctx_retention.py
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.presets.gpus import get_gpu  # noqa: E402
from zeroplan.presets.models import get_model  # noqa: E402
from zeroplan.specs import BatchSpec, FineTuneSpec, ModelSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus  # noqa: E402

HIDDEN, HEADS, FFN, LAYERS, VOCAB = 256, 4, 704, 3, 1000
SEQ, BATCH = 384, 2


def tiny_llama() -> ModelSpec:
    """The measured model's spec: llama-2-7b's layout at the measured sizes."""
    return get_model("llama-2-7b").model_copy(update={
        "hidden_size": HIDDEN, "num_heads": HEADS, "num_kv_heads": HEADS, "ffn_hidden_size": FFN,
        "num_layers": LAYERS, "vocab_size": VOCAB})


@contextlib.contextmanager
def matmul_4bit_inputs():
    """Weak references to every tensor bitsandbytes' MatMul4Bit receives as its input while open."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    inputs: list[weakref.ref] = []
    original = MatMul4Bit.forward

    def spy(ctx, A, *args, **kwargs):
        inputs.append(weakref.ref(A))
        return original(ctx, A, *args, **kwargs)

    MatMul4Bit.forward = staticmethod(spy)
    try:
        yield inputs
    finally:
        MatMul4Bit.forward = staticmethod(original)


def alive_bytes(inputs: list[weakref.ref]) -> int:
    """Bytes of the storages of those inputs still alive, after a collection (a storage shared
    by several counted once)."""
    gc.collect()
    storages = {}
    for ref in inputs:
        tensor = ref()
        if tensor is not None:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def request(version: str) -> PlanRequest:
    """The planner's request for the measured model."""
    model = tiny_llama()
    finetune = FineTuneSpec(lora_rank=8, quantize="nf4", lora_targets=("q", "v"), bitsandbytes_version=version)
    return PlanRequest(model=model, cluster=cluster_from_gpus(get_gpu("a10g"), 1), strategy=StrategySpec(kind="ddp"),
                       batch=BatchSpec(seq_len=SEQ, micro_batch_size=BATCH),
                       training=TrainingSpec(framework="litgpt", precision="bf16-pure", finetune=finetune))


def measure(keeps_input: bool) -> int:
    """Bytes of MatMul4Bit inputs alive after one step's backward, its output still referenced."""
    import bitsandbytes as bnb
    import torch

    from zeroplan.frameworks.lora import matmul_4bit_keeps_input

    torch.manual_seed(0)
    bf16 = torch.bfloat16

    def linear(fan_in: int, fan_out: int):
        layer = bnb.nn.Linear4bit(fan_in, fan_out, bias=False, compute_dtype=bf16, quant_type="nf4",
                                  compress_statistics=False)
        # bitsandbytes quantizes a Params4bit on its move to a device (nn/modules.py Params4bit._quantize).
        layer.weight = bnb.nn.Params4bit(torch.randn(fan_out, fan_in, dtype=bf16), requires_grad=False,
                                         quant_type="nf4", compress_statistics=False).to("cpu")
        return layer

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_1, self.norm_2 = torch.nn.RMSNorm(HIDDEN, dtype=bf16), torch.nn.RMSNorm(HIDDEN, dtype=bf16)
            self.qkv, self.proj = linear(HIDDEN, 3 * HIDDEN), linear(HIDDEN, HIDDEN)
            self.fc_1, self.fc_2, self.down = linear(HIDDEN, FFN), linear(HIDDEN, FFN), linear(FFN, HIDDEN)
            self.lora_a = torch.nn.Parameter(torch.randn(8, HIDDEN, dtype=bf16))
            self.lora_b = torch.nn.Parameter(torch.randn(3 * HIDDEN, 8, dtype=bf16))
            for norm in (self.norm_1, self.norm_2):
                norm.weight.requires_grad_(False)

        def forward(self, x):
            h = self.norm_1(x)
            qkv = self.qkv(h) + (h @ self.lora_a.t()) @ self.lora_b.t()
            q, k, v = (t.view(BATCH, SEQ, HEADS, -1).transpose(1, 2) for t in qkv.split(HIDDEN, dim=-1))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(BATCH, SEQ, HIDDEN))
            h = self.norm_2(x)
            return x + self.down(torch.nn.functional.silu(self.fc_1(h)) * self.fc_2(h))

    embedding = torch.nn.Embedding(VOCAB, HIDDEN, dtype=bf16).requires_grad_(False)
    blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS)).train()
    norm, head = torch.nn.RMSNorm(HIDDEN, dtype=bf16).requires_grad_(False), linear(HIDDEN, VOCAB)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with matmul_4bit_inputs() as inputs:
        with matmul_4bit_keeps_input() if keeps_input else contextlib.nullcontext():
            x = embedding(tokens)
            for block in blocks:
                x = block(x)
            logits = [head(piece) for piece in norm(x).split(128, dim=1)]
            loss = sum(torch.nn.functional.cross_entropy(chunk.float().flatten(0, 1), target.flatten())
                       for chunk, target in zip(logits, tokens.split(128, dim=1)))
            loss.backward()
    del loss, x
    kept = alive_bytes(inputs)
    del logits
    return kept


def main() -> None:
    from zeroplan.core.finetune.activations import previous_step_matmul_inputs_bytes

    for version, keeps in (("0.50.2", False), ("0.42.0", True)):
        measured = measure(keeps)
        planned = previous_step_matmul_inputs_bytes(request(version))
        print(f"bitsandbytes {version} MatMul4Bit: {measured:,} B of inputs alive after backward "
              f"(output referenced); planner {planned:,} B")


if __name__ == "__main__":
    main()
