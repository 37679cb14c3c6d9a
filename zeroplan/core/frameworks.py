"""Framework byte formulas: what torchtitan, Hugging Face Transformers and torchtune hold on a
GPU where they differ from zeroplan's reference transformer (docs/frameworks.md, "Profiles").

The profiles (zeroplan.core.profiles) are data read from each framework's own source; the
functions here turn them into bytes, each with its source file and version on the line above. Only the differences are
modelled here: every term a framework shares with the reference model (the linear inputs, the
SwiGLU MLP, fused SDPA, RoPE saving only its constant cos/sin or complex cache) is computed by
zeroplan.core.activations, which cites its own sources. What the loss holds is
zeroplan.core.framework_loss'. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core import tinyllama
from zeroplan.core.hf_padding_mask import padding_mask_extra_bytes
from zeroplan.core.hf_rotary_cat import rotary_cat_output_copy_bytes, runs_rotary_cat
# At the top, not in autocast_copies_bytes: a from-import there ran at every block's terms under
# DDP's autocast (~2.5 us each, fit ~1.5 a request); zeroplan.core.plan imports it at its start anyway.
from zeroplan.core.params import block_linear_weight_elements
from zeroplan.core.profiles import profile
from zeroplan.core.transformers_release import builds_positions_mask, opt_clamp_score_bytes, positions_mask_side, upcasts_softmax
from zeroplan.specs.finetune import LoraTarget
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec, NormKind, PositionKind
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, Kernels, Precision, TrainingSpec
from zeroplan.units import BF16_BYTES, FP32_BYTES


# torchtune 0.6.1 modules/attention.py: k.unsqueeze(2).expand(...).flatten(1, 2) copies K and
# V to the query head count; SDPA saves the copies, so each is q_size wide instead of kv_size.
def expanded_kv_extra_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Extra bytes one block saves because K and V are expanded before attention."""
    prof = profile(training.framework)
    if not prof.expands_kv_heads:
        return 0
    return 2 * training.precision.compute_bytes * s * b * (model.q_size - model.kv_size)


# transformers 4.56.2 models/llama/modeling_llama.py eager_attention_forward (lines 181-190;
# 4.31.0 LlamaAttention.forward, lines 327-347, the same ops): repeat_kv copies K and V to the
# query head count and the two matmuls keep the copies; the scores pass F.softmax(...,
# dtype=torch.float32), whose backward keeps its fp32 output, then .to(query.dtype), the copy
# softmax@V keeps (what attention_core_terms counts as softmax_output); dropout at p = 0 returns
# its input. So an eager block keeps 4 bytes a score more (none where the compute dtype is fp32:
# the cast returns the same tensor) and the repeated K and V. ALiBi models' fp32 softmax is in
# attention_core_terms already. Measured with saved-tensor hooks on transformers 4.56.2's
# LlamaAttention on the CPU, eager less SDPA (tests/test_eager_attention.py). OPT's own attention
# before transformers 4.49 (zeroplan.core.transformers_release.OPT_OWN_FORWARD_UNTIL) also keeps
# the clamp's input, the masked scores in the compute dtype, and upcasts the softmax only in fp16.
def eager_attention_extra_bytes(request: PlanRequest) -> int:
    """Bytes one block's eager attention keeps beyond attention_core_terms in the framework's code."""
    model, training = request.model, request.training
    if (not profile(training.framework).eager_attention_upcasts_softmax
            or training.attention_kernel is not AttentionKernel.eager or model.position is PositionKind.alibi):
        return 0
    s, b, e = request.batch.seq_len, request.batch.micro_batch_size, training.precision.compute_bytes
    scores = model.num_heads * s * s * b
    upcast = upcasts_softmax(model, training, autocast=request.runs_under_autocast)
    fp32_scores = FP32_BYTES * scores if e < FP32_BYTES and upcast else 0
    clamp = opt_clamp_score_bytes(model, training) * scores
    return fp32_scores + clamp + 2 * e * s * b * (model.q_size - model.kv_size)


# transformers 4.56.2 models/llama/modeling_llama.py LlamaRMSNorm.forward: the fp32 copy of the
# input (saved by pow and by the multiply with rsqrt) is 4 bytes per element, and the multiply
# by the weight saves hidden_states.to(input_dtype): 2 bytes per element when the module runs in
# bf16 (DeepSpeed casts the module; under autocast input_dtype is fp32 and it saves 4, like
# F.rms_norm's two fp32 tensors in zeroplan.core.activations.norm_bytes).
def hf_bf16_norm_savings_bytes(request: PlanRequest) -> int:
    """Bytes per norm that HF's RMSNorm saves less than two fp32 tensors, with a bf16 module (none
    for a LayerNorm: torch's native_layer_norm saves its input in its own dtype, which norm_bytes
    counts already; measured on litgpt's and transformers' GPT-NeoX blocks,
    tests/test_neox_block.py)."""
    # Gemma's RMSNorm scales in fp32 and casts after (ModelSpec.norm_scales_fp32): the product
    # with (1 + weight) keeps the fp32 normalised tensor whatever the module's dtype (measured on
    # GemmaDecoderLayer: tests/test_hf_activation.py).
    if (not profile(request.training.framework).bf16_module_norm_saves_bf16 or not _hf_module_in_bf16(request)
            or request.model.norm is not NormKind.rmsnorm or request.model.norm_scales_fp32):
        return 0
    return (FP32_BYTES - 2) * request.batch.seq_len * request.batch.micro_batch_size * request.model.hidden_size


# torchtitan 0.3.0 models/llama3/__init__.py builds every Llama-3 flavour with fuse_qkv=True
# (models/common/attention.py QKVLinear: one wqkv matmul); the feed-forward is
# w2(silu(w1(x)) * w3(x)) (models/common/feed_forward.py). The block's matmuls in forward order,
# as output widths per token:
def llama_block_mm_widths(model: ModelSpec) -> tuple[int, ...]:
    return (model.q_size + 2 * model.kv_size, model.hidden_size, model.ffn_hidden_size, model.ffn_hidden_size, model.hidden_size)


# torchtitan 0.3.0 torchtitan/distributed/activation_checkpoint.py SelectiveAC._wrap_block: the
# policy MUST_SAVEs the outputs of the ops in _get_default_save_ops (torch's partitioner
# compute-intensive ops: mm, SDPA flash/efficient; plus linear) except every second mm, counted
# afresh in each block's forward (the count is odd for the 1st, 3rd, ... mm: those are kept);
# everything else is recomputed and the checkpoint keeps the block input. With fused QKV the
# kept mms are wqkv, w1 and w2 (wo and w3 are recomputed); SDPA's output and its fp32
# log-sum-exp are kept.
def selective_op_layer_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    e = training.precision.compute_bytes
    sb = s * b
    block_input = e * sb * model.hidden_size
    widths = llama_block_mm_widths(model)
    kept_mm_outputs = e * sb * sum(widths[0::2])
    sdpa = e * sb * model.q_size + FP32_BYTES * model.num_heads * sb
    return block_input + kept_mm_outputs + sdpa




def _hf_module_in_bf16(request: PlanRequest) -> bool:
    # transformers 4.56.2 trainer.py: with DeepSpeed the engine casts the module to bf16; with
    # DDP the Trainer (accelerate prepare_model) keeps fp32 parameters and runs the forward under
    # torch.autocast. With FSDP (accelerate 1.10.1 _prepare_fsdp2 / fsdp2_prepare_model) the
    # sharded parameters are fp32 but fully_shard's MixedPrecisionPolicy(param_dtype=bf16)
    # gathers them in bf16 and no autocast is applied: the blocks compute on a bf16 module.
    # A LoRA base loaded in bf16 (FineTuneSpec.base_dtype) computes in bf16 under autocast too.
    return (request.training.precision is Precision.bf16_pure or request.strategy.kind is not StrategyKind.ddp
            or request.training.finetune.module_in_bf16(request.training.framework))


def residual_element_bytes(request: PlanRequest) -> int:
    """Bytes of one element of the embeddings' output and the residual stream: fp32 for HF under
    autocast (its fp32 embedding output and residual adds stay fp32), else the compute dtype."""
    training = request.training
    if training.framework is Framework.hf and not _hf_module_in_bf16(request):
        return FP32_BYTES
    return training.precision.compute_bytes


def block_input_bytes(request: PlanRequest, s: int, b: int) -> int:
    """The residual-stream tensor a fully checkpointed block keeps (residual_element_bytes wide)."""
    return residual_element_bytes(request) * s * b * request.model.hidden_size


# transformers 4.38.2 models/llama/modeling_llama.py:1074 (zeroplan.core.transformers_release.
# POSITIONS_MASK_RELEASES): ``self.causal_mask[None, None].repeat(b, 1, 1, 1).to(dtype) * min_dtype``,
# b x 1 x P x P in inputs_embeds' dtype, is passed to every decoder layer (:1008-1016). Under
# gradient checkpointing each layer's checkpoint holds its arguments until that layer's backward
# (torch's reentrant CheckpointFunction saves them, the non-reentrant one's recompute closure keeps
# them): the one shared tensor lives from the forward to the first layer's backward, through the
# loss and every block's backward. Without checkpointing no saved tensor is it (eager's and SDPA's
# ``attention_mask[:, :, cache_position, ...]`` index a copy, :377, :662) and it goes when
# LlamaModel.forward returns, before the loss. Measured on 4.38.2's own LlamaForCausalLM on the CPU
# (benchmarks/transformers438_causal_mask.py, benchmarks/transformers438-causal-mask-records.json):
# a weak reference to it is alive after the forward under either checkpoint and not without one,
# and dead after backward; a sample adds its size to the step's peak.
def positions_causal_mask_bytes(request: PlanRequest) -> int:
    """Bytes of the release's b x 1 x P x P causal mask held through backward (0 where the
    release's code builds none, or no block is checkpointed)."""
    model, training, batch = request.model, request.training, request.batch
    if not builds_positions_mask(model, training):
        return 0
    side = positions_mask_side(model, batch.seq_len)
    if training.activation_checkpointing is ActivationCheckpointing.none:
        return 0
    return residual_element_bytes(request) * batch.micro_batch_size * side * side


# lightning 2.4 fabric/plugins/precision/amp.py MixedPrecision (litgpt's "bf16-mixed"): the
# module stays fp32 (no convert_module, no init dtype) and forward_context is torch.autocast,
# so litgpt's GPT on one device caches bf16 weight copies as zeroplan's own model under DDP.
def autocast_caches_weights(request: PlanRequest) -> bool:
    """HF under autocast (any strategy: its Trainer autocasts an fp32 module), or zeroplan's own
    model or litgpt's where the request runs under autocast (DDP and ZeroRedundancyOptimizer;
    litgpt's one device)."""
    if request.training.framework in (Framework.zeroplan, Framework.litgpt):
        return request.runs_under_autocast
    return hf_under_autocast(request)


# The output projection under the same autocast saves its bf16 weight copy (cached, as the
# blocks' weights) from the loss's forward to its backward. Measured for zeroplan's own model on
# a GPU (benchmarks/gpu-allocator-records, ddp: a 125 MiB bf16 copy of the 32000 x 2048 head).
def autocast_head_copy_bytes(request: PlanRequest) -> int:
    """The output projection's bf16 weight copy under zeroplan's own autocast (0 otherwise)."""
    if request.training.framework is not Framework.zeroplan or not request.runs_under_autocast:
        return 0
    return BF16_BYTES * request.model.vocab_size * request.model.hidden_size


def hf_under_autocast(request: PlanRequest) -> bool:
    """HF's Trainer running an fp32 module under torch.autocast (bf16-mixed, not a bf16 module)."""
    training = request.training
    return (training.framework is Framework.hf and training.precision is Precision.bf16_mixed
            and not _hf_module_in_bf16(request))


# Measured from transformers 4.56.2's LlamaDecoderLayer under torch.autocast with fp32 parameters
# (benchmarks/framework-records, hf ddp none: 4,397,858,816 bytes per Llama-3.1-8B block at s 8192,
# b 2; 3,558,866,944 without this term). Autocast casts each nn.Linear's input and weight to bf16
# per call; only casts of leaf tensors (the weights) are cached (torch autocast_mode.cpp
# cached_cast), and each linear saves both bf16 operands for backward. So the block keeps a bf16
# copy of every linear weight, and one bf16 copy of the normed input per projection that reads
# it: q, k and v (three) and gate and up (two), where the planner's block has one of each.
# zeroplan's own model (zeroplan/harness/model.py: separate q, k, v, gate and up linears) under
# DDP's autocast keeps the same, measured on a GPU (benchmarks/gpu-allocator-records, ddp).
def autocast_copies_bytes(request: PlanRequest) -> int:
    """Extra bytes one block keeps under autocast with fp32 parameters (0 otherwise)."""
    if not autocast_caches_weights(request):
        return 0
    model = request.model
    sbh = request.batch.seq_len * request.batch.micro_batch_size * model.hidden_size
    if request.training.finetune.is_lora:
        # Frozen weights are not cached (autocast caches only leaves that require grad) but
        # each matmul still saves its bf16 weight for the input's gradient; the adapters' input
        # copies are zeroplan.core.finetune.activations' (one per adapter), and their own
        # weights' bf16 copies (cached) are counted here.
        from zeroplan.core.finetune.units import adapter_weight_elements
        from zeroplan.core.parallel.units import rank_parameter_units

        adapters = adapter_weight_elements(rank_parameter_units(request)) // model.num_layers
        # bitsandbytes' MatMul4Bit keeps its packed weight, no bf16 copy (autograd/_functions.py).
        base = 0 if request.training.finetune.quantize.is_quantized else block_linear_weight_elements(model)
        return BF16_BYTES * (base + adapters)
    # q, k and v (one copy under a fused qkv weight, litgpt's `attn`); gate and up (gated MLPs).
    extra_input_copies = (0 if profile(request.training.framework).fuses_qkv else 2) + (1 if model.mlp.gated else 0)
    return BF16_BYTES * block_linear_weight_elements(model) + extra_input_copies * BF16_BYTES * sbh


COMPLEX64_BYTES = 8


# torchtitan 0.3.0 trainer.py post_dataloading_process passes the dataloader's per-document
# positions to the model, so models/common/rope.py ComplexRoPE._reshape_cache gathers a fresh
# complex64 cache in every block (_reshape_for_broadcast: rope_cache[positions] for batch 1,
# torch.gather for more), b·s·d/2 elements, which apply_rotary_emb's multiplies save (one tensor
# for q and k). Measured: benchmarks/framework-records, torchtitan ac=none (2,097,152 bytes per
# Llama-3.1-8B block at s 4096, b 1).
def torchtitan_rope_cache_bytes(request: PlanRequest) -> int:
    """Bytes of the position-gathered RoPE cache one torchtitan block saves (0 otherwise)."""
    if request.training.framework is not Framework.torchtitan:
        return 0
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    # torchtitan 0.3.0 models/deepseek_v3/model.py:125 rotates only q_pe and k_pe, qk_rope_head_dim
    # wide, under MLA: its cache is qk_rope_head_dim / 2 complex numbers per position (measured:
    # 524,288 bytes per DeepSeek "16B" block at s 2048, benchmarks/parallel-records/expert).
    rotated = request.model.qk_rope_head_dim if request.model.is_mla else request.model.head_size
    return COMPLEX64_BYTES * tokens * (rotated // 2)


INDEX_BYTES = 8
"""int64, the dtype of torch.argsort's and torch.topk's indices."""


# What one torchtitan 0.3.0 MoE block saves beyond the reference terms (zeroplan.core.activations
# mlp_terms, latent_attention_terms), read from its code and measured on its own DeepSeek "16B"
# under EP + FSDP2 (benchmarks/parallel-records/expert, docs/parallelism-measured.md):
# - models/common/moe.py:298 TokenChoiceTopKRouter.forward runs the gate under
#   torch.autocast(float32): the gate saves fp32 copies of its input (4 T h) and of its weight
#   (4 h E); the 16-bit input (the reference router_input) is saved only by a shared expert's
#   first linear (measured: DeepSeek "16B" keeps it, Qwen3 "30B-A3B", without one, does not);
#   softmax (:306) saves only its fp32 output (4 T E) and the gather (:324) its int64 expert ids
#   (8 T k): these replace the reference router_scores ((e + 4) T E).
# - models/common/token_dispatcher.py:616-619 combine multiplies the fp32 copy of the experts'
#   outputs by the fp32 expert-sorted scores: the product saves both, 4 N h + 4 N for the N = T k
#   routed copies.
# - token_dispatcher.py:93-100 _local_reorder's index ops save two int64 N index tensors (the
#   sorted ids for the scores, the token indices for x, which deterministic_scatter_add saves
#   again); under EP, _permute (:550) saves a third, permuted_indices.
# - models/deepseek_v3/model.py:131-134: v is a split view of wkv_b's output (d_nope + d_v per
#   head); the attention saves v and so keeps the whole storage, e T a d_nope more than the
#   reference's v.
def torchtitan_moe_block_extra_bytes(request: PlanRequest) -> int:
    """Bytes one torchtitan MoE block saves beyond the reference MoE block (0 otherwise)."""
    from zeroplan.core.activations import routed_token_copies

    model = request.model
    if request.training.framework is not Framework.torchtitan or not model.is_moe:
        return 0
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    copies = routed_token_copies(model, tokens)
    h, experts, k = model.hidden_size, model.num_experts, model.experts_per_token
    router = (FP32_BYTES * tokens * h + FP32_BYTES * h * experts + FP32_BYTES * tokens * experts
              + INDEX_BYTES * tokens * k - (e + FP32_BYTES) * tokens * experts)
    if not model.shared_expert_ffn_hidden_size:
        router -= e * tokens * h
    combine = FP32_BYTES * copies * h + FP32_BYTES * copies
    indices = INDEX_BYTES * copies * (3 if request.parallel.ep > 1 else 2)
    latent_v = e * tokens * model.num_heads * (model.head_size - model.qk_rope_head_dim) if model.is_mla else 0
    return router + combine + indices + latent_v


def framework_layer_bytes(request: PlanRequest) -> int:
    """One block's saved bytes without recomputation, in the framework's own model code."""
    from zeroplan.core.activations import layer_bytes
    from zeroplan.core.finetune.activations import lora_layer_delta_bytes

    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    if tinyllama.runs_fork(request):
        # TinyLlama's fork of lit-gpt: its fused kernels (zeroplan.core.tinyllama).
        return tinyllama.block_bytes(request)
    if training.compile and training.framework is Framework.litgpt:
        # litgpt's GPT compiled whole: one block's share of the graph's saved values.
        from zeroplan.core.compiled import litgpt_compiled_layer_bytes

        return litgpt_compiled_layer_bytes(request)
    if training.compile:
        # Inductor's partitioner decides what a compiled block keeps (zeroplan.core.compiled).
        from zeroplan.core.compiled import compiled_layer_bytes

        return compiled_layer_bytes(request) + torchtitan_rope_cache_bytes(request)
    if training.framework is Framework.megatron_deepspeed:
        # The fork's block repeats K and V before either attention kernel and does not fuse
        # SwiGLU (zeroplan.core.megatron_deepspeed).
        from zeroplan.core.megatron_deepspeed import mds_layer_delta_bytes

        return layer_bytes(model, training, s, b) + mds_layer_delta_bytes(request)
    if training.framework is Framework.fairseq:
        # fairseq's decoder layer on torch 1.8: the softmax keeps its scores, GELU its fp32
        # input (zeroplan.core.fairseq).
        from zeroplan.core.fairseq import fairseq_layer_delta_bytes

        return layer_bytes(model, training, s, b) + fairseq_layer_delta_bytes(request)
    if training.framework is Framework.megatron:
        # megatron-core's block is the reference (Korthikanti et al.'s) block but for its fused
        # bias-SwiGLU and eager attention's expanded K/V (zeroplan.core.megatron).
        from zeroplan.core.megatron import megatron_layer_delta_bytes

        return layer_bytes(model, training, s, b) + megatron_layer_delta_bytes(request)
    norm_savings = hf_bf16_norm_savings_bytes(request)
    norms = model.saved_norm_inputs * norm_savings
    return (layer_bytes(model, training, s, b, autocast=request.runs_under_autocast) - norms + expanded_kv_extra_bytes(model, training, s, b)
            + autocast_copies_bytes(request) + torchtitan_rope_cache_bytes(request) + eager_attention_extra_bytes(request)
            + torchtitan_moe_block_extra_bytes(request) + lora_layer_delta_bytes(request, norm_savings)
            + padding_mask_extra_bytes(request) + rotary_cat_extra_bytes(request) + fused_qkv_cache_copies_bytes(request)
            + layer_norm_statistics_bytes(request)
            + litgpt_rms_norm_extra_bytes(request) + litgpt_softcapped_attention_extra_bytes(request))


# litgpt 00af8b0 (and 9a1b82b) litgpt/model.py RMSNorm.forward (lines 564-571): rsqrt's backward
# keeps its fp32 result (one a token), and x_normed * weight.float() keeps the weight's fp32 copy
# for x_normed's gradient, a new tensor where the module is not fp32 (in an fp32 module .float()
# returns the parameter itself). The two fp32 token-wide tensors are composite_rms_norm_bytes'.
# Measured: benchmarks/eager-litgpt-records (Llama-2-7B, Llama-3-8B: 2 x (4 x s + 4 x h) a block).
def litgpt_rms_norm_extra_bytes(request: PlanRequest) -> int:
    """Bytes a litgpt block's RMSNorms keep beyond their two fp32 token-wide tensors."""
    model, training, batch = request.model, request.training, request.batch
    if training.framework is not Framework.litgpt or model.norm is not NormKind.rmsnorm:
        return 0
    rsqrt = FP32_BYTES * batch.seq_len * batch.micro_batch_size
    weight_copy = FP32_BYTES * model.hidden_size if training.precision.compute_bytes != FP32_BYTES and not request.runs_under_autocast else 0
    return model.norms_per_block * (rsqrt + weight_copy)


# litgpt 9a1b82b (and 00af8b0, the profile's commit) litgpt/model.py CausalSelfAttention.forward:
# qkv = self.attn(x) is viewed and permuted (lines 246-247) and split into q, k and v (line 250),
# views of the one matmul output; K and V are expand()ed and reshape()d (copies) only with fewer
# query groups than heads (lines 255-257); apply_rope's output and the torch.cat with the
# pass-through part (lines 263-266, for every rotary_percentage) are new contiguous
# [b, heads, s, d] tensors. SDPA (flash) keeps q, k and v: V, a view, keeps the whole fused
# output (what q_k_v counts), beside the new q and k. Its output takes the query's layout
# (torch's flash mha_fwd: out = at::empty_like(q_padded), q the transposed query; the CPU
# kernel's meta: empty_like(query)), so y.transpose(1, 2).reshape (lines 292-294) copies it for
# the projection, and both are kept: the projection's input (output_projection_input) and
# SDPA's output. transformers 4.56.2 GPT-NeoX does the same (ModelSpec.rotary_cat:
# qkv.chunk(3) views, the partial rotary's cat, attn_output.transpose(1, 2).contiguous() in
# integrations/sdpa_attention.py). Measured with saved-tensor hooks on fake tensors
# (tests/test_neox_block.py): 3 x e x s x b x h a block over the reference block for an MHA
# GPT-NeoX. A padded hf batch runs the memory-efficient kernel, whose output is allocated
# [b, s, heads, d] (_efficient_attention_forward), so its head merge is a view.
def rotary_cat_extra_bytes(request: PlanRequest) -> int:
    """Bytes one block keeps because RoPE writes new q and k while V stays a view of the fused
    qkv output, and because SDPA's output is copied for the output projection
    (zeroplan.core.hf_rotary_cat)."""
    model, training, batch = request.model, request.training, request.batch
    if not runs_rotary_cat(request):
        return 0
    litgpt = training.framework is Framework.litgpt
    hf = training.framework is Framework.hf
    e, sb = training.precision.compute_bytes, batch.seq_len * batch.micro_batch_size
    # The copy is kept by what reads it: a trained projection's matmul, or its LoRA adapter's
    # lora_A without dropout (a frozen base matmul keeps no input; with lora_dropout the adapter
    # keeps its dropped copy and mask instead, zeroplan.core.finetune.activations). Measured on
    # litgpt 9a1b82b's lora.py GPT (Phi-2, every linear adapted, lora_dropout 0.05): SDPA's output
    # kept, the projection's input not.
    # peft's adapters that cast their input to their own dtype keep their copy, not this one
    # (zeroplan.core.finetune.activations.group_adapters_copy_input; measured on peft's LoRA over
    # transformers' PhiDecoderLayer, tests/test_hf_activation.py).
    from zeroplan.core.finetune.activations import group_adapters_copy_input

    finetune = training.finetune
    copy_kept = (not finetune.is_lora or (LoraTarget.o in finetune.targets(training.framework) and finetune.lora_dropout == 0
                                          and not (hf and group_adapters_copy_input(request, "attention"))))
    output_copy = rotary_cat_output_copy_bytes(request) if copy_kept else 0
    # With grouped K/V heads litgpt's expand-and-reshape copies replace V's view
    # (expanded_kv_extra_bytes); the rotated q and k are then the tensors SDPA keeps. transformers'
    # KV cache (TrainingSpec.use_cache; zeroplan.core.kv_cache) hands SDPA its own copies of K and
    # V (cache_utils.py DynamicLayer.update's cat), so V is no view then either.
    view = model.kv_heads == model.num_heads and (litgpt or model.fused_qkv) and not (hf and training.use_cache)
    rotated = e * sb * (model.q_size + model.kv_size) if view else 0
    return output_copy + rotated


# transformers 4.56.2 models/gpt2/modeling_gpt2.py GPT2Attention.forward (lines 310-329): q, k
# and v are views of c_attn's one output; with a cache (GPT2Model.forward:813 and 842-844: the
# config's use_cache, True by default, builds a DynamicCache; only transformers' own gradient
# checkpointing turns it off, :834-839) past_key_values.update (cache_utils.py DynamicLayer.update,
# torch.cat onto an empty tensor) returns copies of K and V, which SDPA then keeps, while q is
# still a view of the fused output, so the whole fused tensor stays too: 2 x e x s x b x kv a
# block beyond the one fused tensor attention_core_terms counts. Eager attention keeps nothing
# more (its matmuls copy q, K and V for bmm whether or not they come from the cache). RoPE models
# rewrite q and k (rotary_cat_extra_bytes), so there the fused output goes. GPTBigCode's
# attention (models/gpt_bigcode/modeling_gpt_bigcode.py:214-229 GPTBigCodeAttention.forward: views of
# c_attn's output, then curr_past_key_value.update) does the same, multi-query
# (kv_size = head_dim) or not. Measured on transformers' GPT2Model and GPTBigCodeModel on the
# CPU (tests/test_hf_activation.py): the planner's fused-qkv families with learned positions.
def fused_qkv_cache_copies_bytes(request: PlanRequest) -> int:
    """Bytes one block's SDPA keeps because the KV cache copies K and V out of a fused qkv output
    that q still views (hf with use_cache, learned positions)."""
    model, training, batch = request.model, request.training, request.batch
    if (training.framework is not Framework.hf or not training.use_cache or not model.fused_qkv or training.compile
            or training.attention_kernel is not AttentionKernel.flash or model.position is not PositionKind.learned):
        return 0
    return 2 * training.precision.compute_bytes * batch.seq_len * batch.micro_batch_size * model.kv_size


# litgpt 00af8b0 (and 9a1b82b) litgpt/model.py CausalSelfAttention.scaled_dot_product_attention
# (lines 303-315): with attention_logit_softcapping (Gemma 2) it does not call SDPA but
# ``scores = q @ k.mT * scale``, ``torch.tanh(scores / cap) * cap`` (tanh's backward keeps its
# result, a [b, heads, s, s] tensor in the compute dtype), adds the mask, ``F.softmax(scores,
# dim=-1, dtype=torch.float)`` (its backward keeps its fp32 result) and ``.to(q.dtype)``, which
# ``scores @ v`` keeps (the same tensor as the softmax's where the compute dtype is fp32). The
# two matmuls keep q and the expanded k and v that SDPA would keep; the bmm's output is not kept
# (its reshape for the projection copies it), so neither SDPA's output (rotary_cat_extra_bytes)
# nor the kernel's log-sum-exp (attention_core_terms) exists. Sliding-window layers only add a
# bias to the mask, which keeps nothing. Measured on litgpt 9a1b82b's lora.py GPT (Gemma-2-2b,
# benchmarks/lora-litgpt-records, tests/test_litgpt_lora_block.py).
def litgpt_softcapped_attention_extra_bytes(request: PlanRequest) -> int:
    """Bytes one litgpt block's soft-capped eager attention keeps beyond the kernel's terms."""
    from zeroplan.core.activations import attention_core_terms

    model, training, batch = request.model, request.training, request.batch
    if training.framework is not Framework.litgpt or not model.attention_softcapping:
        return 0
    e, s, b = training.precision.compute_bytes, batch.seq_len, batch.micro_batch_size
    scores = model.num_heads * s * s * b
    kept = e * scores + FP32_BYTES * scores + (e * scores if e != FP32_BYTES else 0)
    planned = {k: v for k, v in attention_core_terms(model, training, s, b).items() if k != "q_k_v"}
    sdpa_output = e * s * b * model.q_size if training.attention_kernel is AttentionKernel.flash else 0
    return kept - sum(planned.values()) - sdpa_output


# torch 2.13 native_layer_norm (nn.LayerNorm in transformers' and litgpt's blocks): CUDA's
# layer_norm_cuda (aten/src/ATen/native/cuda/layer_norm_kernel.cu) allocates the mean and rstd
# as one value a row in the accumulate type (fp32 for 16-bit inputs), the CPU kernel in the
# parameters' type (the input's dtype when input and weight agree); derivatives.yaml's
# native_layer_norm backward reads input, result1 (mean) and result2 (rstd). Every norm computes
# its own statistics (a parallel residual's two norms of one input included). Measured on
# GPT-NeoX blocks on the CPU: 2 x 2 bytes a token a norm in bf16 (tests/test_neox_block.py).
def layer_norm_statistics_bytes(request: PlanRequest) -> int:
    """Bytes of the LayerNorms' per-token mean and rstd one block keeps (hf and litgpt)."""
    model, training, batch = request.model, request.training, request.batch
    if training.framework not in (Framework.hf, Framework.litgpt) or model.norm is not NormKind.layernorm:
        return 0
    element = FP32_BYTES if training.kernels is Kernels.cuda or request.runs_under_autocast else training.precision.compute_bytes
    return model.norms_per_block * 2 * element * batch.seq_len * batch.micro_batch_size


# torchtune 0.6.1 training/activations.py checkpoint_wrapper: with ac_mode "selective" a
# counter numbers the blocks from 1 in model order and wraps block i when ac_option k divides i.
def selective_layer_checkpointed(training: TrainingSpec, position: int) -> bool:
    """Whether block ``position`` (1-based) is checkpointed under selective-layer."""
    return position % training.selective_layer_interval == 0


# torchtune 0.6.1 (blocks k, 2k, ... checkpointed, the rest keep everything): c = floor(L/k)
# blocks keep their input and L - c blocks all their activations. Backward recomputes a
# checkpointed block once the blocks after it are freed, so one more block's activations are
# alive on top of everything kept only when the last block is a checkpointed one (k divides
# L); otherwise the start of backward is the larger moment (Korthikanti et al. 2022 sec. 5 for
# the recomputed block). k = 1 is full recomputation, L * input + layer.
def selective_layer_layers_bytes(request: PlanRequest, layer: int) -> int:
    num_layers, k = request.model.num_layers, request.training.selective_layer_interval
    checkpointed = num_layers // k
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    kept = checkpointed * block_input_bytes(request, s, b) + (num_layers - checkpointed) * layer
    return kept + (layer if num_layers % k == 0 else 0)


OFFLOAD_MIN_BYTES = 1024
"""torchtune 0.6.1 OffloadActivations(min_offload_size=1024): smaller saved tensors stay."""
OFFLOAD_FORWARD_STASH = 5
"""torchtune 0.6.1 OffloadActivations(max_fwd_stash_size=5), as get_act_offloading_ctx_manager
builds it: an offloaded tensor stays on the device until five later saved tensors are packed."""


# torchtune 0.6.1 training/_activation_offloading.py, as recipes/full_finetune_distributed.py
# uses it (get_act_offloading_ctx_manager around the model's forward, full checkpointing, the
# output projection under NoOpManager). pack_tensor moves to host every saved tensor of at
# least min_offload_size bytes that is not a Parameter or Buffer; under full checkpointing a
# block's one saved tensor is its input (torch 2.13 torch/utils/checkpoint.py
# _CheckpointFrame.save_inputs saves it before the checkpoint's own hooks are entered; the
# block's inner tensors go to those hooks), so no block keeps anything on the device beyond the
# forward stash (offload_forward_stash_bytes). unpack_tensor brings a tensor back only when
# autograd asks for it, so backward holds one recomputed block (its input brought back is the
# tensor its first norm saves again). The stash outlives the forward: OffloadActivations deletes
# it in the hook of the first backward node that unpacks an offloaded tensor
# (_activation_offloading.py unpack_tensor_with_streams, "if there are still things in the
# fwd_stash, get rid of them as we're in bwd now"); the loss's backward unpacks none (its inputs
# stay under NoOpManager). So the loss's moment holds the stash and no recomputed block; the
# plan keeps the stash at a block's backward too (an upper bound: the final norm's backward has
# deleted it by then, and brought back its own tensors).
def offloads_blocks(request: PlanRequest) -> bool:
    """Whether torchtune's offloading moves each block's saved input off the device."""
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    return request.training.activation_offloading and block_input_bytes(request, s, b) >= OFFLOAD_MIN_BYTES


def offloaded_layers_bytes(request: PlanRequest, layer: int) -> int:
    """The forward stash and the one recomputed block (framework_recompute_bytes sets the block
    apart: it is alive only in a block's backward)."""
    return offload_forward_stash_bytes(request) + layer


# torchtune 0.6.1 training/_activation_offloading.py OffloadActivations.pack_tensor: every saved
# tensor (small ones and parameters too) takes the next tensor id, and only when a tensor of at
# least min_offload_size that is no parameter is packed are the stashed ids <= id -
# max_fwd_stash_size released. After the last block's input the forward saves the final norm's
# tensors and nothing more (the output projection runs under NoOpManager). torchtune's RMSNorm
# (modules/rms_norm.py) calls F.rms_norm on x.float() with its 16-bit scale, so torch 2.13 runs
# rms_norm_composite (aten/src/ATen/native/layer_norm.cpp; derivatives.yaml) whose ops save, in
# order: pow the fp32 input, rsqrt its fp32 result, mul the input and that result again, the
# scale's mul the scale (a parameter) and, only where the scale trains (autograd saves an
# operand only for a gradient it must compute), the fp32 normalised product. A trainable scale
# (full fine-tune) ends on that product and releases every block input; a frozen one (LoRA,
# QLoRA) ends on the rsqrt, four ids after the last block input, which stays. Measured with
# torchtune's own llama3_2 and lora_llama3_2, OffloadActivations and its checkpointing on the CPU
# (tests/test_offload_stash.py): the stash at the end of the forward is the fp32 input, its
# fp32 normalised product and the rsqrt (full), the last block input, the fp32 input and the
# rsqrt (LoRA); beside it only the output projection's inputs where its weight trains.
def offload_forward_stash_bytes(request: PlanRequest) -> int:
    """What OffloadActivations' forward stash holds on the device at the end of the forward:
    the hefty tensors among the last max_fwd_stash_size ids up to the last hefty one (each
    storage once)."""
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    block_input = block_input_bytes(request, s, b)
    training = request.training
    if not final_norm_is_stashed(request):
        # Not derived for another norm: every block input the stash can hold.
        return OFFLOAD_FORWARD_STASH * block_input
    sbh_fp32 = FP32_BYTES * s * b * request.model.hidden_size
    rsqrt = FP32_BYTES * s * b
    scale_trains = not training.finetune.is_lora
    # (storage, bytes, offloadable) in pack order: the last blocks' inputs, then the final norm.
    saves = [(f"block{i}", block_input, True) for i in range(OFFLOAD_FORWARD_STASH)]
    saves += [("x", sbh_fp32, True), ("rsqrt", rsqrt, True), ("x", sbh_fp32, True), ("rsqrt", rsqrt, True),
              ("scale", 0, False)]
    if scale_trains:
        saves.append(("normed", sbh_fp32, True))
    hefty = [i for i, (_, n, offloadable) in enumerate(saves) if offloadable and n >= OFFLOAD_MIN_BYTES]
    last = hefty[-1]
    kept = {name: n for i, (name, n, _) in enumerate(saves) if i in hefty and i > last - OFFLOAD_FORWARD_STASH}
    return sum(kept.values())


def final_norm_is_stashed(request: PlanRequest) -> bool:
    """Whether offload_forward_stash_bytes holds the final norm's saved tensors (torchtune's
    composite RMSNorm; the sequence is not derived for another norm)."""
    from zeroplan.core.activations import rms_norm_is_composite

    return request.model.norm is NormKind.rmsnorm and rms_norm_is_composite(request.training, request.runs_under_autocast)


# The output projection under NoOpManager keeps what autograd saves for it on the device: its
# input (a copy per loss chunk, 2sbh in all) only for a gradient that needs it, the head's weight
# or an adapter on the head (torch 2.13 autograd saves an mm operand only for the other
# operand's gradient; measured as offload_forward_stash_bytes is: a frozen head keeps none).
def offloaded_head_input_bytes(request: PlanRequest) -> int:
    from zeroplan.specs.finetune import LoraTarget

    finetune = request.training.finetune
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    trains = (not finetune.is_lora and not finetune.freeze_embeddings) or (
        finetune.is_lora and LoraTarget.output in finetune.targets(request.training.framework))
    return request.training.precision.compute_bytes * s * b * request.model.hidden_size if trains else 0


def selective_op_kept_bytes(request: PlanRequest) -> int:
    """What one block keeps under torchtitan's SelectiveAC, eager or compiled."""
    if request.training.compile:
        from zeroplan.core.compiled import compiled_selective_op_layer_bytes

        return compiled_selective_op_layer_bytes(request)
    return selective_op_layer_bytes(request.model, request.training, request.batch.seq_len, request.batch.micro_batch_size)


def framework_activation_bytes(request: PlanRequest) -> int:
    """Activations saved for backward by one micro-batch (logits excluded)."""
    from zeroplan.core.activations import outside_layers_bytes

    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    if tinyllama.runs_fork(request):
        return tinyllama.activation_bytes(request)
    layer = framework_layer_bytes(request)
    if training.compile and training.framework is Framework.litgpt:
        # litgpt's GPT compiled whole, without checkpointing (zeroplan.core.compiled.COMPILED_POLICIES):
        # every block's share and the final norm's and head's inputs (litgpt_compiled_outside_bytes).
        from zeroplan.core.compiled import litgpt_compiled_outside_bytes

        return model.num_layers * layer + litgpt_compiled_outside_bytes(request)
    mode = training.activation_checkpointing
    frozen = training.finetune.frozen_blocks
    if frozen:
        # zeroplan.core.finetune.activations: the first K blocks of a partly frozen fine-tune.
        from zeroplan.core.finetune.activations import frozen_blocks_kept_bytes

        kept, kept_input = frozen_blocks_kept_bytes(request, layer, block_input_bytes(request, s, b),
                                                    hf_bf16_norm_savings_bytes(request))
        if mode is ActivationCheckpointing.none:
            layers = (model.num_layers - frozen) * layer + frozen * kept
        else:
            layers = (model.num_layers - frozen) * block_input_bytes(request, s, b) + frozen * kept_input + layer
    elif offloads_blocks(request):
        layers = offloaded_layers_bytes(request, layer)
    elif mode is ActivationCheckpointing.none:
        layers = model.num_layers * layer
    elif mode is ActivationCheckpointing.selective_op:
        kept = selective_op_kept_bytes(request)
        layers = model.num_layers * kept + layer - kept
    elif mode is ActivationCheckpointing.selective_layer:
        layers = selective_layer_layers_bytes(request, layer)
    elif mode is ActivationCheckpointing.selective:
        # Korthikanti et al. 2022 sec. 5 (megatron's recompute_modules ["core_attn"]): every
        # block keeps all but its attention core, which one block's backward rebuilds.
        kept = layer - selective_core_bytes(request)
        layers = model.num_layers * kept + layer - kept
    else:
        # Korthikanti et al. 2022 sec. 5: each block's input kept, one block recomputed at a time;
        # what escapes a non-reentrant checkpoint stays with every block (checkpoint_escaping_inputs_bytes).
        from zeroplan.core.finetune.activations import checkpoint_escaping_inputs_bytes

        layers = model.num_layers * (block_input_bytes(request, s, b) + checkpoint_escaping_inputs_bytes(request)) + layer
    norm_savings = hf_bf16_norm_savings_bytes(request)
    outside = (outside_layers_bytes(model, training, s, b, autocast=request.runs_under_autocast) + autocast_head_copy_bytes(request)
               + positions_causal_mask_bytes(request))
    if offloads_blocks(request) and final_norm_is_stashed(request):
        # The final norm's tensors are in the forward stash (offload_forward_stash_bytes) and the
        # output projection keeps its input only for a gradient that needs it.
        from zeroplan.core.activations import norm_bytes

        outside -= (norm_bytes(model, training, s, b, autocast=request.runs_under_autocast)
                    + training.precision.compute_bytes * s * b * model.hidden_size - offloaded_head_input_bytes(request))
    return layers + outside - norm_savings


# Korthikanti et al. 2022 sec. 5: with recomputation one block's activations are rebuilt only
# while that block's backward runs; the loss's forward and backward come before any block's
# backward, with only the kept tensors alive (each block's input under full recomputation,
# torchtitan's saved op outputs under selective-op). The framework step records
# (benchmarks/framework-step-records, ac=full) reach their peak there, without that block.
def framework_recompute_bytes(request: PlanRequest) -> int:
    """The part of framework_activation_bytes alive only during a block's backward."""
    training = request.training
    mode = training.activation_checkpointing
    if offloads_blocks(request):
        return framework_layer_bytes(request)
    if training.activation_offloading or mode is ActivationCheckpointing.none:
        return 0
    layer = framework_layer_bytes(request)
    if mode is ActivationCheckpointing.selective_op:
        return layer - selective_op_kept_bytes(request)
    if mode is ActivationCheckpointing.selective:
        return selective_core_bytes(request)
    return layer


# Korthikanti et al. 2022 sec. 5, as megatron-core's transformer/attention.py
# _checkpointed_attention_forward runs it: the core attention (QK^T, softmax, its dropout,
# softmax@V) is recomputed, Q, K and V (its inputs) stay saved; under eager attention the
# expanded K and V are made inside the recomputed core too.
def selective_core_bytes(request: PlanRequest) -> int:
    """Bytes of one block's attention core that selective recomputation drops."""
    from zeroplan.core.activations import selective_recompute_savings
    from zeroplan.core.megatron import megatron_expanded_kv_bytes

    s, b = request.batch.seq_len, request.batch.micro_batch_size
    savings = selective_recompute_savings(request.model, request.training, s, b)
    if request.training.framework is Framework.megatron_deepspeed:
        # The fork's ParallelAttention repeats K and V before its checkpointed core attention
        # (megatron/model/transformer.py:743-745, then _checkpointed_attention_forward): the
        # copies are the core's saved inputs, not recomputed inside it.
        return savings
    return savings + megatron_expanded_kv_bytes(request)




# What block ``position`` (1-based) keeps for backward on the device under the policy: every
# saved tensor without recomputation (framework_layer_bytes), the checkpoint's block input with
# full recomputation (Korthikanti et al. 2022 sec. 5), torchtitan's kept op outputs with
# selective-op, one or the other by position with selective-layer, nothing once torchtune
# offloads (offloaded_layers_bytes: its one saved tensor, the block input, is at least
# OFFLOAD_MIN_BYTES for any real model). This is the per-block figure
# zeroplan.frameworks.measure records from the frameworks' own code.
def framework_block_kept_bytes(request: PlanRequest, position: int = 1) -> int:
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    training = request.training
    mode = training.activation_checkpointing
    if offloads_blocks(request):
        return 0
    if mode is ActivationCheckpointing.selective_layer:
        mode = ActivationCheckpointing.full if selective_layer_checkpointed(training, position) else ActivationCheckpointing.none
    if mode is ActivationCheckpointing.none:
        return framework_layer_bytes(request)
    if mode is ActivationCheckpointing.selective_op:
        return selective_op_kept_bytes(request)
    if mode is ActivationCheckpointing.selective:
        return framework_layer_bytes(request) - selective_core_bytes(request)
    return block_input_bytes(request, s, b)
