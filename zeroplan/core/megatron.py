"""megatron-core's bytes where they differ from the reference model (docs/frameworks.md,
"Megatron-LM"): the contiguous gradient buffer and the distributed optimizer's sharding of fp32
main parameters and Adam states, its fused bias-SwiGLU, its grouped-query attention without a
fused kernel, and its vocabulary-parallel cross-entropy. Every other activation term (the
Korthikanti et al. 2022 block under tensor, sequence and pipeline parallelism) is the reference
model's, which zeroplan.core.activations and zeroplan.core.parallel compute. Paths are
megatron/core/... in megatron-core 0.16.1 (PyPI). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from zeroplan.core.activations import DROPOUT_MASK_BYTES
from zeroplan.core.optimizer_states import elementwise_state_bytes
from zeroplan.core.parallel.units import MEGATRON_SHARED_EMBEDDING, rank_trainable_units
from zeroplan.specs.model import MlpKind
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import AttentionKernel, Precision
from zeroplan.units import FP32_BYTES, ceil_div


@dataclass(frozen=True)
class MegatronStates:
    """One rank's model states under megatron-core (zeroplan.core.model_states wraps them)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    """fp32 main parameters plus the optimizer's own states; no per-tensor step counters."""
    buffer_elements: int
    optimizer_elements: int

PARAM_START_ALIGNMENT = 64
"""distributed/param_and_grad_buffer.py _pad_start_of_param_if_needed: with the distributed
optimizer each parameter starts at a multiple of 64 elements (128-byte aligned at 16 bits)."""
BUCKET_END_ALIGNMENT = 128
"""_pad_end_of_bucket_if_needed: a bucket ends at a multiple of lcm(dp, 128) elements."""

# distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__: the parameters are laid
# out in reverse module order (params[::-1], roughly backward's order) in one bucket (bucket_size
# is None unless overlap_grad_reduce is set, distributed_data_parallel.py __init__, and always on
# a pipeline stage after the first). With the distributed optimizer each start is padded to 64
# elements and each bucket's end to lcm(dp, 128), so the buffer divides evenly over dp, and a
# parameter marked shared_embedding (a tied word embedding and its last-stage copy under a
# pipeline, zeroplan.core.parallel.units) is a bucket of its own (_does_param_require_new_bucket);
# without it the buffer is the parameters exactly.
def grad_buffer_elements(request: PlanRequest) -> int:
    """Elements of the rank's gradient buffer (and, under the distributed optimizer, of its
    parameter buffer), padding included."""
    tensors = [tensor for unit in rank_trainable_units(request) for tensor in unit.tensors]
    if not request.strategy.kind.zero_stage:
        return sum(tensor.numel for tensor in tensors)
    shared = {MEGATRON_SHARED_EMBEDDING}
    if request.model.tied_embeddings and request.parallel.pp > 1:
        shared.add("token.weight")
    divisor = lcm(request.shard_group_size, BUCKET_END_ALIGNMENT)

    def pad(index: int, multiple: int) -> int:
        return ceil_div(index, multiple) * multiple

    start = end = 0
    open_bucket = False
    for tensor in reversed(tensors):
        start = pad(start, PARAM_START_ALIGNMENT)
        alone = tensor.name in shared
        if alone and open_bucket:
            start = end = pad(start, divisor)
        end = start + tensor.numel
        open_bucket = True
        if alone:
            start = end = pad(end, divisor)
            open_bucket = False
        else:
            start = end
    return pad(end, divisor) if open_bucket else end


# training/arguments.py (Megatron-LM d98e8a6): --bf16 sets accumulate_allreduce_grads_in_fp32
# ("bfloat16 requires gradient accumulation and all-reduce to be done in fp32"), which becomes
# DistributedDataParallelConfig.grad_reduce_in_fp32; --fp16 leaves it off (fp16 main grads);
# fp32 training has fp32 gradients. param_and_grad_buffer.py allocates grad_data in that dtype.
def grad_buffer_element_bytes(precision: Precision) -> int:
    return FP32_BYTES if precision in (Precision.bf16_mixed, Precision.fp32) else 2


# The bytes per parameter megatron-core's own table gives (docs/user-guide/features/
# dist_optimizer.md, Megatron-LM d98e8a6; d the data-parallel size): fp16 20 | 4 + 16/d, bf16 with
# fp32 gradients 18 | 6 + 12/d, fp32 16 | 8 + 8/d. Read from the code:
# - parameters: the module's 16-bit parameters (transformer/module.py Float16Module), which the
#   distributed optimizer re-maps into the buffer's param_data (param_and_grad_buffer.py,
#   use_distributed_optimizer), padded with the gradient buffer;
# - gradients: the buffer's grad_data (grad_buffer_element_bytes), never sharded: the
#   reduce-scatter writes each rank's shard in place and the rest stays allocated;
# - optimizer/distrib_optimizer.py _build_model_and_main_param_groups: an fp32 main copy of each
#   16-bit parameter's slice in this rank's shard (shard_model_param.clone().float(); fp32
#   parameters are stepped through a view, no copy);
# - the optimizer's own states (exp_avg, exp_avg_sq for Adam) beside each main parameter; its
#   fused Adam keeps the step count per parameter group (no per-tensor counter).
# Without the distributed optimizer (optimizer.py Float16OptimizerWithFloat16Params) the same
# fp32 copies exist for every parameter (d = 1, unpadded).
def megatron_model_state_bytes(request: PlanRequest) -> MegatronStates:
    """The rank's model states under megatron-core's DDP (ddp) or distributed optimizer (zero1)."""
    precision = request.training.precision
    buffer = grad_buffer_elements(request)
    shards = request.shard_group_size if request.strategy.kind.zero_stage else 1
    # Each rank's main parameters cover its 1/d of the padded buffer (less any padding in it).
    optimizer_elements = ceil_div(buffer, shards)
    gradient = grad_buffer_element_bytes(precision) * buffer
    master = FP32_BYTES * optimizer_elements if precision.is_mixed else 0
    states = optimizer_elements * elementwise_state_bytes(request.training.optimizer, FP32_BYTES)
    return MegatronStates(parameter_bytes=precision.compute_bytes * buffer, gradient_bytes=gradient,
                          optimizer_state_bytes=master + states, buffer_elements=buffer,
                          optimizer_elements=optimizer_elements)


# optimizer/optimizer.py MixedPrecisionOptimizer.step -> _copy_model_grads_to_main_grads:
# main_param.grad = model_grad.float() (distrib_optimizer.py: shard_main_param.grad =
# shard_model_grad.float()), a copy only when the gradient buffer is 16-bit (fp16 training);
# the next train_step's optimizer.zero_grad() (megatron/training/training.py) sets them to None
# before the forward, so they exist at the step only: the "16/d" of the fp16 row of megatron's
# table is 12/d of states plus these 4/d.
def megatron_step_temporary_bytes(request: PlanRequest, optimizer_elements: int) -> int:
    """fp32 copies of the main parameters' gradients the step makes (fp16 only)."""
    return FP32_BYTES * optimizer_elements if request.training.precision is Precision.fp16_mixed else 0


FUSED_QKV = ("attention.q.", "attention.k.", "attention.v.")
"""Megatron's attention holds q, k and v as one linear (legacy model/transformer.py
ParallelAttention.query_key_value at 992da75, megatron-core's linear_qkv): one weight, one bias."""


# The same copies tensor by tensor, as the caching allocator sees them: optimizer.py:605-611 at
# Megatron-LM 992da75 (MixedPrecisionOptimizer._copy_model_grads_to_main_grads in megatron-core)
# loops over the parameters and makes each main_param.grad = model_param.main_grad.float() on its
# own, all alive until the next zero_grad; a rank's largest are its word embedding's and its
# blocks' MLP weights'. Without the distributed optimizer only (whose copies are slices of the
# rank's shard of the buffer: () here, the schedule's even parts).
def megatron_step_temporary_parts(request: PlanRequest) -> tuple[int, ...]:
    """The step's fp32 gradient copies, one per 16-bit parameter tensor in the model's order
    (q, k and v fused), where Float16OptimizerWithFloat16Params makes them; () elsewhere."""
    if request.training.precision is not Precision.fp16_mixed or request.strategy.kind.zero_stage:
        return ()
    parts: list[int] = []
    for unit in rank_trainable_units(request):
        fused = {"weight": 0, "bias": 0}
        for tensor in unit.tensors:
            if tensor.name.startswith(FUSED_QKV):
                fused[tensor.name.rsplit(".", 1)[1]] += tensor.numel
                continue
            parts.append(FP32_BYTES * tensor.numel)
        parts += [FP32_BYTES * numel for numel in fused.values() if numel]
    return tuple(parts)


# transformer/mlp.py MLP.forward with bias_activation_fusion (Megatron-LM's --swiglu with its
# default bias_swiglu_fusion, training/arguments.py): fusions/fused_bias_swiglu.py
# SwiGLUFunction saves only its input, linear_fc1's [s, b, 2f] output, and recomputes silu in
# backward; linear_fc2 saves the f-wide product. 3 f per token where the reference's gated MLP
# keeps 4 f (gate and up outputs, the activation's output, the product); a GELU MLP's fused
# bias_gelu keeps the same 2 f as the reference.
def fused_swiglu_savings_bytes(request: PlanRequest) -> int:
    """Bytes one block's fused bias-SwiGLU saves less than the reference gated MLP."""
    model = request.model
    if model.mlp is not MlpKind.swiglu:
        return 0
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return request.training.precision.compute_bytes * tokens * model.ffn_hidden_size


def repeated_kv_bytes(request: PlanRequest) -> int:
    """Bytes of K and V copied to the query heads (2·s·b·(q - kv)·e): what a block saves more
    where its attention saves K and V expanded from fewer key-value heads."""
    model = request.model
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return 2 * request.training.precision.compute_bytes * tokens * (model.q_size - model.kv_size)


# transformer/dot_product_attention.py DotProductAttention.forward (the local spec's core
# attention, Megatron's path without Transformer Engine or flash-attn): with fewer key-value
# heads than query heads it repeat_interleaves key and value to the query heads, and the
# baddbmm and bmm save those copies; fused attention takes the grouped K and V as they are.
def megatron_expanded_kv_bytes(request: PlanRequest) -> int:
    """Extra bytes one block saves because K and V are expanded before eager attention."""
    if request.training.attention_kernel is AttentionKernel.flash:
        return 0
    return repeated_kv_bytes(request)


def megatron_layer_delta_bytes(request: PlanRequest) -> int:
    """What one megatron block saves beyond the reference block (negative: less)."""
    return megatron_expanded_kv_bytes(request) - fused_swiglu_savings_bytes(request)


# tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy.forward: the [s, b, V/t] logits
# are upcast once (calculate_logits_max: .float()), and the max subtraction, exp and division
# run in place on that fp32 copy, which is saved as the softmax; backward turns the saved softmax
# into the logits' gradient in place (calculate_gradients) and the .float() backward casts it to
# the compute dtype. Its largest moments, the forward (the caller's compute-dtype logits,
# models/gpt/gpt_model.py keeping them until the loss returns, beside the fp32 copy) and the
# backward (the fp32 gradient and its cast), both hold (4 + e) bytes a logit, where torch's
# F.cross_entropy holds three fp32 tensors (zeroplan.core.activations.logits_bytes). The fused
# variant (fusions/fused_cross_entropy.py, --cross-entropy-loss-fusion) runs the same
# calculations in one jit function and holds the same.
def megatron_logits_parts(request: PlanRequest) -> tuple[int, int]:
    """The vocabulary-parallel loss's two tensors at its largest moment (V as the caller passes
    it: the rank's V/t columns under tensor parallelism): the compute-dtype logits (or gradient)
    and the fp32 copy (the softmax, then the gradient made in place of it)."""
    model, batch = request.model, request.batch
    logits = batch.seq_len * batch.micro_batch_size * model.vocab_size
    return request.training.precision.compute_bytes * logits, FP32_BYTES * logits




# models/gpt/gpt_model.py GPTModel: only a stage with pre_process (the pipeline's first, model
# chunk 0 under interleaving) builds LanguageModelEmbedding, whose forward
# (models/common/embeddings/language_model_embedding.py) ends in embedding_dropout
# (torch.nn.Dropout(config.hidden_dropout)); under sequence parallelism it first scatters the
# [s, b, h] embeddings to the rank's s/t shard. transformer/transformer_block.py
# _checkpointed_forward checkpoints the layers only, so with any recomputation the mask stays
# with its micro-batch's graph until that micro-batch's backward. A stage without pre_process
# (the head's, when pp > 1) runs no embedding dropout.
def embedding_mask_bytes(request: PlanRequest) -> int:
    """One micro-batch's embedding dropout mask on the stage that runs the embedding."""
    if request.model.hidden_dropout <= 0:
        return 0
    parallel, batch = request.parallel, request.batch
    residual = batch.seq_len * batch.micro_batch_size * request.model.hidden_size
    if parallel.sequence_parallel:
        residual = ceil_div(residual, parallel.tp)
    return DROPOUT_MASK_BYTES * residual


# pipeline_parallel/schedules.py: forward_backward_pipelining_without_interleaving keeps each
# warm-up micro-batch's graph (input_tensors/output_tensors) until its backward, min(p, m) on the
# first stage, every one through the embedding. forward_backward_pipelining_with_interleaving
# runs forwards in get_schedule_table's order (groups of microbatch_group_size_per_vp_stage,
# default p, micro-batches through model chunk 0, then 1, ..., v - 1) and backwards in the same
# order with chunk v - 1 - c (get_model_chunk_id(forward=False)), after
# 2(p - 1) + (v - 1) p warm-up forwards on rank 0; only chunk 0's graphs hold an embedding mask.
def first_stage_embedding_masks(pp: int, virtual_stages: int, microbatches: int) -> int:
    """The most micro-batches whose embedding dropout mask pipeline rank 0 keeps at its
    in-flight peak (warm-up done, each later forward followed by one backward)."""
    p, v, m = pp, virtual_stages, microbatches
    if v == 1:
        return min(p, m)
    table = [(mb, chunk) for start in range(0, m, p)
             for chunk in range(v) for mb in range(start, min(m, start + p))]
    warmup = min(2 * (p - 1) + (v - 1) * p, v * m)
    alive = sum(1 for _, chunk in table[:warmup] if chunk == 0)
    most = alive
    for step in range(v * m - warmup):
        alive += table[warmup + step][1] == 0
        most = max(most, alive)
        alive -= table[step][1] == v - 1  # the backward of (mb, v - 1 - chunk): chunk 0 when chunk is v - 1
    return most
