"""ZeRO++'s quantized communication (Wang et al. 2023, secs. 3.1 and 3.3), the rest of
zero3-zeropp besides hpZ (zeroplan.core.zero3_groups): qwZ's int8 parameter all-gathers and
qgZ's hierarchical int4 gradient all-to-all, their bytes on the wire, their buffers, and the HBM
bytes their (de)quantization kernels move (docs/communication-time.md, "ZeRO++ qwZ and qgZ";
docs/memory-model.md, "ZeRO++ qwZ and qgZ").

Sources are deepspeed 0.19.8: runtime/zero/partition_parameters.py (CUDAQuantizer,
all_gather_coalesced's quantized branch, AllGatherCoalescedHandle.wait), runtime/comm/
coalesced_collectives.py (all_to_all_quant_reduce), runtime/zero/stage3.py (__avg_scatter_grads),
utils/groups.py (_get_local_all_to_all_group) and ops/csrc/quantization/pt_binding.cpp (the
kernels' output shapes and dtypes).

Formulas only: no torch.
"""

from __future__ import annotations

from math import isqrt

from zeroplan.core.collective import Collective, CollectiveOp, Phase, make_collective
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.units import ceil_div

QWZ_TARGET_GROUP_ELEMENTS = 8000
"""CUDAQuantizer.target_group_size: the weights quantized under one scale, at most."""
QWZ_BITS = 8
"""CUDAQuantizer.quantize: quantizer_cuda_module.quantize(param, groups, 8, Symmetric)."""
QGZ_BITS = 4
"""all_to_all_quant_reduce: swizzle_quant(tensor, intra_quant_group, 4, Symmetric, ...), fixed."""
SCALE_BYTES = 4
"""pt_binding.cpp quantize_kernel / ds_swizzle_quant / quantized_reduction: scales are a
{groups, 1} at::kFloat tensor (one per group under Symmetric, 2 under Asymmetric)."""
HALF_BYTES = 2
"""The kernels read and write __half: CUDAQuantizer.quantize casts its input to torch.half and
dequantize<__half> returns fp16 (pt_binding.cpp), as swizzle_quant reads (__half*)."""


def qwz_groups(partition_elements: int) -> int:
    """CUDAQuantizer.quantize's group count for a flat input of ``partition_elements``: the
    smallest g >= ceil(n / 8000) with n a multiple of 8 g (its doubling loop never runs then,
    since n / g <= 8000). A one-line refusal where n is no multiple of 8 (DeepSpeed asserts)."""
    n = partition_elements
    if n % 8:
        raise ZeroplanError("strategy", f"zero3-zeropp's qwZ quantizes a partition of {n:,} elements, no multiple of 8 "
                                        "(DeepSpeed's CUDAQuantizer asserts it; allowed: zero3-hpz or zero3)")
    start, m = ceil_div(n, QWZ_TARGET_GROUP_ELEMENTS), n // 8
    # The smallest divisor of n / 8 at or above start (the loop's first g with n % 8g == 0).
    best = m
    for d in range(1, isqrt(m) + 1):
        if m % d == 0:
            for candidate in (d, m // d):
                if start <= candidate < best:
                    best = candidate
    return best


def qwz_scale_bytes(partition_elements: int, group: int) -> int:
    """The gathered scales of one quantized all-gather over ``group`` ranks (quant_scale_buffer:
    scales.numel() x world_size fp32)."""
    return qwz_groups(partition_elements) * group * SCALE_BYTES


# partition_parameters.py all_gather_coalesced, quantize=True: partition_sz is the rank's part of
# the unit (its ds_tensor, or with hpZ its secondary piece, ds_numel x num_of_groups), quantized as
# one flat tensor (torch.cat, then CUDAQuantizer.quantize after a cast to half); the int8 partition
# is gathered into flat_tensor (partition_sz x world_size int8) and the scales into
# quant_scale_buffer. wait() dequantizes flat_tensor to fp16 and copies each parameter out.
def qwz_kernel_bytes(unit_elements: int, group: int) -> int:
    """HBM bytes read and written by one quantized gather's kernels on one rank: quantize reads
    its fp16 partition and writes the int8 one and its scales; dequantize reads the gathered int8
    unit and scales and writes the fp16 unit (the casts and copies around them not counted)."""
    partition = unit_elements // group
    groups = qwz_groups(partition)
    quantize = HALF_BYTES * partition + partition + groups * SCALE_BYTES
    dequantize = unit_elements + groups * group * SCALE_BYTES + HALF_BYTES * unit_elements
    return quantize + dequantize


def qwz_gathers(what: str, phase: Phase, unit_elements: list[int], group: int, occurrences: int,
                spans_nodes: bool, per_node: int | None) -> list[Collective]:
    """One parameter all-gather of every unit under qwZ: the int8 units and their fp32 scales,
    two calls per unit (_dist_allgather_fn twice); the (de)quantization kernels ride on the
    int8 collective (Collective.kernel_bytes)."""
    data = make_collective(CollectiveOp.all_gather, phase, f"{what} int8 (qwZ)", unit_elements, group, occurrences,
                           spans_nodes, QWZ_BITS // 8, per_node)
    scales = make_collective(CollectiveOp.all_gather, phase, f"{what} scales (qwZ)",
                             [qwz_scale_bytes(n // group, group) for n in unit_elements], group, occurrences,
                             spans_nodes, SCALE_BYTES, per_node)
    kernel = sum(qwz_kernel_bytes(n, group) for n in unit_elements)
    return [data.model_copy(update={"kernel_bytes": kernel}), scales]


def qwz_buffer_bytes(request: PlanRequest, unit_elements: list[int]) -> int:
    """qwZ's buffers alive at the wait of the largest unit's gather, over all N ranks (its
    largest case): its int8 partition and scales sent, the int8 unit and scales received
    (flat_tensor, quant_scale_buffer) and the fp16 unit dequantize returns, beside the gathered
    parameters counted as under ZeRO-3."""
    group = request.shard_group_size
    largest = max(unit_elements)
    partition = largest // group
    scales = qwz_groups(partition) * SCALE_BYTES
    return partition + scales + largest + scales * group + HALF_BYTES * largest


# coalesced_collectives.py all_to_all_quant_reduce, per gradient of the bucket: a 1-D tensor, or
# one whose elements are no multiple of 2 x world, is reduce-scattered alone (reduce_scatter_coalesced
# on the world group); the others are quantized to int4 in intra_quant_group = max(shape[0],
# shape[1], world) groups (swizzle_quant: numel / 2 bytes, groups fp32 scales), all-to-all'd inside
# the node (groups local_i: the node's device_count ranks), reduced and requantized to
# intra_quant_group / L groups (quantized_reduction: 1/L of the bytes), all-to-all'd across nodes
# (groups global_j: one rank per node), dequantized to fp16 (numel / L elements) and its num_nodes
# chunks averaged to the rank's 1/world. stage3.py __avg_scatter_grads takes this path only when
# the world spans more than one node (num_nodes > 1); inside one node it reduce-scatters.
def qgz_quantizes(shape: tuple[int, ...], world: int) -> bool:
    """Whether all_to_all_quant_reduce quantizes a gradient of this shape (else reduce-scatters it)."""
    numel = 1
    for d in shape:
        numel *= d
    return len(shape) > 1 and numel % (2 * world) == 0


def qgz_groups(shape: tuple[int, ...], world: int, per_node: int) -> tuple[int, int]:
    """(intra-node groups, inter-node groups) of one quantized gradient."""
    intra = max(shape[0], shape[1], world)
    return intra, intra // per_node


def qgz_kernel_bytes(numel: int, intra: int, inter: int, per_node: int, world: int) -> int:
    """HBM bytes of one gradient's qgZ kernels on one rank: swizzle_quant (fp16 in, int4 and
    scales out), quantized_reduction (the node's int4 and scales in, 1/L of them out), dequantize
    (int4 in, numel / L fp16 out) and the average of the num_nodes chunks (read, the rank's
    1/world written)."""
    int4 = numel * QGZ_BITS // 8
    swizzle = HALF_BYTES * numel + int4 + intra * SCALE_BYTES
    reduction = int4 + intra * SCALE_BYTES + int4 // per_node + inter * SCALE_BYTES
    dequantize = int4 // per_node + inter * SCALE_BYTES + HALF_BYTES * numel // per_node
    average = HALF_BYTES * numel // per_node + HALF_BYTES * numel // world
    return swizzle + reduction + dequantize + average


def qgz_spans_nodes(request: PlanRequest) -> bool:
    """qgZ runs when the data-parallel world spans nodes (num_nodes > 1)."""
    return request.state_group_size > request.cluster.gpus_per_node


def qgz_collectives(request: PlanRequest, gradient_bytes: int, occurrences: int) -> list[Collective]:
    """The gradient reduction of one step under qgZ: the two all-to-alls of the int4 gradients
    and of their scales, and the reduce-scatter of the gradients it leaves unquantized."""
    world, per_node = request.state_group_size, request.cluster.gpus_per_node
    nodes = world // per_node
    fallback, intra_data, intra_scales, inter_data, inter_scales = [], [], [], [], []
    kernel = 0
    for unit in rank_trainable_units(request):
        for t in unit.tensors:
            if not qgz_quantizes(t.shape, world):
                fallback.append(world * ceil_div(t.numel, world) * gradient_bytes)
                continue
            intra, inter = qgz_groups(t.shape, world, per_node)
            int4 = t.numel * QGZ_BITS // 8
            intra_data.append(int4)
            intra_scales.append(intra * SCALE_BYTES)
            inter_data.append(int4 // per_node)
            inter_scales.append(inter * SCALE_BYTES)
            kernel += qgz_kernel_bytes(t.numel, intra, inter, per_node, world)
    a2a = CollectiveOp.all_to_all
    result = []
    if intra_data:
        data = make_collective(a2a, Phase.backward, "gradients int4 (qgZ, node)", intra_data, per_node, occurrences,
                               False, 1)
        inter = make_collective(a2a, Phase.backward, "gradients int4 (qgZ, nodes)", inter_data, nodes, occurrences,
                                True, 1, 1)
        per_byte = 8 // QGZ_BITS
        result += [data.model_copy(update={"kernel_bytes": kernel, "packed_elements": per_byte * sum(intra_data)}),
                   make_collective(a2a, Phase.backward, "gradient scales (qgZ, node)", intra_scales, per_node,
                                   occurrences, False, SCALE_BYTES),
                   inter.model_copy(update={"packed_elements": per_byte * sum(inter_data)}),
                   make_collective(a2a, Phase.backward, "gradient scales (qgZ, nodes)", inter_scales, nodes,
                                   occurrences, True, SCALE_BYTES, 1)]
    if fallback:
        result.append(make_collective(CollectiveOp.reduce_scatter, Phase.backward, "gradients (qgZ fallback)", fallback,
                                      world, occurrences, True, gradient_bytes))
    return result


def qgz_buffer_bytes(request: PlanRequest) -> int:
    """qgZ's buffers of the largest quantized gradient, alive together at its last step: the int4
    tensor and scales sent and received inside the node, the reduced 1/L and scales sent and
    received across nodes, the fp16 dequantized 1/L and the rank's averaged 1/world (0 inside
    one node, where qgZ does not run)."""
    if not qgz_spans_nodes(request):
        return 0
    world, per_node = request.state_group_size, request.cluster.gpus_per_node
    largest = 0
    for unit in rank_trainable_units(request):
        for t in unit.tensors:
            if qgz_quantizes(t.shape, world):
                intra, inter = qgz_groups(t.shape, world, per_node)
                int4 = t.numel * QGZ_BITS // 8
                held = (2 * (int4 + intra * SCALE_BYTES) + 2 * (int4 // per_node + inter * SCALE_BYTES)
                        + HALF_BYTES * t.numel // per_node + HALF_BYTES * t.numel // world)
                largest = max(largest, held)
    return largest
