"""What a transformers release's causal-LM forward returns and allocates at its loss
(TrainingSpec.transformers_version; docs/frameworks.md, "transformers releases"). Read from each
release's own source (the wheels' transformers/models/llama/modeling_llama.py and
transformers/loss/loss_utils.py); the profile's own 4.56.2 is measured (benchmarks/kv-cache-records).
Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.torch_release import torch_release
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import version_tuple
from zeroplan.specs.framework import TRANSFORMERS_VERSION, Framework
from zeroplan.specs.model import EagerSoftmax, ModelSpec, PositionKind
from zeroplan.specs.training import Kernels, Precision, TrainingSpec

FP32_LOGITS_UNTIL = (4, 46, 0)
"""transformers 4.31.0 to 4.45.2 LlamaForCausalLM.forward (4.31.0 modeling_llama.py:825
``logits = logits.float()``; 4.45.2 lines 1213-1214 ``self.lm_head(...).float()``, "TODO: remove
the float() operation in v4.46") returns the logits upcast to fp32 whether or not a loss is
computed ("Starting from v4.46, the `logits` model output will have the same type as the
model"). 4.46.0 returns lm_head's output in the compute dtype (modeling_llama.py:1210) and moves
the upcast into loss/loss_utils.py ForCausalLMLoss (``logits = logits.float()``, line 36)."""

SHIFTED_COPY_UNTIL = (4, 49, 0)
"""Up to 4.48 the loss shifts the fp32 logits (4.31.0 modeling_llama.py:830, 4.46.0 and 4.48.0
loss_utils.py:38-39 ``shift_logits = logits[..., :-1, :].contiguous()``), a second fp32 copy of
b x (s - 1) rows, and cross-entropy runs on those rows. 4.49.0 (PR 35646, "Optimize
ForCausalLMLoss by removing unnecessary contiguous() call to reduce memory overhead")
pads the labels by one position instead (loss_utils.py:39 ``nn.functional.pad(labels, ...)``)
and runs on the upcast logits as they are (4.49.0 loss_utils.py:36-39)."""


OPT_OWN_FORWARD_UNTIL = (4, 49, 0)
"""transformers 4.31.0 to 4.48.0 models/opt/modeling_opt.py (4.28.1 and 4.29.2 the same ops) run
OPT's own OPTAttention and loss. The attention (4.31.0 lines 219-233, 4.48.0 lines 197-211) adds
the causal mask to the scores and clamps them, ``attn_weights = torch.max(attn_weights,
torch.tensor(torch.finfo(attn_weights.dtype).min, ...))``, whose backward (maximum's, torch's
derivatives.yaml) keeps its input, the masked scores in the compute dtype; then it upcasts the
softmax only for fp16 (``if attn_weights.dtype == torch.float16: softmax(..., dtype=float32)
.to(torch.float16)``, else a softmax in the compute dtype). OPTForCausalLM.forward (4.31.0 lines
957-969, 4.48.0 lines 1189-1201) returns ``self.lm_head(outputs[0]).contiguous()`` in the compute
dtype and computes the loss on it: ``shift_logits = logits[..., :-1, :].contiguous()`` and
CrossEntropyLoss over them, in the compute dtype. 4.49.0 replaced both (modeling_opt.py:168
eager_attention_forward without the clamp, softmax upcast whatever the dtype; :1202
self.loss_function, the ForCausalLMLoss the profile's 4.56.2 runs). Measured on the releases'
own OPTForCausalLM under saved-tensor hooks (benchmarks/opt_release_attention.py): 4.28.1 keeps
2 bytes a score more than 4.56.2 in fp16."""


TRAINER_FUSED_ADAMW_FROM = (4, 54, 0)
"""transformers PR 37358 (first in 4.54.0; 4.53.3 training_args.py:1281 ``default_optim =
"adamw_torch"`` with the switch commented out): TrainingArguments' default ``optim`` is
adamw_torch_fused only where torch is 2.8 or later (4.54.0 training_args.py:1286-1291, 4.56.2
:1296-1301), else adamw_torch, ``torch.optim.AdamW`` built without ``fused`` (torch's foreach
default on CUDA from 2.0). Before 4.32 (PR 25109) the default was transformers' own AdamW
(adamw_hf), a per-tensor loop; zeroplan plans that as torch's foreach, its temporaries not modelled."""
TRAINER_FUSED_TORCH_FROM = (2, 8, 0)
"""is_torch_greater_or_equal_than_2_8 (transformers 4.56.2 pytorch_utils.py), the condition of
the fused default."""


def trainer_fuses_adamw(training: TrainingSpec) -> bool:
    """Whether the Trainer's default optimizer is torch's fused AdamW: the planned transformers
    release 4.54 or later with torch 2.8 or later (TRAINER_FUSED_ADAMW_FROM)."""
    return (transformers_release(training) >= TRAINER_FUSED_ADAMW_FROM
            and torch_release(training) >= TRAINER_FUSED_TORCH_FROM)


def transformers_release(training: TrainingSpec) -> tuple[int, int, int]:
    """The release planned: TrainingSpec.transformers_version, else the profile's 4.56.2."""
    return version_tuple(training.transformers_version or TRANSFORMERS_VERSION)


def returns_fp32_logits(training: TrainingSpec) -> bool:
    """Whether the forward's output object carries fp32 logits (releases before 4.46)."""
    return transformers_release(training) < FP32_LOGITS_UNTIL


def shifts_logits_copy(training: TrainingSpec) -> bool:
    """Whether the loss makes a contiguous fp32 copy of the shifted logits (before 4.49)."""
    return transformers_release(training) < SHIFTED_COPY_UNTIL


# SHIFTED_COPY_UNTIL: the loss runs on b x (s - 1) rows, so its saved log-softmax and both
# gradients (nll_loss_backward's, _log_softmax_backward_data's) are of those rows. Backward then
# passes the rows' gradient through view's and contiguous()'s nodes (ViewBackward0 reshapes it,
# CloneBackward0 returns it as it is) to the slice's: SliceBackward0 (torch derivatives.yaml
# slice.Tensor: slice_backward_symint; TensorShape.cpp slice_backward: ``at::zeros(input_sizes,
# grad.options())`` and a copy into its slice) makes a zeroed gradient of all b x s rows beside
# the rows' one, in the loss's dtype, before the upcast's backward casts it (Llama) or lm_head's
# backward reads it (OPT's own forward). Run on the CPU (benchmarks/cuda_autocast_loss_tensors.py,
# "transformers < 4.49"): the backward allocates two b x (s - 1)-row fp32 tensors, then one of
# b x s rows, then the bf16 cast of it; at b = 1 as at b = 2 (there .contiguous() of the slice is
# the slice itself, a view: the forward makes no copy, the backward the same tensors).
def shifted_rows(training: TrainingSpec, s: int) -> int:
    """Rows per sequence the loss's tensors cover: s - 1 where the release shifts the logits
    (before 4.49, or OPT's own forward), else s."""
    return s - 1 if shifts_logits_copy(training) else s


def slice_backward_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int, element_bytes: int) -> tuple[int, ...]:
    """The slice's backward moment (above), where the release shifts the logits: the rows'
    gradient and the zeroed b x s-row gradient, of ``element_bytes``; () otherwise."""
    if not shifts_logits_copy(training):
        return ()
    return element_bytes * b * (s - 1) * model.vocab_size, element_bytes * b * s * model.vocab_size


def returned_logit_bytes(training: TrainingSpec, model: ModelSpec | None = None) -> int:
    """Bytes of one logit in the output object: fp32 before 4.46 (the Llama family's forward;
    OPT's own before 4.49 returns lm_head's compute-dtype output), else the compute dtype."""
    if model is not None and runs_opt_own_forward(model, training):
        return training.precision.compute_bytes
    return 4 if returns_fp32_logits(training) else training.precision.compute_bytes


QWEN2_LAYER_ROPE_CACHE = ((4, 37, 0), (4, 45, 0))
"""transformers 4.37.0 (Qwen2's first release) to 4.44.2 models/qwen2/modeling_qwen2.py: every
Qwen2Attention builds a Qwen2RotaryEmbedding of its own (4.37.0 :238, 4.40.0 :233, 4.44.2 :276),
whose __init__ (4.40.0 :95-117, _set_cos_sin_cache) registers the non-persistent buffers inv_freq
(head_dim / 2) and cos_cached and sin_cached of [max_position_embeddings, head_dim] each; its
forward returns slices of them (:119-127, ``.to`` the dtype they already have under the engine's
cast: views). qwen2_moe's Qwen2MoeRotaryEmbedding the same (4.40.0 :174-205, :314; 4.44.2 :236,
:354). 4.45.0 builds one per model with no cache (modeling_qwen2.py:329, :874; only inv_freq)."""


# hf_config._llama_spec sets qkv_bias only for model_type qwen2 and qwen2_moe (their q, k and v
# biases): that marks the Qwen2 family in a ModelSpec.
def layer_rope_cache_elements(model: ModelSpec, training: TrainingSpec) -> int:
    """The elements of the rotary buffers every layer of a Qwen2-family model holds in the
    releases that cache them per layer (QWEN2_LAYER_ROPE_CACHE); 0 elsewhere."""
    first, until = QWEN2_LAYER_ROPE_CACHE
    if not model.qkv_bias or model.position is not PositionKind.rope or not first <= transformers_release(training) < until:
        return 0
    head = model.head_size
    return model.num_layers * (2 * model.max_positions * head + head // 2)


POSITIONS_MASK_RELEASES = ((4, 38, 0), (4, 39, 0))
"""transformers 4.38.0 to 4.38.2 models/llama/modeling_llama.py (4.38.2 lines cited; 4.38.0 and
4.38.1 :921-923, :1046-1063 the same ops) and models/gemma/modeling_gemma.py (4.38.2 :822-825,
:952-969): LlamaModel.__init__ registers a non-persistent P x P boolean buffer, ``torch.triu(
torch.full((P, P), True, dtype=torch.bool), 1)`` with P = max_position_embeddings (:931-934), and
_update_causal_mask builds at every forward ``self.causal_mask[None, None, :, :].repeat(batch_size,
1, 1, 1).to(dtype) * min_dtype`` (:1074), a b x 1 x P x P tensor in the embeddings' dtype
(``dtype = input_tensor.dtype``, :1064; inputs_embeds, :993) whatever the sequence length, for
eager and SDPA attention alike (flash_attention_2 returns None or the 2-D mask, :1058-1061).
LlamaModel.forward passes that one tensor to every decoder layer (:1008-1016 under gradient
checkpointing, :1018-1026 without). 4.37.2 builds its mask with
_prepare_4d_causal_attention_mask_for_sdpa (no buffer) and 4.39.0 an s x s one
(modeling_llama.py:1074 ``torch.full((sequence_length, target_length), ...)``; Gemma's the same,
modeling_gemma.py:985); Mistral's, Mixtral's and Qwen2's 4.38 code calls
_prepare_4d_causal_attention_mask_for_sdpa (modeling_mistral.py:1004, modeling_qwen2.py:1020)."""


# POSITIONS_MASK_RELEASES: ModelSpec.positions_causal_mask marks the code that builds it.
def builds_positions_mask(model: ModelSpec, training: TrainingSpec) -> bool:
    """Whether the planned release's code builds the b x 1 x P x P causal mask (hf, a release
    4.38.x named by --transformers-version, a LlamaModel or GemmaModel)."""
    first, until = POSITIONS_MASK_RELEASES
    return (training.framework is Framework.hf and training.transformers_version is not None
            and model.positions_causal_mask and first <= transformers_release(training) < until)


# transformers 4.38.2 modeling_llama.py:1068-1070: a sequence longer than the buffer replaces it,
# once, with ``torch.triu(torch.full((2 * P, 2 * P), fill_value=1), 1)``, an int64 tensor made on
# the CPU (no device given); beyond 2P the attention's ``attention_mask[:, :, cache_position, ...]``
# (:377, :662) indexes past it and the forward fails (run on the CPU: IndexError at 2P + 8 tokens).
def positions_mask_side(model: ModelSpec, s: int) -> int:
    """The mask's side: max_position_embeddings, or twice it for a longer sequence."""
    p = model.max_positions
    if s > 2 * p:
        raise ZeroplanError("batch.seq_len", f"{s} is over twice max_position_embeddings ({p}), where transformers 4.38's "
                                             f"{model.name} forward fails (allowed: at most {2 * p} under 4.38.x)")
    return p if s <= p else 2 * p


# transformers 4.38.2 modeling_llama.py:931-934: one bool (1 byte) per element, moved to the device
# with the module (the engine's or FSDP's move, or model.to). A forward longer than P replaces it by
# a CPU tensor (:1068-1070, positions_mask_side), after which the device holds none: not modelled,
# so that the buffers stay independent of the sequence as the planner's state terms assume
# (over-counted by P x P bytes for sequences between P and 2P).
def positions_mask_buffer_bytes(model: ModelSpec, training: TrainingSpec) -> int:
    """Bytes of the P x P boolean buffer on the device, once per model (0 where not built)."""
    if not builds_positions_mask(model, training):
        return 0
    return model.max_positions * model.max_positions


# hf_families.opt_spec is the only model reader that offsets its learned positions (OPT's
# OPTLearnedPositionalEmbedding, ids offset by 2): that marks an OPT model in a ModelSpec.
def is_opt(model: ModelSpec) -> bool:
    return model.position is PositionKind.learned and model.position_offset == 2


def runs_opt_own_forward(model: ModelSpec, training: TrainingSpec) -> bool:
    """Whether an OPT model runs a release's own OPTAttention clamp and compute-dtype loss (before 4.49)."""
    return (training.framework is Framework.hf and training.transformers_version is not None and is_opt(model)
            and transformers_release(training) < OPT_OWN_FORWARD_UNTIL)


# OPT_OWN_FORWARD_UNTIL: the clamp's kept input, the masked scores in the compute dtype.
def opt_clamp_score_bytes(model: ModelSpec, training: TrainingSpec) -> int:
    """Bytes a score OPT's own attention keeps for its clamp (0 where the release does not clamp)."""
    return training.precision.compute_bytes if runs_opt_own_forward(model, training) else 0


# OPT_OWN_FORWARD_UNTIL: the softmax runs in fp32 only where the scores are fp16.
# ModelSpec.eager_softmax (EagerSoftmax.scores: transformers 4.56.2 models/gpt2/modeling_gpt2.py:141
# eager_attention_forward, ``nn.functional.softmax(attn_weights, dim=-1)``): the softmax runs in
# the scores' dtype, but torch 2.13 aten/src/ATen/autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE
# lists softmax for CUDA autocast, which runs it with dtype=float when none is given (what
# Llama's passes itself); CPU autocast leaves it in the compute dtype (measured: a bf16 input's
# softmax under torch.autocast("cpu") is bf16). The ``.type(value.dtype)`` after it is the same
# cast Llama's ``.to(query.dtype)`` is. EagerSoftmax.hidden (models/falcon/modeling_falcon.py:353
# FalconAttention.forward, ``F.softmax(..., dtype=hidden_states.dtype)``): the attention's input
# is input_layernorm's output, fp32 under CUDA and CPU autocast alike (layer_norm is in both
# fp32 lists; measured on the CPU), else the compute dtype; ``attention_scores @ value_layer``
# under autocast then keeps the bf16 cast of the fp32 probabilities, as Llama's does.
def upcasts_softmax(model: ModelSpec, training: TrainingSpec, *, autocast: bool = False) -> bool:
    """Whether the eager softmax runs in fp32 (every dtype from 4.49 where the family asks for
    it, else only under autocast, CUDA's for GPT-2's; OPT's own attention: fp16 only)."""
    if model.eager_softmax is EagerSoftmax.scores:
        return autocast and training.kernels is Kernels.cuda
    if model.eager_softmax is EagerSoftmax.hidden:
        return autocast
    return not runs_opt_own_forward(model, training) or training.precision is Precision.fp16_mixed


# OPT_OWN_FORWARD_UNTIL: OPTForCausalLM.forward's loss in the compute dtype. Its forward holds
# lm_head's logits (b x s rows), their shifted contiguous copy (b x (s - 1) rows) and
# CrossEntropyLoss's log-softmax of it at once; the copy goes when the loss returns (log_softmax
# keeps its output, not its input). The backward starts with nll_loss_backward's dense gradient of
# the log-probabilities, then _log_softmax_backward_data writes the shifted logits' gradient
# while both are alive (as zeroplan.core.activations.logits_parts for the fp32 loss): three
# compute-dtype tensors of b x (s - 1) rows.
def opt_loss_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the loss's forward tensors, its backward's) under OPT's own forward before 4.49."""
    e = training.precision.compute_bytes
    shifted = e * b * (s - 1) * model.vocab_size
    return (e * b * s * model.vocab_size, shifted, shifted), (shifted, shifted, shifted)


# FP32_LOGITS_UNTIL and SHIFTED_COPY_UNTIL: the loss's tensors one by one, in the order the
# release's forward and torch's autograd make and free them. transformers 4.40.0
# models/llama/modeling_llama.py:1227-1241 (4.31.0 :824-838, 4.45.2 :1213-1227 alike):
# ``logits = self.lm_head(hidden_states)`` in the compute dtype, ``logits = logits.float()``
# (the 16-bit logits go as the name is rebound: ToCopyBackward0 keeps none of its input),
# ``shift_logits = logits[..., :-1, :].contiguous()`` and CrossEntropyLoss, whose log_softmax
# output autograd keeps; the shifted copy goes when the forward returns, the fp32 logits with the
# output object when the Trainer's compute_loss returns (4.40.0 trainer.py:3161-3186 returns the
# loss alone). Backward: nll_loss_backward's gradient of the log-probabilities, then
# _log_softmax_backward_data's (both b x (s - 1) rows, fp32), the log-softmax and the first freed
# with their node; SliceBackward0's zeroed b x s-row fp32 gradient, then ToCopyBackward0's cast of
# it to the compute dtype, which lm_head's backward reads (shifted_rows above). Measured on the CPU
# (benchmarks/cuda_autocast_loss_tensors.py ordered_before_446: this order at b 2; at b 1 the
# slice is contiguous and no copy is made) and on DeepSpeed 0.14.2's own engine
# (benchmarks/deepspeed_zero3_fp16_streams.py: the 16-bit logits' segment and a second fp32-sized
# one on the compute stream). The moments the planner sums
# (zeroplan.core.framework_loss.framework_logits_tensors) are the largest sets alive at once here;
# allocated whole they reuse one another's blocks, where in this order the 16-bit logits' block
# and a shifted-sized one are cached beside requests they cannot serve.
LOSS_ORDER = ("logits16+", "logits32+", "logits16-", "shifted+", "logprobs+", "shifted-", "logits32-",
              "nll_grad+", "logprobs_grad+", "nll_grad-", "logprobs-", "slice_grad+", "logprobs_grad-",
              "logits16_grad+", "slice_grad-", "logits16_grad-")
"""The loss's tensors in the release's order: '+' made, '-' freed."""

LOSS_TENSORS = ("logits16", "logits32", "shifted", "logprobs", "nll_grad", "logprobs_grad", "slice_grad", "logits16_grad")
"""The tensors LOSS_ORDER names, by the index ordered_loss_tensors gives each."""


# 4.40.0 modeling_llama.py:1227-1241 and trainer.py:3161-3186 (LOSS_ORDER above).
def ordered_loss_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> tuple[tuple[int, int], ...]:
    """The loss's allocations and frees in LOSS_ORDER, as (tensor index, bytes) for an
    allocation and (tensor index, 0) for a free, where the release upcasts 16-bit logits in the
    model's forward and shifts them (FP32_LOGITS_UNTIL: releases before 4.46 under hf, a 16-bit
    compute dtype, not OPT's own forward); () elsewhere."""
    e = training.precision.compute_bytes
    if (training.framework is not Framework.hf or training.transformers_version is None or e == 4
            or not returns_fp32_logits(training) or runs_opt_own_forward(model, training)):
        return ()
    full, shifted = s * b * model.vocab_size, (s - 1) * b * model.vocab_size
    sizes = {"logits16": e * full, "logits32": 4 * full, "shifted": 4 * shifted, "logprobs": 4 * shifted,
             "nll_grad": 4 * shifted, "logprobs_grad": 4 * shifted, "slice_grad": 4 * full, "logits16_grad": e * full}
    index = {name: k for k, name in enumerate(LOSS_TENSORS)}
    # One sequence: the slice of the first s - 1 rows is contiguous, and .contiguous() returns it.
    steps = [step for step in LOSS_ORDER if b > 1 or not step.startswith("shifted")]
    return tuple((index[step[:-1]], sizes[step[:-1]] if step[-1] == "+" else 0) for step in steps)
