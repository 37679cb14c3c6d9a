"""Activation memory of one micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4 and 5), generalised to grouped-query
attention, gated MLPs, mixtures of experts, fused attention and dropout-free training.

Symbols: s sequence length, b micro-batch, h hidden size, a heads, f FFN width, V vocabulary,
e bytes of one activation element. Every term is what PyTorch autograd saves for backward.
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil

from zeroplan.core.hf_activation import gelu_extra_bytes
from zeroplan.core.profiles import profile
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, Kernels, TrainingSpec
from zeroplan.units import FP32_BYTES

DROPOUT_MASK_BYTES = 1
"""Korthikanti et al. sec. 4.1: dropout masks are stored as one byte per element."""


# Korthikanti et al. 2022, eq. (1): bytes per layer without parallelism or recomputation,
# for GPT (MHA, 4h GeLU MLP, LayerNorm, dropout, 16-bit activations, softmax materialised).
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    return s * b * h * (34 + 5 * a * s / h)


LAYER_TERMS = (
    "norm_inputs", "qkv_input", "q_k_v", "softmax_output", "attention_dropout", "logsumexp", "attention_bias",
    "output_projection_input", "mlp_input", "mlp_inner", "router_input", "router_scores", "hidden_dropout_masks",
    "q_latent", "kv_latent", "shared_expert", "shared_expert_gate", "qk_norm_inputs",
)
"""Names of the terms one block saves for backward (layer_terms); docs/memory-model.md section 3
has one table row per name and tests/test_activations_docs.py checks the rows against the code."""


# Korthikanti et al. sec. 4.1, "Attention block": QK^T saves Q and K; softmax saves its
# output (a*s^2*b); its dropout a mask and an output; softmax@V saves V. A fused kernel
# (Dao et al. 2022, sec. 3.1) saves Q, K, V and a per-row fp32 log-sum-exp instead.
def attention_core_terms(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> dict[str, int]:
    """Bytes saved inside core attention (between the QKV and output projections), by term."""
    e = training.precision.compute_bytes
    # Under MLA (DeepSeek-V2 sec. 2.1.2) the values are v_head_dim wide, the queries and keys
    # d_nope + d_rope: transformers 4.56 DeepseekV2Attention concatenates them before attention.
    terms = {"q_k_v": e * s * b * (model.q_size + model.kv_size + model.v_size)}
    if training.attention_kernel is AttentionKernel.flash:
        return {**terms, "logsumexp": FP32_BYTES * model.num_heads * s * b}
    if training.attention_kernel is AttentionKernel.sdpa_masked:
        return {**terms, **sdpa_masked_terms(model, training, s, b)}
    scores = model.num_heads * s * s * b
    terms["softmax_output"] = e * scores
    if model.position is PositionKind.alibi and not training.framework.megatron_layout:
        # transformers 4.56.2 models/bloom/modeling_bloom.py BloomAttention.forward: the scores
        # (alibi.baddbmm) pass F.softmax(..., dtype=torch.float32), whose fp32 output its backward
        # keeps, then .to(query dtype) for the bmm with the values, which keeps that copy. The
        # BigScience Megatron fork's ALiBi (bigscience-workshop/Megatron-DeepSpeed@541b967f
        # megatron/model/transformer.py:283-358) adds the bias in its baddbmm and passes the 16-bit
        # scores to its FusedScaleMaskSoftmax, which keeps its 16-bit output as without ALiBi.
        # In fp32 the cast returns the softmax's own output: one tensor (measured on BloomBlock
        # under peft's LoRA, tests/test_hf_activation.py).
        terms["softmax_output"] = (FP32_BYTES + (e if e < FP32_BYTES else 0)) * scores
    if model.attention_dropout > 0:
        terms["attention_dropout"] = DROPOUT_MASK_BYTES * scores + e * scores
    return terms


# torch 2.1.1 (the cu121 wheel, git 4c55dc50), F.scaled_dot_product_attention with an additive mask
# on CUDA. Backend: sdp::select_sdp_backend tries flash, then memory-efficient, then math
# (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); libtorch_cuda.so's use_flash_attention
# lists check_for_attn_mask among its constraints and use_mem_efficient_attention does not (its
# constraints: runtime-disabled, sm50-sm90, nested/grad, 4-d shapes, batch and heads, head_dim a
# multiple of 8 for 16 bits on sm80, no zero lengths, last-dim stride 1), so a 16-bit mask-carrying
# call with head_dim 128 on an A100 or H100 runs the memory-efficient kernel, not the math fallback.
# Mask: at::native::scaled_dot_product_attention (attention.cpp; libtorch_cpu.so) calls
# preprocess_mask, which expands the mask to b x a x s x s and then either pads it (pad_bias:
# at::pad to a multiple of 16 columns, then a slice) when s % 16 != 0, or returns
# attn_mask.contiguous() when any stride is 0 or not a multiple of 16 (its lambda
# `stride % 16 != 0 || stride == 0`): an expanded b x 1 x s x s mask has stride 0 over the heads,
# so either branch materialises b*a*s*ceil16(s) elements in the mask's (the query's) dtype.
# Saved: derivatives.yaml (torchgen/packaged/autograd, line 2763-2765 of 2.1.1)
# _scaled_dot_product_efficient_attention's backward reads query, key, value, attn_bias, output,
# log_sumexp and the philox seed and offset; _meta_registrations.py meta__scaled_dot_product_efficient
# gives log_sumexp fp32 b x a x ceil32(s). The backward allocates grad_q/k/v (the residual-stream
# workspace's counterpart of a fused kernel's) and no grad_bias (the mask does not require grad).
# Measured on the CPU with saved-tensor hooks (meta tensors, tests/test_sdpa_masked.py).
def sdpa_masked_terms(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> dict[str, int]:
    """torch 2.1's memory-efficient SDPA with a materialised mask: the log-sum-exp and the mask."""
    e = training.precision.compute_bytes
    return {"logsumexp": FP32_BYTES * model.num_heads * b * 32 * ceil(s / 32),
            "attention_bias": e * b * model.num_heads * s * 16 * ceil(s / 16)}


# Korthikanti sec. 4.1, "LayerNorm": a norm saves its input (2sbh at 16 bits; the fused
# native_layer_norm keeps only that and per-token statistics, which are ignored, as in the paper).
def norm_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Bytes one normalisation layer saves for backward (``autocast``: the forward runs under
    torch.autocast with fp32 parameters, PlanRequest.runs_under_autocast)."""
    sbh = s * b * model.hidden_size
    if model.norm is NormKind.layernorm:
        return training.precision.compute_bytes * sbh
    if training.framework is Framework.torchtitan and training.torchtitan_release == "9dec370" and not autocast:
        return torchtitan_9dec370_rms_norm_bytes(training, sbh, s * b)
    if not rms_norm_is_composite(training, autocast):
        return fused_rms_norm_bytes(rms_norm_operand_bytes(training, autocast)[0], s, b, model.hidden_size)
    return composite_rms_norm_bytes(sbh)


def rms_norm_is_composite(training: TrainingSpec, autocast: bool) -> bool:
    """Whether an RMSNorm runs as composite ops (the CPU, HF's spelled-out norm, operands of two
    dtypes) rather than the fused CUDA kernel (rms_norm_operand_bytes)."""
    dtypes = rms_norm_operand_bytes(training, autocast)
    return not (training.kernels is Kernels.cuda and dtypes is not None and dtypes[0] == dtypes[1])


# torch 2.13 aten/src/ATen/native/layer_norm.cpp rms_norm_symint: at::_fused_rms_norm unless the
# input and weight dtypes differ (then rms_norm_composite, with a warning); native_functions.yaml
# gives _fused_rms_norm a CUDA kernel and rms_norm_composite (CompositeImplicitAutograd) on the
# CPU. The (input, weight) element bytes that reach F.rms_norm, or None where the framework's
# RMSNorm does not call it:
# - zeroplan/harness/model.py and torchtitan 0.3.0 models/common/nn_modules.py use nn.RMSNorm,
#   whose weight is a parameter: fp32 and fp32 in fp32; 16 bits both under bf16-pure, FSDP2
#   (MixedPrecisionPolicy param_dtype casts the parameter and the residual stream is 16-bit) and
#   DeepSpeed (the module is cast); under autocast the residual stream is fp32 (an fp32 embedding
#   plus 16-bit linear outputs) and CUDA autocast's fp32 list, which holds rms_norm
#   (aten/src/ATen/autocast_mode.h AT_FORALL_FP32, registered for CUDA in autocast_mode.cpp;
#   AutocastCPU's own list has no norm), casts both operands to fp32.
# - torchtune 0.6.1 modules/rms_norm.py calls F.rms_norm(x.float(), weight=self.scale): an fp32
#   input beside a parameter weight, fp32 only in fp32 (or under autocast): in bf16 the dtypes
#   differ and CUDA runs the composite too, so its bf16 figures are the CPU ones.
# - transformers 4.56.2 LlamaRMSNorm spells the norm out (pow, mean, rsqrt, multiplies) and never
#   calls F.rms_norm: it saves the same tensors on either device (its bf16-module saving is
#   zeroplan.core.frameworks.hf_bf16_norm_savings_bytes). litgpt 0.4.13.dev1 litgpt/model.py
#   RMSNorm spells it out the same way (FrameworkProfile.rms_norm_spelled_out).
def rms_norm_operand_bytes(training: TrainingSpec, autocast: bool) -> tuple[int, int] | None:
    if profile(training.framework).rms_norm_spelled_out:
        return None
    weight = FP32_BYTES if autocast else training.precision.compute_bytes
    if training.framework is Framework.torchtune:
        return FP32_BYTES, weight
    return weight, weight


# torchtitan 9dec370 torchtitan/models/norms.py:77-101 RMSNorm (norm_type "rmsnorm", the default
# of config_manager.py:174-177 and of every train_configs toml): _norm(x.float()).type_as(x) *
# weight spelled out, no F.rms_norm: pow and the multiply by rsqrt save the fp32 copy of x,
# rsqrt its fp32 per-token result, the multiply by the weight the output cast back to x's dtype.
# Measured: the final norm of benchmarks/torchtitan_2d_step.py (9dec370's own class) keeps one
# fp32 and one bf16 sequence-sharded [b s, h] tensor through the loss.
def torchtitan_9dec370_rms_norm_bytes(training: TrainingSpec, sbh: int, sb: int) -> int:
    return (FP32_BYTES + training.precision.compute_bytes) * sbh + FP32_BYTES * sb


# torch 2.13 tools/autograd/derivatives.yaml, _fused_rms_norm: the backward reads input, weight
# and result1, the fp32 rstd (one per row, i.e. per token): the input in its own dtype plus 4
# bytes per token are saved (the weight is a parameter, not an activation).
def fused_rms_norm_bytes(input_element_bytes: int, s: int, b: int, h: int) -> int:
    return input_element_bytes * s * b * h + FP32_BYTES * s * b


# rms_norm_composite (aten/src/ATen/native/layer_norm.cpp, torch 2.13) computes in fp32: it
# upcasts a 16-bit input, and the normalised x*rsqrt(mean(x^2)) is saved for the weight's
# gradient, so two fp32 sbh tensors are saved (the fp32 input is the input itself in fp32).
# The per-token rsqrt is ignored, as the paper ignores statistics. Measured on the harness's
# Llama blocks on the CPU: 9 norms, 2 x 0.75 MiB each at s*b = 512, h = 384 (docs/validation.md).
def composite_rms_norm_bytes(sbh: int) -> int:
    return 2 * FP32_BYTES * sbh


# Korthikanti et al. sec. 4.1: the part selective recomputation drops (sec. 5): the softmax
# and its dropout, the terms quadratic in s; Q, K, V stay because they are the core's inputs.
def selective_recompute_savings(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    terms = attention_core_terms(model, training, s, b)
    return sum(value for name, value in terms.items() if name != "q_k_v")


# DeepSpeed-MoE (deepspeed/moe/sharded_moe.py, _capacity and top2gating in 0.19.8; GShard,
# Lepikhin et al. 2020, sec. 2.2): each expert takes at most capacity = ceil(k x tokens x cf / E)
# tokens and its input is padded to that, so E x capacity token copies enter the experts;
# dropless routing (torchtitan 0.3.0 models/common/moe.py, Megatron-LM's default
# moe_expert_capacity_factor None) processes every one of the k x tokens copies.
def routed_token_copies(model: ModelSpec, tokens: int) -> int:
    """Token copies the experts of one MoE block process for ``tokens`` tokens."""
    k = model.experts_per_token
    if model.moe_capacity_factor is None:
        return tokens * k
    capacity = ceil(k * tokens * model.moe_capacity_factor / model.num_experts)
    return model.num_experts * capacity


# A ReLU MLP (OPT) saves f: torch tools/autograd/derivatives.yaml gives relu's backward its
# result, the very tensor the second linear saves as its input (measured with saved-tensor hooks
# on transformers' OPTDecoderLayer, tests/test_hf_families.py).
def _mlp_width_bytes(model: ModelSpec, width: int) -> int:
    """Bytes per token, over e, that an MLP of inner width ``width`` saves inside (not its input)."""
    if model.mlp is MlpKind.relu:
        return width
    return 4 * width if model.mlp.gated else 2 * width


# Korthikanti et al. sec. 4.1, "MLP": the first linear saves its input (2sbh); GeLU saves its
# input (8sbh at f=4h); the second linear its input (8sbh). A gated MLP (SwiGLU, GeGLU) saves its
# input, the gate output (for the activation), the activation's output and the up output (for the
# product), and the product (for the down projection): 4*s*b*f. With experts each token passes
# through k of them, each expert f_expert wide (moe_ffn_hidden_size). ``moe_layer`` picks a block
# with experts or a dense one; None: the block the model repeats (with experts for a MoE model).
def mlp_terms(model: ModelSpec, training: TrainingSpec, s: int, b: int, moe_layer: bool | None = None) -> dict[str, int]:
    """Bytes the feed-forward block saves, by term."""
    e = training.precision.compute_bytes
    moe = model.is_moe if moe_layer is None else moe_layer
    if not moe:
        width = _mlp_width_bytes(model, model.ffn_hidden_size)
        # In a parallel block the MLP reads the normed tensor the QKV projection already keeps.
        mlp_input = 0 if model.parallel_block else e * s * b * model.hidden_size
        return {"mlp_input": mlp_input, "mlp_inner": e * s * b * width}
    # Each routed copy of a token enters its expert as a separate input.
    copies = routed_token_copies(model, s * b)
    terms = {"mlp_input": e * copies * model.hidden_size,
             "mlp_inner": e * copies * _mlp_width_bytes(model, model.expert_ffn_hidden_size)}
    # The router (a linear h -> E) saves its input, the un-routed tokens, and its logits and
    # fp32 softmax probabilities for the top-k backward.
    terms["router_input"] = e * s * b * model.hidden_size
    terms["router_scores"] = (e + FP32_BYTES) * s * b * model.num_experts
    if model.shared_expert_ffn_hidden_size:
        # The shared expert (DeepSeekMoE, Dai et al. 2024, sec. 3.2; transformers 4.56
        # DeepseekV2MoE.shared_experts, Qwen2MoeSparseMoeBlock.shared_expert) reads the router's
        # input, the same tensor, so only its inner activations are new.
        terms["shared_expert"] = e * s * b * _mlp_width_bytes(model, model.shared_expert_ffn_hidden_size)
    if model.shared_expert_gate:
        # Qwen2-MoE: sigmoid(gate(x)) * shared_output saves both factors of the product (the
        # sigmoid's output also serves its own backward): h + 1 per token.
        terms["shared_expert_gate"] = e * s * b * (model.hidden_size + 1)
    return terms


# DeepSeek-V2 sec. 2.1.2, as transformers 4.56 DeepseekV2Attention and torchtitan 0.3.0
# models/deepseek_v3 (wkv_a, kv_norm, wkv_b; wq_a, q_norm, wq_b) run it: each latent passes an
# RMSNorm (which saves its input, norm_bytes at the latent's width) and then the up-projection
# (which saves the normalised latent, e per element). The RoPE key part of kv_a's output joins K.
def latent_attention_terms(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> dict[str, int]:
    """Bytes MLA's latent projections save, by term (none without MLA)."""
    if not model.is_mla:
        return {}
    e = training.precision.compute_bytes

    def latent(width: int) -> int:
        norm = norm_bytes(model.model_copy(update={"hidden_size": width}), training, s, b, autocast=autocast)
        return norm + e * s * b * width

    terms = {"kv_latent": latent(model.kv_lora_rank)}
    if model.q_lora_rank is not None:
        terms["q_latent"] = latent(model.q_lora_rank)
    return terms


# Qwen3 (transformers 4.51 modeling_qwen3.py q_norm/k_norm; torchtitan 0.3.0 models/qwen3):
# an RMSNorm over each head of q and of k before RoPE. Each saves what a norm saves (norm_bytes'
# rules) at q's and k's widths, with one rstd per head and token on the fused path. Measured in
# torchtitan's Qwen3-30B-A3B blocks (benchmarks/parallel-records/expert, CPU composite path).
def qk_norm_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Bytes the per-head query and key norms save (0 without them)."""
    if not model.qk_norm:
        return 0
    total = 0
    for heads in (model.num_heads, model.kv_heads):
        elements = s * b * heads * model.head_size
        dtypes = rms_norm_operand_bytes(training, autocast)
        if training.kernels is Kernels.cuda and dtypes is not None and dtypes[0] == dtypes[1]:
            total += dtypes[0] * elements + FP32_BYTES * s * b * heads
        else:
            total += composite_rms_norm_bytes(elements)
    return total


def layer_terms(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False,
                moe_layer: bool | None = None) -> dict[str, int]:
    """Bytes one transformer block saves for backward without recomputation, for every name in
    LAYER_TERMS (0 where a term does not apply; ``autocast`` as in norm_bytes; ``moe_layer`` as
    in mlp_terms)."""
    e = training.precision.compute_bytes
    sbh = s * b * model.hidden_size
    terms = dict.fromkeys(LAYER_TERMS, 0)
    # Pre-attention and pre-MLP norms; Gemma 2's post-norms add two (ModelSpec.norms_per_block);
    # a parallel residual's two norms read one block input, saved once (ModelSpec.saved_norm_inputs).
    terms["norm_inputs"] = model.saved_norm_inputs * norm_bytes(model, training, s, b, autocast=autocast)
    # The QKV projection saves its input (the norm's output); the output projection its input.
    # RoPE (Su et al. 2021, eq. 34) as x*cos + rotate(x)*sin saves only cos and sin, constants
    # of s*d elements: autograd keeps a product's input only when the other factor needs a
    # gradient (torch/csrc/autograd/generated, MulBackward0), so no Q- or K-sized tensor.
    terms["qkv_input"] = e * sbh
    terms.update(attention_core_terms(model, training, s, b))
    terms.update(latent_attention_terms(model, training, s, b, autocast=autocast))
    terms["qk_norm_inputs"] = qk_norm_bytes(model, training, s, b, autocast=autocast)
    terms["output_projection_input"] = e * s * b * model.attention_output_size
    terms.update(mlp_terms(model, training, s, b, moe_layer))
    # transformers' own GELU modules under the hf profile keep more than F.gelu (zeroplan.core.hf_activation).
    terms["mlp_inner"] += gelu_extra_bytes(model, training, s, b, autocast=autocast)
    if model.hidden_dropout > 0:
        terms["hidden_dropout_masks"] = 2 * DROPOUT_MASK_BYTES * sbh
    assert set(terms) == set(LAYER_TERMS), sorted(set(terms) - set(LAYER_TERMS))
    return terms


def _block_kinds(model: ModelSpec) -> dict[bool, int]:
    """Blocks of each kind: {with experts: count, dense: count}, kinds with none left out."""
    moe = model.moe_layer_count if model.is_moe else 0
    return {kind: count for kind, count in ((True, moe), (False, model.num_layers - moe)) if count > 0}


# Kept per arguments (specs hash once): fit's strategies and the largest micro-batch's requests
# ask for the same blocks again.
@lru_cache(maxsize=1024)
def layer_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False,
                moe_layer: bool | None = None) -> int:
    """Bytes one transformer block saves for backward, without recomputation; ``moe_layer``
    None: the largest of the model's blocks (what a recomputing backward rebuilds at its peak)."""
    if moe_layer is not None:
        return sum(layer_terms(model, training, s, b, autocast=autocast, moe_layer=moe_layer).values())
    return max(layer_bytes(model, training, s, b, autocast=autocast, moe_layer=kind) for kind in _block_kinds(model))


def all_layers_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Bytes all L blocks save without recomputation, dense and MoE blocks each their own."""
    return sum(count * layer_bytes(model, training, s, b, autocast=autocast, moe_layer=kind)
               for kind, count in _block_kinds(model).items())


# Korthikanti sec. 5: full recomputation keeps only each block's input (2sbh at 16 bits) and
# recomputes one block at a time in backward, so one block's activations are alive at once.
def checkpointed_layers_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Activation bytes of all L blocks under the request's checkpointing mode."""
    mode = training.activation_checkpointing
    if mode is ActivationCheckpointing.none:
        return all_layers_bytes(model, training, s, b, autocast=autocast)
    if mode is ActivationCheckpointing.selective:
        return (all_layers_bytes(model, training, s, b, autocast=autocast)
                - model.num_layers * selective_recompute_savings(model, training, s, b))
    block_input = training.precision.compute_bytes * s * b * model.hidden_size
    return model.num_layers * block_input + layer_bytes(model, training, s, b, autocast=autocast)


# Korthikanti sec. 4.3: outside the blocks, the embedding dropout mask (sbh), the final norm
# and the output projection's input.
def outside_layers_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    e = training.precision.compute_bytes
    sbh = s * b * model.hidden_size
    embedding_mask = DROPOUT_MASK_BYTES * sbh if model.hidden_dropout > 0 else 0
    # Bloom's and BERT's embedding LayerNorm keeps its input, as the final norm does; BERT's
    # masked-LM head transform keeps its dense layer's input and its GELU's.
    embedding_norm = norm_bytes(model, training, s, b, autocast=autocast) if model.embedding_norm else 0
    transform = 2 * e * sbh if model.head_transform else 0
    final_norm = norm_bytes(model, training, s, b, autocast=autocast) if model.final_norm else 0
    # OPT-350m (ModelSpec.embedding_projection): project_out keeps the last block's b x s x h
    # output, the head its narrower output, and project_in the embedding's, each p wide.
    projections = 2 * e * s * b * model.embedding_projection
    return embedding_mask + embedding_norm + transform + final_norm + e * sbh + projections


# Korthikanti sec. 4.3 counts the cross-entropy's fp32 logits (4sbV). PyTorch's loss
# (F.cross_entropy on logits cast to fp32) saves the fp32 log-softmax (4sbV); its backward
# starts with nll_loss_backward writing a dense fp32 gradient of the log-probabilities (4sbV),
# then _log_softmax_backward_data writes the logits' fp32 gradient (4sbV) while both inputs are
# alive: three fp32 sbV tensors at once (aten/src/ATen/native/LossNLL.cpp, SoftMax.cpp; seen
# by the harness's allocator trace). The compute-dtype logits and their fp32 copy are freed
# once the loss is formed (neither is saved), and this moment is larger than the forward's.
def logits_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    return sum(logits_parts(model, s, b))


def logits_parts(model: ModelSpec, s: int, b: int) -> tuple[int, int, int]:
    """logits_bytes' three fp32 tensors: the saved log-softmax and the two gradients."""
    sbv = s * b * model.vocab_size
    return saved_logits_bytes(model, s, b), FP32_BYTES * sbv, FP32_BYTES * sbv


def saved_logits_bytes(model: ModelSpec, s: int, b: int) -> int:
    """What autograd keeps of the loss: the fp32 log-softmax output."""
    return FP32_BYTES * s * b * model.vocab_size


# Backward of one block reads the gradient of its output and writes the gradient of its
# input: two residual-stream tensors are alive besides the saved activations.
def backward_workspace_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    return 2 * training.precision.compute_bytes * s * b * model.hidden_size


@lru_cache(maxsize=1024)  # as layer_bytes
def activation_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Activations saved for backward by one micro-batch (logits excluded; ``autocast`` as in
    norm_bytes)."""
    return (checkpointed_layers_bytes(model, training, s, b, autocast=autocast)
            + outside_layers_bytes(model, training, s, b, autocast=autocast))
