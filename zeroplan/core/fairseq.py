"""What fairseq's language model holds on a GPU where it differs from zeroplan's reference
block (docs/frameworks.md, "fairseq"): fairseq c6006678 (2021-03-09, the commit of
examples/fully_sharded_data_parallel/README.md) on the torch of its day, 1.8, under fairscale's
FullyShardedDataParallel of the same day (05ce7971). Each term is read from those sources; the
profile's flags (zeroplan.core.profiles, Framework.fairseq) carry the rest: the root unit kept
gathered, the fused (or host) Adam, fairscale's CPU offload. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.model import MlpKind
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


# torch 1.8 tools/autograd/derivatives.yaml: `_softmax` and `_log_softmax` take their backward as
# _softmax_backward_data(grad, result, dim, self), so autograd saves the input beside the output
# (pytorch issue 49600; pytorch PR 65242, September 2021, saves the output alone). fairseq's
# MultiheadAttention (fairseq/modules/multihead_attention.py) calls torch 1.8's
# F.multi_head_attention_forward in training, whose softmax(attn_output_weights) runs on the
# masked scores in the compute dtype: a block keeps its scores beside the probabilities the
# reference block counts (zeroplan.core.activations.attention_core_terms' softmax_output).
def kept_scores_bytes(request: PlanRequest) -> int:
    """The attention scores one block's softmax keeps as its input (torch 1.8)."""
    model, batch = request.model, request.batch
    return request.training.precision.compute_bytes * model.num_heads * batch.seq_len ** 2 * batch.micro_batch_size


# fairseq c6006678 fairseq/modules/gelu.py: gelu(x) = F.gelu(x.float()).type_as(x), the
# activation utils.get_activation_fn("gelu") returns (transformer_lm_gpt* set activation_fn
# "gelu"). GELU's backward keeps its fp32 input and fc2 keeps the cast back, where the reference
# block's GELU keeps a compute-dtype input (zeroplan.core.activations.mlp_terms): 4 - e bytes more
# per inner element (none in fp32, where .float() returns the tensor itself).
def gelu_upcast_bytes(request: PlanRequest) -> int:
    """What fairseq's fp32 GELU keeps beyond the reference block's, in one block."""
    model, batch = request.model, request.batch
    e = request.training.precision.compute_bytes
    if model.mlp is not MlpKind.gelu or e >= FP32_BYTES:
        return 0
    return (FP32_BYTES - e) * batch.seq_len * batch.micro_batch_size * model.ffn_hidden_size


def fairseq_layer_delta_bytes(request: PlanRequest) -> int:
    """What one fairseq decoder layer saves beyond zeroplan.core.activations.layer_bytes."""
    return kept_scores_bytes(request) + gelu_upcast_bytes(request)


# fairseq c6006678 criterions/cross_entropy.py compute_loss: F.nll_loss over
# decoder.get_normalized_probs -> utils.log_softmax(logits, dim=-1) = F.log_softmax(logits,
# dim, dtype=torch.float32). torch 1.8 aten/src/ATen/native/SoftMax.cpp log_softmax: a CUDA
# half input with dtype float runs _log_softmax(input, dim, half_to_float=true), whose backward
# (derivatives.yaml above) keeps the fp16 logits and the fp32 log-probabilities; nll_loss's
# backward writes a dense fp32 gradient of the log-probabilities, and the log-softmax's backward
# one of the logits' dtype. In fp32 the same four tensors are fp32. The criterion returns only
# the loss, so nothing else of the forward outlives it.
def fairseq_logits_parts(request: PlanRequest) -> tuple[int, int, int, int]:
    """The loss's tensors alive at its backward: saved logits and log-probabilities, and the
    two gradients."""
    sbv = request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    e = request.training.precision.compute_bytes
    return e * sbv, FP32_BYTES * sbv, FP32_BYTES * sbv, e * sbv


# torch 1.8 aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda (what
# _softmax_backward_data runs on a CUDA tensor): `Tensor tmp = grad * output;` materialises the
# product of the probabilities and their gradient, then host_softmax_backward(tmp, output, ...)
# writes the scores' gradient into a new tensor (gI = at::empty_like(tmp)) while tmp is alive:
# one scores-sized temporary in the compute dtype beside the gradient it writes (this torch's
# CPU kernel makes no such product: tests/test_fairseq_profile.py writes the CUDA one's out).
def softmax_backward_temporary_bytes(request: PlanRequest) -> int:
    """The `grad * output` product torch 1.8's CUDA softmax backward allocates."""
    return kept_scores_bytes(request)


# fairscale 05ce7971 nn/misc/flatten_params_wrapper.py (fairseq's fsdp_wrap keeps
# flatten_parameters=True, fairseq/distributed/fully_sharded_data_parallel.py): FSDP flattens each unit's parameters
# into one flat_param and at every forward (FlattenParamsWrapper.forward ->
# _unflatten_params_as_views) sets the layer's weights as views of flat_param.split(...); the
# recomputed layer (fairseq's checkpoint_wrapper sits inside the FSDP wrapper) uses those views.
# Autograd's SplitWithSizesBackward runs once every view's gradient has arrived, so a layer's
# weight gradients are held unsharded, in the compute dtype, in its input buffer until the
# layer's last one (the first norm's) is computed. At the softmax's backward those of what runs
# after the attention core are: out_proj, the second norm, fc1 and fc2 (with their biases).
# Outside FSDP (DDP) each gradient goes to its AccumulateGrad, the model states' gradients.
def held_layer_gradient_bytes(request: PlanRequest) -> int:
    """The recomputed layer's unsharded weight gradients alive at its softmax's backward under
    fairscale's FSDP (0 elsewhere)."""
    if not request.strategy.kind.is_fsdp:
        return 0
    model = request.model
    h, f = model.hidden_size, model.ffn_hidden_size
    out_proj = h * h + (h if model.bias else 0)
    mlp_bias = model.bias if model.mlp_bias is None else model.mlp_bias
    mlp = 2 * h * f + ((f + h) if mlp_bias else 0)
    norm = h * (2 if model.norm_bias else 1)
    return request.training.precision.compute_bytes * (out_proj + norm + mlp)


# torch 1.8's autograd runs a fairseq layer's backward in reverse order: fc2, GELU, fc1, the second
# norm, out_proj, probs @ V, then the softmax, whose backward (_softmax_backward_data) writes the
# scores' gradient while the probabilities' gradient (from probs @ V's backward), the product
# above, both saved tensors and (under FSDP) the layer's gradients so far are alive. By then the
# tensors saved after the attention core (out_proj's input, the second norm's input, fc1's input, the MLP's inner tensors, the residual dropouts' masks) are
# freed. zeroplan's block-backward moment counts the whole saved block and two residual-stream
# tensors (zeroplan.core.activations.backward_workspace_bytes); with scores materialised the
# softmax's moment is larger by what this returns.
def softmax_backward_extra_bytes(request: PlanRequest) -> int:
    """What the softmax's backward holds beyond the planner's block-backward moment."""
    from zeroplan.core.activations import layer_terms

    model, training, batch = request.model, request.training, request.batch
    s, b = batch.seq_len, batch.micro_batch_size
    terms = layer_terms(model, training, s, b)
    freed = (terms["output_projection_input"] + terms["mlp_input"] + terms["norm_inputs"] // model.norms_per_block
             + terms["mlp_inner"] + terms["hidden_dropout_masks"] + gelu_upcast_bytes(request))
    gradients = 2 * kept_scores_bytes(request) + softmax_backward_temporary_bytes(request)
    return max(0, gradients + held_layer_gradient_bytes(request) - freed)


# fairseq c6006678 trainer.py: outside fully_sharded, --fp16 casts the model itself
# (self._model.half()), so parameters and their gradients are fp16 (no autocast);
# optim/fp16_optimizer.py FP16Optimizer.build_fp32_params (flatten, the default without
# --fp16-no-flatten-grads) allocates one flat fp32 master copy of every parameter and beside it a
# flat fp32 gradient (fp32_params.grad = fp32_params.data.new(total_param_size)), both kept for
# good (zero_grad zeroes the flat gradient and sets the fp16 ones to None); the wrapped optimizer
# (apex's FusedAdam) keeps its states on the flat master. _sync_fp16_grads_to_fp32 copies the fp16
# gradients into the flat one at the step. --memory-efficient-fp16 (MemoryEfficientFP16Optimizer:
# no master copy) is not an input.
def runs_fp16_optimizer(request: PlanRequest) -> bool:
    """Whether fairseq's FP16Optimizer holds the run's master copy (--fp16 outside FSDP)."""
    from zeroplan.specs.strategy import StrategyKind
    from zeroplan.specs.training import Precision

    return (request.training.framework is Framework.fairseq and request.strategy.kind is StrategyKind.ddp
            and request.training.precision is Precision.fp16_mixed)


def fp16_optimizer_state_bytes(elements: int, optimizer_state_bytes: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) of one rank under FP16Optimizer: fp16 parameters and
    gradients; the flat fp32 master and its flat fp32 gradient, kept between steps, counted with
    the optimizer's own states (``optimizer_state_bytes``, on the fp32 master)."""
    fp16 = 2 * elements
    return fp16, fp16, 2 * FP32_BYTES * elements + optimizer_state_bytes
