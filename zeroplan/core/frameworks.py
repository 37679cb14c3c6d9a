"""Framework byte formulas: what torchtitan, Hugging Face Transformers and torchtune hold on a
GPU where they differ from zeroplan's reference transformer (docs/frameworks.md, "Profiles").

The profiles (zeroplan.core.profiles) are data read from each framework's own source; the
functions here turn them into bytes, each with its source file and version on the line above. Only the differences are
modelled here: every term a framework shares with the reference model (the linear inputs, the
SwiGLU MLP, fused SDPA, RoPE saving only its constant cos/sin or complex cache) is computed by
zeroplan.core.activations, which cites its own sources. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.compiled import COMPILED_CROSS_ENTROPY_ROW_BYTES, compiled_chunked_logits_pieces, compiles_loss
from zeroplan.core.profiles import fsdp_separates_embedding_and_head, loss_chunks, profile
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import MlpKind, ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, Precision, TrainingSpec

FP32_BYTES = 4


# torchtune 0.6.1 modules/attention.py: k.unsqueeze(2).expand(...).flatten(1, 2) copies K and
# V to the query head count; SDPA saves the copies, so each is q_size wide instead of kv_size.
def expanded_kv_extra_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> int:
    """Extra bytes one block saves because K and V are expanded before attention."""
    prof = profile(training.framework)
    if not prof.expands_kv_heads:
        return 0
    return 2 * training.precision.compute_bytes * s * b * (model.q_size - model.kv_size)


# transformers 4.56.2 models/llama/modeling_llama.py LlamaRMSNorm.forward: the fp32 copy of the
# input (saved by pow and by the multiply with rsqrt) is 4 bytes per element, and the multiply
# by the weight saves hidden_states.to(input_dtype): 2 bytes per element when the module runs in
# bf16 (DeepSpeed casts the module; under autocast input_dtype is fp32 and it saves 4, like
# F.rms_norm's two fp32 tensors in zeroplan.core.activations.norm_bytes).
def hf_bf16_norm_savings_bytes(request: PlanRequest) -> int:
    """Bytes per norm that HF's RMSNorm saves less than two fp32 tensors, with a bf16 module."""
    if not profile(request.training.framework).bf16_module_norm_saves_bf16 or not _hf_module_in_bf16(request):
        return 0
    return (FP32_BYTES - 2) * request.batch.seq_len * request.batch.micro_batch_size * request.model.hidden_size


# torchtitan 0.3.0 models/llama3/__init__.py builds every Llama-3 flavour with fuse_qkv=True
# (models/common/attention.py QKVLinear: one wqkv matmul); the feed-forward is
# w2(silu(w1(x)) * w3(x)) (models/common/feed_forward.py). The block's matmuls in forward order,
# as output widths per token:
def llama_block_mm_widths(model: ModelSpec, fused_qkv: bool) -> tuple[int, ...]:
    qkv = (model.q_size + 2 * model.kv_size,) if fused_qkv else (model.q_size, model.kv_size, model.kv_size)
    return (*qkv, model.hidden_size, model.ffn_hidden_size, model.ffn_hidden_size, model.hidden_size)


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
    widths = llama_block_mm_widths(model, fused_qkv=True)
    kept_mm_outputs = e * sb * sum(widths[0::2])
    sdpa = e * sb * model.q_size + FP32_BYTES * model.num_heads * sb
    return block_input + kept_mm_outputs + sdpa


# torchtune 0.6.1 modules/loss/ce_chunked_output_loss.py: the output projection returns
# num_output_chunks bf16 chunks and each is upcast and passed through F.cross_entropy on its
# own. The largest moment of its forward is the last chunk's: all bf16 chunks (2sbV), the fp32
# log-softmax of the chunks before (saved, 4sbV in all) and the last chunk's fp32 copy
# (4sbV/n). Backward first holds the saved log-softmax and one chunk's two fp32 gradients;
# once every chunk's loss backward has run, the n bf16 logit gradients (2sbV) wait for the
# output projection's backward, which adds ``head_backward_bytes`` (fsdp_chunked_head_bytes).
def chunked_logits_pieces(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int,
                          head_backward_bytes: int = 0) -> tuple[int, int, int]:
    """The loss's bytes at its three moments: its forward, its backward, the head's backward."""
    sbv = s * b * model.vocab_size
    forward = training.precision.compute_bytes * sbv + FP32_BYTES * sbv + FP32_BYTES * sbv // chunks
    backward = FP32_BYTES * sbv + 2 * FP32_BYTES * sbv // chunks
    head = training.precision.compute_bytes * sbv + head_backward_bytes
    return forward, backward, head


def chunked_logits_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int,
                         head_backward_bytes: int = 0) -> int:
    """The largest of chunked_logits_pieces."""
    return max(chunked_logits_pieces(model, training, s, b, chunks, head_backward_bytes))


TORCHTITAN_LOSS_CHUNKS = 8
"""torchtitan 0.3.0 components/loss.py:610 ChunkedLossWrapper.Config.num_chunks, which
models/llama3/config_registry.py llama3_8b/70b/405b (lines 187, 260, 312) leave at its default."""


# torchtitan 0.3.0 components/loss.py:567-790 ChunkedLossWrapper (trainer.py:513-535 sets it the
# model's lm_head and _skip_lm_head): the model returns the normed hidden states, and for each of
# n sequence chunks the wrapper runs lm_head, CrossEntropyLoss (line 32: the chunk's logits upcast
# to fp32) and that chunk's backward at once, copying each hidden-state gradient into an fp32
# [b, s, h] GradAccumulator buffer (line 498). Only one chunk's logits ever exist, never the
# whole b x s x V. Under FSDP2 (line 731) the head stays gathered over the chunks, its bf16
# weight gradient accumulates unsharded and is reduce-scattered once, at the last chunk: in
# fp32 (config/configs.py:93 mixed_precision_reduce), a fp32 copy of it and the
# reduce-scatter's fp32 input, plus its 1/N output. That moment is the loss's largest in the
# framework's own step (benchmarks/framework-step-records: FSDPMemTracker's 'temp' at every
# chunked record's peak is, to the byte, those three and the chunk's hidden-state gradient, its
# 'unsharded_grad' the bf16 head gradient), beside the gathered head, the fp32 buffer and the
# chunk's bf16 logits.
def torchtitan_chunked_loss_bytes(request: PlanRequest) -> int:
    """The chunked loss's largest moment: the last chunk's head reduce-scatter."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    e = training.precision.compute_bytes
    if s % TORCHTITAN_LOSS_CHUNKS:
        # components/loss.py:672: "sequence length must be divisible by num_chunks".
        raise ZeroplanError("batch.seq_len", f"{s}: torchtitan's chunked loss needs a multiple of {TORCHTITAN_LOSS_CHUNKS} (or unchunked_loss, --unchunked-loss)")
    rows = b * s // TORCHTITAN_LOSS_CHUNKS
    chunk = e * rows * model.vocab_size + e * rows * model.hidden_size
    accumulator = FP32_BYTES * b * s * model.hidden_size + torchtitan_hidden_chunk_copies_bytes(request)
    vh = model.vocab_size * model.hidden_size
    head = e * vh
    if request.strategy.kind in (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.hsdp):
        head += 2 * FP32_BYTES * vh + FP32_BYTES * vh // request.shard_group_size
    return chunk + accumulator + head + fsdp_head_gathered_bytes(request, prefetched=False)


# torchtitan 0.3.0 components/loss.py ChunkedLossWrapper.__call__ runs each chunk's lm_head, its
# CrossEntropyLoss and that chunk's backward in turn, the chunk's bf16 logits held by the loop
# until the backward is done. Eager, cross_entropy_loss upcasts the logits and F.cross_entropy
# saves the fp32 log-softmax (4 bytes a logit); its backward reaches the upcast's bf16 gradient
# with the nll gradient and the log-softmax gradient (fp32 both) still held: 16 bytes a logit
# with the bf16 logits, before the head's backward starts (measured: every storage of the
# framework's own step, 8B s16384 b4 full recomputation, at its peak: _log_softmax,
# nll_loss_backward and _log_softmax_backward_data outputs in fp32, the mm's logits and the
# _to_copy gradient in bf16). Compiled (the
# loss is in torchtitan's default CompileConfig.components), the chunk's cross-entropy keeps its
# bf16 logits and 8 bytes a row, and its backward writes one bf16 gradient
# (zeroplan.core.compiled, benchmarks/compiled-loss-records). With few rows a chunk the last
# chunk's head reduce-scatter is larger (torchtitan_chunked_loss_bytes); from about
# b x s / 8 > h rows on, this moment is.
def torchtitan_chunk_cross_entropy_bytes(request: PlanRequest) -> int:
    """The chunked loss at its first chunk's cross-entropy backward."""
    return sum(torchtitan_chunk_cross_entropy_parts(request))


def torchtitan_chunk_cross_entropy_parts(request: PlanRequest) -> list[int]:
    """The tensors of torchtitan_chunk_cross_entropy_bytes, one by one: the chunk's bf16 logits,
    what its cross-entropy holds (eager: the fp32 log-softmax, nll and log-softmax gradients and
    the bf16 gradient; compiled: the bf16 gradient and the row statistics), the fp32 gradient
    buffer and the gathered head."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    e = training.precision.compute_bytes
    rows = b * s // TORCHTITAN_LOSS_CHUNKS
    logits = rows * model.vocab_size
    if training.compile:
        cross_entropy = [e * logits, COMPILED_CROSS_ENTROPY_ROW_BYTES * rows]
    else:
        cross_entropy = [FP32_BYTES * logits, FP32_BYTES * logits, FP32_BYTES * logits, e * logits]
    accumulator = FP32_BYTES * b * s * model.hidden_size
    return [e * logits, *cross_entropy, accumulator, torchtitan_hidden_chunk_copies_bytes(request),
            fsdp_head_gathered_bytes(request, prefetched=False)]


# ChunkedLossWrapper._chunk_local: ``c.contiguous()`` of each torch.split(hidden, s / n, dim=1)
# piece, detached as the loop's leaves. With b > 1 a piece of dim 1 is not contiguous, so the n
# pieces are copies, b x s x h in all, held through the loop (measured: eight 64 MiB bf16 storages
# alive at the cross-entropy moment of the 8B s16384 b4 step). With b = 1 they are views: the
# term is charged there too, because the plan search needs every loss moment affine in the
# micro-batch (zeroplan.core.search), an over-count of s x h in bf16 on the safe side (32 MiB for
# 8B at s 4096, 256 MiB at s 32768).
def torchtitan_hidden_chunk_copies_bytes(request: PlanRequest) -> int:
    """The chunked loss's copies of the normed hidden states."""
    return request.training.precision.compute_bytes * request.batch.micro_batch_size * request.batch.seq_len \
        * request.model.hidden_size


def torchtitan_chunked_loss(training: TrainingSpec) -> bool:
    """Whether the loss is torchtitan's ChunkedLossWrapper (framework_logits_pieces' moments are
    then torchtitan_chunked_loss_bytes and torchtitan_chunk_cross_entropy_bytes)."""
    return (training.framework is Framework.torchtitan and not training.unchunked_loss
            and not training.fused_linear_cross_entropy)


# torchtune 0.6.1 modules/transformer.py TransformerDecoder.chunked_output calls self.output once
# per chunk; under FSDP2 (torch 2.13 _fully_shard/_fsdp_state.py) each call is a forward of the
# `output` unit with its own pre-backward, so in backward the unit is all-gathered again for
# every chunk, and its weight gradient is accumulated out of place (aten.add.Tensor, traced
# under fake tensors on the framework's own step): from the second chunk on, the accumulated
# gradient, the chunk's new mm output and their sum (3 unsharded V x h gradients) live beside
# the gathered weight. Each such all-gather also holds, until its copy-out is done, the
# all-gather output beside the unit's unsharded parameters: twice the unit. With the head frozen
# (LoRA) there is no gradient to accumulate and that copy-out is the larger moment (measured:
# torchtune LoRA, whose configs leave the output projection in the root unit with the
# embedding, benchmarks/framework-finetune-step-records: 'unsharded_param' and 'all_gather'
# both the root unit's 2,101,354,496 bytes at the peak, 'temp' the bf16 logit gradients).
def fsdp_chunked_head_bytes(request: PlanRequest) -> int:
    """What the output projection's backward adds to the bf16 logit gradients (0 unless the
    framework chunks its loss and its FSDP2 gathers the head per chunk under full sharding)."""
    if loss_chunks(request.training) == 1:
        return 0
    gathered = fsdp_head_gathered_bytes(request)
    if gathered == 0:
        return 0
    # Under LoRA the head's weight is frozen (an adapter on it has its own small gradient).
    finetune = request.training.finetune
    head_trainable = not finetune.is_lora and not finetune.freeze_embeddings
    head_gradient = request.model.vocab_size * request.model.hidden_size * request.training.precision.compute_bytes
    copy_out = 2 * fsdp_head_gathered_bytes(request, prefetched=False)
    return max(copy_out, gathered + (3 * head_gradient if head_trainable else 0))


# torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_state.py _pre_backward ->
# _fsdp_param_group.py pre_backward: the first unit to run backward is the one that ran the
# output projection last in forward; reshard_after_forward freed its parameters, so its
# pre-backward hook all-gathers them again (in the compute dtype) while the loss's gradient
# tensors are still alive, and prefetches the next unit in backward order. HF's (accelerate)
# root unit holds the embedding and lm_head, and the next is the last decoder layer; torchtune's
# `output` is a unit of its own, and the next, the root, holds only the final norm. FSDPMemTracker
# at the loss backward of both (benchmarks/framework-step-records): 'unsharded_param' is that
# unit, 'all_gather' the prefetched one.
def fsdp_head_gathered_bytes(request: PlanRequest, *, prefetched: bool = True) -> int:
    """Gathered parameters alive at the loss's backward beside the loss's tensors (0 unless
    the framework's profile says its FSDP2 step does this, under full sharding). Without
    ``prefetched``: the head's unit alone, as during the loss's forward (nothing is prefetched
    after the last block's forward)."""
    from zeroplan.core.layout import element_bytes
    from zeroplan.core.model_states import unit_gather_bytes

    prof = profile(request.training.framework)
    if not prof.fsdp_loss_backward_gathers_head or request.strategy.kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp):
        return 0
    compute_bytes = element_bytes(request.training.precision, request.convention).compute_parameter
    padded = unit_gather_bytes(request, request.shard_group_size, compute_bytes)
    embedding, last_block, head = padded[0], padded[-2], padded[-1]
    if fsdp_separates_embedding_and_head(request):
        gathered = head  # the output unit; the root after it holds only the final norm
    else:
        gathered = embedding + head + (request.strategy.prefetch_units * last_block if prefetched else 0)
    return gathered


def _hf_module_in_bf16(request: PlanRequest) -> bool:
    # transformers 4.56.2 trainer.py: with DeepSpeed the engine casts the module to bf16; with
    # DDP the Trainer (accelerate prepare_model) keeps fp32 parameters and runs the forward under
    # torch.autocast. With FSDP (accelerate 1.10.1 _prepare_fsdp2 / fsdp2_prepare_model) the
    # sharded parameters are fp32 but fully_shard's MixedPrecisionPolicy(param_dtype=bf16)
    # gathers them in bf16 and no autocast is applied: the blocks compute on a bf16 module.
    # A LoRA base loaded in bf16 (FineTuneSpec.base_dtype) computes in bf16 under autocast too.
    return (request.training.precision is Precision.bf16_pure or request.strategy.kind is not StrategyKind.ddp
            or request.training.finetune.module_in_bf16(request.training.framework))


def block_input_bytes(request: PlanRequest, s: int, b: int) -> int:
    """The residual-stream tensor a fully checkpointed block keeps: fp32 for HF under autocast
    (its fp32 embedding output and residual adds stay fp32), else the compute dtype."""
    training = request.training
    width = training.precision.compute_bytes
    if training.framework is Framework.hf and not _hf_module_in_bf16(request):
        width = FP32_BYTES
    return width * s * b * request.model.hidden_size


BF16_BYTES = 2


def autocast_caches_weights(request: PlanRequest) -> bool:
    """HF under autocast (any strategy: its Trainer autocasts an fp32 module), or zeroplan's own
    model where the request runs under autocast (DDP and ZeroRedundancyOptimizer)."""
    if request.training.framework is Framework.zeroplan:
        return request.runs_under_autocast
    return _hf_under_autocast(request)


# The output projection under the same autocast saves its bf16 weight copy (cached, as the
# blocks' weights) from the loss's forward to its backward. Measured for zeroplan's own model on
# a GPU (benchmarks/gpu-allocator-records, ddp: a 125 MiB bf16 copy of the 32000 x 2048 head).
def autocast_head_copy_bytes(request: PlanRequest) -> int:
    """The output projection's bf16 weight copy under zeroplan's own autocast (0 otherwise)."""
    if request.training.framework is not Framework.zeroplan or not request.runs_under_autocast:
        return 0
    return BF16_BYTES * request.model.vocab_size * request.model.hidden_size


def _hf_under_autocast(request: PlanRequest) -> bool:
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
    from zeroplan.core.params import block_linear_weight_elements

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
    extra_input_copies = 2 + (0 if model.mlp is MlpKind.gelu else 1)  # q, k, v; gate and up (gated MLPs)
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
    if training.compile:
        # Inductor's partitioner decides what a compiled block keeps (zeroplan.core.compiled).
        from zeroplan.core.compiled import compiled_layer_bytes

        return compiled_layer_bytes(request) + torchtitan_rope_cache_bytes(request)
    norm_savings = hf_bf16_norm_savings_bytes(request)
    norms = model.norms_per_block * norm_savings
    return (layer_bytes(model, training, s, b, autocast=request.runs_under_autocast) - norms + expanded_kv_extra_bytes(model, training, s, b)
            + autocast_copies_bytes(request) + torchtitan_rope_cache_bytes(request)
            + torchtitan_moe_block_extra_bytes(request) + lora_layer_delta_bytes(request, norm_savings))


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
# block's inner tensors go to those hooks), so no block keeps anything on the device. Its forward
# stash keeps each offloaded tensor alive until five later ones are packed: the inputs of the
# last five blocks (measured: device bytes grow by one block input over blocks 2 to 5 and not
# from block 6 on, Llama-3.1-8B, s 4096, 9 blocks); at the end of the forward the final norm's saved
# tensors, until backward starts (counted in outside_layers_bytes, with the output
# projection's input, which NoOpManager keeps). unpack_tensor brings a tensor back only when
# autograd asks for it, so backward holds one recomputed block (its input brought back is the
# tensor its first norm saves again). The stash outlives the forward: OffloadActivations deletes
# it in the hook of the first backward node that unpacks an offloaded tensor
# (_activation_offloading.py unpack_tensor_with_streams, "if there are still things in the
# fwd_stash, get rid of them as we're in bwd now"), i.e. in the last block's backward; the loss's
# backward unpacks none (its inputs stay under NoOpManager). So the loss's moment holds the stash
# and no recomputed block, and the first block's backward the stash and its recomputed block.
def offloads_blocks(request: PlanRequest) -> bool:
    """Whether torchtune's offloading moves each block's saved input off the device."""
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    return request.training.activation_offloading and block_input_bytes(request, s, b) >= OFFLOAD_MIN_BYTES


def offloaded_layers_bytes(request: PlanRequest, layer: int) -> int:
    """The forward stash and the one recomputed block (framework_recompute_bytes sets the block
    apart: it is alive only in a block's backward)."""
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    forward_stash = OFFLOAD_FORWARD_STASH * block_input_bytes(request, s, b)
    return forward_stash + layer


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
    layer = framework_layer_bytes(request)
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
    else:
        # Korthikanti et al. 2022 sec. 5: each block's input kept, one block recomputed at a time.
        layers = model.num_layers * block_input_bytes(request, s, b) + layer
    norm_savings = hf_bf16_norm_savings_bytes(request)
    outside = outside_layers_bytes(model, training, s, b, autocast=request.runs_under_autocast) + autocast_head_copy_bytes(request)
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
    return layer


def framework_logits_pieces(request: PlanRequest) -> tuple[int, ...]:
    """The loss's bytes at each moment that can be its largest (each affine in the micro-batch)."""
    from zeroplan.core.activations import logits_bytes

    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    chunks = loss_chunks(training)
    if torchtitan_chunked_loss(training):
        return torchtitan_chunked_loss_bytes(request), torchtitan_chunk_cross_entropy_bytes(request)
    if training.fused_linear_cross_entropy:
        return fused_linear_cross_entropy_pieces(request)
    if chunks > 1 and compiles_loss(training):
        return compiled_chunked_logits_pieces(model, training, s, b, chunks, fsdp_chunked_head_bytes(request))
    if chunks > 1:
        return chunked_logits_pieces(model, training, s, b, chunks, fsdp_chunked_head_bytes(request))
    if training.unchunked_loss and training.framework is Framework.torchtune:
        return torchtune_unchunked_logits_pieces(request)
    # The loss's fp32 tensors are alive at the start of its backward, beside the head's unit
    # that FSDP2 gathers then (fsdp_head_gathered_bytes; 0 outside a framework's FSDP2).
    return (logits_bytes(model, training, s, b) + fsdp_head_gathered_bytes(request),)


# torchtune 0.6.1 with a plain torch.nn.CrossEntropyLoss as its recipe's loss (TrainingSpec.
# unchunked_loss): the loss runs outside the model on logits the model upcast whole
# (modules/transformer.py unembed), so its backward (logits_bytes: three fp32 sbV tensors) runs
# before any FSDP2 unit's pre-backward; the output unit is gathered only once the logits' fp32
# gradient reaches the `.float()`, beside it and its bf16 cast (measured: the framework's own
# step, benchmarks/framework-step-records `+unchunked-loss`: FSDPMemTracker's 'unsharded_param'
# 0 at the peak, 'temp' the two fp32 gradients, 'act' the log-softmax).
def torchtune_unchunked_logits_pieces(request: PlanRequest) -> tuple[int, int]:
    """(the loss's backward, the start of the output projection's backward)."""
    from zeroplan.core.activations import logits_bytes

    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    sbv = s * b * model.vocab_size
    head = (FP32_BYTES + training.precision.compute_bytes) * sbv + 2 * fsdp_head_gathered_bytes(request, prefetched=False)
    return logits_bytes(model, training, s, b), head


# liger-kernel 0.6.2 ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward:
# inc_factor = cdiv(V, H), chunk_size = next_power_of_2(cdiv(BT, inc_factor)), so that one
# chunk's logits are about as large as the BT x H input; the last chunk is what is left of BT.
def fused_linear_cross_entropy_chunk_rows(model: ModelSpec, tokens: int) -> int:
    """Rows (tokens) of the largest chunk whose logits liger's fused linear cross-entropy forms."""
    inc_factor = -(-model.vocab_size // model.hidden_size)
    chunk_size = 1 << (-(-tokens // inc_factor) - 1).bit_length()
    return min(chunk_size, tokens)


def _fused_loss_widths(request: PlanRequest) -> tuple[int, int]:
    """(bytes of an element of the head's input and weight, bytes of an element of a matmul
    output): under HF's autocast with fp32 parameters the final norm's output and lm_head's
    weight are fp32 and the matmuls write bf16; on a bf16 module all three are bf16."""
    compute = request.training.precision.compute_bytes
    return (FP32_BYTES if _hf_under_autocast(request) else compute), compute


# liger-kernel 0.6.2 ops/fused_linear_cross_entropy.py, as transformers 4.56.2's Trainer applies
# it (model/llama.py lce_forward -> loss_utils.py LigerForCausalLMLoss, accum_dtype None).
# fused_linear_cross_entropy_forward allocates grad_input = zeros_like(_input) (BT x H) and
# grad_weight = zeros_like(weight) (V x H), both in their input's dtype, and loss_1d (BT fp32).
# Per chunk: logits_chunk = _input_chunk @ weight.t() (r x V, in place of its gradient after the
# Triton cross-entropy kernel, which works in registers), then
# grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float(): a V x H matmul output
# and, unless that is already fp32, its fp32 copy, both alive at the add. From the second chunk
# on, the new logits_chunk is formed while the previous one is still bound (grad_logits_chunk).
# ctx.save_for_backward keeps grad_input and grad_weight; backward only scales them in place
# (element_mul_kernel) and hands them to autograd, so the head's input (counted in
# outside_layers_bytes) is no longer alive then. Three moments: the weight-gradient add, the
# second chunk's logits (only with more than one chunk) and the loss's backward; under FSDP2 the
# head's unit is gathered at each (fsdp_head_gathered_bytes: the loss runs inside the root
# unit's forward, and the backward gathers it again with the last block prefetched). Under
# autocast with an fp32 weight (torch 2.13 aten/src/ATen/autocast_mode.cpp cached_cast: casts of
# leaf tensors that require grad are cached until the autocast region exits) a bf16 copy of
# lm_head.weight lives through the forward's chunks. The label tensors (int64 shift_labels and
# its bool mask, 9 bytes a token) are left out, as the unfused loss leaves out its labels.
def fused_linear_cross_entropy_pieces(request: PlanRequest) -> tuple[int, ...]:
    """The fused loss's bytes at its moments: weight-gradient add, next chunk, loss backward."""
    model, training = request.model, request.training
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    vh = model.vocab_size * model.hidden_size
    stored, matmul = _fused_loss_widths(request)
    kept = stored * tokens * model.hidden_size + stored * vh
    weight_cast = matmul * vh if matmul != stored else 0
    forward = kept + FP32_BYTES * tokens + weight_cast + fsdp_head_gathered_bytes(request, prefetched=False)
    rows = fused_linear_cross_entropy_chunk_rows(model, tokens)
    chunk_logits = matmul * rows * model.vocab_size
    weight_add = forward + chunk_logits + matmul * vh + (FP32_BYTES * vh if matmul != FP32_BYTES else 0)
    pieces = [weight_add]
    if rows < tokens:
        pieces.append(forward + 2 * chunk_logits)
    head_input = training.precision.compute_bytes * tokens * model.hidden_size
    pieces.append(kept + fsdp_head_gathered_bytes(request) - head_input)
    return tuple(pieces)


def framework_logits_bytes(request: PlanRequest) -> int:
    """The loss's largest moment: logits and the cross-entropy's fp32 tensors (and, in a
    framework's FSDP2, the head's unit gathered for its backward)."""
    return max(framework_logits_pieces(request))


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
    return block_input_bytes(request, s, b)
