"""What transformers' eager attention holds at its softmax's backward on a GPU, beyond zeroplan's
block-backward moment (docs/memory-model.md, "Peak"): the scores' gradients and the CUDA
kernel's temporary, less what the block's backward has freed by then. Read from torch's and
transformers' sources (each on the line above its function); the tensors alive at that moment
are measured on transformers' own LlamaDecoderLayer on the CPU (tests/test_hf_eager_backward.py).
Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.activations import layer_terms, norm_bytes
from zeroplan.core.finetune.activations import lora_after_attention_delta_bytes
from zeroplan.core.frameworks import eager_attention_extra_bytes, hf_bf16_norm_savings_bytes
from zeroplan.core.transformers_release import opt_clamp_score_bytes, upcasts_softmax
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import AttentionKernel, Precision
from zeroplan.units import FP32_BYTES


def runs_eager_softmax(request: PlanRequest) -> bool:
    """Whether the request's blocks run transformers' eager attention op by op (hf, eager, not
    compiled: under torch.compile Inductor plans the block, zeroplan.core.compiled)."""
    training = request.training
    return (training.framework is Framework.hf and training.attention_kernel is AttentionKernel.eager
            and not training.compile and not request.model.is_encoder_decoder)


# transformers 4.56.2 models/llama/modeling_llama.py eager_attention_forward (lines 181-190; 4.31.0
# LlamaAttention.forward, lines 327-347, the same ops): F.softmax(scores, dim=-1,
# dtype=torch.float32). torch 2.13 aten/src/ATen/native/SoftMax.cpp softmax: a CUDA fp16 input
# with dtype float runs _softmax(input, dim, half_to_float=true), any other converts the input
# to fp32 first and runs _softmax in fp32. OPT's own attention before transformers 4.49 runs
# the softmax in the compute dtype but in fp16 (zeroplan.core.transformers_release.upcasts_softmax).
def score_elements(request: PlanRequest) -> int:
    """Elements of one block's scores tensor (b x heads x s x s), the size of every tensor here."""
    batch = request.batch
    return request.model.num_heads * batch.seq_len ** 2 * batch.micro_batch_size


def softmax_element_bytes(request: PlanRequest) -> int:
    """Bytes of one element of the softmax's output (and of the gradient reaching it)."""
    e = request.training.precision.compute_bytes
    return FP32_BYTES if upcasts_softmax(request.model, request.training, autocast=request.runs_under_autocast) else e


def softmax_input_gradient_bytes(request: PlanRequest) -> int:
    """Bytes of one element of the gradient the softmax's backward writes: the input's dtype,
    fp16 under half_to_float, else the dtype the softmax ran in."""
    training = request.training
    if upcasts_softmax(request.model, training, autocast=request.runs_under_autocast) and training.precision is Precision.fp16_mixed:
        return training.precision.compute_bytes
    return softmax_element_bytes(request)


# torch 2.13 aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda_out (the structured
# kernel of _softmax_backward_data: its output, grad_input, is allocated before it runs):
# `Tensor tmp = grad * output;` then host_softmax_backward(tmp, output, dim, half_to_float,
# grad_input). So while it runs, the gradient of the probabilities (the cast's backward made it
# in the softmax's dtype), the product tmp (that dtype) and grad_input are alive beside the
# fp32 output the softmax saved. torch 1.8's softmax_backward_cuda makes the same product
# (zeroplan.core.fairseq.softmax_backward_temporary_bytes). The CPU kernel makes no such
# product (tests/test_hf_eager_backward.py adds it to what it measures there).
def softmax_backward_gradient_bytes(request: PlanRequest) -> int:
    """The scores-sized gradients alive while one block's softmax backward runs on CUDA."""
    return (2 * softmax_element_bytes(request) + softmax_input_gradient_bytes(request)) * score_elements(request)


# Autograd runs a block's backward in reverse order (the ready queue takes the node created last)
# and frees what each node saved once it has run (torch/csrc/autograd/engine.cpp, release_variables;
# under the non-reentrant checkpoint the recomputed tensors go with the saved variables that hold
# them). At the softmax's backward the tensors saved after it are gone: the probabilities' cast
# and the dropout's tensors (the softmax keeps its own output), V as softmax@V saved it (the
# repeated copy under grouped heads), the output projection's input, the post-attention norms,
# the MLP's inputs and inner tensors, the residual dropouts' masks, and their LoRA adapters'
# tensors (lora_after_attention_delta_bytes). What is counted is what the planner's block
# counted (framework_layer_bytes); autocast's weight copies and DoRA's after the core are left in
# (they are not scores-sized). The gradient of V and of the residual stream stay, the two
# tensors the planner's block-backward workspace holds (activations.backward_workspace_bytes).
def freed_before_softmax_backward_bytes(request: PlanRequest) -> int:
    """What one block's backward has freed of its saved tensors when it reaches the softmax."""
    return sum(freed_before_softmax_backward_parts(request))


def kept_score_bytes(request: PlanRequest) -> int:
    """The scores-sized tensors the block still holds at its softmax's backward: the softmax's
    saved output (and OPT's clamp's)."""
    return (softmax_element_bytes(request) + opt_clamp_score_bytes(request.model, request.training)) * score_elements(request)


def freed_before_softmax_backward_parts(request: PlanRequest) -> tuple[int, int, int]:
    """freed_before_softmax_backward_bytes as (the probabilities' cast and dropout tensors, V as
    softmax@V saved it, what the block saved after the attention core)."""
    model, training = request.model, request.training
    s, b, e = request.batch.seq_len, request.batch.micro_batch_size, training.precision.compute_bytes
    terms = layer_terms(model, training, s, b, autocast=request.runs_under_autocast)
    planned_scores = (terms["softmax_output"] + terms["attention_dropout"]
                      + eager_attention_extra_bytes(request) - _repeated_kv_bytes(request))
    values = e * s * b * model.v_size + _repeated_kv_bytes(request) // 2
    norm_savings = hf_bf16_norm_savings_bytes(request)
    norm = norm_bytes(model, training, s, b, autocast=request.runs_under_autocast) - norm_savings
    after = (terms["output_projection_input"] + terms["mlp_input"] + terms["mlp_inner"] + terms["hidden_dropout_masks"]
             + terms["router_input"] + terms["router_scores"] + terms["shared_expert"] + terms["shared_expert_gate"]
             + (model.saved_norm_inputs - 1) * norm + lora_after_attention_delta_bytes(request, norm_savings))
    return planned_scores - kept_score_bytes(request), values, after


def _repeated_kv_bytes(request: PlanRequest) -> int:
    """The repeated K and V eager_attention_extra_bytes counts (beside the fp32 probabilities)."""
    model, batch, training = request.model, request.batch, request.training
    if not eager_attention_extra_bytes(request):
        return 0
    return 2 * training.precision.compute_bytes * batch.seq_len * batch.micro_batch_size * (model.q_size - model.kv_size)


def softmax_backward_extra_bytes(request: PlanRequest) -> int:
    """What transformers' eager softmax backward holds beyond the planner's block-backward
    moment (0 outside runs_eager_softmax)."""
    if not runs_eager_softmax(request):
        return 0
    return max(0, softmax_backward_gradient_bytes(request) - freed_before_softmax_backward_bytes(request))
