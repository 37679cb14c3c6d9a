"""DeepSpeed's bf16 master weights, gradients and optimizer states under torch_autocast
(DeepSpeed PR 7700, first released in 0.18.3; TrainingSpec.deepspeed_bf16_autocast):
what the mode adds to the planner's bf16-pure plan of DeepSpeed's ZeRO-3 engine
(docs/memory-model.md, "DeepSpeed's bf16 master weights under torch_autocast"). Sources:
DeepSpeed 0.19.8, torch 2.13 (aten/src/ATen/autocast_mode.h and autocast_mode.cpp, the CUDA
lists; nn/functional.py multi_head_attention_forward).

The model states: bf16 module partitions, a separate bf16 master partition, bf16 gradient
partitions and reduce bucket, bf16 Adam states (10 bytes per parameter over N; bf16-pure plans
8). The step casts each sub-group's flat gradient to the master's dtype, bf16: no copy.

The activations: torch.autocast("cuda", bfloat16) over a module DeepSpeed already cast to bf16
changes only the ops on CUDA's fp32 lists (AT_FORALL_FP32: layer_norm; AT_FORALL_FP32_SET_OPT_DTYPE:
softmax, log_softmax; linear, bmm and baddbmm are on AT_FORALL_LOWER_PRECISION_FP and their bf16
inputs need no cast). Through DeepSpeedExamples' SimpleTransformerModel (post-norm blocks of
nn.MultiheadAttention and a Linear-GELU-Linear FFN, zeroplan.core.deepspeed_mha_views) that is:
- the attention's softmax returns fp32, saved for its backward, and the next bmm casts it to a
  bf16 copy it saves: 4 + 2 bytes a score where bf16-pure saves 2;
- each LayerNorm saves an fp32 input (the block's first sum is bf16 + bf16, cast; every later
  sum adds a bf16 branch to the fp32 norm output before it, fp32 by type promotion): 4 bytes an
  element where bf16-pure saves 2;
- every block after the first receives the previous norm's fp32 output, and its chunked
  in-projection (three linears, one per query, key and value tensor DeepSpeed's hooks hand it)
  casts it three times, each linear saving its own bf16 copy, where bf16-pure's three share one
  input;
- under a full block checkpoint the checkpoint saves that fp32 input instead of a bf16 one.
The loss's fp32 log-softmax and gradients are what the planner plans already
(zeroplan.core.activations.logits_bytes), and the FFN's and the output projection's inputs are
bf16 copies of the fp32 norm output, the size bf16-pure plans. The CPU's autocast lists differ
(softmax and layer_norm are not on them), so DeepSpeed's engine on gloo shows the model states
and the step's temporaries (benchmarks/deepspeed_bf16mw_step.py --bf16full), not these terms.

This module does not import torch."""

from __future__ import annotations

from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, Precision, StateConvention
from zeroplan.units import FP32_BYTES

BF16_BYTES = 2


def runs_bf16_autocast(request: PlanRequest) -> bool:
    """Whether the request runs DeepSpeed's bf16 master-weights mode under torch_autocast."""
    return request.training.deepspeed_bf16_autocast


# deepspeed 0.19.8 runtime/zero/stage3.py _create_fp32_partitions (lines 1158-1171; 0.18.3
# 981-986): the 16-bit partition is shared as the master only where partition.device ==
# self.device, a torch.device against the accelerator's device-name string, never equal, so
# `.to(device, master_weights_and_grads_dtype).clone()` makes a bf16 copy.
def master_copy_element_bytes(request: PlanRequest) -> int:
    """Bytes per optimizer element of the separate master partition this mode keeps (0 elsewhere)."""
    return BF16_BYTES if runs_bf16_autocast(request) else 0


# stage3.py _prepare_fp32_grad_for_sub_group (line 2686): the flat gradient `.to()` the master's
# dtype, a no-op when both are bf16.
def step_cast_element_bytes(request: PlanRequest, model_dtype_bytes: int) -> int:
    """Bytes per element of the step's cast of a sub-group's flat gradient to the master's dtype."""
    if runs_bf16_autocast(request) or model_dtype_bytes == FP32_BYTES:
        return 0
    return FP32_BYTES


# torch 2.13 nn/functional.py multi_head_attention_forward (need_weights=True: the math path):
# softmax(q k^T) then bmm(weights, v). Under CUDA autocast softmax is fp32_set_opt_dtype
# (autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE): its output, saved for its backward, is fp32,
# and bmm (AT_FORALL_LOWER_PRECISION_FP) saves the bf16 copy it casts.
def softmax_extra_bytes(request: PlanRequest) -> int:
    """What one block saves beyond bf16-pure's bf16 scores: the fp32 scores and their bf16 copy."""
    scores = request.batch.micro_batch_size * request.model.num_heads * request.batch.seq_len ** 2
    return (FP32_BYTES + BF16_BYTES - BF16_BYTES) * scores


def _sbh(request: PlanRequest) -> int:
    return request.batch.seq_len * request.batch.micro_batch_size * request.model.hidden_size


# autocast_mode.h AT_FORALL_FP32 holds layer_norm: it runs on an fp32 input (a cast copy of a
# bf16 one) and native_layer_norm saves that input for its backward.
def norm_inputs_extra_bytes(request: PlanRequest) -> int:
    """What one block's LayerNorms save beyond bf16-pure's bf16 inputs."""
    return request.model.norms_per_block * (FP32_BYTES - BF16_BYTES) * _sbh(request)


# nn/functional.py _in_projection (the chunked branch zeroplan.core.deepspeed_mha_views explains):
# three F.linear calls, each casting the fp32 block input (the previous block's norm output) to a
# bf16 copy it saves; under bf16-pure the three inputs are views of one bf16 tensor.
def in_projection_copies_extra_bytes(request: PlanRequest) -> int:
    """What a block after the first saves beyond bf16-pure's one bf16 in-projection input."""
    return (3 - 1) * BF16_BYTES * _sbh(request)


# torch 2.13 utils/checkpoint.py (non-reentrant): the checkpoint saves the block's input as it
# is given, fp32 after the first block.
def checkpointed_input_extra_bytes(request: PlanRequest) -> int:
    """What a checkpointed block after the first saves beyond bf16-pure's bf16 input."""
    return (FP32_BYTES - BF16_BYTES) * _sbh(request)


def block_extra_bytes(request: PlanRequest, first: bool) -> int:
    """What one block saves under CUDA autocast beyond bf16-pure's plan of it."""
    extra = softmax_extra_bytes(request) + norm_inputs_extra_bytes(request)
    return extra if first else extra + in_projection_copies_extra_bytes(request)


def activation_extra_bytes(request: PlanRequest) -> int:
    """The activations CUDA autocast adds to bf16-pure's over the micro-batch (0 outside the
    mode): every block's extra terms, or under a full block checkpoint the fp32 inputs after the
    first block and one recomputed block's terms."""
    if not runs_bf16_autocast(request):
        return 0
    layers = request.model.num_layers
    if request.training.activation_checkpointing is ActivationCheckpointing.full:
        return (layers - 1) * checkpointed_input_extra_bytes(request) + block_extra_bytes(request, first=False)
    return block_extra_bytes(request, first=True) + (layers - 1) * block_extra_bytes(request, first=False)


def check_bf16_autocast(request: PlanRequest) -> None:
    """The mode is planned where it was measured and derived: DeepSpeed's plain ZeRO-3 engine,
    bf16-pure, the reference model as torch's nn.MultiheadAttention, no or full checkpointing."""
    if not runs_bf16_autocast(request):
        return
    training = request.training
    if (request.convention is not StateConvention.deepspeed or request.strategy.kind is not StrategyKind.zero3
            or training.precision is not Precision.bf16_pure):
        raise ZeroplanError("deepspeed_bf16_autocast", "is planned for DeepSpeed's ZeRO-3 engine without offload, in "
                            "bf16-pure (allowed: strategy zero3, state convention deepspeed, precision bf16-pure)")
    if not training.torch_multihead_attention:
        raise ZeroplanError("deepspeed_bf16_autocast", "is derived for the blocks of torch's nn.MultiheadAttention "
                            "(allowed: with torch_multihead_attention)")
    if training.activation_checkpointing not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        raise ZeroplanError("deepspeed_bf16_autocast", f"is planned with activation checkpointing none or full, not "
                            f"{training.activation_checkpointing.value!r}")
