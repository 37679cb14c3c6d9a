"""The rate attention's FLOPs run at, relative to the matrix products' (docs/communication-time.md,
"Compute": attention at its own rate).

Flash attention runs well below the matmul ceiling, and how far below depends on the kernel and
the GPU generation (FlashAttention-3, Shah et al. 2024, sec. 3.1: the softmax's exponentials and
the kernel's scheduling, not the matrix units, bound it). One HFU for every executed FLOP cannot
say that, so compute is priced as

    t = matmul FLOPs / (peak x HFU) + attention FLOPs / (peak x HFU x r(GPU generation, kernel, s))

with r the kernel's published forward + backward TFLOP/s over the GPU's maximum achievable matmul
rate (zeroplan.core.roofline.ceilings, MAMF), both read from publications, never fitted to the
throughput rows. The kernels' TFLOP/s count FLOPs as zeroplan.core.flops executes them (causal:
half the score blocks; backward 2.5x the forward: flash-attn benchmarks/benchmark_flash_attention.py,
flops()), so r prices the FLOPs the planner counts. Published at head dimension 128 (a width no
kernel pads), causal, batch x sequence = 16k tokens, at
sequences 512-16k; between points r is interpolated in log2(s), outside them held at the end
point. A (generation, kernel) with no row runs at the matmul rate (r = 1, the flat HFU), as does
a GPU of a row's architecture but another compute die (rate_architecture). A head
dimension the kernel pads (flash kernels run it rounded up to their tile) runs at d / padded of
that rate (head_dim_efficiency); eager attention's passes over its scores cost the same per score
whatever the head dimension, so its rate moves with d as eager_relative_at_head_dim says.
"""

import math
from functools import lru_cache

from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import GpuArchitecture, GpuSpec
from zeroplan.specs.training import AttentionImplementation, AttentionKernel

SEQUENCE_POINTS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
"""The sequence lengths the kernel benchmarks publish (FlashAttention-2 README and paper, Fig. 4)."""

_LOG2_SEQUENCE_POINTS: tuple[float, ...] = tuple(math.log2(s) for s in SEQUENCE_POINTS)
"""log2 of SEQUENCE_POINTS, where AttentionRate.relative interpolates."""

A100_MAMF_TFLOPS = 267.9
H100_MAMF_TFLOPS = 792.1
"""Maximum achievable bf16 matmul TFLOP/s (zeroplan.core.roofline.ceilings: stas00/ml-engineering
compute/accelerator/README.md, MAMF table, A100 SXM and H100 SXM, CUDA 12.1)."""

_FA2_README = ("flash-attention README 'Performance' (assets/flash2_a100_fwd_bwd_benchmark.png, also "
               "FlashAttention-2, Dao 2023, Fig. 4(d))")
_FA2_README_H100 = "flash-attention README 'Performance', H100 (assets/flash2_h100_fwd_bwd_benchmark.png)"


class AttentionRate(Frozen):
    """One (GPU generation, kernel)'s published attention throughput."""

    architecture: GpuArchitecture
    kernel: str
    """An AttentionImplementation value, or 'eager' (AttentionKernel.eager: PyTorch's standard
    attention, two batched products and a softmax)."""
    tflops: tuple[float, ...]
    """Forward + backward TFLOP/s at each of SEQUENCE_POINTS (causal, head dim 128, bf16/fp16),
    in the FLOPs zeroplan.core.flops executes for that kernel."""
    matmul_tflops: float
    """The GPU's maximum achievable matmul TFLOP/s the rates are relative to."""
    source: str
    """Where the figures are published."""
    assumed: str = ""
    """What is assumed where the combination itself is not published ('' where it is)."""

    def relative(self, seq_len: int) -> float:
        """r at ``seq_len``: TFLOP/s over the matmul rate, interpolated in log2(s)."""
        points = _LOG2_SEQUENCE_POINTS
        x = min(max(math.log2(seq_len), points[0]), points[-1])
        for i in range(len(points) - 1):
            if x <= points[i + 1]:
                t = (x - points[i]) / (points[i + 1] - points[i])
                return (self.tflops[i] + t * (self.tflops[i + 1] - self.tflops[i])) / self.matmul_tflops
        return self.tflops[-1] / self.matmul_tflops

    def relative_at(self, seq_len: int, head_dim: int, v_head_dim: int | None = None) -> float:
        """r at ``seq_len`` for the model's query/key head dimension ``head_dim`` (and value head
        dimension, where it differs: MLA): a flash kernel's at d over its padded width
        (head_dim_efficiency), eager attention's by its per-score passes at the mean of the two,
        2 (d_qk + d_v) FLOPs per score (eager_relative_at_head_dim)."""
        if self.kernel == AttentionKernel.eager.value:
            width = head_dim if v_head_dim is None else (head_dim + v_head_dim) / 2
            return eager_relative_at_head_dim(self.relative(seq_len), width)
        return self.relative(seq_len) * head_dim_efficiency(self.kernel, head_dim)


# The Triton kernel has no published H100 figure. Like FlashAttention-2's CUDA kernels it issues
# Ampere's mma.sync (neither uses Hopper's wgmma or TMA: FlashAttention-3 sec. 1), so it is taken
# to gain from A100 to H100 what FlashAttention-2 gains, sequence by sequence. The copy
# llm-foundry's H100 rows ran is compiled by triton-pre-mlir from vchiley/triton's
# triton_pre_mlir_sm90 branch (llm-foundry v0.3.0 setup.py), whose code generator takes its
# sm >= 80 path on sm_90: mma16816, i.e. mma.sync (lib/codegen/selection/generator.cc, visit_dot)
# and cp.async pipelining (lib/codegen/pass.cc, has_sm80); the branch's sm_90 changes set the PTX
# target alone (lib/driver/llvm.cc max_nvvm_cc 75 -> 90, include/triton/external/CUDA/cuda.h).
_FA2_A100 = (99.0, 133.0, 155.0, 173.0, 182.0, 189.0)
_FA2_H100 = (163.0, 221.0, 265.0, 294.0, 308.0, 328.0)
_TRITON_A100 = (50.0, 61.0, 68.0, 74.0, 78.0, 80.0)
_TRITON_H100 = tuple(round(t * h / a, 1) for t, h, a in zip(_TRITON_A100, _FA2_H100, _FA2_A100, strict=True))
# PyTorch's standard attention: the causal panels count half the FLOPs (flops() divides by 2),
# while eager attention computes every score, so its executed rate is twice the plotted one.
_EAGER_A100 = tuple(2 * t for t in (23.0, 28.0, 32.0, 32.0, 34.0, 34.0))
_EAGER_H100 = tuple(2 * t for t in (40.0, 50.0, 57.0, 61.0, 63.0, 63.0))

RATES: tuple[AttentionRate, ...] = (
    AttentionRate(architecture=GpuArchitecture.ampere, kernel=AttentionImplementation.flash_attn_2.value,
                  tflops=_FA2_A100, matmul_tflops=A100_MAMF_TFLOPS,
                  source=f"{_FA2_README}: FlashAttention-2, A100 80GB SXM4, causal, head dim 128"),
    AttentionRate(architecture=GpuArchitecture.ampere, kernel=AttentionImplementation.flash_attn_triton.value,
                  tflops=_TRITON_A100, matmul_tflops=A100_MAMF_TFLOPS,
                  source=f"{_FA2_README}: 'FlashAttention Triton', A100 80GB SXM4, causal, head dim 128"),
    AttentionRate(architecture=GpuArchitecture.ampere, kernel=AttentionKernel.eager.value,
                  tflops=_EAGER_A100, matmul_tflops=A100_MAMF_TFLOPS,
                  source=f"{_FA2_README}: 'Pytorch', A100 80GB SXM4, causal, head dim 128, x2 (every score computed)",
                  assumed="16k: the 8k figure (the benchmark ran out of memory)"),
    AttentionRate(architecture=GpuArchitecture.hopper, kernel=AttentionImplementation.flash_attn_2.value,
                  tflops=_FA2_H100, matmul_tflops=H100_MAMF_TFLOPS,
                  source=f"{_FA2_README_H100}: FlashAttention-2, H100 80GB SXM5, causal, head dim 128"),
    AttentionRate(architecture=GpuArchitecture.hopper, kernel=AttentionImplementation.flash_attn_triton.value,
                  tflops=_TRITON_H100, matmul_tflops=H100_MAMF_TFLOPS,
                  source=f"{_FA2_README} and {_FA2_README_H100}",
                  assumed="not published on H100: the A100 Triton figure x FlashAttention-2's H100/A100 gain at "
                          "the same sequence (both kernels use Ampere's mma.sync, neither Hopper's wgmma)"),
    AttentionRate(architecture=GpuArchitecture.hopper, kernel=AttentionKernel.eager.value,
                  tflops=_EAGER_H100, matmul_tflops=H100_MAMF_TFLOPS,
                  source=f"{_FA2_README_H100}: 'Pytorch', H100 80GB SXM5, causal, head dim 128, x2 (every score computed)",
                  assumed="16k: the 8k figure (the benchmark ran out of memory)"),
)
"""The published rates, one row per (GPU generation, kernel)."""


# The rows were measured on one GPU of each architecture, the A100 80GB SXM4 and the H100 80GB
# SXM5 (their sources above), whose dense bf16 peaks are the A100 and H100 datasheets' 312 and 989
# TFLOP/s. A row's rates are that GPU's own (under 'kernel' its TFLOP/s themselves), so they time
# another GPU of the architecture only where it has the same compute die, architecture and peak
# (as zeroplan.core.default_efficiency borrows a fit): the H200, A100 PCIe, A800, H800. A GA102
# card of the same architecture (RTX 3090: 71 TFLOP/s peak) would otherwise run attention at the
# A100's 189 TFLOP/s; it, and the H100 PCIe and NVL, have no row (the matmul rate).
MEASURED_PEAK_BF16_FLOPS_PER_S = {GpuArchitecture.ampere: 312e12, GpuArchitecture.hopper: 989e12}
"""Dense bf16 peak of the GPU each architecture's rows were measured on."""


def rate_architecture(gpu: GpuSpec) -> GpuArchitecture | None:
    """The architecture whose rows time ``gpu``'s attention: its own where that architecture's rows
    were measured on a GPU of ``gpu``'s peak bf16 FLOP/s, else None (no row)."""
    measured = MEASURED_PEAK_BF16_FLOPS_PER_S.get(gpu.architecture) if gpu.architecture else None
    return gpu.architecture if measured == gpu.peak_bf16_flops_per_s else None


@lru_cache(maxsize=64)  # the table is fixed; every plan's step time asks for its row
def attention_rate_row(architecture: GpuArchitecture | None, kernel: str) -> AttentionRate | None:
    """The table's row for (architecture, kernel); None where none is published."""
    return next((row for row in RATES if row.architecture is architecture and row.kernel == kernel), None)


def kernel_name(kernel: AttentionKernel, implementation: AttentionImplementation) -> str:
    """The table's kernel name: 'eager', or the flash implementation's."""
    return AttentionKernel.eager.value if kernel is AttentionKernel.eager else implementation.value


# The flash kernels run the head dimension padded to their tile. llm-foundry v0.3.0 (the
# version its benchmark sweep installs) llmfoundry/models/layers/flash_attn_triton.py,
# _flash_attn_forward and _flash_attn_backward: BLOCK_HEADDIM = max(triton.next_power_of_2(d), 16),
# the tiles' products BLOCK_HEADDIM wide with masked loads where d is not (EVEN_HEADDIM). The
# benchmark's 'FlashAttention Triton' bars time another kernel, OpenAI's triton.ops.flash_attention
# (flash-attention benchmarks/benchmark_flash_attention.py at 60499abc), at head dimension 128, so
# unpadded; what llm-foundry's kernel achieves against them is zeroplan.core.attention_efficiency's
# e (--attention-rate kernel). flash-attention
# csrc/flash_attn/flash_api.cpp (FlashAttention-2): head_size_rounded = round_multiple(head_size,
# 32), the kernels instantiated per rounded head dimension (HEADDIM_SWITCH). PyTorch's eager
# attention runs cuBLAS batched products of the true width (no padding).
def padded_head_dim(kernel: str, head_dim: int) -> int:
    """The head dimension ``kernel`` (an attention_rate_row kernel name) computes with."""
    if kernel == AttentionImplementation.flash_attn_triton.value:
        return max(1 << (head_dim - 1).bit_length(), 16)
    if kernel == AttentionImplementation.flash_attn_2.value:
        return -(-head_dim // 32) * 32
    return head_dim


# The planner counts attention's FLOPs at the model's head dimension d (zeroplan.core.flops); a
# kernel padding it to d' executes d'/d of them, so at the published (unpadded, d = 128) rate
# the counted FLOPs run at d / d' of it: MPT-30B's d = 112 runs Triton's and FlashAttention-2's
# 128-wide tiles, 12.5 % of the products on padding.
def head_dim_efficiency(kernel: str, head_dim: int) -> float:
    """d / padded d: the share of ``kernel``'s products that are the model's."""
    return head_dim / padded_head_dim(kernel, head_dim)


PUBLISHED_HEAD_DIM = 128
"""The head dimension the table's rates are published at."""


# Eager attention (flash-attention benchmarks/benchmark_flash_attention.py attention_pytorch, as
# Megatron's ParallelAttention) runs two batched products, 4 d FLOPs per score forward, and between
# them passes over the materialised b x heads x s x s scores (the causal mask's add, the softmax,
# the dropout, and their backwards) that move the same bytes per score whatever d. Per counted
# FLOP, over the matmul rate: 1/r(d) = 1 + (1/r(128) - 1) x 128/d, the products at the matmul
# rate (r = 1 is the table's MAMF) and the score passes' time per FLOP in proportion to 1/d; a
# model of fewer, wider heads runs its attention faster. The same README plots' head-dimension-64
# panels (causal 'Pytorch', x2 executed: A100 15, 16, 17, 18, 18; H100 26, 29, 31, 32, 32 plotted)
# are what it predicts from the 128 panels at 1k-8k within 9 %, 16-19 % slow at 512
# (tests/test_attention_rate.py).
def eager_relative_at_head_dim(relative_128: float, head_dim: float) -> float:
    """Eager attention's r at head dimension ``head_dim`` from its published r at 128."""
    return 1 / (1 + (1 / relative_128 - 1) * PUBLISHED_HEAD_DIM / head_dim)


# Kept by its arguments (the table is fixed): every plan's step time asks for it, fit's
# strategies and a sweep's micro-batches at the same few sequences.
@lru_cache(maxsize=256)
def relative_attention_rate(architecture: GpuArchitecture | None, kernel: AttentionKernel,
                            implementation: AttentionImplementation, seq_len: int,
                            head_dim: int | None = None, v_head_dim: int | None = None) -> float:
    """r: attention's FLOP rate over the matrix products' for this GPU generation and kernel at
    ``seq_len`` and ``head_dim`` (unpadded where None), 1 where the table has no row."""
    name = kernel_name(kernel, implementation)
    row = attention_rate_row(architecture, name)
    if row is None:
        return 1.0
    return row.relative(seq_len) if head_dim is None else row.relative_at(seq_len, head_dim, v_head_dim)
