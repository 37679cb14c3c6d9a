"""DeepSpeed-Ulysses sequence parallelism as Megatron-DeepSpeed runs it: the fork's
--ds-sequence-parallel-size P, planned as cp P under framework megatron-deepspeed (the fork has no
other context parallelism). Fork paths are microsoft/Megatron-DeepSpeed@f4157bea69f3df8c6cb66f2ebcda66ba03d1288e;
DeepSpeed paths deepspeed/... in 0.19.8. Nothing here imports torch.

What the rest of the planner already does for cp P is the fork's too: every rank embeds and runs
its blocks on its own s/P tokens (pretrain_gpt.py:133-147 get_batch slices tokens, positions and
labels; zeroplan.core.parallel.activations.chunk_request), the data-parallel degree is the world
over tp x P x pp (megatron/arguments.py:101-107), and DeepSpeed builds BF16_Optimizer or the ZeRO
optimizer over the sequence-data-parallel group of dp x P ranks (megatron/core/parallel_state.py:
210-222; runtime/engine.py:2626, :2683 dp_process_group=seq_data_parallel_group), over which it
all-reduces the gradients too (engine.py _reduce_non_expert_gradients, :3884: the sum over the P
ranks' partial gradients, averaged over dp): PlanRequest.state_group_size. This module adds what
the all-to-alls and the fork's loss under Ulysses add.
"""

from __future__ import annotations

from zeroplan.core.collective import Collective, CollectiveOp, Phase, make_collective
from zeroplan.core.parallel.units import rank_block_count
from zeroplan.specs.parallel import is_ulysses
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.units import FP32_BYTES

ALL_TO_ALLS_PER_BLOCK = 4
"""deepspeed/sequence/layer.py DistributedAttention.forward (:550-579): one _SeqAllToAll each for
q, k and v (scattering heads, gathering the sequence) and one for the context (back); the
backward of each runs the opposite all-to-all (:457-462)."""


def runs_ulysses(request: PlanRequest) -> bool:
    """Whether the request's cp is DeepSpeed-Ulysses (zeroplan.specs.parallel.is_ulysses)."""
    return is_ulysses(request.parallel, request.training.framework)


def local_q_bytes(request: PlanRequest) -> int:
    """X: one rank's q before its all-to-all, [b, s/P, heads, head_dim] in the compute dtype (the
    size of every all-to-all's input and output: each moves a tensor of X bytes)."""
    batch, model = request.batch, request.model
    tokens = batch.micro_batch_size * (batch.seq_len // request.parallel.cp)
    return request.training.precision.compute_bytes * tokens * model.num_heads * model.head_size


# deepspeed/sequence/layer.py single_all_to_all (:270-307) with the layouts of
# _generate_layout_params (:49-88), batch_dim_idx 0 (the fork's flash path, transformer.py:835-846):
# pre_all2all_fun (:106-113) copies the input to its reshape().contiguous() (a copy only for a
# non-contiguous input) and then to the permute's .contiguous(), rebinding the name, so the first
# copy is freed once the second is made; torch.empty_like makes the output (:296); post_all2all
# (:91-103) copies the output's permute. Of the two permutes, the one that moves the batch
# dimension past the P chunks ((1, 0, 2, 3, 4): the post-exchange one when scattering heads, the
# pre-exchange one when gathering them) is a view at batch 1. Measured on DeepSpeed's own code on
# gloo (benchmarks/ulysses_attention_records.py; tests/test_ulysses.py checks this rule against
# each recorded call).
def all_to_all_peak_bytes(x_bytes: int, batch: int, scatters_heads: bool, input_contiguous: bool) -> int:
    """The most bytes of its own storages (buffers and result) one single_all_to_all holds at once."""
    if batch > 1:
        # Both permutes copy: input_t, the output and the post-exchange copy.
        return 3 * x_bytes
    if scatters_heads:
        # The pre-exchange permute copies (after any contiguous copy, which it frees); the
        # post-exchange one is a view.
        return 2 * x_bytes
    # The pre-exchange permute is a view: input_t is the input, or its contiguous copy.
    return (2 if input_contiguous else 3) * x_bytes


# The fork's calls (transformer.py:835-846, flash attention): forward q, k, v scatter heads from
# the contiguous rearranged copies (:839-840) and the context gathers them back from the flash
# output (contiguous); backward, the context's gradient scatters heads from the permuted view the
# rearrange at :846 hands back (non-contiguous), and dq, dk, dv gather them from the flash
# backward's (contiguous) outputs. The largest is counted on top of the block's backward moment,
# as zeroplan.core.parallel.ring_attention counts the ring's: one call runs at a time, and a
# recomputing backward's forward calls are no larger than its backward ones.
FORK_CALLS = ((True, True), (False, True), (True, False), (False, True))
"""(scatters_heads, input_contiguous) of the fork's all-to-alls: forward q/k/v, forward context,
backward context gradient, backward dq/dk/dv."""


def ulysses_all_to_all_bytes(request: PlanRequest) -> int:
    """The largest all-to-all's buffers on the rank (0 without Ulysses)."""
    if not runs_ulysses(request):
        return 0
    x = local_q_bytes(request)
    b = request.batch.micro_batch_size
    return max(all_to_all_peak_bytes(x, b, heads, contiguous) for heads, contiguous in FORK_CALLS)


def recomputes_forward(request: PlanRequest) -> bool:
    """Whether the backward reruns the blocks' forward, all-to-alls included (full recomputation:
    DeepSpeed's CheckpointFunction reruns the whole block)."""
    return request.training.activation_checkpointing is ActivationCheckpointing.full


# Each all-to-all moves X bytes on every rank, (P - 1)/P of them to the other ranks
# (CollectiveOp.all_to_all); four per block forward, four backward, four again in a recomputing
# backward. The sequence-parallel group is P consecutive ranks (parallel_state.py:200-206): it
# crosses a node only when P is above the GPUs of one. The attention waits for each (blocking).
def ulysses_collectives(request: PlanRequest) -> list[Collective]:
    """The rank's DeepSpeed-Ulysses all-to-alls of one step."""
    if not runs_ulysses(request):
        return []
    cp, e = request.parallel.cp, request.training.precision.compute_bytes
    calls = ALL_TO_ALLS_PER_BLOCK * rank_block_count(request)
    x = local_q_bytes(request)
    accum = request.batch.grad_accum_steps
    spans = cp > request.cluster.gpus_per_node
    result = [
        make_collective(CollectiveOp.all_to_all, Phase.forward, "Ulysses q, k, v and context all-to-alls",
                        [x] * calls, cp, accum, spans, e, blocking=True),
        make_collective(CollectiveOp.all_to_all, Phase.backward, "Ulysses gradient all-to-alls",
                        [x] * calls, cp, accum, spans, e, blocking=True),
    ]
    if recomputes_forward(request):
        result.append(make_collective(CollectiveOp.all_to_all, Phase.backward, "Ulysses q, k, v and context all-to-alls",
                                      [x] * calls, cp, accum, spans, e, blocking=True))
    return result


# Under Ulysses the fork runs without its pipeline engine (examples_deepspeed/sequence_parallel/
# ds_pretrain_gpt_1.3B_seq_parallel_32k.sh:143-144, :322-324 --no-pipeline-parallel; its
# get_batch_pipe, pretrain_gpt.py:176-205, does not slice the sequence), so GPTModel's
# post_language_model_processing (megatron/model/gpt_model.py:39-75) makes the loss:
# parallel_lm_logits gives the [s/P, b, V] logits in the compute dtype, kept in `output` through
# the call; vocab_sequence_parallel_cross_entropy(output.float(), labels)
# (megatron/core/sequence_parallel/cross_entropy.py:10-52) takes their fp32 copy, makes its
# softmax (saved) and softmax.log() for the nll_loss (freed when the forward returns, as is the
# fp32 copy: nothing saves it). Its backward turns the softmax into the gradient in place and
# .float()'s backward casts it to the compute dtype. The all-gathered [s, b] fp32 losses and their
# transposes are s b floats, left out as the planner leaves out the norms' statistics.
def ulysses_logits_tensors(chunk: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The loss's tensors at its two moments for a rank's chunk of s/P tokens: the forward's
    (logits, their fp32 copy, softmax, its log) and the backward's (fp32 gradient, its cast)."""
    logits = chunk.batch.seq_len * chunk.batch.micro_batch_size * chunk.model.vocab_size
    compute = chunk.training.precision.compute_bytes
    forward = (compute * logits, FP32_BYTES * logits, FP32_BYTES * logits, FP32_BYTES * logits)
    backward = (FP32_BYTES * logits, compute * logits)
    return forward, backward
