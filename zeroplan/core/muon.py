"""The Muon optimizer (momentum orthogonalised by Newton-Schulz) with its auxiliary AdamW: which
tensors each steps, the state bytes each keeps on one rank, and the temporaries of the
orthogonalisation. Modelled where zeroplan.specs.request.check_muon allows it: torch.optim.Muon
beside torch.optim.AdamW under DDP, DeepSpeed's MuonWithAuxAdam under its ZeRO stages 1 and 2.
Measured by benchmarks/muon_records.py (tests/test_muon.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.core.param_tensors import ParamTensor, ParamUnit
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.units import BF16_BYTES, ceil_div

if TYPE_CHECKING:
    from zeroplan.specs.request import PlanRequest

_ADAMW_STATES = 2
"""torch/optim/adamw.py _init_group and DeepSpeed's FusedAdam (ops/adam/fused_adam.py): exp_avg
and exp_avg_sq per element."""

_AUXILIARY_UNITS = ("embedding", "head")


# deepspeed 0.19.8 deepspeed/__init__.py set_optimizer_flags: use_muon for a parameter whose layer
# shape has 2 or more dimensions and whose name holds neither "embed" nor "lm_head"; every other
# parameter goes to the auxiliary AdamW (runtime/engine.py _muon_param_groups). torch 2.13
# torch/optim/_muon.py accepts 2-D parameters only and its docstring leaves biases and embeddings
# to AdamW; Keller Jordan's MuonWithAuxAdam example (quoted in DeepSpeed's original_muon.py)
# gives the blocks' matrices to Muon and the embedding, the head and every vector to AdamW. In
# zeroplan's units: a matrix of a block (MoE's batched experts are refused by check_muon).
def muon_steps(unit: ParamUnit, tensor: ParamTensor) -> bool:
    """Whether Muon (True) or the auxiliary AdamW (False) steps this trainable tensor."""
    return len(tensor.shape) >= 2 and unit.name not in _AUXILIARY_UNITS


def split_tensors(request: PlanRequest) -> tuple[list[ParamTensor], list[ParamTensor]]:
    """This rank's trainable tensors in registration order: (Muon's, AdamW's)."""
    muon: list[ParamTensor] = []
    adamw: list[ParamTensor] = []
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            if tensor.trainable:
                (muon if muon_steps(unit, tensor) else adamw).append(tensor)
    return muon, adamw


# deepspeed 0.19.8 runtime/zero/muon/original_muon.py MuonWithAuxAdam.__init__: the Muon group's
# parameters are sorted by torch.Size, largest first (a stable sort, so equal shapes keep their
# order); ZeRO-1/2 flattens each optimizer group in that order (stage_1_and_2.py bit16_groups).
def deepspeed_muon_order(tensors: list[ParamTensor]) -> list[ParamTensor]:
    return sorted(tensors, key=lambda tensor: tensor.shape, reverse=True)


# deepspeed 0.19.8 runtime/zero/stage_1_and_2.py _muon_momentum_buffer: a Muon group's momentum is
# torch.zeros(sum(t.numel() for t in tensor_list)) over params_in_partition, the whole parameters
# that meet the rank's partition (Newton-Schulz needs whole matrices: average_tensor all-reduces a
# Muon matrix cut by a partition bound to every rank holding a piece of it); the flat group is
# padded to a multiple of 2N (deepspeed_buckets.flat_group_elements) and cut into N equal
# partitions.
def deepspeed_muon_whole_elements_by_rank(numels: list[int], group_size: int) -> list[int]:
    """Per rank, the elements of the whole parameters meeting its partition of a flat group of
    parameters of ``numels`` (in the group's order)."""
    return deepspeed_whole_sum_by_rank(numels, numels, group_size)


def deepspeed_whole_sum_by_rank(numels: list[int], values: list[int], group_size: int) -> list[int]:
    """Per rank, the sum of ``values`` (one per parameter, in the group's order) over the whole
    parameters meeting its partition of a flat group of parameters of ``numels``."""
    from zeroplan.core.deepspeed_buckets import flat_group_elements

    whole = [0] * group_size
    if not numels:
        return whole
    partition = flat_group_elements(sum(numels), group_size) // group_size
    start = 0
    for numel, value in zip(numels, values):
        end = start + numel
        for rank in range(start // partition, min(group_size, ceil_div(end, partition))):
            whole[rank] += value
        start = end
    return whole


def deepspeed_whole_elements(request: PlanRequest) -> int:
    """The whole Muon matrices' elements on the fullest rank under DeepSpeed's ZeRO-1/2."""
    muon, _ = split_tensors(request)
    return max(deepspeed_muon_whole_elements_by_rank([t.numel for t in deepspeed_muon_order(muon)], request.shard_group_size))


# deepspeed 0.19.8 runtime/zero/stage_1_and_2.py get_flat_partition (return_tensor_list=True, at
# the backward's end): each Muon matrix's muon_update returns a new update tensor in the
# gradients' dtype, and averaged_gradients keeps views of it until step() flattens the group and
# drops them (averaged_gradients[i] = None): the whole matrices' updates are held beside the
# gradient buffer from the backward's end through the norm to the group's step. Measured by
# benchmarks/muon_records.py (held_storages_bytes).
def deepspeed_held_update_bytes(request: PlanRequest, gradient_bytes: int) -> int:
    return deepspeed_whole_elements(request) * gradient_bytes


# deepspeed 0.19.8 runtime/zero/stage_1_and_2.py _muon_momentum_buffer (the dtype of the gradients
# it folds in: the model's, DeepSpeed's default grad_accum_dtype, engine.py get_data_types) and
# _muon_staging_momentum (an empty_like of it, kept across steps so a skipped step leaves the
# committed momentum as it was): two buffers of the whole matrices. The auxiliary AdamW's two
# states on its own group's partition (the engine makes it a group of its own, _muon_param_groups),
# each torch.zeros_like of the partition it steps (original_muon.py MuonWithAuxAdam.step:
# exp_avg, exp_avg_sq): in the partition's master_weights_and_grads_dtype (stage_1_and_2.py
# weights_partition ... .to(dtype=self.master_weights_and_grads_dtype)), fp32 unless
# bf16_master_weights_and_grads with bf16_optimizer_states make it bf16
# (runtime/base_optimizer.py _configure_master_weights), which bf16-pure stands for here.
def deepspeed_state_bytes(request: PlanRequest, gradient_bytes: int, adamw_state_bytes: int) -> int:
    """Muon's momentum and staged momentum (on the fullest rank) plus AdamW's states on one rank
    under ZeRO-1/2, each AdamW state element of ``adamw_state_bytes`` (the master partition's)."""
    momentum = deepspeed_whole_elements(request)
    return 2 * momentum * gradient_bytes + _ADAMW_STATES * adamw_state_bytes * deepspeed_adamw_partition_elements(request)


def deepspeed_adamw_partition_elements(request: PlanRequest) -> int:
    """Elements of the auxiliary AdamW group's partition on one rank (its flat group cut N ways)."""
    from zeroplan.core.deepspeed_buckets import flat_group_elements

    _, adamw = split_tensors(request)
    group = request.shard_group_size
    return flat_group_elements(sum(t.numel for t in adamw), group) // group if adamw else 0


# torch 2.13 torch/optim/_muon.py Muon._init_group: one momentum_buffer, zeros_like(p.grad), per
# matrix (the grad of the tensor the optimizer steps has its dtype); AdamW two states per element.
def torch_state_bytes(request: PlanRequest, state_dtype_bytes: int) -> int:
    """torch.optim.Muon's momentum and AdamW's states on one unsharded rank (DDP)."""
    muon, adamw = split_tensors(request)
    return (sum(t.numel for t in muon) + _ADAMW_STATES * sum(t.numel for t in adamw)) * state_dtype_bytes


def adamw_stepped_tensors(request: PlanRequest) -> int:
    """The tensors torch.optim.AdamW steps beside Muon (each keeps a 0-dim fp32 step; Muon keeps
    none: _muon.py _init_group makes the momentum alone)."""
    return len(split_tensors(request)[1])


# torch 2.13 torch/optim/_muon.py _single_tensor_muon and _zeropower_via_newtonschulz, per matrix of
# r x c (s = min(r, c)): the Nesterov update grad.lerp(buf) in the gradient's dtype lives through
# the iteration; its bf16 copy (none when the gradient is bf16 already: .bfloat16() returns it)
# is replaced at each step by addmm(X, B, X), made while the old X, the Gram matrix X X^T (s x s)
# and B = addmm(A, A, A) (s x s) are alive: one r x c in the gradient's dtype, two r x c and two
# s x s in bf16 at once. Measured by benchmarks/muon_records.py (torch_muon, step_peak_bytes).
def newton_schulz_peak_bytes(shape: tuple[int, ...], gradient_bytes: int) -> int:
    rows, cols = shape[-2], shape[-1]
    numel = rows * cols
    side = min(rows, cols)
    return numel * gradient_bytes + 2 * BF16_BYTES * numel + 2 * BF16_BYTES * side * side


def largest_newton_schulz_bytes(request: PlanRequest, gradient_bytes: int) -> int:
    """The step's largest Newton-Schulz peak: matrices are orthogonalised one after another."""
    muon, _ = split_tensors(request)
    return max((newton_schulz_peak_bytes(t.shape, gradient_bytes) for t in muon), default=0)


def adamw_elements(request: PlanRequest) -> tuple[int, int]:
    """(all elements, the largest tensor's) of the tensors the auxiliary AdamW steps on one rank."""
    _, adamw = split_tensors(request)
    return sum(t.numel for t in adamw), max((t.numel for t in adamw), default=0)
