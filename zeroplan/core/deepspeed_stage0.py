"""DeepSpeed's unpartitioned optimizer, ``zero_optimization.stage`` 0: the ddp strategy under the
deepspeed state convention, run by DeepSpeed 0.19.8's own engine.

runtime/engine.py _do_optimizer_sanity_check picks the wrapper: under fp16 FP16 and under bf16
DDP_BFLOAT16 (grad_accum_dtype unset, so the model dtype), both _configure_fp16_optimizer, which
wraps a torch optimizer (not a FusedAdam) in runtime/fp16/unfused_optimizer.py
FP16_UnfusedOptimizer; under fp32 the torch optimizer steps the parameters itself. The engine
casts the module to 16 bits (no autocast); the wrapper's fp32 master is one clone per parameter
(unfused_optimizer.py __init__), none under fp32 (zeroplan.core.model_states). Measured on gloo,
2 ranks, accumulation 1 and 2 (benchmarks/deepspeed-accumulation-records records-zero0-*.json,
tests/test_deepspeed_stage0.py), per rank with Psi trainable elements and e the model dtype's bytes:

| precision | parameters | master + AdamW | between micro-steps | at the step | after it |
| --- | --- | --- | --- | --- | --- |
| fp16, bf16 | Psi 2 | Psi 4 + Psi 8 | Psi 2 (param.grad) | Psi 2 + Psi 4 (master .grad) | 0 |
| fp32 | Psi 4 | Psi 8 | Psi 4 (param.grad) | Psi 4 | 0 |

(AdamW's states include a 4-byte step per tensor.) The gradients are all-reduced once backward
ends at the accumulation boundary, through flat buckets the engine makes and frees one at a time
(allreduce_bucket_elements).
"""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _model_dtype_bytes, _tensor_numels, runs_deepspeed_engine
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision

# deepspeed 0.19.8 runtime/engine.py:151 MEMORY_OPT_ALLREDUCE_SIZE, the default bucket_size of
# allreduce_gradients (:3073), which backward calls without one (:3165): stage 0 reads no
# reduce_bucket_size.
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000

PLANNED_PRECISIONS = (Precision.fp32, Precision.bf16_mixed, Precision.fp16_mixed)
"""The precisions measured at stage 0 (DeepSpeed runs no other: bf16 parameters with bf16
states are not a DeepSpeed precision)."""


def runs_deepspeed_stage0(request: PlanRequest) -> bool:
    """Whether DeepSpeed's engine runs the request at ZeRO stage 0: the ddp strategy under its
    state convention (megatron-core, which plans under the convention with its own DDP, aside)."""
    return request.strategy.kind is StrategyKind.ddp and runs_deepspeed_engine(request)


def check_deepspeed_stage0(request: PlanRequest) -> None:
    """Refuse, in one line, what stage 0 is not measured with."""
    if not runs_deepspeed_stage0(request):
        return
    training, parallel = request.training, request.parallel
    if training.precision not in PLANNED_PRECISIONS:
        raise ZeroplanError("training.precision", f"{training.precision.value} under DeepSpeed's stage 0 is not planned "
                            f"(allowed: {', '.join(p.value for p in PLANNED_PRECISIONS)})")
    if (parallel.tp, parallel.pp, parallel.cp, parallel.ep) != (1, 1, 1, 1):
        # engine.py _do_optimizer_sanity_check: under the pipeline engine bf16 runs BF16_Optimizer.
        raise ZeroplanError("parallel", "DeepSpeed's stage 0 is measured with data parallelism alone "
                                        "(allowed: tp, pp, cp and ep 1)")
    if training.optimizer_in_backward or training.paged_optimizer or training.fsdp_cpu_offload:
        raise ZeroplanError("training", "DeepSpeed's stage 0 steps its optimizer after backward on the GPU "
                                        "(allowed: no optimizer in backward, paged optimizer or CPU offload)")


def trainable_elements(request: PlanRequest) -> int:
    return sum(_tensor_numels(request))


# engine.py backward -> allreduce_gradients: at a micro-step that is not the boundary nothing is
# reduced, so every parameter's .grad (the model dtype) accumulates in autograd.
def between_micro_steps_bytes(request: PlanRequest) -> int:
    return trainable_elements(request) * _model_dtype_bytes(request)


# unfused_optimizer.py step: fp32_param.grad = fp16_param.grad.to(fp32) for every parameter
# before self.optimizer.step(), with the 16-bit gradients still held (zero_grad frees them after
# the step); under fp32 AdamW reads param.grad itself.
def step_gradient_bytes(request: PlanRequest) -> int:
    elements = trainable_elements(request)
    fp32_copies = elements * 4 if request.training.precision.is_mixed else 0
    return elements * _model_dtype_bytes(request) + fp32_copies


# engine.py:3828-3839 allreduce_no_retain: gradients in registration order
# (_get_gradients_for_reduction walks module.parameters()) join a bucket until its elements pass
# numel_per_bucket, then it is flattened (allreduce_bucket: _flatten_dense_tensors, one torch.cat
# in the communication dtype, the model dtype by default), all-reduced, copied back and freed.
def allreduce_bucket_elements(numels: list[int], per_bucket: int = ALLREDUCE_BUCKET_ELEMENTS) -> list[int]:
    """The elements of each flat bucket, in the order they are all-reduced."""
    buckets, elements = [], 0
    for numel in numels:
        elements += numel
        if elements > per_bucket:
            buckets.append(elements)
            elements = 0
    if elements:
        buckets.append(elements)
    return buckets


def allreduce_bucket_bytes(request: PlanRequest) -> list[int]:
    e = _model_dtype_bytes(request)
    return [elements * e for elements in allreduce_bucket_elements(_tensor_numels(request))]


def backward_end_buffer_bytes(request: PlanRequest) -> int:
    """The largest flat bucket, beside every gradient, at the end of the boundary's backward."""
    return max(allreduce_bucket_bytes(request), default=0)
