"""Temporary and communication buffers alive during backward, and the optimizer step's
temporaries. Each term names the library behaviour it models."""

from __future__ import annotations

from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.model_states import padded_unit_elements_of
from zeroplan.core.params import total_parameters
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Optimizer


# torch/nn/parallel/distributed.py, gradient_as_bucket_view: "if False, gradients are copied
# into bucket storage ... setting it True saves memory equal to the total gradient size".
def ddp_bucket_bytes(request: PlanRequest, gradient_bytes_per_element: int) -> int:
    if request.strategy.ddp_gradient_as_bucket_view:
        return 0
    return total_parameters(request.model) * gradient_bytes_per_element


# deepspeed/runtime/zero/stage_1_and_2.py: gradients are reduced through an "ipg" bucket of
# reduce_bucket_size elements (allocated once, in the gradient dtype).
def zero_reduce_bucket_bytes(request: PlanRequest, gradient_bytes_per_element: int) -> int:
    elements = min(request.strategy.zero_bucket_elements, total_parameters(request.model))
    return elements * gradient_bytes_per_element


# ZeRO paper sec. 5.3 / FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):
# a unit is all-gathered before use; with prefetching the next unit's gather is in flight,
# so (1 + prefetch) unsharded units are alive, plus the unsharded gradient of the unit being
# reduce-scattered.
def gathered_unit_bytes(request: PlanRequest, bytes_per_element: int, gradient_bytes_per_element: int) -> int:
    padded = padded_unit_elements_of(request, request.shard_group_size)
    largest = max(padded)
    if request.strategy.kind is StrategyKind.fsdp_shard_grad_op:
        # reshard_after_forward=False: every unit stays gathered from forward through backward.
        gathered = sum(padded) * bytes_per_element
    else:
        gathered = (1 + request.strategy.prefetch_units) * largest * bytes_per_element
    return gathered + largest * gradient_bytes_per_element


def backward_buffer_bytes(request: PlanRequest) -> int:
    """Communication and gathering buffers alive during backward, on one GPU."""
    kind = request.strategy.kind
    eb = element_bytes(request.training.precision, request.convention)
    if kind is StrategyKind.ddp:
        return ddp_bucket_bytes(request, eb.gradient)
    if kind.zero_stage in (1, 2):
        buffers = zero_reduce_bucket_bytes(request, eb.compute_parameter)
    else:
        buffers = gathered_unit_bytes(request, eb.compute_parameter, gradient_wire_bytes(request))
    accumulating = request.batch.grad_accum_steps > 1 and request.strategy.keep_unsharded_grads_on_accum
    if accumulating and kind.zero_stage >= 2:
        # no_sync(): unsharded gradients accumulate locally until the last micro-batch.
        buffers += total_parameters(request.model) * eb.compute_parameter
    return buffers


# torch/optim/adam.py, _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) materialises one
# state-sized temporary per step (foreach is the default on CUDA); Lion's interpolation of
# momentum and gradient likewise. SGD updates in place; bitsandbytes and Adafactor use fused
# or factored kernels whose temporaries are not modelled.
_STEP_TEMPORARY_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw, Optimizer.lion)


def optimizer_step_temporary_bytes(request: PlanRequest, optimizer_elements: int) -> int:
    if request.strategy.kind.offloads_optimizer:
        return 0
    if request.training.optimizer not in _STEP_TEMPORARY_OPTIMIZERS:
        return 0
    eb = element_bytes(request.training.precision, request.convention)
    return optimizer_elements * eb.optimizer_dtype
