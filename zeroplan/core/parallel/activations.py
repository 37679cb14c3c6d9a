"""The activations one rank of a model-parallel layout keeps: the planner's own terms for the
tensor-parallel block (zeroplan.core.parallel.tensor), the rank's 1/cp of the tokens, and the
blocks of its pipeline stages times the micro-batches its schedule keeps in flight
(zeroplan.core.parallel.pipeline). With every degree 1 each function returns the planner's own
figure."""

from __future__ import annotations

from functools import lru_cache

from zeroplan.core.activations import layer_terms, norm_bytes, outside_layers_bytes
from zeroplan.core.compiled import (
    compiled_float8_gathered_inputs_bytes,
    compiled_selective_op_tensor_parallel_extra_bytes,
    compiled_sequence_sharded_bytes,
)
from zeroplan.core.deepspeed_checkpointing import (
    checkpoint_terms,
    host_checkpoint_bytes_per_block,
    moves_checkpoints,
    newest_device_input_bytes,
    offload_engine_keeps_newest,
)
from zeroplan.core.framework_loss import (
    loss_parallel_applies,
    loss_parallel_logits_tensors,
)
from zeroplan.core.frameworks import block_input_bytes
from zeroplan.core.memo import batch_keyed
from zeroplan.core.parallel.pipeline import in_flight_chunks, rank_stage_indices
from zeroplan.core.parallel.ring_attention import torchtitan_sdpa_ring
from zeroplan.core.parallel.tensor import tensor_parallel_model
from zeroplan.core.parallel.ulysses import runs_ulysses, ulysses_logits_tensors
from zeroplan.core.parallel.units import holds_embedding, holds_head, rank_block_count
from zeroplan.core.profiles import (
    profile,
    torchtitan_keeps_input_gradients,
    torchtitan_keeps_stage_outputs,
)
from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.units import ceil_div


def chunk_request(request: PlanRequest, *, split_heads: bool) -> PlanRequest:
    """One micro-batch through one block of this rank, as a request of its own with
    nothing model-parallel: the tensor-parallel block (``split_heads``) or the whole one, and
    the rank's 1/cp of the sequence. Built without validation: only the planner reads it."""
    parallel = request.parallel
    model = _chunk_model(request.model, parallel.tp if split_heads else 1)
    # Without context parallelism the rank's sequence is the request's (its batch as it is).
    batch = request.batch if parallel.cp == 1 else request.batch.model_copy(update={"seq_len": request.batch.seq_len // parallel.cp})
    return request.model_copy(update={"model": model, "batch": batch, "parallel": _NO_MODEL_PARALLELISM})


# A layout's chunks share the model's tensor-parallel block (the plan search asks for the
# chunks of thousands of requests of a few models).
@lru_cache(maxsize=256)
def _chunk_model(model: ModelSpec, tp: int) -> ModelSpec:
    """One of the model's blocks as tensor-parallel rank 0 of ``tp`` computes it."""
    return tensor_parallel_model(model, tp).model_copy(update={"num_layers": 1})


_NO_MODEL_PARALLELISM = ParallelSpec()
"""A chunk's layout (specs are immutable: one object serves every chunk)."""


@frozen
class MicroBatchBytes:
    """What one micro-batch keeps on this rank, split the way a pipeline multiplies it."""

    per_block: int
    """Kept by one block until its backward (all of it, or what checkpointing keeps)."""
    recompute: int
    """The block a recomputing backward rebuilds: alive once, in a block's backward."""
    outside: int
    """Kept outside the blocks (the final norm's and the output projection's inputs)."""


def micro_batch_bytes(request: PlanRequest, activations) -> MicroBatchBytes:
    """Split ``activations(req) -> (kept, recompute)``, the planner's bytes of one micro-batch
    through every block of ``req``, into per-block, recompute and outside terms by evaluating
    it at one and two tensor-parallel blocks (each term is linear in the block count), then
    split the sequence-parallel terms t ways."""
    parallel = request.parallel
    return _chunk_bytes(chunk_request(request, split_heads=True), activations, parallel.tp,
                        parallel.sequence_parallel, parallel.cp)


# What micro_batch_bytes reads is one block's chunk (no pipeline rank, no model-parallel degree)
# and the layout's tp, sequence parallelism and cp: every pipeline rank and accumulation count
# of a layout shares one answer (the plan search asks for each), kept on the chunk with its
# batch cut to the sequence and the micro-batch (zeroplan.core.memo: a read of any other batch
# field is answered uncached).
@batch_keyed("seq_len", "micro_batch_size", limit=4096)
def _chunk_bytes(one: PlanRequest, activations, tp: int, sequence_parallel: bool, cp: int) -> MicroBatchBytes:
    """micro_batch_bytes from the request's one-block chunk."""
    two = one.model_copy(update={"model": one.model.model_copy(update={"num_layers": 2})})
    kept_one, recompute = activations(one)
    kept_two, _ = activations(two)
    per_block = kept_two - kept_one
    terms = MicroBatchBytes(per_block=per_block, recompute=recompute, outside=kept_one - per_block)
    if compiled_selective_op_under_tp(one, tp):
        extra = compiled_selective_op_tensor_parallel_extra_bytes(one)
        terms = MicroBatchBytes(per_block=terms.per_block + extra, recompute=terms.recompute, outside=terms.outside)
    if sequence_parallel:
        terms = sequence_parallel_bytes(one, terms, tp)
    return deepspeed_checkpoint_bytes(one, gathered_kv_bytes(cp, one, terms), tp)


def checkpointed_input_bytes(chunk: PlanRequest) -> int:
    """The block input full recomputation keeps for one block of ``chunk``: the framework's
    residual stream (zeroplan.core.frameworks.block_input_bytes), the compute dtype's for the
    reference model."""
    s, b = chunk.batch.seq_len, chunk.batch.micro_batch_size
    if chunk.training.framework is not Framework.zeroplan:
        return block_input_bytes(chunk, s, b)
    return chunk.training.precision.compute_bytes * s * b * chunk.model.hidden_size


# DeepSpeed's activation checkpointing keeps each block's input partitioned over the model-
# parallel ranks or on the host (zeroplan.core.deepspeed_checkpointing): the per-block term loses
# what leaves the device, the recomputing block gets its whole input back. The offload engine's
# inputs on the device are the rank's, whatever its micro-batches in flight (engine_inputs_bytes).
def deepspeed_checkpoint_bytes(chunk: PlanRequest, terms: MicroBatchBytes, tp: int) -> MicroBatchBytes:
    """``terms`` of a chunk with its kept block input where DeepSpeed's checkpointing keeps it."""
    if not moves_checkpoints(chunk.training):
        return terms
    moved, restored = checkpoint_terms(checkpointed_input_bytes(chunk), tp, chunk.training)
    return MicroBatchBytes(per_block=terms.per_block - moved, recompute=terms.recompute + restored,
                           outside=terms.outside)


def rank_checkpointed_input_bytes(request: PlanRequest) -> int:
    """checkpointed_input_bytes of one block of the request's rank (its tensor-parallel block, its
    1/cp of the sequence)."""
    return checkpointed_input_bytes(chunk_request(request, split_heads=True))


def engine_inputs_bytes(request: PlanRequest) -> int:
    """The block inputs DeepSpeed's offload engine keeps on this rank's device (0 without it)."""
    if not request.training.cpu_checkpointing:
        return 0
    return newest_device_input_bytes(rank_checkpointed_input_bytes(request), request.training)


def host_checkpoint_bytes(request: PlanRequest) -> int:
    """What DeepSpeed's cpu_checkpointing keeps of this rank's block inputs in host memory, at
    the peak of its micro-batches in flight (the offload engine's newest input is on the device)."""
    training = request.training
    if not training.cpu_checkpointing:
        return 0
    x = rank_checkpointed_input_bytes(request)
    newest = x if offload_engine_keeps_newest(training) else 0
    per_block = host_checkpoint_bytes_per_block(x, request.parallel.tp, training)
    return in_flight_blocks_bytes(request, rank_chunks_in_flight(request), per_block) - newest


def rank_chunks_in_flight(request: PlanRequest) -> int:
    """The micro-batch chunks the rank's pipeline schedule keeps in flight at its peak (1 without
    a pipeline)."""
    parallel = request.parallel
    return in_flight_chunks(parallel, parallel.pipeline_rank, request.batch.grad_accum_steps)


def in_flight_blocks_bytes(request: PlanRequest, chunks: int, per_block: int) -> int:
    """``per_block`` bytes kept by each of the rank's blocks for each of ``chunks`` in flight
    (each in-flight chunk is one micro-batch through one of the rank's v stages)."""
    return chunks * rank_block_count(request) * per_block // request.parallel.virtual_stages


def one_rank_activations(request: PlanRequest, activations) -> tuple[int, int]:
    """``activations(request)`` (kept, recompute) of a request without model parallelism, its
    block inputs where DeepSpeed's checkpointing keeps them."""
    kept, recompute = activations(request)
    if not moves_checkpoints(request.training):
        return kept, recompute
    moved, restored = checkpoint_terms(checkpointed_input_bytes(request), 1, request.training)
    return kept - request.model.num_layers * moved + engine_inputs_bytes(request), recompute + restored


# A stack whose context parallelism all-gathers K and V (FrameworkProfile.context_parallel_gathers_kv,
# torchtitan 0.3.0's apply_cp_to_forward under FlexAttention) saves them at the whole sequence:
# each block keeps K and V for s tokens where the rank's own are s/cp. A ring (Liu et al. 2023)
# keeps only its own and passes the rest round again in backward (torchtitan 9dec370's SDPA
# ring: its buffers are zeroplan.core.parallel.ring_attention's).
def gathered_kv_bytes(cp: int, chunk: PlanRequest, terms: MicroBatchBytes) -> MicroBatchBytes:
    """``terms`` with the gathered K and V of the other ``cp`` - 1 context-parallel ranks added."""
    if cp == 1 or not profile(chunk.training.framework).context_parallel_gathers_kv or torchtitan_sdpa_ring(chunk.training):
        return terms
    local_tokens = chunk.batch.seq_len * chunk.batch.micro_batch_size
    others = 2 * (cp - 1) * local_tokens * chunk.model.kv_size * chunk.training.precision.compute_bytes
    kept = others if chunk.training.activation_checkpointing is ActivationCheckpointing.none else 0
    rebuilt = others if terms.recompute else 0
    return MicroBatchBytes(per_block=terms.per_block + kept, recompute=terms.recompute + rebuilt, outside=terms.outside)


# Korthikanti et al. 2022, sec. 4.2.2: sequence parallelism splits over the sequence what
# tensor parallelism left whole: the norms' saved tensors, the dropout masks and (Megatron-LM
# keeps the shard and gathers it again in backward) the column-parallel linears' inputs; with
# full recomputation the kept block input is the sequence-sharded residual stream. Each such
# term keeps ceil(x / t) of its x bytes (with every one split this is the paper's
# sbh/t (34 + 5as/h)); a stack whose linears save the gathered input keeps those whole
# (FrameworkProfile.sequence_parallel_saves_gathered_inputs).
def sequence_parallel_bytes(chunk: PlanRequest, terms: MicroBatchBytes, tp: int) -> MicroBatchBytes:
    """``terms`` of a tensor-parallel chunk with its sequence-parallel parts split ``tp`` ways."""
    model, training, batch = chunk.model, chunk.training, chunk.batch
    s, b, autocast = batch.seq_len, batch.micro_batch_size, chunk.runs_under_autocast
    layer = layer_terms(model, training, s, b, autocast=autocast)
    sharded_layer = layer["norm_inputs"] + layer["hidden_dropout_masks"]
    if not profile(training.framework).sequence_parallel_saves_gathered_inputs:
        sharded_layer += layer["qkv_input"] + layer["mlp_input"]
    norm = norm_bytes(model, training, s, b, autocast=autocast)
    outside = outside_layers_bytes(model, training, s, b, autocast=autocast)
    sharded_outside = outside if not profile(training.framework).sequence_parallel_saves_gathered_inputs else norm

    def split(x: int) -> int:
        """Bytes a sequence-sharded term of x bytes gives back: x - ceil(x / t)."""
        return x - ceil_div(x, tp)

    mode = training.activation_checkpointing
    if training.compile:
        # A compiled block shards other tensors than the eager one (zeroplan.core.compiled).
        sharded_layer = compiled_sequence_sharded_bytes(chunk)
    if mode is ActivationCheckpointing.none:
        kept_sharded = sharded_layer
    elif compiled_selective_op_under_tp(chunk, tp):
        # x and the reduce-scattered output the compiled SelectiveAC block keeps.
        kept_sharded = block_input_bytes(chunk, s, b) + compiled_selective_op_tensor_parallel_extra_bytes(chunk)
    else:
        # The checkpoint keeps the block's input: the residual stream, sequence-sharded.
        kept_sharded = checkpointed_input_bytes(chunk)
    recompute_sharded = sharded_layer if terms.recompute else 0
    # A compiled float8 block keeps the float8 casts of its all-gathered inputs instead.
    gathered = compiled_float8_gathered_inputs_bytes(chunk) if training.compile else 0
    return MicroBatchBytes(per_block=terms.per_block - split(kept_sharded) + (gathered if mode is ActivationCheckpointing.none else 0),
                           recompute=terms.recompute - split(recompute_sharded) + (gathered if terms.recompute else 0),
                           outside=terms.outside - split(sharded_outside))


def compiled_selective_op_under_tp(chunk: PlanRequest, tp: int) -> bool:
    """Whether a chunk's block is torchtitan's compiled SelectiveAC under tensor parallelism,
    which keeps one [b s, h] tensor more (zeroplan.core.compiled)."""
    training = chunk.training
    return training.compile and tp > 1 and training.activation_checkpointing is ActivationCheckpointing.selective_op


def rank_activation_bytes(request: PlanRequest, activations) -> tuple[int, int]:
    """(kept, recompute): the activations the request's rank keeps at its peak, and the block it
    rebuilds in backward. ``activations`` as in micro_batch_bytes; what is kept outside the
    blocks (the final norm's and output projection's inputs) is held by the rank with the head."""
    if request.parallel.is_trivial:
        return one_rank_activations(request, activations)
    terms = micro_batch_bytes(request, activations)
    parallel = request.parallel
    chunks = rank_chunks_in_flight(request)
    kept = in_flight_blocks_bytes(request, chunks, terms.per_block)
    if holds_head(request):
        kept += last_stage_in_flight(request) * terms.outside
    if request.training.framework is Framework.megatron and parallel.pp > 1:
        kept += megatron_pipeline_embedding_mask_bytes(request)
    elif not holds_head(request) and request.training.framework is Framework.megatron_deepspeed:
        # DeepSpeed's pipeline engine keeps each in-flight micro-batch's stage output.
        from zeroplan.core.megatron_deepspeed import pipe_output_bytes

        kept += chunks * pipe_output_bytes(request)
        if holds_embedding(request):
            from zeroplan.core.megatron_deepspeed import pipe_embedding_mask_bytes, pipe_embedding_norm_bytes

            kept += chunks * (pipe_embedding_mask_bytes(request) + pipe_embedding_norm_bytes(request))
    elif request.training.framework is Framework.megatron_deepspeed and not holds_embedding(request):
        # The head's stage counts the outside-block terms, the embedding norm's input among them.
        from zeroplan.core.megatron_deepspeed import pipe_embedding_norm_bytes

        kept -= last_stage_in_flight(request) * pipe_embedding_norm_bytes(request)
    if request.training.framework is Framework.torchtitan and parallel.pp > 1:
        kept += pipeline_stage_output_bytes(request, chunks) + pipeline_input_gradient_bytes(request, chunks)
        # The receive buffers are allocated once and kept, so alive at the end of backward and
        # at the optimizer step too; they grow with the micro-batch, which the model states and
        # resident buffers do not (plan._state_terms): counted with the activations, at the
        # moments they are part of.
        kept += pipeline_receive_buffer_bytes(request) - pipeline_received_input_bytes(request, chunks)
    return kept + engine_inputs_bytes(request), terms.recompute


def megatron_pipeline_embedding_mask_bytes(request: PlanRequest) -> int:
    """What a megatron-core pipeline rank keeps of the embedding dropout masks beyond the
    outside-block terms: each in-flight micro-batch's mask on the first stage, and none on the
    head's stage, whose outside terms count one (zeroplan.core.megatron.embedding_mask_bytes)."""
    from zeroplan.core.megatron import embedding_mask_bytes, first_stage_embedding_masks

    parallel = request.parallel
    mask = embedding_mask_bytes(request)
    kept = 0
    if holds_embedding(request):
        kept += first_stage_embedding_masks(parallel.pp, parallel.virtual_stages, request.batch.grad_accum_steps) * mask
    if holds_head(request):
        kept -= last_stage_in_flight(request) * mask
    return kept


# torch distributed/pipelining/stage.py forward_one_chunk keeps a stage's output in fwd_cache
# until backward_one_chunk pops it (2.6.0 and 2.13 alike); the checkpointed blocks that made it
# save their inputs, not it. Under torchtitan 9dec370 (profiles.torchtitan_keeps_stage_outputs)
# every stage also keeps each micro-batch's output in output_chunks to the next step's
# clear_runtime_states (torch 2.6.0 stage.py:703, :514): at the rank's in-flight peak all v m
# are alive, the last stage's being its bf16 logits (9dec370 models/llama/model.py:445, the
# vocab-sharded shard under loss_parallel). Counted on torch's own schedules on a fake process
# group (benchmarks/torchtitan_pipeline_outputs.py: live outputs = chunks in flight under
# torch 2.13 with return_outputs=False; 8 on every 1F1B rank, 16 on every interleaved one, under
# torch 2.6.0, pp 8, 8 micro-batches). The loss's terms hold none of these logits: outside a
# pipeline train.py's `del pred` frees them before backward (zeroplan.core.framework_loss), but a
# stage's output stays in fwd_cache through its loss's backward and in output_chunks after, so
# under 9dec370 the last stage holds all m at its loss's backward, the current one's included.
def pipeline_stage_output_bytes(request: PlanRequest, chunks: int) -> int:
    """The stage outputs the rank's pipeline stages hold at its in-flight peak (under 0.3.0
    beyond the loss's micro-batches in flight)."""
    parallel = request.parallel
    chunk = chunk_request(request, split_heads=True)
    s, b = chunk.batch.seq_len, chunk.batch.micro_batch_size
    residual = stage_boundary_bytes(request)
    head = holds_head(request)
    loss_in_flight = last_stage_in_flight(request) if head else 0
    if not torchtitan_keeps_stage_outputs(request.training):
        return (chunks - loss_in_flight) * residual
    microbatches = request.batch.grad_accum_steps
    logits = chunk.model.vocab_size * s * b * request.training.precision.compute_bytes
    return (parallel.virtual_stages - head) * microbatches * residual + microbatches * logits * head


def stage_boundary_bytes(request: PlanRequest) -> int:
    """One tensor a pipeline stage sends or receives for one micro-batch: the residual stream
    (torchtitan's TP plan hands each block's output on as the local sequence shard under
    sequence parallelism)."""
    chunk = chunk_request(request, split_heads=True)
    residual = block_input_bytes(chunk, chunk.batch.seq_len, chunk.batch.micro_batch_size)
    return ceil_div(residual, request.parallel.tp) if request.parallel.sequence_parallel else residual


def _receiving_stages(request: PlanRequest) -> tuple[int, int]:
    """(stages of the rank that receive activations, stages that receive gradients): every stage
    but the pipeline's first, every stage but its last."""
    parallel = request.parallel
    indices = rank_stage_indices(parallel, parallel.pipeline_rank)
    last = parallel.pp * parallel.virtual_stages - 1
    return sum(1 for i in indices if i != 0), sum(1 for i in indices if i != last)


# torch distributed/pipelining/stage.py allocates a receive buffer per micro-batch for every
# activation a non-first stage receives (2.6.0 _prepare_forward_infra :1433; 2.13
# _setup_forward_recv_info :2270) and for every gradient a non-last stage receives (2.6.0
# _prepare_backward_infra :299 via _create_grad_recv_info; 2.13 :330, :2314), once, at the first
# step, and keeps them for every later one. Counted on torch's own schedules on a fake process
# group (benchmarks/torchtitan_pipeline_outputs.py, pp 8, 8 micro-batches, torch 2.6.0 and 2.13
# alike): 1F1B ranks 1-6 hold 8 + 8, rank 0 8 gradient buffers, rank 7 8 activation buffers;
# interleaved 1F1B 16 + 16 on ranks 1-6, 8 + 16 on rank 0, 16 + 8 on rank 7.
def pipeline_receive_buffer_bytes(request: PlanRequest) -> int:
    """The receive buffers of a torchtitan pipeline rank (allocated once, kept for good)."""
    parallel = request.parallel
    if request.training.framework is not Framework.torchtitan or parallel.pp == 1:
        return 0
    activations, gradients = _receiving_stages(request)
    return (activations + gradients) * request.batch.grad_accum_steps * stage_boundary_bytes(request)


# The micro-batch a non-first stage runs on is its receive buffer itself (torch 2.6.0 stage.py
# _retrieve_recv_activations :537, 2.13 :635; the benchmark checks every stage input's storage
# is one of the buffers'), and full recomputation's checkpoint saves each block's input: the
# first block of such a stage saves the buffer that pipeline_receive_buffer_bytes counts.
def pipeline_received_input_bytes(request: PlanRequest, chunks: int) -> int:
    """The in-flight chunks' saved stage inputs that are receive buffers (counted there)."""
    if request.training.activation_checkpointing is not ActivationCheckpointing.full:
        return 0
    v = request.parallel.virtual_stages
    receiving, _ = _receiving_stages(request)
    # A rank with the first stage runs its chunks over v stages, one of them not receiving: the
    # in-flight chunks are taken spread over the stages, as rank_activation_bytes spreads them.
    return chunks * receiving * stage_boundary_bytes(request) // v


# The gradient of a non-first stage's input, made at its backward and sent to the previous
# stage: torch 2.6.0 leaves it on the receive buffer (_backward.py:359) until the next step's
# clear_runtime_states (stage.py:525), so at the rank's in-flight peak (after its last forward)
# every backward done so far left one (profiles.torchtitan_keeps_input_gradients); torch 2.13
# drops it (_backward.py:450) and only Schedule1F1B's bwd_sends (schedules.py:1116) still
# holds the previous backward's at the next. Counted on torch's own schedules
# (benchmarks/torchtitan_pipeline_outputs.py, pp 8, 8 micro-batches): torch 2.6.0 v m - chunks
# on every rank but 0 (1F1B 1..7, interleaved 0..7), torch 2.13 1 under 1F1B, 0 interleaved.
def pipeline_input_gradient_bytes(request: PlanRequest, chunks: int) -> int:
    """The input gradients the rank's non-first stages hold at its in-flight peak."""
    parallel = request.parallel
    receiving, _ = _receiving_stages(request)
    if torchtitan_keeps_input_gradients(request.training):
        held = min(max(parallel.virtual_stages * request.batch.grad_accum_steps - chunks, 0),
                   receiving * request.batch.grad_accum_steps)
    else:
        held = 1 if receiving and parallel.pp_schedule is PipelineSchedule.one_f_one_b else 0
    return held * stage_boundary_bytes(request)


def last_stage_in_flight(request: PlanRequest) -> int:
    """Micro-batches whose loss-side activations the last stage keeps at once: all of them under
    GPipe, one under the 1F1B family (its backward follows each forward)."""
    parallel = request.parallel
    if parallel.pp == 1 or parallel.pp_schedule is not PipelineSchedule.gpipe:
        return 1
    return request.batch.grad_accum_steps


def rank_logits_pieces(request: PlanRequest, pieces) -> tuple[int, ...]:
    """The loss's bytes at each of its moments on this rank: the tensor-parallel vocabulary
    columns of the rank's 1/cp of the tokens; nothing on a rank without the head."""
    if request.parallel.is_trivial:
        return _of_sequences(request, pieces)
    if not holds_head(request):
        return (0,)
    chunk = chunk_request(request, split_heads=True)
    scale = last_stage_in_flight(request)
    if loss_parallel_applies(request):
        # torchtitan 9dec370's loss_parallel (zeroplan.core.framework_loss): its own moment.
        return tuple(scale * sum(moment) for moment in _of_sequences(chunk, loss_parallel_logits_tensors))
    if runs_ulysses(request):
        # Megatron-DeepSpeed's GPTModel loss under Ulysses (zeroplan.core.parallel.ulysses).
        return tuple(scale * sum(moment) for moment in _of_sequences(chunk, ulysses_logits_tensors))
    return tuple(scale * piece for piece in _of_sequences(chunk, pieces))


# A micro-batch's activations and loss pieces are those of its sequences: the accumulation
# counts the plan search and fit ask for share one answer, kept on the request with its batch
# cut to the sequence and the micro-batch (zeroplan.core.memo: a function that reads another
# batch field is answered uncached).
@batch_keyed("seq_len", "micro_batch_size", limit=4096)
def _of_sequences(request: PlanRequest, function):
    """``function(request)``."""
    return function(request)


def rank_logits_tensors(request: PlanRequest, tensors) -> tuple[tuple[int, ...], ...]:
    """rank_logits_pieces' moments as their tensors (``tensors`` gives a request's, moment by
    moment): the rank's chunk's, once per micro-batch in flight."""
    if request.parallel.is_trivial:
        return tensors(request)
    if not holds_head(request):
        return ((),)
    chunk = chunk_request(request, split_heads=True)
    scale = last_stage_in_flight(request)
    if loss_parallel_applies(request):
        return tuple(scale * tuple(moment) for moment in loss_parallel_logits_tensors(chunk))
    if runs_ulysses(request):
        return tuple(scale * tuple(moment) for moment in ulysses_logits_tensors(chunk))
    return tuple(scale * tuple(moment) for moment in tensors(chunk))


def rank_workspace_bytes(request: PlanRequest, workspace) -> int:
    """The residual-stream gradients a block's backward reads and writes, on this rank."""
    if request.parallel.is_trivial:
        return workspace(request)
    whole = workspace(chunk_request(request, split_heads=False))
    # The residual stream's gradients are sequence-sharded under sequence parallelism.
    return ceil_div(whole, request.parallel.tp) if request.parallel.sequence_parallel else whole
