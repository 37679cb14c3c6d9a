"""What one GPU achieves, not what its datasheet promises: the three ceilings the per-operation
model times every kernel against.

- Matrix products: the maximum achievable matmul FLOP/s (MAMF) of bf16 inputs, the best rate a
  search over large aligned shapes finds (the MAMF comparison table of stas00/ml-engineering,
  compute/accelerator/README.md; this project's own H200 measurement where the table has none).
- Memory-bound kernels: the bytes per second a device-to-device copy moves, read and written.
  Measured on the H200 here (benchmarks/gpu-step-profile-records/kernels.json: 4.168 TB/s, 86.8 %
  of the 4.8 TB/s datasheet); the other GPUs take their datasheet bandwidth at that same
  fraction, an assumption until a copy on them is measured.
- The exponentials of attention's softmax: flash attention computes one exp per score on the
  multi-function unit, 16 results per clock per SM on compute capability 8.0 and 9.0 (CUDA C++
  Programming Guide, "Arithmetic Instructions", throughput table), next to the matrix units:
  FlashAttention-3 (Shah et al. 2024, sec. 3.1) counts 3.9 TFLOP/s of them on an H100 SXM5
  against 989 of bf16 matmul, which is why attention runs well below the matmul ceiling.
"""

from pydantic import Field

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import GpuSpec
from zeroplan.specs.request import PlanRequest


class GpuCeilings(Frozen):
    """The achievable rates of one GPU model."""

    matmul_flops_per_s: float = Field(gt=0)
    """bf16 matrix products at their best shape (MAMF)."""
    memory_bytes_per_s: float = Field(gt=0)
    """Device memory traffic (bytes read plus bytes written) per second of a streaming kernel."""
    exp_per_s: float = Field(gt=0)
    """Exponentials per second of the special-function units (SMs x 16 per clock x clock)."""
    source: str = Field(min_length=1)


COPY_FRACTION_OF_DATASHEET = 4.168e12 / 4.8e12
"""The H200's measured copy bandwidth over its datasheet figure (kernels.json above), carried
to the GPUs no copy was measured on."""
MUFU_RESULTS_PER_CLOCK_PER_SM = 16
"""exp2 results per clock per SM, compute capability 8.0 and 9.0 (CUDA C++ Programming Guide)."""

_MAMF = "stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table'"


# SMs x 16 per clock x the clock the datasheet's tensor rate is quoted at: A100 108 SMs at
# 1.41 GHz (312 TFLOP/s = 432 tensor cores x 512 FLOP x 1.41 GHz), H100/H200 SXM 132 SMs at
# 1.83 GHz (989 TFLOP/s = 528 x 1024 x 1.83 GHz; FlashAttention-3 sec. 3.1 rounds to 3.9 T/s).
def special_function_rate(sms: int, clock_hz: float) -> float:
    """Exponentials per second of a GPU's multi-function units."""
    return sms * MUFU_RESULTS_PER_CLOCK_PER_SM * clock_hz


def _ceilings(matmul_tflops: float, datasheet_tb_per_s: float, sms: int, clock_ghz: float, source: str,
              measured_tb_per_s: float | None = None) -> GpuCeilings:
    memory = measured_tb_per_s * 1e12 if measured_tb_per_s else datasheet_tb_per_s * 1e12 * COPY_FRACTION_OF_DATASHEET
    return GpuCeilings(matmul_flops_per_s=matmul_tflops * 1e12, memory_bytes_per_s=memory,
                       exp_per_s=special_function_rate(sms, clock_ghz * 1e9), source=source)


_A100 = _ceilings(267.9, 2.039, 108, 1.41, f"{_MAMF} (A100 SXM, CUDA 12.1); HBM2e 2,039 GB/s (A100 datasheet)")
CEILINGS: dict[str, GpuCeilings] = {
    "a100-80gb": _A100,
    # The 40 GB SXM part has the same SMs and clocks; its HBM2 runs at 1,555 GB/s.
    "a100-40gb": _ceilings(267.9, 1.555, 108, 1.41, f"{_MAMF} (A100 SXM); HBM2 1,555 GB/s (A100 datasheet)"),
    "h100-80gb": _ceilings(792.1, 3.35, 132, 1.83, f"{_MAMF} (H100 SXM, CUDA 12.1); HBM3 3.35 TB/s (H100 datasheet)"),
    # The H200 is the H100's chip with HBM3e: its measured 8192^3 product (786.5 TFLOP/s) agrees
    # with the H100's MAMF within 1 %, and its copy bandwidth was measured, not scaled.
    "h200-141gb": _ceilings(786.5, 4.8, 132, 1.83, "benchmarks/gpu-step-profile-records/kernels.json (one H200, "
                            "torch 2.11: 8192^3 bf16 product, 1 GiB device copy)", measured_tb_per_s=4.168),
}


def gpu_ceilings(gpu: GpuSpec) -> GpuCeilings:
    """The ceilings of ``gpu``; a one-line refusal for a GPU no measurement covers."""
    ceilings = CEILINGS.get(gpu.name)
    if ceilings is None:
        raise ZeroplanError(
            "compute-model", f"roofline has no measured ceilings for gpu {gpu.name!r} "
            f"(allowed: {', '.join(sorted(CEILINGS))}); use --compute-model hfu",
        )
    return ceilings


def times_memory_bound(request: PlanRequest) -> bool:
    """Whether the flat-HFU model times the memory-bound kernels apart, at the GPU's copy
    bandwidth (a GPU zeroplan.core.roofline.ceilings has a bandwidth for, unless
    PerformanceAssumptions.memory_bound says 'in-hfu'); else its HFU covers every kernel."""
    return request.performance.memory_bound == "copy-bandwidth" and request.cluster.gpu.name in CEILINGS
