"""The checkpoint save of a Hugging Face run under accelerate's FSDP1: a moment of its own after
a step (docs/memory-model.md, "The checkpoint save"), whose bytes beyond the model states the
step leaves come from what FSDP1's state-dict hooks gather and clone. Formulas only: no torch.

The mechanism, read from the frameworks' source:
- transformers' Trainer saves through accelerate under FSDP (4.39.0 trainer.py:2752-2758
  _save_checkpoint -> save_fsdp_model / save_fsdp_optimizer), which builds ``model.state_dict()``
  inside ``FSDP.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config, ...)``
  (accelerate 0.28.0 and 1.10.1 utils/fsdp_utils.py save_fsdp_model; a PEFT model's
  get_peft_model_state_dict filters the whole state dict afterwards).
- accelerate's default type under FSDP1 is FULL_STATE_DICT (0.28.0 utils/dataclasses.py:1101-1103
  ``os.environ.get(prefix + "STATE_DICT_TYPE", "FULL_STATE_DICT")``; 1.10.1 :1973-1977 the same
  for fsdp_version 1, SHARDED_STATE_DICT for 2), with FullStateDictConfig(offload_to_cpu=True,
  rank0_only=True), which save_fsdp_model keeps on more than one process.
- SHARDED_STATE_DICT had no config of accelerate's before 0.31.0, so torch's
  ShardedStateDictConfig(offload_to_cpu=False) held; accelerate 67308ca (#2762, first in 0.31.0)
  sets ShardedStateDictConfig(offload_to_cpu=True).
- torch FSDP1 (2.13 distributed/fsdp/_state_dict_utils.py; the same in 2.2): a module's
  state_dict runs its pre-hook, its children's state_dict, then its post-hook, so the root unit
  (embedding, final norm, head) is gathered first and stays gathered while each block unit is
  gathered, read and resharded in turn. Every unit is gathered in its full precision (the flat
  parameter's stored dtype, _force_full_precision under SUMMON_FULL_PARAMS).
  FULL_STATE_DICT with offload_to_cpu and rank0_only (_unshard_param_utils.py
  _unshard_fsdp_state_params): rank 0 copies each gathered flat parameter to the host and frees
  it on the device (FlatParamHandle.to_cpu), gathering it again once the unit's state dict is
  done; the other ranks reshard at once. Each parameter is then cloned on the host
  (_full_post_state_dict_hook).
  SHARDED_STATE_DICT (_sharded_post_state_dict_hook): each parameter becomes a ShardedTensor whose
  local shard is ``chunks[rank].clone()`` of the gathered tensor on the device
  (_shard_utils.py _create_chunk_sharded_tensor), moved to the host (``.cpu()``) only under
  offload_to_cpu. Without it the rank's share of every parameter stays on the device until the
  state dict is dropped.
So the save holds, beside the model states left after the step (gradients freed by zero_grad's
set_to_none): under FULL_STATE_DICT on several processes one unit gathered at a time (the root's
among them); under SHARDED_STATE_DICT the root unit gathered, one block unit gathered at a time,
and the chunks kept (every parameter's share, before accelerate 0.31.0) or the one chunk being
moved to the host (from 0.31.0). The optimizer's save (save_fsdp_optimizer) follows the
model's, one flat parameter's states at a time, and is not planned.
"""

from __future__ import annotations

from zeroplan.core.finetune.storage import frozen_tensor_bytes
from zeroplan.core.layout import element_bytes
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.core.parallel.units import block_positions, rank_parameter_units
from zeroplan.core.record import frozen
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import version_tuple
from zeroplan.specs.framework import ACCELERATE_VERSION, Framework
from zeroplan.specs.request import HF_FSDP1_STRATEGIES, PlanRequest
from zeroplan.specs.training import FsdpStateDict
from zeroplan.units import ceil_div

ACCELERATE_FSDP1_DEFAULT = FsdpStateDict.full
"""accelerate's fsdp_state_dict_type when the config names none, under FSDP1 (0.28.0
utils/dataclasses.py:1101-1103, 1.10.1 :1973-1977)."""

SHARDED_OFFLOADS_FROM = (0, 31, 0)
"""accelerate 67308ca (#2762, 'Enable sharded cpu resume'), first released in 0.31.0:
set_state_dict_type gives SHARDED_STATE_DICT ShardedStateDictConfig(offload_to_cpu=True)."""


@frozen(slots=True)
class SaveUnits:
    """What the save gathers and keeps on one rank, in its order."""

    held_bytes: int
    """The root unit gathered, from its pre-hook to its post-hook (the whole save)."""
    steps: tuple[tuple[int, tuple[int, ...], int], ...]
    """Each unit in turn, the blocks then the root's own post-hook: (bytes gathered for it and
    freed after, each parameter's chunk kept until the state dict is dropped, the largest chunk
    made and moved to the host at once)."""


def applies(request: PlanRequest) -> bool:
    """Whether the request is an hf run under accelerate's FSDP1 with a strategy it was measured under."""
    return (request.training.framework is Framework.hf and request.strategy.fsdp1_root_stays_gathered
            and request.strategy.kind in HF_FSDP1_STRATEGIES)


def check_fsdp_state_dict(request: PlanRequest) -> None:
    """Refuse, in one line naming the field, a state-dict type where the save is not modelled."""
    if request.training.fsdp_state_dict is None or applies(request):
        return
    allowed = ", ".join(k.value for k in HF_FSDP1_STRATEGIES)
    fsdp2 = " under FSDP2" if request.strategy.kind.is_fsdp and not request.strategy.fsdp1_root_stays_gathered else ""
    raise ZeroplanError("fsdp_state_dict", f"applies to framework hf under FSDP1 (--fsdp-version 1) with {allowed} "
                        f"only, not {request.training.framework.value} {request.strategy.kind.value}{fsdp2}")


def state_dict_type(request: PlanRequest) -> FsdpStateDict | None:
    """The type the run saves with (accelerate's default where none is given); None outside hf's FSDP1."""
    if not applies(request):
        return None
    return request.training.fsdp_state_dict or ACCELERATE_FSDP1_DEFAULT


# accelerate 67308ca (SHARDED_OFFLOADS_FROM): from 0.31.0 a sharded save's chunks go to the host.
def sharded_chunks_stay(request: PlanRequest) -> bool:
    """Whether a SHARDED_STATE_DICT save keeps the chunks on the device (accelerate before 0.31.0)."""
    return version_tuple(request.training.accelerate_version or ACCELERATE_VERSION) < SHARDED_OFFLOADS_FROM


def save_units(request: PlanRequest) -> SaveUnits | None:
    """What the save gathers and keeps on the rank that holds the most (rank 0); None where no
    save is planned."""
    kind = state_dict_type(request)
    if kind is None or kind is FsdpStateDict.none:
        return None
    shards = request.shard_group_size
    eb = element_bytes(request.training.precision, request.convention)
    # Full precision: the trainable flat parameters in their stored dtype, frozen ones in their
    # storage. One process runs NO_SHARD (torch FSDP1 _init_utils.py: FULL_SHARD on a world of
    # one is switched to it), whose parameters are whole already: nothing is gathered.
    units = rank_parameter_units(request)
    gathered = unit_gather_bytes(request, shards, eb.parameter) if shards > 1 else [0] * len(units)
    blocks = block_positions(units)
    root = [i for i in range(len(units)) if i not in blocks]
    if kind is FsdpStateDict.full and shards > 1:
        # offload_to_cpu and rank0_only: FlatParamHandle.to_cpu (_flat_param.py) copies each
        # gathered unit to the host and frees it on the device, the root's too, gathering it
        # again once the unit's state dict is done: one unit on the device at a time, the
        # clones (_full_post_state_dict_hook) on the host.
        return SaveUnits(held_bytes=0, steps=tuple((gathered[i], (), 0) for i in blocks)
                         + ((sum(gathered[i] for i in root), (), 0),))
    # One process: save_fsdp_model sets neither offload_to_cpu nor rank0_only, and the full
    # state dict's clones stay on the device, as a sharded one's chunks do before 0.31.0.
    keeps = kind is FsdpStateDict.full or sharded_chunks_stay(request)

    def chunks(indices: list[int]) -> tuple[int, ...]:
        # torch.chunk(world_size) of each parameter: the first rank's chunk, the largest, is its ceiling share.
        return tuple(ceil_div(t.numel * eb.parameter if t.trainable else frozen_tensor_bytes(request, t, gathered=True),
                              shards) for i in indices for t in units[i].tensors)

    def step(gathered_bytes: int, indices: list[int]) -> tuple[int, tuple[int, ...], int]:
        # The chunks are kept on the device, or each moved to the host as it is made.
        made = chunks(indices)
        return (gathered_bytes, made, 0) if keeps else (gathered_bytes, (), max(made, default=0))

    steps = tuple(step(gathered[i], [i]) for i in blocks) + (step(0, root),)
    return SaveUnits(held_bytes=sum(gathered[i] for i in root), steps=steps)


def save_peak_bytes(save: SaveUnits | None) -> int:
    """The most the save holds at once beyond the states the step leaves: the root gathered,
    the chunks kept so far, and the unit being read with its chunk; 0 without a save."""
    if save is None:
        return 0
    peak = kept = 0
    for gathered, keeps, moves in save.steps:
        peak = max(peak, kept + gathered + sum(keeps) + moves)
        kept += sum(keeps)
    return save.held_bytes + peak
