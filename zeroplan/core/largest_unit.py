"""The largest unit a sharded strategy gathers or reduces as one: the figure ZeRO's buckets,
FSDP's gathered units and DeepSpeed's prefetch bounds are sized by. Below zeroplan.core.buffers
and the DeepSpeed modules that both read it.

Formulas only: no torch.
"""

from __future__ import annotations

from zeroplan.core.model_states import padded_unit_elements_of, unit_gather_bytes
from zeroplan.core.parallel.units import block_positions, rank_parameter_units
from zeroplan.core.profiles import fsdp_separates_embedding_and_head
from zeroplan.specs.request import PlanRequest


# The FSDP recipe (torchtitan, zeroplan/harness/torch_engines.py): fully_shard each block, then
# the root, whose parameter group is everything else (embedding, final norm, head), gathered as
# one. The reference ZeRO and DeepSpeed gather the embedding and the head as separate units, as
# does torchtune's FSDP2 (custom_sharded_layers, zeroplan.core.profiles).
def largest_unit_elements(request: PlanRequest) -> int:
    """Padded trainable elements of the largest unit gathered or reduced as one."""
    return _largest_group(request, padded_unit_elements_of(request, request.shard_group_size))


def largest_gathered_unit_bytes(request: PlanRequest, bytes_per_element: int) -> int:
    """Bytes of the largest unit an all-gather brings in (frozen tensors in their storage)."""
    return _largest_group(request, unit_gather_bytes(request, request.shard_group_size, bytes_per_element))


def _largest_group(request: PlanRequest, per_unit: list[int]) -> int:
    if not request.strategy.kind.is_fsdp or fsdp_separates_embedding_and_head(request):
        return max(per_unit)
    blocks = [per_unit[i] for i in block_positions(rank_parameter_units(request))]
    # The root's units are the rest: every unit's sum less the blocks' (integers, exact).
    root = sum(per_unit) - sum(blocks)
    return max(blocks + [root])
