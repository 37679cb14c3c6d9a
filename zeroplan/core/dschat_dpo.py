"""What a DPO step of DeepSpeed-Chat holds beyond a causal-LM step, per rank (--objective dpo under
--framework hf; torchtune's LoRA DPO recipes are zeroplan.core.dpo).

DeepSpeed-Chat's step2_dpo_finetuning/main.py (deepspeedai/DeepSpeedExamples at 1842b4f):
the policy and a second, frozen reference copy of the model are both ``create_hf_model
(AutoModelForCausalLM, ...)`` (:270-300); the reference goes through ``deepspeed.initialize``
with get_eval_ds_config (:281-300, :433): ZeRO stage 0 unless the policy runs stage 3, fp16, no
optimizer, so the engine holds its parameters in the model dtype beside the policy's states. Each
step (:456-495) runs ``outputs = model(**batch, use_cache=False)`` on the batch whose first half
is the chosen and second half the rejected sequences (DataCollatorReward), ``with torch.no_grad():
ref_outputs = ref_model(**batch)`` (no use_cache argument: the config's, True for OPT, so the
output object carries every layer's K and V), get_batch_logps on each (:219-229:
``logits[:, :-1, :]``, ``.log_softmax(-1)`` in the logits' dtype, a gather of the labels'
log-probabilities), the DPO loss on 2 x pairs scalars, ``model.backward(loss)``,
``model.step()``. The loop's names ``outputs`` and ``ref_outputs`` hold both models' logits (and
the reference's cache) through backward and the step, until the next step rebinds them.

Where torchtune's recipes differ (zeroplan.core.dpo): the logits stay in the compute dtype (no
``.float()`` upcast, no temperature division: torchtune's three fp32 reference tensors are one
compute-dtype log-softmax here); both models' logits are held by the loop; the reference is a
separate model (torchtune's LoRA recipes disable the adapters on the policy's weights). Shared:
chosen and rejected in one forward of 2 x pairs rows (dpo_rows), the blocks' activations the
causal-LM formulas at those rows, the policy's log-softmax saved for backward.
"""

from __future__ import annotations

from zeroplan.core.params import total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing, Objective, StateConvention


def runs_dschat_dpo(request: PlanRequest) -> bool:
    """Whether the request is DeepSpeed-Chat's DPO step (objective dpo under framework hf)."""
    return request.training.objective is Objective.dpo and request.training.framework is Framework.hf


# main.py:281-300 and :433 (module docstring): the reference's engine at stage 0 casts the
# module to the model dtype and keeps it whole on each rank.
def reference_parameter_bytes(request: PlanRequest) -> int:
    """The frozen reference model's parameters on this rank (0 outside DeepSpeed-Chat's DPO)."""
    if not runs_dschat_dpo(request):
        return 0
    return total_parameters(request.model) * request.training.precision.compute_bytes


# main.py:472-474: the loop's ``outputs`` (the policy's logits, b x s x V in the compute dtype:
# OPTForCausalLM returns ``self.lm_head(outputs[0]).contiguous()``, 4.47.1 modeling_opt.py:1189)
# and ``ref_outputs`` (the reference's logits, and its past_key_values: each layer's K and V of
# b x s x kv width, the tuple cache of releases before OPT moved to Cache classes).
def held_outputs_tensors(request: PlanRequest) -> tuple[int, ...]:
    """What the loop holds through backward beyond what backward needs: both logits, the reference's cache."""
    model, batch, e = request.model, request.batch, request.training.precision.compute_bytes
    logits = e * batch.micro_batch_size * batch.seq_len * model.vocab_size
    layer_kv = e * batch.micro_batch_size * batch.seq_len * model.kv_size
    return (logits, logits, *(layer_kv, layer_kv) * model.num_layers)


# main.py:494-495 and the next step's :472 (module docstring): ``outputs`` and ``ref_outputs``
# are rebound only by the next step's forwards, so they are alive at ``model.step()``: the
# published log's MemAllocated after each step (5.53 GiB at OPT-350m, 4 rows x 512) is the
# states, the reference's parameters and these, 0.58 GiB of them. The plan's step moment holds
# no activations (zeroplan.core.kv_cache.kept_outputs_bytes): they join the step's temporaries.
def held_through_step_bytes(request: PlanRequest) -> int:
    """What the loop holds at the optimizer step beyond the states (0 outside DeepSpeed-Chat's DPO)."""
    return sum(held_outputs_tensors(request)) if runs_dschat_dpo(request) else 0


# main.py:219-229 get_batch_logps on the policy's logits: the slice is a view, log_softmax makes
# b x (s - 1) x V in the logits' dtype and LogSoftmaxBackward keeps it; on the reference's, under
# no grad, the same log-softmax is a transient gathered and freed. Backward: GatherBackward's
# zeroed b x (s - 1) x V gradient with the scattered values, _log_softmax_backward_data's gradient
# beside it and the saved log-softmax, then SliceBackward's zeroed b x s x V gradient beside the
# log-softmax's, which lm_head's backward reads.
def dschat_dpo_logits_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The head's moments beyond the held logits (held_outputs_tensors, counted with the
    activations): the reference's log-softmax beside the policy's saved one, then backward's."""
    b, s, v = request.batch.micro_batch_size, request.batch.seq_len, request.model.vocab_size
    e = request.training.precision.compute_bytes
    shifted, whole = e * b * (s - 1) * v, e * b * s * v
    return (shifted, shifted), (shifted, shifted, shifted), (shifted, whole)


# What DeepSpeed-Chat's DPO script runs (module docstring): its engine (the deepspeed convention:
# stage 0 as ddp with --state-convention deepspeed, or ZeRO-1/2, the reference then at stage 0),
# a full fine-tune, data parallelism alone; its --lora_dim is its own LinearLayer_LoRA and its
# --gradient_checkpointing, --offload_reference_model and ZeRO-3 reference are not planned.
def check_dschat_dpo(request: PlanRequest) -> None:
    """Refuse, in one line naming the field, a DeepSpeed-Chat DPO step not planned."""
    if not runs_dschat_dpo(request):
        return
    training, parallel = request.training, request.parallel
    if request.convention is not StateConvention.deepspeed or request.strategy.kind.zero_stage == 3:
        raise ZeroplanError("objective", "dpo under hf is DeepSpeed-Chat's step 2 under DeepSpeed's engine with its reference "
                            "at stage 0 (allowed: ddp with state convention deepspeed, zero1, zero2)")
    if request.strategy.kind.offloads_optimizer or request.strategy.kind.offloads_parameters:
        raise ZeroplanError("strategy", "DeepSpeed-Chat's DPO with offload is not planned (allowed: no offload)")
    if training.finetune.is_lora or request.model.is_encoder_decoder:
        raise ZeroplanError("finetune", "dpo under hf plans DeepSpeed-Chat's full fine-tune of a decoder (allowed: no "
                            "LoRA; its --lora_dim LinearLayer_LoRA is not peft's)")
    if training.activation_checkpointing is not ActivationCheckpointing.none:
        raise ZeroplanError("activation_checkpointing", "DeepSpeed-Chat's DPO is planned without checkpointing (allowed: none)")
    if field := training.first_switched_on(("keep_outputs", "use_cache", "unchunked_loss", "compile",
                                             "fused_linear_cross_entropy", "fused_cross_entropy", "uncast_loss",
                                             "activation_offloading")):
        raise ZeroplanError(field, "is not planned with objective dpo under hf: the loop's held outputs and the "
                                   "reference's cache are the objective's own (allowed: off)")
    if (parallel.tp, parallel.cp, parallel.pp, parallel.ep) != (1, 1, 1, 1):
        raise ZeroplanError("parallel", "dpo is planned with data parallelism alone (allowed: tp, cp, pp, ep all 1)")
