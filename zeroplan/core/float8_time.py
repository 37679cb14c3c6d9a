"""float8 training in the step time (docs/communication-time.md, "float8 in the step time").

torchao's Float8Linear (torchtitan's float8 converter) runs each converted linear's three
matrix products in float8: the output, the input's gradient and the weight's gradient
(torchao float8/float8_linear.py matmul_with_hp_or_float8_args at 0afa4c1, the commit
torchtitan's H200 table ran, and at eab345c, its H100 tables': forward casts the input and the
weight, backward casts the output's gradient for grad_input, the weight again, and the output's
gradient and the saved high-precision input again for grad_weight; Float8LinearConfig's
default casts all of them, tensorwise). So three things change against the bf16 step:
  1. the converted linears' FLOPs run at the fp8 dense peak (GpuSpec.peak_fp8_flops_per_s, the
     datasheet's: 2x bf16 on the H100/H200 SXM) at the same utilisation the bf16 products reach
     (the HFU; no fp8 efficiency is fitted: one published source has float8 rows, and a
     quantity fitted on it could not be scored leave-one-source-out);
  2. every cast is a memory-bound pass at the copy bandwidth: an amax over the bf16 tensor
     (tensor_to_amax: read 2 bytes an element) and the scaled cast (read 2, write 1);
  3. under FSDP2 with enable_fsdp_float8_all_gather, each Float8Linear weight is cast on its
     shard before the all-gather and travels one byte an element (torchao float8/fsdp_utils.py
     WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather), and
     precompute_float8_dynamic_scale_for_fsdp all-reduces one fp32 amax per Float8Linear once
     a step, after the optimizer (zeroplan.core.communication).
TransformerEngine's te.Linear (Float8Recipe.te_delayed, llm-foundry's amp_fp8) changes the same
three things but casts otherwise (transformer_engine_cast_bytes): its delayed scaling takes each
scale from the amax history, the cast kernel records the new amax as it writes, so no amax pass
runs; the casts are TransformerEngine's fused kernels, not compiled ones.
torchao's float8 is modelled compiled only (zeroplan.core.compiled.check_compiled), so its casts are
counted as inductor fuses them: casts of one tensor under one scale share their amax (wq, wk, wv
read one norm output, w1 and w3 the other), the output gradient's two casts (for grad_input and
for grad_weight, tensorwise: one scale) one amax, and the layout _scaled_mm needs is written by
the cast itself. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.flops import (
    head_forward_flops_per_token,
    layers_linear_forward_flops_per_token,
    recompute_attention_flops_per_token,
    recompute_flops_per_token,
)
from zeroplan.specs.request import PlanRequest
from zeroplan.core.roofline.ceilings import gpu_ceilings, times_memory_bound
from zeroplan.specs.training import ActivationCheckpointing, Float8Recipe

FLOAT8_ALIGNMENT = 16
"""torchtitan's float8 module_filter_fn: a Linear with any dimension not divisible by 16 stays
high precision (torch._scaled_mm's alignment)."""
AMAX_BYTES_PER_ELEMENT = 2
"""torchao float8_utils.py tensor_to_amax: one read of the bf16 tensor."""
CAST_BYTES_PER_ELEMENT = 3
"""torchao float8_scaling_utils.py hp_tensor_to_float8_dynamic -> _ToFloat8ConstrFunc: read the
bf16 element (2 bytes), write its float8 (1)."""


def times_float8(request: PlanRequest) -> bool:
    """Whether the request's linears run in float8 (torchao Float8Linear)."""
    return request.training.float8 is not None


def is_transformer_engine(request: PlanRequest) -> bool:
    """Whether the float8 linears are TransformerEngine's te.Linear (Float8Recipe.te_delayed)."""
    return request.training.float8 is Float8Recipe.te_delayed


def bf16_weight_gradient(request: PlanRequest) -> bool:
    """Whether the recipe computes each weight's gradient in bf16 from the high-precision operands
    (Float8Recipe.rowwise_with_gw_hp: no float8 product, no cast for it)."""
    return request.training.float8 is Float8Recipe.rowwise_with_gw_hp


def converts_head(request: PlanRequest) -> bool:
    """Whether the output projection is a Float8Linear (torchtitan 0.3.0 converts it unless
    filter_fqns names it; its earlier Llama 3 configs did: TrainingSpec.float8_skips_output).
    Never a te.Linear: llm-foundry v0.3.0 builds only the blocks' linears from fc_type
    (llmfoundry/models/layers/attention.py Wqkv, out_proj; ffn.py up_proj, down_proj), its head
    is the tied embedding's F.linear (modeling_mpt.py)."""
    model = request.model
    return (not is_transformer_engine(request) and not request.training.float8_skips_output and model.vocab_size % FLOAT8_ALIGNMENT == 0
            and model.hidden_size % FLOAT8_ALIGNMENT == 0)


# The converted products are every block linear (each Llama width is a multiple of 16) and the
# head unless it is filtered: forward once, backward twice (grad_input, grad_weight; flops.py
# BACKWARD_MATMULS_PER_FORWARD_MATMUL), and what the checkpointing policy recomputes of them.
def float8_gemm_flops(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with recomputation) FLOPs of one rank's step that run in float8."""
    if not times_float8(request):
        return 0.0, 0.0
    # rowwise_with_gw_hp (torchao float8/config.py:312-337): grad_weight = input_t_hp @
    # grad_output_hp in bf16, so of the backward's two products only grad_input's is float8.
    backward_products = 1 if bf16_weight_gradient(request) else 2
    model, training, batch = request.model, request.training, request.batch
    tokens = batch.micro_batch_size * batch.seq_len * batch.grad_accum_steps
    linear = layers_linear_forward_flops_per_token(model) + (head_forward_flops_per_token(model) if converts_head(request) else 0)
    recomputed = (recompute_flops_per_token(model, training, batch.seq_len)
                  - recompute_attention_flops_per_token(model, training, batch.seq_len))
    ranks = request.parallel.model_parallel_size
    return tokens * linear / ranks, tokens * (backward_products * linear + recomputed) / ranks


def float8_gemm_saved_seconds(request: PlanRequest, bf16_flops_per_s: float) -> tuple[float, float]:
    """(forward, backward) seconds the float8 products save against the bf16 rate
    ``bf16_flops_per_s`` (peak x HFU): the same utilisation of the fp8 peak (0 where the catalog
    has no fp8 peak for the GPU)."""
    gpu = request.cluster.gpu
    if not times_float8(request) or gpu.peak_fp8_flops_per_s is None:
        return 0.0, 0.0
    fp8_flops_per_s = bf16_flops_per_s * gpu.peak_fp8_flops_per_s / gpu.peak_bf16_flops_per_s
    forward, backward = float8_gemm_flops(request)
    saved = 1 / bf16_flops_per_s - 1 / fp8_flops_per_s
    return forward * saved, backward * saved


# Per token of one block, the distinct tensors cast (module docstring): inputs, the attention
# norm's output (h, for wq/wk/wv), the attention output (wo's input) and the MLP norm's output
# (h, for w1/w3), the MLP's hidden product (w2's input): an amax and a cast in forward, again in
# backward for grad_weight from the saved bf16 input. Output gradients, one per linear: an amax
# and two casts (grad_input's and grad_weight's layouts; rowwise, an amax each). Weights, unless FSDP gathers them cast:
# an amax and a cast in forward and again in backward for grad_input, per micro-batch.
def float8_cast_bytes(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with recomputation) bytes of one rank's step that the float8 casts
    read and write."""
    if not times_float8(request):
        return 0.0, 0.0
    if is_transformer_engine(request):
        return transformer_engine_cast_bytes(request)
    model, batch = request.model, request.batch
    h, f = model.hidden_size, model.ffn_hidden_size * (model.experts_per_token if model.is_moe else 1)
    pass_bytes = AMAX_BYTES_PER_ELEMENT + CAST_BYTES_PER_ELEMENT
    inputs = 2 * h + model.attention_output_size + f
    # wq, wk, wv, wo, then the MLP's up (and gate) projections and its down projection.
    outputs = model.q_size + 2 * model.kv_size + h + (2 if model.mlp.gated else 1) * f + h
    # Tensorwise, the output gradient's two casts share one scale, so one amax; rowwise
    # (Float8LinearConfig.from_recipe_name("rowwise"): axiswise along -1 for grad_input, 0 for
    # grad_weight) each cast has its own amax.
    gradient_bytes = pass_bytes + (CAST_BYTES_PER_ELEMENT if request.training.float8 is Float8Recipe.tensorwise
                                   else pass_bytes)
    # rowwise_with_gw_hp: the output gradient's one cast (grad_input's) and no recast of the saved
    # input (cast_config_*_for_grad_weight DISABLED).
    input_recasts = 0 if bf16_weight_gradient(request) else 1
    if bf16_weight_gradient(request):
        gradient_bytes = pass_bytes
    head = converts_head(request)
    forward_per_token = model.num_layers * inputs * pass_bytes + (h * pass_bytes if head else 0)
    backward_per_token = (model.num_layers * (input_recasts * inputs * pass_bytes + outputs * gradient_bytes)
                          + ((input_recasts * h * pass_bytes + model.vocab_size * gradient_bytes) if head else 0))
    policy = request.training.activation_checkpointing
    if policy is ActivationCheckpointing.full:
        backward_per_token += model.num_layers * inputs * pass_bytes
    elif policy is ActivationCheckpointing.selective_op:
        # torchtitan's op-level policy recomputes wo and w3 (flops.selective_op_recompute_flops_per_token):
        # their inputs' casts run again.
        backward_per_token += model.num_layers * (model.attention_output_size + h) * pass_bytes
    tokens = batch.micro_batch_size * batch.seq_len * batch.grad_accum_steps
    ranks = request.parallel.model_parallel_size
    forward, backward = tokens * forward_per_token / ranks, tokens * backward_per_token / ranks
    if not request.training.float8_all_gather:
        weights = float8_weight_elements(request) / ranks
        forward += batch.grad_accum_steps * weights * pass_bytes
        backward += batch.grad_accum_steps * weights * pass_bytes
    return forward, backward


TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT = 4
"""TransformerEngine v0.10 fp8_cast_transpose_fused (and fp8_cast_transpose_bgrad_fused, its bias
gradient reduced in the same pass): read the bf16 element (2 bytes), write its float8 (1) and
the float8 transpose (1) the other GEMM operand needs; the amax is recorded in the same kernel."""


# TransformerEngine v0.10 (the tag llm-foundry b2a43a14's submit_benchmarks.py installs for
# amp_fp8) transformer_engine/pytorch/module/linear.py _Linear with the recipe's
# override_linear_precision (False, False, False): fprop, dgrad and wgrad all in float8.
#   forward: the input through fp8_cast_transpose_fused (inputmat and inputmat_t, the latter
#     saved for wgrad); the weight through fp8_cast_transpose_fused into weight_fp8 and
#     weight_t_fp8 whenever update_fp8_weights (is_first_microbatch None, as Composer calls it:
#     every micro-batch), read at the gathered parameter's dtype (Composer's FSDP DEFAULT mixed
#     precision: the compute dtype);
#   backward: the output's gradient through module/base.py grad_output_preprocess,
#     fp8_cast_transpose_bgrad_fused with a bias (MPT's), fp8_cast_transpose_fused without;
#   what full checkpointing recomputes runs the forward's casts again (grad enabled).
# Per token of one block the te.Linear inputs are Wqkv's (the attention norm's output), out_proj's,
# up_proj's (the MLP norm's output) and down_proj's; the outputs are their four results.
def transformer_engine_cast_bytes(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with recomputation) bytes of one rank's step that TransformerEngine's
    float8 casts read and write."""
    model, batch = request.model, request.batch
    h, f = model.hidden_size, model.ffn_hidden_size
    per_element = TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT
    up = (2 if model.mlp.gated else 1) * f
    inputs = 2 * h + model.attention_output_size + f
    outputs = model.q_size + 2 * model.kv_size + h + up + h
    tokens = batch.micro_batch_size * batch.seq_len * batch.grad_accum_steps
    weight_per_element = request.training.precision.compute_bytes + 2
    weights = batch.grad_accum_steps * float8_weight_elements(request) * weight_per_element
    forward = tokens * model.num_layers * inputs * per_element + weights
    backward = tokens * model.num_layers * outputs * per_element
    # zeroplan.core.compiled.check_transformer_engine_float8 allows none and full.
    if request.training.activation_checkpointing is ActivationCheckpointing.full:
        backward += tokens * model.num_layers * inputs * per_element + weights
    return forward, backward


def _float8_weights(request: PlanRequest) -> list:
    """The Float8Linear weights' parameter tensors (block linears, and the head when converted)."""
    from zeroplan.core.params import parameter_units

    return [t for unit in parameter_units(request.model) for t in unit.tensors
            if is_float8_weight(request, unit.name, t.name, t.shape)]


def float8_weight_elements(request: PlanRequest) -> int:
    """Elements of the Float8Linear weights."""
    return sum(t.numel for t in _float8_weights(request))


def is_float8_weight(request: PlanRequest, unit: str, name: str, shape: tuple[int, ...]) -> bool:
    """Whether a parameter tensor is a Float8Linear's weight: a 2-D block linear with both
    dimensions multiples of 16, or the head's projection where it is converted."""
    if len(shape) != 2 or any(d % FLOAT8_ALIGNMENT for d in shape) or not name.endswith(".weight"):
        return False
    if unit == "head":
        return name.startswith("lm_head") and converts_head(request)
    return unit.startswith("block.") and not name.startswith("mlp.router")


def float8_linear_count(request: PlanRequest) -> int:
    """Float8Linear modules of the model (one amax each in the FSDP precompute all-reduce)."""
    return len(_float8_weights(request))


def float8_cast_seconds(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward) seconds of the casts at the GPU's copy bandwidth; (0, 0) where the
    flat-HFU model does not time memory-bound kernels apart (its HFU covers them)."""
    if not times_float8(request) or not times_memory_bound(request):
        return 0.0, 0.0
    bandwidth = gpu_ceilings(request.cluster.gpu).memory_bytes_per_s
    forward, backward = float8_cast_bytes(request)
    return forward / bandwidth, backward / bandwidth


# torchao float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather: FSDP2
# gathers each Float8Linear weight's float8 data (1 byte), the other parameters of the unit in
# the compute dtype (the norms' weights), all as one uint8 buffer (docs/compile-float8.md, "FSDP2
# float8 all-gather": 218,120,192 bytes for Llama-3.1-8B's block-by-block gathers against
# 436,224,000 in bf16). Each unit's padded gather scales by its own mix.
def float8_gather_bytes(request: PlanRequest, gathered: list[int], compute_bytes: int) -> list[int]:
    """The units' all-gather bytes (``gathered``, in the compute dtype, in unit order) with their
    Float8Linear weights at one byte an element."""
    from zeroplan.core.parallel.units import rank_parameter_units

    result = []
    for unit, size in zip(rank_parameter_units(request), gathered, strict=True):
        total = sum(t.numel for t in unit.tensors)
        cast = sum(t.numel for t in unit.tensors if is_float8_weight(request, unit.name, t.name, t.shape))
        result.append(size if total == 0 else round(size * (total * compute_bytes - cast * (compute_bytes - 1))
                                                      / (total * compute_bytes)))
    return result


# torchao float8/fsdp_utils.py precompute_float8_dynamic_scale_for_fsdp, called after each
# optimizer step: torch._foreach_norm(ord=inf) of every Float8Linear weight's shard, stacked,
# then one DTensor Partial -> Replicate redistribute: an all-reduce of one fp32 amax each.
def float8_scale_all_reduce(request: PlanRequest, group: int, spans_nodes: bool, per_node: int | None):
    """The step's all-reduce of the Float8Linear weights' amaxes (one fp32 each)."""
    from zeroplan.core.collective import CollectiveOp, Phase, make_collective

    count = float8_linear_count(request)
    return make_collective(CollectiveOp.all_reduce, Phase.step, "float8 weight amaxes", [4 * count], group, 1,
                           spans_nodes, 4, per_node)
