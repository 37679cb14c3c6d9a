"""What auto-gptq's QuantLinear allocates and keeps in a forward and a backward, measured with
its own module on CPU, against zeroplan.core.finetune.activations (gptq_dequantize_peak_bytes,
gptq_saved_weight_bytes) and zeroplan.core.finetune.storage.gptq_layout.

The module is auto-gptq 0.4.2's nn_modules/qlinear/qlinear_cuda_old.py, the one transformers'
GPTQConfig(bits=4, disable_exllama=True) loads for a checkpoint with desc_act false
(utils/import_utils.py:41-45 at that release). Without its CUDA extension (as on any CPU) it runs
the torch path, the one it runs on a GPU at or above kernel_switch_threshold (128) rows of input.
A 4-bit QuantLinear with random codes, zero points and fp16 scales multiplies an fp16 input
that needs a gradient (as a LoRA base's input does: enable_input_require_grads), under torch's
profiler with profile_memory (the CPU allocator's own allocations and frees); the tensors the
forward saves for backward are counted through saved_tensors_hooks. Usage, with the module's
file from auto-gptq's repository at v0.4.2 (or its sdist):

    git -C AutoGPTQ show v0.4.2:auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py > qlinear_cuda_old.py
    python benchmarks/gptq_quantlinear_memory.py qlinear_cuda_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.core.finetune.activations import GPTQ_UNPACK_BYTES_PER_ELEMENT  # noqa: E402

GROUP = 128
SHAPES = ((256, 512, 1024, True), (256, 1024, 512, False), (512, 2048, 1536, True))
"""(rows of input, in_features, out_features, bias) measured."""


def load_quant_linear(path: Path):
    spec = importlib.util.spec_from_file_location("qlinear_cuda_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuantLinear


def forward_backward_peaks(QuantLinear, rows: int, fan_in: int, fan_out: int, bias: bool) -> dict[str, int]:
    """The forward's peak of live bytes above what existed before it, what it leaves alive,
    and the backward's peak above that (the profiler sees only blocks allocated inside it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    layer = QuantLinear(4, GROUP, fan_in, fan_out, bias)
    layer.qweight.random_(-2**31, 2**31 - 1)
    layer.qzeros.random_(-2**31, 2**31 - 1)
    layer.scales.uniform_(0.001, 0.01)
    x = torch.randn(rows, fan_in, dtype=torch.float16).requires_grad_(True)
    grad = torch.ones(rows, fan_out, dtype=torch.float16)
    buffers = {name: b.numel() * b.element_size() for name, b in layer.named_buffers()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("gptq::forward"):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(x)
        with record_function("gptq::backward"):
            out.backward(grad)
    allocations, ranges = [], {}
    stack = [(e, "") for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, parent = stack.pop()
        fields = e.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device == torch.device("cpu"):
            allocations.append((e.start_time_ns, fields.alloc_size, parent))
        if e.name.startswith("gptq::"):
            ranges[e.name] = (e.start_time_ns, e.end_time_ns)
        stack.extend((child, e.name) for child in e.children)
    allocations.sort()
    live, trace = 0, []
    for time_ns, size, _ in allocations:
        live += size
        trace.append((time_ns, live))
    # The forward's phases, by the operator that allocates: line 240's unpacking runs until the
    # first aten::sub (line 266's weight - zeros), line 266 until aten::mm (line 269).
    names = [name for _, _, name in allocations]
    first_sub = names.index("aten::sub")
    first_mm = names.index("aten::mm")
    start = ranges["gptq::forward"][0]
    base = max((total for t, total in trace if t < start), default=0)
    unpack_peak = max(total for total in (t for _, t in trace[:first_sub])) - base
    scale_peak = max(total for total in (t for _, t in trace[first_sub:first_mm])) - base
    # torch aten/src/ATen/TensorIterator.cpp TensorIteratorBase::compute_types: where the common
    # device is the CPU (only there) an input of another dtype is promoted through a temporary;
    # line 266's fp16 * int8 makes one of the int8 operand in fp16 (2 bytes an element), which a
    # CUDA kernel casts in registers instead.
    promotion = 2 * fan_in * fan_out

    def peak_and_end(name: str) -> tuple[int, int]:
        start, end = ranges[name]
        inside = [total for t, total in trace if start <= t <= end]
        before = [total for t, total in trace if t < start]
        base = before[-1] if before else 0
        return max(inside, default=base) - base, (inside[-1] if inside else base) - base

    forward_peak, forward_left = peak_and_end("gptq::forward")
    backward_peak, _ = peak_and_end("gptq::backward")
    return {"buffers": buffers, "saved": sum(saved.values()), "forward_peak": forward_peak,
            "unpack_peak": unpack_peak, "scale_peak": scale_peak, "promotion": promotion,
            "forward_left": forward_left, "backward_peak": backward_peak,
            "out": out.numel() * out.element_size(), "x_grad": x.grad.numel() * x.grad.element_size()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qlinear", type=Path, help="auto-gptq 0.4.2's nn_modules/qlinear/qlinear_cuda_old.py")
    options = parser.parse_args(argv)
    QuantLinear = load_quant_linear(options.qlinear)
    for rows, fan_in, fan_out, bias in SHAPES:
        m = forward_backward_peaks(QuantLinear, rows, fan_in, fan_out, bias)
        n = fan_in * fan_out
        groups = -(-fan_in // GROUP)
        planned_peak = GPTQ_UNPACK_BYTES_PER_ELEMENT * n + groups * fan_out
        planned_saved = 2 * n
        bias_bytes = 2 * fan_out if bias else 0
        planned_buffers = {"qweight": n // 2, "qzeros": groups * fan_out // 2, "scales": 2 * groups * fan_out,
                           "g_idx": 4 * fan_in, **({"bias": bias_bytes} if bias else {})}
        print(f"rows {rows}, {fan_in} x {fan_out}, bias {bias}: N = {n:,} weight elements")
        for name, size in m["buffers"].items():
            print(f"  buffer {name:8s} {size:>12,} B  planned {planned_buffers.get(name, 0):>12,}")
        print(f"  saved for backward {m['saved']:>12,} B  planned (fp16 weight) {planned_saved:>12,}")
        print(f"  forward peak above its start {m['forward_peak']:>12,} B")
        print(f"    line 240 (unpack to int8) {m['unpack_peak']:>12,} B  planned dequantization peak {planned_peak:>12,}")
        print(f"    line 266 (scale to fp16)  {m['scale_peak']:>12,} B  of which the CPU-only promotion temporary "
              f"{m['promotion']:,}: on a GPU {m['scale_peak'] - m['promotion']:,}")
        print(f"  alive after the forward {m['forward_left']:>12,} B  = output {m['out']:,} + saved {m['saved']:,}: "
              f"{m['out'] + m['saved']:,}")
        print(f"  backward peak above its start {m['backward_peak']:>12,} B  (input gradient {m['x_grad']:,} B)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
