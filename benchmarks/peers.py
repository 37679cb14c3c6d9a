"""Other estimators' model-state formulas, restated so benchmarks can print them beside
zeroplan's predictions on the same cases.

DeepSpeed: deepspeed/runtime/zero/stage_1_and_2.py (estimate_zero2_model_states_mem_needs)
and deepspeed/runtime/zero/stage3.py (estimate_zero3_model_states_mem_needs), without
their additional_buffer_factor (1.5, applied to host memory only). llm-analysis is used
through its own package when installed (`pip install llm-analysis`); it is optional.
"""

from __future__ import annotations


# stage_1_and_2.py: GPU = fp16 params and grads (4 bytes) + 16 bytes/param of fp32 master,
# Adam states and fp32 gradients split over the GPUs; with CPU offload only the fp16 params.
def deepspeed_zero2_gpu_bytes(total_params: int, total_gpus: int, cpu_offload: bool) -> int:
    if cpu_offload:
        return 2 * total_params
    return 4 * total_params + int(16 * total_params / total_gpus)


# stage3.py: GPU = the largest layer gathered in fp32-sized buffers (4 bytes/param) + 18 bytes
# per param split over the GPUs; optimizer offload leaves 2 bytes/param, param offload none.
def deepspeed_zero3_gpu_bytes(
    total_params: int, largest_layer_params: int, total_gpus: int, cpu_offload: bool, cpu_offload_params: bool
) -> int:
    largest_layer = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        return largest_layer
    if cpu_offload:
        return largest_layer + int(2 * total_params / total_gpus)
    return largest_layer + int(18 * total_params / total_gpus)


def llm_analysis_available() -> bool:
    try:
        import llm_analysis  # noqa: F401
    except ImportError:
        return False
    return True
