"""DeepSpeed ZeRO-3's parameter gathers per step under the ``deepspeed`` state convention, with
its prefetcher's keep at the forward/backward turnaround (DeepSpeed 0.19.8,
runtime/zero/partitioned_param_coordinator.py; parameters persist per partition_parameters.py).

With a complete trace and stage3_prefetch_bucket_size > 0, each module fetch scans the
parameter trace ahead (_fetch_sub_module_impl, lines 452-476) for at most
min(stage3_max_live_parameters - elements available, prefetch bucket) elements: a parameter
not available is gathered, one that is available (already gathered) is passed over, and either
way its ``__most_recent_step_id_param_fetched_for`` is raised to that later use (470-472).
``__params_to_release`` (634-651) then keeps every parameter so marked. Towards the end of the
forward the trace ahead is the backward's (the trace holds forward then backward), so the last
modules of the forward are still gathered when the scan reaches their backward entries: they
stay gathered through the turnaround and their backward gathers nothing. What bounds them is
stage3_max_live_parameters (``__n_available_params``, counted in ds_numel: += at each gather,
line 593; -= at each release, 630): the modules kept are the longest run of the forward's last
modules whose elements fit in it, whole modules (a module's parameters are fetched and released
together, iter_params(recurse=False)). Measured on tiny-llama (benchmarks/emitted-records,
the emitted file's max_live 6,292,224): the head, the final norm, the last block and the second
last block from its o projection on (6,145,536 elements), to the element.

Persistent parameters (partition_parameters.py _partition_param, line 1292: ds_numel <=
stage3_param_persistence_threshold, within model_persistence_threshold) are gathered once when
the engine is built and never released (``__params_to_release`` skips ds_persist): no gather
per step. With the prefetch off (stage3_prefetch_bucket_size 0, the harness's own DeepSpeed
config) nothing is scanned and every other parameter is gathered before its forward and again
before its backward.

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import StateConvention
from zeroplan.units import ceil_div


def models_deepspeed_gathers(request: PlanRequest) -> bool:
    """Whether the ZeRO-3 gathers are DeepSpeed's plain ones (the deepspeed state convention at
    stage 3; not FSDP, nor ZeRO++ (hpZ, qwZ) or MiCS, whose gathers have terms of their own)."""
    kind = request.strategy.kind
    return (request.convention is StateConvention.deepspeed and kind.zero_stage == 3 and not kind.is_fsdp
            and not kind.uses_hpz and not kind.quantizes_communication and kind is not StrategyKind.zero3_mics)


def prefetch_bucket_elements(request: PlanRequest) -> int:
    """stage3_prefetch_bucket_size: the strategy's, else what --emit writes (prefetch_units
    largest units, zeroplan.emit.formats.deepspeed_config)."""
    chosen = request.strategy.deepspeed_prefetch_bucket_elements
    return request.strategy.prefetch_units * largest_unit_elements(request) if chosen is None else chosen


def max_live_parameters(request: PlanRequest) -> int:
    """stage3_max_live_parameters: the strategy's, else what --emit writes ((1 + prefetch_units)
    largest units: the gathered units core/buffers.py gathered_unit_bytes counts)."""
    chosen = request.strategy.deepspeed_max_live_parameters
    return (1 + request.strategy.prefetch_units) * largest_unit_elements(request) if chosen is None else chosen


def _modules(request: PlanRequest) -> list[tuple[int, list]]:
    """(unit index, the module's tensors) in forward order: a module is the tensors of one
    dotted prefix ('attention.q' of 'attention.q.weight' and '.bias'), as DeepSpeed fetches them."""
    modules: list[tuple[int, list]] = []
    for index, unit in enumerate(rank_parameter_units(request)):
        by_prefix: dict[str, list] = {}
        for tensor in unit.tensors:
            by_prefix.setdefault(tensor.name.rsplit(".", 1)[0], []).append(tensor)
        modules += [(index, tensors) for tensors in by_prefix.values()]
    return modules


def _persistent(request: PlanRequest, tensor) -> bool:
    return tensor.numel <= request.strategy.deepspeed_param_persistence_threshold


def _gathered_bytes(request: PlanRequest, tensor, bytes_per_element: int) -> int:
    """Bytes an all-gather brings in for one tensor: partition_parameters.py pads each
    parameter to a multiple of the group (ceil(ds_numel / N) per rank); a frozen tensor in its
    own storage (zeroplan.core.finetune.storage)."""
    group = request.shard_group_size
    if tensor.trainable:
        return ceil_div(tensor.numel, group) * group * bytes_per_element
    from zeroplan.core.finetune.storage import frozen_tensor_bytes

    return group * ceil_div(frozen_tensor_bytes(request, tensor, gathered=True), group)


def kept_at_turnaround(request: PlanRequest) -> list[tuple[int, list]]:
    """The modules (unit index, tensors) still gathered when the forward ends and kept for
    their backward: the longest run of the forward's last non-persistent modules whose elements
    fit in stage3_max_live_parameters; none with the prefetch off."""
    if not models_deepspeed_gathers(request) or prefetch_bucket_elements(request) == 0:
        return []
    limit, held, kept = max_live_parameters(request), 0, []
    for index, tensors in reversed(_modules(request)):
        tensors = [t for t in tensors if not _persistent(request, t)]
        if not tensors:
            continue
        elements = sum(t.numel for t in tensors)
        if held + elements > limit:
            break
        held += elements
        kept.append((index, tensors))
    return kept


def kept_elements_at_turnaround(request: PlanRequest) -> int:
    """Elements kept gathered from the forward to the backward (ds_numel, unpadded)."""
    return sum(t.numel for _, tensors in kept_at_turnaround(request) for t in tensors)


def kept_bytes_at_turnaround(request: PlanRequest, bytes_per_element: int) -> int:
    """Bytes the kept modules hold gathered at the turnaround (at most stage3_max_live_parameters
    elements, so within the gathered units the buffer model counts under --emit's settings)."""
    return sum(_gathered_bytes(request, t, bytes_per_element) for _, tensors in kept_at_turnaround(request) for t in tensors)


def _per_unit(request: PlanRequest, tensors_of, bytes_per_element: int) -> list[int]:
    totals = [0] * len(rank_parameter_units(request))
    for index, tensors in tensors_of:
        totals[index] += sum(_gathered_bytes(request, t, bytes_per_element) for t in tensors)
    return totals


def forward_gather_bytes(request: PlanRequest, bytes_per_element: int) -> list[int]:
    """Per unit, the bytes its forward gathers: every parameter but the persistent ones."""
    persistent = [(i, [t for t in tensors if _persistent(request, t)]) for i, tensors in _modules(request)]
    return [whole - kept for whole, kept in zip(unit_gather_bytes(request, request.shard_group_size, bytes_per_element),
                                                _per_unit(request, persistent, bytes_per_element))]


def backward_gather_bytes(request: PlanRequest, bytes_per_element: int) -> list[int]:
    """Per unit, the bytes its backward gathers: the forward's, less what the turnaround kept."""
    kept = _per_unit(request, kept_at_turnaround(request), bytes_per_element)
    return [forward - k for forward, k in zip(forward_gather_bytes(request, bytes_per_element), kept)]
