"""The roofline compute model (zeroplan.core.roofline) against one H200's measured kernels.

Prints three tables from benchmarks/gpu-step-profile-records (made by gpu_step_profile.py):
1. per profiled step, device seconds by kernel category (matrix products, attention, memory-bound
   kernels, the optimizer step), measured and predicted, and forward+backward as CUDA events
   timed it (the kernels' sum and the host-bound gaps between them);
2. each of the model's GEMM shapes, timed alone, against the roofline's time for that product;
3. flash attention forward and forward+backward, timed alone, against the roofline's.

    python benchmarks/step_profile_accuracy.py

error = predicted / measured - 1 (negative: the model predicts a faster kernel).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeroplan.core.flops import attention_forward_flops_per_token, executed_causal_fraction  # noqa: E402
from zeroplan.core.roofline.ceilings import gpu_ceilings  # noqa: E402
from zeroplan.core.roofline.operations import OpPass, attention_core, matmul  # noqa: E402
from zeroplan.core.roofline.step import operation_seconds  # noqa: E402
from zeroplan.presets.gpus import get_gpu  # noqa: E402
from zeroplan.specs import AttentionKernel, TrainingSpec  # noqa: E402
from zeroplan.validate.step_profile import CATEGORIES, STEP_PROFILE_DIR, compare_profile, step_profiles  # noqa: E402

KERNELS_FILE = STEP_PROFILE_DIR.parent / "kernels.json"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.1%}"


def step_table() -> list[str]:
    lines = ["| step | category | measured ms | predicted ms | error |", "|---|---|---:|---:|---:|"]
    for profile in step_profiles():
        comparison = compare_profile(profile)
        for category in CATEGORIES:
            measured, predicted = profile.kernel_s[category], comparison.predicted_s[category]
            lines.append(f"| {profile.name} | {category} kernels | {_ms(measured)} | {_ms(predicted)} | {_error(predicted, measured)} |")
        kernels = comparison.measured_kernel_forward_backward_s
        predicted = comparison.predicted_s["forward_backward"]
        lines.append(f"| {profile.name} | forward+backward kernels | {_ms(kernels)} | {_ms(predicted)} | {_error(predicted, kernels)} |")
        if profile.forward_backward_s is None or profile.optimizer_step_s is None:
            continue  # a CPU smoke run: no CUDA events
        lines.append(f"| {profile.name} | forward+backward, CUDA events | {_ms(profile.forward_backward_s)} | {_ms(predicted)} | "
                     f"{_error(predicted, profile.forward_backward_s)} |")
        lines.append(f"| {profile.name} | optimizer step, CUDA events | {_ms(profile.optimizer_step_s)} | "
                     f"{_ms(comparison.predicted_s['optimizer'])} | {_error(comparison.predicted_s['optimizer'], profile.optimizer_step_s)} |")
    return lines


def gemm_table(kernels: dict) -> list[str]:
    ceilings = gpu_ceilings(get_gpu("h200-141gb"))
    lines = ["| projection | pass | m x k x n | measured us | TFLOP/s | predicted us | bound | error |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    for row in kernels["gemm"]:
        op = matmul(row["projection"], OpPass.forward, row["m"], row["k"], row["n"], 2, 1)
        seconds, bound = operation_seconds(op, ceilings)
        lines.append(f"| {row['projection']} | {row['pass']} | {row['m']} x {row['k']} x {row['n']} | {row['seconds'] * 1e6:.1f} | "
                     f"{row['tflops']:.0f} | {seconds * 1e6:.1f} | {bound} | {_error(seconds, row['seconds'])} |")
    return lines


def attention_table(kernels: dict) -> list[str]:
    from zeroplan.validate.step_profile import step_profiles as profiles

    model = profiles()[0].model
    ceilings = gpu_ceilings(get_gpu("h200-141gb"))
    training = TrainingSpec(attention_kernel=AttentionKernel.flash)
    lines = ["| batch x seq | heads / kv heads / d | pass | measured ms | TFLOP/s | predicted ms | error |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in kernels["attention"]:
        tokens = row["batch"] * row["seq_len"]
        forward = attention_core(model, training, tokens, row["seq_len"], 2, OpPass.forward, 1)[0]
        backward = attention_core(model, training, tokens, row["seq_len"], 2, OpPass.backward, 1)[0]
        forward_s = operation_seconds(forward, ceilings)[0]
        both_s = forward_s + operation_seconds(backward, ceilings)[0]
        flops = tokens * attention_forward_flops_per_token(model, row["seq_len"], executed_causal_fraction(AttentionKernel.flash))
        shape = f"{row['batch']} x {row['seq_len']}"
        heads = f"{row['heads']} / {row['kv_heads']} / {row['head_size']}"
        lines.append(f"| {shape} | {heads} | forward | {_ms(row['forward_s'])} | {flops / row['forward_s'] / 1e12:.0f} | "
                     f"{_ms(forward_s)} | {_error(forward_s, row['forward_s'])} |")
        lines.append(f"| {shape} | {heads} | forward+backward | {_ms(row['forward_backward_s'])} | "
                     f"{3.5 * flops / row['forward_backward_s'] / 1e12:.0f} | {_ms(both_s)} | {_error(both_s, row['forward_backward_s'])} |")
    return lines


def main() -> int:
    kernels = json.loads(KERNELS_FILE.read_text())
    print(f"{kernels['device_name']}, torch {kernels['torch_version']}; ceilings: "
          f"{gpu_ceilings(get_gpu('h200-141gb')).source}\n")
    for title, lines in (("Profiled steps", step_table()), ("GEMM shapes alone", gemm_table(kernels)),
                         ("Flash attention alone", attention_table(kernels))):
        print(f"## {title}\n")
        print("\n".join(lines))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
