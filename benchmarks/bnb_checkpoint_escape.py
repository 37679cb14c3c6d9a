"""What bitsandbytes' 4-bit matmuls keep through a fully checkpointed step, under torch's reentrant
and non-reentrant checkpoints, measured with bitsandbytes' own Linear4bit on CPU, against
zeroplan.core.finetune.activations.checkpoint_escaping_inputs_bytes.

A small Llama-shaped QLoRA model in bf16 (a frozen embedding whose output requires a gradient,
as transformers' enable_input_require_grads makes it; per block an RMSNorm, 4-bit q, k and v with
a LoRA on q and v, causal attention, a 4-bit o, an RMSNorm, 4-bit gate and up reading the same
input, the SiLU-gated product, a 4-bit down; a final norm and a bf16 head) runs one step with
every block under torch.utils.checkpoint, as Hugging Face's gradient checkpointing wraps each
decoder layer: forward, loss, backward, the loss still referenced (the Trainer's training_step
drops it after backward). Every tensor MatMul4Bit receives as its input is followed by a weak
reference; the bytes of those alive after the forward and after the backward are the
measurement, with the line releases before 0.43.2 ran (``ctx.tensors = (A, B)``:
zeroplan/frameworks/lora.py matmul_4bit_keeps_input) and with the installed one. Usage:

    python benchmarks/bnb_checkpoint_escape.py
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bnb_ctx_retention import FFN, HEADS, HIDDEN, LAYERS, VOCAB, alive_bytes, matmul_4bit_inputs, tiny_llama  # noqa: E402
from zeroplan.presets.gpus import get_gpu  # noqa: E402
from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus  # noqa: E402

SEQ, BATCH = 128, 2


def request(version: str, reentrant: bool) -> PlanRequest:
    """The planner's request for the measured model (llama-2-7b's layout at the measured sizes),
    as ms-swift runs it: a bf16 base with nothing cast to fp32, hf's full checkpointing."""
    model = tiny_llama()
    finetune = FineTuneSpec(lora_rank=8, quantize="nf4", lora_targets=("q", "v"), bitsandbytes_version=version,
                            kbit_fp32_cast=False)
    return PlanRequest(model=model, cluster=cluster_from_gpus(get_gpu("a10g"), 1), strategy=StrategySpec(kind="ddp"),
                       batch=BatchSpec(seq_len=SEQ, micro_batch_size=BATCH),
                       training=TrainingSpec(framework="hf", precision="bf16-pure", finetune=finetune,
                                             activation_checkpointing="full", checkpoint_reentrant=reentrant))


def measure(keeps_input: bool, reentrant: bool) -> tuple[int, int]:
    """Bytes of MatMul4Bit inputs alive (after the forward, after the backward), the loss referenced."""
    import bitsandbytes as bnb
    import torch
    import torch.utils.checkpoint

    from zeroplan.frameworks.lora import matmul_4bit_keeps_input

    torch.manual_seed(0)
    bf16 = torch.bfloat16

    def linear(fan_in: int, fan_out: int):
        layer = bnb.nn.Linear4bit(fan_in, fan_out, bias=False, compute_dtype=bf16, quant_type="nf4")
        # bitsandbytes quantizes a Params4bit on its move to a device (nn/modules.py Params4bit._quantize).
        layer.weight = bnb.nn.Params4bit(torch.randn(fan_out, fan_in, dtype=bf16), requires_grad=False,
                                         quant_type="nf4").to("cpu")
        return layer

    class Adapter(torch.nn.Module):
        def __init__(self, fan_in: int, fan_out: int) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(8, fan_in, dtype=bf16))
            self.b = torch.nn.Parameter(torch.randn(fan_out, 8, dtype=bf16))

        def forward(self, x):
            return (x @ self.a.t()) @ self.b.t()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_1, self.norm_2 = torch.nn.RMSNorm(HIDDEN, dtype=bf16), torch.nn.RMSNorm(HIDDEN, dtype=bf16)
            self.q, self.k, self.v, self.o = (linear(HIDDEN, HIDDEN) for _ in range(4))
            self.lora_q, self.lora_v = Adapter(HIDDEN, HIDDEN), Adapter(HIDDEN, HIDDEN)
            self.gate, self.up, self.down = linear(HIDDEN, FFN), linear(HIDDEN, FFN), linear(FFN, HIDDEN)
            for norm in (self.norm_1, self.norm_2):
                norm.weight.requires_grad_(False)

        def forward(self, x):
            h = self.norm_1(x)
            q, k, v = self.q(h) + self.lora_q(h), self.k(h), self.v(h) + self.lora_v(h)
            q, k, v = (t.view(BATCH, SEQ, HEADS, -1).transpose(1, 2) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(BATCH, SEQ, HIDDEN))
            h = self.norm_2(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    embedding = torch.nn.Embedding(VOCAB, HIDDEN, dtype=bf16).requires_grad_(False)
    blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS)).train()
    norm = torch.nn.RMSNorm(HIDDEN, dtype=bf16).requires_grad_(False)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=bf16).requires_grad_(False)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with matmul_4bit_inputs() as inputs:
        with matmul_4bit_keeps_input() if keeps_input else contextlib.nullcontext():
            # transformers' enable_input_require_grads: the embedding's output requires a gradient.
            x = embedding(tokens).requires_grad_(True)
            for block in blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            logits = head(norm(x)).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            del x, logits
            after_forward = alive_bytes(inputs)
            loss.backward()
            after_backward = alive_bytes(inputs)
    del loss
    return after_forward, after_backward


def main() -> None:
    from zeroplan.core.finetune.activations import checkpoint_escaping_inputs_bytes

    for version, keeps in (("0.50.2", False), ("0.41.3", True)):
        for reentrant in (True, False):
            forward, backward = measure(keeps, reentrant)
            planned = LAYERS * checkpoint_escaping_inputs_bytes(request(version, reentrant))
            kind = "reentrant" if reentrant else "non-reentrant"
            print(f"bitsandbytes {version} MatMul4Bit, {kind} checkpoint: {forward:,} B of inputs alive after the "
                  f"forward, {backward:,} B after the backward; planner {planned:,} B")


if __name__ == "__main__":
    main()
