"""Bytes per element of each model state, and how many elements of a unit a rank holds."""

from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING

from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.core.profiles import profile
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import Precision, StateConvention
from zeroplan.units import ceil_div

if TYPE_CHECKING:
    from zeroplan.specs.request import PlanRequest


class ElementBytes(Frozen):
    """Bytes per parameter element of each persistent model state."""

    parameter: int
    """The parameter as stored between steps (half precision under ``zero``, fp32 under fsdp2)."""
    gradient: int
    """The gradient as held between backward and the optimizer step."""
    master: int
    """A separate fp32 master copy of the weights, else 0."""
    optimizer_dtype: int
    """Bytes of one optimizer-state element (fp32, or bf16 for pure bf16)."""
    compute_parameter: int
    """The parameter as the forward pass uses it (what ZeRO-3/FSDP all-gather)."""


# ZeRO paper sec. 3.1 (zero); DeepSpeed holds the gradients the optimizer reads in fp32
# (deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups[i].grad;
# stage3.py fp32_partitioned_groups_flat[i].grad, both fp32 copies made at the step): 2 + 4 + 12 = 18 bytes (deepspeed); FSDP2
# (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) keeps fp32 sharded parameters and
# gradients and casts to MixedPrecisionPolicy.param_dtype for compute (fsdp2).
# In fp32 DeepSpeed still clones its partition into a separate fp32 master
# (stage_1_and_2.py: weights_partition = ...detach().clone().to(master_weights_and_grads_dtype);
# stage3.py: fp32_partitioned_groups_flat), measured by the harness: 4 + 4 + 4 + 8 = 20 bytes.
# Asked for every collective and buffer of every plan: one answer per (precision, convention).
@lru_cache(maxsize=None)
def element_bytes(precision: Precision, convention: StateConvention) -> ElementBytes:
    if precision is Precision.fp32:
        master = 4 if convention is StateConvention.deepspeed else 0
        return ElementBytes(parameter=4, gradient=4, master=master, optimizer_dtype=4, compute_parameter=4)
    if precision is Precision.bf16_pure:
        return ElementBytes(parameter=2, gradient=2, master=0, optimizer_dtype=2, compute_parameter=2)
    if convention is StateConvention.fsdp2:
        return ElementBytes(parameter=4, gradient=4, master=0, optimizer_dtype=4, compute_parameter=2)
    if convention is StateConvention.deepspeed:
        return ElementBytes(parameter=2, gradient=4, master=4, optimizer_dtype=4, compute_parameter=2)
    return ElementBytes(parameter=2, gradient=2, master=4, optimizer_dtype=4, compute_parameter=2)


class ShardLayout(str, Enum):
    """How a unit is cut into N shards."""

    flat = "flat"
    """The unit is one flat buffer padded to a multiple of N (zeroplan's reference ZeRO,
    zeroplan/harness/zero.py; DeepSpeed flattens per group in the same way)."""
    dim0 = "dim0"
    """Each tensor is split on dim 0, padded to a multiple of N rows (FSDP2's
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharded_param)."""


def tensor_shard_count(tensor: ParamTensor, num_shards: int) -> int:
    """Ranks a tensor is sharded over: the group, or the group over ep for the routed experts
    under expert parallelism (ParamTensor.shard_group_divisor)."""
    return max(1, num_shards // tensor.shard_group_divisor)


def tensor_shard_elements(tensor: ParamTensor, num_shards: int, layout: ShardLayout) -> int:
    """shard_elements of a unit of ``tensor`` alone (padding included), without building the unit."""
    if layout is ShardLayout.flat:
        return ceil_div(tensor.numel, num_shards)
    rows = tensor.shape[0]
    return ceil_div(rows, tensor_shard_count(tensor, num_shards)) * (tensor.numel // rows)


def padded_unit_elements(unit: ParamUnit, num_shards: int, layout: ShardLayout) -> int:
    """Elements of the unit after padding, summed over all shards."""
    if layout is ShardLayout.flat:
        return num_shards * shard_elements(unit, num_shards, layout)
    return _dim0_elements(unit, num_shards)[1]


def shard_elements(unit: ParamUnit, num_shards: int, layout: ShardLayout) -> int:
    """Elements of the unit one rank holds (padding included)."""
    if layout is ShardLayout.flat:
        return ceil_div(unit.numel, num_shards)
    return _dim0_elements(unit, num_shards)[0]


# FSDP2's dim-0 shards are a walk over the unit's tensors, asked for every unit of every rank's
# layout by the model states, buffers and collectives (the plan search: tens of thousands of
# walks). A model's blocks are the same tensors under another unit name, so the answer is kept
# per the tensors' (rows, elements a row, shard group divisor), which every unit of the same
# shapes shares, and each unit's shapes under its identity (the entry keeps the unit alive, so
# the identity cannot be reused).
_DIM0_SHAPES: dict[int, tuple[ParamUnit, int]] = {}
"""id(unit) -> (the unit, its shapes' number in _DIM0_SHAPE_NUMBERS)."""
_DIM0_SHAPE_NUMBERS: dict[tuple[tuple[int, int, int], ...], int] = {}
_DIM0_ELEMENTS: dict[tuple[int, int], tuple[int, int]] = {}
"""(shapes' number, shards) -> (shard_elements, padded_unit_elements) under ShardLayout.dim0."""
_DIM0_LIMIT = 8192


def _make_room(units: int) -> None:
    """Clear the shapes' caches unless ``units`` more units fit. Numbers are reused once
    cleared, so every cache that holds them goes together, and only here: a caller that has
    made room for its units reads their numbers without one being cleared in between."""
    if len(_DIM0_SHAPES) + units > _DIM0_LIMIT or len(_DIM0_ELEMENTS) >= _DIM0_LIMIT:
        _DIM0_SHAPES.clear(), _DIM0_SHAPE_NUMBERS.clear(), _DIM0_ELEMENTS.clear()


def _shapes_number(unit: ParamUnit) -> int:
    """The number of the unit's tensors' shapes in _DIM0_SHAPE_NUMBERS (equal for units whose
    tensors have the same rows, elements a row and shard group divisors, in order)."""
    known = _DIM0_SHAPES.get(id(unit))
    if known is None or known[0] is not unit:
        _make_room(1)
        shapes = tuple((t.shape[0], t.numel // t.shape[0], t.shard_group_divisor) for t in unit.tensors)
        known = _DIM0_SHAPES[id(unit)] = (unit, _DIM0_SHAPE_NUMBERS.setdefault(shapes, len(_DIM0_SHAPE_NUMBERS)))
    return known[1]


_DISTINCT_UNITS: dict[int, tuple[tuple[ParamUnit, ...], tuple[tuple[ParamUnit, int], ...]]] = {}
"""id(units) -> (the units, distinct_units of them)."""


def distinct_units(units: tuple[ParamUnit, ...]) -> tuple[tuple[ParamUnit, int], ...]:
    """The units as (one unit of each set of tensor shapes, how many units have them), first
    appearance first: every shard size (shard_elements, padded_unit_elements, under either
    layout) is the same for units of the same shapes, so a sum over a model's identical blocks
    is one unit's times their count. Kept by the units' identity (the entry holds them)."""
    known = _DISTINCT_UNITS.get(id(units))
    if known is not None and known[0] is units:
        return known[1]
    _make_room(len(units))
    counts: dict[int, list] = {}
    for unit in units:
        number = _shapes_number(unit)
        entry = counts.get(number)
        if entry is None:
            counts[number] = [unit, 1]
        else:
            entry[1] += 1
    if len(_DISTINCT_UNITS) >= _DIM0_LIMIT:
        _DISTINCT_UNITS.clear()
    answer = tuple((unit, count) for unit, count in counts.values())
    _DISTINCT_UNITS[id(units)] = (units, answer)
    return answer


def _dim0_elements(unit: ParamUnit, num_shards: int) -> tuple[int, int]:
    """(elements one rank holds, elements summed over the shards) of ``unit`` cut on dim 0 of
    each tensor ``num_shards`` ways (each tensor over tensor_shard_count ranks), padding included."""
    key = (_shapes_number(unit), num_shards)
    answer = _DIM0_ELEMENTS.get(key)
    if answer is None:
        held = padded = 0
        for tensor in unit.tensors:
            shards, rows = tensor_shard_count(tensor, num_shards), tensor.shape[0]
            row_numel = tensor.numel // rows
            held += ceil_div(rows, shards) * row_numel
            padded += shards * ceil_div(rows, shards) * row_numel
        answer = _DIM0_ELEMENTS[key] = (held, padded)
    return answer


def gradient_wire_bytes(request: "PlanRequest") -> int:
    """Bytes per element of the gradients the collectives reduce: the compute dtype (ZeRO
    reduces fp16/bf16 gradients), or fp32 for FSDP with an fp32 reduce_dtype (unless the
    framework's own FSDP2 wrapping reduces in the compute dtype: zeroplan.core.profiles)."""
    eb = element_bytes(request.training.precision, request.convention)
    strategy = request.strategy
    framework_choice = profile(request.training.framework).fsdp_reduces_in_compute_dtype
    if strategy.kind.is_fsdp and strategy.fsdp_reduce_in_fp32 and not framework_choice:
        return 4
    return eb.compute_parameter
