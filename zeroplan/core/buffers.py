"""Temporary and communication buffers alive during backward, and the optimizer step's
temporaries. Each term names the library behaviour it models."""

from __future__ import annotations

from zeroplan.core import deepspeed_2022, deepspeed_epilogue, deepspeed_offload, deepspeed_step
from zeroplan.core import deepspeed_coordinator, deepspeed_fused_fp16, deepspeed_one_rank, deepspeed_stage0, muon, tinyllama
from zeroplan.core.finetune import modules_to_save
from zeroplan.core.finetune.adapter_dtype import trainable_element_bytes
from zeroplan.core.deepspeed_accumulation import resident_bytes as deepspeed_resident_bytes
from zeroplan.core.deepspeed_accumulation import stage12_bucket_bytes
from zeroplan.core.largest_unit import largest_gathered_unit_bytes, largest_unit_elements
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.model_states import (
    largest_optimizer_tensor_elements, largest_tensor_shard_elements, model_state_bytes, padded_unit_elements_of,
    unit_gather_bytes,
)
from zeroplan.core.parallel.pipeline import pipeline_defers_fsdp_reduction
from zeroplan.core.parallel.units import accumulating_trainable_elements, rank_parameter_units, rank_trainable_elements
from zeroplan.core.profiles import fsdp1_root_stays_gathered, fsdp_separates_embedding_and_head, profile
from zeroplan.core.torch_release import default_loop_is_for_loop, foreach_adam_temporaries
from zeroplan.core.transformers_release import trainer_fuses_adamw
from zeroplan.core.zero3_groups import hpz_secondary_partition_bytes
from zeroplan.core.zeropp import qgz_buffer_bytes, qwz_buffer_bytes
from zeroplan.specs.framework import EARLIER_HF_DEEPSPEED_RELEASES, Framework
from zeroplan.core.megatron_deepspeed import bf16_allreduce_buffer_bytes, bf16_optimizer_runs, bf16_optimizer_states
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind, ZeroGradientReduce
from zeroplan.specs.training import Optimizer, OptimizerLoop, StateConvention
from zeroplan.units import FP32_BYTES


# torch/nn/parallel/distributed.py, gradient_as_bucket_view: "if False, gradients are copied
# into bucket storage ... setting it True saves memory equal to the total gradient size".
# At world size 1 there is no one to all-reduce with: zeroplan plans plain training (the
# model unwrapped, docs/memory-model.md "One GPU"), so there are no buckets.
def ddp_bucket_bytes(request: PlanRequest, gradient_bytes_per_element: int) -> int:
    if request.strategy.ddp_gradient_as_bucket_view or request.cluster.world_size == 1:
        return 0
    return rank_trainable_elements(request) * gradient_bytes_per_element


# deepspeed/runtime/zero/stage_1_and_2.py: gradients are reduced through an "ipg" bucket of
# reduce_bucket_size elements in the gradient dtype, at most the model (zeroplan's emitted
# config); Hugging Face's configs do not cap it (deepspeed_accumulation._bucket_elements).
def zero_reduce_bucket_bytes(request: PlanRequest, gradient_bytes_per_element: int) -> int:
    elements = request.strategy.zero_bucket_elements
    if request.training.framework is not Framework.hf:
        elements = min(elements, rank_trainable_elements(request))
    return elements * gradient_bytes_per_element


# ZeRO paper sec. 5.3 / FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):
# a unit is all-gathered before use; with prefetching the next unit's gather is in flight,
# so (1 + prefetch) unsharded units are alive, plus the unsharded gradient of the unit being
# reduce-scattered.
def gathered_unit_bytes(request: PlanRequest, bytes_per_element: int, gradient_bytes_per_element: int) -> int:
    gathered = (1 + request.strategy.prefetch_units) * largest_gathered_unit_bytes(request, bytes_per_element)
    return gathered + largest_unit_elements(request) * gradient_bytes_per_element


# megatron-core 0.16.1 distributed/param_and_grad_buffer.py: gradients are accumulated straight
# into the contiguous grad_data buffer (param.main_grad views; counted as the gradients), which
# is all-reduced or reduce-scattered in place, and the distributed optimizer all-gathers the
# updated parameters in place into param_data (_ParamAndGradBucketGroup.start_param_sync): no
# bucket copy, gathered unit or flat copy exists beside the model states.
def _megatron_buffers(request: PlanRequest) -> bool:
    return request.training.framework is Framework.megatron


# Megatron-DeepSpeed under DeepSpeed 0.19.8's BF16_Optimizer (zeroplan.core.megatron_deepspeed):
# the gradients accumulate into the optimizer's own unpartitioned fp32 flat buffer, allocated
# once and kept (a resident buffer), and are all-reduced after the last micro-batch's backward
# through buffered_allreduce_fallback's copies (bf16_allreduce_buffer_bytes); nothing is held
# through the backward. Under fp16 DeepSpeed's ZeRO stage-1 optimizer keeps the deepspeed
# convention's buffers below.
def _bf16_optimizer_buffers(request: PlanRequest) -> bool:
    return bf16_optimizer_runs(request)


def _reduces_through_ddp_buckets(request: PlanRequest) -> bool:
    """DDP itself, or ZeroRedundancyOptimizer under DDP (zero_gradient_reduce=ddp-buckets)."""
    return (
        request.strategy.kind is StrategyKind.ddp
        or request.strategy.zero_gradient_reduce is ZeroGradientReduce.ddp_buckets
    )


# docs/memory-model.md, "Peak": buffers differ in when they are alive. Resident buffers are
# allocated once and kept (DDP's bucket copies, DeepSpeed's stage 3 bucket and gradient
# partition); backward-held ones live from the forward through the end of backward
# (shard-grad-op's gathered units, no_sync's unsharded gradients); transient ones exist only
# while a unit is gathered or reduced (DeepSpeed's stage 1-2 bucket while gradients arrive).
def resident_buffer_bytes(request: PlanRequest) -> int:
    return _resident_buffer_bytes(request) + engine_module_buffer_bytes(request)


# DeepSpeed 0.14.2 runtime/engine.py:1099-1112 (_configure_distributed_model; 0.13.3 the same):
# under fp16 or bf16 the engine casts the whole module, buffers included (module.half() /
# .bfloat16()), and moves it to the device unless zero.Init placed it there already (whose
# tensors are made on the device in its dtype): the model's buffers stay on the GPU beside the
# partitions, in the model dtype, for the run. Of those, transformers' per-layer rotary caches
# (transformers_release.QWEN2_LAYER_ROPE_CACHE) are what is modelled. Under any strategy the
# module's buffers go to the device with it (FSDP's device_id move, DDP's, model.to): 4.38's
# boolean causal-mask buffer (transformers_release.positions_mask_buffer_bytes), which the
# engine's cast leaves bool (module.bfloat16() casts floating-point tensors only).
def engine_module_buffer_bytes(request: PlanRequest) -> int:
    """The model's own buffers kept on the device under the hf profile: the per-layer rotary
    caches DeepSpeed's engine casts, in the releases that build them, and 4.38's causal-mask
    buffer under any strategy; 0 elsewhere."""
    from zeroplan.core.deepspeed_accumulation import runs_deepspeed_engine
    from zeroplan.core.transformers_release import layer_rope_cache_elements, positions_mask_buffer_bytes

    if request.training.framework is not Framework.hf:
        return 0
    mask = positions_mask_buffer_bytes(request.model, request.training)
    if not runs_deepspeed_engine(request):
        return mask
    elements = layer_rope_cache_elements(request.model, request.training)
    return elements * element_bytes(request.training.precision, request.convention).compute_parameter + mask


def _resident_buffer_bytes(request: PlanRequest) -> int:
    if _megatron_buffers(request):
        return 0
    if _bf16_optimizer_buffers(request):
        return bf16_optimizer_states(request).gradient_buffer_bytes
    if deepspeed_stage0.runs_deepspeed_stage0(request):
        # Nothing kept across steps: no DDP reducer, no scalar (its gradient norm is a float).
        return 0
    kind = request.strategy.kind
    eb = element_bytes(request.training.precision, request.convention)
    if _reduces_through_ddp_buckets(request):
        # fairseq's --fp16 model is fp16 itself (zeroplan.core.fairseq): torch 1.8 DDP's buckets,
        # copies of its gradients (fairseq's c10d wrapper sets no gradient_as_bucket_view), too.
        from zeroplan.core.fairseq import runs_fp16_optimizer

        # PEFT's trainable copies have buckets of their own dtype (zeroplan.core.finetune.modules_to_save).
        return (ddp_bucket_bytes(request, 2 if runs_fp16_optimizer(request) else eb.gradient)
                + modules_to_save.copy_bucket_bytes(request))
    # zero3-hpz's secondary parameter partition lives from the forward through the step
    # (zeroplan.core.zero3_groups): alive at every moment the peak is taken at.
    secondary = hpz_secondary_partition_bytes(request)
    if kind.zero_stage in (1, 2, 3) and request.convention is StateConvention.deepspeed and not (
            kind.offloads_optimizer or kind.offloads_parameters):
        # Stage 3's ipg bucket and grad_partitions_flat_buffer, allocated once, and the scalars
        # every stage keeps (measured to the byte: zeroplan.core.deepspeed_accumulation).
        return deepspeed_resident_bytes(request) + secondary
    # DeepSpeed's optimizer offload keeps its device staging buffer instead (zeroplan.core.deepspeed_offload).
    return secondary + deepspeed_offload.device_staging_bytes(request)


# DeepSpeed before 0.18.0 allocates ZeRO-2's ipg bucket in the optimizer's own backward, before it
# calls loss.backward: v0.9.0 runtime/zero/stage_1_and_2.py:1871-1884 and v0.13.3 :2030-2043
# (backward: torch.empty(reduce_bucket_size) in the model dtype with contiguous_gradients, a second
# with overlap_comm; v0.17.0 backward_prologue :2062-2078 the same), and frees it in the epilogue
# after backward (_release_ipg_buffers). So it is alive at the loss's backward too, where 0.18.0's
# setup_buckets, called from process_gradients at the first gradient hook, allocates it only once
# the loss's backward has produced a gradient (0.19.8 :2287, :3256-3276). The hf profile's
# deepspeed_release "0.13.3" stands for those releases. Under offload_optimizer the same backward
# allocates it: contiguous_gradients is forced on by the offload (v0.13.3 :206 and v0.14.2 :205,
# contiguous_gradients or self.cpu_offload; v0.14.2 backward :2037-2050).
def deepspeed_bucket_from_backward_start(request: PlanRequest) -> bool:
    """Whether ZeRO-2's ipg bucket is held from the start of backward (hf, DeepSpeed 0.13.3),
    with or without the optimizer offloaded."""
    return (request.training.framework is Framework.hf
            and request.training.deepspeed_release in EARLIER_HF_DEEPSPEED_RELEASES
            and request.strategy.kind in (StrategyKind.zero2, StrategyKind.zero2_offload)
            and request.convention is StateConvention.deepspeed
            and request.strategy.zero_gradient_reduce is ZeroGradientReduce.bucket)


def backward_held_buffer_bytes(request: PlanRequest) -> int:
    if _megatron_buffers(request) or _bf16_optimizer_buffers(request):
        return 0
    kind = request.strategy.kind
    eb = element_bytes(request.training.precision, request.convention)
    held = stage12_bucket_bytes(request) if deepspeed_bucket_from_backward_start(request) else 0
    deferred = pipeline_defers_fsdp_reduction(request.parallel, kind.is_fsdp)
    if kind is StrategyKind.fsdp_shard_grad_op or deferred:
        # reshard_after_forward=False (or a pipeline stage's reshard_after_backward=False):
        # every unit stays gathered from forward through backward.
        held += sum(unit_gather_bytes(request, request.shard_group_size, eb.compute_parameter))
    accumulating = request.batch.grad_accum_steps > 1 and request.strategy.keep_unsharded_grads_on_accum
    if deferred:
        # A pipeline stage's FSDP2 without gradient sync upcasts each unsharded gradient to the
        # reduce dtype and accumulates it there (torch 2.13 _fully_shard/_fsdp_param.py
        # to_accumulated_grad_if_needed) until perform_reduce_grad; an interleaved schedule of
        # one round reduces each stage before the next one's backwards start.
        held += accumulating_trainable_elements(request) * gradient_wire_bytes(request)
    elif accumulating and kind.zero_stage >= 2:
        # no_sync(): unsharded gradients accumulate locally until the last micro-batch.
        held += rank_trainable_elements(request) * no_sync_gradient_element_bytes(request)
    return held


# torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward (lines 607-612)
# calls _fsdp_param.py to_accumulated_grad_if_needed (lines 802-813) when gradients are not
# reduced: the unsharded gradient moves to unsharded_accumulated_grad = grad.to(reduce_dtype)
# (reduce_dtype clamped to None where it equals param_dtype, lines 587-593), and the next
# micro-batches add into it (accumulate_unsharded_grad_if_needed). So FSDP accumulates in the
# reduce dtype, the gradients' wire dtype (fp32 by default under MixedPrecisionPolicy's
# reduce_dtype, the compute dtype where a framework reduces in it); the reference ZeRO engines
# keep them in the compute dtype.
def no_sync_gradient_element_bytes(request: PlanRequest) -> int:
    """Bytes per element of the unsharded gradients accumulated without gradient sync."""
    if tinyllama.runs_fork(request):
        # Lightning 2.1.2's FSDP bf16-mixed: param_dtype fp32, so FSDP1's unsharded gradients are fp32.
        return FP32_BYTES
    if request.strategy.kind.is_fsdp:
        return gradient_wire_bytes(request)
    return element_bytes(request.training.precision, request.convention).compute_parameter


# torch 2.13 distributed/fsdp/_runtime_utils.py _post_backward_hook (lines 743-746): under FSDP1's
# no_sync() a unit's post-backward keeps its unsharded gradient and returns; _reduce_grad (lines
# 846-847) takes it off flat_param.grad and reduce-scatters it into a new shard only in the last
# micro-batch's backward. The step's zero_grad(set_to_none=True) frees the shard (use_orig_params:
# _flat_param.py _reset_flat_param_grad_info_if_needed, line 2471, at the next forward). FSDP2 the
# same (_fully_shard/_fsdp_param_group.py post_backward, lines 607-612: no reduce-scatter, the
# unsharded gradient kept). So what a micro-batch leaves for the next is the unsharded gradient
# backward_held_buffer_bytes holds, and no gradient shard beside it (the harness's FSDP2 run with
# 4 micro-batches, benchmarks/records/tiny-llama-fsdp-full-shard-torch-fp32-n2-accum4-keep).
# The reference ZeRO-2/3 (zeroplan/harness/zero.py) the same: its zero_grad sets every unit's
# grad_shard to None, _on_grad reduce-scatters into a new shard only in the last micro-batch,
# and the first K-1 add up in p.grad (the harness's runs at micro-batch 2 x seq 256 with 4
# micro-batches: Gradient 48.0 MiB at the peak, the unsharded gradients alone).
def fsdp_no_sync_carried_gradient_bytes(request: PlanRequest) -> int | None:
    """What one micro-batch leaves allocated for the next beyond the held buffers
    (PeakTerms.accumulated_gradients): 0 where FSDP, or ZeRO-2/3 outside DeepSpeed's
    convention, accumulates unsharded gradients (keep_unsharded_grads_on_accum); None
    elsewhere (the model states' gradients)."""
    kind = request.strategy.kind
    reference_zero = kind in (StrategyKind.zero2, StrategyKind.zero3) and request.convention is not StateConvention.deepspeed
    if (request.batch.grad_accum_steps > 1 and request.strategy.keep_unsharded_grads_on_accum
            and (kind.is_fsdp or reference_zero)
            and not pipeline_defers_fsdp_reduction(request.parallel, kind.is_fsdp)
            and not (_megatron_buffers(request) or _bf16_optimizer_buffers(request))):
        return 0
    return None


def draining_held_buffer_bytes(request: PlanRequest) -> int:
    """The part of backward_held_buffer_bytes the gradient shards replace after the step's
    backward (PeakTerms.draining_held_buffers): FSDP's unsharded gradients under no_sync
    accumulation, which the last micro-batch reduce-scatters; 0 elsewhere."""
    if fsdp_no_sync_carried_gradient_bytes(request) is None:
        return 0
    return rank_trainable_elements(request) * no_sync_gradient_element_bytes(request)


def transient_buffer_bytes(request: PlanRequest) -> int:
    """Buffers of the unit being gathered or reduced (the largest unit)."""
    if _megatron_buffers(request):
        return 0
    if _bf16_optimizer_buffers(request):
        return bf16_allreduce_buffer_bytes(request)
    if deepspeed_2022.models_2022(request):
        # No ipg bucket: the reduction's flat copy of its largest bucket is the transient.
        return deepspeed_2022.reduce_copy_bytes(request)
    kind = request.strategy.kind
    eb = element_bytes(request.training.precision, request.convention)
    if _reduces_through_ddp_buckets(request):
        return 0
    if kind.zero_stage in (1, 2):
        if request.strategy.zero_gradient_reduce is ZeroGradientReduce.bucket:
            if deepspeed_bucket_from_backward_start(request):
                # Held through the whole backward instead (backward_held_buffer_bytes).
                return 0
            # Filled as gradients arrive and released after backward: no bucket is alive at
            # the loss backward (the harness's allocator trace of DeepSpeed stage 2).
            return zero_reduce_bucket_bytes(request, eb.compute_parameter)
        largest = largest_unit_elements(request)
        # Stage 2 reduces in backward: the unit's full gradients and their flat copy; stage 1
        # reduces in the step, where the full gradients are already counted.
        copies = 2 if kind.zero_stage == 2 else 1
        return copies * largest * eb.compute_parameter
    if kind is StrategyKind.fsdp_shard_grad_op:
        return largest_unit_elements(request) * gradient_wire_bytes(request)
    if deepspeed_one_rank.gathers_nothing(request):
        # One rank gathers nothing: a module's backward holds autograd's gradients alone until
        # their hooks copy them into the bucket (zeroplan.core.deepspeed_one_rank).
        return deepspeed_one_rank.largest_module_gradient_bytes(request)
    if deepspeed_coordinator.replays_gathers(request):
        # DeepSpeed gathers module by module, not a whole block (zeroplan.core.deepspeed_coordinator).
        return deepspeed_coordinator.peak_gathered_bytes(request)
    gathered = gathered_unit_bytes(request, eb.compute_parameter, gradient_wire_bytes(request))
    if kind.quantizes_communication:
        # zero3-zeropp: qwZ's int8 and fp16 copies of the unit being gathered and qgZ's int4
        # buffers of the gradient being reduced, both transient, counted together: the next
        # unit's gather runs while the last one's gradients reduce (zeroplan.core.zeropp).
        elements = padded_unit_elements_of(request, request.shard_group_size)
        gathered += qwz_buffer_bytes(request, elements) + qgz_buffer_bytes(request)
    return gathered


# torch 2.13 _fully_shard/_fsdp_state.py: while a block runs its backward under full sharding,
# the units gathered are the block, the next one prefetched (_fsdp_param_group.py pre_backward)
# and, where the framework wraps embedding and head into the root unit (HF, torchtitan; torchtune's
# LoRA recipes), the root: gathered again at the loss's backward and resharded only by its own
# post-backward, after the last block (seen in the frameworks' whole steps on fake tensors:
# docs/memory-model.md, "The caching allocator"). Where embedding and head are units of their own
# (torchtune's full fine-tunes), the head is gathered only around the loss, whose own terms count
# it (zeroplan.core.framework_loss.fsdp_head_gathered_bytes), and the embedding after the last block.
def head_weight_gradient_bytes(request: PlanRequest) -> int:
    """The output projection's unsharded gradient, which the root unit holds from the loss's
    backward to its own post-backward (0 where the head is frozen, or where torchtitan's chunked
    loss reduce-scatters it at its last chunk: zeroplan.core.framework_loss.torchtitan_chunked_loss_bytes)."""
    training = request.training
    if not training.finetune.trains_everything and (training.finetune.is_lora or training.finetune.freeze_embeddings):
        return 0
    if training.framework is Framework.torchtitan and not training.unchunked_loss:
        return 0
    # A tensor-parallel rank's head is its V/tp vocabulary rows (zeroplan.core.parallel.tensor).
    return (request.model.vocab_size * request.model.hidden_size * element_bytes(training.precision, request.convention).compute_parameter
            // request.parallel.tp)


# torch 2.13 _fully_shard: the last unit's post-backward (the root's, run from the root's final
# callback, _fsdp_state.py:395-420, as its inputs need no gradient) reshards its parameters
# before reducing (_fsdp_param_group.py:637-638), so no unit is gathered at the end of backward
# (FSDP1, which hf's and litgpt's stacks are planned with, also reshards first:
# torch/distributed/fsdp/_runtime_utils.py:742 before :766; its flat gradient is the input itself).
# foreach_reduce (_fsdp_collectives.py:595-612) allocates one flat input in the reduce dtype,
# copies the unit's unsharded gradients into it and drops them (the copy-in), then allocates the
# sharded output, which becomes the unit's sharded gradient (counted with the gradients) and
# reduce-scatters. The head's unsharded gradient outlives that reduce-scatter: measured on gloo
# (the emitted accelerate and torchtitan runs' allocator snapshots free it after the
# reduce-scatter, and so does a bare fully_shard model, with no Python referrer left), as
# head_weight_gradient_bytes says it stays to the root's post-backward.
def _fsdp_last_unit(request: PlanRequest) -> tuple[int, int] | None:
    """(padded trainable elements of the unit reduced last, the head gradient it holds) under
    FSDP full sharding without a pipeline; None where the units are not embedding, blocks, head."""
    kind = request.strategy.kind
    if kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp) or request.parallel.pp > 1:
        return None
    units = rank_parameter_units(request)
    blocks = [i for i, unit in enumerate(units) if unit.name.startswith("block.")]
    if not blocks or units[0].name != "embedding" or units[-1].name != "head":
        return None
    elements = padded_unit_elements_of(request, request.shard_group_size)
    if fsdp_separates_embedding_and_head(request):
        # The head is reduced after the loss's backward; the embedding unit last.
        last, head = elements[0], 0
    else:
        last = sum(n for i, n in enumerate(elements) if i not in blocks)
        head = head_weight_gradient_bytes(request) if last else 0
    # A frozen root (or embedding) reduces nothing: the first block's reduce is the last.
    return (last or elements[blocks[0]]), head


def _fsdp_backward_end_bytes(request: PlanRequest, last: int, head: int) -> int:
    """Beyond every sharded gradient: the last unit's flat input, and the larger of what sits
    beside it at the copy-in (the unit's unsharded gradients, its sharded one not made yet unless
    an earlier micro-batch made it) and at the reduce-scatter (the head gradient the root holds)."""
    eb = element_bytes(request.training.precision, request.convention)
    copy_in = last * eb.compute_parameter - _last_shard_not_yet_bytes(request, last)
    return last * gradient_wire_bytes(request) + max(copy_in, head)


# The model states count every sharded gradient; the last unit's is made only by its
# reduce-scatter, after backward's last moment, unless an earlier micro-batch made it.
def _last_shard_not_yet_bytes(request: PlanRequest, last: int) -> int:
    """The last unit's sharded gradient, counted in the model states but not allocated yet at
    the end of backward (0 under gradient accumulation, where an earlier micro-batch made it)."""
    if request.batch.grad_accum_steps > 1:
        return 0
    return last // request.shard_group_size * element_bytes(request.training.precision, request.convention).gradient


def last_reduce_scatter_input_bytes(request: PlanRequest) -> int:
    """The input of the reduce-scatter that ends backward, where it is modelled tensor by tensor
    (FSDP2 full sharding's last unit, DeepSpeed ZeRO-3's epilogue); 0 elsewhere. A backend that
    copies its input (gloo: zeroplan.validate.gloo) copies this."""
    fsdp = _fsdp_last_unit(request)
    if fsdp is not None:
        return fsdp[0] * gradient_wire_bytes(request)
    if deepspeed_epilogue.models_epilogue(request):
        return deepspeed_epilogue.reduce_scatter_input_bytes(request)
    return 0


# torch 2.13 distributed/fsdp/_flat_param.py _use_unsharded_views: FSDP1 hands each module its
# parameters as views split off the root's gathered FlatParameter, so autograd's SplitWithSizes
# node (engine.cpp: a node runs once all its incoming gradients are in its InputBuffer) cats the
# embedding's, the final norm's and the head's gradients (the head's waiting since the loss) into
# one flat gradient after the embedding's backward, before the post-backward hook reshards the
# root (_runtime_utils.py _post_backward_hook, on the FlatParameter's AccumulateGrad). Under
# no_sync that flat gradient is then added into the held one. Measured on gloo
# (benchmarks/fsdp1_tied_embedding_backward.py --untied, an embedding-dominated toy wrapped as
# litgpt's: the root's gathered 32 MiB, the head's and the embedding's 16 MiB gradients and their
# 32 MiB cat alive at once, beside the held unsharded gradients). A tied embedding is one view
# used twice: its InputBuffer sums the head's and the embedding's gradients out of place first,
# and that sum is the peak (the same script without --untied: the 16 MiB root gathered, the two
# 16 MiB gradients and their 16 MiB sum).
def _fsdp1_root_backward_end_bytes(request: PlanRequest, root_elements: int) -> int:
    """The gathered root, its parameters' gradients and their flat concatenation (with a tied
    embedding: the two gradients of the one weight and their sum), beyond every sharded gradient
    but the root's own, not made yet without accumulation."""
    copies = 4 if request.model.tied_embeddings else 3
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    return copies * root_elements * compute - _last_shard_not_yet_bytes(request, root_elements)


# accelerate 1.10.1 Accelerator.prepare_model under fsdp_version 1 wraps hf's model in FSDP1 with
# use_orig_params=True: the same views of the root's gathered FlatParameter (_flat_param.py
# _use_unsharded_views), so every backward ends in that cat before the root's post-backward
# reduce-scatters it (_runtime_utils.py _post_backward_hook -> _reduce_grad), not only a no_sync
# one. Measured at full size (benchmarks/framework-fsdp1-step-records, zeroplan.frameworks.
# hf_fsdp1_step): Llama-3.1-8B on 8 ranks, s 4096, b 1, full recomputation peaks there, with the
# root gathered (2.10 GB), the embedding's and the head's bf16 gradients (1.05 GB each) and their
# 2.10 GB cat alive at once.
def _fsdp1_root_cats_gradients(request: PlanRequest) -> bool:
    """Whether backward ends in FSDP1's flat concatenation of the gathered root's gradients:
    FSDP1 under no_sync, or hf under accelerate's FSDP1 at every step."""
    hf_fsdp1 = request.training.framework is Framework.hf and fsdp1_root_stays_gathered(request)
    return hf_fsdp1 or _runs_fsdp1_no_sync(request)


def _runs_fsdp1_no_sync(request: PlanRequest) -> bool:
    """FSDP1 accumulating under no_sync: the harness's FSDP1 engine, or a stack whose loop runs
    FSDP1's no_sync() (FrameworkProfile.accumulates_without_gradient_sync: litgpt through Lightning)."""
    fsdp1 = fsdp1_root_stays_gathered(request) or profile(request.training.framework).accumulates_without_gradient_sync
    return fsdp1 and fsdp_no_sync_carried_gradient_bytes(request) == 0


def backward_end_buffer_bytes(request: PlanRequest) -> int | None:
    """The buffers of the last reduction of backward (PeakTerms.backward_end_buffers): FSDP2's
    last unit's flat reduce-scatter input, its unsharded gradients or the head gradient the root
    holds; FSDP1's gathered root with its gradients and their flat concatenation under no_sync;
    DeepSpeed ZeRO-3's flat copy of its last bucket and its first module, still gathered.
    None where the largest unit's transient buffers stand for them."""
    if deepspeed_stage0.runs_deepspeed_stage0(request):
        return deepspeed_stage0.backward_end_buffer_bytes(request)
    fsdp = _fsdp_last_unit(request)
    if fsdp is not None:
        last, head = fsdp
        if head and _fsdp1_root_cats_gradients(request):
            return _fsdp1_root_backward_end_bytes(request, last)
        return _fsdp_backward_end_bytes(request, last, head)
    if deepspeed_epilogue.models_epilogue(request):
        return deepspeed_epilogue.epilogue_buffer_bytes(request)
    if deepspeed_2022.models_2022(request):
        return deepspeed_2022.reduce_copy_bytes(request)
    if deepspeed_offload.models_gradient_path(request):
        # The bucket is held through backward (deepspeed_bucket_from_backward_start).
        return deepspeed_offload.gradient_path_bytes(request)
    return None


def backward_end_gradient_bytes(request: PlanRequest) -> int | None:
    """The gradients alive at the last reduction (PeakTerms.backward_end_gradients): none under
    DeepSpeed ZeRO-3, whose fp32 partition is made at the step, what the shards add beyond the
    held unsharded gradients under FSDP's no_sync accumulation (none from two ranks on:
    no_sync_backward_end_gradient_bytes), and every full gradient under
    DeepSpeed ZeRO-1, reduced only once backward ends (zeroplan.core.deepspeed_epilogue); None
    (the model states' gradients) elsewhere."""
    if deepspeed_epilogue.models_epilogue(request):
        return 0
    if deepspeed_stage0.runs_deepspeed_stage0(request):
        # The model-dtype gradients in autograd; the fp32 copies are made at the step.
        return deepspeed_stage0.between_micro_steps_bytes(request)
    if fsdp_no_sync_carried_gradient_bytes(request) == 0:
        return no_sync_backward_end_gradient_bytes(request)
    saved_shards = fsdp1_offload_saved_gradient_bytes(request)
    if saved_shards:
        return saved_shards
    if deepspeed_epilogue.stage1_keeps_gradients(request):
        return deepspeed_epilogue.stage1_gradient_bytes(request)
    return None


# Every micro-batch of no_sync accumulation but the last ends its backward with the unsharded
# gradients whole and no shard (fsdp_no_sync_carried_gradient_bytes); the last ends with the
# shards its reduce-scatters made in their place (draining_held_buffer_bytes), beside the same last
# reduction. From two ranks on the shards are no larger (4/N bytes an element of fp32 shards
# against the unsharded 2), on one rank under fp32 shards they are twice as large.
def no_sync_backward_end_gradient_bytes(request: PlanRequest) -> int:
    """The gradients alive at the end of backward under FSDP's no_sync accumulation beyond the
    held unsharded gradients: what the last micro-batch's shards add to the larger end."""
    shards = fsdp1_offload_saved_gradient_bytes(request) or model_state_bytes(request).gradient_bytes
    return max(shards - draining_held_buffer_bytes(request), 0)


# torch 2.13 distributed/fsdp/_runtime_utils.py _accumulate_sharded_grad: under FSDP1's CPUOffload
# each unit's reduced fp32 shard is kept on the device as _saved_grad_shard (_offload_grad copies
# it into the host's _cpu_grad without freeing it) until the post-backward final callback's
# _flat_param.py prepare_gradient_for_optim deletes it: the shards are alive on the device at the
# end of backward, though the step runs on the host. FSDP2's CPUOffloadPolicy moves each shard to
# the host as it is reduced (_fsdp_collectives.py foreach_reduce). Measured at full size
# (benchmarks/framework-fsdp1-qlora-offload-step-records, zeroplan.frameworks.hf_fsdp1_step).
def fsdp1_offload_saved_gradient_bytes(request: PlanRequest) -> int:
    """The reduced gradient shards FSDP1 under CPUOffload holds on the device at the end of
    backward: the sharded gradients the states would have without the offload; 0 elsewhere.
    fairseq's FSDP is fairscale's FullyShardedDataParallel, not torch's: its offloaded step is
    planned by its own terms (fairseq-fsdp-13b-offload-1gpu, measured within 1 %)."""
    if not (request.training.fsdp_cpu_offload and fsdp1_root_stays_gathered(request)):
        return 0
    if request.training.framework is Framework.fairseq:
        return 0
    kept = request.training.model_copy(update={"fsdp_cpu_offload": False})
    return model_state_bytes(request.model_copy(update={"training": kept})).gradient_bytes


def block_backward_gradient_bytes(request: PlanRequest) -> int:
    """Gradients alive at the first block's backward beyond those carried between micro-batches
    (PeakTerms.block_backward_gradients): DeepSpeed ZeRO-1/2's gradients of what follows the
    blocks (zeroplan.core.deepspeed_epilogue.early_gradient_bytes), a tied head's gradient held
    under the optimizer in backward (tied_head_gradient_in_backward_bytes); 0 elsewhere."""
    return deepspeed_epilogue.early_gradient_bytes(request) + tied_head_gradient_in_backward_bytes(request)


# torch 2.13 torch/csrc/autograd/engine.cpp (Engine::evaluate_function): a node runs once every
# incoming gradient has reached its InputBuffer, where they are summed. A tied embedding's weight
# is one leaf used twice (output projection and embedding), so its AccumulateGrad, and with it
# the post-accumulate-grad hook that torchtune's optimizer_in_bwd steps and frees the gradient
# in (torchtune 0.6.1 training/memory.py register_optim_in_bwd_hooks), runs only after the
# embedding's backward, the last: the output projection's contribution, a weight-sized gradient
# in the compute dtype, is held from the loss's backward through every block's. Untied, the
# head's hook steps and frees it at once. Measured on the CPU (tests/test_head_gradients.py):
# at the first layer's backward the tied model holds one head-sized gradient more than the untied one.
def tied_head_gradient_in_backward_bytes(request: PlanRequest) -> int:
    """The tied embedding's first gradient contribution held through backward under
    TrainingSpec.optimizer_in_backward (0 untied, frozen or without the optimizer in backward)."""
    units = rank_parameter_units(request)
    if (not request.training.optimizer_in_backward or not request.model.tied_embeddings or request.parallel.pp > 1
            or not any(t.trainable for unit in units if unit.name == "embedding" for t in unit.tensors)):
        return 0
    return request.model.vocab_size * request.model.hidden_size * request.training.precision.compute_bytes // request.parallel.tp


def block_backward_transient_bytes(request: PlanRequest) -> int:
    """The gathered and reduced units a block's backward holds under FSDP full sharding (the
    blocks' and the root's, not the largest unit twice); transient_buffer_bytes otherwise."""
    kind = request.strategy.kind
    if _bf16_optimizer_buffers(request):
        # The all-reduce runs after the backward of the step's last micro-batch.
        return 0
    if deepspeed_epilogue.stage1_carries_bucket(request):
        # The bucket is the earlier micro-steps', already in PeakTerms.accumulated_gradients.
        return 0
    if deepspeed_2022.models_2022(request):
        # 2022's stage 1 reduces nothing in backward (no hooks, no bucket): after it, at the boundary.
        return 0
    if deepspeed_one_rank.gathers_nothing(request):
        # A block's backward: its largest module's gradients, nothing gathered (deepspeed_one_rank).
        return deepspeed_one_rank.largest_module_gradient_bytes(request, blocks_only=True)
    units = rank_parameter_units(request)
    blocks = [i for i, unit in enumerate(units) if unit.name.startswith("block.")]
    if kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp) or not blocks or request.parallel.pp > 1:
        return transient_buffer_bytes(request)
    eb = element_bytes(request.training.precision, request.convention)
    shard = request.shard_group_size
    gathered = unit_gather_bytes(request, shard, eb.compute_parameter)
    elements = padded_unit_elements_of(request, shard)
    root = 0 if fsdp_separates_embedding_and_head(request) else sum(
        n for i, n in enumerate(gathered) if not units[i].name.startswith("block.")) + head_weight_gradient_bytes(request)
    largest_gathered = max(gathered[i] for i in blocks)
    largest_elements = max(elements[i] for i in blocks)
    if request.training.framework is Framework.fairseq:
        # fairscale's root stays gathered with its head gradient through backward beside the
        # layer's unit, so the largest unit (the root) does not bound them; the layer's own
        # gradients at its softmax's backward are in the workspace (zeroplan.core.fairseq).
        return root + (1 + request.strategy.prefetch_units) * largest_gathered
    # The flat reduce-scatter input held is the unit's reduced before (_fsdp_param_group.py
    # post_backward: comm_ctx.reduce_scatter_state, freed once the next reduce-scatter starts): a
    # block's, or at the first block's backward, where the head is a unit of its own, the head's.
    held_input = largest_elements
    if fsdp_separates_embedding_and_head(request) and _runs_units_in_order(request):
        held_input = max(held_input, elements[-1])
    block_units = (1 + request.strategy.prefetch_units) * largest_gathered + held_input * gradient_wire_bytes(request)
    if profile(request.training.framework).runs_fsdp1 or _runs_units_in_order(request):
        # torch 2.13 distributed/fsdp/_runtime_utils.py _post_forward_reshard: FSDP1 does not
        # reshard the root after its forward (free_unsharded_flat_param is false for the root), and
        # the root's post-backward, which reshards it, runs after every block's. litgpt's root
        # (Lightning's FSDPStrategy, auto_wrap_policy={Block}: wte, ln_f, lm_head) is thus gathered,
        # with its head's gradient, beside each block's units: the largest unit does not bound them.
        # FSDP2 the same (_fully_shard/_fsdp_state.py: the root's pre-backward gathers it at the
        # loss's backward, its post-backward runs from the root's final callback, after every
        # block's: allocator/fsdp_schedule.py record_fsdp_step gathers it for the whole backward).
        return root + block_units
    return min(root + block_units, transient_buffer_bytes(request))


def _sharded_blocks_in_order(request: PlanRequest) -> frozenset[int]:
    """The rank's block units (their indices) under FSDP full sharding or HSDP whose units run
    embedding, blocks, head without a pipeline (what block_copy_buffer_bytes and
    root_gather_buffer_bytes apply to); empty elsewhere."""
    kind = request.strategy.kind
    if kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp) or request.parallel.pp > 1:
        return frozenset()
    if not _runs_units_in_order(request):
        return frozenset()
    return frozenset(i for i, unit in enumerate(rank_parameter_units(request)) if unit.name.startswith("block."))


def _runs_units_in_order(request: PlanRequest) -> bool:
    """The rank's units run embedding, blocks, head (what allocator/fsdp_schedule.py applies to)."""
    units = rank_parameter_units(request)
    return len(units) >= 3 and units[0].name == "embedding" and units[-1].name == "head"


# torch 2.13 _fully_shard/_fsdp_collectives.py foreach_all_gather and _fsdp_param_group.py
# pre_backward (FSDP1 the same: _runtime_utils.py _prefetch_handle, _flat_param.py
# _all_gather_flat_param into the padded unsharded flat parameter): the next block, prefetched as
# a block's backward starts, is gathered into one flat all-gather buffer, alive beside the
# parameters copied out of it (foreach_all_gather_copy_out) until they are all copied, before the
# block's workspace is made. Then, after the workspace is freed, autograd's unsharded gradients
# (one per parameter, the compute dtype) are alive beside the block's gathered parameters, the
# prefetched ones and the earlier block's flat reduce-scatter input, until post_backward reshards
# and foreach_reduce copies them into the block's own input (_fsdp_collectives.py:595-612). Both
# are what allocator/fsdp_schedule.py record_fsdp_step allocates beside those units in place of
# the workspace (its gather and backward_gradients).
def block_copy_buffer_bytes(request: PlanRequest) -> int:
    """PeakTerms.block_copy_buffers: the largest block's flat all-gather buffer or its unsharded
    gradients, whichever is larger, under FSDP full sharding or HSDP whose units run embedding,
    blocks, head without a pipeline; 0 elsewhere."""
    blocks = _sharded_blocks_in_order(request)
    if not blocks:
        return 0
    eb = element_bytes(request.training.precision, request.convention)
    shard = request.shard_group_size
    gathered = unit_gather_bytes(request, shard, eb.compute_parameter)
    elements = padded_unit_elements_of(request, shard)
    return max(max(gathered[i] for i in blocks), max(elements[i] for i in blocks) * eb.compute_parameter)


# torch 2.13 _fully_shard/_fsdp_state.py _pre_backward and _fsdp_param_group.py pre_backward: a
# root unit resharded after its forward (FSDP2's, reshard_after_forward) is gathered again when
# the backward reaches it, after the loss's own backward and before any block's, into one flat
# all-gather buffer beside the parameters copied out of it (foreach_all_gather, copy-out), every
# activation still saved (allocator/fsdp_schedule.py record_fsdp_step: gather(units[0]) after the
# loss). FSDP1's root stays gathered from its forward (fsdp1_root_stays_gathered), torchtitan's
# unit holding the head under its unchunked loss too (fsdp_schedule.FsdpStepInputs.held_root), and
# where embedding and head are units of their own the embedding is gathered after the last block.
def root_gather_buffer_bytes(request: PlanRequest) -> int:
    """PeakTerms.root_gather_buffers: the root unit's flat all-gather buffer and its copied-out
    parameters, twice its gathered bytes, where it is gathered again for the backward; else 0."""
    blocks = _sharded_blocks_in_order(request)
    if not blocks or fsdp_separates_embedding_and_head(request) or fsdp1_root_stays_gathered(request):
        return 0
    training = request.training
    if training.framework is Framework.torchtitan and training.unchunked_loss:
        return 0
    eb = element_bytes(training.precision, request.convention)
    gathered = unit_gather_bytes(request, request.shard_group_size, eb.compute_parameter)
    return 2 * sum(n for i, n in enumerate(gathered) if i not in blocks)


# torch 2.13 _fully_shard/_fsdp_state.py:434-452 _register_pre_backward_hook: the root's
# pre-backward (:381-392 _pre_backward, _fsdp_param_group.py:576-586 pre_backward: unshard,
# wait_for_unshard's copy-out) is a hook on the gradient of the root module's forward output.
# Where the loss is computed outside the root's forward on its logits (zeroplan's reference
# model: zeroplan/harness/torch_engines.py _Base.forward_backward, logits = self.module(...), then
# next_token_loss), that gradient is the logits' own, which the loss's backward has just
# written: the hook fires at the logits' grad_fn, after the cross-entropy's backward freed its
# saved log-softmax, so the root is gathered again (root_gather_buffer_bytes: its flat all-gather
# output and the parameters copied out of it) beside every saved activation and the logits'
# gradient (b s V in the logits' dtype, the compute dtype), which lives on to the head's
# backward. Measured on 2 gloo ranks (benchmarks/records/tiny-llama-fsdp-full-shard-torch-fp32-n2,
# FSDPMemTracker at the step's peak: All Gather 25,167,360 + Unsharded Param 25,167,360 beside
# Temp 16,777,216, the fp32 logits' gradient, and every activation). The harness wraps the root
# with reshard_after_forward=True, which torch 2.13 honours for a root (_fully_shard.py:246-260:
# only None turns the root's post_forward_mesh_info off, _fsdp_state.py:205-207).
# Only the reference model is counted so: a framework's own model places its loss itself (hf's
# LlamaForCausalLM computes it inside the root's forward when given labels, where the hook fires
# on the loss before the cross-entropy's backward; torchtune's output comes in chunks; torchtitan's
# head units are held or separate), and their whole steps on fake tensors
# (benchmarks/framework-step-records) are what their terms answer to.
def root_gathers_beside_logits_gradient(request: PlanRequest) -> bool:
    """PeakTerms.root_gather_after_loss: whether the root unit, gathered again for the backward
    (root_gather_buffer_bytes), is gathered beside the logits' gradient: the reference model's
    loss runs outside the root's forward (without model parallelism)."""
    return (request.training.framework is Framework.zeroplan and request.parallel.is_trivial
            and root_gather_buffer_bytes(request) > 0)


def reference_logits_gradient_bytes(request: PlanRequest) -> int:
    """PeakTerms.logits_gradient: the reference model's logits' gradient, b s V in the compute
    dtype, as the loss's backward leaves it for the head's (0 for a framework's own model, or
    with model parallelism); what a root gathered after the loss's backward is gathered beside."""
    if request.training.framework is not Framework.zeroplan or not request.parallel.is_trivial:
        return 0
    batch = request.batch
    return batch.micro_batch_size * batch.seq_len * request.model.vocab_size * request.training.precision.compute_bytes


# torch/optim/adam.py, _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) materialises one
# state-sized temporary per step (foreach is the default on CUDA); Lion's interpolation of
# momentum and gradient likewise. SGD updates in place; bitsandbytes and Adafactor use fused
# or factored kernels whose temporaries are not modelled.
_STEP_TEMPORARY_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw, Optimizer.lion)
_FUSED_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw)
"""torch 2.13 offers fused=True for these (and SGD, which has no temporary anyway)."""


# deepspeed 0.19.8 runtime/engine.py get_optimizer_configuration and _configure_basic_optimizer:
# a config's "Adam"/"AdamW" becomes DeepSpeed's FusedAdam (ops/adam/fused_adam.py, one
# multi-tensor kernel updating in place) unless it sets torch_adam or steps on the CPU, and
# "Lion" its FusedLion; neither materialises a state-sized temporary.
_DEEPSPEED_FUSED_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw, Optimizer.lion)


def optimizer_loop(request: PlanRequest) -> OptimizerLoop:
    """The request's optimizer loop, or its stack's: fused where DeepSpeed builds the optimizer
    (the deepspeed state convention) or the framework's recipes fuse Adam/AdamW
    (FrameworkProfile.fused_optimizer), else foreach, torch's CUDA default (the for-loop before
    torch 2.0: TrainingSpec.torch_release)."""
    chosen = request.training.optimizer_loop
    if chosen is not None:
        return chosen
    optimizer = request.training.optimizer
    if request.convention is StateConvention.deepspeed and optimizer in _DEEPSPEED_FUSED_OPTIMIZERS:
        return OptimizerLoop.fused
    # Before torch 2.0 torch's optimizers loop tensor by tensor unless asked
    # (zeroplan.core.torch_release): the loops of the time (peft's examples' torch.optim.AdamW,
    # given neither foreach nor fused) stepped so, whatever the framework's recipe fuses today.
    if default_loop_is_for_loop(request.training):
        return OptimizerLoop.for_loop
    fuses = optimizer in _FUSED_OPTIMIZERS and profile(request.training.framework).fused_optimizer
    # The hf profile's fused AdamW is the Trainer's default of transformers 4.54+ under torch 2.8+
    # only; earlier releases build torch.optim.AdamW unfused (transformers_release.TRAINER_FUSED_ADAMW_FROM).
    if fuses and request.training.framework is Framework.hf and not trainer_fuses_adamw(request.training):
        fuses = False
    return OptimizerLoop.fused if fuses else OptimizerLoop.foreach


def step_makes_temporary(request: PlanRequest) -> bool:
    """Whether the optimizer step materialises a temporary: Adam/AdamW and Lion do, unless fused."""
    if request.training.optimizer not in _STEP_TEMPORARY_OPTIMIZERS:
        return False
    return optimizer_loop(request) is not OptimizerLoop.fused


# torch/optim/adam.py _single_tensor_adam (foreach=False), per parameter:
# denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): the square root and the
# quotient are two tensor-sized temporaries alive together, both gone before the next tensor.
# Measured on a GPU (benchmarks/gpu-allocator-records, DDP: two 250 MiB fp32 temporaries of the
# embedding at once). Lion's update is one temporary.
def for_loop_step_temporary_bytes(request: PlanRequest, eb) -> int:
    copies = 1 if request.training.optimizer is Optimizer.lion else 2
    return copies * largest_optimizer_tensor_elements(request) * eb.optimizer_dtype


def optimizer_step_temporary_bytes(request: PlanRequest, optimizer_elements: int) -> int:
    if deepspeed_fused_fp16.runs_fused_fp16_optimizer(request):
        # A client FusedAdam's FP16_Optimizer at stage 0: the first group's fp32 gradient copies.
        return deepspeed_fused_fp16.step_temporary_bytes(request)
    if _megatron_buffers(request):
        from zeroplan.core.megatron import megatron_step_temporary_bytes  # megatron's requests alone load it

        return megatron_step_temporary_bytes(request, optimizer_elements)
    if _bf16_optimizer_buffers(request):
        # runtime/bf16_optimizer.py step hands the fp32 gradient partition itself to the fused
        # Adam (param_partition.grad = grad_partition; a copy only under bf16 accumulation).
        return 0
    # With FSDP2's CPUOffloadPolicy the step runs on the host's states (model_state_bytes), and
    # so does DeepSpeed's offload but for the sub-groups a ratio keeps on the GPU, whose AdamW
    # makes its temporary there (zeroplan.core.deepspeed_partial_offload).
    if request.strategy.kind.offloads_optimizer and not request.training.fsdp_cpu_offload:
        from zeroplan.core.deepspeed_partial_offload import device_step_temporary_bytes

        # DeepSpeed 0.14.1-0.16.x's ZeRO-2 offload copies its fp32 partition onto the GPU at the
        # step (zeroplan.core.deepspeed_offload.step_upcopy_bytes); the partial offload is stage 3's.
        return device_step_temporary_bytes(request) + deepspeed_offload.step_upcopy_bytes(request)
    if request.training.fsdp_cpu_offload:
        return 0
    # The states' dtype: peft's adapters' where nothing casts them (zeroplan.core.finetune.adapter_dtype).
    eb = trainable_element_bytes(request, element_bytes(request.training.precision, request.convention))
    if request.training.optimizer_in_backward:
        return optimizer_in_backward_step_bytes(request, eb)
    # DeepSpeed's ZeRO-1/2 step takes the gradient norm (one fp64 copy at a time) before the
    # optimizer updates: the larger of the two is the step's temporary.
    if request.training.optimizer is Optimizer.muon:
        step = max(deepspeed_step.norm_copy_bytes(request), muon_step_temporary_bytes(request, eb))
        if request.convention is StateConvention.deepspeed:
            # The Muon updates DeepSpeed holds from the backward's end to the step (zeroplan.core.muon).
            step += muon.deepspeed_held_update_bytes(request, eb.compute_parameter)
        return step
    if deepspeed_2022.models_2022(request):
        return deepspeed_2022.step_temporary_bytes(request)
    norm = deepspeed_step.norm_copy_bytes(request)
    if not step_makes_temporary(request):
        return norm
    # PEFT's trainable copies, a dtype group of their own (zeroplan.core.finetune.modules_to_save).
    beside, copy_for_loop = modules_to_save.copy_step_temporary_bytes(request, optimizer_loop(request))
    if optimizer_loop(request) is OptimizerLoop.for_loop:
        return max(norm, for_loop_step_temporary_bytes(request, eb), copy_for_loop)
    group_bytes = optimizer_elements * eb.optimizer_dtype
    # Each dtype group's temporaries are made while the group before it still holds its own (the
    # names are rebound, not deleted): with c copies a group, the larger group's c beside the
    # smaller's one, whichever runs first.
    extra_copies = foreach_step_copies(request) - 1
    return max(norm, group_bytes + beside + extra_copies * max(group_bytes, beside))


# torch 2.0.1 torch/optim/adamw.py:564-568 (adam.py:505-507): the foreach step's square root and
# its eps-shifted copy (denom = torch._foreach_add(exp_avg_sq_sqrt, eps)) are alive together;
# torch 2.1.0 adamw.py:579 shifts in place (zeroplan.core.torch_release.FOREACH_ADAM_IN_PLACE_FROM).
# Lion is not torch's in those releases: its one interpolation stays.
def foreach_step_copies(request: PlanRequest) -> int:
    """State-sized temporaries the foreach step holds at once."""
    if request.training.optimizer in (Optimizer.adam, Optimizer.adamw):
        return foreach_adam_temporaries(request.training)
    return 1


# Muon orthogonalises one matrix after another (torch 2.13 optim/_muon.py _single_tensor_muon;
# deepspeed 0.19.8 runtime/zero/stage_1_and_2.py get_flat_partition calls muon_update per matrix
# of the partition, on the model-dtype gradients, when the backward ends) and its AdamW steps the
# rest apart: the step's temporary is the larger of the largest matrix's Newton-Schulz peak
# (zeroplan.core.muon) and AdamW's own. DeepSpeed's AdamW is FusedAdam (runtime/engine.py
# get_optimizer_configuration), in place; torch.optim.AdamW's is optimizer_loop's (foreach: one
# state-sized sqrt over its tensors; for-loop: two of its largest tensor). DeepSpeed's muon_update
# is torch.compile'd with its Gram iteration in fp16 on a GPU; the eager torch.optim.Muon figure
# stands for it (not measured on a GPU).
def muon_step_temporary_bytes(request: PlanRequest, eb) -> int:
    deepspeed = request.convention is StateConvention.deepspeed
    newton_schulz = muon.largest_newton_schulz_bytes(request, eb.compute_parameter if deepspeed else eb.optimizer_dtype)
    elements, largest = muon.adamw_elements(request)
    loop = OptimizerLoop.fused if deepspeed else (request.training.optimizer_loop or OptimizerLoop.foreach)
    adamw = {OptimizerLoop.fused: 0, OptimizerLoop.foreach: elements, OptimizerLoop.for_loop: 2 * largest}[loop]
    return max(newton_schulz, adamw * eb.optimizer_dtype)


# torchtune 0.6.1 recipes/full_finetune_distributed.py _setup_optimizer: with optimizer_in_bwd
# one optimizer per parameter, each stepped in that parameter's post-accumulate-grad hook
# (training/memory.py register_optim_in_bwd_hooks), then zeroed. The largest such step holds
# one tensor's gradient shard and, for the optimizers above, one state-sized temporary.
def optimizer_in_backward_step_bytes(request: PlanRequest, eb) -> int:
    """Bytes alive at the largest per-parameter step beside the resident states."""
    elements = largest_tensor_shard_elements(request)
    temporary = eb.optimizer_dtype if step_makes_temporary(request) else 0
    return elements * (eb.gradient + temporary)


def _reduces_unit_by_unit(request: PlanRequest) -> bool:
    """FSDP full sharding (or HSDP) without a pipeline over embedding, blocks and head: each
    unit's gradient becomes its shard as its backward ends (with accumulation it is added into
    the carried shard, torch 2.13 _fully_shard/_fsdp_collectives.py foreach_reduce:
    sharded_param.grad._local_tensor += new_sharded_grad, so every micro-batch's backward ends at
    the first layer with the same buffers; under no_sync accumulation the last micro-batch's
    backward does, no_sync_first_layer_gradient_bytes). Data parallelism alone: under tensor or context parallelism the pieces below over-count the
    schedule's moment (torchtitan 9dec370's Llama-3.1-70B at TP 8, 8,192 tokens: 8.55 GB against
    the replay's 7.68, tests/test_loss_parallel.py), so the moment is left to the replay there."""
    if request.strategy.kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp) or request.parallel.pp > 1:
        return False
    if request.parallel.tp > 1 or request.parallel.cp > 1:
        return False
    if (request.batch.grad_accum_steps > 1 and request.strategy.keep_unsharded_grads_on_accum
            and fsdp_no_sync_carried_gradient_bytes(request) != 0):
        return False
    units = rank_parameter_units(request)
    return len(units) >= 3 and units[0].name == "embedding" and units[-1].name == "head"


def first_layer_activation_blocks(request: PlanRequest) -> int:
    """PeakTerms.activation_blocks: the blocks whose activations the first layer's backward has
    seen freed all but one of, where that moment is modelled (_reduces_unit_by_unit); else 0."""
    return request.model.num_layers if _reduces_unit_by_unit(request) else 0


# torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward (and FSDP1's
# _runtime_utils.py _post_backward_hook): a unit's gradients are reduce-scattered to its shard as
# its backward ends, so when the first layer's backward runs, the last unit to run but the root
# (or the embedding), every other unit's shard is there: the blocks after the first and, where the
# head is a unit of its own, the head's. The shards split the model states' gradients in
# proportion to the units' padded trainable elements, the remainder on the largest (as the step's
# trace splits them: allocator/fsdp_schedule.py record_fsdp_step).
def first_layer_gradient_bytes(request: PlanRequest, gradient_bytes: int, before_block: int = 0) -> int:
    """PeakTerms.first_layer_gradients: the shards of the units reduced before block
    ``before_block``'s backward, the first's or (1) the second's (0 where that moment is not
    modelled; under no_sync accumulation what they add beyond the unsharded gradients they
    replace, no_sync_first_layer_gradient_bytes)."""
    if not _reduces_unit_by_unit(request):
        return 0
    no_sync = fsdp_no_sync_carried_gradient_bytes(request) == 0
    if request.batch.grad_accum_steps > 1 and not no_sync:
        # With accumulation every shard is there from the start (the carried gradients), and
        # each reduce-scatter's output is added into it.
        return 0
    shards = _reduced_before(request, gradient_bytes, before_block)
    if no_sync:
        return no_sync_first_layer_gradient_bytes(shards, _reduced_before(request, draining_held_buffer_bytes(request), before_block))
    return shards


def _reduced_before(request: PlanRequest, total_bytes: int, before_block: int) -> int:
    """The part of ``total_bytes``, split among the units in proportion to their padded
    trainable elements (the remainder on the largest), of the units reduced before block
    ``before_block``'s backward (as the step's trace splits the gradient shards and the no_sync
    unsharded gradients: allocator/fsdp_schedule.py record_fsdp_step)."""
    elements = padded_unit_elements_of(request, request.shard_group_size)
    # The units in forward order as FSDP wraps them: the root holds embedding and head together.
    weights = elements if fsdp_separates_embedding_and_head(request) else [elements[0] + elements[-1], *elements[1:-1]]
    total = sum(weights)
    if total_bytes <= 0 or total <= 0:
        return 0
    # weights[1 + before_block] is that block's: every unit after it is reduced before it.
    after = 2 + before_block
    before = sum(total_bytes * w // total for w in weights[after:])
    largest = max(range(len(weights)), key=weights.__getitem__)
    if largest >= after:
        before += total_bytes - sum(total_bytes * w // total for w in weights)
    return before


# torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward (lines 603-627):
# in the last micro-batch of no_sync accumulation (reduce_grads True) a unit's post-backward adds
# the new gradient into its unsharded accumulated one (accumulate_unsharded_grad_if_needed), takes
# it off the parameter (unsharded_accumulated_grad = None) and hands it to foreach_reduce, whose
# copy-in drops it (_fsdp_collectives.py foreach_reduce, line 606: unsharded_grads.clear()) and
# whose output becomes the unit's new gradient shard. FSDP1 the same (_runtime_utils.py
# _reduce_grad, lines 846-847: the unsharded flat gradient taken off flat_param.grad and
# reduce-scattered into a new shard). So
# that micro-batch's first layer's backward holds the shards of the units reduced before it in
# place of their unsharded gradients, the others' unsharded gradients still held; every earlier
# micro-batch's holds every unsharded gradient and no shard. The moment is the larger of the two:
# the held unsharded gradients (backward_held_buffer_bytes) and what the shards add beyond the
# unsharded gradients they replace (on one rank fp32 shards are twice bf16 unsharded gradients).
def no_sync_first_layer_gradient_bytes(reduced_shard_bytes: int, reduced_unsharded_bytes: int) -> int:
    """What the last micro-batch's shards of the units reduced before the first layer's
    backward add beyond the unsharded gradients they replace (0 where they are no larger)."""
    return max(reduced_shard_bytes - reduced_unsharded_bytes, 0)


def _first_layer_units(request: PlanRequest):
    """(block indices, gathered bytes per unit, padded elements per unit, element bytes) of the
    units the first-layer moment reads; None where that moment is not modelled."""
    if not _reduces_unit_by_unit(request):
        return None
    blocks = [i for i, unit in enumerate(rank_parameter_units(request)) if unit.name.startswith("block.")]
    if not blocks:
        return None
    eb = element_bytes(request.training.precision, request.convention)
    shard = request.shard_group_size
    return blocks, unit_gather_bytes(request, shard, eb.compute_parameter), padded_unit_elements_of(request, shard), eb


# allocator/fsdp_schedule.py record_fsdp_step, after torch 2.13 _fully_shard/_fsdp_param_group.py
# (post_backward keeps a unit's flat reduce-scatter input until the next unit's reduce-scatter
# starts) and _fsdp_state.py (the backward prefetch): while the first layer's backward runs, the
# root stays gathered (or, where embedding and head are units of their own, the embedding is
# gathered, prefetched as the unit whose backward comes next), the first block is gathered and the
# second block's flat reduce-scatter input is still held; the workspace comes beside them. The last
# block's backward, the first to run, has no earlier input held: block_backward_transient_bytes'
# fairseq units leave it out, which this moment may not.
def first_layer_buffer_bytes(request: PlanRequest) -> int:
    """The units the first layer's backward holds (0 where that moment is not modelled): the root
    or the prefetched embedding, the largest block gathered and the largest block's flat input."""
    found = _first_layer_units(request)
    if found is None:
        return 0
    blocks, gathered, elements, _ = found
    if fsdp_separates_embedding_and_head(request):
        outside = gathered[0]
    else:
        outside = sum(n for i, n in enumerate(gathered) if i not in blocks) + head_weight_gradient_bytes(request)
    return (outside + max(gathered[i] for i in blocks)
            + max(elements[i] for i in blocks) * gradient_wire_bytes(request))


# allocator/fsdp_schedule.py record_fsdp_step, after torch 2.13 _fully_shard/_fsdp_collectives.py:
# the first layer's workspace is freed before autograd makes its unsharded gradients, one per
# parameter in the compute dtype, which are alive beside the block's gathered parameters and the
# second block's flat input until foreach_reduce copies them into the block's own; and before the
# workspace is made, the prefetched embedding (a unit of its own) is gathered into one flat
# all-gather buffer beside its copied-out parameters (foreach_all_gather, then copy-out).
def first_layer_copy_buffer_bytes(request: PlanRequest) -> int:
    """PeakTerms.first_layer_copy_buffers: the largest block's unsharded gradients, or the
    embedding's all-gather buffer where it is a unit of its own, whichever is larger (0 where
    the moment is not modelled)."""
    found = _first_layer_units(request)
    if found is None:
        return 0
    blocks, gathered, elements, eb = found
    gradients = max(elements[i] for i in blocks) * eb.compute_parameter
    if not fsdp_separates_embedding_and_head(request):
        return gradients
    return max(gradients, gathered[0])


# allocator/fsdp_schedule.py record_fsdp_step, after torch 2.13 _fully_shard/_fsdp_state.py (the
# backward prefetch) and _fsdp_collectives.py foreach_all_gather: the first layer is gathered
# while the second layer's backward runs, before the second's workspace is made, into a flat
# all-gather buffer (first_layer_gather_flat_bytes) whose copy-out gives its parameters; beside
# them the second block gathered, the third block's flat reduce-scatter input still held and,
# where embedding and head share the root unit, the root (gathered since the loss's backward).
def first_layer_gather_buffer_bytes(request: PlanRequest) -> int:
    """PeakTerms.first_layer_gather_buffers: the root where it holds embedding and head, two of
    the largest block gathered and the largest block's flat input (0 where the moment is not
    modelled)."""
    found = _first_layer_units(request)
    if found is None:
        return 0
    blocks, gathered, elements, _ = found
    root = 0 if fsdp_separates_embedding_and_head(request) else \
        sum(n for i, n in enumerate(gathered) if i not in blocks) + head_weight_gradient_bytes(request)
    return root + 2 * max(gathered[i] for i in blocks) + max(elements[i] for i in blocks) * gradient_wire_bytes(request)


def first_layer_gather_flat_bytes(request: PlanRequest) -> int:
    """PeakTerms.first_layer_gather_flat_buffers: the largest block's flat all-gather buffer (0
    where the moment is not modelled)."""
    found = _first_layer_units(request)
    if found is None:
        return 0
    blocks, gathered, _, _ = found
    return max(gathered[i] for i in blocks)
