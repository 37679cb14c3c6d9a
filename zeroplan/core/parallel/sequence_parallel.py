"""The transient tensors a sequence-parallel block's forward makes around its tensor-parallel
collectives, under torch's tensor-parallel styles (torchtitan's plan): formulas only."""

from __future__ import annotations

from zeroplan.core.parallel.collectives import recomputes_collectives
from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest

FLOAT8_BYTES = 1
"""torch.float8_e4m3fn's element."""

SUBLAYERS = 2
"""Attention and feed-forward: each gathers its input and reduce-scatters its output."""


@frozen(slots=True)
class SublayerCollectives:
    """One sublayer's forward collectives, in bytes per micro-batch on one rank."""

    gathered: int
    """The all-gathered input ([b, s, h] whole; float8 under torchao's float8 styles)."""
    partial: int
    """The row-parallel linear's partial output ([b, s, h] whole, the compute dtype)."""
    shard: int
    """The reduce-scattered output ([b, s/t, h])."""
    recomputed: bool
    """The block's backward reruns its forward, these collectives included
    (collectives.recomputes_collectives)."""
    held: bool
    """Eager: the gathered input is the sublayer's argument, alive until it returns (beside the
    scatter); compiled, inductor frees it after its last reader, the column-parallel matmuls."""
    fused: bool
    """Asynchronous TP: no concatenated copies (fused_all_gather_matmul, fused_matmul_reduce_scatter)."""
    gather_copy: bool = True
    """The gather's concatenated copy is made (False: torch 2.13's funcol returns a view)."""

    def peak(self) -> int:
        """The most of them alive at once (as run_sequence_parallel_forward makes them): the
        gather's, or the scatter's beside the gathered input where that is held."""
        gather = self.gathered if self.fused or not self.gather_copy else 2 * self.gathered
        scatter = self.partial + self.shard if self.fused else max(2 * self.partial, self.partial + self.shard)
        return max(gather, (self.gathered if self.held else 0) + scatter)


# torchtitan 9dec370 parallelisms/parallelize_llama.py apply_tp: each block's attention and
# feed_forward take their input through PrepareModuleInput(input_layouts Shard(1), desired
# Replicate()) and leave it through RowwiseParallel(output_layouts=Shard(1)); with float8 the
# styles are torchao's (float8/float8_tensor_parallel.py @eab345c PrepareFloat8ModuleInput
# casts to float8_e4m3fn before redistribute, so the input is gathered in one byte). DTensor's
# Shard(1) -> Replicate() is funcol all_gather_tensor(gather_dim=1) and Partial() -> Shard(1)
# reduce_scatter_tensor(scatter_dim=1) (torch/distributed/tensor/placement_types.py); funcol of
# December 2024 (torch/distributed/_functional_collectives.py, the runs' torch 1963fc8) gathers on
# dim 0 into a new tensor and then `torch.cat(torch.chunk(res, group_size, dim=0), dim=gather_dim)`
# (a second whole tensor, the first freed), and scatters on a dim other than 0 after
# `torch.cat(torch.chunk(self, group_size, dim=scatter_dim))` of the partial output (a whole copy
# beside it) into a shard. Each sublayer's forward so allocates two whole [b, s, h] tensors for
# its gather and two for its scatter, none of them kept past the sublayer's forward. Eager, the
# gathered input is the sublayer's argument (9dec370 models/llama/model.py Attention.forward(x,
# ...), FeedForward.forward(x)) and lives until it returns, beside the scatter's; compiled
# (apply_compile: each block one fullgraph graph), inductor's wrapper frees each buffer after its
# last reader, so the gathered input goes once the column-parallel matmuls have read it.
# torch 2.13's funcol (the torch torchtitan 0.3.0 is measured on) gathers through
# torch/_utils.py _maybe_view_chunk_cat, a view where every dim the gathered one moves across has
# size 1: on dim 1 of [b, s/t, h], at micro-batch 1 (its scatter still concatenates,
# _chunk_or_narrow_cat). The runs of 9dec370 had December 2024's funcol, which always copies.
# Asynchronous TP (apply_tp: torch._inductor.config._micro_pipeline_tp) replaces both by the
# symmetric-memory ops of torch/distributed/_symmetric_memory/__init__.py (December 2024):
# _fused_all_gather_matmul gathers the shards into one whole tensor (no concatenated copy) and
# _fused_matmul_reduce_scatter computes the partials into one whole `stacked_partials`
# (x.new_empty) and reduces them into the shard; their peer-to-peer workspaces are symmetric
# memory, outside the caching allocator.
def sequence_parallel_forward_collectives(request: PlanRequest) -> SublayerCollectives | None:
    """What each sublayer's forward collectives allocate on a rank, or None where the block runs
    none of them (no sequence parallelism, or a stack other than torchtitan's DTensor plan)."""
    parallel, training, batch = request.parallel, request.training, request.batch
    if not parallel.sequence_parallel or parallel.tp == 1 or training.framework is not Framework.torchtitan:
        return None
    tokens = batch.micro_batch_size * (batch.seq_len // parallel.cp)
    whole = tokens * request.model.hidden_size
    compute = training.precision.compute_bytes
    gathered = whole * (FLOAT8_BYTES if training.float8 is not None else compute)
    return SublayerCollectives(gathered=gathered, partial=whole * compute, shard=whole * compute // parallel.tp,
                              recomputed=recomputes_collectives(request), held=not training.compile,
                              fused=parallel.async_tp,
                              gather_copy=training.torchtitan_release == "9dec370" or batch.micro_batch_size > 1)
