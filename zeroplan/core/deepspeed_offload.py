"""The staging buffers DeepSpeed allocates once under offload_optimizer (deepspeed 0.19.8), beside
the states the offload puts on the host (fp32 master, its gradient, the optimizer's states:
zeroplan.core.model_states). Measured to the byte on gloo (benchmarks/deepspeed-records
tiny-llama-zero2-offload and -zero3-offload: the record's kept buffers and host states)."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _bucket_elements, _model_dtype_bytes, _tensor_numels
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import StateConvention
from zeroplan.units import ceil_div


# stage3.py:333 puts the optimizer's own buffers on the host under offload_optimizer, and
# :780-784 allocates the ipg bucket on the accelerator whatever is offloaded: offload_param
# (zero3-param-offload, both offloads to the CPU) moves the parameter partitions, not these.
_STAGING_KINDS = (StrategyKind.zero2_offload, StrategyKind.zero3_offload, StrategyKind.zero3_param_offload)


def models_staging(request: PlanRequest) -> bool:
    """Whether the request is DeepSpeed's optimizer offload as modelled here: stage 2 or 3 under
    DeepSpeed's own state convention, with or without the parameter offload to the CPU (the NVMe
    variants stage otherwise)."""
    return request.strategy.kind in _STAGING_KINDS and request.convention is StateConvention.deepspeed


def _largest_tensor_elements(request: PlanRequest) -> int:
    return max(_tensor_numels(request), default=0)


# stage_1_and_2.py:626-635 (largest_param_numel) and :659-661: temp_grad_buffer_for_gpu_offload,
# torch.zeros(largest_param_numel) on the accelerator in the model dtype. stage3.py:780-784: the
# ipg bucket, torch.empty(reduce_bucket_size) on the accelerator with contiguous_gradients, as
# without offload.
def device_staging_bytes(request: PlanRequest) -> int:
    """The device buffers the offload keeps from the engine's start on (0 outside models_staging)."""
    if not models_staging(request):
        return 0
    e = _model_dtype_bytes(request)
    if request.strategy.kind is StrategyKind.zero2_offload:
        return _largest_tensor_elements(request) * e
    return _bucket_elements(request) * e if request.strategy.deepspeed_contiguous_gradients else 0


# stage_1_and_2.py:563-575: a copy of the rank's partition of the flat group in its own dtype
# (param_buffer_of_bit16_for_cpu_offload_groups) on the host, and :653-655
# temp_grad_buffer_for_cpu_offload, torch.zeros(largest_param_numel) on the host (self.device is
# the offload device) in the model dtype. stage3.py:791-793: grad_partitions_flat_buffer, each
# parameter's padded partition in gradient_accumulation_dtype, on self.device, the host under
# offload_optimizer (stage3.py:333).
def host_staging_bytes(request: PlanRequest) -> int:
    """The host buffers the offload keeps beside the offloaded states (0 outside models_staging)."""
    if not models_staging(request):
        return 0
    e = _model_dtype_bytes(request)
    group = request.shard_group_size
    numels = _tensor_numels(request)
    if request.strategy.kind is StrategyKind.zero2_offload:
        partition = flat_group_elements(sum(numels), group) // group
        return (partition + _largest_tensor_elements(request)) * e
    return sum(ceil_div(numel, group) for numel in numels) * e
