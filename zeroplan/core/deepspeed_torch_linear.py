"""torch's own F.linear under DeepSpeed's ZeRO-3 engine: every released linear's gathered weight
stays alive from the linear's forward to its backward (docs/memory-model.md, "torch's F.linear
under DeepSpeed's ZeRO-3"). Sources: DeepSpeed 0.3.12 to 0.3.14, 0.19.3 and 0.19.8, torch 2.13.

DeepSpeed's ZeRO-3 swaps torch.nn.functional.linear for an autograd Function of its own
(runtime/zero/linear.py zero3_linear_wrap) whose backward gathers the weight again; torch's
linear instead saves weight.t() for its backward (aten::linear's addmm or matmul on the
transpose), a view that keeps the gathered storage after the coordinator's free_param has
swapped param.data for an empty tensor (0.19.8 partition_parameters.py line 329). When the swap
is in force during training depends on the release:
- 0.3.12 and 0.3.13, ZeRO-3's first releases (March 2021): zero.Init's __enter__ installs it and
  its __exit__ puts torch's back (partition_parameters.py lines 192-194 and 213-214), so training
  always runs torch's. DeepSpeed #881 (in 0.3.14) stopped undoing it at the context's exit.
- 0.3.14 to 0.19.3: zero.Init's __enter__ installs it and it persists; a model built outside a
  zero.Init context and handed to deepspeed.initialize never gets it (0.19.3 Init.__init__ has
  no such call).
- 0.19.4 onward (DeepSpeed #8189): Init(module=...), which deepspeed.initialize runs on such a
  model (parameter_offload.py line 270), installs it too (partition_parameters.py lines 1090-1091).
TrainingSpec.deepspeed_torch_linear says the run kept torch's. DeepSpeed 0.19.8's own engine on
gloo with torch's F.linear put back after deepspeed.initialize (benchmarks/deepspeed_bf16mw_step.py
--torch-linear) keeps every block's in_proj_weight, out_proj weight and both FFN weights alive at
the backward's start; the biases (added, never saved) and the embeddings (whose backward needs
only the indices) stay free.

Which parameters the coordinator releases after the forward is its replay's
(zeroplan.core.deepspeed_coordinator.released_after_forward); those it keeps gathered to their
backward are in its held bytes already. The rest are saved for backward block by block and freed
at the block's backward, as activations are: the planner counts them with the activations, in
place of the in-projection views zeroplan.core.deepspeed_mha_views counts under DeepSpeed's own
linear. A full block checkpoint saves nothing in the blocks' forward: only a linear outside them
(the output projection) can keep its weight.

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_coordinator import released_after_forward, replays_gathers
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing, ModelLoad

PACKED_IN_PROJECTION_WEIGHT = "attention.in_proj_weight"
"""nn.MultiheadAttention's packed in-projection weight, as the coordinator's replay names it."""


def keeps_torch_linear(request: PlanRequest) -> bool:
    """Whether the request's linears save their gathered weights: torch's F.linear
    (deepspeed_torch_linear, or hf's model loaded whole per rank under a release before 0.19.4)
    under DeepSpeed's plain ZeRO-3 gathers."""
    return (request.training.deepspeed_torch_linear or hf_loaded_outside_zero_init_before_0_19_4(request)) \
        and replays_gathers(request)


# transformers from_pretrained enters zero.Init only where TrainingArguments built the DeepSpeed
# config first (zeroplan.core.model_load); a model loaded before is handed to the engine, whose
# Init(module=...) converts it without replacing F.linear before DeepSpeed 0.19.4 (v0.8.0
# partition_parameters.py:701-703, v0.13.3 :995-997, v0.19.3 :1100) and replaces it from 0.19.4
# (DeepSpeed #8189, v0.19.4 :1060-1061): the hf profile's 0.13.3 keeps torch's, its 0.19.8 not.
# bitsandbytes' 4-bit and 8-bit linears call their own matmuls, not F.linear.
def hf_loaded_outside_zero_init_before_0_19_4(request: PlanRequest) -> bool:
    """Whether an hf run trains on torch's F.linear under ZeRO-3: its model loaded whole per rank
    (TrainingSpec.model_load full-per-rank) under DeepSpeed 0.13.3, the base not quantized."""
    training = request.training
    return (training.framework is Framework.hf and training.model_load is ModelLoad.full_per_rank
            and training.deepspeed_release not in (None, "0.19.8")
            and not training.finetune.quantize.is_quantized)


# aten::linear saves the weight's transpose, never the bias; a 2-D tensor outside the embedding
# unit is a linear's weight in the reference model (norms are 1-D; an embedding's backward keeps
# only the indices). A tied output projection runs F.linear on the token embedding, which the
# backward gathers again for the embedding's own backward whether or not it was released between
# the head's forward and backward: left out (at DeepSpeed's default reuse distance the
# coordinator keeps it gathered across the loss, the head's use being the forward's last and the
# backward's first).
def _linear_weights(request: PlanRequest) -> set[str]:
    """'<unit name>.<tensor name>' of every parameter outside the embedding a linear takes as its weight."""
    return {f"{unit.name}.{tensor.name}" for unit in rank_parameter_units(request) if unit.name != "embedding"
            for tensor in unit.tensors if len(tensor.shape) == 2}


def _is_linear_weight(name: str, linear_weights: set[str]) -> bool:
    """Whether '<unit name>.<tensor name>' is a linear's weight (any block's packed in-projection)."""
    return name in linear_weights or name.endswith("." + PACKED_IN_PROJECTION_WEIGHT)


def pinned_linear_weight_bytes(request: PlanRequest) -> int:
    """The gathered linear weights the forward leaves alive after their release, to each one's
    backward (0 where keeps_torch_linear does not hold)."""
    if not keeps_torch_linear(request):
        return 0
    linear_weights = _linear_weights(request)
    in_blocks = request.training.activation_checkpointing is not ActivationCheckpointing.full
    return sum(size for name, size in released_after_forward(request).items()
               if _is_linear_weight(name, linear_weights) and (in_blocks or not name.startswith("block.")))
