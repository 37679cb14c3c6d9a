"""torch's nn.MultiheadAttention under DeepSpeed's ZeRO-3 engine: every block's gathered
in-projection stays alive from its forward to its backward, after the coordinator has released it
(docs/memory-model.md, "nn.MultiheadAttention under DeepSpeed's ZeRO-3"). Sources: DeepSpeed 0.19.8,
torch 2.13.

DeepSpeed's forward pre-hook on every module passes each input tensor through an autograd
Function of its own (runtime/zero/parameter_offload.py _post_backward_module_hook, lines 437-442;
PostBackwardFunctionModule.forward returns output.detach(), line 501; utils.py
apply_to_tensors_only, line 186), so a block's attention(x, x, x) reaches the attention module as
three different tensors. nn.MultiheadAttention.forward's `query is key` test then fails
(nn/modules/activation.py lines 1456-1465) and F._in_projection_packed takes its w.chunk(3)
branch (nn/functional.py lines 6259-6266) instead of one linear on the packed weight (6226-6229).
F.linear is DeepSpeed's zero3_linear_wrap by then (partition_parameters.py lines 412-419 and
1090-1091, from deepspeed.initialize's Init(module=...), parameter_offload.py line 270), whose
setup_context saves the weight it is given (runtime/zero/linear.py line 105): a chunk view here,
not the parameter, so its backward does not re-gather it (lines 118-121) and the view keeps the
gathered storage (partition_parameters.py line 795: one torch.cat per parameter) alive after
free_param swaps param.data for an empty tensor (line 329). The FFN's nn.Linear and the
out-projection (passed whole, nn/functional.py line 7047) save the parameter itself: released,
nothing stays. Under a full block checkpoint the forward saves nothing, and DeepSpeed's own
engine pins nothing in the recomputation either (benchmarks/deepspeed_mha_pinned_records.py).

Which blocks' in-projections the coordinator releases after the forward is its replay's
(zeroplan.core.deepspeed_coordinator.released_after_forward, q, k and v packed into one
in_proj_weight and one in_proj_bias as DeepSpeed sees them); those it keeps gathered to their
backward are in its held bytes already. The pinned ones are saved for backward block by block and
freed at the block's backward, as activations are: the planner counts them with the activations.
Against the engine's records the replay releases one block fewer (the engine releases that
block's in_proj_weight and its prefetch gathers it again before the loss; the replay keeps it
gathered): tests/test_deepspeed_mha_views.py.

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_coordinator import released_after_forward, replays_gathers
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing

IN_PROJECTION = ("attention.in_proj_weight", "attention.in_proj_bias")
"""nn.MultiheadAttention's packed in-projection, as the coordinator's replay names it (the
planner's q, k and v tensors together: zeroplan.core.deepspeed_coordinator._packed_in_projection)."""


def pins_in_projection(request: PlanRequest) -> bool:
    """Whether the request's blocks keep their released in-projections to their backward: torch's
    nn.MultiheadAttention under DeepSpeed's plain ZeRO-3 gathers and its zero3_linear_wrap (under
    torch's own F.linear zeroplan.core.deepspeed_torch_linear counts the in-projection weight
    with the other linears'), without a full block checkpoint."""
    return (request.training.torch_multihead_attention and replays_gathers(request)
            and request.training.activation_checkpointing is not ActivationCheckpointing.full
            and not request.training.deepspeed_torch_linear)


def _is_in_projection(name: str) -> bool:
    """Whether '<unit name>.<tensor name>' is a block's in_proj_weight or in_proj_bias."""
    unit, _, tensor = name.partition(".")
    return unit == "block" and tensor.partition(".")[2] in IN_PROJECTION  # past the block's index


# The chunk views hold the gathered in_proj_weight and in_proj_bias whole (one storage each).
def pinned_in_projection_bytes(request: PlanRequest) -> int:
    """The gathered in-projection bytes every released block keeps from its forward to its
    backward (0 where pins_in_projection does not hold)."""
    if not pins_in_projection(request):
        return 0
    return sum(size for name, size in released_after_forward(request).items() if _is_in_projection(name))


def check_torch_multihead_attention(request: PlanRequest) -> None:
    """nn.MultiheadAttention's shape: as many key/value heads as query heads of hidden / heads
    each, no latent attention, and no tensor, context or pipeline split."""
    if not request.training.torch_multihead_attention:
        return
    model, parallel = request.model, request.parallel
    if model.kv_heads != model.num_heads or model.is_mla or model.head_size * model.num_heads != model.hidden_size:
        raise ZeroplanError("torch_multihead_attention", "nn.MultiheadAttention has as many key/value heads as query "
                            "heads, each hidden / heads wide (allowed: a model without grouped-query or latent attention)")
    finetune = request.training.finetune
    if not finetune.trains_everything or finetune.quantize.is_quantized:
        raise ZeroplanError("torch_multihead_attention", "is planned for full training (allowed: without LoRA, frozen "
                            "parts or a quantized base)")
    if parallel.tp > 1 or parallel.cp > 1 or parallel.pp > 1:
        raise ZeroplanError("torch_multihead_attention", "is planned without tensor, context or pipeline parallelism "
                            "(allowed: tp, cp and pp 1)")
