"""What torchtune's compiled NF4 linear allocates to dequantize its weight, from the code inductor
generates (CPU backend), against the 7 bf16 copies torchao's eager get_original_weight holds
(zeroplan.core.finetune.activations.TORCHAO_NF4_DEQUANTIZE_COPIES).

torchtune 0.6.1's FrozenNF4Linear (modules/low_precision/nf4_linear.py) runs torchao 0.14.1's
linear_nf4: F.linear(input, weight.to(input.dtype)) in forward, grad_output @ weight.to(...) in
backward. The layer is compiled as torchtune's recipes compile each decoder layer, one forward
and backward is run, and every buffer the generated forward and backward code allocates
(``empty_strided_cpu``) is listed with its bytes. Usage:

    python benchmarks/compiled_nf4_dequantize.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IN_FEATURES, OUT_FEATURES, TOKENS = 512, 1792, 64

_BUFFER = re.compile(r"(\w+) = empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def generated_buffers() -> list[list[tuple[str, int]]]:
    """(name, bytes) of each buffer inductor's generated code allocates, one list per compiled
    graph (the forward's, then the backward's)."""
    import torch
    from torch._inductor.utils import run_and_get_code
    from torchtune.modules.low_precision.nf4_linear import FrozenNF4Linear

    torch.manual_seed(0)
    layer = FrozenNF4Linear(IN_FEATURES, OUT_FEATURES, dtype=torch.bfloat16)
    x = torch.randn(TOKENS, IN_FEATURES, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    graphs = []
    for code in codes:
        buffers = []
        for name, shape, _, dtype in _BUFFER.findall(code):
            numel = 1
            for size in (int(s) for s in shape.split(",") if s.strip()):
                numel *= size
            buffers.append((name, numel * _BYTES[dtype]))
        graphs.append(buffers)
    return graphs


def main() -> None:
    weight_bf16 = 2 * IN_FEATURES * OUT_FEATURES
    for label, buffers in zip(("forward", "backward"), generated_buffers()):
        described = ", ".join(f"{name} {size:,} B" for name, size in buffers)
        copies = sum(size for _, size in buffers if size >= weight_bf16) / weight_bf16
        print(f"{label}: {described}; weight-sized buffers: {copies:g} bf16 copies of the weight "
              f"({weight_bf16:,} B; eager torchao holds 7)")


if __name__ == "__main__":
    main()
