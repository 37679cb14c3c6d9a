"""The buffers torchao's AdamW8bit step allocates per parameter, read from the code inductor
generates for it (the installed torchao and torch, CPU backend).

torchao's 8-bit Adam (torchao 0.14.1 optim/adam.py:142, _AdamBase.step) runs single_param_adam (:163-208) under
torch.compile(fullgraph=True) once per parameter: it upcasts the parameter and gradient, forms
the new moments in fp32 (``exp_avg.float().lerp(grad_f32, 1 - beta1)`` and the same for
exp_avg_sq) and copies them into the OptimState8bit states (blockwise absmax scales, 256 elements
a block, then the 8-bit codes). The buffers the generated code allocates are what one parameter's
step holds beyond its states; under torchtune's optimizer_in_bwd that step runs inside backward,
as each gradient is accumulated (the tied embedding of a Llama-3.2 last). No zeroplan input
plans torchao's optimizer yet (zeroplan's adam-8bit is bitsandbytes' in-place kernel); this
prints what such an input would rest on. The CUDA backend may fuse the moment, its block
reduction and the quantization differently (a persistent reduction over 256 elements): a GPU run
decides. Usage:

    python benchmarks/torchao_adamw8bit_step.py
"""

from __future__ import annotations

import re
import sys

# torch.fx.experimental.validator imports z3 when it can; an unrelated `z3` module breaks it.
sys.modules.setdefault("z3", None)

import torch  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

BUFFER = re.compile(r"empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}


def step_buffers(shape: tuple[int, int] = (1024, 2048)) -> tuple[int, list[tuple[int, str]]]:
    """(the parameter's elements, the (elements, dtype) of each buffer its compiled step allocates)."""
    import torchao
    from torchao.optim import AdamW8bit

    del torchao
    param = torch.nn.Parameter(torch.randn(*shape, dtype=torch.bfloat16))
    optimizer = AdamW8bit([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    optimizer.step()  # creates the 8-bit states
    param.grad = torch.randn_like(param)
    _, codes = run_and_get_code(optimizer.step)
    buffers = []
    for code in codes:
        for dims, dtype in BUFFER.findall(code):
            elements = 1
            for dim in (d for d in dims.split(",") if d.strip()):
                elements *= int(dim)
            buffers.append((elements, dtype))
    return param.numel(), buffers


def main() -> int:
    import torchao

    numel, buffers = step_buffers()
    print(f"torchao {torchao.__version__}, torch {torch.__version__}: AdamW8bit step of a bf16 parameter of {numel:,} elements")
    for elements, dtype in buffers:
        print(f"  buffer {elements:>12,} x {dtype:9s} = {elements / numel:.4f} of the parameter's elements")
    total = sum(elements * BYTES.get(dtype, 0) for elements, dtype in buffers)
    print(f"  {total / numel:.3f} bytes per parameter element alive in its step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
