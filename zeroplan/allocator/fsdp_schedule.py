"""The planner's step trace for FSDP2 full sharding, unit by unit and tensor by tensor, in the
order FSDP2 issues its allocations (torch 2.13 torch/distributed/fsdp/_fully_shard/):

- a unit's all-gather output is one flat buffer on the all-gather stream
  (_fsdp_collectives.py foreach_all_gather); its copy-out gives every parameter an unsharded
  storage of its own on the compute stream (_fsdp_param.py alloc_storage), and the flat buffer
  is then freed; after the unit's forward (reshard_after_forward) and its backward the
  parameters' storages are freed again;
- in backward the next unit's all-gather is issued before the current unit's gradients are
  computed (the backward prefetch), and each unit's unsharded gradients are copied into one
  flat reduce-scatter input, whose output and the sharded gradient live on the reduce-scatter
  stream (_fsdp_collectives.py foreach_reduce); that input is held until the next unit's
  reduce-scatter starts (_fsdp_param_group.py, comm_ctx.reduce_scatter_state);
- a root unit (embedding and head together) stays gathered through the forward, is gathered
  again for the loss's backward and resharded last; under torchtitan 9dec370 it is never
  resharded and the last block stays gathered from its forward to its backward;
- torchtitan's unchunked loss runs tensor by tensor as torch's cross-entropy allocates it
  (_torchtitan_unchunked_loss; compiled, _torchtitan_compiled_unchunked_loss), the unit holding
  the head gathered from its forward on.

Two steps are traced, the optimizer states created inside the first (AdamW's lazy state).
Under no_sync accumulation each step is two micro-batches: one before the last, which keeps
every unit's unsharded gradients and makes no shard, and the last, whose reduce-scatters turn
them into the shards unit by unit (_fsdp_param_group.py post_backward).

The framework traces recorded on fake tensors (zeroplan.simulate.alloc_trace) show exactly
these allocations; docs/memory-model.md, "The caching allocator", says what is still coarser
here (each block's own intermediates, a loss moment's tensors made and freed together)."""

from __future__ import annotations

from dataclasses import replace

from zeroplan.allocator.builder import TraceBuilder, proportional_bytes, split_bytes
from zeroplan.allocator.eager_softmax_workspace import record_workspace
from zeroplan.allocator.streams import Stream
from zeroplan.core.buffers import head_weight_gradient_bytes
from zeroplan.core.compiled import COMPILED_CROSS_ENTROPY_ROW_BYTES, compiles_loss, compiles_unchunked_loss
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.layout import padded_unit_elements
from zeroplan.core.model_states import padded_unit_elements_of, shard_layout, unit_gather_bytes
from zeroplan.core.parallel.expert import expert_index, expert_leaf
from zeroplan.core.param_tensors import ParamUnit
from zeroplan.core.params import FINAL_NORM_PREFIX
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.core.framework_loss import (
    fsdp_chunked_head_bytes, fsdp_head_gathered_bytes, framework_logits_tensors, loss_parallel_applies,
)
from zeroplan.core.memo import batch_keyed
from zeroplan.core.fused_cross_entropy import fused_cross_entropy_parts
from zeroplan.core.uncast_loss import uncast_logits_parts
from zeroplan.core.kv_cache import kv_cache_tensors
from zeroplan.core.parallel.activations import rank_logits_pieces, rank_logits_tensors
from zeroplan.core.parallel.sequence_parallel import (
    SUBLAYERS, SublayerCollectives, sequence_parallel_forward_collectives,
)
from zeroplan.core.profiles import fsdp1_root_stays_gathered, fsdp_separates_embedding_and_head, loss_chunks, profile
from zeroplan.core.record import frozen
from zeroplan.specs import StrategyKind
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.core.peak import PeakTerms
from zeroplan.units import FP32_BYTES


@frozen(slots=True)
class _Unit:
    """One FSDP2 parameter group: its gathered bytes, its parameters' unsharded sizes, and its
    trainable elements (what its gradients and optimizer states are proportional to)."""

    gathered_bytes: int
    tensor_bytes: tuple[int, ...]
    elements: int
    head_tensors: int = 0
    """In a root unit holding the head: how many of the last tensor_bytes are the head unit's."""


def applies(request: PlanRequest) -> bool:
    """Whether this schedule describes the request: FSDP2 full sharding (or HSDP) without a
    pipeline, whose units run embedding, blocks, head."""
    if request.strategy.kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp) or request.parallel.pp > 1:
        return False
    units = rank_parameter_units(request)
    return len(units) >= 3 and units[0].name == "embedding" and units[-1].name == "head"


class _Units(tuple):
    """A request's units (a tuple, equal to and hashing as the plain one), its hash computed
    once: the planner's trace keys (schedule.StepInputs) hold them, and a plain tuple's hash
    walks every unit and its parameters' sizes at each lookup (an 8B model's 33 units, three
    times a trace key)."""

    def __hash__(self) -> int:
        return self.hashed


def _kept_units(units: list[_Unit] | tuple[_Unit, ...]) -> _Units:
    kept = _Units(units)
    kept.hashed = tuple.__hash__(kept)
    return kept


# The same at every micro-batch and sequence length: fit() and the largest-micro-batch search
# ask for it at each (core/memo.py enforces that no batch field is read).
@batch_keyed(limit=256)
def _units(request: PlanRequest) -> tuple[_Unit, ...]:
    """The request's units in forward order, grouped as its framework wraps them: embedding and
    head apart, or together in the root unit gathered first."""
    shard = request.shard_group_size
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    gathered = unit_gather_bytes(request, shard, compute)
    elements = padded_unit_elements_of(request, shard)
    units = []
    grouped = request.training.framework is Framework.torchtitan
    for unit, unit_bytes, unit_elements in zip(rank_parameter_units(request), gathered, elements):
        # Each parameter's unsharded storage, scaled so they sum to the unit's gathered bytes
        # (padding and frozen storage included).
        numels = _grouped_expert_numels(unit.tensors) if grouped else [t.numel for t in unit.tensors]
        units.append(_Unit(unit_bytes, tuple(split_bytes(unit_bytes, numels)), unit_elements))
    if fsdp_separates_embedding_and_head(request):
        if not profile(request.training.framework).fsdp_head_unit_holds_final_norm:
            units[-1] = _without_final_norm(request, rank_parameter_units(request)[-1], units[-1], compute)
        return _kept_units(units)
    embedding, head = units[0], units[-1]
    root = _Unit(embedding.gathered_bytes + head.gathered_bytes, embedding.tensor_bytes + head.tensor_bytes,
                 embedding.elements + head.elements, len(head.tensor_bytes))
    return _kept_units((root, *units[1:-1]))


def _without_final_norm(request: PlanRequest, head: ParamUnit, unit: _Unit, compute: int) -> _Unit:
    """The head unit of a wrapping that shards the output projection alone, the final norm left
    to the root unit (FrameworkProfile.fsdp_head_unit_holds_final_norm): what its all-gathers
    and unsharded gradients are, to the byte, which decides the caching allocator's blocks (a
    head's requests a norm larger round to segments that requests of the projection alone,
    such as its weight gradient, leave split). The root's norm, a hidden-size vector gathered
    once, is not scheduled; its shard's bytes stay in the parameters' total."""
    norm = tuple(t for t in head.tensors if t.name.startswith(FINAL_NORM_PREFIX))
    kept = [t for t in head.tensors if not t.name.startswith(FINAL_NORM_PREFIX)]
    if not norm or not kept:
        return unit
    shard = request.shard_group_size
    norm_elements = padded_unit_elements(ParamUnit(name=head.name, tensors=norm), shard, shard_layout(request))
    trainable = sum(padded_unit_elements(ParamUnit(name=head.name, tensors=(t,)), shard, shard_layout(request))
                    for t in norm if t.trainable)
    gathered = unit.gathered_bytes - norm_elements * compute
    return _Unit(gathered, tuple(split_bytes(gathered, [t.numel for t in kept])), unit.elements - trainable,
                 unit.head_tensors)


# torchtitan 0.3.0 models/common/moe.py GroupedExperts: a block's routed experts are three
# parameters (w1, w3 of E x f x h, w2 of E x h x f), one storage each once gathered, where the
# planner's units list every expert's matrices apart (as transformers' ModuleList holds them).
def _grouped_expert_numels(tensors) -> list[int]:
    """Each parameter's elements, every routed expert's matrices of one kind as one parameter
    (at the place of the first expert's)."""
    numels: list[int] = []
    leaf_at: dict[str, int] = {}
    for tensor in tensors:
        if expert_index(tensor) is None:
            numels.append(tensor.numel)
            continue
        leaf = expert_leaf(tensor)
        if leaf in leaf_at:
            numels[leaf_at[leaf]] += tensor.numel
        else:
            leaf_at[leaf] = len(numels)
            numels.append(tensor.numel)
    return numels


@frozen(slots=True)
class _ChunkedLoss:
    """What torchtune's chunked loss under FSDP2 reads (_chunked_loss)."""

    chunks: int
    compute_bytes: int
    """The logits' element bytes (the compute dtype)."""
    sbv_chunk: int
    """A chunk's logits elements."""
    compiled: bool
    rows: int
    """A chunk's tokens."""
    weight_gradient_bytes: int


@frozen(slots=True)
class FsdpStepInputs:
    """What record_fsdp_step reads beyond the step's common inputs (schedule.StepInputs), from
    the request, computed before it runs."""

    units: tuple[_Unit, ...]
    separate: bool
    """fsdp_separates_embedding_and_head."""
    compute: int
    wire: int
    offload: bool
    stored: int
    shard: int
    loss_tensors: tuple[int, int] | None
    """torchtitan_unchunked_loss_tensors."""
    chunked_loss: _ChunkedLoss | None
    """Where per_chunk_head: torchtune's chunked loss."""
    fsdp1_root: bool = False
    """FSDP1's root unit (embedding and head), gathered from the forward to the end of backward
    (fsdp1_root_held)."""
    loss_parallel: bool = False
    """loss_tensors are those of loss_parallel's cross-entropy on the rank's vocabulary shard
    (zeroplan.core.framework_loss.loss_parallel_applies), run as run_torchtitan_loss_parallel."""
    sequence_parallel: SublayerCollectives | None = None
    """forward_collectives: each block's forward collectives (run_sequence_parallel_forward)."""
    gradient_is_output: bool = False
    """reduce_output_is_sharded_gradient: a unit's sharded gradient is its reduce-scatter output."""
    root_head_gradient: int = 0
    """root_head_gradient_bytes: where the schedule runs the loss's moments, the head weight's
    unsharded gradient the root keeps from the loss's backward to its own post-backward."""
    root_gather_loss_gradient: int = 0
    """The logits' gradient the root's gather for the backward runs beside, where its
    pre-backward hook waits for it (PeakTerms.root_gather_after_loss, logits_gradient)."""

    compiled_loss: bool = False
    """loss_tensors are the compiled unchunked loss's (the bf16 logits, the row statistics), run
    as _torchtitan_compiled_unchunked_loss (zeroplan.core.compiled.compiles_unchunked_loss)."""
    defers_all_gather_free: bool = False
    """FSDP2's all-gather outputs (FrameworkProfile.fsdp_is_fully_shard; FSDP1 gathers into its
    flat parameter): kept in forward until the next unit's copy-out, and a backward prefetch's
    copied out only at its unit's pre-backward (record_fsdp_step's wait_for_unshard)."""

    @property
    def block_units(self) -> int:
        return len(self.units) - (2 if self.separate else 1)

    @property
    def held_root(self) -> bool:
        # torchtitan's unit holding the head is not resharded after its forward: 9dec370's root
        # (apply_fsdp: fully_shard(model, reshard_after_forward=not pp_enabled), which torch up to
        # 2.7, the runs' 1963fc8 among them, clamps to False for a root; pytorch PR 154704 (2.8)
        # honours an explicit True, PR 155319 keeps None unsharded), 0.3.0's [norm, lm_head]
        # (distributed/fsdp.py:200-207, reshard_after_forward False under the default policy).
        return self.loss_tensors is not None and not self.separate and self.units[0].head_tensors > 0 \
            and self.block_units > 0

    @property
    def held_head(self) -> bool:
        return self.loss_tensors is not None and self.separate

    @property
    def runs_own_loss(self) -> bool:
        """The loss's moments (loss_allocations) are not what the schedule runs."""
        return self.held_root or self.held_head or self.chunked_loss is not None


_UNITS_SEEN: dict[tuple[_Unit, ...], tuple[_Unit, ...]] = {}
"""Each distinct units tuple once: the planner keeps thousands of traces' inputs, and requests
that differ in their batch alone have equal units (a 70B model's 81 units are ~40 KB, the rest of its inputs ~2 KB)."""
_UNITS_SEEN_LIMIT = 256


def fsdp_step_inputs(request: PlanRequest, terms: PeakTerms) -> FsdpStepInputs:
    """What record_fsdp_step reads of ``request`` (where applies)."""
    precision = request.training.precision
    eb = element_bytes(precision, request.convention)
    chunked = None
    if per_chunk_head(request):
        model, training, batch = request.model, request.training, request.batch
        chunks = loss_chunks(training)
        e = precision.compute_bytes
        chunked = _ChunkedLoss(chunks, e, batch.seq_len * batch.micro_batch_size * model.vocab_size // chunks,
                               compiles_loss(training), batch.seq_len * batch.micro_batch_size // chunks,
                               model.vocab_size * model.hidden_size * e)
    units = _units(request)
    if len(_UNITS_SEEN) >= _UNITS_SEEN_LIMIT and units not in _UNITS_SEEN:
        _UNITS_SEEN.clear()
    units = _UNITS_SEEN.setdefault(units, units)
    inputs = FsdpStepInputs(units, fsdp_separates_embedding_and_head(request), eb.compute_parameter,
                            gradient_wire_bytes(request), bool(request.training.fsdp_cpu_offload), eb.parameter,
                            request.shard_group_size, torchtitan_unchunked_loss_tensors(request, terms), chunked,
                            fsdp1_root_held(request), loss_parallel_applies(request),
                            forward_collectives(request, terms), reduce_output_is_sharded_gradient(request))
    fully_shard = profile(request.training.framework).fsdp_is_fully_shard and not fsdp1_root_stays_gathered(request)
    return replace(inputs, root_head_gradient=root_head_gradient_bytes(request, inputs), defers_all_gather_free=fully_shard,
                   root_gather_loss_gradient=terms.logits_gradient if terms.root_gather_after_loss else 0,
                   compiled_loss=inputs.loss_tensors is not None and compiles_unchunked_loss(request))


# torch 2.13 distributed/fsdp/_fully_shard/_fsdp_state.py: a unit's post-backward (reshard, then
# foreach_reduce of its unsharded gradients) runs from the autograd hook on its forward inputs
# (_fsdp_param_group.py:891-907 _register_post_backward_hook, RegisterPostBackwardFunction), only
# for inputs that need a gradient; the root's inputs are token ids, so its post-backward runs
# from _root_post_backward_final_callback (:395-420), after every block's backward. Where the root
# holds the head (hf/accelerate's FSDP2 wrapping, FSDP1's root, whose flat gradient waits for the
# embedding's: zeroplan.core.buffers), the head's weight gradient that the loss's backward
# accumulates into the unsharded parameter stays there through the blocks' backward, as the
# planner's block moments count it (buffers.head_weight_gradient_bytes: the head weight's; the
# final norm's, a hidden-size vector, is left to the post-backward here, as the planner leaves it
# out). The hf 70B whole step recorded from torch's FSDP2 on fake tensors
# (benchmarks/framework-step-records) holds it.
def root_head_gradient_bytes(request: PlanRequest, inputs: FsdpStepInputs) -> int:
    """The head weight's unsharded gradient the schedule holds in the root from the loss's
    backward on, where it runs the loss's moments itself (runs_own_loss: its own loss keeps it);
    0 where the root trains no head or is not the head's unit."""
    if inputs.separate or inputs.runs_own_loss or not inputs.units[0].head_tensors or not inputs.units[0].elements:
        return 0
    return head_weight_gradient_bytes(request)


# torch 2.13 distributed/fsdp/_fully_shard/_fsdp_collectives.py:696-708 foreach_reduce:
# reduce_output = _to_dtype_if_needed(reduce_output, orig_dtype) (_fsdp_common.py:173-178: a new
# tensor only where the dtypes differ), then each parameter's new sharded gradient is
# torch.as_strided(reduce_output, ...), a view of it, set as its .grad (or added into the .grad
# an earlier micro-batch left, the view then dropped). orig_dtype is the sharded parameters'
# dtype (_fsdp_param_group.py:279-286): where the reduce dtype is that dtype (fp32 parameters
# reduced in fp32, bf16 parameters in bf16) the output is the sharded gradient, no second
# allocation; otherwise the cast is the gradient and the reduce-dtype output is freed.
def reduce_output_is_sharded_gradient(request: PlanRequest) -> bool:
    """Whether a unit's reduce-scatter output, kept, is its sharded gradient: the gradient wire
    dtype is the stored parameters' (by element size: zeroplan's dtypes of a size are one)."""
    return gradient_wire_bytes(request) == element_bytes(request.training.precision, request.convention).parameter


# A block's backward reruns its forward under full recomputation (and computes the gradients of
# the same collectives), inside the workspace the planner gives it (PeakTerms.workspace): the
# forward's collectives are scheduled where they fit in it, so that the trace's requested peak
# stays the planner's allocated peak.
def forward_collectives(request: PlanRequest, terms: PeakTerms) -> SublayerCollectives | None:
    """sequence_parallel_forward_collectives where the block's backward workspace holds them."""
    collectives = sequence_parallel_forward_collectives(request)
    if collectives is None or collectives.peak() > terms.workspace:
        return None
    return collectives


# torch 2.13 distributed/fsdp/_runtime_utils.py _post_forward_reshard: FSDP1 does not reshard the
# root after its forward, and its pre-backward unshard finds it gathered.
def fsdp1_root_held(request: PlanRequest) -> bool:
    """Whether the schedule keeps the root unit (embedding and head together) gathered from its
    forward to its post-backward (profiles.fsdp1_root_stays_gathered)."""
    return fsdp1_root_stays_gathered(request) and not fsdp_separates_embedding_and_head(request)


def record_fsdp_step(x, f: FsdpStepInputs, b: "TraceBuilder", copy_second_step: bool = True) -> None:
    """One step under FSDP2 full sharding, recorded in ``b`` (an empty builder), from the step's
    inputs alone (``x`` the common ones, schedule.StepInputs, not imported here: it holds ``f``;
    ``x.block_weights`` the bytes one block saves for backward, tensor by tensor,
    as weights). The second step is the first's ops again (TraceBuilder.repeat_step, where the
    first frees all it makes but the optimizer states); without ``copy_second_step`` it is
    recorded call by call (the same ops: tests/test_allocator_repeat_step.py)."""
    units = f.units
    separate = f.separate
    compute = f.compute
    wire = f.wire
    accumulating = x.accumulating
    weights = [u.elements for u in units]
    blocks = x.blocks
    block_tensor_parts = list(x.block_weights)

    offload = f.offload
    stored = f.stored

    deferred = f.defers_all_gather_free
    # torch 2.13 _fully_shard/_fsdp_param_group.py wait_for_unshard (:417-489): in forward the
    # unit's all-gather output is kept (comm_ctx.all_gather_state) until the next unit's
    # copy-out has run, the local ``prev_all_gather_state`` holding it to that call's end; the
    # root's post-forward frees the last (_fsdp_state.py _post_forward). In backward it goes as
    # soon as its own copy-out has run.
    forward_result: list[int] = []

    def unshard(unit: _Unit) -> list[int]:
        # Under CPU offload the unit's host shard is first copied to the device on a stream of
        # its own (in the stored dtype, then cast to the compute dtype where they differ), and
        # that copy is freed once the all-gather has read it (offload_shard_copy_parts).
        copies = []
        if offload:
            shard = f.shard
            parts = offload_shard_copy_parts(unit.gathered_bytes, unit.elements, compute, stored, shard)
            copies = b.alloc(parts[0], Stream.host_copy)
            if len(parts) > 1:
                cast = b.alloc(parts[1], Stream.host_copy)
                b.free(copies)
                copies = cast
        flat = b.alloc(unit.gathered_bytes, Stream.all_gather)
        b.free(copies)
        return flat

    def copy_out(unit: _Unit, flat: list[int], forward: bool = False) -> list[int]:
        """The unit's parameters out of its all-gather output ``flat`` (wait_for_unshard)."""
        parameters = b.alloc_parts(unit.tensor_bytes)
        if forward and deferred:
            previous = forward_result[:]
            forward_result[:] = flat
            b.free(previous)
        else:
            b.free(flat)
        return parameters

    def gather(unit: _Unit) -> list[int]:
        return copy_out(unit, unshard(unit))

    def gather_forward(unit: _Unit) -> list[int]:
        return copy_out(unit, unshard(unit), forward=True)

    def forward_ends() -> None:
        # The root's post-forward (_fsdp_state.py _post_forward): the last all-gather output goes.
        b.free(forward_result)
        forward_result.clear()

    block_units = units[1:-1] if separate else units[1:]
    loss_tensors = f.loss_tensors
    held_root, held_head = f.held_root, f.held_head
    per_block, outside = divmod(x.activations, blocks)

    def backward_gradient_parts(unit: _Unit) -> list[int]:
        # autograd's unsharded gradient per parameter, in the compute dtype (frozen storage none).
        scale = unit.elements * compute
        return [size * scale // max(unit.gathered_bytes, 1) for size in unit.tensor_bytes]
    block_parts = [p * per_block // max(sum(block_tensor_parts), 1) for p in block_tensor_parts]
    block_parts[-1] += per_block - sum(block_parts)
    # With accumulation the shards are carried from the start; under no_sync (accumulated
    # gradients 0) none is: the last micro-batch's reduce-scatters make them, unit by unit, in
    # place of the unsharded gradients (buffers.no_sync_first_layer_gradient_bytes).
    carried = x.gradient_bytes if x.accumulated_gradients is None else x.accumulated_gradients
    no_sync = accumulating and x.draining_held_buffers > 0
    shares = proportional_bytes(x.gradient_bytes, weights) if not accumulating or no_sync else []
    # The micro-batch being recorded: the shards its reduce-scatters make (none where they are
    # carried, or in a no_sync micro-batch before the last), in the last under no_sync each
    # unit's unsharded gradients, held until its reduce-scatter's copy-in, and whether it
    # reduce-scatters at all (a no_sync micro-batch before the last does not).
    making: list = [shares, [], True]
    cache_parts = x.cache_parts

    # Two steps: AdamW creates its states lazily, inside the first step's optimizer step, among
    # the cached blocks the first backward left; the second step runs with them in place, as
    # every later one does (the frameworks' traces record both steps the same way).
    b.alloc_parts(split_bytes(x.parameter_bytes, [u.gathered_bytes for u in units]))
    b.alloc(x.resident_buffers)

    def one_step(first_step: bool) -> tuple | None:
        """Record one step; the first returns where its optimizer states were made
        (TraceBuilder.once_start's answer, then the op index and id after them)."""
        made_once = None
        gradients = b.alloc_parts(split_bytes(carried, weights)) if accumulating and carried else []
        held = b.alloc(x.backward_held_buffers - x.draining_held_buffers)
        if not no_sync:
            micro_batch(gradients)
        else:
            # FSDP's no_sync unsharded gradients, one allocation per unit: a micro-batch before the
            # last keeps them all through its backward and makes no shard; the last micro-batch
            # reduce-scatters each unit's as its backward ends, which drops them for its shard
            # (torch 2.13 _fully_shard/_fsdp_param_group.py post_backward; FSDP1 _runtime_utils.py
            # _post_backward_hook and _reduce_grad).
            draining = [b.alloc(part) for part in proportional_bytes(x.draining_held_buffers, weights)]
            making[:] = [[], [], False]
            micro_batch(gradients)
            making[:] = [shares, draining, True]
            micro_batch(gradients)
            b.free([ident for unit in draining for ident in unit])
        b.free(held)

        # Optimizer step: its temporaries per unit, then the gradients go (set_to_none).
        if first_step:
            once = b.once_start() if copy_second_step else None
            b.alloc_parts(split_bytes(x.optimizer_state_bytes, weights))
            made_once = once, (len(b.ops), b.next_id)
        b.free(b.alloc_parts(split_bytes(x.step_temporary, weights)))
        b.free(gradients)
        return made_once

    def micro_batch(gradients: list[int]) -> None:
        """One micro-batch's forward and backward; the shards its reduce-scatters make join
        ``gradients``."""
        made, drains, reduces = making
        # Forward: the root (or the embedding) first; each block's parameters gathered, its
        # activations saved, its parameters freed (reshard_after_forward).
        root = gather_forward(units[0])
        outside_ids = b.alloc(outside)
        if separate:
            b.free(root)
            root = []
        saved: list[list[int]] = []
        cache: list[int] = []
        last_block: list[int] = []
        for position, unit in enumerate(block_units):
            b.mark()
            parameters = gather_forward(unit)
            saved.append(b.alloc_parts(block_parts))
            b.free(record_workspace(b, x.block_forward_steps))
            cache += b.alloc_parts(list(cache_parts[position]))
            run_sequence_parallel_forward(b, f.sequence_parallel)
            if held_root and position == len(block_units) - 1:
                last_block = parameters  # torchtitan 9dec370: the last block is not resharded
            else:
                b.free(parameters)
        b.mark()

        head_gradient: list[int] = []
        head_parameters: list[int] = []
        prefetched_first: list[int] = []

        def prefetch_last_block() -> None:
            # The head unit's pre-backward for the chunk it ran first in forward: the unit before
            # it in post_forward_order is the last block, whose all-gather it issues
            # (_fsdp_param_group.py _backward_prefetch); an earlier chunk's target is the head.
            if block_units:
                prefetched_first[:] = unshard(block_units[-1])
        if held_root or held_head:
            # The head's unit stays gathered; the loss's tensors one by one; the head's gradient
            # kept until its unit's post-backward (the root's, at the end of backward).
            head_unit = units[-1] if held_head else units[0]
            head_parameters = gather_forward(head_unit) if held_head else []
            head_parts = backward_gradient_parts(head_unit)[-head_unit.head_tensors:] if held_root else backward_gradient_parts(head_unit)

            def pre_backward() -> None:
                # 0.3.0: the head unit's pre-backward prefetches the last block.
                if held_head and block_units:
                    # FSDP2 issues the all-gather here; its copy-out waits for the block's own
                    # pre-backward (wait_for_unshard).
                    prefetched_first[:] = unshard(block_units[-1]) if deferred else gather(block_units[-1])

            run = run_torchtitan_loss_parallel if f.loss_parallel else \
                _torchtitan_compiled_unchunked_loss if f.compiled_loss else _torchtitan_unchunked_loss
            head_gradient = run(b, loss_tensors, head_parts, pre_backward, post_forward=forward_ends)
        else:
            # The root's parameters are resharded after the forward and gathered again at the
            # loss's backward, which the planner's loss term counts (fsdp_head_gathered_bytes);
            # FSDP1's root stays gathered throughout instead, and the loss's moments leave it out
            # (loss_allocations' held_root_bytes).
            if not f.fsdp1_root:
                b.free(root)
            if f.chunked_loss is not None:
                head_gradient = _chunked_loss(f.chunked_loss, b, gather, units[-1], gather_forward, forward_ends,
                                              prefetch_last_block if deferred else None)
            else:
                b.free(gather_forward(units[-1]) if separate else [])
                forward_ends()
                run_loss(x.loss_moments, b, cache)
            if not f.fsdp1_root:
                # The reference model's root is gathered from its pre-backward hook on the logits'
                # gradient, which the loss's backward has left (buffers.root_gathers_beside_logits_gradient).
                logits_gradient = b.alloc(f.root_gather_loss_gradient) if f.root_gather_loss_gradient else []
                root = [] if separate else gather(units[0])
                b.free(logits_gradient)
            if f.root_head_gradient:
                # The head's backward (the loss's last) leaves its weight's unsharded gradient,
                # held to the root's post-backward after every block's (root_head_gradient_bytes).
                head_gradient = b.alloc(f.root_head_gradient)
        pending_input: list[int] = []

        def backward_gradients(index: int, parameters: list[int], unsharded: list[int] | None = None) -> None:
            # autograd's unsharded gradient per parameter; post_backward reshards the parameters,
            # then foreach_reduce copies the gradients into one flat input and reduce-scatters it
            # to a shard on the reduce-scatter stream (upcast there where the reduce dtype is
            # fp32), which becomes the sharded gradient.
            unit = units[index]
            if unsharded is None and unit.elements:
                unsharded = b.alloc_parts(backward_gradient_parts(unit))
            b.free(parameters)
            if not unit.elements:
                return
            if not reduces:
                # Without gradient sync post_backward only accumulates the new unsharded
                # gradients into the held ones and returns: no copy-in, no reduce-scatter
                # (torch 2.13 _fully_shard/_fsdp_param_group.py post_backward, reduce_grads
                # False: to_accumulated_grad_if_needed; FSDP1 _runtime_utils.py
                # _post_backward_hook under no_sync).
                b.free(unsharded or [])
                return
            if drains:
                # The last no_sync micro-batch: accumulate_unsharded_grad_if_needed adds the new
                # gradients into the held unsharded ones, which are what foreach_reduce copies in.
                b.free(unsharded or [])
                unsharded, drains[index] = drains[index], []
            # The previous unit's flat input is held until this reduce-scatter starts
            # (_fsdp_param_group.py post_backward: comm_ctx.reduce_scatter_state). The input is
            # in the reduce dtype, the gradients copied into it by chunk_cat
            # (_fsdp_collectives.py:597-603 foreach_reduce: reduce_scatter_comm.allocate(...,
            # dtype=reduce_dtype)), so fp32 under an fp32 reduce_dtype.
            b.free(pending_input)
            pending_input[:] = b.alloc(unit.elements * wire)
            b.free(unsharded or [])
            output = b.alloc(unit.elements // f.shard * wire, Stream.reduce_scatter)
            if made and made[index] and f.gradient_is_output:
                # The sharded gradient is a view of the output (reduce dtype = parameter dtype).
                gradients.extend(output)
                return
            if made:
                gradients.extend(b.alloc(made[index], Stream.reduce_scatter))
            b.free(output)

        # Backward, last unit first: the head (the root stays gathered), then each block with the
        # one before it prefetched, its workspace (and recomputation) and gradients, its
        # activations freed; the embedding last.
        order = [(len(units) - 1, None)] if separate else []
        order += [(1 + position, position) for position in reversed(range(len(block_units)))]
        order += [(0, None)] if separate else []
        if separate and (head_gradient or held_head):
            # The chunked loss (or torchtitan's unchunked one) has run the head's backward
            # already: its gradient goes, with the parameters the unit held.
            order.pop(0)
            backward_gradients(len(units) - 1, head_parameters, head_gradient)
        if held_root:
            current = last_block
        elif deferred:
            # Each unit's copy-out at its own pre-backward, from the all-gather a prefetch issued.
            current = prefetched_first if prefetched_first else unshard(units[order[0][0]])
        else:
            current = prefetched_first if held_head else gather(units[order[0][0]])
        for step, (index, position) in enumerate(order):
            if deferred and not (held_root and step == 0):
                current = copy_out(units[index], current)
            prefetched = [] if step + 1 >= len(order) else \
                unshard(units[order[step + 1][0]]) if deferred else gather(units[order[step + 1][0]])
            if position is not None:
                run_sequence_parallel_recompute(b, f.sequence_parallel)
                if x.workspace_steps:
                    # transformers' eager attention core, tensor by tensor (eager_softmax_workspace).
                    b.free(record_workspace(b, x.workspace_steps))
                else:
                    b.free(b.alloc_parts(list(x.workspace_parts or (x.workspace,))))
                b.free(saved[position])
            backward_gradients(index, current)
            current = prefetched
        b.free(outside_ids)
        if held_root:
            # The root's post-backward: the embedding's gradient beside the head's, kept since
            # the loss's backward.
            root_parts = backward_gradient_parts(units[0])
            backward_gradients(0, root, head_gradient + b.alloc_parts(root_parts[:-units[0].head_tensors]))
        elif head_gradient and not separate:
            # The root's other gradients (the embedding's, the final norm's) beside the head
            # weight's, whose share of the root's parts it takes.
            root_parts = backward_gradient_parts(units[0])
            head_at = max(range(len(root_parts) - units[0].head_tensors, len(root_parts)), key=root_parts.__getitem__)
            backward_gradients(0, root, head_gradient + b.alloc_parts(root_parts[:head_at] + root_parts[head_at + 1:]))
        elif not separate:
            backward_gradients(0, root)
        b.free(pending_input)

    # The second step makes and frees what the first does, in the same order, but the states
    # the first made: recorded by copying the first's ops (about a third of the build's time
    # for a step's thousands of per-parameter events), where the builder finds that it qualifies.
    start = b.step_start() if copy_second_step else None
    made_once = one_step(True)
    if start is None or not b.repeat_step(start, *made_once):
        one_step(False)


# FSDP's CPU offload, torch 2.13: FSDP1's FlatParamHandle.pre_unshard (fsdp/_flat_param.py:1335-
# 1337) runs flat_param_to(device) on the pre-unshard stream (_runtime_utils.py:292-293 _unshard),
# a new device tensor of the padded shard that the all-gather reads (_flat_param.py:1440-1491
# _all_gather_flat_param, record_stream to the unshard stream) and that goes once
# _use_unsharded_flat_param points the FlatParameter at the gathered one; under parameter mixed
# precision _use_low_precision_shard (_flat_param.py:1342-1357) copies the shard to the device in
# its stored dtype into the low-precision _mp_shard, which post_unshard frees. FSDP2's
# FSDPParam.all_gather_inputs (_fully_shard/_fsdp_param.py:897-901) copies each offloaded shard to
# the device and casts it to the param dtype inside foreach_all_gather's copy-in stream
# (_fsdp_collectives.py:336-358), freed once copied into the all-gather buffer.
def offload_shard_copy_parts(gathered_bytes: int, trainable_elements: int, compute_bytes: int, stored_bytes: int,
                             shard_group_size: int) -> list[int]:
    """The device copies of one rank's host shard of a unit gathered to ``gathered_bytes``: the
    shard as stored (its trainable elements in ``stored_bytes``, the frozen storage as gathered),
    then, where the stored dtype is not the compute dtype, its cast (the shard as gathered)."""
    shards = max(shard_group_size, 1)
    as_gathered = -(-gathered_bytes // shards)
    trainable = trainable_elements * compute_bytes
    as_stored = -(-(gathered_bytes - trainable + trainable_elements * stored_bytes) // shards)
    return [as_stored] if as_stored == as_gathered else [as_stored, as_gathered]


def loss_allocations(request: PlanRequest, terms: PeakTerms, held_root_bytes: int = 0) -> list[list[int]]:
    """The loss's moments as a schedule allocates them, one after another, each as the tensors
    it is made of (zeroplan.core.framework_loss.framework_logits_tensors, on this rank as
    rank_logits_pieces sizes the moments themselves: each moment's tensors sum to its piece of
    PeakTerms.logits_pieces); the reference model's loss, which has no pieces, as its three fp32
    sbV tensors, flash-attn's fused one as the tensors of its backward
    (zeroplan.core.fused_cross_entropy.fused_cross_entropy_parts), the uncast one as its three
    (zeroplan.core.uncast_loss.uncast_logits_parts: under CUDA autocast a 16-bit log-softmax
    and two fp32 tensors) and what the loss's term holds beyond them. Less ``held_root_bytes``:
    FSDP1's root, which the planner's loss terms count beside the loss's tensors and the FSDP
    schedule holds gathered itself (fsdp_loss_allocations)."""
    if not terms.logits_pieces:
        if request.training.fused_cross_entropy:
            return [list(rank_logits_pieces(request, fused_cross_entropy_parts))]
        if request.training.uncast_loss:
            parts = [part for part in rank_logits_pieces(request, uncast_logits_parts) if part > 0]
            rest = terms.logits - held_root_bytes - sum(parts)
            return [parts + [rest] if rest > 0 else parts]
        return [split_bytes(terms.logits - held_root_bytes, [1, 1, 1])]
    moments = [list(moment) for moment in rank_logits_tensors(request, framework_logits_tensors)]
    if [sum(moment) for moment in moments] != list(terms.logits_pieces):
        # Terms that are not this request's own (a caller's hand-made PeakTerms): each moment
        # as one allocation of the planner's bytes.
        return [[piece - held_root_bytes] for piece in terms.logits_pieces]
    return [_without(moment, held_root_bytes) for moment in moments]


def _without(moment: list[int], tensor: int) -> list[int]:
    """``moment`` less its last tensor of ``tensor`` bytes (none: ``moment`` as it is)."""
    for index in reversed(range(len(moment))):
        if tensor and moment[index] == tensor:
            return moment[:index] + moment[index + 1:]
    return moment


def fsdp_loss_allocations(request: PlanRequest, terms: PeakTerms) -> list[list[int]]:
    """loss_allocations as the FSDP schedule runs them: without FSDP1's root (fsdp1_root_held),
    which it keeps gathered from the forward on."""
    held = fsdp_head_gathered_bytes(request) if fsdp1_root_held(request) else 0
    return loss_allocations(request, terms, held)


def forward_cache_parts(request: PlanRequest, blocks: int) -> list[tuple[int, ...]]:
    """The KV cache's tensors each block's forward adds (zeroplan.core.kv_cache: transformers'
    cache keeps a layer's K and V as its attention runs), one tuple per block; empty tuples
    without the cache."""
    tensors = kv_cache_tensors(request) if request.parallel.is_trivial else ()
    if not tensors:
        return [()] * blocks
    per_block = len(tensors) // blocks
    return [tuple(tensors[k * per_block:(k + 1) * per_block]) for k in range(blocks)]


def run_loss(moments: tuple[tuple[int, ...], ...], b: "TraceBuilder", cache: list[int]) -> None:
    """The loss's moments one after another (loss_allocations). With the KV cache, the first
    moment is the loss's forward, whose cache tensors the blocks' forward allocated already
    (``cache``): its other tensors are made beside them, and the cache goes with them, as the
    output object does once the forward returns (zeroplan.core.framework_loss)."""
    if cache:
        b.free(b.alloc_parts(moments[0][len(cache):]))
        b.free(cache)
        moments = moments[1:]
    for moment in moments:
        b.free(b.alloc_parts(moment))


def per_chunk_head(request: PlanRequest) -> bool:
    """torchtune's chunked loss under FSDP2 full sharding: its output unit is gathered for each
    chunk in forward and again in backward (zeroplan.core.framework_loss.fsdp_chunked_head_bytes)."""
    return loss_chunks(request.training) > 1 and fsdp_chunked_head_bytes(request) > 0 \
        and fsdp_separates_embedding_and_head(request) and not request.training.fused_linear_cross_entropy


def _chunked_loss(loss: _ChunkedLoss, b: "TraceBuilder", gather, head: _Unit, gather_forward=None,
                  forward_ends=None, last_pre_backward=None) -> list[int]:
    """torchtune 0.6.1's chunked cross-entropy (zeroplan.core.framework_loss.chunked_logits_pieces
    names its three moments) chunk by chunk: returns the head's accumulated weight gradient.
    ``gather_forward`` gathers in forward (default ``gather``), ``forward_ends`` runs at the
    model's post-forward, ``last_pre_backward`` after the head's gather for its last chunk in backward."""
    chunks, e, sbv_chunk = loss.chunks, loss.compute_bytes, loss.sbv_chunk
    # Forward: each chunk's logits from the head gathered for it; then each chunk upcast and its
    # fp32 log-softmax saved; the bf16 logits go with the forward.
    logits = []
    for _ in range(chunks):
        parameters = (gather_forward or gather)(head)
        logits += b.alloc(e * sbv_chunk)
        b.free(parameters)
    if forward_ends is not None:
        forward_ends()
    logit_gradients = []
    if loss.compiled:
        # Compiled (zeroplan.core.compiled.compiled_chunked_logits_pieces): each chunk's
        # cross-entropy keeps its bf16 logits and two fp32 values a row; its backward writes the
        # chunk's bf16 gradient, then lets the chunk go.
        rows = loss.rows
        statistics = [b.alloc(COMPILED_CROSS_ENTROPY_ROW_BYTES * rows) for _ in range(chunks)]
        for chunk in reversed(range(chunks)):
            logit_gradients += b.alloc(e * sbv_chunk)
            b.free([logits[chunk]])
            b.free(statistics[chunk])
    else:
        saved = []
        for _ in range(chunks):
            upcast = b.alloc(FP32_BYTES * sbv_chunk)
            saved.append(b.alloc(FP32_BYTES * sbv_chunk))
            b.free(upcast)
        b.free(logits)
        # Backward: each chunk's two fp32 gradients, then its bf16 logit gradient.
        for chunk in reversed(range(chunks)):
            first, second = b.alloc(FP32_BYTES * sbv_chunk), b.alloc(FP32_BYTES * sbv_chunk)
            b.free(saved[chunk])
            b.free(first)
            logit_gradients += b.alloc(e * sbv_chunk)
            b.free(second)
    # The head's backward per chunk: gathered again, its weight gradient added out of place.
    weight_gradient_bytes = loss.weight_gradient_bytes
    accumulated: list[int] = []
    for position, gradient in enumerate(logit_gradients):
        parameters = gather(head)
        if last_pre_backward is not None and position == len(logit_gradients) - 1:
            last_pre_backward()
        product = b.alloc(weight_gradient_bytes)
        if accumulated:
            total = b.alloc(weight_gradient_bytes)
            b.free(accumulated + product)
            accumulated = total
        else:
            accumulated = product
        b.free([gradient])
        b.free(parameters)
    return accumulated


def torchtitan_unchunked_loss_tensors(request: PlanRequest, terms: PeakTerms) -> tuple[int, int] | None:
    """(the bf16 logits, one fp32 logit-sized tensor) on this rank, for torchtitan's unchunked
    cross-entropy (9dec370's, or 0.3.0's with unchunked_loss; under tensor parallelism 9dec370's
    loss_parallel on the rank's vocabulary shard), or compiled (compiles_unchunked_loss) the bf16
    logits and their row statistics; None where the schedule keeps to the loss's moments (the
    chunked loss, tensor parallelism without loss_parallel, terms that are not the request's own)."""
    training = request.training
    if training.framework is not Framework.torchtitan or not training.unchunked_loss:
        return None
    if request.parallel.tp > 1 and not loss_parallel_applies(request):
        return None
    moments = loss_allocations(request, terms)
    if len(moments) != 1 or len(moments[0]) < 3:
        return None
    if compiles_unchunked_loss(request):
        # framework_loss.torchtitan_compiled_unchunked_loss_parts: the logits, the row
        # statistics, the logits' gradient, then the gathered units.
        logits, rows, gradient = moments[0][:3]
        return (logits, rows) if logits == gradient else None
    # The moment is the three fp32 tensors of logits_parts (the saved log-softmax and the two
    # gradients; loss_parallel's four: loss_parallel_logits_tensors), then the units gathered
    # beside them (fsdp_head_gathered_parts), which this schedule holds from the forward on.
    fp32 = moments[0][0]
    fp32_tensors = 4 if loss_parallel_applies(request) else 3
    if len(moments[0]) < fp32_tensors or any(p != fp32 for p in moments[0][:fp32_tensors]) or fp32 % FP32_BYTES:
        return None
    return fp32 // FP32_BYTES * training.precision.compute_bytes, fp32


# torchtitan 9dec370 train.py (as 0.3.0 trainer.py:812-828 _forward_backward_body): pred =
# model(inputs); loss = loss_fn(pred, labels); del pred; loss.backward(). Its loss_fn is
# cross_entropy_loss (0.3.0 components/loss.py:60-65): F.cross_entropy(pred.flatten(0, 1).float(),
# ...), which torch runs as log_softmax then nll_loss (torch/nn/functional.py:3555
# torch._C._nn.cross_entropy_loss; aten cross_entropy_loss), log_softmax saving its fp32 output,
# not its input. Measured on fake tensors (benchmarks/torchtitan_release_step.py's step, 8 ranks,
# 1 x 32768): the head's bf16 logits; the fp32 upcast and the log-softmax; the upcast freed, then
# the logits (del pred); in backward nll_loss's fp32 gradient and log_softmax's, the first freed
# and the saved log-softmax with it; the gradient cast to bf16 and the fp32 one freed; the head's
# weight gradient (kept to the root's post-backward) before the bf16 logit gradient goes.
def _torchtitan_unchunked_loss(b: "TraceBuilder", tensors: tuple[int, int], head_gradient_parts: list[int],
                               pre_backward, post_forward=None) -> list[int]:
    """The loss's allocations from the head's logits to the head's backward (``pre_backward``
    called when the gradient reaches the head's unit, ``post_forward`` once the logits, the
    model's output, are made); returns the head's unsharded gradients."""
    logits_bytes, fp32 = tensors
    logits = b.alloc(logits_bytes)
    if post_forward is not None:
        post_forward()
    upcast = b.alloc(fp32)
    log_softmax = b.alloc(fp32)
    b.free(upcast)
    b.free(logits)
    nll_gradient = b.alloc(fp32)
    log_softmax_gradient = b.alloc(fp32)
    b.free(nll_gradient)
    b.free(log_softmax)
    logits_gradient = b.alloc(logits_bytes)
    b.free(log_softmax_gradient)
    pre_backward()
    head_gradient = b.alloc_parts(head_gradient_parts)
    b.free(logits_gradient)
    return head_gradient


# torchtitan's unchunked loss compiled (2c8b594 components/loss.py:25-30; 0.3.0
# BaseLoss._maybe_compile), measured on fake tensors (benchmarks/compiled-loss-records chunks1):
# the head's bf16 logits, which the compiled forward saves with two fp32 values a row (max and
# log-sum-exp), so `del pred` frees nothing; the compiled backward returns the logits' bf16
# gradient while the saved values are held, and autograd frees them once it has run; the head's
# weight gradient before the bf16 logit gradient goes. The upcast, the softmax and its gradient
# stay inside inductor's fused kernels.
def _torchtitan_compiled_unchunked_loss(b: "TraceBuilder", tensors: tuple[int, int], head_gradient_parts: list[int],
                                        pre_backward, post_forward=None) -> list[int]:
    """_torchtitan_unchunked_loss's allocations for the compiled loss; ``tensors`` the bf16
    logits and the row statistics."""
    logits_bytes, row_bytes = tensors
    logits = b.alloc(logits_bytes)
    if post_forward is not None:
        post_forward()
    rows = b.alloc(row_bytes)
    logits_gradient = b.alloc(logits_bytes)
    b.free(rows)
    b.free(logits)
    pre_backward()
    head_gradient = b.alloc_parts(head_gradient_parts)
    b.free(logits_gradient)
    return head_gradient


# torch/distributed/tensor/parallel/loss.py (torch 2.6.0 and 2.13 alike), torchtitan 9dec370's
# loss under tensor parallelism: cross_entropy(pred.flatten(0, 1).float(), labels) on the
# vocab-sharded logits under loss_parallel(), then del pred and backward. DTensor's handlers run on
# the rank's shard; their local tensors, in the order they are made and freed (measured with
# zeroplan.frameworks.loss_parallel's dispatch mode, which sees them, on a fake process group):
# the bf16 logits; the fp32 upcast, `shifted` and exp(shifted), exp freed, the log-softmax, then
# `shifted`, the upcast and the logits freed (del pred); in backward
# (_nll_loss_and_log_softmax_backward) zeros_like of the log-softmax, its exp and their sum, the
# exp freed, the product with grad_output, the sum, the zeros and the saved log-softmax freed; the
# gradient cast to bf16 (the .float()'s backward) and the fp32 one freed; the head's weight
# gradient before the bf16 logit gradient goes.
def run_torchtitan_loss_parallel(b: "TraceBuilder", tensors: tuple[int, int], head_gradient_parts: list[int],
                                 pre_backward, logits_held: bool = False, post_forward=None) -> list[int]:
    """loss_parallel's allocations from the head's logits to the head's backward, as
    _torchtitan_unchunked_loss's for torch's plain cross-entropy (``logits_held``: the logits are
    a pipeline stage's output, allocated and kept elsewhere)."""
    logits_bytes, fp32 = tensors
    logits = [] if logits_held else b.alloc(logits_bytes)
    if post_forward is not None:
        post_forward()
    upcast = b.alloc(fp32)
    shifted = b.alloc(fp32)
    b.free(b.alloc(fp32))
    log_softmax = b.alloc(fp32)
    b.free(shifted)
    b.free(upcast)
    b.free(logits)
    zeros = b.alloc(fp32)
    exp = b.alloc(fp32)
    total = b.alloc(fp32)
    b.free(exp)
    product = b.alloc(fp32)
    b.free(total)
    b.free(zeros)
    b.free(log_softmax)
    logits_gradient = b.alloc(logits_bytes)
    b.free(product)
    pre_backward()
    head_gradient = b.alloc_parts(head_gradient_parts)
    b.free(logits_gradient)
    return head_gradient


# zeroplan.core.parallel.sequence_parallel: funcol's all-gather on dim 1 (its output, then the
# concatenated copy the sublayer reads, the output freed once copied) and its reduce-scatter on
# dim 1 (the row-parallel linear's partial output, its concatenated copy, the shard), once for the
# attention and once for the feed-forward; the gathered input freed after the column-parallel
# matmuls (compiled) or once the sublayer returns (eager); where funcol's gather is a view
# (SublayerCollectives.gather_copy) its output alone. Fused (asynchronous TP): the gathered input
# alone, then the stacked partials and the shard. Nothing of them is kept.
def run_sequence_parallel_forward(b: "TraceBuilder", collectives: SublayerCollectives | None) -> None:
    """One block's forward collectives under sequence parallelism (none where ``collectives``
    is None)."""
    if collectives is None:
        return
    for _ in range(SUBLAYERS):
        if collectives.fused or not collectives.gather_copy:
            gathered = b.alloc(collectives.gathered)
        else:
            output = b.alloc(collectives.gathered)
            gathered = b.alloc(collectives.gathered)
            b.free(output)
        if not collectives.held:
            b.free(gathered)
            gathered = []
        partial = b.alloc(collectives.partial)
        if not collectives.fused:
            copy = b.alloc(collectives.partial)
            b.free(partial)
            partial = copy
        shard = b.alloc(collectives.shard)
        b.free(partial)
        b.free(gathered)
        b.free(shard)


def run_sequence_parallel_recompute(b: "TraceBuilder", collectives: SublayerCollectives | None) -> None:
    """The recomputed forward's collectives at the start of a block's backward, where it reruns
    them (SublayerCollectives.recomputed), before the workspace the planner gives the rest."""
    if collectives is not None and collectives.recomputed:
        run_sequence_parallel_forward(b, collectives)
