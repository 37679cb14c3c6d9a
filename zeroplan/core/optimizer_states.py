"""Bytes of optimizer state per parameter tensor, for each optimizer zeroplan knows."""

from __future__ import annotations

from zeroplan.core.params import ParamTensor
from zeroplan.specs.training import Optimizer
from zeroplan.units import ceil_div

# Number of full-size state tensors per parameter (torch.optim sources: adamw.py keeps exp_avg
# and exp_avg_sq; sgd.py keeps momentum_buffer; Chen et al. 2023 (Lion), Alg. 1: one momentum).
_ELEMENTWISE_STATES = {
    Optimizer.adamw: 2,
    Optimizer.adam: 2,
    Optimizer.sgd: 0,
    Optimizer.sgd_momentum: 1,
    Optimizer.lion: 1,
}

# bitsandbytes optim/optimizer.py (Optimizer2State.init_state): 8-bit states are quantised in
# blocks of 256 with one fp32 absmax per block; tensors below min_8bit_size=4096 stay fp32.
ADAM_8BIT_BLOCK = 256
ADAM_8BIT_MIN_SIZE = 4096


def is_elementwise(optimizer: Optimizer) -> bool:
    """True when the state is a fixed number of bytes per element (exact under any sharding)."""
    return optimizer in _ELEMENTWISE_STATES


def elementwise_state_bytes(optimizer: Optimizer, state_dtype_bytes: int) -> int:
    """Optimizer bytes per parameter element for element-wise optimizers (K minus the master
    copy, in the ZeRO paper's notation: 8 for fp32 Adam)."""
    return _ELEMENTWISE_STATES[optimizer] * state_dtype_bytes


# Shazeer & Stern 2018 (Adafactor), sec. 3: the second moment of an (r, c) matrix is factored
# into a row vector (r) and a column vector (c); vectors keep the full second moment. The
# first moment is off by default (beta1=None, as in transformers.optimization.Adafactor and
# torch.optim.Adafactor). A tensor of more dimensions is factored over its last two, once per
# leading index (torch/optim/_adafactor.py: row_var of shape (..., r, 1), col_var (..., 1, c)).
def adafactor_state_bytes(tensor: ParamTensor, state_dtype_bytes: int) -> int:
    if len(tensor.shape) < 2:
        return tensor.numel * state_dtype_bytes
    rows, cols = tensor.shape[-2], tensor.shape[-1]
    matrices = tensor.numel // (rows * cols)
    return matrices * (rows + cols) * state_dtype_bytes


# Dettmers et al. 2022 (8-bit optimizers), sec. 2: two uint8 states plus block-wise absmax.
def adam_8bit_state_bytes(tensor: ParamTensor) -> int:
    if tensor.numel < ADAM_8BIT_MIN_SIZE:
        return 2 * 4 * tensor.numel
    blocks = ceil_div(tensor.numel, ADAM_8BIT_BLOCK)
    return 2 * (tensor.numel + 4 * blocks)


def tensor_state_bytes(tensor: ParamTensor, optimizer: Optimizer, state_dtype_bytes: int) -> int:
    """Optimizer-state bytes of one unsharded tensor (master copy not included)."""
    if optimizer is Optimizer.adafactor:
        return adafactor_state_bytes(tensor, state_dtype_bytes)
    if optimizer is Optimizer.adam_8bit:
        return adam_8bit_state_bytes(tensor)
    return tensor.numel * elementwise_state_bytes(optimizer, state_dtype_bytes)


# torch/optim/adam.py and adamw.py (_init_group): state["step"] is a 0-dim fp32 tensor per
# stepped tensor (also with capturable=False), so every tensor the optimizer sees adds 4 bytes;
# torch/optim/_adafactor.py (_init_group) keeps the same 0-dim fp32 step per tensor. SGD keeps
# no step.
ADAM_STEP_COUNTER_BYTES = 4
_OPTIMIZERS_WITH_STEP_TENSORS = (Optimizer.adam, Optimizer.adamw, Optimizer.adafactor)


def step_counter_bytes(optimizer: Optimizer, num_stepped_tensors: int) -> int:
    if optimizer in _OPTIMIZERS_WITH_STEP_TENSORS:
        return ADAM_STEP_COUNTER_BYTES * num_stepped_tensors
    return 0
