"""PEFT's ``modules_to_save``: a module trained whole beside the LoRA adapters, its trainable deep
copy's parameter, gradient and optimizer states (and DDP's bucket copy of its gradient, and the
optimizer step's temporary over it), terms added to the per-rank model states and buffers.

peft 0.17.1 utils/other.py:498-527 ``ModulesToSaveWrapper.update`` keeps the wrapped module as
``original_module`` (``requires_grad_(False)``) and trains ``copy.deepcopy(original_module)``;
the forward runs the copy (``_forward_wrapped``, :481-484). peft 0.5.0 (the release of
September 2023) does the same in utils/other.py:151-186: ``_set_trainable`` (:202-213) sets
``requires_grad`` on the original before wrapping it and nothing clears it, but the forward runs
the copy only, so the original never gets a gradient and torch's optimizers skip it (they step
a parameter only where ``p.grad is not None``). The frozen original stays where the base keeps
it (zeroplan.core.finetune.storage); this module adds the copy.

The copy keeps the dtype of the module it copies: ``get_peft_model``'s fp32 upcast
(tuners_utils.py:353-393 ``_cast_adapter_dtype``) walks ``BaseTunerLayer`` modules only, and a
ModulesToSaveWrapper is none (utils/other.py:221, :468). So under the Trainer's bf16 autocast a
bf16 base trains a bf16 copy, with bf16 gradients and AdamW states (torch.optim's states are
``zeros_like(p)``), beside fp32 adapters; prepare_model_for_kbit_training (an hf quantized base)
casts the embedding and head to fp32 before peft copies them. Measured on the CPU:
tests/test_modules_to_save.py.
"""

from __future__ import annotations

from zeroplan.core.optimizer_states import elementwise_state_bytes, step_counter_bytes
from zeroplan.core.param_tensors import ParamTensor
from zeroplan.core.params import parameter_units
from zeroplan.specs.finetune import BaseDtype, SavedModule
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Optimizer, OptimizerLoop, Precision, TrainingSpec


def saved_module_tensors(request: PlanRequest) -> tuple[ParamTensor, ...]:
    """The tensors the trainable copies hold: the token embedding's weight ('embed') and the
    untied head's weight and bias ('head'), one copy each (nothing without modules_to_save)."""
    return saved_tensors_of(request.model, request.training.finetune.modules_to_save)


def saved_tensors_of(model: ModelSpec, saved: tuple[SavedModule, ...]) -> tuple[ParamTensor, ...]:
    if not saved:
        return ()
    units = parameter_units(model)
    tensors: list[ParamTensor] = []
    if SavedModule.embed in saved:
        tensors += [t for t in units[0].tensors if t.name == "token.weight"]
    if SavedModule.head in saved:
        tensors += [t for t in units[-1].tensors if t.name.startswith("lm_head.")]
    return tuple(tensors)


def saved_copy_elements(request: PlanRequest) -> int:
    return sum(t.numel for t in saved_module_tensors(request))


def copy_element_bytes(request: PlanRequest) -> int:
    return copy_element_bytes_of(request.training)


def copy_element_bytes_of(training: TrainingSpec) -> int:
    """Bytes per element of the copy, its gradient and each of its optimizer states: the dtype
    of the module it copies (fp32 under fp32 training, an fp32 load or hf's kbit fp32 cast; else
    the 16-bit base)."""
    finetune = training.finetune
    if (training.precision is Precision.fp32 or finetune.base_dtype is BaseDtype.fp32
            or finetune.hf_casts_rest_to_fp32(training.framework)):
        return 4
    return 2


def copy_parameter_bytes(request: PlanRequest) -> int:
    return saved_copy_elements(request) * copy_element_bytes(request)


def copy_gradient_bytes(request: PlanRequest) -> int:
    """The copy's .grad, in its own dtype (AccumulateGrad keeps the parameter's dtype)."""
    return saved_copy_elements(request) * copy_element_bytes(request)


def copy_optimizer_state_bytes(request: PlanRequest) -> int:
    """The element-wise optimizer's states of the copy (zeros_like(p): the copy's dtype;
    check_saved_module_training refuses the other optimizers); step counters apart."""
    return saved_copy_elements(request) * elementwise_state_bytes(request.training.optimizer, copy_element_bytes(request))


def copy_step_counter_bytes(request: PlanRequest) -> int:
    """A step counter per copied tensor (torch.optim.AdamW's 0-dim fp32 ``step``)."""
    return step_counter_bytes(request.training.optimizer, len(saved_module_tensors(request)))


def largest_copy_tensor_bytes(request: PlanRequest) -> int:
    """The copy's largest tensor (its gradient and each state are as large); 0 without one."""
    tensors = saved_module_tensors(request)
    return max((t.numel for t in tensors), default=0) * copy_element_bytes(request)


# torch/nn/parallel/distributed.py (gradient_as_bucket_view False, the Trainer's default): the
# Reducer copies each gradient into bucket storage of the gradient's dtype, kept between steps
# (zeroplan.core.buffers.ddp_bucket_bytes); at one GPU nothing is wrapped.
def copy_bucket_bytes(request: PlanRequest) -> int:
    if request.strategy.ddp_gradient_as_bucket_view or request.cluster.world_size == 1:
        return 0
    return copy_gradient_bytes(request)


# torch 2.13 optim/adam.py:553 _multi_tensor_adam (its group loop from :638, the sqrt at :762 and
# :790): the tensors are grouped by device and dtype (optimizer.py:545
# _group_tensors_by_device_and_dtype) and each group's ``exp_avg_sq_sqrt =
# torch._foreach_sqrt(device_exp_avg_sqs)`` is a new list of the group's size, bound to the same
# name in the next group's turn only after that group's list is made: the copy's group (16-bit)
# and the adapters' (fp32) temporaries are alive together. _single_tensor_adam (for-loop) makes
# two temporaries of one tensor at a time (zeroplan.core.buffers.for_loop_step_temporary_bytes);
# fused makes none.
def copy_step_temporary_bytes(request: PlanRequest, loop: OptimizerLoop | None) -> tuple[int, int]:
    """(bytes the foreach step adds beside the adapters' temporary, bytes of the for-loop's
    temporaries over the copy's largest tensor) under ``loop`` (None: the step makes none,
    zeroplan.core.buffers.step_makes_temporary)."""
    tensors = saved_module_tensors(request)
    if not tensors or loop is None or loop is OptimizerLoop.fused:
        return 0, 0
    e = copy_element_bytes(request)
    if loop is OptimizerLoop.for_loop:
        copies = 1 if request.training.optimizer is Optimizer.lion else 2
        return 0, copies * max(t.numel for t in tensors) * e
    return sum(t.numel for t in tensors) * e, 0
