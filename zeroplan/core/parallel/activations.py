"""The activations one rank of a model-parallel layout keeps: the planner's own terms for the
tensor-parallel block (zeroplan.core.parallel.tensor), the rank's 1/cp of the tokens, and the
blocks of its pipeline stages times the micro-batches its schedule keeps in flight
(zeroplan.core.parallel.pipeline). With every degree 1 each function returns the planner's own
figure."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.parallel.pipeline import in_flight_chunks
from zeroplan.core.parallel.tensor import sequence_parallel_layer_bytes, tensor_parallel_model
from zeroplan.core.parallel.units import holds_head, rank_block_count
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.request import PlanRequest


def chunk_request(request: PlanRequest, num_layers: int, *, split_heads: bool) -> PlanRequest:
    """One micro-batch through ``num_layers`` blocks of this rank, as a request of its own with
    nothing model-parallel: the tensor-parallel block (``split_heads``) or the whole one, and
    the rank's 1/cp of the sequence. Built without validation: only the planner reads it."""
    model = tensor_parallel_model(request.model, request.parallel.tp) if split_heads else request.model
    model = model.model_copy(update={"num_layers": num_layers})
    batch = request.batch.model_copy(update={"seq_len": request.batch.seq_len // request.parallel.cp})
    return request.model_copy(update={"model": model, "batch": batch, "parallel": ParallelSpec()})


@dataclass(frozen=True)
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
    it at one and two blocks: each term is linear in the block count."""
    parallel = request.parallel
    sequence_parallel = parallel.sequence_parallel
    one = chunk_request(request, 1, split_heads=not sequence_parallel)
    two = chunk_request(request, 2, split_heads=not sequence_parallel)
    kept_one, recompute = activations(one)
    kept_two, _ = activations(two)
    per_block = kept_two - kept_one
    outside = kept_one - per_block
    if sequence_parallel:
        # Korthikanti et al. 2022 sec. 4.2.2: every term of the block and the norms outside it
        # split t ways over the sequence.
        tp = parallel.tp
        return MicroBatchBytes(per_block=sequence_parallel_layer_bytes(per_block, tp),
                               recompute=sequence_parallel_layer_bytes(recompute, tp),
                               outside=sequence_parallel_layer_bytes(outside, tp))
    return MicroBatchBytes(per_block=per_block, recompute=recompute, outside=outside)


def rank_activation_bytes(request: PlanRequest, activations) -> tuple[int, int]:
    """(kept, recompute): the activations the request's rank keeps at its peak, and the block it
    rebuilds in backward. ``activations`` as in micro_batch_bytes; what is kept outside the
    blocks (the final norm's and output projection's inputs) is held by the rank with the head."""
    if request.parallel.is_trivial:
        return activations(request)
    terms = micro_batch_bytes(request, activations)
    parallel = request.parallel
    blocks = rank_block_count(request)
    microbatches = request.batch.grad_accum_steps
    chunks = in_flight_chunks(parallel, parallel.pipeline_rank, microbatches)
    # Each in-flight chunk is one micro-batch through one of the rank's v stages.
    kept = chunks * blocks * terms.per_block // parallel.virtual_stages
    if holds_head(request):
        kept += last_stage_in_flight(request) * terms.outside
    return kept, terms.recompute


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
        return pieces(request)
    if not holds_head(request):
        return (0,)
    chunk = chunk_request(request, 1, split_heads=True)
    scale = last_stage_in_flight(request)
    return tuple(scale * piece for piece in pieces(chunk))


def rank_workspace_bytes(request: PlanRequest, workspace) -> int:
    """The residual-stream gradients a block's backward reads and writes, on this rank."""
    if request.parallel.is_trivial:
        return workspace(request)
    whole = workspace(chunk_request(request, 1, split_heads=False))
    return sequence_parallel_layer_bytes(whole, request.parallel.tp) if request.parallel.sequence_parallel else whole
