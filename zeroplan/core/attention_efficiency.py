"""Attention at the kernel's achieved rate (--attention-rate kernel): the stack's attention
kernel over the rate its published benchmark gives (docs/validation.md, "Attention at the
kernel's achieved rate").

Under --attention-rate kernel attention's FLOPs run at the kernel's published TFLOP/s
(zeroplan.core.attention_rate), whatever the HFU, so one measured step fixes the matrix
products' HFU alone and attention's share of the step moves with the sequence as the kernel's
own rate does. The published rate is a benchmark's, which is not always the kernel a stack runs:
the 'FlashAttention Triton' bars of the flash-attention README time OpenAI's
triton.ops.flash_attention (flash-attention benchmarks/benchmark_flash_attention.py at 60499abc:
``from triton.ops.flash_attention import attention as attention_triton``), while llm-foundry's
``attn_impl: triton`` runs its own copy of flash-attention's flash_attn_triton.py on
triton-pre-mlir (llm-foundry v0.3.0 llmfoundry/models/layers/flash_attn_triton.py, the version
its benchmark sweep installs: scripts/train/benchmarking/submit_benchmarks.py). So the rate is

    attention FLOP/s = e(kernel) x the kernel's published TFLOP/s(GPU generation, s, head dim)

with e one number per attention kernel (a property of the kernel against its benchmark, the same
on every GPU generation the benchmark's gain carries to), fitted on the published throughput rows
of the sources whose rows span at least MIN_SEQUENCE_LENGTHS sequence lengths (one sequence length
cannot tell attention's rate from the matrix products'), leave-one-source-out wherever an
accuracy figure is reported (zeroplan.validate.step_calibration.attention_efficiency_fit). A
kernel no such source ran keeps its published rate (e = 1).
"""

from __future__ import annotations

from zeroplan.specs.request import PerformanceAssumptions, PlanRequest

MIN_SEQUENCE_LENGTHS = 3
"""A source's rows tell attention's rate from the matrix products' only where they run at least
this many sequence lengths (its share of the step then moves while the HFU does not)."""


# Two unknowns per source, the matrix products' 1/HFU and attention's 1/e, and one equation per
# row: t_published - t_rest = (matmul FLOPs / peak) x 1/HFU + t_attention(e = 1) x 1/e, with
# t_rest the planner's step less its compute plus the memory-bound kernels (timed apart at the
# copy bandwidth); least squares on relative residuals (each row divided by its own t), so a long
# step does not outweigh a short one. Plain normal equations: two unknowns.
def source_attention_efficiency(rows: list[tuple[float, float, float]]) -> float | None:
    """e of one source from its rows' (matmul FLOPs / peak, attention seconds at e = 1, published
    step less the planner's non-matmul, non-attention seconds); None where the two columns do not
    tell the unknowns apart or the fit is not a rate (e <= 0)."""
    a11 = a12 = a22 = b1 = b2 = 0.0
    for matmul_s_at_hfu_1, attention_s, target_s in rows:
        if target_s <= 0:
            continue
        x1, x2, y = matmul_s_at_hfu_1 / target_s, attention_s / target_s, 1.0
        a11, a12, a22 = a11 + x1 * x1, a12 + x1 * x2, a22 + x2 * x2
        b1, b2 = b1 + x1 * y, b2 + x2 * y
    determinant = a11 * a22 - a12 * a12
    if determinant <= 1e-12 * max(a11 * a22, 1e-300):
        return None
    inverse_e = (a11 * b2 - a12 * b1) / determinant
    return 1 / inverse_e if inverse_e > 0 else None


def attention_efficiency(request: PlanRequest, kernel: str) -> float:
    """e of ``kernel`` (an attention_rate kernel name) for ``request``: the one given
    (PerformanceAssumptions.attention_efficiency), else the fitted default
    (zeroplan.core.default_efficiency), else 1 (the published rate)."""
    return kernel_attention_efficiency(request.performance, kernel)


def kernel_attention_efficiency(performance: PerformanceAssumptions, kernel: str) -> float:
    """attention_efficiency of the request whose performance assumptions are ``performance``
    (the only part of it the efficiency reads)."""
    given = performance.attention_efficiency
    if given is not None:
        return given
    from zeroplan.core.default_efficiency import default_table

    return default_table().attention_efficiency.get(kernel, 1.0)
