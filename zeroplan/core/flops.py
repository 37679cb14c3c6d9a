"""FLOPs of one training step: what the GPU executes (the compute time's numerator) and what
model FLOPs utilisation counts (PaLM's convention). docs/communication-time.md, "Compute".

Per token and in the symbols of Korthikanti et al. (2022): h width, a query heads, d head
size, L blocks, s sequence length, V vocabulary. A matmul of an (m x k) by a (k x n) matrix is
2mkn FLOPs; elementwise ops (norms, activations, softmax, RoPE, biases) are not counted.
"""

import functools

from zeroplan.core.params import active_parameters, block_tensors
from zeroplan.core.profiles import checkpoint_stops_early
from zeroplan.specs.base import Frozen
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, BatchSpec, Objective, TrainingSpec

MATMUL_FLOPS_PER_MULTIPLY_ADD = 2
"""A multiply-add is two FLOPs (Kaplan et al. 2020, sec. 2.1)."""
BACKWARD_MATMULS_PER_FORWARD_MATMUL = 2
"""A linear layer's backward is two matmuls of its forward's size, for the input's and for the
weight's gradient (Narayanan et al. 2021, sec. 5.1: backward = 2x forward)."""
CAUSAL_EXECUTED_FRACTION = 0.5
"""Share of the s x s score blocks a causal flash kernel computes: FlashAttention-2 (Dao 2023,
sec. 3.1.1, "Causal masking") skips every block whose columns all lie above the diagonal, and
its FLOP count (sec. 4.1; flash-attention benchmarks/benchmark_flash_attention.py, flops())
divides by 2 for that; the diagonal blocks it does compute add about block/(2s) more
(1.6 % at s = 4096 with 128-wide blocks), not counted."""
FLASH_BACKWARD_OVER_FORWARD = 2.5
"""FlashAttention-2 (Dao 2023, sec. 4.1; benchmark_flash_attention.py, flops(mode="bwd")): the
backward runs 5 matmuls of the forward's size against the forward's 2 (it recomputes QK^T
from Q, K and the log-sum-exp), so 2.5x."""


class StepFlops(Frozen):
    """FLOPs of one optimizer step on one GPU."""

    forward_flops: float
    """Executed by the forward passes of all micro-batches (recomputation excluded)."""
    backward_flops: float
    """Executed by the backward passes, recomputed forward work included."""
    recompute_flops: float
    """Of backward_flops, the recomputed forward work the checkpointing policy adds."""
    model_flops: float
    """What model FLOPs utilisation counts (PaLM, Appendix B): 6N + 12 L a d s per token."""
    attention_forward_flops: float = 0.0
    """Of forward_flops, attention's own QK^T and AV (the attention core's kernel)."""
    attention_backward_flops: float = 0.0
    """Of backward_flops, the attention core's backward and its recomputed forward."""

    @property
    def executed_flops(self) -> float:
        return self.forward_flops + self.backward_flops


# Kaplan et al. 2020, sec. 2.1: a linear layer is 2 FLOPs per weight per token. One block's
# linear weights (q, k, v, o, the MLP's matrices; a mixture of experts' router and the k experts
# a token is routed to, Fedus et al. 2022, sec. 2, plus the shared expert every token passes
# through, DeepSeekMoE, Dai et al. 2024, sec. 3.2) over the 2 FLOPs. ``moe_layer`` picks a block
# with experts or a dense one (DeepSeek's first blocks); None: the block the model repeats.
def block_linear_forward_flops_per_token(model: ModelSpec, moe_layer: bool | None = None) -> int:
    """Forward FLOPs per token of one block's linear layers (attention's own matmuls excluded)."""
    moe = model.is_moe if moe_layer is None else moe_layer
    h = model.hidden_size
    if model.is_mla:
        # DeepSeek-V2 sec. 2.1.2: the down- and up-projections of the latents are linears too.
        attention = sum(t.numel for t in block_tensors(model, moe) if t.name.startswith("attention.") and len(t.shape) == 2)
    else:
        attention = h * (model.q_size + 2 * model.kv_size) + model.q_size * h
    matrices = 3 if model.mlp.gated else 2
    if not moe:
        return MATMUL_FLOPS_PER_MULTIPLY_ADD * (attention + matrices * h * model.ffn_hidden_size)
    experts = matrices * h * model.expert_ffn_hidden_size * model.experts_per_token
    shared = matrices * h * model.shared_expert_ffn_hidden_size + (h if model.shared_expert_gate else 0)
    router = h * model.num_experts
    return MATMUL_FLOPS_PER_MULTIPLY_ADD * (attention + experts + shared + router)


@functools.lru_cache(maxsize=64)  # a model's alone: every step's FLOPs ask for it
def layers_linear_forward_flops_per_token(model: ModelSpec) -> int:
    """Forward FLOPs per token of every block's linear layers (dense and MoE blocks each their own)."""
    moe_blocks = model.moe_layer_count
    dense_blocks = model.num_layers - moe_blocks
    total = moe_blocks * block_linear_forward_flops_per_token(model, True) if moe_blocks else 0
    if dense_blocks:
        total += dense_blocks * block_linear_forward_flops_per_token(model, False)
    return total


# The output projection is a (tokens x h) by (h x V) matmul, tied or not; the input embedding
# is a row lookup and executes no FLOPs. OPT-350m's (ModelSpec.embedding_projection p) is
# p wide, after project_out (h -> p) and beside project_in (p -> h). ``outputs`` is V, or 1 for
# a reward model's v_head (zeroplan.core.reward_model).
def head_forward_flops_per_token(model: ModelSpec, outputs: int | None = None) -> int:
    """Forward FLOPs per token of the output projection (the logits), of BERT's head transform
    before it and of OPT-350m's projections."""
    transform = model.hidden_size * model.hidden_size if model.head_transform else 0
    width = model.embedding_projection or model.hidden_size
    projections = 2 * model.hidden_size * model.embedding_projection
    outputs = model.vocab_size if outputs is None else outputs
    return MATMUL_FLOPS_PER_MULTIPLY_ADD * (width * outputs + transform + projections)


# Attention's own matmuls per query head per token: the scores q k^T against s keys (2 s d)
# and the weighted sum of s values (2 s d), so 4 s d a per block (PaLM, Appendix B, counts the
# same 4 per forward inside its 12 L H Q T). A causal kernel computes about half
# (CAUSAL_EXECUTED_FRACTION); eager attention computes the full s x s matrix and masks it.
def attention_forward_flops_per_token(model: ModelSpec, seq_len: int, causal_fraction: float = 1.0) -> float:
    """Forward FLOPs per token of one block's QK^T and AV matmuls."""
    # Scores over the query/key head width, the weighted sum over the value head width (equal
    # but under MLA: DeepSeek-V2 sec. 2.1.2, d_nope + d_rope against d_v).
    per_head = MATMUL_FLOPS_PER_MULTIPLY_ADD * seq_len * (model.head_size + model.v_head_size)
    return causal_fraction * per_head * model.num_heads


# FlashAttention-2 (Dao 2023), sec. 3.1.1: a flash kernel skips the fully masked blocks; an
# eager softmax(QK^T)V computes every score and masks afterwards.
def executed_causal_fraction(kernel: AttentionKernel, causal: bool = True) -> float:
    """Share of the score matrix the kernel computes (all of it for an encoder's attention)."""
    return CAUSAL_EXECUTED_FRACTION if kernel is AttentionKernel.flash and causal else 1.0


# Backward of QK^T and AV: eager attention runs 4 matmuls of the forward's size (dV, dP, dQ,
# dK) against the forward's 2, so 2x; flash attention also recomputes QK^T (2.5x).
def attention_backward_over_forward(kernel: AttentionKernel) -> float:
    return FLASH_BACKWARD_OVER_FORWARD if kernel is AttentionKernel.flash else BACKWARD_MATMULS_PER_FORWARD_MATMUL


# PaLM (Chowdhery et al. 2022), Appendix B: model FLOPs per token 6N + 12 L H Q T (H heads of
# size Q, T the sequence), non-causal and without recomputation; N are the parameters a token
# passes through, embeddings included: the published torchtitan benchmark rows count them so
# (their MFU column is WPS x this / peak to 3 digits, tests/test_step_time_accuracy.py), though
# torchtitan 0.3.0's models/utils.py get_dense_model_nparams_and_flops now leaves the token
# table out (6.5 % fewer model FLOPs for Llama-3.1-8B): docs/validation.md, "Step time".
def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs per token that model FLOPs utilisation (MFU) counts."""
    forward_backward = 1 + BACKWARD_MATMULS_PER_FORWARD_MATMUL
    return forward_backward * (
        MATMUL_FLOPS_PER_MULTIPLY_ADD * active_parameters(model)
        + model.num_layers * attention_forward_flops_per_token(model, seq_len)
    )


# torchtitan 0.3.0 torchtitan/distributed/activation_checkpoint.py (op-level selective AC)
# keeps the outputs of every odd-numbered mm of a block and of SDPA and recomputes the rest;
# with torchtitan's fused QKV the block's mms run wqkv, wo, w1, w3, w2
# (zeroplan.core.frameworks.llama_block_mm_widths), so wo (a d x h) and w3 (h x f, per routed
# expert) run again. A two-matrix MLP (fc1, fc2) recomputes fc2 (f x h) instead.
def selective_op_recompute_flops_per_token(model: ModelSpec) -> int:
    """Forward FLOPs per token per block that op-level selective checkpointing recomputes
    (averaged over the blocks when dense and MoE blocks differ)."""
    h, k = model.hidden_size, model.experts_per_token
    wo = model.attention_output_size * h
    if not model.is_moe:
        return MATMUL_FLOPS_PER_MULTIPLY_ADD * (wo + h * model.ffn_hidden_size)
    moe_blocks = model.moe_layer_count
    w3 = moe_blocks * h * model.expert_ffn_hidden_size * k + (model.num_layers - moe_blocks) * h * model.ffn_hidden_size
    return MATMUL_FLOPS_PER_MULTIPLY_ADD * (wo + w3 // model.num_layers)


# torch/utils/checkpoint.py: the non-reentrant checkpoint, with early stop on (its default),
# ends recomputation once every tensor the backward saved is back. A block's last matmul (the
# MLP's down or fc2 projection) saves nothing the backward needs that is not already back (its
# input is recomputed before it, for its weight gradient; the residual add after it saves
# nothing), so it is not run again. Not where dropout follows it (its mask is saved) nor in an
# expert block (the routing weights' gradient needs the experts' outputs). Measured on an H200
# (docs/validation.md, "Step time, kernel by kernel"): the harness's recomputed products took
# 15.0 ms of kernels, against 20.3 ms for its whole forward and 14.7 without the down matmul.
def early_stop_skipped_flops_per_token(model: ModelSpec, training: TrainingSpec) -> int:
    """Forward FLOPs per token of each recomputed block's last matmul, which early stop skips
    (0 where the framework's checkpoint does not stop early)."""
    if not checkpoint_stops_early(training) or model.is_moe or model.hidden_dropout > 0:
        return 0
    return MATMUL_FLOPS_PER_MULTIPLY_ADD * model.ffn_hidden_size * model.hidden_size


# What each policy runs again in backward, per token, over all L blocks (activation
# checkpointing wraps the blocks, never the embedding or the output projection):
# full: each block's forward (Korthikanti et al. 2022, sec. 5), less what early stop skips;
# selective: the attention core,
# QK^T and AV (sec. 5); selective-layer: the floor(L/k) checkpointed blocks' forward (torchtune
# 0.6.1 training/activations.py); selective-op: the mms above.
def recompute_flops_per_token(model: ModelSpec, training: TrainingSpec, seq_len: int) -> float:
    """Forward FLOPs per token the checkpointing policy executes again during backward."""
    mode = training.activation_checkpointing
    attention = attention_forward_flops_per_token(model, seq_len, executed_causal_fraction(training.attention_kernel, model.causal))
    linear = layers_linear_forward_flops_per_token(model)
    skipped = early_stop_skipped_flops_per_token(model, training)
    if mode is ActivationCheckpointing.full:
        return linear + model.num_layers * (attention - skipped)
    # One block's worth: the blocks' mean (dense and MoE blocks differ).
    block = linear / model.num_layers + attention - skipped
    if mode is ActivationCheckpointing.selective:
        return model.num_layers * attention
    if mode is ActivationCheckpointing.selective_layer:
        return (model.num_layers // training.selective_layer_interval) * block
    if mode is ActivationCheckpointing.selective_op:
        return model.num_layers * selective_op_recompute_flops_per_token(model)
    return 0.0


def recompute_attention_flops_per_token(model: ModelSpec, training: TrainingSpec, seq_len: int) -> float:
    """Of recompute_flops_per_token, the attention core's (QK^T and AV run again): every block
    under full and selective checkpointing, the checkpointed blocks under selective-layer, none
    under selective-op (it saves the attention's output) or without checkpointing."""
    mode = training.activation_checkpointing
    attention = attention_forward_flops_per_token(model, seq_len, executed_causal_fraction(training.attention_kernel, model.causal))
    if mode in (ActivationCheckpointing.full, ActivationCheckpointing.selective):
        return model.num_layers * attention
    if mode is ActivationCheckpointing.selective_layer:
        return (model.num_layers // training.selective_layer_interval) * attention
    return 0.0


def step_flops(request: PlanRequest) -> StepFlops:
    """Executed and model FLOPs of one GPU's optimizer step."""
    model, training = request.model, request.training
    if training.finetune.trains_everything:
        return _step_flops(model, training, request.batch, 0, 0)
    # Frozen weights skip their gradient's matmul; LoRA adapters add their own two small
    # matmuls (forward and full backward). Model FLOPs stay the model's (MFU's definition).
    from zeroplan.core.finetune.units import adapter_weight_elements, frozen_matmul_weight_elements
    from zeroplan.core.parallel.units import rank_parameter_units

    units = rank_parameter_units(request)
    return _step_flops(model, training, request.batch, 2 * adapter_weight_elements(units),
                       2 * frozen_matmul_weight_elements(units, model.tied_embeddings))


# The FLOPs read the model, the training, the batch and the rank's adapter and frozen weights
# only: fit's strategies and the largest micro-batch's requests share them.
@functools.lru_cache(maxsize=256)
def _step_flops(model: ModelSpec, training: TrainingSpec, batch: BatchSpec, adapter_flops_per_token: int,
                frozen_gradient_flops_per_token: int) -> StepFlops:
    """step_flops: the step's tokens times _flops_per_token."""
    tokens = batch.micro_batch_size * batch.seq_len * batch.grad_accum_steps
    values = {name: tokens * per_token for name, per_token in _flops_per_token(
        model, training, batch.seq_len, adapter_flops_per_token, frozen_gradient_flops_per_token)}
    # StepFlops' fields are floats: built unvalidated (Frozen.trusted) where each already is one,
    # as validating them would leave them; validated otherwise.
    if all(type(value) is float for value in values.values()):
        return StepFlops.trusted(**values)
    return StepFlops(**values)


# Per token of the step the FLOPs read the model, the training, the sequence and the rank's
# adapter and frozen weights alone: computed once per sequence (the micro-batches and
# accumulation counts of a sweep share them).
@functools.lru_cache(maxsize=256)
def _flops_per_token(model: ModelSpec, training: TrainingSpec, seq_len: int, adapter_flops_per_token: int,
                     frozen_gradient_flops_per_token: int) -> tuple[tuple[str, float], ...]:
    """StepFlops' fields per token of the step: ``adapter_flops_per_token`` (twice the rank's
    adapter weights) joins the linears' forward and its backward matmuls, and
    ``frozen_gradient_flops_per_token`` (twice the frozen matmul weights) leaves the backward."""
    kernel = training.attention_kernel
    # DeepSpeed-Chat's reward model ends in a v_head of one output (zeroplan.core.reward_model).
    head = head_forward_flops_per_token(model, 1 if training.objective is Objective.reward else None)
    linear = layers_linear_forward_flops_per_token(model) + head
    attention = model.num_layers * attention_forward_flops_per_token(model, seq_len, executed_causal_fraction(kernel, model.causal))
    recompute = recompute_flops_per_token(model, training, seq_len)
    backward = BACKWARD_MATMULS_PER_FORWARD_MATMUL * linear + attention_backward_over_forward(kernel) * attention
    if adapter_flops_per_token or frozen_gradient_flops_per_token:
        linear += adapter_flops_per_token
        backward += BACKWARD_MATMULS_PER_FORWARD_MATMUL * adapter_flops_per_token - frozen_gradient_flops_per_token
    # torchtune 0.6.1 recipes/lora_dpo_single_device.py train(): the reference's
    # concatenated_forward, under no_grad and disable_adapter, runs the base model's forward
    # again over the same rows (zeroplan.core.dpo).
    reference = linear - adapter_flops_per_token + attention if training.objective is Objective.dpo else 0.0
    return (("forward_flops", linear + attention + reference), ("backward_flops", backward + recompute), ("recompute_flops", recompute),
            ("model_flops", model_flops_per_token(model, seq_len)), ("attention_forward_flops", attention),
            ("attention_backward_flops", attention_backward_over_forward(kernel) * attention
             + recompute_attention_flops_per_token(model, training, seq_len)))
