"""TinyLlama's fork of lit-gpt (jzhang38/TinyLlama@bf12224) as its pretraining runs it
(pretrain/tinyllama.py), planned under the litgpt profile with TrainingSpec.litgpt_fork "tinyllama":
what its fused kernels save for backward, block by block, and its loss.

The run: Lightning 2.1.2's FSDPStrategy at "bf16-mixed". Its FSDPPrecision keeps the parameters
fp32 (mixed_precision_config, src/lightning/fabric/plugins/precision/fsdp.py lines 87-89:
param_dtype float32, reduce and buffer dtypes bfloat16) and runs the forward under
torch.autocast(bfloat16) (forward_context, line 114), then casts the model's output to fp32
(convert_output, line 121). So the embedding's output, and with it the residual stream, is fp32,
and every linear saves a bf16 cast of its input and of its weight (FSDP's parameters are views of
the gathered flat parameter, never cached by autocast). The block (lit_gpt/model.py):
- FusedRMSNorm (lit_gpt/rmsnorm.py rms_norm -> DropoutAddLayerNormFn, lines 349-351): saves its
  input (xmat is the input itself without residual or dropout, line 53), in its fp32 dtype, and
  fp32 mu and rsigma per row (flash-attention@26d7d92 csrc/layer_norm/ln_api.cpp lines 209-210).
- the qkv linear (its bf16 input cast); q, k and v split from its output (model.py lines
  212-229): q's reshape copies (its heads are not contiguous in the packed groups), k and v stay
  views of the qkv output; the fused rotary (lit_gpt/fused_rotary_embedding.py) runs in place
  and saves only cos and sin; flash_attn_func saves q, k, v, its output and the fp32 log-sum-exp
  per head and token (flash_attn_interface.py line 387; csrc/flash_attn/flash_api.cpp line 319),
  no repeated K and V (GQA is native: model.py line 220). k and v keep the whole qkv output alive.
- the output projection saves the attention's output (the same storage) and its weight's cast.
- xformers' SwiGLU (_pack_weights False): FSDP's w1 and w2 are adjacent views of one flat
  parameter, so xformers.ops.unbind.get_stack_strides stacks them and SwiGLUOpDispatch picks
  SwiGLUPackedFusedOp on an A100 under bf16 autocast (xformers@cfad52d ops/swiglu_op.py lines
  237-281, 295-299); its autocast kernel casts x, w1w2 and w3 to bf16 and saves those casts
  with x1 and x2, the two up projections (csrc/swiglu/swiglu_packedw.cpp SwiGLUPackedWeights::
  forward, save_for_backward({x, w1w2, w3, x1, x2})): silu(x1) * x2 is rebuilt in backward.
The loss: FusedCrossEntropyLoss (lit_gpt/fused_cross_entropy.py, inplace_backward True) on the
fp32 logits Lightning returns: it saves the logits and an fp32 log-sum-exp per token and writes
the gradient into the logits in place; the loop (pretrain/tinyllama.py lines 222-226) holds the
previous micro-batch's logits until the new ones are assigned.

This module does not import torch."""

from __future__ import annotations

from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import LITGPT_FORKS, Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, Kernels, Precision, TrainingSpec
from zeroplan.units import BF16_BYTES, FP32_BYTES

NORM_ROW_STATISTICS = 2
"""mu and rsigma: the fp32 values per row flash-attention's layer-norm kernel keeps."""


def runs_fork(request: PlanRequest) -> bool:
    """Whether the request plans TinyLlama's fork (checked: check_fork)."""
    return request.training.framework is Framework.litgpt and request.training.litgpt_fork == "tinyllama"


def check_fork_training(training: TrainingSpec) -> None:
    """Refuse, in one line, a fork that is not modelled or asked of another framework."""
    fork = training.litgpt_fork
    if fork is None:
        return
    if training.framework is not Framework.litgpt:
        raise ZeroplanError("litgpt_fork", "is a fork of lit-gpt (allowed only with framework litgpt)")
    if fork not in LITGPT_FORKS:
        raise ZeroplanError("litgpt_fork", f"{fork!r} is not modelled (allowed: {', '.join(LITGPT_FORKS)})")


def check_fork(request: PlanRequest) -> None:
    """check_fork_training, and refuse a setup TinyLlama's pretraining does not run."""
    training = request.training
    check_fork_training(training)
    if training.litgpt_fork is None:
        return
    # pretrain/tinyllama.py: FSDPStrategy(activation_checkpointing_policy=None) on CUDA at
    # get_default_supported_precision(training=True), bf16-mixed on an A100; full pretraining.
    if request.strategy.kind is not StrategyKind.fsdp_full_shard:
        raise ZeroplanError("litgpt_fork", "tinyllama's pretraining runs Lightning's FSDP (allowed with strategy fsdp-full-shard)")
    if (training.precision is not Precision.bf16_mixed or training.activation_checkpointing is not ActivationCheckpointing.none
            or training.kernels is not Kernels.cuda or training.compile or training.finetune.is_lora):
        raise ZeroplanError("litgpt_fork", "tinyllama is planned as its pretraining runs it: bf16-mixed, CUDA kernels, "
                                           "no checkpointing, compile or LoRA")


def block_bytes(request: PlanRequest) -> int:
    """Bytes one TinyLlama block saves for backward (the module docstring, term by term)."""
    check_fork(request)
    from zeroplan.core.params import block_linear_weight_elements

    model = request.model
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    h, d, f = model.hidden_size, model.head_size, model.ffn_hidden_size
    qkv_width = (model.num_heads + 2 * model.kv_heads) * d
    norms = 2 * (FP32_BYTES * h + NORM_ROW_STATISTICS * FP32_BYTES) * tokens
    attention = BF16_BYTES * tokens * (h + qkv_width + 2 * model.num_heads * d) + FP32_BYTES * tokens * model.num_heads
    swiglu = BF16_BYTES * tokens * (h + 2 * f)
    weight_casts = BF16_BYTES * block_linear_weight_elements(model)
    return norms + attention + swiglu + weight_casts


def outside_bytes(request: PlanRequest) -> int:
    """Bytes the final norm and the output projection save (its bf16 input and weight casts)."""
    model = request.model
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    norm = (FP32_BYTES * model.hidden_size + NORM_ROW_STATISTICS * FP32_BYTES) * tokens
    return norm + BF16_BYTES * tokens * model.hidden_size + BF16_BYTES * model.vocab_size * model.hidden_size


def activation_bytes(request: PlanRequest) -> int:
    """Activations one micro-batch saves (logits excluded): every block's, kept (no checkpointing)."""
    return request.model.num_layers * block_bytes(request) + outside_bytes(request)


def logits_tensors(request: PlanRequest, gathered: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The loss's tensors at its three moments, with the FSDP units still gathered: the model's
    forward end (the bf16 logits, Lightning's fp32 copy, the previous micro-batch's fp32 logits),
    the loss's forward (the logits and the fp32 log-sum-exp and losses per token) and its backward
    (the logits holding their gradient, and the bf16 gradient of Lightning's cast)."""
    model = request.model
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    logits = tokens * model.vocab_size
    model_end = (BF16_BYTES * logits, FP32_BYTES * logits, FP32_BYTES * logits, *gathered)
    loss = (FP32_BYTES * logits, FP32_BYTES * tokens, FP32_BYTES * tokens, *gathered)
    backward = (FP32_BYTES * logits, FP32_BYTES * tokens, BF16_BYTES * logits, *gathered)
    return model_end, loss, backward
