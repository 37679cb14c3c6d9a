"""The KV cache a Hugging Face forward builds in training, and the output object a training loop
may hold through backward (TrainingSpec.use_cache, TrainingSpec.keep_outputs; docs/frameworks.md,
"KV cache"). Nothing here imports torch; benchmarks/kv-cache-records measure it from
transformers' own Llama (zeroplan.frameworks.kv_cache).

transformers 4.56.2 LlamaConfig defaults use_cache=True (models/llama/configuration_llama.py:173)
and only its own gradient checkpointing turns the cache off (utils/generic.py:981-985,
modeling_layers.py:66-68). Without checkpointing the cache holds the very K and V each
attention saves for backward (nothing more); under checkpointing applied from outside
transformers (torch's checkpoint_wrapper: llama-recipes' FSDP runs, accelerate's
fsdp_activation_checkpointing) the blocks keep only their inputs and the cache keeps every
layer's K and V besides, for as long as the model's output object is alive.
"""

from __future__ import annotations

from zeroplan.core.dschat_dpo import held_outputs_tensors, runs_dschat_dpo
from zeroplan.core.transformers_release import (
    opt_loss_tensors, returned_logit_bytes, returns_fp32_logits, runs_opt_own_forward, shifts_logits_copy,
)
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.units import FP32_BYTES


# transformers 4.56.2 models/llama/modeling_llama.py:244-246 LlamaAttention.forward hands each
# layer's post-RoPE key_states and value_states ([b, kv_heads, s, head_dim]) to
# past_key_values.update; cache_utils.py:116-118 DynamicLayer.update keeps their concatenation
# onto an empty tensor, a copy of each. Measured (benchmarks/kv-cache-records, Llama-2-7B, s 2048,
# b 4, bf16 module): a layer under torch's checkpoint_wrapper keeps 134,217,728 bytes more with the
# cache than without, 2 x 2 bytes x 4 x 2048 x 4096; without checkpointing 33,554,432 bytes less
# (the attention saves the cache's own tensors, and without a cache 4.56.2 builds an explicit
# b x s x s causal mask, which the CPU kernel converts and saves per layer: masking_utils.py
# 734-739, 805-807). Releases before 4.36 (a (key_states, value_states) tuple per layer,
# returned as the layer's `present`) keep the same two tensors, in the compute dtype (4.31's
# rotary cos/sin are cast to the values' dtype; 4.56.2 under CPU autocast keeps them fp32, but
# only without checkpointing, where the cache adds nothing).
def kv_cache_tensors(request: PlanRequest) -> tuple[int, ...]:
    """The cache's K and V of every layer in forward order (bytes each), beyond what the blocks
    keep: empty without the cache or without checkpointing."""
    training = request.training
    if not training.use_cache or training.activation_checkpointing is ActivationCheckpointing.none:
        return ()
    model, batch = request.model, request.batch
    one = training.precision.compute_bytes * batch.seq_len * batch.micro_batch_size * model.kv_size
    return (one, one) * model.num_layers


def kv_cache_bytes(request: PlanRequest) -> int:
    return sum(kv_cache_tensors(request))


# transformers 4.56.2 LlamaForCausalLM.forward (modeling_llama.py:473-477) with labels: lm_head's
# logits in the compute dtype (the output object's `logits`), then loss/loss_utils.py:55 ForCausalLMLoss
# upcasts them (`logits.float()`) and F.cross_entropy saves the fp32 log-softmax: e + 4 + 4 bytes
# a logit at once; the fp32 copy goes when the loss returns (log_softmax's backward keeps only its
# output). The cache is alive through all of it: the loss is formed inside the model's forward.
# Measured (benchmarks/kv-cache-records): the forward's peak is what it returns with the output
# object held plus the fp32 copy, to the byte. An fp32 module's `.float()` returns the logits
# themselves (torch Tensor.to with the dtype it has): no copy. Older releases
# (zeroplan.core.transformers_release): before 4.49 the loss also copies the shifted fp32 logits
# (b x (s - 1) rows, which the log-softmax then covers); before 4.46 the forward itself upcasts,
# so the output object carries the fp32 logits and lm_head's compute-dtype output is gone by the
# time the loss runs (Tensor.float saves nothing for backward).
def loss_forward_tensors(request: PlanRequest) -> tuple[int, ...]:
    """The loss's tensors at its forward, in the order they are made."""
    training = request.training
    b, s, v = request.batch.micro_batch_size, request.batch.seq_len, request.model.vocab_size
    if runs_opt_own_forward(request.model, training):
        return opt_loss_tensors(request.model, training, s, b)[0]
    e = training.precision.compute_bytes
    returned = returned_logit_bytes(training) * s * b * v
    upcast = (FP32_BYTES * s * b * v,) if e != FP32_BYTES and not returns_fp32_logits(training) else ()
    if not shifts_logits_copy(training):
        return returned, *upcast, FP32_BYTES * s * b * v
    shifted = FP32_BYTES * (s - 1) * b * v
    return returned, *upcast, shifted, shifted


# llama-recipes before its PR 41 (utils/train_utils.py: `outputs = model(**batch); loss =
# outputs.loss; loss.backward()`): the loop's `outputs` holds the output object (its logits, its
# past_key_values) through backward and the optimizer step, until the next forward returns. The
# logits are what LlamaForCausalLM returns (4.56.2: lm_head's output, the compute dtype; fp32
# before 4.46, zeroplan.core.transformers_release). The
# planner counts them with the activations (zeroplan.core.plan), so at the loss's and the blocks'
# backward and, with the loss's forward moment of the next step, as two steps' outputs; the end of
# backward and the optimizer step, which hold no activations, do not count them (a moment the
# micro-batch terms of the plan search would have to carry apart).
def kept_outputs_bytes(request: PlanRequest) -> int:
    """What a loop that holds the model's output object keeps beyond what backward needs."""
    if runs_dschat_dpo(request):
        # DeepSpeed-Chat's DPO loop holds both models' outputs (zeroplan.core.dschat_dpo).
        return sum(held_outputs_tensors(request))
    if not request.training.keep_outputs:
        return 0
    if request.training.framework is Framework.torchtune:
        return torchtune_kept_logits_bytes(request)
    sbv = request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    return returned_logit_bytes(request.training, request.model) * sbv + kv_cache_bytes(request)


# torchtune's single-device LoRA recipe before August 2024 (recipes/lora_finetune_single_device.py
# at ff594c2, lines 447-468, and at 8e03661, lines 569-578): `logits = self._model(...)`, whose
# TransformerDecoder upcasts the output projection (modules/transformer.py:210 at ff594c2, :246 at
# 8e03661: `self.output(h).float()`), then `logits = logits[..., :-1, :].contiguous()` rebinds the
# loop's name to an fp32 copy of the shifted rows, `logits.transpose(1, 2)` and the loss. The loop
# holds that copy through `loss.backward()` and the optimizer step, until the next forward rebinds
# it (the whole upcast goes at the rebinding: the slice's backward keeps only its shape). Its
# nn.CrossEntropyLoss keeps the log-softmax of those rows, which the unchunked loss counts
# (zeroplan.core.framework_loss.torchtune_unchunked_logits_tensors); the held copy is beyond it.
# 0.6.1 frees the logits before backward (`del logits` in _loss_step) and shifts the labels instead.
def torchtune_kept_logits_bytes(request: PlanRequest) -> int:
    """The fp32 shifted logits a pre-August-2024 torchtune loop holds through backward."""
    b, s, v = request.batch.micro_batch_size, request.batch.seq_len, request.model.vocab_size
    return FP32_BYTES * b * (s - 1) * v
