"""Megatron-DeepSpeed's bytes where they differ from megatron-core's (docs/frameworks.md,
"Megatron-DeepSpeed"): DeepSpeed, not Megatron, owns the 16-bit module, the gradients and the
optimizer, so the model states are DeepSpeed 0.19.8's ZeRO stage-1 optimizer (fp16, and bf16 by
default: zeroplan.core.model_states' deepspeed convention) or its BF16_Optimizer (bf16 with
data_types.grad_accum_dtype fp32, here); the fork's legacy GPT block repeats grouped K and V
whatever the attention kernel and does not fuse SwiGLU; its pipeline engine upcasts the logits
to fp32 as a stage output. Everything else (the Korthikanti et al.
2022 block under tensor, sequence and pipeline parallelism) is megatron-core's and the reference
model's. Fork paths are microsoft/Megatron-DeepSpeed@f4157bea69f3df8c6cb66f2ebcda66ba03d1288e;
DeepSpeed paths are deepspeed/... in 0.19.8 (PyPI). Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.optimizer_states import elementwise_state_bytes
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.core.record import frozen
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision
from zeroplan.units import BF16_BYTES, FP32_BYTES, ceil_div

NCCL_START_ALIGNMENT_FACTOR = 2
"""runtime/bf16_optimizer.py BF16_Optimizer.__init__: nccl_start_alignment_factor = 2; each
group's flat buffer is padded to a multiple of 2 x dp elements (_flatten_dense_tensors_aligned)."""

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
"""runtime/engine.py: the elements per all-reduce bucket of buffered_allreduce_fallback, which
the pipeline engine's _bf16_reduce_grads passes (runtime/pipe/engine.py)."""


@frozen
class Bf16OptimizerStates:
    """One rank's model states under DeepSpeed's BF16_Optimizer."""

    parameter_bytes: int
    """The bf16 flat groups the module's parameters are re-pointed into (padding included)."""
    gradient_bytes: int
    """The parameters' own bf16 .grad tensors: made by the first micro-batch's backward, zeroed
    (not freed) by the later ones, set to None by the step's zero_grad."""
    gradient_buffer_bytes: int
    """The unpartitioned fp32 flat gradient buffers, allocated once and kept."""
    optimizer_state_bytes: int
    """fp32 master partition plus the optimizer's states beside it."""
    group_elements: tuple[int, ...]
    """Each parameter group's padded flat elements."""
    partition_elements: int
    """Elements of this rank's fp32 partitions (all groups)."""


def bf16_optimizer_runs(request: PlanRequest) -> bool:
    """Whether DeepSpeed 0.19.8 wraps the fork's optimizer in BF16_Optimizer for this request.

    runtime/engine.py _do_optimizer_sanity_check: bf16 at ZeRO stage 1 with
    data_types.grad_accum_dtype "fp32" (StrategySpec.deepspeed_grad_accum_fp32; the fork's
    universal-checkpointing example configs set it, examples_deepspeed/universal_checkpointing/
    ds_config.json) returns BFLOAT16, whose gradient accumulation is then fp32
    (_configure_bf16_optimizer passes grad_acc_dtype). Without it (DeepSpeed's default, the
    model's dtype) bf16 runs the ZeRO stage-1 optimizer, as fp16 does. Stage 0 reaches
    BF16_Optimizer too, with bf16 accumulation, under the pipeline engine; the profile plans stage 1.
    """
    return (request.training.framework is Framework.megatron_deepspeed and request.strategy.deepspeed_grad_accum_fp32
            and request.training.precision is Precision.bf16_mixed and request.strategy.kind is StrategyKind.zero1)


def check_grad_accum_dtype(request: PlanRequest) -> None:
    """Refuse, in one line, an fp32 gradient accumulation dtype the planner does not model."""
    if not request.strategy.deepspeed_grad_accum_fp32:
        return
    if request.training.framework is not Framework.megatron_deepspeed:
        raise ZeroplanError("strategy.deepspeed_grad_accum_fp32", f"is modelled for framework megatron-deepspeed, not "
                            f"{request.training.framework.value} (allowed: the model's dtype)")
    if request.training.deepspeed_release == "2022-bigscience":
        # runtime/bf16_optimizer.py entered DeepSpeed on 2022-04-19 (#1801), after the pinned source.
        raise ZeroplanError("strategy.deepspeed_grad_accum_fp32", "BF16_Optimizer is not in deepspeed 2022-bigscience "
                            "(allowed: the model's dtype, or deepspeed_release 0.19.8)")
    if request.training.precision is not Precision.bf16_mixed:
        raise ZeroplanError("strategy.deepspeed_grad_accum_fp32", f"is modelled under bf16-mixed (DeepSpeed's "
                            f"BF16_Optimizer), not {request.training.precision.value}")


# megatron/optimizer/__init__.py:18-66 (the fork) get_param_groups: biases and 1-D parameters
# (norms) go to the no-weight-decay group, every other parameter to the weight-decay group; the
# fork hands the bare optimizer to deepspeed.initialize (megatron/optimizer/__init__.py:115,
# megatron/training.py:617), and BF16_Optimizer flattens each group apart.
def param_group_elements(request: PlanRequest) -> tuple[int, ...]:
    """Unpadded elements of the fork's parameter groups on this rank (non-empty ones, in order)."""
    decayed = no_decay = 0
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            if len(tensor.shape) == 1 or tensor.name.endswith(".bias"):
                no_decay += tensor.numel
            else:
                decayed += tensor.numel
    return tuple(n for n in (decayed, no_decay) if n)


def data_parallel_size(request: PlanRequest) -> int:
    """The ranks BF16_Optimizer partitions over: the engine's seq_data_parallel_group, dp x cp
    (cp is DeepSpeed-Ulysses' sequence-parallel degree: zeroplan.core.parallel.ulysses)."""
    return request.state_group_size


# runtime/bf16_optimizer.py _setup_for_real_optimizer, per parameter group:
# - bf16_groups_flat: the group's bf16 parameters flattened and aligned to 2 x dp elements, the
#   module's parameters re-pointed into it (_update_storage_to_flattened_tensor): 2 bytes each;
# - fp32_groups_flat_partition: this rank's 1/dp of it, cloned to fp32 (the master);
# - fp32_groups_gradients_flat: torch.zeros_like(bf16 flat, dtype=grad_acc_dtype), the whole
#   group and never partitioned (fp32 here), kept for good (clear_hp_grads zeroes it);
#   update_hp_grads adds each parameter's bf16 .grad into it after every backward
#   (immediate_grad_update False by default, runtime/precision_config.py); the pipeline engine's
#   clear_lp_grads before each backward zeroes those .grad tensors (set_to_none False) and the
#   step's zero_grad (set_to_none True) frees them, so they live from the first micro-batch's
#   backward to the step, as a plain gradient does;
# - the wrapped optimizer's states beside the fp32 partition (its param_groups' params are
#   replaced by [fp32 partition]); apex's or DeepSpeed's FusedAdam keeps exp_avg and exp_avg_sq.
def bf16_optimizer_states(request: PlanRequest) -> Bf16OptimizerStates:
    """The rank's model states under BF16_Optimizer (fp32 gradient accumulation)."""
    state_bytes = elementwise_state_bytes(request.training.optimizer, FP32_BYTES)
    return bf16_optimizer_bytes(param_group_elements(request), data_parallel_size(request), state_bytes)


def bf16_optimizer_bytes(group_numels: tuple[int, ...], dp: int, state_bytes_per_element: int) -> Bf16OptimizerStates:
    """BF16_Optimizer's model states for parameter groups of ``group_numels`` elements over
    ``dp`` ranks, the optimizer keeping ``state_bytes_per_element`` beside each fp32 element
    (what benchmarks/megatron_deepspeed_records.py measures from DeepSpeed's own class)."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * dp
    groups = tuple(ceil_div(n, alignment) * alignment for n in group_numels)
    flat = sum(groups)
    partition = sum(g // dp for g in groups)
    return Bf16OptimizerStates(
        parameter_bytes=BF16_BYTES * flat,
        # One bf16 .grad per parameter (unpadded); the fp32 flat buffers are padded.
        gradient_bytes=BF16_BYTES * sum(group_numels),
        gradient_buffer_bytes=FP32_BYTES * flat,
        optimizer_state_bytes=FP32_BYTES * partition + state_bytes_per_element * partition,
        group_elements=groups,
        partition_elements=partition,
    )


# runtime/pipe/engine.py _exec_reduce_grads -> _bf16_reduce_grads -> runtime/engine.py
# buffered_allreduce_fallback(elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE) over the optimizer's
# flat gradient groups: allreduce_no_retain gathers groups into a bucket until it passes 5e8
# elements (or the groups end), and allreduce_bucket flattens the bucket (a copy when it holds
# more than one group; torch's flatten of one tensor is a view) and casts it to the
# communication dtype, bf16 for a bf16 engine (engine.py communication_data_type), before the
# all-reduce and the copy back. The largest bucket's copies are alive at once, after backward.
def bf16_allreduce_buffer_bytes(request: PlanRequest) -> int:
    """The largest all-reduce bucket's flat copy and bf16 cast (0 with one data-parallel rank)."""
    if data_parallel_size(request) == 1:
        return 0
    return allreduce_copy_bytes(bf16_optimizer_states(request).group_elements)


def allreduce_copy_bytes(group_elements: tuple[int, ...]) -> int:
    """The copies buffered_allreduce_fallback makes of the largest bucket of fp32 flat groups."""
    largest, bucket, count = 0, 0, 0

    def cost(elements: int, tensors: int) -> int:
        flat = FP32_BYTES * elements if tensors > 1 else 0
        return flat + BF16_BYTES * elements

    for elements in group_elements:
        bucket += elements
        count += 1
        if bucket > MEMORY_OPT_ALLREDUCE_SIZE:
            largest = max(largest, cost(bucket, count))
            bucket, count = 0, 0
    if count:
        largest = max(largest, cost(bucket, count))
    return largest


# megatron/model/transformer.py:674-690 (the fork) ParallelAttention.repeat_kv: with fewer
# key-value heads than query heads, K and V are expanded to the query heads (expand + reshape, a
# copy) at lines 743-745, before either core attention (its CoreAttention or flash-attn's
# FlashSelfAttention) saves them: the copies are saved with every kernel.
# megatron/model/transformer.py:137-141 (the fork): --swiglu is a Python function, chunk then
# F.silu(x[0]) * x[1], saving what the reference gated MLP saves (no fused bias-SwiGLU, whose
# savings zeroplan.core.megatron counts for megatron-core).
def mds_layer_delta_bytes(request: PlanRequest) -> int:
    """What one Megatron-DeepSpeed block saves beyond the reference block: the repeated K and V."""
    from zeroplan.core.megatron import repeated_kv_bytes  # megatron's module loads only for its requests

    return repeated_kv_bytes(request)


# megatron/model/gpt_model.py (the fork) GPTModelPipe: after the tied head (_logits_helper,
# lines 412-433) a float16_to_fp32 layer (line 437) upcasts the [s, b, V/t] logits, and that fp32
# tensor is the last stage's output, which the pipeline engine keeps in
# pipe_buffers['outputs'] until the micro-batch's backward ends (runtime/pipe/engine.py
# _exec_backward_pass frees it after backward). The loss, CrossEntropy (lines 307-319), passes
# it (already fp32: .float() is a no-op) to megatron/core/tensor_parallel/cross_entropy.py,
# whose forward makes `logits - max` (line 25, a new fp32 tensor), exponentiates and normalises
# it in place and saves it as the softmax; its backward turns the softmax into the gradient in
# place and float16_to_fp32's backward casts that to the compute dtype. Largest moment: the
# backward's fp32 output, fp32 gradient and its cast, (8 + e) bytes a logit.
def mds_logits_parts(request: PlanRequest) -> tuple[int, int, int]:
    """The fork's loss tensors at its largest moment: the fp32 stage output, the fp32 softmax
    (then gradient) and the gradient cast to the compute dtype."""
    model, batch = request.model, request.batch
    logits = batch.seq_len * batch.micro_batch_size * model.vocab_size
    return FP32_BYTES * logits, FP32_BYTES * logits, request.training.precision.compute_bytes * logits


# deepspeed runtime/pipe/engine.py _exec_forward_pass keeps each micro-batch's stage output in
# pipe_buffers['outputs'] until _exec_backward_pass frees it after that micro-batch's backward,
# and _exec_send_activations sends it without freeing it (megatron-core's schedules free the
# data after the send, deallocate_output_tensor). Under tensor parallelism the engine's
# pipe_partitioned (on by default, runtime/config.py) replaces the output's data by
# torch.zeros(1) and keeps this rank's 1/t part of it (PartitionedTensor) instead. No block of
# the stage saves its own last output, so these are bytes beyond the blocks' activations on
# every stage but the last (whose output is the loss's fp32 logits, mds_logits_parts).
def pipe_output_bytes(request: PlanRequest) -> int:
    """One in-flight micro-batch's stage output the pipeline engine keeps on this rank."""
    parallel, batch = request.parallel, request.batch
    residual = batch.seq_len * batch.micro_batch_size * request.model.hidden_size
    if parallel.sequence_parallel:
        # The fork's residual stream is already [s/t, b, h] under sequence parallelism.
        residual = ceil_div(residual, parallel.tp)
    return request.training.precision.compute_bytes * ceil_div(residual, parallel.tp)


# deepspeed runtime/pipe/module.py:602-608 (0.19.8 and microsoft/DeepSpeed@8eef742f0 alike)
# PipelineModule._is_checkpointable: a GPTModelPipe chunk is checkpointed only when all its
# layers are ParallelTransformerLayerPipe, so the first stage's EmbeddingPipe runs outside any
# checkpoint and autograd keeps its dropout's mask (megatron/model/language_model.py Embedding:
# embedding_dropout, hidden_dropout; one byte an element) for every micro-batch in flight until
# that micro-batch's backward. Under sequence parallelism the fork scatters the embeddings to
# the sequence shard before the dropout, as megatron-core does: the same mask, so the same
# function (zeroplan.core.megatron.embedding_mask_bytes). On a stage without the head these
# bytes are nowhere else (the head's stage counts them with the other outside-block terms).
def pipe_embedding_mask_bytes(request: PlanRequest) -> int:
    """One in-flight micro-batch's embedding dropout mask on the first pipeline stage."""
    # Imported here: a default fit never reaches a Megatron request (tests/test_cli_imports.py).
    from zeroplan.core.megatron import embedding_mask_bytes

    return embedding_mask_bytes(request)


# bigscience-workshop/Megatron-DeepSpeed@541b967f megatron/mpu/layers.py:191, :236-237
# (--embed-layernorm): VocabParallelEmbedding normalises its all-reduced output with a
# torch.nn.LayerNorm, which saves its [b, s, h] input (2 bytes an element in the 16-bit module;
# its fp32 mean and rstd are s b floats each, left out as the planner's norms leave them). Like
# the dropout mask it runs outside any checkpoint (pipe_embedding_mask_bytes), so the first stage
# keeps it for every micro-batch in flight; the head's stage counts the model's outside-block
# terms, this one included, which it does not hold under a pipeline.
def pipe_embedding_norm_bytes(request: PlanRequest) -> int:
    """One in-flight micro-batch's embedding norm input on the stage that runs the embedding
    (0 without the embedding norm)."""
    if not request.model.embedding_norm:
        return 0
    from zeroplan.core.activations import norm_bytes

    batch = request.batch
    return norm_bytes(request.model, request.training, batch.seq_len, batch.micro_batch_size)
