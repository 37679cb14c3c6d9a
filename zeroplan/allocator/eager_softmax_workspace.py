"""A recomputing block's backward workspace under transformers' eager attention, as the
scores-sized tensors its attention core makes and frees, in their order (where
zeroplan.core.hf_eager_backward applies: hf, eager attention, not compiled). Elsewhere the
schedules allocate the workspace as one tensor (schedule._workspace_parts).

The order is the one transformers' own LlamaDecoderLayer shows on the CPU under torch's
non-reentrant checkpoint (tests/test_eager_softmax_workspace.py logs it), plus the CUDA
kernel's `grad * output` product the CPU kernel does not make."""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.core.frameworks import framework_recompute_bytes
from zeroplan.core.hf_eager_backward import (
    freed_before_softmax_backward_parts, kept_score_bytes, runs_eager_softmax, score_elements, softmax_backward_extra_bytes,
    softmax_element_bytes, softmax_input_gradient_bytes,
)
from zeroplan.core.transformers_release import opt_clamp_score_bytes
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing


class _Sequence:
    """Allocations and frees in order, as steps (eager_softmax_workspace), with the most bytes
    alive at once; a zero-byte allocation makes no step."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.sizes: list[int] = []
        self.emitted: list[int | None] = []
        """Each allocation's place among the steps' allocations (None: zero bytes)."""
        self.allocations = self.alive = self.peak = 0
        self.values = self.output = self.cast = self.after = -1

    def alloc(self, size: int) -> int:
        self.sizes.append(size)
        self.emitted.append(self.allocations if size else None)
        if size:
            self.allocations += 1
            self.steps.append(size)
            self.alive += size
            self.peak = max(self.peak, self.alive)
        return len(self.sizes) - 1

    def free(self, *indices: int) -> None:
        for index in indices:
            if self.emitted[index] is not None:
                self.steps.append(~self.emitted[index])
                self.alive -= self.sizes[index]


# transformers 4.56.2 models/llama/modeling_llama.py eager_attention_forward (lines 170-196; 4.31.0
# LlamaAttention.forward, lines 327-347, the same ops with `/ math.sqrt(head_dim)`):
#   attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling      # s1, s2
#   attn_weights = attn_weights + causal_mask                                     # s3
#   attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
#   attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
#   attn_output = torch.matmul(attn_weights, value_states)
# torch 2.13 SoftMax.cpp softmax: a bf16 input (any but CUDA fp16 under dtype float) is converted
# to fp32 (a temporary) before _softmax; the old attn_weights (s3) goes when the name is rebound,
# after the cast of the probabilities. Backward, last op first (autograd's engine.cpp runs the
# node created last; each node's saved tensors go once it has run): softmax@V's backward writes
# the probabilities' gradient, then frees the probabilities and V; the cast's backward converts
# that gradient to fp32; _softmax_backward_data allocates its output, and on CUDA
# softmax_backward_cuda_out the product tmp = grad * output (SoftMax.cu), freed once the kernel
# ran, then the saved output and the incoming gradient go; the input's conversion's backward
# casts the result back, the scaling's backward (MulBackward0 / DivBackward0) writes a new
# tensor, the mask's addition passes it on, and QK^T's backward reads it.
def eager_softmax_workspace(request: PlanRequest, workspace_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the block's first forward under the checkpoint, its backward's workspace
    (``workspace_bytes``, PeakTerms.workspace)) as steps: a positive step allocates that many
    bytes, a negative one frees the allocation ~step (0-based, in the order of the steps'
    allocations); what is alive at the end is freed with the block's saved tensors. Empty where
    the workspace is one tensor: outside runs_eager_softmax, without full recomputation (the
    tensors freed before the softmax's backward are then the forward's saved tensors, not the
    workspace's), under model parallelism, where the softmax's gradients add nothing to the
    block's backward (softmax_backward_extra_bytes 0), for OPT's clamp, or where the steps would
    hold more than the workspace at once."""
    training = request.training
    if (not runs_eager_softmax(request) or training.activation_checkpointing is not ActivationCheckpointing.full
            or not request.parallel.is_trivial or opt_clamp_score_bytes(request.model, training)):
        return (), ()
    extra = softmax_backward_extra_bytes(request)
    recompute = framework_recompute_bytes(request)
    probabilities, values, after = freed_before_softmax_backward_parts(request)
    kept = kept_score_bytes(request)
    others = recompute - probabilities - values - after - kept
    rest = workspace_bytes - recompute - extra
    if extra <= 0 or others < 0 or rest < 0:
        return (), ()
    scores = score_elements(request)
    e = training.precision.compute_bytes
    output_bytes, input_gradient_bytes = softmax_element_bytes(request), softmax_input_gradient_bytes(request)
    converts_input = input_gradient_bytes != e
    casts_output = output_bytes != e

    sizes = _Sizes(rest, others, values, e * scores, output_bytes * scores if converts_input else 0, kept,
                   probabilities, after)
    forward, backward = _rebuild(sizes, forward=True), _rebuild(sizes, forward=False)
    _backward_to_softmax(backward, sizes, casts_output, e, output_bytes, input_gradient_bytes, scores)
    # Never more at once than the planner's workspace (its block-backward moment).
    if backward.peak > workspace_bytes or forward.peak > backward.peak:
        return (), ()
    return tuple(forward.steps), tuple(backward.steps)


class _Sizes(NamedTuple):
    rest: int
    others: int
    values: int
    score: int
    """The scores in the compute dtype."""
    converted: int
    """The softmax's fp32 copy of its input (0: none)."""
    output: int
    probabilities: int
    after: int


def _rebuild(z: _Sizes, forward: bool) -> _Sequence:
    """The block's forward up to what it saves after the core: the first forward under the
    checkpoint (``forward``: the softmax's output is not kept) or the backward's rerun, after
    the residual stream's gradients and what else the planner's workspace holds."""
    q = _Sequence()
    if not forward:
        q.alloc(z.rest)
    q.alloc(0 if forward else z.others)
    q.values = q.alloc(0 if forward else z.values)
    s1 = q.alloc(z.score)
    s2 = q.alloc(z.score)
    q.free(s1)
    s3 = q.alloc(z.score)
    q.free(s2)
    converted = q.alloc(z.converted)
    q.output = q.alloc(z.output)
    q.free(converted)
    q.cast = q.alloc(z.probabilities)
    q.free(s3)
    if forward:
        q.free(q.output)
    q.after = q.alloc(0 if forward else z.after)
    return q


def _backward_to_softmax(q: _Sequence, z: _Sizes, casts_output: bool, e: int, output_bytes: int,
                         input_gradient_bytes: int, scores: int) -> None:
    """The rerun block's backward through its attention core (after _rebuild)."""
    # What the block saved after the core goes; softmax@V's gradient of the probabilities.
    q.free(q.after)
    gradient = q.alloc(e * scores if casts_output else output_bytes * scores)
    if z.probabilities > (e * scores if casts_output else 0):
        # Attention dropout's backward (native_dropout_backward: grad * mask * scale).
        dropped = q.alloc(e * scores if casts_output else output_bytes * scores)
        q.free(gradient)
        gradient = dropped
    q.free(q.cast, q.values)
    if casts_output:
        upcast = q.alloc(output_bytes * scores)
        q.free(gradient)
        gradient = upcast
    grad_input = q.alloc(input_gradient_bytes * scores)
    q.free(q.alloc(output_bytes * scores))  # tmp = grad * output
    q.free(q.output, gradient)
    if input_gradient_bytes != e:
        downcast = q.alloc(e * scores)
        q.free(grad_input)
        grad_input = downcast
    scaled = q.alloc(e * scores)
    q.free(grad_input, scaled)


def peak_tensors(steps: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of the allocations eager_softmax_workspace's ``steps`` hold at their most bytes
    alive at once (the first such moment), in allocation order."""
    sizes: list[int] = []
    alive: dict[int, int] = {}
    peak_bytes, at_peak = 0, ()
    for step in steps:
        if step > 0:
            alive[len(sizes)] = step
            sizes.append(step)
        else:
            del alive[~step]
        if sum(alive.values()) > peak_bytes:
            peak_bytes, at_peak = sum(alive.values()), tuple(alive.values())
    return at_peak


def record_workspace(b: TraceBuilder, steps: tuple[int, ...]) -> list[int]:
    """Record eager_softmax_workspace's steps in ``b``; the ids still alive at their end."""
    if not steps:
        return []  # most blocks make none: asked once a block, forward and backward
    ids: list[int] = []
    alive: set[int] = set()
    for step in steps:
        if step > 0:
            ids += b.alloc(step)
            alive.add(ids[-1])
        else:
            b.free([ids[~step]])
            alive.discard(ids[~step])
    return [ident for ident in ids if ident in alive]
