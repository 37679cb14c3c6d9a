"""The bandwidth torch's eager memory-bound kernels reached on the project's one GPU measurement
(benchmarks/gpu-step-profile-records: one H200, torch 2.11, the harness's 1.1 B Llama in FSDP2
with bf16 parameters), per kernel class, against the copy bandwidth the roofline times every
memory pass at (kernels.json's 1 GiB device copy, bytes read plus written).

Each profiled step's `operators` list every aten operator by input shape with its device time.
For the block's eager kernels the bytes are counted as the roofline counts them
(zeroplan.core.roofline.operations.block_memory_passes: each tensor read once and written once,
bf16 activations), so a class's fraction is exactly the factor by which the roofline's copy-
bandwidth time for that class is short or long on this GPU:

- pointwise: the residual adds (add, add_), the SwiGLU product (mul) and activation (silu,
  silu_backward) over whole activations, no broadcast: bytes = (inputs + output) x 2;
- norm forward: torch's fused RMSNorm (_fused_rms_norm): read x, write y;
- norm backward: _fused_rms_norm_backward (torch's layer-norm input-gradient kernel and its
  weight-gradient reduction, GammaBetaBackward, which reads x and dy again): read x and dy,
  write dx, the roofline's 3h;
- log-softmax forward and backward over the fp32 logits (8 and 12 bytes an element).

The harness's RoPE (half-width strided views, 4-D broadcasts) is printed apart: it is the
harness's own code, not a kernel a stack's block shares.

    python benchmarks/eager_kernel_bandwidth.py
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "gpu-step-profile-records"
ACTIVATION_BYTES = 2  # bf16 activations (FSDP2 with bf16 parameters)
FP32_BYTES = 4
STEPS = ("fsdp-full-shard-torch-2-4096-none", "fsdp-full-shard-torch-1-8192-none", "fsdp-full-shard-torch-2-4096-full")
"""The FSDP2 steps (bf16 activations throughout); the DDP step runs autocast over fp32 parameters."""

POINTWISE = {"aten::add": 3, "aten::add_": 3, "aten::mul": 3, "aten::silu": 2, "aten::silu_backward": 3}
"""Pointwise operators and the whole activations each reads and writes (the roofline's count)."""
CLASSES = ("pointwise", "norm forward", "norm backward", "log-softmax forward", "log-softmax backward", "rotary (harness)")


def copy_bandwidth_bytes_per_s() -> float:
    """kernels.json's device copy: bytes read plus written per second (the H200's roofline ceiling)."""
    kernels = json.loads((RECORDS / "kernels.json").read_text())
    copy = kernels["copy"]
    return copy["bytes_read_and_written"] / copy["seconds"]


def _shapes(operator: dict) -> list[list[int]]:  # type: ignore[type-arg]
    return [shape for shape in json.loads(operator["input_shapes"]) if isinstance(shape, list) and shape]


def _elements(shape: list[int]) -> int:
    elements = 1
    for size in shape:
        elements *= size
    return elements


# The roofline's bytes for one call of an operator of the block (None: not one of its classes).
def classify(operator: dict, tokens: int) -> tuple[str, int] | None:  # type: ignore[type-arg]
    """(class, bytes per call) of a profiled aten operator, as the roofline counts them."""
    name, shapes = operator["name"], _shapes(operator)
    if not shapes:
        return None
    first = shapes[0]
    whole = len(first) == 3 and first[0] * first[1] == tokens and all(shape == first for shape in shapes)
    if name in POINTWISE and whole:
        return "pointwise", POINTWISE[name] * _elements(first) * ACTIVATION_BYTES
    if name in ("aten::mul", "aten::add", "aten::add_", "aten::sub", "aten::neg") and len(first) == 4 \
            and first[0] * first[1] == tokens:
        # the harness's rotary embedding on half-width views: read the inputs, write the output
        moved = sum(_elements(shape) for shape in shapes) + _elements(first)
        return "rotary (harness)", moved * ACTIVATION_BYTES
    if name == "aten::_fused_rms_norm" and _elements(first) // first[-1] == tokens:
        return "norm forward", 2 * _elements(first) * ACTIVATION_BYTES
    if name == "aten::_fused_rms_norm_backward" and _elements(first) // first[-1] == tokens:
        return "norm backward", 3 * _elements(first) * ACTIVATION_BYTES
    if name == "aten::_log_softmax" and first[0] == tokens:
        return "log-softmax forward", 2 * _elements(first) * FP32_BYTES
    if name == "aten::_log_softmax_backward_data" and first[0] == tokens:
        return "log-softmax backward", 3 * _elements(first) * FP32_BYTES
    return None


def step_classes(step: str) -> dict[str, tuple[int, float, float]]:
    """Per class of one profiled step: (calls, device seconds, bytes as the roofline counts them)."""
    with gzip.open(RECORDS / "steps" / f"{step}.json.gz", "rt") as handle:
        document = json.load(handle)
    tokens = document["micro_batch"] * document["seq_len"]
    found: dict[str, tuple[int, float, float]] = {}
    for operator in document["operators"]:
        classified = classify(operator, tokens)
        if classified is None or not operator["self_device_time_total_us"]:
            continue
        kind, moved = classified
        calls, seconds, total = found.get(kind, (0, 0.0, 0.0))
        found[kind] = (calls + operator["count"], seconds + operator["self_device_time_total_us"] * 1e-6,
                       total + operator["count"] * moved)
    return found


def measured_fractions() -> dict[str, float]:
    """Per class, the bandwidth reached (the roofline's bytes over the device time) over the copy
    bandwidth, pooled over the FSDP2 steps (bytes summed over seconds summed)."""
    copy = copy_bandwidth_bytes_per_s()
    pooled: dict[str, tuple[float, float]] = {}
    for step in STEPS:
        for kind, (_, seconds, moved) in step_classes(step).items():
            total_s, total_bytes = pooled.get(kind, (0.0, 0.0))
            pooled[kind] = (total_s + seconds, total_bytes + moved)
    return {kind: moved / seconds / copy for kind, (seconds, moved) in pooled.items()}


def report() -> list[str]:
    """The table docs/validation.md quotes: each step's classes, then the pooled fractions."""
    copy = copy_bandwidth_bytes_per_s()
    lines = [f"H200 copy bandwidth (kernels.json): {copy / 1e12:.3f} TB/s", "",
             "| step | class | calls | device ms | GB (roofline's count) | TB/s | of copy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for step in STEPS:
        found = step_classes(step)
        for kind in CLASSES:
            if kind in found:
                calls, seconds, moved = found[kind]
                lines.append(f"| {step} | {kind} | {calls} | {seconds * 1e3:.2f} | {moved / 1e9:.2f} "
                             f"| {moved / seconds / 1e12:.2f} | {moved / seconds / copy:.2f} |")
    fractions = measured_fractions()
    lines += ["", "pooled over the three steps (of the copy bandwidth): "
              + ", ".join(f"{kind} {fractions[kind]:.2f}" for kind in CLASSES if kind in fractions)]
    return lines


def main(argv: list[str]) -> int:
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
