"""A step's allocation trace generated from the planner's own terms for one request (where no
measured run gives one), in step order: model states and resident buffers first, then per
block its gathered unit and saved activations (forward), the loss's tensors, per block in
reverse its gathered unit, reduce buffer and workspace while its activations are freed
(backward), the gradients, the optimizer step's temporaries. Its requested peak equals the
planner's allocated peak (zeroplan.core.plan.peak_allocated_bytes): the trace realises each of
the planner's four moments and nothing larger. docs/memory-model.md, "The caching allocator",
lists what it approximates."""

from __future__ import annotations


from zeroplan.allocator.builder import TraceBuilder, even_parts, split_bytes
from zeroplan.allocator.fsdp_schedule import applies as fsdp_applies
from zeroplan.allocator.fsdp_schedule import forward_cache_parts, record_fsdp_step, run_loss
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


def step_trace(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> AllocationTrace:
    """One training step's allocations and frees, from the planner's terms for ``request``
    (zeroplan.core.plan.peak_terms: passed in, so the planner can call this without a cycle)."""
    builder, source = _recorded_step(request, states, terms)
    return builder.trace(source)


def step_ops(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> Ops:
    """step_trace compiled for replay (replay.compile_trace's ops), without building its typed
    events: what the planner replays on every fit."""
    return _recorded_step(request, states, terms)[0].ops


def step_builder(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> TraceBuilder:
    """The builder holding step_ops, with the peaks it counted while recording them."""
    return _recorded_step(request, states, terms)[0]


def _recorded_step(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> tuple[TraceBuilder, str]:
    """The builder holding the step's allocations and frees, and the trace's source."""
    blocks = max(1, request.model.num_layers // request.parallel.pp)
    accumulating = request.batch.grad_accum_steps > 1
    fsdp = request.strategy.kind.is_fsdp
    gathered, reduce = _transient_parts(request, terms.transient_buffers)
    gather_stream = Stream.all_gather if fsdp else Stream.compute
    b = TraceBuilder()
    framework = request.training.framework.value
    if fsdp_applies(request):
        record_fsdp_step(request, states, terms, b, _block_tensor_weights(request), blocks)
        return b, f"planner schedule ({framework}, FSDP2 units)"

    # Between steps: parameters and optimizer states per unit (the blocks and the rest).
    b.alloc_parts(even_parts(states.parameter_bytes, blocks + 1))
    b.alloc_parts(even_parts(states.optimizer_state_bytes, blocks + 1))
    b.alloc(terms.resident_buffers)
    # With accumulation, what the earlier micro-batches left (the gradients, or under DeepSpeed's
    # convention its own buffers: PeakTerms.accumulated_gradients) is there from the start.
    carried = states.gradient_bytes if terms.accumulated_gradients is None else terms.accumulated_gradients
    gradients = b.alloc_parts(even_parts(carried, blocks + 1)) if accumulating else []
    held = b.alloc(terms.backward_held_buffers - terms.draining_held_buffers)
    # FSDP's no_sync unsharded gradients: whole through a micro-batch's backward, they give way
    # to the gradient shards the last one's reduce-scatters make.
    draining = b.alloc(terms.draining_held_buffers)

    # Forward: each block's unit gathered, its activations saved, the unit freed. A block holds
    # no more than block_transient_buffers (0 where the only buffer is an all-reduce after the
    # backward: Megatron-DeepSpeed's BF16_Optimizer, zeroplan.core.buffers).
    at_end = gathered
    gathered = min(gathered, terms.block_transient_buffers)
    per_block, outside = divmod(terms.activations, blocks)
    weights = _block_tensor_weights(request)
    outside_ids = b.alloc(outside)
    saved: list[list[int]] = []
    cache: list[int] = []
    for parts in forward_cache_parts(request, blocks):
        unit = b.alloc(gathered, gather_stream)
        saved.append(b.alloc_parts(split_bytes(per_block, weights)))
        cache += b.alloc_parts(list(parts))
        b.free(unit)

    # The loss: each of its moments in turn (the reference model's: three fp32 sbV tensors).
    run_loss(request, terms, b, cache)

    # Backward, last block first: unit gathered and reduce buffer, the workspace (and the
    # recomputed block) while the block's gradients are computed, then its activations freed.
    # Gradients a framework leaves unreduced from before the blocks are there from the first
    # (PeakTerms.block_backward_gradients: DeepSpeed ZeRO-1's).
    early = b.alloc(terms.block_backward_gradients)
    for block in reversed(range(blocks)):
        unit = b.alloc(gathered, gather_stream)
        reducing = b.alloc(reduce, Stream.reduce_scatter)
        b.free(b.alloc(terms.workspace))
        b.free(saved[block])
        b.free(unit + reducing)
    b.free(outside_ids)
    b.free(early)

    # End of backward: the planner's gradients arrive once the activations are gone, beside the
    # last unit's buffers, or the last reduction's own buffers and gradients where it is modelled
    # tensor by tensor (PeakTerms.backward_end_buffers, backward_end_gradients).
    if terms.backward_end_buffers is None:
        unit = b.alloc(at_end, gather_stream) + b.alloc(reduce, Stream.reduce_scatter)
    else:
        unit = b.alloc(terms.backward_end_buffers)
    if accumulating and carried != states.gradient_bytes:
        # DeepSpeed's micro-step buffers give way to the gradient the step takes (peak.py's
        # end-of-backward moment counts the gradients alone).
        b.free(gradients)
        gradients = []
    ending = terms.backward_end_gradients
    if ending is not None and ending != states.gradient_bytes:
        # DeepSpeed's: what backward ends with is not the gradient the step takes.
        b.free(gradients)
        gradients = []
        b.free(b.alloc_parts(even_parts(ending, blocks + 1)) + unit)
        unit = []
    b.free(draining)
    # DeepSpeed's ZeRO-1/2 step reads one flat fp32 gradient partition and makes its temporaries
    # (the norm's fp64 copy of one gradient, an optimizer temporary over the flat partition) one
    # tensor at a time (zeroplan.core.deepspeed_step): whole tensors here, not per-unit parts.
    parts = 1 if runs_flat_step(request) else blocks + 1
    if not gradients:
        gradients = b.alloc_parts(even_parts(states.gradient_bytes, parts))
    b.free(unit)
    b.free(held)

    # Optimizer step: its temporaries per unit, then the gradients go (set_to_none).
    b.free(b.alloc_parts(even_parts(terms.step_temporary, parts)))
    b.free(gradients)
    return b, f"planner schedule ({framework})"
