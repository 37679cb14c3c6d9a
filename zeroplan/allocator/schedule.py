"""A step's allocation trace generated from the planner's own terms for one request (where no
measured run gives one), in step order: model states and resident buffers first, then per
block its gathered unit and saved activations (forward), the loss's tensors, per block in
reverse its gathered unit, reduce buffer and workspace while its activations are freed
(backward), the gradients, the optimizer step's temporaries. Its requested peak equals the
planner's allocated peak (zeroplan.core.plan.peak_allocated_bytes): the trace realises each of
the planner's four moments and nothing larger. docs/memory-model.md, "The caching allocator",
lists what it approximates."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from zeroplan.allocator.builder import TraceBuilder, even_parts, split_bytes
from zeroplan.allocator.checkpoint_save import record_checkpoint_save
from zeroplan.allocator.deepspeed_first_step import DeepSpeedFirstStep, first_step, record_constructed_states
from zeroplan.allocator.eager_softmax_workspace import eager_softmax_workspace, peak_tensors, record_workspace
from zeroplan.allocator.fsdp_schedule import applies as fsdp_applies
from zeroplan.allocator.fsdp_schedule import (FsdpStepInputs, forward_cache_parts, forward_collectives, fsdp_loss_allocations,
                                              fsdp_step_inputs, loss_allocations, record_fsdp_step, run_loss,
                                              run_sequence_parallel_forward, run_sequence_parallel_recompute,
                                              run_torchtitan_loss_parallel)
from zeroplan.core.parallel.sequence_parallel import SublayerCollectives
from zeroplan.allocator.replay import Ops
from zeroplan.allocator.streams import Stream
from zeroplan.core import deepspeed_2022, deepspeed_one_rank, deepspeed_reduce_stream, deepspeed_stage0, deepspeed_stage3_step
from zeroplan.core.activations import layer_terms
from zeroplan.core.checkpoint_save import SaveUnits, save_units
from zeroplan.core.deepspeed_accumulation import overlap_comm
from zeroplan.core.deepspeed_epilogue import stage1_carries_bucket
from zeroplan.core.deepspeed_step import NORM_COPY_BYTES, runs_flat_step
from zeroplan.core.framework_loss import loss_parallel_applies
from zeroplan.core.frameworks import framework_recompute_bytes
from zeroplan.core.transformers_release import LOSS_TENSORS, ordered_loss_tensors
from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.parallel.activations import rank_activation_bytes
from zeroplan.core.parallel.pipeline import in_flight_chunks, rank_stages
from zeroplan.core.record import frozen
from zeroplan.specs.parallel import PipelineSchedule
from zeroplan.specs.framework import Framework
from zeroplan.core.buffers import foreach_step_copies, optimizer_loop
from zeroplan.core.finetune.adapter_dtype import trainable_element_bytes
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, Optimizer, OptimizerLoop, StateConvention
from zeroplan.units import FP32_BYTES
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms, peak_allocated_bytes

if TYPE_CHECKING:
    from zeroplan.allocator.trace import AllocationTrace



def _block_tensor_weights(request: PlanRequest) -> list[int]:
    """The tensors one block saves, as the planner's layer terms (one tensor each); under full
    recomputation the block keeps only its input."""
    model, training, batch = request.model, request.training, request.batch
    if training.activation_checkpointing is ActivationCheckpointing.full:
        return [1]
    terms = layer_terms(model, training, batch.seq_len, batch.micro_batch_size, autocast=request.runs_under_autocast)
    weights = [value for value in terms.values() if value > 0]
    return weights or [1]


# Korthikanti et al. 2022 sec. 5: under full recomputation a block's backward first reruns its
# forward with gradients on (DeepSpeed runtime/activation_checkpointing/checkpointing.py
# CheckpointFunction.backward at microsoft/DeepSpeed@8eef742f0: ctx.run_function under
# torch.enable_grad, then torch.autograd.backward), allocating the block's saved tensors one by
# one (zeroplan.core.frameworks.framework_recompute_bytes counts their sum), beside the
# residual-stream gradients the rest of the workspace is. Taken tensor by tensor where the
# recompute is DeepSpeed's (the megatron-deepspeed profile's --deepspeed-activation-checkpointing)
# or fairseq's (fairseq c6006678 modules/checkpoint_activations.py CheckpointFunction.backward:
# ctx.run_function under torch.enable_grad, then torch.autograd.backward, the same rerun);
# torch.utils.checkpoint reruns alike (reentrant, utils/checkpoint.py:278-337, and non-reentrant,
# :1165-1207), but taken tensor by tensor for the other profiles the schedule reserves less than
# their own steps do (torchtune's full-shard trace: OOM capacity +0.7 -> -8.2 %; fsdp_qlora's
# reserved rows 3.7 -> 7.8 %): the one allocation stands in for the temporaries those steps make
# and the schedule does not record, so it stays (docs/memory-model.md, "The caching allocator").
def _recompute_only(request: PlanRequest) -> tuple[int, int]:
    """(kept, recompute) as rank_activation_bytes reads them, the recompute alone."""
    return 0, framework_recompute_bytes(request)


def _workspace_parts(request: PlanRequest, workspace: int) -> tuple[int, ...]:
    """A block's backward workspace as the tensors it allocates: the rebuilt block's own (as the
    planner's layer terms weigh them, a transformers MoE's experts apart) and the rest in one;
    the whole in one elsewhere."""
    training = request.training
    experts = _experts_run_one_by_one(request)
    if (training.activation_checkpointing is not ActivationCheckpointing.full
            or training.framework not in (Framework.megatron_deepspeed, Framework.torchtitan, Framework.fairseq)
            and not experts):
        return (workspace,)
    recompute = min(rank_activation_bytes(request, _recompute_only)[1], workspace)
    model, batch = request.model, request.batch
    terms = layer_terms(model, training, batch.seq_len, batch.micro_batch_size, autocast=request.runs_under_autocast)
    weights = []
    for name, value in terms.items():
        if value > 0:
            apart = experts if experts and name in _EXPERT_TERMS else 1
            weights += [value // apart] * apart
    return tuple(split_bytes(recompute, weights or [1]) + split_bytes(workspace - recompute, [1]))


def workspace_peak_tensors(request: PlanRequest, terms: PeakTerms) -> tuple[int, ...]:
    """The tensors one block's backward workspace holds at its most bytes, as both schedules
    allocate it (record_step, fsdp_schedule.record_fsdp_step): transformers' eager attention
    core's steps at their peak, else _workspace_parts, allocated together."""
    steps = eager_softmax_workspace(request, terms.workspace)[1]
    return peak_tensors(steps) if steps else _workspace_parts(request, terms.workspace)


_EXPERT_TERMS = ("mlp_inner",)
"""The layer terms of a MoE block that its routed experts' own tensors make up
(zeroplan.core.activations.mlp_terms: each routed copy of a token's inner activations)."""


# transformers 4.56.2 models/mixtral/modeling_mixtral.py MixtralSparseMoeBlock.forward (lines
# 126-138; qwen2_moe's and qwen3_moe's blocks the same, deepseek_v2's DeepseekV2MoE.moe lines
# 126-133 alike on its sorted tokens): the experts run one by one, each on the tokens routed to it,
# so each expert's inner activations are tensors of their own, about 1/E of the layer's, where the
# workspace as one allocation was one tensor larger than any the block makes (Mixtral-8x7B at
# 53 x 2,048 tokens: 36 GiB). Under transformers' gradient checkpointing (modeling_utils.py
# gradient_checkpointing_enable: use_reentrant=True, torch/utils/checkpoint.py
# CheckpointFunction.backward) the backward reruns the block's forward under enable_grad, the
# rerun DeepSpeed's CheckpointFunction makes: the rebuilt block's tensors are allocated one by one.
def _experts_run_one_by_one(request: PlanRequest) -> int:
    """The routed experts a transformers MoE block runs one after another (hf's MoE models),
    whose tensors the workspace splits among; 0 elsewhere."""
    model = request.model
    if request.training.framework is not Framework.hf or not model.is_moe:
        return 0
    return max(model.num_experts // request.parallel.ep, 1)


# A pipeline rank holds each in-flight micro-batch's saved tensors apart: every forward of a
# micro-batch allocates its own (deepspeed runtime/pipe/engine.py _exec_forward_pass at
# microsoft/DeepSpeed@8eef742f0, one PipelineModule forward per buffer slot; torch's
# distributed/pipelining stage.py forward_one_chunk; megatron-core's forward_step), and its
# backward frees them. zeroplan.core.parallel.activations counts them as one sum per block.
def _in_flight_micro_batches(request: PlanRequest) -> int:
    """Micro-batches whose saved tensors each of the rank's blocks holds at its in-flight peak:
    the rank's in-flight chunks spread over its virtual stages (1 without a pipeline)."""
    parallel = request.parallel
    if parallel.pp == 1:
        return 1
    chunks = in_flight_chunks(parallel, parallel.pipeline_rank, request.batch.grad_accum_steps)
    return max(1, chunks // parallel.virtual_stages)


# torch 2.13 (and 2.6.0) distributed/pipelining/schedules.py ScheduleInterleaved1F1B
# forward_stage_index: a rank's k-th forward runs its local stage (k // q) % v, q = m // max(1,
# m // p) micro-batches per round, and its first backward (the peak, in_flight_chunks) follows
# the warm-up forwards and one more: on the last rank (pp 8, m 8, v 2) eight micro-batches of its
# first stage, then one of the head's stage, whose loss and backward come next. The chunks are
# replayed in that order, each over its stage's share of the rank's blocks, so the head stage's
# micro-batch runs its loss on top of the other stage's held chunks (not every block once per
# in_flight // v micro-batch, as under 1F1B). megatron-core's interleaved schedule
# (pipeline_parallel/schedules.py get_schedule_table, microbatch_group_size_per_vp_stage = pp by
# default) runs the same order where p divides m.
def _in_flight_chunk_blocks(request: PlanRequest, blocks: int) -> tuple[tuple[int, ...], ...]:
    """The blocks each in-flight chunk runs, in forward order, as the rank's ``blocks`` slots
    (empty: every block once per in-flight micro-batch)."""
    parallel = request.parallel
    if parallel.pp == 1 or parallel.virtual_stages == 1 or parallel.pp_schedule is not PipelineSchedule.interleaved_1f1b:
        return ()
    m, p, v, rank = request.batch.grad_accum_steps, parallel.pp, parallel.virtual_stages, parallel.pipeline_rank
    stages = rank_stages(parallel, request.model.num_layers, request.training.framework, rank)
    total = sum(stage.num_blocks for stage in stages)
    if total == 0:
        return ()
    bounds, seen = [0], 0
    for stage in stages:
        seen += stage.num_blocks
        bounds.append(round(blocks * seen / total))
    per_round = m // max(1, m // p)
    chunks = tuple(tuple(range(bounds[(k // per_round) % v], bounds[(k // per_round) % v + 1]))
                   for k in range(in_flight_chunks(parallel, rank, m)))
    return chunks if any(chunks) else ()


# DeepSpeed ZeRO-1 accumulating reduces every micro-step through the one ipg bucket its first
# hook made (stage_1_and_2.py:3256-3281 setup_buckets, released only by the boundary's epilogue:
# zeroplan.core.deepspeed_epilogue.stage1_carries_bucket), which the carried buffers count
# (PeakTerms.accumulated_gradients, deepspeed_accumulation.stage12_bucket_bytes): the reduction
# after the last micro-step's backward allocates no second bucket beside them.
def _transient_parts(request: PlanRequest, transient: int) -> tuple[int, int]:
    """(gathered unit on the all-gather stream, reduce buffer on the reduce-scatter stream) for
    FSDP; the whole term on the compute stream otherwise (returned as the first; none where
    ZeRO-1's carried bucket is the one it stands for)."""
    if stage1_carries_bucket(request):
        return 0, 0
    if not request.strategy.kind.is_fsdp:
        return transient, 0
    reduce = min(transient, largest_unit_elements(request) * gradient_wire_bytes(request))
    return transient - reduce, reduce


@frozen(slots=True)
class StepInputs:
    """Everything a step's schedule reads, computed from the request, its states and terms
    before the schedule runs: the schedules (record_step, fsdp_schedule.record_fsdp_step) read
    nothing else, so requests with equal inputs have the same trace, and the planner keys what it
    knows of a trace by them without building it. A schedule's unread fields are left at 0."""

    blocks: int
    accumulating: bool
    parameter_bytes: int
    optimizer_state_bytes: int
    gradient_bytes: int
    resident_buffers: int
    accumulated_gradients: int | None
    backward_held_buffers: int
    draining_held_buffers: int
    loss_held_buffers: int
    """PeakTerms.loss_held_buffers: allocated before the loss, freed once its moments are done."""
    activations: int
    workspace: int
    step_temporary: int
    block_weights: tuple[int, ...]
    """The tensors one block saves, as weights (_block_tensor_weights)."""
    cache_parts: tuple[tuple[int, ...], ...]
    """forward_cache_parts: the KV cache's tensors per block."""
    loss_moments: tuple[tuple[int, ...], ...]
    """loss_allocations (where the schedule runs the loss's moments; else empty)."""
    fsdp: FsdpStepInputs | None
    """The FSDP2 schedule's own inputs; None: this module's schedule."""
    loss_order: tuple[tuple[int, int], ...] = ()
    """transformers_release.ordered_loss_tensors: the same loss tensor by tensor in the release's
    order, run in place of loss_moments (empty: the moments)."""
    gathered: int = 0
    reduce: int = 0
    block_transient_buffers: int = 0
    block_backward_gradients: int = 0
    backward_end_buffers: int | None = None
    backward_end_gradients: int | None = None
    gather_stream: int = Stream.compute
    """The stream a unit's gather is on (FSDP's all-gather stream, or the compute stream)."""
    flat_step: bool = False
    """runs_flat_step: the step's gradients and temporaries whole, not per unit."""
    in_flight: int = 1
    """_in_flight_micro_batches: each block's saved tensors once per micro-batch in flight."""
    chunk_blocks: tuple[tuple[int, ...], ...] = ()
    """_in_flight_chunk_blocks: the in-flight chunks' blocks in forward order (empty: in_flight
    micro-batches through every block)."""
    stage1_2022: tuple | None = None
    """deepspeed_2022.step_allocations where the 2022 DeepSpeed's ZeRO stage-1 step runs: the
    16-bit gradients tensor by tensor and the step's allocations in their order; None elsewhere."""
    workspace_parts: tuple[int, ...] = ()
    """_workspace_parts: the tensors a block's backward workspace is made of (empty: the
    workspace whole)."""
    workspace_steps: tuple[int, ...] = ()
    """eager_softmax_workspace: the workspace as transformers' eager attention core makes and
    frees its tensors (empty: workspace_parts, allocated together)."""
    block_forward_steps: tuple[int, ...] = ()
    """eager_softmax_workspace: what a checkpointed block's first forward makes and frees
    beside its saved input (empty: nothing)."""
    loss_parallel: bool = False
    """The one loss moment is loss_parallel's (four fp32 local-logit tensors, then the units
    gathered beside them): run tensor by tensor as torch's handlers make them
    (fsdp_schedule.run_torchtitan_loss_parallel)."""
    loss_logits_held: bool = False
    """The bf16 logits the loss starts from are a pipeline stage's output, held with the
    activations (parallel.activations.pipeline_stage_output_bytes), not made and freed by it."""
    sequence_parallel: SublayerCollectives | None = None
    """fsdp_schedule.forward_collectives: each block's forward collectives, run in every
    micro-batch's forward (fsdp_schedule.run_sequence_parallel_forward)."""
    reduce_stream_copies: tuple[tuple[int, ...], ...] = ()
    """deepspeed_reduce_stream.flushes_by_block: the ipg bucket's flat copies each block's
    backward makes on DeepSpeed ZeRO-3's reduce stream, the last block first (empty: none)."""
    backward_end_reduce_copy: int = 0
    """deepspeed_reduce_stream.epilogue_copy_bytes: the part of backward_end_buffers that is
    DeepSpeed ZeRO-3's epilogue flat copy, made on its reduce stream (0: none there)."""
    overflow_check: int = 0
    """deepspeed_reduce_stream.overflow_check_bytes: fp16's overflow check's bool tensor, made
    twice on the reduce stream as the step starts (0: none)."""
    norm_copy: int = 0
    """deepspeed_stage3_step.norm_copy_bytes: DeepSpeed ZeRO-3's gradient norm's largest fp64
    copy, made and freed before the sub-groups' steps (0: none)."""
    sub_group_steps: tuple[tuple[int, int], ...] = ()
    """DeepSpeed ZeRO-3's step, sub-group by sub-group (zeroplan.core.deepspeed_stage3_step):
    each sub-group's flat gradient copy and fp32 cast, made and freed in turn in place of the
    whole gradient partition (stage3.py step; empty: the gradients whole)."""
    step_temporary_parts: tuple[int, ...] = ()
    """The step's temporaries tensor by tensor where the framework makes them one per parameter
    (megatron.megatron_step_temporary_parts; torch's foreach Adam/AdamW under per_parameter_tensors);
    empty: step_temporary in even parts per unit."""
    gradient_parts: tuple[int, ...] = ()
    """The gradients tensor by tensor where each parameter's is its own tensor
    (per_parameter_tensors); empty: gradient_bytes in even parts per unit."""
    gradients_kept: bool = False
    """ModelStateBytes.gradients_kept: the previous step's gradients, zeroed in place by a torch
    release before 2.0, are allocated before the forward and never freed."""
    step_keeps_backward_gradients: bool = False
    """DeepSpeed's stage 0 under 16 bits (zeroplan.core.deepspeed_stage0): the gradients backward
    ends with (backward_end_gradients) stay through the step beside the fp32 copies it reads
    (PeakTerms.step_gradients), freed by the zero_grad after it."""
    deepspeed_first_step: DeepSpeedFirstStep | None = None
    """zeroplan.allocator.deepspeed_first_step: DeepSpeed ZeRO-3's optimizer build, then two
    steps, the first making the optimizer's states (None: one step, every state allocated before it)."""
    checkpoint_save: SaveUnits | None = None
    """zeroplan.core.checkpoint_save.save_units: the checkpoint save after the step (hf under
    FSDP1), recorded after it (record_checkpoint_save); None where none is planned."""


def step_inputs(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> StepInputs:
    """What the request's step schedule reads (StepInputs)."""
    inputs = _step_inputs(request, states, terms)
    # The planner's forward moment does not count the eager scores' temporaries of a
    # checkpointed block's first forward: where they would lift the trace's requested peak past
    # the planner's allocated peak (or past the trace's own without them, where the FSDP
    # schedule's is above it already), the forward makes none (eager_softmax_workspace).
    if not inputs.block_forward_steps:
        return inputs
    peak = record_step(inputs).requested_peak_bytes
    if peak <= peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)[0]:
        return inputs
    without = replace(inputs, block_forward_steps=())
    return inputs if peak <= record_step(without).requested_peak_bytes else without


def _step_inputs(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> StepInputs:
    blocks = max(1, request.model.num_layers // request.parallel.pp)
    common = dict(blocks=blocks, accumulating=request.batch.grad_accum_steps > 1,
                  parameter_bytes=states.parameter_bytes, optimizer_state_bytes=states.optimizer_state_bytes,
                  gradient_bytes=states.gradient_bytes, resident_buffers=terms.resident_buffers,
                  accumulated_gradients=terms.accumulated_gradients,
                  backward_held_buffers=terms.backward_held_buffers,
                  draining_held_buffers=terms.draining_held_buffers, loss_held_buffers=terms.loss_held_buffers,
                  activations=terms.activations,
                  workspace=terms.workspace, step_temporary=terms.step_temporary,
                  block_weights=tuple(_block_tensor_weights(request)), gradients_kept=states.gradients_kept,
                  checkpoint_save=save_units(request))
    if fsdp_applies(request):
        fsdp = fsdp_step_inputs(request, terms)
        moments = () if fsdp.runs_own_loss else tuple(map(tuple, fsdp_loss_allocations(request, terms)))
        return StepInputs(**common, cache_parts=tuple(forward_cache_parts(request, fsdp.block_units)),
                          loss_moments=moments, fsdp=fsdp, workspace_parts=_workspace_parts(request, terms.workspace),
                          **_eager_steps(request, terms))
    gathered, reduce = _transient_parts(request, terms.transient_buffers)
    moments = tuple(map(tuple, loss_allocations(request, terms)))
    return StepInputs(**common, cache_parts=tuple(forward_cache_parts(request, blocks)),
                      loss_moments=moments, loss_order=_loss_order(request, moments), fsdp=None,
                      loss_parallel=_runs_loss_parallel(request, moments),
                      loss_logits_held=request.parallel.pp > 1,
                      gathered=gathered, reduce=reduce, block_transient_buffers=terms.block_transient_buffers,
                      block_backward_gradients=terms.block_backward_gradients,
                      backward_end_buffers=terms.backward_end_buffers,
                      backward_end_gradients=terms.backward_end_gradients,
                      step_keeps_backward_gradients=deepspeed_stage0.runs_deepspeed_stage0(request),
                      gather_stream=_gather_stream(request),
                      flat_step=runs_flat_step(request), in_flight=_in_flight_micro_batches(request),
                      chunk_blocks=_in_flight_chunk_blocks(request, blocks),
                      workspace_parts=_workspace_parts(request, terms.workspace),
                      **_eager_steps(request, terms),
                      sequence_parallel=forward_collectives(request, terms),
                      stage1_2022=deepspeed_2022.step_allocations(request) if deepspeed_2022.models_2022(request) else None,
                      sub_group_steps=deepspeed_stage3_step.sub_group_steps(request),
                      norm_copy=deepspeed_stage3_step.norm_copy_bytes(request),
                      reduce_stream_copies=_reduce_stream_copies(request, blocks),
                      overflow_check=deepspeed_reduce_stream.overflow_check_bytes(request),
                      backward_end_reduce_copy=_epilogue_reduce_copy(request, terms.backward_end_buffers),
                      deepspeed_first_step=first_step(request, states, terms),
                      **_per_parameter_parts(request, states, terms))


# stage3.py:1082-1084 at v0.14.2: the epilogue's flush is __reduce_and_partition_ipg_grads, in the
# reduce stream's context (:1265), as the backward's are (zeroplan.core.deepspeed_reduce_stream).
def _epilogue_reduce_copy(request: PlanRequest, backward_end_buffers: int | None) -> int:
    """StepInputs.backward_end_reduce_copy: the epilogue's flat copy where backward_end_buffers
    holds it (at most those buffers), else 0."""
    if backward_end_buffers is None or request.parallel.pp != 1:
        return 0
    return min(deepspeed_reduce_stream.epilogue_copy_bytes(request), backward_end_buffers)


# zeroplan.core.deepspeed_reduce_stream (stage3.py:1221-1265 at v0.14.2).
def _reduce_stream_copies(request: PlanRequest, blocks: int) -> tuple[tuple[int, ...], ...]:
    """StepInputs.reduce_stream_copies, where the blocks run once each (no pipeline)."""
    if request.parallel.pp != 1:
        return ()
    return deepspeed_reduce_stream.flushes_by_block(request, blocks)


# zeroplan.core.transformers_release.ordered_loss_tensors (4.40.0 modeling_llama.py:1227-1241).
def _loss_order(request: PlanRequest, moments: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """transformers_release.ordered_loss_tensors where the loss's moments are its tensors
    (the release's three: the forward's fp32 logits, shifted copy and log-softmax; the
    backward's log-softmax and two gradients; the slice's two), none of them held elsewhere
    (a loop keeping the output object, the KV cache); () otherwise."""
    if request.training.keep_outputs:
        return ()
    b, s = request.batch.micro_batch_size, request.batch.seq_len
    order = ordered_loss_tensors(request.model, request.training, s, b)
    if not order:
        return ()
    sizes = {LOSS_TENSORS[tensor]: size for tensor, size in order if size}
    logits, logprobs, nll, grad, sliced = (sizes[name] for name in ("logits32", "logprobs", "nll_grad", "logprobs_grad",
                                                                     "slice_grad"))
    if moments != ((logits, logprobs, logprobs), (logprobs, nll, grad), (grad, sliced)):
        return ()
    return order


# The same order as ordered_loss_tensors gives it (measured: cuda_autocast_loss_tensors.ordered_before_446).
def _run_loss_order(b: TraceBuilder, order: tuple[tuple[int, int], ...]) -> None:
    """StepInputs.loss_order: each tensor made and freed where the release does."""
    made: dict[int, list[int]] = {}
    for tensor, size in order:
        if size:
            made[tensor] = b.alloc(size)
        else:
            b.free(made.pop(tensor))


def _per_parameter_parts(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> dict[str, tuple[int, ...]]:
    """StepInputs.step_temporary_parts and gradient_parts: Megatron-LM's per-parameter fp32
    gradient copies; under per_parameter_tensors, one gradient per trainable tensor and torch's
    foreach Adam/AdamW lists, one output per stepped tensor."""
    if request.training.framework is Framework.megatron:
        from zeroplan.core.megatron import megatron_step_temporary_parts  # megatron's requests alone load it

        return {"step_temporary_parts": megatron_step_temporary_parts(request)}
    weights = _per_parameter_weights(request)
    if not weights:
        return {}
    parts = {"gradient_parts": tuple(split_bytes(states.gradient_bytes, weights))}
    adam = request.training.optimizer in (Optimizer.adam, Optimizer.adamw)
    if not adam or optimizer_loop(request) is not OptimizerLoop.foreach:
        return parts
    copies = foreach_step_copies(request)
    eb = trainable_element_bytes(request, element_bytes(request.training.precision, request.convention))
    # Only where the step's temporary is those lists alone (not, say, PEFT's copies beside them).
    if terms.step_temporary == copies * states.optimizer_elements * eb.optimizer_dtype:
        parts["step_temporary_parts"] = tuple(split_bytes(terms.step_temporary, weights * copies))
    return parts


# torch gives every parameter its own gradient tensor (autograd's AccumulateGrad, where the leaf
# has no .grad, steals the gradient it is handed or clones it: torch 2.13
# torch/csrc/autograd/functions/accumulate_grad.h:81-83 and 188-200), and a foreach op returns one
# output per input (torch 2.13 torch/optim/adam.py:790 exp_avg_sq_sqrt = torch._foreach_sqrt(...),
# a list): each is its own allocation, which a cached block the size of one of the backward's
# activations can hold, where one allocation per unit (a whole layer's gradient) cannot
# (tests/test_allocator_per_parameter.py measures both on the CPU). Under plain DDP or one GPU
# outside DeepSpeed's and Megatron's flat buffers, without tensor or pipeline parallelism and
# with the optimizer stepping after the backward.
def per_parameter_tensors(request: PlanRequest) -> bool:
    """Whether the step's gradients and foreach temporaries are made tensor by tensor."""
    training = request.training
    return (request.strategy.kind is StrategyKind.ddp and request.convention is not StateConvention.deepspeed
            and training.framework not in (Framework.megatron, Framework.megatron_deepspeed, Framework.fairseq)
            and not training.optimizer_in_backward and request.parallel.tp == 1 and request.parallel.pp == 1
            and not deepspeed_2022.models_2022(request))


def _per_parameter_weights(request: PlanRequest) -> list[int]:
    """The trainable tensors' elements in the rank's units' order (empty: per_parameter_tensors
    does not hold)."""
    if not per_parameter_tensors(request):
        return []
    return [tensor.numel for unit in rank_trainable_units(request) for tensor in unit.tensors if tensor.trainable]


def _eager_steps(request: PlanRequest, terms: PeakTerms) -> dict[str, tuple[int, ...]]:
    """StepInputs' block_forward_steps and workspace_steps (eager_softmax_workspace)."""
    forward, backward = eager_softmax_workspace(request, terms.workspace)
    return dict(block_forward_steps=forward, workspace_steps=backward)


# DeepSpeed ZeRO-3's coordinator gathers in its allgather stream's context (v0.13.3 and v0.14.0
# runtime/zero/partitioned_param_coordinator.py:303 and :460, 0.19.8 :400 and :606: `with
# get_accelerator().stream(self.__allgather_stream)` around all_gather_coalesced, which allocates the
# gathered buffer), a stream of its own where overlap_comm is on (parameter_offload.py:138-139 at
# v0.13.3, :195-196 at 0.19.8); the caching allocator keeps that stream's blocks apart. Hugging
# Face's DeepSpeed configs (accelerate's plugin) leave overlap_comm to DeepSpeed's default, on at
# stage 3 (deepspeed_accumulation.overlap_comm). DeepSpeed 0.13.3's own allocation sequence at the
# 70B LoRA row's sizes (benchmarks/deepspeed_zero3_allocator_replay.py --persistence-threshold 2047,
# the run whose persistent share of stage3_max_live_parameters is near the row's) reserves 60.2 GiB
# replayed with its gathers on that stream, 67.4 with them on the compute stream.
def _gather_stream(request: PlanRequest) -> int:
    """The stream a unit's gather allocates on: FSDP's all-gather stream, DeepSpeed ZeRO-3's
    allgather stream under the hf profile (overlap_comm on), else the compute stream."""
    kind = request.strategy.kind
    if kind.is_fsdp:
        return Stream.all_gather
    if deepspeed_one_rank.gathers_nothing(request):
        # One rank gathers nothing; what its units stand for is autograd's gradients, made on
        # the compute stream (zeroplan.core.deepspeed_one_rank).
        return Stream.compute
    if (kind.zero_stage == 3 and request.training.framework is Framework.hf
            and request.convention is StateConvention.deepspeed and overlap_comm(request)):
        return Stream.all_gather
    return Stream.compute


def _runs_loss_parallel(request: PlanRequest, moments: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the loss's one moment is loss_parallel's four fp32 local-logit tensors (bf16
    logits: their bf16 casts are half of one)."""
    if not loss_parallel_applies(request) or request.training.precision.compute_bytes != 2 or len(moments) != 1:
        return False
    moment = moments[0]
    return len(moment) >= 4 and len(set(moment[:4])) == 1 and moment[0] % FP32_BYTES == 0 and moment[0] > 0


def step_trace(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> AllocationTrace:
    """One training step's allocations and frees, from the planner's terms for ``request``
    (zeroplan.core.plan.peak_terms: passed in, so the planner can call this without a cycle)."""
    framework = request.training.framework.value
    inputs = step_inputs(request, states, terms)
    units = ", FSDP2 units" if inputs.fsdp is not None else ""
    return record_step(inputs).trace(f"planner schedule ({framework}{units})")


def step_ops(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> Ops:
    """step_trace compiled for replay (replay.compile_trace's ops), without building its typed
    events: what the planner replays on every fit."""
    return record_step(step_inputs(request, states, terms)).ops


def record_step(x: StepInputs) -> TraceBuilder:
    """The builder holding the step's allocations and frees (with the peaks it counted while
    recording them), from its inputs alone; a checkpoint save after it where one is planned."""
    b = TraceBuilder()
    if x.fsdp is not None:
        record_fsdp_step(x, x.fsdp, b)
    else:
        _record_step(x, b)
    record_checkpoint_save(b, x.checkpoint_save)
    return b


def _record_step(x: StepInputs, b: TraceBuilder) -> None:
    """record_step's schedule outside FSDP2 full sharding."""
    if x.deepspeed_first_step is not None:
        # DeepSpeed ZeRO-3's optimizer build, then its first step, which makes the optimizer's
        # states, and a second step (zeroplan.allocator.deepspeed_first_step).
        record_constructed_states(b, x.deepspeed_first_step)
        _record_step_body(x, b, x.deepspeed_first_step.lazy_states)
        _record_step_body(x, b, ())
        return
    # Between steps: parameters and optimizer states per unit (the blocks and the rest).
    b.alloc_parts(even_parts(x.parameter_bytes, x.blocks + 1))
    b.alloc_parts(even_parts(x.optimizer_state_bytes, x.blocks + 1))
    b.alloc(x.resident_buffers)
    # What the previous step made on DeepSpeed ZeRO-3's reduce stream stays cached there into
    # this one (neither DeepSpeed 0.14.2's step nor transformers 4.40's Trainer calls
    # empty_cache): its flat copies and overflow checks, made and freed in their order.
    for copies in x.reduce_stream_copies:
        for size in copies:
            b.free(b.alloc(size, Stream.reduce_scatter))
    _overflow_check(x, b)
    _record_step_body(x, b, ())


def _record_step_body(x: StepInputs, b: TraceBuilder, lazy_states: tuple[tuple[int, ...], ...]) -> None:
    """One step from its first micro-batch's start, the states allocated; ``lazy_states``: the
    optimizer states its DeepSpeed ZeRO-3 step makes, per sub-group (empty: none)."""
    blocks, accumulating = x.blocks, x.accumulating
    gathered, reduce = x.gathered, x.reduce
    gather_stream = x.gather_stream
    # With accumulation, what the earlier micro-batches left (the gradients, or under DeepSpeed's
    # convention its own buffers: PeakTerms.accumulated_gradients) is there from the start.
    carried = x.gradient_bytes if x.accumulated_gradients is None else x.accumulated_gradients
    grads_2022 = x.stage1_2022[0] if x.stage1_2022 is not None else None
    # The 2022 ZeRO stage 1 keeps every 16-bit .grad as its own tensor (deepspeed_2022.step_allocations).
    carried_parts = list(grads_2022) if grads_2022 is not None else (
        list(x.gradient_parts) if x.gradient_parts and carried == x.gradient_bytes else even_parts(carried, blocks + 1))
    # Before torch 2.0 zero_grad() zeroes them in place: the first step's backward made them, one
    # tensor per parameter, and each later step finds them allocated (StepInputs.gradients_kept).
    gradients = b.alloc_parts(carried_parts) if accumulating or x.gradients_kept else []
    held = b.alloc(x.backward_held_buffers - x.draining_held_buffers)
    # FSDP's no_sync unsharded gradients: whole through a micro-batch's backward, they give way
    # to the gradient shards the last one's reduce-scatters make.
    draining = b.alloc(x.draining_held_buffers)

    # Forward: each block's unit gathered, its activations saved, the unit freed. A block holds
    # no more than block_transient_buffers (0 where the only buffer is an all-reduce after the
    # backward: Megatron-DeepSpeed's BF16_Optimizer, zeroplan.core.buffers).
    at_end = gathered
    gathered = min(gathered, x.block_transient_buffers)
    # Under a pipeline each in-flight micro-batch's forward saves its own tensors in every
    # block, the earliest micro-batch first (_in_flight_micro_batches).
    # An interleaved schedule's chunks each run one stage's blocks (_in_flight_chunk_blocks).
    chunks = x.chunk_blocks or tuple(tuple(range(len(x.cache_parts))) for _ in range(x.in_flight))
    per_block, outside = divmod(x.activations, sum(len(chunk) for chunk in chunks))
    weights = list(x.block_weights)
    outside_ids = b.alloc(outside)
    saved: list[list[list[int]]] = []
    cache: list[int] = []
    cached: set[int] = set()
    block_parts = split_bytes(per_block, weights)
    for chunk in chunks:
        saved.append([])
        for block in chunk:
            b.mark()
            unit = b.alloc(gathered, gather_stream)
            saved[-1].append(b.alloc_parts(block_parts))
            b.free(record_workspace(b, x.block_forward_steps))
            if block not in cached:
                cached.add(block)
                cache += b.alloc_parts(list(x.cache_parts[block]))
            run_sequence_parallel_forward(b, x.sequence_parallel)
            b.free(unit)
    b.mark()

    # The loss: each of its moments in turn (the reference model's: three fp32 sbV tensors);
    # loss_parallel's tensor by tensor, the units its moment holds gathered around it.
    if x.loss_parallel:
        (moment,) = x.loss_moments
        around = b.alloc_parts(list(moment[4:]))
        b.free(run_torchtitan_loss_parallel(b, (moment[0] // 2, moment[0]), [], lambda: None,
                                            logits_held=x.loss_logits_held))
        b.free(around)
    else:
        # DeepSpeed ZeRO-3's parameters still gathered from the forward (PeakTerms.loss_held_buffers),
        # released in the backward: freed with the loss here, before the blocks' gathers.
        around = b.alloc(x.loss_held_buffers, x.gather_stream)
        if x.loss_order:
            _run_loss_order(b, x.loss_order)
        else:
            run_loss(x.loss_moments, b, cache)
        b.free(around)

    # Backward, last block first: unit gathered and reduce buffer, the workspace (and the
    # recomputed block) while the block's gradients are computed, then its activations freed.
    # Gradients a framework leaves unreduced from before the blocks are there from the first
    # (PeakTerms.block_backward_gradients: DeepSpeed ZeRO-1's).
    # Under a pipeline the micro-batches' backwards run in turn, the earliest first (1F1B's
    # cool-down; in its steady state a forward between two backwards reuses what one freed).
    early = b.alloc(x.block_backward_gradients)
    workspace = list(x.workspace_parts) or [x.workspace]
    # Interleaved: the head stage's chunk, whose loss just ran, goes back first.
    order = list(range(len(chunks)))
    if x.chunk_blocks:
        order = order[-1:] + order[:-1]
    for index in order:
        for position in reversed(range(len(chunks[index]))):
            unit = b.alloc(gathered, gather_stream)
            reducing = b.alloc(reduce, Stream.reduce_scatter)
            run_sequence_parallel_recompute(b, x.sequence_parallel)
            b.free(record_workspace(b, x.workspace_steps) if x.workspace_steps else b.alloc_parts(workspace))
            # DeepSpeed ZeRO-3's bucket flushes in this block's backward, each flat copy made and
            # freed on the reduce stream (after the workspace here: the planner's backward moment
            # does not count them).
            if x.reduce_stream_copies:
                for size in x.reduce_stream_copies[len(chunks[index]) - 1 - position]:
                    b.free(b.alloc(size, Stream.reduce_scatter))
            b.free(saved[index][position])
            b.free(unit + reducing)
    b.free(outside_ids)
    b.free(early)

    if x.stage1_2022 is not None:
        _record_2022_step(x, b, gradients, held + draining)
        return

    # End of backward: the planner's gradients arrive once the activations are gone, beside the
    # last unit's buffers, or the last reduction's own buffers and gradients where it is modelled
    # tensor by tensor (PeakTerms.backward_end_buffers, backward_end_gradients).
    if x.backward_end_buffers is None:
        unit = b.alloc(at_end, gather_stream) + b.alloc(reduce, Stream.reduce_scatter)
    else:
        # DeepSpeed ZeRO-3's epilogue flat copy on its reduce stream, the rest on the compute stream.
        unit = (b.alloc(x.backward_end_buffers - x.backward_end_reduce_copy)
                + b.alloc(x.backward_end_reduce_copy, Stream.reduce_scatter))
    if accumulating and carried != x.gradient_bytes:
        # DeepSpeed's micro-step buffers give way to the gradient the step takes (peak.py's
        # end-of-backward moment counts the gradients alone).
        b.free(gradients)
        gradients = []
    ending = x.backward_end_gradients
    ended: list[int] = []
    if ending is not None and ending != x.gradient_bytes:
        # DeepSpeed's: what backward ends with is not the gradient the step takes.
        b.free(gradients)
        gradients = []
        ended = b.alloc_parts(even_parts(ending, blocks + 1))
        if not x.step_keeps_backward_gradients:
            b.free(ended)
            ended = []
        b.free(unit)
        unit = []
    b.free(draining)
    # DeepSpeed's ZeRO-1/2 step reads one flat fp32 gradient partition and makes its temporaries
    # (the norm's fp64 copy of one gradient, an optimizer temporary over the flat partition) one
    # tensor at a time (zeroplan.core.deepspeed_step): whole tensors here, not per-unit parts.
    parts = 1 if x.flat_step else blocks + 1
    if x.sub_group_steps:
        b.free(gradients + unit + held)
        _overflow_check(x, b)
        # The norm's fp64 copies, one gradient partition at a time: the largest's.
        b.free(b.alloc(x.norm_copy))
        for group, (flat_bytes, cast_bytes) in enumerate(x.sub_group_steps):
            flat = b.alloc(flat_bytes)
            cast = b.alloc(cast_bytes)
            b.free(flat)
            # The first step's optimizer states, made as it steps this sub-group (deepspeed_first_step).
            if lazy_states:
                b.alloc_parts(list(lazy_states[group]))
            b.free(b.alloc(x.step_temporary))
            b.free(cast)
        return
    if not gradients:
        gradients = b.alloc_parts(list(x.gradient_parts) or even_parts(x.gradient_bytes, parts))
    b.free(unit)
    b.free(held)

    _overflow_check(x, b)
    # Optimizer step: its temporaries per unit, then the gradients go (set_to_none), or stay
    # for the next step where zero_grad() zeroes them.
    b.free(b.alloc_parts(list(x.step_temporary_parts) or even_parts(x.step_temporary, parts)))
    if not x.gradients_kept:
        b.free(gradients)
    b.free(ended)


# stage3.py:2138-2143 at v0.14.2: isinf's bool tensor freed by .any() before isnan's is made.
def _overflow_check(x: StepInputs, b: TraceBuilder) -> None:
    """StepInputs.overflow_check: isinf's bool tensor, then isnan's, on the reduce stream."""
    for _ in range(2 if x.overflow_check else 0):
        b.free(b.alloc(x.overflow_check, Stream.reduce_scatter))


# zeroplan.core.deepspeed_2022.step_allocations: the reduction's flat bucket copy after backward
# (backward_end_buffers, reduce_copy_bytes), the epilogue's zero_grad freeing the gradients
# outside the partition, then the step's copies in their order, each its own allocation.
def _record_2022_step(x: StepInputs, b: TraceBuilder, gradients: list[int], held: list[int]) -> None:
    """The end of backward and the step of the 2022 DeepSpeed's ZeRO stage 1."""
    grads, kept, group_kept, groups = x.stage1_2022
    if not gradients:
        # Without accumulation the one backward makes them.
        gradients = b.alloc_parts(list(grads))
    b.free(b.alloc(x.backward_end_buffers or 0))
    keep = set(kept)
    b.free([ident for i, ident in enumerate(gradients) if i not in keep])
    b.free(held)
    for _, _, pieces in groups:
        for piece in pieces:
            b.free(b.alloc(deepspeed_2022.OVERFLOW_COPY_BYTES * piece))
    partitions: list[int] = []
    for (flat_bytes, fp32_bytes, pieces), members in zip(groups, group_kept):
        for piece in pieces:
            b.free(b.alloc(NORM_COPY_BYTES * piece))
        flat = b.alloc(flat_bytes)
        partitions += b.alloc(fp32_bytes)
        b.free(flat)
        b.free([gradients[i] for i in members])
    b.free(partitions)
