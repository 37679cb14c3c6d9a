"""An encoder-decoder's terms in the one per-rank breakdown (T5, mT5, umT5 and T0/mT0 in
transformers 4.56.2 models/t5, mt5, umt5): its parameter units (so its model states, its ZeRO
and FSDP gathers and its communication volumes follow from the counts, as for one stack), the
activations its encoder blocks keep at the source length and its decoder blocks at the target
length, and the loss over the target length. zeroplan.core.plan asks here instead of the
decoder-only activation terms when ModelSpec.encoder_decoder is set.

Symbols: S source (encoder) tokens per sequence, T target (decoder) tokens, b micro-batch, h
width, a heads, i = a x head_dim the attention's inner width, f the feed-forward width, e bytes
of an activation element. What is kept is what autograd saves (torch 2.13
tools/autograd/derivatives.yaml: a matmul keeps its input only for its weight's gradient, a
product each factor only for the other's gradient), read from transformers' modeling_t5.py and
measured with saved-tensor hooks on its own T5ForConditionalGeneration (tests/test_encoder_decoder.py).
"""

from __future__ import annotations


from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import LoraTarget
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import MlpKind, NormKind, PositionKind
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, Precision
from zeroplan.units import FP32_BYTES

ATTENTION_TARGETS = (LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o)
"""The linears an adapter may wrap in an encoder-decoder: the attention's (self and cross);
peft 0.17.1 utils/constants.py maps t5 and mt5 to ["q", "v"] and bart to ["q_proj", "v_proj"],
module names both attentions of a decoder block carry."""


# ---------------------------------------------------------------- what is planned

# The layouts measured against transformers' own T5 (tests/test_encoder_decoder.py). Each refusal
# names what is not: BART's post-norm blocks and its fused attention kernels, model parallelism
# (the tensor-parallel and pipeline terms are one stack's), autocast (its copies are one
# stack's), 16-bit adapters (peft's fp32 adapter copies), quantized bases, DoRA, torch.compile.
def check_encoder_decoder_request(request: PlanRequest) -> None:
    """Refuse, in one line, a request for an encoder-decoder outside what is modelled, and a
    target length for a model with one stack."""
    model, training, batch = request.model, request.training, request.batch
    if not model.is_encoder_decoder:
        if batch.target_len is not None:
            raise ZeroplanError("batch.target_len", f"is an encoder-decoder's decoder length; {model.name} has one stack "
                                                    "(allowed: unset, --target-len left out)")
        return
    finetune = training.finetune
    target = target_len(request)
    if target > model.max_positions and (model.position is PositionKind.learned or not batch.allow_longer_seq):
        raise ZeroplanError("batch.target_len", f"{target:,} exceeds {model.name}'s maximum of {model.max_positions:,} positions "
                                                f"(allowed: 1 to {model.max_positions:,}; allow_longer_seq (--allow-longer-seq) "
                                                "runs T5's relative positions past that)")
    refusals = (
        (training.framework is not Framework.hf, "training.framework",
         f"{training.framework.value} builds no encoder-decoder (allowed: hf, transformers' own T5)"),
        (model.encoder_decoder.post_norm or model.norm is not NormKind.rmsnorm, "model.encoder_decoder",
         "BART's post-norm LayerNorm blocks are counted (parameters, presets) but their activations are not "
         "modelled (allowed: T5, mT5, umT5, T0 and mT0 layouts)"),
        (not request.parallel.is_trivial, "parallel",
         "tensor, pipeline, context and expert parallelism are modelled for one stack (allowed: tp, pp, cp, ep 1)"),
        (training.precision.is_mixed, "training.precision",
         f"{training.precision.value}'s autocast copies are modelled for one stack (allowed: fp32, bf16-pure)"),
        (training.activation_checkpointing not in (ActivationCheckpointing.none, ActivationCheckpointing.full),
         "training.activation_checkpointing", f"{training.activation_checkpointing.value} (allowed: none, full)"),
        (training.attention_kernel is not AttentionKernel.eager, "training.attention_kernel",
         "transformers' T5Attention computes its scores eagerly, with no fused kernel (allowed: eager, --attention eager)"),
        (training.compile or training.activation_offloading or training.fused_cross_entropy or training.fused_linear_cross_entropy,
         "training", "compile, activation offloading and fused losses are not modelled for an encoder-decoder (allowed: off)"),
        (finetune.quantize.is_quantized or finetune.dora or finetune.frozen_blocks, "finetune",
         "quantized bases, DoRA and frozen blocks are not modelled for an encoder-decoder (allowed: full fine-tune or LoRA)"),
        (finetune.is_lora and training.precision is not Precision.fp32, "training.precision",
         "LoRA on an encoder-decoder is modelled in fp32 (peft's fp32 adapters; allowed: fp32)"),
    )
    for refused, field, detail in refusals:
        if refused:
            raise ZeroplanError(field, detail)
    if finetune.is_lora:
        others = [t.value for t in finetune.targets(training.framework) if t not in ATTENTION_TARGETS]
        if others:
            raise ZeroplanError("finetune.lora_targets", f"{', '.join(others)} on an encoder-decoder is not modelled "
                                                         "(allowed: q, k, v, o: both attentions' linears)")


def target_len(request: PlanRequest) -> int:
    """T: the decoder's tokens per sequence (batch.target_len, or seq_len when not given)."""
    batch = request.batch
    return batch.target_len if batch.target_len is not None else batch.seq_len


# ---------------------------------------------------------------- activations

def _linear_keeps_input(request: PlanRequest) -> bool:
    """Whether a base linear keeps its input: its weight trains, or DeepSpeed ZeRO-3's
    F.linear replacement keeps it regardless (zeroplan.core.finetune.activations.zero3_linear_keeps_input)."""
    from zeroplan.core.finetune.activations import zero3_linear_keeps_input

    return not request.training.finetune.is_lora or zero3_linear_keeps_input(request)


def _mask_bytes(request: PlanRequest) -> int:
    """Bytes a dropout keeps per element (zeroplan.core.finetune.activations.dropout_mask_bytes)."""
    from zeroplan.core.finetune.activations import dropout_mask_bytes

    return dropout_mask_bytes(request, request.training.precision.compute_bytes)


def _wrapped(request: PlanRequest) -> tuple[LoraTarget, ...]:
    finetune = request.training.finetune
    return finetune.targets(request.training.framework) if finetune.is_lora else ()


# T5LayerNorm.forward (modeling_t5.py): variance = x.to(float32).pow(2).mean(-1); x * rsqrt(variance
# + eps); .to(weight dtype) in 16 bits; weight * that. pow keeps its fp32 input (a copy of a
# 16-bit x), the product x * rsqrt keeps x and the fp32 per-token rsqrt, the weight's product
# the normalised tensor only for the weight's gradient (a frozen weight: nothing).
def norm_kept_bytes(request: PlanRequest, tokens: int) -> int:
    """Bytes one T5LayerNorm over ``tokens`` tokens keeps."""
    e, h = request.training.precision.compute_bytes, request.model.hidden_size
    kept = FP32_BYTES * tokens * h + FP32_BYTES * tokens
    if e != FP32_BYTES:
        kept += e * tokens * h
    if not request.training.finetune.is_lora:
        kept += e * tokens * h
    return kept


def _input_kept_bytes(request: PlanRequest, linears: tuple[LoraTarget, ...], tokens: int, width: int) -> int:
    """What is kept of one input read by ``linears``: the input once if a base linear keeps it or
    an adapter reads it undropped; with lora_dropout, each adapter's mask and dropped copy; and
    each adapter's r-wide A output (peft 0.17.1 tuners/lora/layer.py Linear.forward:
    lora_B(lora_A(dropout(x))) * scaling, one nn.Dropout per adapter)."""
    finetune = request.training.finetune
    e = request.training.precision.compute_bytes
    wrapped = [t for t in linears if t in _wrapped(request)]
    shared = _linear_keeps_input(request) or (wrapped and finetune.lora_dropout == 0)
    kept = e * tokens * width if shared else 0
    if finetune.lora_dropout > 0:
        kept += len(wrapped) * (_mask_bytes(request) + e) * tokens * width
    return kept + len(wrapped) * e * tokens * finetune.lora_rank


# T5Attention.forward (modeling_t5.py): q, k, v projected; scores = q @ k^T keeps q and k;
# += position_bias in place (nothing kept); softmax(scores.float()) keeps its fp32 output,
# .type_as(scores) a 16-bit copy; dropout keeps its mask, and attn_weights @ v the dropped
# probabilities (else the 16-bit copy, the fp32 output itself in fp32) and v; o reads the
# heads' output transposed back (a new tensor).
def attention_kept_bytes(request: PlanRequest, query_tokens: int, key_tokens: int, *, cross: bool) -> int:
    """Bytes one self- or cross-attention keeps past its norm: ``query_tokens`` and
    ``key_tokens`` over the whole micro-batch (b x length). The cross-attention's k and v read the
    encoder's output, counted once for every decoder block (outside_kept_bytes)."""
    model, training = request.model, request.training
    e, inner = training.precision.compute_bytes, model.q_size
    dropout = model.attention_dropout
    b = request.batch.micro_batch_size
    scores = model.num_heads * query_tokens * key_tokens // b
    kept = e * inner * (query_tokens + 2 * key_tokens) + FP32_BYTES * scores
    if dropout > 0:
        kept += (_mask_bytes(request) + e) * scores
    elif e != FP32_BYTES:
        kept += e * scores
    if cross:
        kept += _input_kept_bytes(request, (LoraTarget.q,), query_tokens, model.hidden_size)
        kept += _cross_kv_adapter_bytes(request, key_tokens)
    else:
        kept += _input_kept_bytes(request, (LoraTarget.q, LoraTarget.k, LoraTarget.v), query_tokens, model.hidden_size)
    kept += _input_kept_bytes(request, (LoraTarget.o,), query_tokens, inner)
    if model.hidden_dropout > 0:
        kept += _mask_bytes(request) * query_tokens * model.hidden_size
    return kept


def _cross_kv_adapter_bytes(request: PlanRequest, key_tokens: int) -> int:
    """What adapters on the cross-attention's k and v keep beyond the encoder's output (which
    outside_kept_bytes counts once): with lora_dropout each its own dropped copy, and each its
    A output."""
    finetune = request.training.finetune
    e, h = request.training.precision.compute_bytes, request.model.hidden_size
    wrapped = [t for t in (LoraTarget.k, LoraTarget.v) if t in _wrapped(request)]
    dropped = (_mask_bytes(request) + e) * key_tokens * h if finetune.lora_dropout > 0 else 0
    return len(wrapped) * (dropped + e * key_tokens * finetune.lora_rank)


def _encoder_output_kept(request: PlanRequest) -> bool:
    """Whether the cross-attentions' k and v keep the encoder's output (their weights train,
    ZeRO-3's F.linear keeps it, or an undropped adapter reads it)."""
    finetune = request.training.finetune
    wrapped = any(t in _wrapped(request) for t in (LoraTarget.k, LoraTarget.v))
    return _linear_keeps_input(request) or (wrapped and finetune.lora_dropout == 0)


# T5DenseActDense: wi, the activation, dropout, wo; T5DenseGatedActDense (t5 1.1, mT5, T0):
# act(wi_0(x)) * wi_1(x), dropout, wo, with gated-gelu's gelu_new (transformers
# activations.py NewGELUActivation, spelled out: 0.5 * x * (1 + tanh(c (x + 0.044715 x^3))))
# keeping x, the tanh, 0.5 x and 1 + tanh: 4 f where F.gelu keeps f. relu keeps its output, which
# is wo's input when no dropout lies between.
def mlp_kept_bytes(request: PlanRequest, tokens: int) -> int:
    """Bytes one feed-forward block keeps past its norm, over ``tokens`` tokens."""
    model = request.model
    e, f = request.training.precision.compute_bytes, model.ffn_hidden_size
    dropout = model.hidden_dropout > 0
    keeps = _linear_keeps_input(request)
    # wi (wi_0 and wi_1) read the norm's output.
    kept = e * tokens * model.hidden_size if keeps else 0
    if model.mlp is MlpKind.relu:
        inner = e * tokens * f
        wo_input = e * tokens * f if dropout and keeps else 0
    else:
        # gate's output (gelu_new's input) and its three internals, gelu's output and up's output
        # (the product's factors); wo's input: the product, or its dropped copy.
        inner = 6 * e * tokens * f
        wo_input = e * tokens * f if keeps else 0
    masks = _mask_bytes(request) * tokens * (f + model.hidden_size) if dropout else 0
    return kept + inner + wo_input + masks


def encoder_block_bytes(request: PlanRequest) -> int:
    """Bytes one encoder block keeps without recomputation (S b tokens)."""
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return (2 * norm_kept_bytes(request, tokens) + attention_kept_bytes(request, tokens, tokens, cross=False)
            + mlp_kept_bytes(request, tokens))


def decoder_block_bytes(request: PlanRequest) -> int:
    """Bytes one decoder block keeps without recomputation (T b tokens; its cross-attention
    reads S b encoder tokens)."""
    b = request.batch.micro_batch_size
    tokens, source = target_len(request) * b, request.batch.seq_len * b
    return (3 * norm_kept_bytes(request, tokens) + attention_kept_bytes(request, tokens, tokens, cross=False)
            + attention_kept_bytes(request, tokens, source, cross=True) + mlp_kept_bytes(request, tokens))


# T5Stack.forward: dropout(inputs_embeds) before the first block; final_layer_norm, then
# dropout, after the last. The encoder's dropped output is what every cross-attention's k and v
# read (one tensor). T5ForConditionalGeneration scales a tied head's input by h^-1/2 (a new
# tensor) before lm_head, which keeps its input for its weight's gradient.
def outside_kept_bytes(request: PlanRequest) -> int:
    """Bytes kept outside the blocks: the stacks' embedding dropouts and final norms, the
    encoder's output, the head's input."""
    model, training = request.model, request.training
    e, h, b = training.precision.compute_bytes, model.hidden_size, request.batch.micro_batch_size
    dropout = model.hidden_dropout > 0
    kept = 0
    for tokens in (request.batch.seq_len * b, target_len(request) * b):
        kept += norm_kept_bytes(request, tokens) if model.encoder_decoder.stack_final_norms else 0
        kept += 2 * _mask_bytes(request) * tokens * h if dropout else 0
    if _encoder_output_kept(request):
        kept += e * request.batch.seq_len * b * h
    finetune = training.finetune
    if (not finetune.is_lora and not finetune.freeze_embeddings) or _linear_keeps_input(request) and finetune.is_lora:
        kept += e * target_len(request) * b * h
    if finetune.is_lora:
        for tokens in (request.batch.seq_len * b, target_len(request) * b):
            kept -= frozen_stream_savings_bytes(request, tokens)
    return kept


# Under LoRA the embedding is frozen, so each stack's embedding output needs no gradient until
# the first adapter: autograd keeps nothing for the embedding's dropout, the first attention
# norm, the dropouts of that attention's q, k, v adapters, and of scores = q @ k^T it keeps q only
# for k's gradient (k = a frozen linear of that stream). Measured on transformers' T5 under peft
# (tests/test_encoder_decoder.py: the one-block model keeps exactly these less). With q unwrapped
# and k wrapped the roles swap; with neither wrapped the first attention keeps less still, which
# is not derived (the plan then counts its scores' tensors: an upper bound).
def frozen_stream_savings_bytes(request: PlanRequest, tokens: int) -> int:
    """What the first block of a stack over ``tokens`` tokens keeps less than the others under LoRA."""
    model, finetune = request.model, request.training.finetune
    e, h = request.training.precision.compute_bytes, model.hidden_size
    wrapped = _wrapped(request)
    savings = norm_kept_bytes(request, tokens)
    if model.hidden_dropout > 0:
        savings += _mask_bytes(request) * tokens * h
    if finetune.lora_dropout > 0:
        savings += sum(1 for t in (LoraTarget.q, LoraTarget.k, LoraTarget.v) if t in wrapped) * _mask_bytes(request) * tokens * h
    if (LoraTarget.q in wrapped) != (LoraTarget.k in wrapped):
        savings += e * tokens * model.q_size
    return savings


# T5ForConditionalGeneration.forward: CrossEntropyLoss(lm_logits.view(-1, V), labels.view(-1)) on
# the head's output as it is (no fp32 upcast, no shift: the labels are the targets): log_softmax
# keeps its output; backward writes the log-probabilities' gradient, then the logits' (the three
# tensors of zeroplan.core.activations.logits_parts, at T tokens and the compute dtype).
def logits_tensors(request: PlanRequest) -> tuple[int, int, int]:
    """The loss's three tensors over the target tokens."""
    sbv = target_len(request) * request.batch.micro_batch_size * request.model.vocab_size
    e = request.training.precision.compute_bytes
    return e * sbv, e * sbv, e * sbv


def activations(request: PlanRequest) -> tuple[int, int]:
    """(kept, recompute): every block's and the outside terms, or under full recomputation each
    block's input (T5Block is a GradientCheckpointingLayer) and the larger block rebuilt apart."""
    model, training, batch = request.model, request.training, request.batch
    e, h, b = training.precision.compute_bytes, model.hidden_size, batch.micro_batch_size
    encoder, decoder = encoder_block_bytes(request), decoder_block_bytes(request)
    outside = outside_kept_bytes(request)
    if training.activation_checkpointing is ActivationCheckpointing.full:
        inputs = e * h * b * (model.encoder_layers * batch.seq_len + model.decoder_layers * target_len(request))
        return inputs + outside, max(encoder, decoder)
    return model.encoder_layers * encoder + model.decoder_layers * decoder + outside, 0


def micro_batch_terms(request: PlanRequest) -> tuple[tuple[str, object], ...]:
    """zeroplan.core.plan's micro-batch terms for an encoder-decoder: the activations, the loss
    over the target length, the backward workspace (two residual-stream tensors of the longer
    stack: zeroplan.core.activations.backward_workspace_bytes) with the rebuilt block."""
    check_encoder_decoder_request(request)
    kept, recompute = activations(request)
    if request.training.keep_outputs:
        # The loop's held output object: its logits beyond the loss's tensors (its cache's
        # k and v are the tensors the attention keeps anyway, zeroplan.core.kv_cache).
        kept += logits_tensors(request)[0]
    e, b = request.training.precision.compute_bytes, request.batch.micro_batch_size
    workspace = 2 * e * b * request.model.hidden_size * max(request.batch.seq_len, target_len(request)) + recompute
    logits = sum(logits_tensors(request))
    return (("activations", kept), ("logits", logits), ("workspace", workspace), ("logits_pieces", (logits,)),
            ("logits_gradient", 0))
