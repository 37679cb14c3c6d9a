"""The staging buffers DeepSpeed allocates once under offload_optimizer (deepspeed 0.19.8), beside
the states the offload puts on the host (fp32 master, its gradient, the optimizer's states:
zeroplan.core.model_states). Measured to the byte on gloo (benchmarks/deepspeed-records
tiny-llama-zero2-offload and -zero3-offload: the record's kept buffers and host states)."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _bucket_elements, _model_dtype_bytes, _tensor_numels
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.specs.framework import EARLIER_HF_DEEPSPEED_RELEASES, Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import StateConvention
from zeroplan.units import FP32_BYTES, ceil_div


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


OVERFLOW_CHECK_BYTES_16BIT = 11
"""_has_inf_or_nan's most live bytes an element of a 16-bit gradient: x.float() (4), isnan (1),
isinf (1), logical_or (1) and inf_or_nan.float() (4) alive at once."""
OVERFLOW_CHECK_BYTES_FP32 = 7
"""The same for an fp32 gradient, whose x.float() is x itself."""
NORM_COPY_BYTES = 8
"""set_norm_for_param_grad_in_gpu's .double() of the gradient's slice in the partition."""


def _zero2_offload_under_hf(request: PlanRequest, releases: tuple[str, ...]) -> bool:
    return (request.strategy.kind is StrategyKind.zero2_offload and request.convention is StateConvention.deepspeed
            and request.training.framework is Framework.hf and request.training.deepspeed_release in releases)


def models_gradient_path(request: PlanRequest) -> bool:
    """Whether the backward's end is ZeRO-2's offload gradient path of DeepSpeed before 0.18.0
    (hf, deepspeed_release 0.13.3 or 0.14.2), tensor by tensor."""
    return _zero2_offload_under_hf(request, EARLIER_HF_DEEPSPEED_RELEASES)


# v0.14.2 runtime/zero/stage_1_and_2.py:1320-1329 copy_grads_in_partition: under offload_optimizer,
# at the accumulation boundary, each gradient in the rank's partition goes through, one after
# another and beside the gradient itself, set_norm_for_param_grad_in_gpu (:1244-1257, its slice's
# .double().norm(2)), update_overflow_tracker_for_param_grad (:1167-1170 -> _has_inf_or_nan
# :2020-2025 on the whole gradient: x.float(), isnan, isinf, logical_or, .float()) and
# async_inplace_copy_grad_to_fp32_buffer_from_gpu (:1259-1275, its slice .float() on the GPU before
# the non-blocking copy to the host). The same text from v0.9.0 to v0.17.x (0.18.0 replaced the
# overflow tracker). Run on CPU tensors under a dispatch mode that counts live storages, those
# functions' own text (v0.14.2) holds 11, 8 and 4 bytes an element of a 16-bit gradient (7, 8 and
# 0 of an fp32 one). A gradient larger than the bucket is reduced alone (:944-946
# extra_large_param_to_reduce) at the next hook or, for the last one (Llama's embedding, the
# first registered), by the epilogue's reduce_ipg_grads (:754) once backward has ended, with the
# bucket still allocated (released at :790): the backward's end holds the largest gradient and its
# temporaries on the rank whose partition it falls in.
def gradient_path_bytes(request: PlanRequest) -> int:
    """The largest gradient and the most its offload path holds beside it (0 outside
    models_gradient_path)."""
    if not models_gradient_path(request):
        return 0
    from zeroplan.core.deepspeed_step import largest_partition_piece_elements

    numels = _tensor_numels(request)
    largest = _largest_tensor_elements(request)
    e = _model_dtype_bytes(request)
    overflow = OVERFLOW_CHECK_BYTES_FP32 if e == 4 else OVERFLOW_CHECK_BYTES_16BIT
    piece = largest_partition_piece_elements(numels, request.shard_group_size)
    return largest * e + max(overflow * largest, NORM_COPY_BYTES * piece)


# v0.14.2 runtime/zero/stage_1_and_2.py:1868-1871 step: under offload_optimizer, after the host's
# AdamW, bit16_partitions[partition_id].data.copy_(fp32_partition.to(current_device_name()).data):
# the rank's whole fp32 master partition is copied onto the GPU, then cast into the 16-bit one
# (commit ec16120, "fix pagable h2d memcpy", first in v0.14.1). v0.17.0 copies it through a 16-bit
# pinned host buffer instead (commit 17c8be0, "Fix the GPU memory usage of ZeRO-Offload": "the
# memory usage is about 3x that of params_FP16"); v0.13.3's step has no such copy.
def step_upcopy_bytes(request: PlanRequest) -> int:
    """The fp32 partition the step copies onto the GPU (hf, deepspeed_release 0.14.2; else 0)."""
    if not _zero2_offload_under_hf(request, ("0.14.2",)):
        return 0
    group = request.shard_group_size
    return flat_group_elements(sum(_tensor_numels(request)), group) // group * FP32_BYTES
