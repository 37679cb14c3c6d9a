"""Activation memory of one micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4 and 5), generalised to grouped-query
attention, gated MLPs, mixtures of experts, fused attention and dropout-free training.

Symbols: s sequence length, b micro-batch, h hidden size, a heads, f FFN width, V vocabulary,
e bytes of one activation element. Every term is what PyTorch autograd saves for backward.
"""

from __future__ import annotations

from zeroplan.specs.model import MlpKind, ModelSpec
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, TrainingSpec

DROPOUT_MASK_BYTES = 1
"""Korthikanti et al. sec. 4.1: dropout masks are stored as one byte per element."""
FP32_BYTES = 4


# Korthikanti et al. 2022, eq. (1): bytes per layer without parallelism or recomputation,
# for GPT (MHA, 4h GeLU MLP, LayerNorm, dropout, 16-bit activations, softmax materialised).
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    return s * b * h * (34 + 5 * a * s / h)


# Korthikanti et al. sec. 4.1, "Attention block": QK^T saves Q and K; softmax saves its
# output (a*s^2*b); its dropout a mask and an output; softmax@V saves V. A fused kernel
# (Dao et al. 2022, sec. 3.1) saves Q, K, V and a per-row fp32 log-sum-exp instead.
def attention_core_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Bytes saved inside core attention (between the QKV and output projections)."""
    e = training.precision.compute_bytes
    qkv = e * s * b * (model.q_size + 2 * model.kv_size)
    if training.attention_kernel is AttentionKernel.flash:
        return qkv + FP32_BYTES * model.num_heads * s * b
    scores = model.num_heads * s * s * b
    quadratic = e * scores
    if model.attention_dropout > 0:
        quadratic += DROPOUT_MASK_BYTES * scores + e * scores
    return qkv + quadratic


# Korthikanti et al. sec. 4.1: the part selective recomputation drops (sec. 5): the softmax
# and its dropout, the terms quadratic in s; Q, K, V stay because they are the core's inputs.
def selective_recompute_savings(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    e = training.precision.compute_bytes
    if training.attention_kernel is AttentionKernel.flash:
        return FP32_BYTES * model.num_heads * s * b
    return attention_core_bytes(model, training, s, b) - e * s * b * (model.q_size + 2 * model.kv_size)


# Korthikanti et al. sec. 4.1, "MLP": the first linear saves its input (2sbh); GeLU saves its
# input (8sbh at f=4h); the second linear its input (8sbh). A SwiGLU MLP saves its input, the
# gate output (for SiLU), SiLU's output and the up output (for the product), and the product
# (for the down projection): 4*s*b*f. With experts each token passes through k of them.
def mlp_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    e = training.precision.compute_bytes
    per_token_width = 2 * model.ffn_hidden_size if model.mlp is MlpKind.gelu else 4 * model.ffn_hidden_size
    inner = e * s * b * per_token_width * model.experts_per_token
    mlp_input = e * s * b * model.hidden_size
    if model.is_moe:
        # The router saves its logits and fp32 softmax probabilities for the top-k backward.
        router = (e + FP32_BYTES) * s * b * model.num_experts
        # Each routed copy of a token enters its expert as a separate input.
        mlp_input *= model.experts_per_token
        return mlp_input + inner + router + e * s * b * model.hidden_size
    return mlp_input + inner


def layer_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Bytes one transformer block saves for backward, without recomputation."""
    e = training.precision.compute_bytes
    sbh = s * b * model.hidden_size
    # Korthikanti sec. 4.1, "LayerNorm": each of the two norms saves its input (2sbh each).
    norms = 2 * e * sbh
    # The QKV projection saves its input (the norm's output); the output projection its input.
    attention = e * sbh + attention_core_bytes(model, training, s, b) + e * s * b * model.q_size
    dropout_masks = 2 * DROPOUT_MASK_BYTES * sbh if model.hidden_dropout > 0 else 0
    return norms + attention + mlp_bytes(model, training, s, b) + dropout_masks


# Korthikanti sec. 5: full recomputation keeps only each block's input (2sbh at 16 bits) and
# recomputes one block at a time in backward, so one block's activations are alive at once.
def checkpointed_layers_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Activation bytes of all L blocks under the request's checkpointing mode."""
    full_layer = layer_bytes(model, training, s, b)
    mode = training.activation_checkpointing
    if mode is ActivationCheckpointing.none:
        return model.num_layers * full_layer
    if mode is ActivationCheckpointing.selective:
        return model.num_layers * (full_layer - selective_recompute_savings(model, training, s, b))
    block_input = training.precision.compute_bytes * s * b * model.hidden_size
    return model.num_layers * block_input + full_layer


# Korthikanti sec. 4.3: outside the blocks, the embedding dropout mask (sbh), the final norm's
# input and the output projection's input.
def outside_layers_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    e = training.precision.compute_bytes
    sbh = s * b * model.hidden_size
    embedding_mask = DROPOUT_MASK_BYTES * sbh if model.hidden_dropout > 0 else 0
    return embedding_mask + 2 * e * sbh


# Korthikanti sec. 4.3 counts the cross-entropy's fp32 logits (4sbV). PyTorch's loss on
# half-precision logits also holds the logits themselves (e*sbV) while upcasting, saves the
# fp32 log-softmax (4sbV) and, in backward, writes its fp32 gradient (4sbV).
def logits_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    e = training.precision.compute_bytes
    sbv = s * b * model.vocab_size
    upcast = 0 if e == FP32_BYTES else e * sbv
    return upcast + FP32_BYTES * sbv + FP32_BYTES * sbv


# Backward of one block reads the gradient of its output and writes the gradient of its
# input: two residual-stream tensors are alive besides the saved activations.
def backward_workspace_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    return 2 * training.precision.compute_bytes * s * b * model.hidden_size


def activation_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Activations saved for backward by one micro-batch (logits excluded)."""
    return checkpointed_layers_bytes(model, training, s, b) + outside_layers_bytes(model, training, s, b)
