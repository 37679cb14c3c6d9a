"""A step's allocation trace generated from the planner's own terms for one request (where no
measured run gives one), in step order: model states and resident buffers first, then per
block its gathered unit and saved activations (forward), the loss's tensors, per block in
reverse its gathered unit, reduce buffer and workspace while its activations are freed
(backward), the gradients, the optimizer step's temporaries. Its requested peak equals the
planner's allocated peak (zeroplan.core.plan.peak_allocated_bytes): the trace realises each of
the planner's four moments and nothing larger. docs/memory-model.md, "The caching allocator",
lists what it approximates."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.allocator.builder import TraceBuilder, even_parts, split_bytes
from zeroplan.allocator.fsdp_schedule import applies as fsdp_applies
from zeroplan.allocator.fsdp_schedule import (FsdpStepInputs, forward_cache_parts, fsdp_loss_allocations, fsdp_step_inputs, loss_allocations,
                                              record_fsdp_step, run_loss)
from zeroplan.allocator.replay import Ops
from zeroplan.allocator.trace import AllocationTrace, Stream
from zeroplan.core.activations import layer_terms
from zeroplan.core.deepspeed_step import runs_flat_step
from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.layout import gradient_wire_bytes
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms



def _block_tensor_weights(request: PlanRequest) -> list[int]:
    """The tensors one block saves, as the planner's layer terms (one tensor each); under full
    recomputation the block keeps only its input."""
    model, training, batch = request.model, request.training, request.batch
    if training.activation_checkpointing is ActivationCheckpointing.full:
        return [1]
    terms = layer_terms(model, training, batch.seq_len, batch.micro_batch_size, autocast=request.runs_under_autocast)
    weights = [value for value in terms.values() if value > 0]
    return weights or [1]


def _transient_parts(request: PlanRequest, transient: int) -> tuple[int, int]:
    """(gathered unit on the all-gather stream, reduce buffer on the reduce-scatter stream) for
    FSDP; the whole term on the compute stream otherwise (returned as the first)."""
    if not request.strategy.kind.is_fsdp:
        return transient, 0
    reduce = min(transient, largest_unit_elements(request) * gradient_wire_bytes(request))
    return transient - reduce, reduce


@dataclass(frozen=True, slots=True)
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


def step_inputs(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> StepInputs:
    """What the request's step schedule reads (StepInputs)."""
    blocks = max(1, request.model.num_layers // request.parallel.pp)
    common = dict(blocks=blocks, accumulating=request.batch.grad_accum_steps > 1,
                  parameter_bytes=states.parameter_bytes, optimizer_state_bytes=states.optimizer_state_bytes,
                  gradient_bytes=states.gradient_bytes, resident_buffers=terms.resident_buffers,
                  accumulated_gradients=terms.accumulated_gradients,
                  backward_held_buffers=terms.backward_held_buffers,
                  draining_held_buffers=terms.draining_held_buffers, activations=terms.activations,
                  workspace=terms.workspace, step_temporary=terms.step_temporary,
                  block_weights=tuple(_block_tensor_weights(request)))
    if fsdp_applies(request):
        fsdp = fsdp_step_inputs(request, terms)
        moments = () if fsdp.runs_own_loss else tuple(map(tuple, fsdp_loss_allocations(request, terms)))
        return StepInputs(**common, cache_parts=tuple(forward_cache_parts(request, fsdp.block_units)),
                          loss_moments=moments, fsdp=fsdp)
    gathered, reduce = _transient_parts(request, terms.transient_buffers)
    return StepInputs(**common, cache_parts=tuple(forward_cache_parts(request, blocks)),
                      loss_moments=tuple(map(tuple, loss_allocations(request, terms))), fsdp=None,
                      gathered=gathered, reduce=reduce, block_transient_buffers=terms.block_transient_buffers,
                      block_backward_gradients=terms.block_backward_gradients,
                      backward_end_buffers=terms.backward_end_buffers,
                      backward_end_gradients=terms.backward_end_gradients,
                      gather_stream=Stream.all_gather if request.strategy.kind.is_fsdp else Stream.compute,
                      flat_step=runs_flat_step(request))


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
    recording them), from its inputs alone."""
    b = TraceBuilder()
    if x.fsdp is not None:
        record_fsdp_step(x, x.fsdp, b)
        return b
    blocks, accumulating = x.blocks, x.accumulating
    gathered, reduce = x.gathered, x.reduce
    gather_stream = x.gather_stream

    # Between steps: parameters and optimizer states per unit (the blocks and the rest).
    b.alloc_parts(even_parts(x.parameter_bytes, blocks + 1))
    b.alloc_parts(even_parts(x.optimizer_state_bytes, blocks + 1))
    b.alloc(x.resident_buffers)
    # With accumulation, what the earlier micro-batches left (the gradients, or under DeepSpeed's
    # convention its own buffers: PeakTerms.accumulated_gradients) is there from the start.
    carried = x.gradient_bytes if x.accumulated_gradients is None else x.accumulated_gradients
    gradients = b.alloc_parts(even_parts(carried, blocks + 1)) if accumulating else []
    held = b.alloc(x.backward_held_buffers - x.draining_held_buffers)
    # FSDP's no_sync unsharded gradients: whole through a micro-batch's backward, they give way
    # to the gradient shards the last one's reduce-scatters make.
    draining = b.alloc(x.draining_held_buffers)

    # Forward: each block's unit gathered, its activations saved, the unit freed. A block holds
    # no more than block_transient_buffers (0 where the only buffer is an all-reduce after the
    # backward: Megatron-DeepSpeed's BF16_Optimizer, zeroplan.core.buffers).
    at_end = gathered
    gathered = min(gathered, x.block_transient_buffers)
    per_block, outside = divmod(x.activations, blocks)
    weights = list(x.block_weights)
    outside_ids = b.alloc(outside)
    saved: list[list[int]] = []
    cache: list[int] = []
    block_parts = split_bytes(per_block, weights)
    for parts in x.cache_parts:
        b.mark()
        unit = b.alloc(gathered, gather_stream)
        saved.append(b.alloc_parts(block_parts))
        cache += b.alloc_parts(list(parts))
        b.free(unit)
    b.mark()

    # The loss: each of its moments in turn (the reference model's: three fp32 sbV tensors).
    run_loss(x.loss_moments, b, cache)

    # Backward, last block first: unit gathered and reduce buffer, the workspace (and the
    # recomputed block) while the block's gradients are computed, then its activations freed.
    # Gradients a framework leaves unreduced from before the blocks are there from the first
    # (PeakTerms.block_backward_gradients: DeepSpeed ZeRO-1's).
    early = b.alloc(x.block_backward_gradients)
    for block in reversed(range(blocks)):
        unit = b.alloc(gathered, gather_stream)
        reducing = b.alloc(reduce, Stream.reduce_scatter)
        b.free(b.alloc(x.workspace))
        b.free(saved[block])
        b.free(unit + reducing)
    b.free(outside_ids)
    b.free(early)

    # End of backward: the planner's gradients arrive once the activations are gone, beside the
    # last unit's buffers, or the last reduction's own buffers and gradients where it is modelled
    # tensor by tensor (PeakTerms.backward_end_buffers, backward_end_gradients).
    if x.backward_end_buffers is None:
        unit = b.alloc(at_end, gather_stream) + b.alloc(reduce, Stream.reduce_scatter)
    else:
        unit = b.alloc(x.backward_end_buffers)
    if accumulating and carried != x.gradient_bytes:
        # DeepSpeed's micro-step buffers give way to the gradient the step takes (peak.py's
        # end-of-backward moment counts the gradients alone).
        b.free(gradients)
        gradients = []
    ending = x.backward_end_gradients
    if ending is not None and ending != x.gradient_bytes:
        # DeepSpeed's: what backward ends with is not the gradient the step takes.
        b.free(gradients)
        gradients = []
        b.free(b.alloc_parts(even_parts(ending, blocks + 1)) + unit)
        unit = []
    b.free(draining)
    # DeepSpeed's ZeRO-1/2 step reads one flat fp32 gradient partition and makes its temporaries
    # (the norm's fp64 copy of one gradient, an optimizer temporary over the flat partition) one
    # tensor at a time (zeroplan.core.deepspeed_step): whole tensors here, not per-unit parts.
    parts = 1 if x.flat_step else blocks + 1
    if not gradients:
        gradients = b.alloc_parts(even_parts(x.gradient_bytes, parts))
    b.free(unit)
    b.free(held)

    # Optimizer step: its temporaries per unit, then the gradients go (set_to_none).
    b.free(b.alloc_parts(even_parts(x.step_temporary, parts)))
    b.free(gradients)
    return b
