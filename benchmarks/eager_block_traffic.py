"""Bytes the eager kernels of one harness block read and write, counted on fake tensors, beside
the roofline's single-pass count (zeroplan.core.roofline.operations.block_memory_passes).

The harness's Transformer (what benchmarks/gpu_step_profile.py ran on the H200) is built with 1
and with 2 blocks in bf16 and run forward and backward on fake tensors under a dispatch mode that
adds up, per aten operator, the distinct bytes of its tensor inputs and outputs (a broadcast
input counts its stored elements once; views, metadata and allocation count nothing); the
difference of the two runs is one block. torch's fused CUDA RMSNorm is registered for the CPU
(zeroplan.simulate.fused_rms_norm), so the norm is one kernel each way, as on a GPU. Products
and attention are left out: this is the memory-bound part.

    python benchmarks/eager_block_traffic.py [--micro-batch 2] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from zeroplan.frameworks.compiled_traffic import COMPUTE, NO_TRAFFIC  # noqa: E402


def distinct_bytes(tensor) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the elements a kernel touches: a broadcast (stride-0) dimension counts once."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            elements *= size
    return elements * tensor.element_size()


def count(layers: int, micro_batch: int, seq_len: int) -> collections.Counter:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from gpu_measure import llama_1b
    from zeroplan.harness.model import build_model, next_token_loss
    from zeroplan.simulate import _torch_private as private
    from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula

    traffic: collections.Counter = collections.Counter()
    phase = ["forward"]

    class Traffic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and not any(marker in name for marker in COMPUTE):
                tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
                traffic[phase[0], name] += sum(distinct_bytes(x) for x in tensors)
            return out

    spec = llama_1b().model_copy(update={"num_layers": layers})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with cuda_rms_norm_formula(), private.fake_tensor_mode():
            model = build_model(spec)
            tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq_len))
            with Traffic():
                loss = next_token_loss(model(tokens), tokens)
                phase[0] = "backward"
                loss.backward()
    finally:
        torch.set_default_dtype(default)
    return traffic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)

    from gpu_measure import llama_1b
    from zeroplan.core.roofline.operations import OpPass, block_memory_passes

    one, two = count(1, args.micro_batch, args.seq_len), count(2, args.micro_batch, args.seq_len)
    block = {key: two[key] - one[key] for key in set(one) | set(two) if two[key] != one[key]}
    tokens = args.micro_batch * args.seq_len
    print(f"harness Transformer, llama-1b-like, bf16, {args.micro_batch} x {args.seq_len} tokens; one block's "
          "memory-bound kernels (MB)\n")
    print("| pass | operator | eager MB |\n|---|---|---:|")
    for (phase, name), moved in sorted(block.items()):
        print(f"| {phase} | {name} | {moved / 1e6:,.1f} |")
    print()
    model = llama_1b()
    for phase, op_pass in (("forward", OpPass.forward), ("backward", OpPass.backward)):
        eager = sum(moved for (p, _), moved in block.items() if p == phase)
        single = sum(op.moved_bytes for op in block_memory_passes(model, False, tokens, 2, op_pass, 1))
        print(f"{phase}: eager {eager / 1e9:.3f} GB, roofline single pass {single / 1e9:.3f} GB, ratio {eager / single:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
