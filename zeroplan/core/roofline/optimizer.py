"""The optimizer step on the GPU: a memory-bound pass (or several) over the rank's parameters,
gradients and states. docs/communication-time.md, "Compute, operation by operation"."""

from __future__ import annotations

from zeroplan.core.optimizer_states import elementwise_state_bytes, is_elementwise
from zeroplan.specs.training import Optimizer, OptimizerLoop
from zeroplan.units import BF16_BYTES

TORCH_ADAM_ACCESSES_PER_ELEMENT = 20
"""torch 2.13 torch/optim/adam.py, _single_tensor_adam and _multi_tensor_adam run the same ops,
one tensor (or one list of tensors) at a time, each a pass over memory. Per element: decoupled
weight decay param.mul_ (2 accesses), exp_avg.lerp_ (3), exp_avg_sq.mul_ then addcmul_ (2 + 3),
the denominator's sqrt, division and add_ (2 + 2 + 2), param.addcdiv_ (4): 20."""
FUSED_ADAM_ACCESSES_PER_ELEMENT = 7
"""torch._fused_adamw_ (and DeepSpeed's FusedAdam, multi_tensor_apply) reads param, gradient,
exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq back, once each."""
MASTER_TO_PARAMETER_BYTES = 4 + 2
"""Where the optimizer steps an fp32 master copy beside 16-bit parameters (DeepSpeed's and the
reference ZeRO's layout), the updated master is cast back: read 4 bytes, write 2."""


def optimizer_bytes_per_element(optimizer: Optimizer, loop: OptimizerLoop, state_dtype_bytes: int,
                                separate_master: bool) -> int:
    """Device-memory bytes read plus written per parameter element by one optimizer step.
    Adam/AdamW: 20 accesses unfused, 7 fused. Other element-wise optimizers are charged one
    fused pass over parameter, gradient and states (a lower bound for their unfused loops);
    factored and 8-bit optimizers as Adam."""
    if optimizer in (Optimizer.adam, Optimizer.adamw) or not is_elementwise(optimizer):
        accesses = FUSED_ADAM_ACCESSES_PER_ELEMENT if loop is OptimizerLoop.fused else TORCH_ADAM_ACCESSES_PER_ELEMENT
        moved = accesses * state_dtype_bytes
    else:
        states = elementwise_state_bytes(optimizer, state_dtype_bytes)
        moved = 2 * state_dtype_bytes + states + state_dtype_bytes + states
    return moved + (MASTER_TO_PARAMETER_BYTES if separate_master else 0)


# torch 2.13 torch/optim/_muon.py _single_tensor_muon (no foreach or fused form: muon() refuses
# foreach), per element of a matrix in the gradient's dtype g beside a parameter of p bytes:
# buf.lerp_(grad) reads two and writes one (3g), the Nesterov grad.lerp(buf) likewise (3g);
# _zeropower_via_newtonschulz's .bfloat16() copy (g + 2, none for a bf16 gradient), its norm
# (read 2) and div_ (2 + 2); after the products, param.mul_ (2p) and param.add_ of the bf16
# update (p + 2 + p). The products' own traffic is theirs (zeroplan.core.muon_time).
def torch_muon_bytes_per_element(gradient_bytes: int, parameter_bytes: int) -> int:
    """Device-memory bytes read plus written per Muon element by torch.optim.Muon's element-wise ops."""
    cast = 0 if gradient_bytes == BF16_BYTES else gradient_bytes + BF16_BYTES
    return 6 * gradient_bytes + cast + 3 * BF16_BYTES + 4 * parameter_bytes + BF16_BYTES
