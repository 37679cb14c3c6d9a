"""DeepSpeed ZeRO-3's gathered parameters under megatron-deepspeed, replayed module by module as
DeepSpeed's parameter coordinator fetches, prefetches and releases them over the step's trace
(DeepSpeed 0.19.8 runtime/zero/partitioned_param_coordinator.py; 0.6.2, the Azure recipes'
release, follows the same rules, quoted beside each step below).

ZeRO-3 hooks every module and gathers the parameters of one module at a time
(fetch_sub_module: iter_params(current_submodule), recurse=False; 0.6.2 lines 219-225), not a
whole block: megatron-deepspeed's ParallelTransformerLayer holds input_layernorm,
query_key_value (one ColumnParallelLinear of q, k and v), dense, post_attention_layernorm,
dense_h_to_4h and dense_4h_to_h (Megatron-DeepSpeed@62bc4562 megatron/model/transformer.py
lines 67, 84, 147, 186, 415, 430), each its own fetch. With a complete trace each fetch then
prefetches from the parameter trace until at least min(stage3_max_live_parameters - elements
available, stage3_prefetch_bucket_size) elements are in flight (0.19.8 lines 452-476; 0.6.2
lines 277-292), whole parameters. After a module's forward or backward its parameters are
released unless the trace within stage3_max_reuse_distance elements uses them again (0.19.8
__params_to_release, lines 634-665; 0.6.2 lines 358-380) or, in 0.19.8, a prefetch scan marked
them for a later use. Under full recomputation (Megatron's --checkpoint-activations, one layer
per checkpoint: megatron/arguments.py line 425) the backward reruns each block's forward, so the
trace is the forward's modules, then per block from the last: its forward again and its modules'
backward in reverse. The count is ds_numel (unpadded), as the coordinator's; the bytes are the
padded gathers. Persistent parameters (ds_numel <= stage3_param_persistence_threshold) are
gathered once when the engine is built and never counted or released.

This module does not import torch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from zeroplan.core.deepspeed_prefetch import (
    _gathered_bytes,
    max_live_parameters,
    models_deepspeed_gathers,
    prefetch_bucket_elements,
)
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing


def replays_gathers(request: PlanRequest) -> bool:
    """Whether the request's ZeRO-3 gathers are replayed here: megatron-deepspeed's model at
    stage 3 with DeepSpeed's plain gathers, its prefetch on (a complete trace) and either no
    recomputation or full recomputation of every block."""
    return (request.training.framework is Framework.megatron_deepspeed and models_deepspeed_gathers(request)
            and prefetch_bucket_elements(request) > 0 and request.parallel.pp == 1
            and request.training.activation_checkpointing in (ActivationCheckpointing.none, ActivationCheckpointing.full))


# Megatron's ParallelAttention computes q, k and v with one query_key_value linear
# (megatron/model/transformer.py line 147): the planner's separate q, k and v tensors are one
# module's parameters there.
def _module_name(tensor_name: str) -> str:
    prefix = tensor_name.rsplit(".", 1)[0]
    return "attention.qkv" if prefix in ("attention.q", "attention.k", "attention.v") else prefix


@dataclass(frozen=True)
class _Param:
    numel: int
    gathered_bytes: int
    gradient_bytes: int


def _modules(request: PlanRequest) -> tuple[list[tuple[int, list[int]]], list[_Param], list[bool]]:
    """(each module's unit and parameter ids, in forward order; the parameters; whether each
    unit is a block). The tied output projection uses the embedding's word embeddings again after
    the final norm (megatron/model/gpt_model.py line 130, parallel_lm_logits with
    word_embeddings_weight()): one more use of that parameter, last in the forward."""
    eb = element_bytes(request.training.precision, request.convention)
    wire = gradient_wire_bytes(request)
    threshold = request.strategy.deepspeed_param_persistence_threshold
    params: list[_Param] = []
    modules: list[tuple[int, list[int]]] = []
    units = rank_parameter_units(request)
    word_embeddings = None
    for index, unit in enumerate(units):
        by_module: dict[str, list[int]] = {}
        for tensor in unit.tensors:
            if tensor.numel <= threshold:
                continue  # persistent: gathered at the engine's start, never fetched
            by_module.setdefault(_module_name(tensor.name), []).append(len(params))
            if tensor.name == "token.weight":
                word_embeddings = len(params)
            params.append(_Param(tensor.numel, _gathered_bytes(request, tensor, eb.compute_parameter),
                                 tensor.numel * wire if tensor.trainable else 0))
        modules += [(index, ids) for ids in by_module.values()]
    if request.model.tied_embeddings and word_embeddings is not None:
        modules.append((len(units) - 1, [word_embeddings]))
    return modules, params, [unit.name.startswith("block.") for unit in units]


def _trace(request: PlanRequest, modules: list[tuple[int, list[int]]], blocks: list[bool]) -> list[tuple[int, bool]]:
    """(module, whether it is its backward) in the order the coordinator fetches them: the
    forward, then unit by unit from the last its backward in reverse, after a block's forward
    again under full recomputation."""
    full = request.training.activation_checkpointing is ActivationCheckpointing.full
    trace = [(m, False) for m in range(len(modules))]
    for unit in reversed(range(len(blocks))):
        own = [m for m, (index, _) in enumerate(modules) if index == unit]
        if full and blocks[unit]:
            trace += [(m, False) for m in own]
        trace += [(m, True) for m in reversed(own)]
    return trace


def peak_gathered_bytes(request: PlanRequest) -> int:
    """The most the coordinator holds at once: the gathered parameters after a fetch and its
    prefetch, and, at a module's backward, that module's full gradients before they are reduced."""
    modules, params, blocks = _modules(request)
    trace = _trace(request, modules, blocks)
    ids = [own for _, own in modules]
    limit, bucket = max_live_parameters(request), prefetch_bucket_elements(request)
    reuse = request.strategy.deepspeed_max_reuse_distance
    queue = deque((p, step) for step, (m, _) in enumerate(trace) for p in ids[m])
    available: set[int] = set()
    most_recent = [-1] * len(params)
    n_available = peak = 0
    for step, (m, is_backward) in enumerate(trace):
        for p in ids[m]:
            if p not in available:
                available.add(p)
                n_available += params[p].numel
        # The current module's own entries leave the queue (0.19.8 lines 427-436).
        while queue and queue[0][1] <= step:
            p, used_at = queue.popleft()
            most_recent[p] = max(most_recent[p], used_at)
        # Prefetch: whole parameters until at least min(max_live - available, bucket) elements
        # are in flight; available ones are passed over but marked (0.19.8 lines 452-476).
        wanted, fetching = min(limit - n_available, bucket), 0
        while queue and fetching < wanted:
            p, used_at = queue.popleft()
            most_recent[p] = max(most_recent[p], used_at)
            if p not in available:
                available.add(p)
                n_available += params[p].numel
                fetching += params[p].numel
        held = sum(params[p].gathered_bytes for p in available)
        if is_backward:
            held += sum(params[p].gradient_bytes for p in ids[m])
        peak = max(peak, held)
        # Release after the module's forward or backward, at step_id = step + 1.
        release = {p for p in ids[m] if most_recent[p] <= step + 1}
        traversed = 0
        for later, _ in trace[step + 1:]:
            if traversed >= reuse or not release:
                break
            for p in ids[later]:
                release.discard(p)
                traversed += params[p].numel
        for p in release & available:
            available.discard(p)
            n_available -= params[p].numel
    return peak
