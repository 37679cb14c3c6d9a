"""Seconds of one GPU's training step, kernel by kernel (docs/communication-time.md, "Compute,
operation by operation"): each operation of zeroplan.core.roofline.operations, the FSDP copies
around its collectives and the optimizer step, at the GPU's achievable ceilings."""

import functools

from pydantic import ConfigDict

from zeroplan.core.activations import FP32_BYTES
from zeroplan.core.bf16_accumulation_time import bf16_accumulation_operations
from zeroplan.core.buffers import optimizer_loop
from zeroplan.core.frameworks import BF16_BYTES, autocast_caches_weights
from zeroplan.core.layout import element_bytes
from zeroplan.core.memo import batch_keyed
from zeroplan.core.model_states import held_elements, shard_layout
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.core.params import blocks_linear_weight_elements, total_parameters
from zeroplan.core.roofline.ceilings import GpuCeilings, gpu_ceilings
from zeroplan.core.roofline.operations import (
    Operation,
    OpKind,
    OpPass,
    memory_pass,
    step_operations,
)
from zeroplan.core.roofline.optimizer import optimizer_bytes_per_element, torch_muon_bytes_per_element
from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, Optimizer, StateConvention


class RooflineTerm(Frozen):
    """One operation's time and what bounds it."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    operation: Operation
    seconds: float
    bound: str
    """'compute' (matrix or special-function units) or 'memory' (device-memory bandwidth)."""


class RooflineStep(Frozen):
    """Every term of one rank's optimizer step, and their sums by phase."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    terms: tuple[RooflineTerm, ...]

    def seconds(self, *passes: OpPass, kind: OpKind | None = None) -> float:
        return sum(t.seconds for t in self.terms
                   if t.operation.op_pass in passes and (kind is None or t.operation.kind is kind))

    @property
    def forward_s(self) -> float:
        return self.seconds(OpPass.forward)

    @property
    def backward_s(self) -> float:
        """The backward, its recomputation included (as StepTime.backward_compute_s)."""
        return self.seconds(OpPass.backward, OpPass.recompute)

    @property
    def recompute_s(self) -> float:
        return self.seconds(OpPass.recompute)

    @property
    def optimizer_s(self) -> float:
        return self.seconds(OpPass.optimizer)


# Williams, Waterman & Patterson 2009 (the roofline model): a kernel takes the longer of its
# arithmetic at the achievable rate and its memory traffic at the achievable bandwidth. The
# attention core adds its exponentials on the special-function units to its matrix work
# (FlashAttention-3, Shah et al. 2024, sec. 3.1: the two do not overlap in FlashAttention-2's
# schedule, which torch's SDPA and cuDNN's kernels follow).
def operation_seconds(operation: Operation, ceilings: GpuCeilings) -> tuple[float, str]:
    memory_s = operation.moved_bytes / ceilings.memory_bytes_per_s
    if operation.kind is OpKind.memory:
        return memory_s, "memory"
    compute_s = operation.flops / ceilings.matmul_flops_per_s + operation.exponentials / ceilings.exp_per_s
    return (compute_s, "compute") if compute_s >= memory_s else (memory_s, "memory")


# torch 2.13 _fully_shard/_fsdp_collectives.py: foreach_all_gather_copy_out splits the gathered
# flat buffer into the per-parameter storages (torch.split_with_sizes_copy: read and write each
# unsharded element), once per all-gather (forward, and backward again after a reshard);
# foreach_reduce packs the gradients into the reduce-scatter input in the reduce dtype
# (torch._chunk_cat: read a, write the gradient's bytes). Once per micro-batch.
def fsdp_copy_operations(request: PlanRequest, micro_batches: int, activation_bytes: int) -> list[Operation]:
    kind = request.strategy.kind
    if not kind.is_fsdp:
        return []
    # Spread evenly over the pipeline and tensor-parallel ranks, as the kernels are (context-
    # parallel ranks gather every parameter of their stage).
    elements = total_parameters(request.model) / (request.parallel.tp * request.parallel.pp)
    gradient_bytes = element_bytes(request.training.precision, request.convention).gradient
    copy_out = elements * 2 * activation_bytes
    ops = [memory_pass("fsdp all-gather copy-out", OpPass.forward, copy_out, micro_batches),
           memory_pass("fsdp reduce-scatter copy-in", OpPass.backward, elements * (activation_bytes + gradient_bytes),
                       micro_batches)]
    if kind is not StrategyKind.fsdp_shard_grad_op:
        ops.append(memory_pass("fsdp all-gather copy-out", OpPass.backward, copy_out, micro_batches))
    return ops


# torch 2.13 aten/src/ATen/autocast_mode.cpp (cached_cast): under autocast with fp32 parameters
# each linear casts its weight to bf16, once per autocast region (casts of leaves that require
# grad are cached until the region exits): read 4 bytes, write 2 per element. The cast's backward
# (_to_copy) turns the weight's bf16 gradient into fp32: read 2, write 4. A non-reentrant
# checkpoint recomputes in an autocast region of its own, so full recomputation casts the
# blocks' weights again. The output projection is a linear too (tied or not); the embedding's
# lookup is not cast. Once per micro-batch.
def autocast_cast_operations(request: PlanRequest, micro_batches: int) -> list[Operation]:
    if not autocast_caches_weights(request):
        return []
    model = request.model
    # Per rank of the model-parallel group, as fsdp_copy_operations spreads its copies.
    per_element = (FP32_BYTES + BF16_BYTES) / (request.parallel.tp * request.parallel.pp)
    block_bytes = blocks_linear_weight_elements(model) * per_element
    all_bytes = block_bytes + model.vocab_size * model.hidden_size * per_element
    ops = [memory_pass("autocast weight casts", OpPass.forward, all_bytes, micro_batches),
           memory_pass("autocast weight-gradient casts", OpPass.backward, all_bytes, micro_batches)]
    if request.training.activation_checkpointing is ActivationCheckpointing.full:
        ops.append(memory_pass("autocast weight casts", OpPass.recompute, block_bytes, micro_batches))
    return ops


def optimizer_operation(request: PlanRequest) -> list[Operation]:
    """The GPU's optimizer step over the elements this rank steps (none when it runs on the host,
    but for the sub-groups ZeRO-Offload++'s ratio keeps on the GPU: device_sub_group_step)."""
    if request.training.fsdp_cpu_offload:
        return []
    if request.strategy.kind.offloads_optimizer:
        return device_sub_group_step(request)
    eb = element_bytes(request.training.precision, request.convention)
    elements = held_elements(rank_trainable_units(request), request.shard_group_size, shard_layout(request))
    per_element = optimizer_bytes_per_element(request.training.optimizer, optimizer_loop(request), eb.optimizer_dtype,
                                              eb.master > 0 and eb.compute_parameter < eb.master)
    if request.training.optimizer is Optimizer.muon and request.convention is not StateConvention.deepspeed:
        # torch.optim.Muon's own passes over its matrices, AdamW's over the rest (DDP: unsharded).
        from zeroplan.core import muon

        matrices, _ = muon.split_tensors(request)
        muon_elements = sum(t.numel for t in matrices)
        moved = (muon_elements * torch_muon_bytes_per_element(eb.optimizer_dtype, eb.optimizer_dtype)
                 + (elements - muon_elements) * per_element)
        return [memory_pass("optimizer step", OpPass.optimizer, moved, 1)]
    return [memory_pass("optimizer step", OpPass.optimizer, elements * per_element, 1)]


# deepspeed 0.19.8 runtime/zero/stage3.py:1249-1258: a GPU sub-group's step is the backup
# torch.optim.AdamW's on its fp32 master (foreach, unfused: TORCH_ADAM_ACCESSES_PER_ELEMENT in
# fp32), with the unscale and the cast back around it (zeroplan.core.deepspeed_partial_offload).
def device_sub_group_step(request: PlanRequest) -> list[Operation]:
    """The GPU's share of a partial offload's step (none without a ratio)."""
    from zeroplan.core import deepspeed_partial_offload as partial
    from zeroplan.specs.training import OptimizerLoop

    elements = partial.device_partition_elements(request)
    if not elements:
        return []
    model_bytes = request.training.precision.compute_bytes
    per_element = (optimizer_bytes_per_element(request.training.optimizer, OptimizerLoop.foreach, FP32_BYTES, False)
                   + partial.device_step_extra_bytes_per_element(request, model_bytes, FP32_BYTES))
    return [memory_pass("optimizer step", OpPass.optimizer, elements * per_element, 1)]


def compiled_block_operations(request: PlanRequest, operations: list[Operation]) -> list[Operation]:
    """``operations`` with each block memory pass moving what the compiled block's kernels move
    (zeroplan.core.compiled_time.compiled_roofline_scale; MoE blocks take the dense block's ratio)."""
    from zeroplan.core.compiled_time import BLOCK_MEMORY_NAMES, compiled_roofline_scale

    scales = {backward: compiled_roofline_scale(request, False, backward) for backward in (False, True)}
    return [op.model_copy(update={"moved_bytes": op.moved_bytes * scales[op.op_pass is OpPass.backward]})
            if op.kind is OpKind.memory and op.name in BLOCK_MEMORY_NAMES else op for op in operations]


def check_roofline_applies(request: PlanRequest) -> None:
    if not request.training.finetune.trains_everything:
        raise ZeroplanError("compute-model", "roofline prices full training only (frozen weights and adapters: "
                            "allowed --compute-model hfu)")


@functools.lru_cache(maxsize=16)
def roofline_step(request: PlanRequest) -> RooflineStep:
    """The per-operation step time of one rank. Model parallelism divides the replica's
    kernels evenly among its tp x cp x pp ranks (as zeroplan.core.timing.rank_flops). The last
    few answers are kept (a step time asks for its compute and its optimizer step apart)."""
    check_roofline_applies(request)
    return _step_terms(request, eager=False)


# The flat-HFU model's memory-bound kernels (zeroplan.core.timing.memory_bound_time_s): the
# roofline's memory passes at their eager single-pass bytes, FSDP's copies, autocast's casts
# and the optimizer step, each at the GPU's copy bandwidth; the HFU then covers the matrix
# products and attention (and what a stack's eager kernels move beyond one pass over their
# tensors). Frozen-weight fine-tuning keeps its activations' passes (the roofline's matrix
# products, which it does not price there, are not used).
@functools.lru_cache(maxsize=16)
def memory_bound_step(request: PlanRequest) -> RooflineStep:
    """The memory-bound terms of one rank's step (every OpKind.memory operation)."""
    return RooflineStep(terms=tuple(t for t in _step_terms(request, eager=True).terms
                                    if t.operation.kind is OpKind.memory))


# memory_bound_step's sums by phase, as RooflineStep sums them (each phase's terms in step order
# through one sum()), without building the step: the flat-HFU model asks for them of every plan
# (zeroplan.core.timing.memory_bound_time_s, gpu_optimizer_time_s), and the model's own terms
# are shared by every strategy of a batch shape (_model_memory_seconds).
@functools.lru_cache(maxsize=64)
def memory_bound_seconds(request: PlanRequest) -> tuple[float, float, float]:
    """(forward, backward with recomputation, optimizer step) seconds of memory_bound_step."""
    model_seconds = _model_memory_seconds(*_model_shape(request))
    extra_seconds = _request_memory_seconds(request)
    return tuple(sum((*model, *added)) for model, added in zip(model_seconds, extra_seconds))


# The request's own operations (FSDP's copies, autocast's casts, the optimizer step, BF16's
# accumulation) read of the batch its accumulation alone, so a sweep's micro-batches and
# sequences share them (batch_keyed answers a read of another batch field uncached).
@batch_keyed("grad_accum_steps")
def _request_memory_seconds(request: PlanRequest) -> tuple[tuple[float, ...], ...]:
    """_memory_seconds_by_phase of _request_operations, each at _step_terms' seconds (not divided
    among the ranks)."""
    ceilings = gpu_ceilings(request.cluster.gpu)
    return _memory_seconds_by_phase([(operation, operation_seconds(operation, ceilings)[0])
                                     for operation in _request_operations(request)])


@functools.lru_cache(maxsize=64)
def _model_memory_priced(model, training, micro_batch_size: int, seq_len: int, micro_batches: int,
                         activation_bytes: int, gpu, ranks: int, replicas: int) -> tuple[tuple[Operation, float], ...]:
    """_model_terms' memory passes alone (step_operations' memory_only; the same arguments), each
    with its seconds on one of ``ranks`` model-parallel ranks, priced as _model_terms prices them."""
    ceilings = gpu_ceilings(gpu)
    operations = step_operations(model, training, micro_batch_size, seq_len, micro_batches, activation_bytes, memory_only=True)
    # _term's seconds, without building the terms.
    return tuple((operation, operation_seconds(operation, ceilings)[0] / operation_ranks(operation, ranks, replicas))
                 for operation in operations)


TP_REPLICATED_PASSES = frozenset({"norms", "residual adds", "gradient sums", "final norm"})
"""The memory passes that run on the block's whole s b h activation, outside its tensor-parallel
matrix products: without sequence parallelism every tensor-parallel rank runs them in full."""


# Megatron-LM sec. 3 (Figure 4): a block's tensor parallelism splits its matrix products, the
# attention heads and the MLP's hidden width (the attention core, its softmax, the activation),
# and leaves the layer norms, the residual adds (Megatron's bias-dropout-add) and the sum of the
# normed input's gradients replicated: every rank of the tp group runs them on the whole h
# (Korthikanti et al. 2022, sec. 4.2.2: "the layer-norm and dropouts ... are replicated across
# the tensor parallel ranks"; sequence parallelism splits them along the sequence instead). So
# they are divided among the pipeline and context ranks only, the rest among all tp x cp x pp.
def operation_ranks(operation: Operation, ranks: int, tp_replicas: int) -> int:
    """The ranks ``operation``'s work is divided among: ``ranks`` (tp x cp x pp), or ranks / tp for a
    pass every tensor-parallel rank runs whole (``tp_replicas``: tp without sequence parallelism, else 1)."""
    return ranks // tp_replicas if operation.name in TP_REPLICATED_PASSES else ranks


def tp_replicas(request: PlanRequest) -> int:
    """tp where the request's tensor-parallel ranks each run the replicated passes whole (no
    sequence parallelism), else 1."""
    parallel = request.parallel
    return 1 if parallel.sequence_parallel else parallel.tp


# 512 kept (small tuples): a validation over the published rows asks for about 210 shapes in
# turn, again for each attention rate and each HFU tried, and with 64 none was left by its next turn.
@functools.lru_cache(maxsize=512)
def _model_memory_seconds(model, training, micro_batch_size: int, seq_len: int, micro_batches: int,
                          activation_bytes: int, gpu, ranks: int, tp_replicas: int = 1) -> tuple[tuple[float, ...], ...]:
    """_memory_seconds_by_phase of _model_memory_priced (the same arguments), shared by every
    strategy of a batch shape: from the passes' byte polynomials (_memory_pass_polynomials), the
    same floats without building the operations, else from the operations themselves."""
    polynomials = _memory_pass_polynomials(model, training, activation_bytes)
    if polynomials is None:
        return _memory_seconds_by_phase(list(_model_memory_priced(
            model, training, micro_batch_size, seq_len, micro_batches, activation_bytes, gpu, ranks, tp_replicas)))
    bandwidth = gpu_ceilings(gpu).memory_bytes_per_s
    tokens = micro_batch_size * seq_len
    by_phase: tuple[list[float], ...] = tuple([] for _ in _PHASES)
    for phase, per_token, per_score, fixed, replicated in polynomials:
        # Twice the integer bytes, halved once as a float: _early_stopped's halving of a float
        # byte count, and exact (a float's halving) for the rest; then operation_seconds'
        # division by the bandwidth and _model_memory_priced's by the ranks, in that order.
        moved = float(micro_batches * (per_token * tokens + per_score * tokens * seq_len + fixed)) / 2
        by_phase[phase].append(moved / bandwidth / (ranks // tp_replicas if replicated else ranks))
    return tuple(tuple(seconds) for seconds in by_phase)


# step_operations(memory_only=True) builds the same passes, in the same order, for every batch
# shape, and each pass moves an integer number of bytes (every width, count and element size is
# an int) of the form micro_batches x (A tokens + B tokens x seq_len + C): tokens x a per-token
# byte count (norms, rotary, residual adds, activation, gradient sums, final norm, loss), the
# eager softmax's scores (tokens x heads x seq_len), the embedding's table-sized gradient (C),
# times calls = blocks x micro_batches; a checkpoint's early stop halves its residual adds (as a
# float). So the coefficients, read off step_operations itself at three shapes of one
# micro-batch and checked at two more, price any shape with the operations' own floats.
_PROBE_SHAPES = ((1, 1), (2, 1), (1, 2))
_CHECK_SHAPES = ((3, 5), (2, 7))


# 512 kept, as _model_memory_seconds (the published rows: about 150 model x training pairs).
@functools.lru_cache(maxsize=512)
def _memory_pass_polynomials(model, training, activation_bytes: int) -> tuple[tuple[int, int, int, int, bool], ...] | None:
    """For each memory pass of step_operations(memory_only=True), in order: (its index in _PHASES,
    2A, 2B, 2C as above, whether every tensor-parallel rank runs it whole); None where the
    passes do not take that form (a non-integer byte count, or a shape that changes the list)."""
    def doubled_bytes(micro_batch_size: int, seq_len: int) -> list[tuple[str, OpPass, int]] | None:
        passes = []
        for operation in step_operations(model, training, micro_batch_size, seq_len, 1, activation_bytes, memory_only=True):
            doubled = 2 * operation.moved_bytes
            if operation.kind is not OpKind.memory or doubled != int(doubled) or doubled >= 2 ** 53:
                return None
            passes.append((operation.name, operation.op_pass, int(doubled)))
        return passes

    probes = [doubled_bytes(*shape) for shape in (*_PROBE_SHAPES, *_CHECK_SHAPES)]
    if any(probe is None for probe in probes) or len({tuple(p[:2] for p in probe) for probe in probes}) != 1:
        return None
    polynomials = []
    for (name, op_pass, at_11), (_, _, at_21), (_, _, at_12) in zip(*probes[:len(_PROBE_SHAPES)]):
        # at (b, s): A b s + B b s^2 + C.
        linear = at_21 - at_11  # A + B
        fixed = at_11 - linear
        quadratic, odd = divmod(at_12 - fixed - 2 * linear, 2)
        if odd:
            return None
        phase = next(i for i, passes in enumerate(_PHASES) if op_pass in passes)
        polynomials.append((phase, linear - quadratic, quadratic, fixed, name in TP_REPLICATED_PASSES))
    for (micro_batch_size, seq_len), checked in zip(_CHECK_SHAPES, probes[len(_PROBE_SHAPES):]):
        tokens = micro_batch_size * seq_len
        if any(value != per_token * tokens + per_score * tokens * seq_len + fixed
               for (_, _, value), (_, per_token, per_score, fixed, _) in zip(checked, polynomials)):
            return None
    return tuple(polynomials)


def _model_shape(request: PlanRequest) -> tuple:
    """_model_memory_priced's arguments for the request's model and batch shape (eager: the
    model's terms whether or not the request compiles, as _step_terms(eager=True))."""
    batch = request.batch
    return (request.model, request.training, batch.micro_batch_size, batch.seq_len, batch.grad_accum_steps,
            request.training.precision.compute_bytes, request.cluster.gpu, request.parallel.model_parallel_size,
            tp_replicas(request))


def eager_softmax_seconds(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with recomputation) seconds of eager attention's softmax passes
    (attention_core's 'attention softmax'), as memory_bound_seconds prices them; (0, 0) for a
    flash kernel."""
    forward, backward, _ = _memory_seconds_by_phase(
        [(operation, seconds) for operation, seconds in _model_memory_priced(*_model_shape(request))
         if operation.name == "attention softmax"])
    return sum(forward), sum(backward)


# RooflineStep.forward_s, backward_s and optimizer_s: the phases each sums.
_PHASES = ((OpPass.forward,), (OpPass.backward, OpPass.recompute), (OpPass.optimizer,))


def _memory_seconds_by_phase(priced: list[tuple[Operation, float]]) -> tuple[tuple[float, ...], ...]:
    """The memory-bound operations' seconds (``priced``: each with its seconds), in step order,
    for each of _PHASES."""
    return tuple(tuple(seconds for operation, seconds in priced
                       if operation.kind is OpKind.memory and operation.op_pass in passes) for passes in _PHASES)


def _term(operation: Operation, ceilings: GpuCeilings, ranks: int, replicas: int) -> RooflineTerm:
    """One of the replica's operations on one of its ``ranks`` model-parallel ranks (``replicas``: tp_replicas)."""
    seconds, bound = operation_seconds(operation, ceilings)
    return RooflineTerm(operation=operation, seconds=seconds / operation_ranks(operation, ranks, replicas), bound=bound)


# The model's own operations depend on the model, the training, the batch's shape, the GPU and
# the model-parallel ranks only, not on the strategy: fit's strategies (and the plan search's
# groups of one layout) share them.
@functools.lru_cache(maxsize=64)
def _model_terms(model, training, micro_batch_size: int, seq_len: int, micro_batches: int, activation_bytes: int,
                 gpu, ranks: int, replicas: int) -> tuple[RooflineTerm, ...]:
    """The eager step's operations (step_operations) priced on ``gpu``'s ceilings, per rank."""
    ceilings = gpu_ceilings(gpu)
    operations = step_operations(model, training, micro_batch_size, seq_len, micro_batches, activation_bytes)
    return tuple(_term(operation, ceilings, ranks, replicas) for operation in operations)


def _request_operations(request: PlanRequest) -> list[Operation]:
    """The operations that depend on the request beyond its model and batch shape (the strategy's
    copies, autocast's casts, the optimizer step, BF16_Optimizer's fp32 accumulation): one list
    for both _step_terms and memory_bound_seconds, so the two always price the same passes."""
    batch = request.batch
    activation_bytes = request.training.precision.compute_bytes
    return (fsdp_copy_operations(request, batch.grad_accum_steps, activation_bytes)
            + autocast_cast_operations(request, batch.grad_accum_steps) + optimizer_operation(request)
            + bf16_accumulation_operations(request, batch.grad_accum_steps))


def _step_terms(request: PlanRequest, eager: bool) -> RooflineStep:
    """Every term of the step; ``eager``: the blocks' memory passes at their eager single-pass
    bytes even where the request compiles (the flat-HFU model takes compile's measured saving
    off apart: zeroplan.core.compiled_time.compile_saved_seconds)."""
    ceilings = gpu_ceilings(request.cluster.gpu)
    batch = request.batch
    activation_bytes = request.training.precision.compute_bytes
    ranks = request.parallel.model_parallel_size
    replicas = tp_replicas(request)
    if request.training.compile and not eager:
        operations = compiled_block_operations(request, step_operations(
            request.model, request.training, batch.micro_batch_size, batch.seq_len, batch.grad_accum_steps,
            activation_bytes))
        terms = [_term(operation, ceilings, ranks, replicas) for operation in operations]
    else:
        terms = list(_model_terms(request.model, request.training, batch.micro_batch_size, batch.seq_len,
                                  batch.grad_accum_steps, activation_bytes, request.cluster.gpu, ranks, replicas))
    for operation in _request_operations(request):
        seconds, bound = operation_seconds(operation, ceilings)
        terms.append(RooflineTerm(operation=operation, seconds=seconds, bound=bound))
    return RooflineStep(terms=tuple(terms))
