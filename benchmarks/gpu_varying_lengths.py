"""How much a real CUDA caching allocator reserves after micro-batches of varying length, and
whether each record-long batch adds one segment per fp32 logit-sized loss tensor alive at once as
zeroplan.allocator.varying_lengths assumes. Not yet run: no GPU was lent when it was written.

The step is the loss path of Qwen-1's modeling_qwen.py (QWenLMHeadModel.forward: lm_head,
shift_logits .contiguous(), nn.CrossEntropyLoss) under HF Trainer 4.36's mixed precision
(accelerate's autocast around forward, then convert_outputs_to_fp32 on the logits, kept through
compute_loss and dropped before backward) over a small stand-in body (checkpointed bf16
blocks). The vocabulary is Qwen's 151,936, so the loss's tensors dominate as on the ms-swift
rows. Lengths are drawn from ms-swift's page statistics (shifted gamma, samples above
--seq-len dropped, 1,971 batches at 2048 tokens) with a fixed seed. The script reports:
max_memory_reserved after one batch at seq_len and after the whole sequence; the sequence's
record lengths; and the growth the model's rule gives for those same records (2 segments per
record below the longest: the two fp32 tensors zeroplan.core.own_loss reads from torch 2.1's
autocast lists). That last figure compares with no distribution involved.

    python3 benchmarks/gpu_varying_lengths.py --out "$OUT"   # on a GPU machine, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

GIB = 2**30
VOCAB = 151_936
ROUND_LARGE_BYTES = 2 * 2**20
MEAN, SD, MIN = 3234.4, 2547.5, 91
"""ms-swift's page statistics of its samples' lengths in tokens (benchmarks/varying_length_rows.py)."""


def _segment_bytes(size: int) -> int:
    """get_allocation_size for a request above 10 MiB."""
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def lengths_of(seq_len: int, batches: int, seed: int) -> list[int]:
    """``batches`` lengths drawn with ``seed`` from the page statistics' shifted gamma, those above
    ``seq_len`` dropped (shared with benchmarks/varying_length_rows.py and allocator_varying_loss_order.py)."""
    shape, scale = ((MEAN - MIN) / SD) ** 2, SD**2 / (MEAN - MIN)
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < batches:
        tokens = int(MIN + rng.gammavariate(shape, scale))
        if tokens <= seq_len:
            out.append(tokens)
    return out


def run(seq_len: int, batches: int, hidden: int, blocks: int, seed: int, device_name: str = "cuda") -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    reserved = torch.cuda.max_memory_reserved if cuda else (lambda: 0)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, hidden).to(device, torch.bfloat16)
    body = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden).to(device, torch.bfloat16) for _ in range(blocks))
    head = torch.nn.Linear(hidden, VOCAB, bias=False).to(device, torch.bfloat16)
    embed.weight.requires_grad_(False)
    head.weight.requires_grad_(False)

    def step(tokens: int) -> None:
        ids = torch.randint(0, VOCAB, (1, tokens), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden_states = embed(ids).requires_grad_(True)
            for block in body:
                hidden_states = checkpoint(block, hidden_states, use_reentrant=True)
            logits = head(hidden_states)
            shift_logits = logits[..., :-1, :].contiguous()
            loss = torch.nn.functional.cross_entropy(shift_logits.view(-1, VOCAB), ids[..., 1:].reshape(-1))
        outputs = logits.float()  # accelerate's convert_outputs_to_fp32
        del logits, shift_logits
        outputs.argmax(dim=-1)  # ms-swift's token accuracy
        del outputs
        loss.backward()

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step(seq_len)
    one = reserved()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    lengths = lengths_of(seq_len, batches, seed) + [seq_len]
    records, longest = [], 0
    for tokens in lengths:
        if tokens > longest:
            records.append(tokens)
            longest = tokens
        step(tokens)
    varying = reserved()
    # zeroplan.core.own_loss: two fp32 tensors of the loss alive at once (nll_loss's fp32 input with
    # accelerate's fp32 outputs, then with nll_loss's gradient), one segment each per record.
    rule = 2 * sum(_segment_bytes(4 * VOCAB * (t - 1)) for t in records[:-1])
    return {
        "seq_len": seq_len, "batches": len(lengths), "seed": seed,
        "one_length_reserved_gib": one / GIB, "varying_reserved_gib": varying / GIB,
        "growth_gib": (varying - one) / GIB, "records": records,
        "rule_growth_gib": rule / GIB, "num_alloc_retries": torch.cuda.memory_stats()["num_alloc_retries"] if cuda else 0,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the loop, no memory figures")
    options = parser.parse_args(argv)
    results = []
    for seq_len, batches in ((512, 289), (2048, 1971), (8192, 949)):
        for seed in (0, 1):
            result = run(seq_len, batches, options.hidden, options.blocks, seed, options.device)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "records"}), "records:", len(result["records"]),
                  file=sys.stderr)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "varying_lengths.json").write_text(json.dumps(results, indent=1))
    return 0 if all(math.isfinite(r["growth_gib"]) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
