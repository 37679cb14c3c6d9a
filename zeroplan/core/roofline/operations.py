"""The kernels of one training step on one GPU, each with the FLOPs it executes and the bytes it
moves through device memory: matrix products by shape, the attention core, and the memory-bound
passes between them (norms, rotary embedding, activation, residual adds, loss, embedding).

Counts follow the FLOP model of zeroplan.core.flops exactly (tests/test_roofline.py checks the
sums), so the two step-time models differ only in the rate each FLOP runs at. Bytes are the
tensors each eager kernel reads and writes once (torch's eager kernels do not fuse across ops);
a weight is read in the compute dtype. Symbols per token: h width, q and kv the query and
key/value projection widths, F the MLP's hidden width a token passes through, V vocabulary,
a bytes per activation element, s sequence length.
"""

from enum import Enum
from functools import lru_cache

from pydantic import ConfigDict, Field

from zeroplan.core.flops import (
    MATMUL_FLOPS_PER_MULTIPLY_ADD, attention_backward_over_forward, attention_forward_flops_per_token,
    early_stop_skipped_flops_per_token, executed_causal_fraction,
)
from zeroplan.core.params import ParamTensor, block_tensors
from zeroplan.core.profiles import profile
from zeroplan.specs.base import Frozen
from zeroplan.specs.model import ModelSpec, PositionKind
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, TrainingSpec

FP32_BYTES = 4


class OpKind(str, Enum):
    matmul = "matmul"
    attention = "attention"
    memory = "memory"


class OpPass(str, Enum):
    """When the kernel runs: the forward, the backward, the backward's recomputation of
    checkpointed forward work, or the optimizer step."""

    forward = "forward"
    backward = "backward"
    recompute = "recompute"
    optimizer = "optimizer"


class Operation(Frozen):
    """One kind of kernel of the step, its work summed over every call (layers, micro-batches)."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    name: str
    kind: OpKind
    op_pass: OpPass
    flops: float = Field(ge=0)
    moved_bytes: float = Field(ge=0)
    """Bytes read plus bytes written in device memory."""
    exponentials: float = Field(default=0, ge=0)
    """Softmax exponentials the attention core computes (attention only)."""
    calls: int = Field(default=1, ge=0)


# A matmul of (m x k) by (k x n): 2mkn FLOPs (Kaplan et al. 2020, sec. 2.1), reading both
# operands and writing the product once each.
def matmul(name: str, op_pass: OpPass, m: float, k: float, n: float, element_bytes: int, calls: int) -> Operation:
    return Operation(name=name, kind=OpKind.matmul, op_pass=op_pass, calls=calls,
                     flops=calls * MATMUL_FLOPS_PER_MULTIPLY_ADD * m * k * n,
                     moved_bytes=calls * element_bytes * (m * k + k * n + m * n))


def memory_pass(name: str, op_pass: OpPass, moved_bytes: float, calls: int) -> Operation:
    moved = calls * moved_bytes
    # The flat-HFU model builds a dozen of these for every new batch shape: built unvalidated
    # (Frozen.trusted) where the values are what validation would keep (the float fields made
    # floats as it makes them); anything else takes validation's own answer or error.
    if type(name) is str and type(op_pass) is OpPass and type(calls) is int and calls >= 0 and moved >= 0:
        return Operation.trusted(name=name, kind=OpKind.memory, op_pass=op_pass, flops=0.0, moved_bytes=float(moved),
                                 calls=calls)
    return Operation(name=name, kind=OpKind.memory, op_pass=op_pass, flops=0, moved_bytes=moved, calls=calls)


def _routed_share(model: ModelSpec, tensor: ParamTensor) -> float:
    """Share of the tokens a block's weight sees: k/E for a routed expert (balanced routing,
    Fedus et al. 2022, sec. 2), all of them otherwise."""
    if tensor.name.startswith("mlp.experts."):
        return model.experts_per_token / model.num_experts
    return 1.0


def _linear_weights(model: ModelSpec, moe: bool) -> list[ParamTensor]:
    """The block's matrices (stored (out, in), as torch's nn.Linear)."""
    return [t for t in block_tensors(model, moe) if len(t.shape) == 2]


# Forward: out[T, n] = x[T, k] W^T. Backward (Narayanan et al. 2021, sec. 5.1): the input's
# gradient dx[T, k] = dy[T, n] W and the weight's dW[n, k] = dy^T x, each a product of the
# forward's size.
def block_matmuls(model: ModelSpec, moe: bool, tokens: int, element_bytes: int, op_pass: OpPass, calls: int,
                  only: tuple[str, ...] | None = None) -> list[Operation]:
    """The matrix products of ``calls`` blocks for ``tokens`` tokens each (``only``: weight-name
    suffixes to keep, for a recomputation that reruns some of them)."""
    ops = []
    for tensor in _linear_weights(model, moe):
        if only is not None and not tensor.name.endswith(only):
            continue
        out_features, in_features = tensor.shape
        rows = tokens * _routed_share(model, tensor)
        name = tensor.name.removesuffix(".weight")
        if op_pass is OpPass.backward:
            ops.append(matmul(f"{name} input grad", op_pass, rows, out_features, in_features, element_bytes, calls))
            ops.append(matmul(f"{name} weight grad", op_pass, out_features, rows, in_features, element_bytes, calls))
        else:
            ops.append(matmul(name, op_pass, rows, in_features, out_features, element_bytes, calls))
    return ops


def attention_core(model: ModelSpec, training: TrainingSpec, tokens: int, seq_len: int, element_bytes: int,
                   op_pass: OpPass, calls: int, memory_only: bool = False) -> list[Operation]:
    """The attention core of ``calls`` blocks: one fused kernel (flash), or eager attention's
    two batched products and its softmax over the materialised scores (``memory_only``: the
    softmax alone, as every function here that takes it keeps only the memory passes)."""
    kernel = training.attention_kernel
    fraction = executed_causal_fraction(kernel, model.causal)
    forward_flops = tokens * attention_forward_flops_per_token(model, seq_len, fraction)
    backward = op_pass is OpPass.backward
    flops = forward_flops * (attention_backward_over_forward(kernel) if backward else 1)
    q, kv = model.q_size, model.kv_size
    if kernel is AttentionKernel.flash and memory_only:
        return []
    if kernel is AttentionKernel.flash:
        # Reads q, k, v and writes the output (forward); reads q, k, v, the output and its
        # gradient and writes dq, dk, dv (backward). One exponential per computed score: the
        # backward recomputes P = exp(S - lse) (FlashAttention-2, Dao 2023, sec. 3.1.2) and is
        # charged at the forward's FLOP rate (the H200 profile: 403 against 411 TFLOP/s), so its
        # exponentials scale with its FLOPs (docs/communication-time.md).
        per_score = MATMUL_FLOPS_PER_MULTIPLY_ADD * (model.head_size + model.v_head_size)
        moved = tokens * element_bytes * ((q + 2 * kv + q) if not backward else (3 * q + 2 * kv + q + 2 * kv))
        return [Operation(name="attention core", kind=OpKind.attention, op_pass=op_pass, calls=calls,
                          flops=calls * flops, moved_bytes=calls * moved, exponentials=calls * flops / per_score)]
    # Eager: scores and probabilities of a x s per token, materialised (Korthikanti et al. eq. 1).
    scores = tokens * model.num_heads * seq_len
    ops = [] if memory_only else [
        Operation(name="attention scores and values", kind=OpKind.matmul, op_pass=op_pass, calls=calls,
                  flops=calls * flops, moved_bytes=calls * element_bytes * (tokens * (2 * q + 2 * kv) + 2 * scores))]
    softmax_passes = 3 if backward else 2  # forward: read scores, write probabilities; backward: + the gradient
    ops.append(memory_pass("attention softmax", op_pass, element_bytes * softmax_passes * scores, calls))
    return ops


def _mlp_width(model: ModelSpec, moe: bool) -> int:
    """F: the MLP hidden width one token's activation function runs over."""
    if not moe:
        return model.ffn_hidden_size
    return model.expert_ffn_hidden_size * model.experts_per_token + model.shared_expert_ffn_hidden_size


# Eager elementwise kernels, bytes per token (a per element):
#   norm: read x, write y (forward); read x and dy, write dx (backward)     2h / 3h
#   rotary embedding on q and k: read, write                                 2(q + kv) both ways
#   residual add: read two, write one; its gradient adds two branches         3h both ways
#   gated activation act(gate) * up: act reads F, writes F; the product reads 2F, writes F (5F);
#     backward: d_up = dh * act (3F), d_act = dh * up (3F), act's backward (3F) (9F)
#   two-matrix activation: 2F forward, 3F backward
#   routed experts: tokens gathered to their experts and combined back, k copies of h each way
#   gradient sums (backward): autograd adds the gradients of a tensor that n operations read with
#     n - 1 adds (torch/csrc/autograd/input_buffer.cpp, InputBuffer::add), 3h each: the normed
#     input read by q, k and v (one fused wqkv where the framework fuses them) and by the MLP's
#     input matrices (gate and up; a MoE's router, shared expert and dispatch)
def block_memory_passes(model: ModelSpec, moe: bool, tokens: int, element_bytes: int, op_pass: OpPass,
                        calls: int, fused_qkv: bool = False) -> list[Operation]:
    """The memory-bound kernels of ``calls`` blocks."""
    h, q, kv, width = model.hidden_size, model.q_size, model.kv_size, _mlp_width(model, moe)
    backward = op_pass is OpPass.backward
    per_token: dict[str, float] = {"norms": model.norms_per_block * h * (3 if backward else 2)}
    if model.qk_norm:
        per_token["norms"] += (q + kv) * (3 if backward else 2)
    if model.position is PositionKind.rope:
        per_token["rotary embedding"] = 2 * (q + kv)
    per_token["residual adds"] = 2 * 3 * h
    if model.mlp.gated:
        per_token["activation"] = (9 if backward else 5) * width
    else:
        per_token["activation"] = (3 if backward else 2) * width
    if moe:
        per_token["expert dispatch and combine"] = 2 * 2 * model.experts_per_token * h
    if backward:
        extra_readers = input_readers(model, moe, fused_qkv) - 2
        if extra_readers:
            per_token["gradient sums"] = 3 * h * extra_readers
    return [memory_pass(name, op_pass, tokens * element_bytes * elements, calls) for name, elements in per_token.items()]


@lru_cache(maxsize=64)  # the model's alone: every batch shape's memory passes ask for it
def input_readers(model: ModelSpec, moe: bool, fused_qkv: bool) -> int:
    """Operations that read the attention's and the MLP's normed inputs (h wide), together."""
    h = model.hidden_size
    # The output projections (attention's o, the MLP's down or fc2) read the block's own
    # intermediates, not its input, whatever their widths.
    outputs = (".o.weight", ".down.weight", ".fc2.weight")
    weights = [t for t in _linear_weights(model, moe)
               if t.shape[1] == h and not t.name.startswith("mlp.experts.") and not t.name.endswith(outputs)]
    attention = sum(1 for t in weights if t.name.startswith("attention."))
    if fused_qkv and not model.is_mla:
        attention = 1
    mlp = sum(1 for t in weights if t.name.startswith("mlp.")) + (1 if moe else 0)
    return max(attention, 1) + max(mlp, 1)


def block_operations(model: ModelSpec, training: TrainingSpec, moe: bool, tokens: int, seq_len: int,
                     element_bytes: int, op_pass: OpPass, calls: int, memory_only: bool = False) -> list[Operation]:
    """Everything ``calls`` blocks run in one pass (forward or backward)."""
    return (([] if memory_only else block_matmuls(model, moe, tokens, element_bytes, op_pass, calls))
            + attention_core(model, training, tokens, seq_len, element_bytes, op_pass, calls, memory_only)
            + block_memory_passes(model, moe, tokens, element_bytes, op_pass, calls, profile(training.framework).fuses_qkv))


# The loss in fp32 over the logits (torchtitan, torchtune and HF all upcast): forward casts the
# a-byte logits up (a + 4 per element), log-softmax reads and writes (8); backward writes the
# NLL gradient (4), log-softmax's backward reads two and writes one (12), the cast back reads 4
# and writes a. Chunked losses move the same bytes in pieces.
# flash-attn's fused cross-entropy (TrainingSpec.fused_cross_entropy; zeroplan.core.fused_cross_entropy)
# reads the a-byte logits once in its forward kernel and, in its backward kernel, reads them
# again and writes their a-byte gradient; its per-row outputs are negligible beside them.
def loss_bytes_per_token(vocab_size: int, element_bytes: int, backward: bool, fused: bool = False) -> float:
    if fused:
        return vocab_size * element_bytes * (2 if backward else 1)
    return vocab_size * ((FP32_BYTES + 3 * FP32_BYTES + FP32_BYTES + element_bytes) if backward
                         else (element_bytes + FP32_BYTES + 2 * FP32_BYTES))


def head_operations(model: ModelSpec, tokens: int, element_bytes: int, op_pass: OpPass, calls: int,
                    fused_cross_entropy: bool = False, memory_only: bool = False) -> list[Operation]:
    """Final norm, output projection and loss of ``calls`` micro-batches."""
    h, vocab = model.hidden_size, model.vocab_size
    backward = op_pass is OpPass.backward
    ops = [memory_pass("final norm", op_pass, tokens * element_bytes * h * (3 if backward else 2), calls)]
    if model.head_transform and not memory_only:
        ops += ([matmul("head transform input grad", op_pass, tokens, h, h, element_bytes, calls),
                 matmul("head transform weight grad", op_pass, h, tokens, h, element_bytes, calls)] if backward
                else [matmul("head transform", op_pass, tokens, h, h, element_bytes, calls)])
    if memory_only:
        pass  # the output projection is a matrix product
    elif backward:
        ops += [matmul("output projection input grad", op_pass, tokens, vocab, h, element_bytes, calls),
                matmul("output projection weight grad", op_pass, vocab, tokens, h, element_bytes, calls)]
    else:
        ops.append(matmul("output projection", op_pass, tokens, h, vocab, element_bytes, calls))
    ops.append(memory_pass("cross-entropy", op_pass,
                           tokens * loss_bytes_per_token(vocab, element_bytes, backward, fused_cross_entropy), calls))
    return ops


# The lookup reads and writes one row per token; its backward (embedding_dense_backward) zeroes
# an fp32 table-sized gradient and adds each token's row into it.
def embedding_operations(model: ModelSpec, tokens: int, element_bytes: int, op_pass: OpPass, calls: int) -> list[Operation]:
    h = model.hidden_size
    if op_pass is OpPass.backward:
        moved = tokens * h * (element_bytes + 2 * FP32_BYTES) + model.vocab_size * h * FP32_BYTES
    else:
        moved = tokens * h * 2 * element_bytes
    return [memory_pass("embedding", op_pass, moved, calls)]


# flops.recompute_flops_per_token, kernel by kernel: full reruns every block's forward (less
# its last matmul and residual add where the checkpoint stops early),
# selective the attention core, selective-layer the forward of every k-th block, selective-op
# (torchtitan's policy: every other mm's output and SDPA's are saved) the unsaved mms, wo and
# w3 (fc2 in a two-matrix MLP), and the elementwise kernels between them.
def recompute_operations(model: ModelSpec, training: TrainingSpec, tokens: int, seq_len: int,
                         element_bytes: int, calls_per_block: int, memory_only: bool = False) -> list[Operation]:
    mode = training.activation_checkpointing
    op_pass = OpPass.recompute
    ops: list[Operation] = []
    for moe, blocks in _block_kinds(model):
        if mode is ActivationCheckpointing.full:
            ops += _early_stopped(block_operations(model, training, moe, tokens, seq_len, element_bytes, op_pass,
                                                   blocks * calls_per_block, memory_only), model, training)
        elif mode is ActivationCheckpointing.selective:
            ops += attention_core(model, training, tokens, seq_len, element_bytes, op_pass, blocks * calls_per_block,
                                  memory_only)
        elif mode is ActivationCheckpointing.selective_layer:
            checkpointed = blocks // training.selective_layer_interval if len(_block_kinds(model)) == 1 else \
                blocks * (model.num_layers // training.selective_layer_interval) // model.num_layers
            if checkpointed:
                ops += _early_stopped(block_operations(model, training, moe, tokens, seq_len, element_bytes, op_pass,
                                                       checkpointed * calls_per_block, memory_only), model, training)
        elif mode is ActivationCheckpointing.selective_op:
            rerun = ("attention.o.weight", "up.weight") if model.mlp.gated else ("attention.o.weight", "fc2.weight")
            if memory_only:
                pass  # the reruns below are matrix products
            elif moe and model.mlp.gated:
                shared = tuple(t.name for t in _linear_weights(model, moe) if t.name.startswith("mlp.shared"))
                ops += [op for op in block_matmuls(model, moe, tokens, element_bytes, op_pass, blocks * calls_per_block, rerun)
                        if not any(op.name == name.removesuffix(".weight") for name in shared)]
            else:
                ops += block_matmuls(model, moe, tokens, element_bytes, op_pass, blocks * calls_per_block, rerun)
            ops += block_memory_passes(model, moe, tokens, element_bytes, op_pass, blocks * calls_per_block)
    return ops


def _early_stopped(ops: list[Operation], model: ModelSpec, training: TrainingSpec) -> list[Operation]:
    """A recomputed block's kernels less what the checkpoint's early stop skips: its last matmul
    and the residual add after it (zeroplan.core.flops.early_stop_skipped_flops_per_token)."""
    if not early_stop_skipped_flops_per_token(model, training):
        return ops
    last = ("mlp.down", "mlp.fc2")
    kept = []
    for op in ops:
        if op.kind is OpKind.matmul and op.name in last:
            continue
        if op.name == "residual adds":
            op = op.model_copy(update={"moved_bytes": op.moved_bytes / 2})
        kept.append(op)
    return kept


def _block_kinds(model: ModelSpec) -> list[tuple[bool, int]]:
    """(has experts, how many such blocks) for the model's blocks."""
    moe_blocks = model.moe_layer_count
    kinds = [(True, moe_blocks)] if moe_blocks else []
    if model.num_layers - moe_blocks:
        kinds.append((False, model.num_layers - moe_blocks))
    return kinds


def step_operations(model: ModelSpec, training: TrainingSpec, micro_batch_size: int, seq_len: int,
                    micro_batches: int, element_bytes: int, memory_only: bool = False) -> list[Operation]:
    """Forward, backward and recomputation of ``micro_batches`` micro-batches of
    ``micro_batch_size`` x ``seq_len`` tokens (the optimizer step is zeroplan.core.roofline.optimizer's).
    ``memory_only``: only the memory passes (OpKind.memory), in the same order, without building
    the matrix products and attention cores the flat-HFU model does not price kernel by kernel."""
    tokens = micro_batch_size * seq_len
    ops: list[Operation] = []
    for op_pass in (OpPass.forward, OpPass.backward):
        ops += embedding_operations(model, tokens, element_bytes, op_pass, micro_batches)
        for moe, blocks in _block_kinds(model):
            ops += block_operations(model, training, moe, tokens, seq_len, element_bytes, op_pass, blocks * micro_batches,
                                    memory_only)
        ops += head_operations(model, tokens, element_bytes, op_pass, micro_batches, training.fused_cross_entropy,
                               memory_only)
    ops += recompute_operations(model, training, tokens, seq_len, element_bytes, micro_batches, memory_only)
    return ops

