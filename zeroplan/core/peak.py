"""The moments of a step whose live bytes set the allocated peak (docs/memory-model.md,
"Peak"): the terms they combine, each moment's bytes, and the largest. Formulas only: the
planner (zeroplan.core.plan), the allocator's schedule and the plan search all read these."""

from __future__ import annotations

import operator
from dataclasses import replace

from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.record import frozen
from zeroplan.results import PeakMoment


# docs/memory-model.md, "Peak": five moments of a step, each what is alive at once.
# Loss backward: all activations, the loss's three fp32 sbV tensors and the buffers kept
# through backward, with what DeepSpeed's ZeRO-3 keeps gathered from the forward (loss_held_buffers). A block's backward: activations (at the first block, nearly all), the
# unit being gathered or reduced and the residual-stream workspace. End of backward: every
# gradient and the last unit's buffers. Optimizer step: gradients and step temporaries. With
# accumulation the earlier micro-batches' gradients are there from the start (what DeepSpeed keeps
# between micro-steps under its state convention: PeakTerms.accumulated_gradients). With the
# optimizer in backward (torchtune) no gradient outlives its parameter's step: none at the end
# of backward, and the step moment is the largest single parameter's (model_state_bytes,
# optimizer_in_backward_step_bytes). A gradient buffer allocated once (megatron-core's) is alive
# at all four. Where the last reduction of backward is known tensor by tensor (FSDP2 full
# sharding's last unit, DeepSpeed ZeRO-3's gradient epilogue, ZeRO-1's reduction after backward)
# its own buffers and the gradients alive then replace the generic end of backward
# (PeakTerms.backward_end_buffers/_gradients); gradients a framework leaves unreduced from before
# the blocks (DeepSpeed ZeRO-1/2's) are alive at a block's backward (block_backward_gradients).
# Under FSDP's no_sync accumulation the micro-batches carry the held unsharded gradients and no
# shard (accumulated_gradients 0): every micro-batch but the last ends its backward so, beside its
# last unit's buffers, and the last turns them into the shards (backward_end_gradients: what the
# shards add beyond them, 0 from two ranks on). Where a
# strategy reduces each unit's gradient to its shard as that unit's backward ends (FSDP full
# sharding, HSDP), the first layer's backward, the last block's to run, holds the same units and
# workspace as a block's but one block's activations (and what the blocks leave outside) and the
# shards of every unit whose backward ran before it (PeakTerms.first_layer_gradients).
def peak_moments(states: ModelStateBytes, moments: PeakTerms, grad_accum_steps: int) -> dict[PeakMoment, MomentBytes]:
    """Every moment's live bytes, split into gradients, buffers (and workspace) and the rest."""
    return peak_moments_and_block_pieces(states, moments, grad_accum_steps)[0]


def peak_moments_and_block_pieces(states: ModelStateBytes, moments: PeakTerms, grad_accum_steps: int) -> tuple[
        dict[PeakMoment, MomentBytes], tuple[MomentBytes, ...]]:
    """peak_moments, and the block's backward in its pieces (block_pieces) it chose from; the
    checkpoint save among them only where one is planned (PeakTerms.checkpoint_save)."""
    loss, blocks, first_layer, backward_end, step = _moment_pieces(states, moments, grad_accum_steps)
    alive = {
        PeakMoment.loss_backward: loss,
        PeakMoment.block_backward: max(blocks, key=_TOTAL),
        PeakMoment.first_layer_backward: max(first_layer, key=_TOTAL),
        PeakMoment.backward_end: backward_end,
        PeakMoment.optimizer_step: step,
    }
    if moments.checkpoint_save:
        alive[PeakMoment.checkpoint_save] = save_moment(states, moments)
    return alive, blocks


# zeroplan.core.checkpoint_save: the save runs after the step, whose zero_grad (set_to_none) has
# dropped the gradients (kept only where they are never freed: a resident buffer, or a torch
# before 2.0 zeroing them in place), its activations and temporaries freed; the resident buffers
# stay, and the save's units and chunks join them.
def save_moment(states: ModelStateBytes, moments: PeakTerms) -> MomentBytes:
    """The checkpoint save's live bytes (0 where none is planned)."""
    if not moments.checkpoint_save:
        return MomentBytes(0, 0, 0)
    gradients = states.gradient_bytes if states.gradients_resident or states.gradients_kept else 0
    return MomentBytes(states.parameter_bytes + states.optimizer_state_bytes, gradients,
                       moments.resident_buffers + moments.checkpoint_save)


def _moment_pieces(states: ModelStateBytes, moments: PeakTerms, grad_accum_steps: int) -> tuple[
        MomentBytes, tuple[MomentBytes, ...], tuple[MomentBytes, ...], MomentBytes, MomentBytes]:
    """The loss's backward, a block's backward in its pieces, the first layer's in its pieces,
    the backward's end and the optimizer step: what peak_moments and moment_totals both read."""
    accumulated, resident, held = backward_bases(states, moments, grad_accum_steps)
    backward_end_buffers = moments.transient_buffers if moments.backward_end_buffers is None else moments.backward_end_buffers
    backward_end_gradients = states.gradient_bytes if moments.backward_end_gradients is None else moments.backward_end_gradients
    return (MomentBytes(resident + moments.activations + moments.logits, accumulated, held + moments.loss_held_buffers),
            block_pieces(moments, accumulated, resident, held),
            first_layer_pieces(moments, accumulated, resident, held),
            MomentBytes(resident, backward_end_gradients, held + backward_end_buffers),
            MomentBytes(resident + moments.step_temporary,
                        states.gradient_bytes if moments.step_gradients is None else moments.step_gradients,
                        moments.resident_buffers))


def backward_bases(states: ModelStateBytes, moments: PeakTerms, grad_accum_steps: int) -> tuple[int, int, int]:
    """(the gradients carried from earlier micro-batches, the resident model states, the buffers
    held through backward): what every moment of backward starts from."""
    resident = states.parameter_bytes + states.optimizer_state_bytes
    held = moments.resident_buffers + moments.backward_held_buffers
    carried = states.gradient_bytes if moments.accumulated_gradients is None else moments.accumulated_gradients
    # megatron-core's gradient buffer is there from the first step on (gradients_resident), and
    # so are the gradients a torch release before 2.0 zeroes in place (gradients_kept).
    accumulated = carried if grad_accum_steps > 1 or states.gradients_resident or states.gradients_kept else 0
    return accumulated, resident, held


# docs/memory-model.md, "Peak": a block's backward holds its units beside its workspace, and,
# before the workspace is made or once it is freed, beside the prefetched block's flat all-gather
# buffer or its own unsharded gradients (PeakTerms.block_copy_buffers): two pieces, each affine in
# the micro-batch, as the plan search's bounds take every moment.
# The root's gathering again for the backward (PeakTerms.root_gather_buffers) comes before any
# block's, with the same activations and gradients, and where its pre-backward hook waits for
# the logits' gradient, with that gradient (PeakTerms.root_gather_after_loss): a third piece.
def block_pieces(moments: PeakTerms, accumulated: int, resident: int, held: int) -> tuple[MomentBytes, ...]:
    """A block's backward in its pieces: its units with its workspace, with its copy buffers
    (PeakTerms.block_copy_buffers), and the root gathered again before it (root_gather_buffers)."""
    other, gradients = resident + moments.activations, accumulated + moments.block_backward_gradients
    units = held + moments.block_transient_buffers
    return (MomentBytes(other, gradients, units + moments.workspace),
            MomentBytes(other, gradients, units + moments.block_copy_buffers),
            MomentBytes(other + (moments.logits_gradient if moments.root_gather_after_loss else 0), gradients,
                        held + moments.root_gather_buffers))


# docs/memory-model.md, "Peak": the first layer's backward, from its all-gather (prefetched while
# the second layer's backward runs) to its gradients' reduction. The step's trace splits the
# activations into one share per block and a remainder outside them (allocator/fsdp_schedule.py
# record_fsdp_step: divmod(activations, blocks)); every block after the first two has freed its
# share by the first layer's all-gather, every block after the first by its backward. The
# remainder (less than ``blocks`` bytes) is taken at its most, so that every piece grows with the
# activations, as the plan search's bounds take every moment.
def first_layer_activation_bytes(activations: int, blocks: int, shares: int = 1) -> int:
    """The activations alive at a piece of the first layer's backward: ``shares`` blocks' shares
    (two at its all-gather, one at its own backward) and at most the remainder of the split."""
    return shares * (activations // blocks) + blocks - 1


FIRST_LAYER_SHARES = (1, 1, 2, 2)
"""The blocks' activation shares alive at each of first_layer_pieces."""


def first_layer_pieces(moments: PeakTerms, accumulated: int, resident: int, held: int) -> tuple[MomentBytes, ...]:
    """The first layer's backward in its four pieces (nothing where PeakTerms.activation_blocks
    is 0): its units with its workspace, its units with its unsharded gradients or the
    embedding's all-gather (PeakTerms.first_layer_copy_buffers), and the second layer's
    backward with the first layer gathered (PeakTerms.first_layer_gather_buffers) beside its
    flat all-gather buffer, then beside the second layer's workspace, each with the shards
    reduced by then."""
    if not moments.activation_blocks:
        return (MomentBytes(0, 0, 0),) * len(FIRST_LAYER_SHARES)
    blocks, activations = moments.activation_blocks, moments.activations
    own = accumulated + moments.block_backward_gradients + moments.first_layer_gradients
    gathering = accumulated + moments.block_backward_gradients + moments.first_layer_gather_gradients
    at_own = resident + first_layer_activation_bytes(activations, blocks, FIRST_LAYER_SHARES[0])
    at_second = resident + first_layer_activation_bytes(activations, blocks, FIRST_LAYER_SHARES[2])
    second_units = held + moments.first_layer_gather_buffers
    return (
        MomentBytes(at_own, own, held + moments.first_layer_buffers + moments.workspace),
        MomentBytes(at_own, own, held + moments.first_layer_buffers + moments.first_layer_copy_buffers),
        MomentBytes(at_second, gathering, second_units + moments.first_layer_gather_flat_buffers),
        MomentBytes(at_second, gathering, second_units + moments.workspace),
    )


def peak_allocated_bytes(states: ModelStateBytes, moments: PeakTerms, grad_accum_steps: int) -> tuple[int, PeakMoment]:
    """The largest moment's bytes and which moment it is (the first of them on a tie)."""
    return largest_moment(peak_moments(states, moments, grad_accum_steps))


def largest_moment(alive: dict[PeakMoment, MomentBytes]) -> tuple[int, PeakMoment]:
    """peak_allocated_bytes of moments already computed (peak_moments): the first largest, as
    max(alive, key=...) picks it, read in one pass over the items (no moment's enum hashed to
    look it up again: a Python call each, at every plan's breakdown)."""
    largest = moment = None
    for at, moment_bytes in alive.items():
        total = moment_bytes.total
        if largest is None or total > largest:
            largest, moment = total, at
    if moment is None:
        raise ValueError("largest_moment() of no moments")
    return largest, moment


@frozen
class MomentBytes:
    """Bytes alive at one moment: gradients and buffers apart, everything else in ``other``."""

    other: int
    gradients: int
    buffers: int

    @property
    def total(self) -> int:
        return self.other + self.gradients + self.buffers


@frozen
class PeakTerms:
    """The byte terms the peak moments combine (besides the model states)."""

    activations: int
    logits: int
    workspace: int
    resident_buffers: int
    backward_held_buffers: int
    transient_buffers: int
    block_transient_buffers: int
    """The units a block's backward holds (zeroplan.core.buffers.block_backward_transient_bytes;
    ``transient_buffers`` outside FSDP full sharding)."""
    step_temporary: int
    block_copy_buffers: int = 0
    """What a block's backward holds beside its units instead of its workspace, before the
    workspace is made or once it is freed: the prefetched block's flat all-gather buffer or the
    block's unsharded gradients (zeroplan.core.buffers.block_copy_buffer_bytes); 0 elsewhere."""
    root_gather_buffers: int = 0
    """The root unit's flat all-gather buffer and copied-out parameters where it is gathered
    again for the backward, before any block's (zeroplan.core.buffers.root_gather_buffer_bytes)."""
    logits_gradient: int = 0
    """The reference model's logits' gradient, which its loss's backward leaves for the head's
    (zeroplan.core.buffers.reference_logits_gradient_bytes); 0 for a framework's own model."""
    root_gather_after_loss: bool = False
    """Whether the root is gathered again beside ``logits_gradient``, its pre-backward hook
    waiting for it (zeroplan.core.buffers.root_gathers_beside_logits_gradient)."""
    logits_pieces: tuple[int, ...] = ()
    """The loss's bytes at each of its own moments (``logits`` is their largest). Each is
    affine in the micro-batch, their maximum is not: the plan search needs them apart."""
    accumulated_gradients: int | None = None
    """With accumulation, what an earlier micro-batch leaves allocated for the next beyond the
    resident buffers; None: the model states' gradients. Set under the deepspeed convention
    (zeroplan.core.deepspeed_accumulation.accumulated_bytes), whose gradient is the fp32
    partition made at the step while the micro-steps carry other buffers."""
    backward_end_buffers: int | None = None
    """The buffers (beyond the resident and backward-held ones) alive at the last reduction of
    backward where it is modelled tensor by tensor (zeroplan.core.buffers.backward_end_buffer_bytes);
    None: ``transient_buffers``, the largest unit's."""
    step_gradients: int | None = None
    """The gradients alive at the optimizer step's peak where they are not the model states'
    (DeepSpeed ZeRO-3 makes them one sub-group at a time: the largest sub-group's flat copy and
    fp32 cast, zeroplan.core.deepspeed_stage3_step); None: the model states' gradients."""
    block_backward_gradients: int = 0
    """Gradients alive at the first block's backward beyond ``accumulated_gradients``: those a
    framework keeps unreduced from before the blocks (zeroplan.core.buffers.block_backward_gradient_bytes)."""
    backward_end_gradients: int | None = None
    """The gradients alive at that moment where they are not the model states' (DeepSpeed
    ZeRO-3 makes the fp32 gradient partition the optimizer reads only at the step); None: the
    model states' gradients."""
    first_layer_gradients: int = 0
    """The gradient shards alive at the first layer's backward beyond ``accumulated_gradients``:
    those of every unit whose backward ran before the first block's, where each unit's gradient
    is reduced to its shard as its backward ends and nothing accumulates; under no_sync
    accumulation what the last micro-batch's shards add beyond the held unsharded gradients
    they replace (zeroplan.core.buffers.first_layer_gradient_bytes)."""
    activation_blocks: int = 0
    """The blocks the activations are split among at the first layer's backward (one block's
    share left: first_layer_activation_bytes); 0 where that moment is not modelled."""
    first_layer_buffers: int = 0
    """The units the first layer's backward holds beside its workspace
    (zeroplan.core.buffers.first_layer_buffer_bytes)."""
    first_layer_copy_buffers: int = 0
    """What the first layer's backward holds beside those units once its workspace is freed, or
    before it is made (zeroplan.core.buffers.first_layer_copy_buffer_bytes): the workspace and
    these are not alive together, and only the workspace grows with the micro-batch."""
    first_layer_gather_buffers: int = 0
    """The units alive in the second layer's backward once the first layer is gathered for its
    own (zeroplan.core.buffers.first_layer_gather_buffer_bytes)."""
    first_layer_gather_flat_buffers: int = 0
    """The first layer's flat all-gather buffer, alive beside them before its parameters are
    copied out, and before the second layer's workspace is made (the largest block gathered)."""
    first_layer_gather_gradients: int = 0
    """The gradient shards alive then: those of the units whose backward ran before the second
    layer's (zeroplan.core.buffers.first_layer_gradient_bytes, before_block 1)."""
    loss_held_buffers: int = 0
    """Buffers alive at the loss's backward beyond the resident and backward-held ones: the
    parameters DeepSpeed's ZeRO-3 coordinator keeps gathered after the forward
    (zeroplan.core.deepspeed_coordinator.loss_gathered_bytes); 0 elsewhere."""
    checkpoint_save: int = 0
    """The most a checkpoint save after the step holds at once beyond the model states and resident
    buffers (zeroplan.core.checkpoint_save.save_peak_bytes); 0 where no save is planned."""
    draining_held_buffers: int = 0
    """The part of ``backward_held_buffers`` the gradient shards replace once the step's backward
    is done: FSDP's unsharded gradients under no_sync accumulation, reduce-scattered by the last
    micro-batch (zeroplan.core.buffers.draining_held_buffer_bytes); the allocator schedules free
    it before they allocate the shards."""


_PEAK_TERM_FIELDS = frozenset(PeakTerms.__dataclass_fields__)
_TOTAL = operator.attrgetter("total")
"""A moment's total bytes (MomentBytes.total), the key the largest piece is chosen by."""


# dataclasses.replace checks its arguments against the fields and calls __init__ with every
# field (a frozen dataclass sets each through object.__setattr__): ~10 us for PeakTerms' twenty,
# where the plan search swaps the micro-batch's terms into the model states' thousands of times.
# PeakTerms has no __post_init__ and no field whose value replace would derive, so the copy of
# its fields with the changes is what replace builds.
def with_terms(terms: PeakTerms, changes: dict[str, object]) -> PeakTerms:
    """dataclasses.replace(terms, **changes), each name of ``changes`` a PeakTerms field."""
    if not changes.keys() <= _PEAK_TERM_FIELDS:
        return replace(terms, **changes)  # replace's own error
    copied = object.__new__(PeakTerms)
    copied.__dict__.update(terms.__dict__)
    copied.__dict__.update(changes)
    return copied


# PeakTerms' __init__ sets its two dozen fields one by one (a frozen record's object.__setattr__),
# once for every request planned: where the micro-batch's terms and the model states' name every
# field between them, once each, the record of their values is what it builds.
def peak_terms_of(micro_batch: dict[str, object], states: dict[str, object]) -> PeakTerms:
    """PeakTerms(**micro_batch, **states)."""
    values = {**micro_batch, **states}
    if len(values) != len(micro_batch) + len(states) or values.keys() != _PEAK_TERM_FIELDS:
        return PeakTerms(**micro_batch, **states)  # its own error, or its defaults
    built = object.__new__(PeakTerms)
    built.__dict__.update(values)
    return built


BLOCK_PIECES = 3
"""How many pieces block_pieces gives."""

TOTAL_MOMENTS: tuple[PeakMoment, ...] = (
    *(PeakMoment.block_backward for _ in range(BLOCK_PIECES)), *(PeakMoment.first_layer_backward for _ in FIRST_LAYER_SHARES),
    PeakMoment.backward_end, PeakMoment.optimizer_step, PeakMoment.checkpoint_save,
)
"""The moment of each of moment_totals' entries before the loss's pieces."""


def moment_totals(states: ModelStateBytes, terms: PeakTerms, grad_accum_steps: int) -> list[int]:
    """Every moment's bytes (TOTAL_MOMENTS), the first layer's once per piece of it
    (first_layer_pieces), the loss's once per piece of the loss (each affine in the micro-batch,
    as PeakTerms.logits_pieces says; their maximum is not)."""
    loss, blocks, first_layer, backward_end, step = _moment_pieces(states, terms, grad_accum_steps)
    totals = [piece.total for piece in (*blocks, *first_layer, backward_end, step, save_moment(states, terms))]
    return totals + [loss.total - terms.logits + piece for piece in terms.logits_pieces or (terms.logits,)]
