"""What each framework's loss holds on a GPU, moment by moment (docs/frameworks.md, "Profiles"):
torchtune's chunked cross-entropy and its plain one, torchtitan's ChunkedLossWrapper, liger's
fused linear cross-entropy, and the output projection's unit FSDP2 gathers around them. Each
moment is affine in the micro-batch, so the plan search can scale it (zeroplan.core.search).
The blocks' bytes are zeroplan.core.frameworks'; nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.compiled import (COMPILED_CROSS_ENTROPY_ROW_BYTES, compiled_chunked_logits_tensors, compiles_loss,
                                    compiles_unchunked_loss)
from zeroplan.core.frameworks import hf_under_autocast
from zeroplan.core import tinyllama
from zeroplan.core.dpo import dpo_logits_tensors
from zeroplan.core.dschat_dpo import dschat_dpo_logits_tensors, runs_dschat_dpo
from zeroplan.core.reward_model import reward_head_tensors
from zeroplan.core.kv_cache import kv_cache_tensors, loss_forward_tensors
from zeroplan.core.own_loss import loss_under_trainer_autocast, own_loss_tensors, runs_own_loss
from zeroplan.core.transformers_release import (
    opt_loss_tensors, runs_opt_own_forward, shifted_rows, slice_backward_tensors,
)
from zeroplan.core.profiles import fsdp1_root_stays_gathered, fsdp_separates_embedding_and_head, loss_chunks, profile
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Objective, TrainingSpec
from zeroplan.units import BF16_BYTES, FP32_BYTES, even_split


# torchtune 0.6.1 modules/loss/ce_chunked_output_loss.py: the output projection returns
# num_output_chunks bf16 chunks and each is upcast and passed through F.cross_entropy on its
# own. The largest moment of its forward is the last chunk's: all bf16 chunks (2sbV), the fp32
# log-softmax of the chunks before (saved, 4sbV in all) and the last chunk's fp32 copy
# (4sbV/n). Backward first holds the saved log-softmax and one chunk's two fp32 gradients;
# once every chunk's loss backward has run, the n bf16 logit gradients (2sbV) wait for the
# output projection's backward, which adds ``head_backward_bytes`` (fsdp_chunked_head_bytes).
def chunked_logits_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int,
                           head_backward_parts: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
    """The tensors alive at the loss's three moments (its forward: n bf16 chunks, n saved fp32
    log-softmax chunks, the last chunk's fp32 copy; its backward: the saved log-softmax and one
    chunk's two fp32 gradients; the head's backward: the n bf16 logit gradients and
    ``head_backward_parts``, fsdp_chunked_head_parts)."""
    sbv = s * b * model.vocab_size
    e = training.precision.compute_bytes
    saved = even_split(FP32_BYTES * sbv, chunks)
    forward = (*even_split(e * sbv, chunks), *saved, FP32_BYTES * sbv // chunks)
    backward = (*saved, *even_split(2 * FP32_BYTES * sbv // chunks, 2))
    head = (*even_split(e * sbv, chunks), *head_backward_parts)
    return forward, backward, head


def chunked_logits_pieces(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int) -> tuple[int, int, int]:
    """The loss's bytes at its three moments: its forward, its backward, the head's backward."""
    forward, backward, head = (sum(m) for m in chunked_logits_tensors(model, training, s, b, chunks, ()))
    return forward, backward, head


TORCHTITAN_LOSS_CHUNKS = 8
"""torchtitan 0.3.0 components/loss.py:610 ChunkedLossWrapper.Config.num_chunks, which
models/llama3/config_registry.py llama3_8b/70b/405b (lines 187, 260, 312) leave at its default."""


# torchtitan 0.3.0 components/loss.py:567-790 ChunkedLossWrapper (trainer.py:513-535 sets it the
# model's lm_head and _skip_lm_head): the model returns the normed hidden states, and for each of
# n sequence chunks the wrapper runs lm_head, CrossEntropyLoss (line 32: the chunk's logits upcast
# to fp32) and that chunk's backward at once, copying each hidden-state gradient into an fp32
# [b, s, h] GradAccumulator buffer (line 498). Only one chunk's logits ever exist, never the
# whole b x s x V. Under FSDP2 (line 731) the head stays gathered over the chunks, its bf16
# weight gradient accumulates unsharded and is reduce-scattered once, at the last chunk: in
# fp32 (config/configs.py:93 mixed_precision_reduce), a fp32 copy of it and the
# reduce-scatter's fp32 input, plus its 1/N output. That moment is the loss's largest in the
# framework's own step (benchmarks/framework-step-records: FSDPMemTracker's 'temp' at every
# chunked record's peak is, to the byte, those three and the chunk's hidden-state gradient, its
# 'unsharded_grad' the bf16 head gradient), beside the gathered head, the fp32 buffer and the
# chunk's bf16 logits.
def torchtitan_chunked_loss_bytes(request: PlanRequest) -> int:
    """The chunked loss's largest moment: the last chunk's head reduce-scatter."""
    return sum(torchtitan_chunked_loss_parts(request))


def torchtitan_chunked_loss_parts(request: PlanRequest) -> tuple[int, ...]:
    """The tensors of torchtitan_chunked_loss_bytes, one by one: the chunk's bf16 logits and
    hidden-state gradient, the fp32 gradient buffer, the hidden-state chunk copies, the bf16
    head gradient (under FSDP its fp32 copy, the reduce-scatter's fp32 input and its output)
    and the gathered head."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    e = training.precision.compute_bytes
    if s % TORCHTITAN_LOSS_CHUNKS:
        # components/loss.py:672: "sequence length must be divisible by num_chunks".
        raise ZeroplanError("batch.seq_len", f"{s}: torchtitan's chunked loss needs a multiple of {TORCHTITAN_LOSS_CHUNKS} (or unchunked_loss, --unchunked-loss)")
    rows = b * s // TORCHTITAN_LOSS_CHUNKS
    chunk = (e * rows * model.vocab_size, e * rows * model.hidden_size)
    accumulator = (FP32_BYTES * b * s * model.hidden_size, *torchtitan_hidden_chunk_copies_parts(request))
    vh = model.vocab_size * model.hidden_size
    head: tuple[int, ...] = (e * vh,)
    if request.strategy.kind in (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.hsdp):
        head += (FP32_BYTES * vh, FP32_BYTES * vh, FP32_BYTES * vh // request.shard_group_size)
    return tuple(p for p in (*chunk, *accumulator, *head, *fsdp_head_gathered_parts(request, prefetched=False)) if p > 0)


# torchtitan 0.3.0 components/loss.py ChunkedLossWrapper.__call__ runs each chunk's lm_head, its
# CrossEntropyLoss and that chunk's backward in turn, the chunk's bf16 logits held by the loop
# until the backward is done. Eager, cross_entropy_loss upcasts the logits and F.cross_entropy
# saves the fp32 log-softmax (4 bytes a logit); its backward reaches the upcast's bf16 gradient
# with the nll gradient and the log-softmax gradient (fp32 both) still held: 16 bytes a logit
# with the bf16 logits, before the head's backward starts (measured: every storage of the
# framework's own step, 8B s16384 b4 full recomputation, at its peak: _log_softmax,
# nll_loss_backward and _log_softmax_backward_data outputs in fp32, the mm's logits and the
# _to_copy gradient in bf16). Compiled (the
# loss is in torchtitan's default CompileConfig.components), the chunk's cross-entropy keeps its
# bf16 logits and 8 bytes a row, and its backward writes one bf16 gradient
# (zeroplan.core.compiled, benchmarks/compiled-loss-records). With few rows a chunk the last
# chunk's head reduce-scatter is larger (torchtitan_chunked_loss_bytes); from about
# b x s / 8 > h rows on, this moment is.
def torchtitan_chunk_cross_entropy_bytes(request: PlanRequest) -> int:
    """The chunked loss at its first chunk's cross-entropy backward."""
    return sum(torchtitan_chunk_cross_entropy_parts(request))


def torchtitan_chunk_cross_entropy_parts(request: PlanRequest) -> list[int]:
    """The tensors of torchtitan_chunk_cross_entropy_bytes, one by one: the chunk's bf16 logits,
    what its cross-entropy holds (eager: the fp32 log-softmax, nll and log-softmax gradients and
    the bf16 gradient; compiled: the bf16 gradient and the row statistics), the fp32 gradient
    buffer and the gathered head."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    e = training.precision.compute_bytes
    rows = b * s // TORCHTITAN_LOSS_CHUNKS
    logits = rows * model.vocab_size
    if training.compile:
        cross_entropy = [e * logits, COMPILED_CROSS_ENTROPY_ROW_BYTES * rows]
    else:
        cross_entropy = [FP32_BYTES * logits, FP32_BYTES * logits, FP32_BYTES * logits, e * logits]
    accumulator = FP32_BYTES * b * s * model.hidden_size
    return [p for p in (e * logits, *cross_entropy, accumulator, *torchtitan_hidden_chunk_copies_parts(request),
                        *fsdp_head_gathered_parts(request, prefetched=False)) if p > 0]


# ChunkedLossWrapper._chunk_local: ``c.contiguous()`` of each torch.split(hidden, s / n, dim=1)
# piece, detached as the loop's leaves. With b > 1 a piece of dim 1 is not contiguous, so the n
# pieces are copies, b x s x h in all, held through the loop (measured: eight 64 MiB bf16 storages
# alive at the cross-entropy moment of the 8B s16384 b4 step). With b = 1 they are views: the
# term is charged there too, because the plan search needs every loss moment affine in the
# micro-batch (zeroplan.core.search), an over-count of s x h in bf16 on the safe side (32 MiB for
# 8B at s 4096, 256 MiB at s 32768).
def torchtitan_hidden_chunk_copies_bytes(request: PlanRequest) -> int:
    """The chunked loss's copies of the normed hidden states."""
    return request.training.precision.compute_bytes * request.batch.micro_batch_size * request.batch.seq_len \
        * request.model.hidden_size


def torchtitan_hidden_chunk_copies_parts(request: PlanRequest) -> tuple[int, ...]:
    """torchtitan_hidden_chunk_copies_bytes as its n chunk copies."""
    return even_split(torchtitan_hidden_chunk_copies_bytes(request), TORCHTITAN_LOSS_CHUNKS)


def torchtitan_chunked_loss(training: TrainingSpec) -> bool:
    """Whether the loss is torchtitan's ChunkedLossWrapper (framework_logits_pieces' moments are
    then torchtitan_chunked_loss_bytes and torchtitan_chunk_cross_entropy_bytes)."""
    return (training.framework is Framework.torchtitan and not training.unchunked_loss
            and not training.fused_linear_cross_entropy)


# torchtune 0.6.1 modules/transformer.py TransformerDecoder.chunked_output calls self.output once
# per chunk; under FSDP2 (torch 2.13 _fully_shard/_fsdp_state.py) each call is a forward of the
# `output` unit with its own pre-backward, so in backward the unit is all-gathered again for
# every chunk, and its weight gradient is accumulated out of place (aten.add.Tensor, traced
# under fake tensors on the framework's own step): from the second chunk on, the accumulated
# gradient, the chunk's new mm output and their sum (3 unsharded V x h gradients) live beside
# the gathered weight. Each such all-gather also holds, until its copy-out is done, the
# all-gather output beside the unit's unsharded parameters: twice the unit. With the head frozen
# (LoRA) there is no gradient to accumulate and that copy-out is the larger moment (measured:
# torchtune LoRA, whose configs leave the output projection in the root unit with the
# embedding, benchmarks/framework-finetune-step-records: 'unsharded_param' and 'all_gather'
# both the root unit's 2,101,354,496 bytes at the peak, 'temp' the bf16 logit gradients).
def fsdp_chunked_head_bytes(request: PlanRequest) -> int:
    """What the output projection's backward adds to the bf16 logit gradients (0 unless the
    framework chunks its loss and its FSDP2 gathers the head per chunk under full sharding)."""
    return sum(fsdp_chunked_head_parts(request))


def fsdp_chunked_head_parts(request: PlanRequest) -> tuple[int, ...]:
    """The tensors of fsdp_chunked_head_bytes: the head's unit twice (all-gather output and its
    copy-out), or the gathered units and three unsharded head gradients, whichever is larger."""
    if loss_chunks(request.training) == 1:
        return ()
    gathered = fsdp_head_gathered_parts(request)
    if sum(gathered) == 0:
        return ()
    # Under LoRA the head's weight is frozen (an adapter on it has its own small gradient).
    finetune = request.training.finetune
    head_trainable = not finetune.is_lora and not finetune.freeze_embeddings
    head_gradient = request.model.vocab_size * request.model.hidden_size * request.training.precision.compute_bytes
    copy_out = 2 * fsdp_head_gathered_parts(request, prefetched=False)
    accumulating = (*gathered, *((head_gradient,) * 3 if head_trainable else ()))
    return copy_out if sum(copy_out) > sum(accumulating) else accumulating


# torchtune 0.6.1 modules/transformer.py TransformerDecoder.chunked_output runs self.output once
# per chunk, so the output projection's weight (a tied embedding's included) is one leaf with n
# uses. torch 2.13's autograd engine (csrc/autograd/engine.cpp evaluate_function, input_buffer.cpp
# InputBuffer::add) sums each chunk's weight gradient into the AccumulateGrad node's buffer out of
# place (aten.add.Tensor), and releases a node's inputs before routing its outputs: the head's
# backward runs the chunks' matmul backwards after all n cross-entropy backwards (later nodes
# first), each freeing its bf16 logit gradient, and from the second chunk on the running sum, the
# chunk's new mm output and their sum, three V x h gradients in the compute dtype, are alive
# beside the n - 2 chunks' gradients still waiting. Measured on the CPU with torchtune's own
# llama3_2 and CEWithChunkedOutputLoss, tied and untied (tests/test_head_gradients.py):
# at most 3 head-sized gradients and 6 of 8 bf16 logit-chunk gradients at once, at that add.
# Under FSDP2 full sharding fsdp_chunked_head_parts counts the unsharded accumulation instead.
def chunked_head_accumulation_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The moment of the head's weight-gradient accumulation over the loss's chunks (the n - 2
    bf16 logit-chunk gradients left and three head gradients), or none: a frozen head, one chunk,
    fused linear cross-entropy or FSDP2's gathered head (fsdp_chunked_head_parts)."""
    chunks = loss_chunks(request.training)
    finetune = request.training.finetune
    if (chunks < 3 or finetune.is_lora or finetune.freeze_embeddings or request.training.fused_linear_cross_entropy
            or fsdp_chunked_head_parts(request)):
        return ()
    e = request.training.precision.compute_bytes
    sbv = request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    head_gradient = request.model.vocab_size * request.model.hidden_size * e // request.parallel.tp
    return ((*even_split(e * sbv // request.parallel.tp, chunks)[2:], *(head_gradient,) * 3),)


# torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_state.py _pre_backward ->
# _fsdp_param_group.py pre_backward: the first unit to run backward is the one that ran the
# output projection last in forward; reshard_after_forward freed its parameters, so its
# pre-backward hook all-gathers them again (in the compute dtype) while the loss's gradient
# tensors are still alive, and prefetches the next unit in backward order. HF's (accelerate)
# root unit holds the embedding and lm_head, and the next is the last decoder layer; torchtune's
# `output` is a unit of its own, and the next, the root, holds only the final norm. FSDPMemTracker
# at the loss backward of both (benchmarks/framework-step-records): 'unsharded_param' is that
# unit, 'all_gather' the prefetched one.
def fsdp_head_gathered_bytes(request: PlanRequest, *, prefetched: bool = True) -> int:
    """Gathered parameters alive at the loss's backward beside the loss's tensors (0 unless
    the framework's profile says its FSDP2 step does this, under full sharding). Without
    ``prefetched``: the head's unit alone, as during the loss's forward (nothing is prefetched
    after the last block's forward)."""
    return sum(fsdp_head_gathered_parts(request, prefetched=prefetched))


def fsdp_head_gathered_parts(request: PlanRequest, *, prefetched: bool = True) -> tuple[int, ...]:
    """fsdp_head_gathered_bytes unit by unit (each unit's parameters gathered as one)."""
    prof = profile(request.training.framework)
    fsdp1 = fsdp1_root_stays_gathered(request)
    # The profile first: the reference model's micro-batch terms key on no more of the strategy
    # than fsdp1_root_stays_gathered (core.plan.reference_engine).
    if not (prof.fsdp_loss_backward_gathers_head or fsdp1):
        return ()
    if request.strategy.kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp):
        return ()
    from zeroplan.core.layout import element_bytes
    from zeroplan.core.model_states import unit_gather_bytes

    compute_bytes = element_bytes(request.training.precision, request.convention).compute_parameter
    padded = unit_gather_bytes(request, request.shard_group_size, compute_bytes)
    embedding, last_block, head = padded[0], padded[-2], padded[-1]
    if fsdp1:
        # FSDP1's root, never resharded after forward (profiles.fsdp1_root_stays_gathered),
        # is one FlatParameter of the embedding, the final norm and the head; the loss's backward
        # runs before the root's pre-backward hook, so nothing is prefetched yet.
        return (embedding + head,) if embedding + head > 0 else ()
    if fsdp_separates_embedding_and_head(request):
        gathered: tuple[int, ...] = (head,)  # the output unit; the root after it holds only the final norm
    else:
        gathered = (embedding, head, *((last_block,) * request.strategy.prefetch_units if prefetched else ()))
    return tuple(p for p in gathered if p > 0)


LITGPT_LOSS_CHUNK_TOKENS = 128
"""litgpt 0.4.13.dev1 (commit 00af8b0): finetune/lora.py fit calls model(input_ids,
lm_head_chunk_size=128), and utils.chunked_cross_entropy's chunk_size defaults to 128."""


LITGPT_LOGITS_BYTES = FP32_BYTES
"""lightning 2.4 fabric/wrappers.py _FabricModule.forward (lines 140-143) runs the module under the
precision plugin's forward_context and calls its convert_output once that context has restored
the default dtype: HalfPrecision (plugins/precision/half.py lines 61-62, litgpt's bf16-true),
BitsandbytesPrecision (bitsandbytes.py lines 155-156, --quantize bnb.*) and MixedPrecision
(amp.py lines 70-71, bf16-mixed) cast every floating output to torch.get_default_dtype(), fp32
(plugins/precision/utils.py _convert_fp_tensor): litgpt's logits reach its loss in fp32."""


# lit-gpt 8641822 lit_gpt/lora.py:500-502 and litgpt 0.4.13.dev1 litgpt/lora.py:551-553: LoRA's
# fit() runs the head once per 128-token slice. Under lightning's MixedPrecision (bf16-mixed: the
# module stays fp32 and runs under torch.autocast) each slice's F.linear casts the head's fp32
# weight to bf16, and autocast caches a cast only for a leaf that requires grad (torch
# aten/src/ATen/autocast_mode.cpp cached_cast): the frozen head gets a fresh bf16 copy per
# slice, which the matmul saves for its input's gradient until that slice's head backward, after
# every slice's loss backward. Measured on the CPU with lit-gpt 8641822's own GPT under
# torch.autocast(bf16): 3 slices of 300 tokens save 3 distinct 2 V h byte copies of the head.
def litgpt_autocast_head_copies(request: PlanRequest) -> tuple[int, ...]:
    """The bf16 copies of the fp32 frozen head that litgpt's LoRA forward saves under autocast,
    one per 128-token slice (none otherwise: a 16-bit head is used as it is, a 4-bit one is
    dequantized per slice and not saved, litgpt_logits_tensors)."""
    training = request.training
    if not (training.finetune.is_lora and request.runs_under_autocast and not training.finetune.quantize.is_quantized):
        return ()
    # The slices cut the sequence, whatever the micro-batch: the copies do not grow with it.
    slices = len(_chunk_lengths(request.batch.seq_len, LITGPT_LOSS_CHUNK_TOKENS))
    return (BF16_BYTES * request.model.vocab_size * request.model.hidden_size,) * slices


def _chunk_lengths(total: int, size: int) -> list[int]:
    """torch.split(x, size): the lengths of its pieces (the last what is left)."""
    return [min(size, total - start) for start in range(0, total, size)]


# litgpt 0.4.13.dev1 (commit 00af8b0), the loss of its finetune scripts' fit(): the head's
# logits come back from lightning's _FabricModule as fp32 copies (LITGPT_LOGITS_BYTES: the
# compute-dtype originals are alive until the last copy is made), so the cross-entropy, its
# log-softmax and its gradients are fp32; fit()'s local `logits` holds them until the next
# step's model(...) has returned:
# - LoRA (finetune/lora.py lines 304-307; litgpt/lora.py GPT.forward lines 551-553): the head
#   runs on 128-token slices of the sequence, a list of [b, 128, V] chunks (4sbV); the last is
#   sliced [..., :-1, :], which utils.chunked_cross_entropy's reshape copies (one chunk); each
#   chunk's F.cross_entropy saves its log-softmax (4sbV in all). In backward every chunk's
#   nll_loss and log-softmax backward run before any chunk's reshape and head backward (they
#   were recorded later, so autograd's queue takes them first): the saved log-softmax of the
#   chunks not yet reached and the logit gradients of those done add to 4sbV, beside one
#   chunk's two gradients (the nll_loss gradient and the log-softmax one).
# - Full fine-tune (finetune/full.py lines 255-257): the head returns [b, s, V] whole; the
#   sliced logits' reshape copies them (4sbV) and is split into 128-row chunks, whose saved
#   log-softmax adds 4sbV: three 4sbV at the forward's end. In backward the split's gradient
#   concatenates the chunks' gradients (two 4sbV beside the logits) and the slice's gradient
#   is a new [b, s, V] written from it: three 4sbV again.
# - The model's forward end (the first moment): when convert_output has made the last fp32
#   copy, the compute-dtype logits are alive beside their copies, and the previous step's fp32
#   logits beside both (fit() rebinds `logits` only once model(...) has returned), with what
#   that step's graph keeps beyond its backward (bitsandbytes before 0.43.2: every 4-bit
#   matmul's input, zeroplan.core.finetune.activations.previous_step_matmul_inputs_bytes).
def litgpt_logits_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The loss's tensors at the model's forward end, its forward's end and in its backward, as
    litgpt's fit() runs it, one by one (the model's forward end:
    the head's output in the compute dtype, its fp32 copy and the previous step's; LoRA: each
    128-token chunk's logits and saved log-softmax and the last chunk's copy, then one chunk's
    two gradients; full: the logits, their reshaped copy and each 128-row chunk's log-softmax,
    then three [b, s, V] tensors), with the gathered units."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    e = training.precision.compute_bytes
    f = LITGPT_LOGITS_BYTES
    sbv = s * b * model.vocab_size
    gathered = fsdp_head_gathered_parts(request)
    if training.finetune.is_lora:
        rows = b * min(LITGPT_LOSS_CHUNK_TOKENS, s) * model.vocab_size
        chunks = [b * tokens * model.vocab_size for tokens in _chunk_lengths(s, LITGPT_LOSS_CHUNK_TOKENS)]
    else:
        rows = LITGPT_LOSS_CHUNK_TOKENS * model.vocab_size
        chunks = [sbv]
    # convert_output's copy (none where the model computes in fp32 already: .to is a no-op).
    head = (*((e * c for c in chunks) if e != f else ()), *(f * c for c in chunks))
    from zeroplan.core.finetune.activations import previous_step_matmul_inputs_parts

    previous = (*(f * c for c in chunks), *previous_step_matmul_inputs_parts(request))
    copies = litgpt_autocast_head_copies(request)
    model_end = (*head, *previous, *copies, *gathered)
    if training.finetune.is_lora:
        held = (*(f * c for c in chunks), *(f * c for c in chunks), *copies)
        loss = (*held, f * rows, *gathered), (*held, f * rows, f * rows, *gathered)
        if not training.finetune.quantize.is_quantized:
            return model_end, *loss
        # The 4-bit head (finetune.units: litgpt's lm_head) dequantizes its weight for each
        # chunk (litgpt_dequantized_element_bytes: fp16, then its compute-dtype copy): at the
        # last chunk, beside the chunks made before it and the previous step's tensors.
        from zeroplan.core.finetune.activations import litgpt_dequantized_element_bytes

        weight = litgpt_dequantized_element_bytes(request) * model.vocab_size * model.hidden_size
        last_chunk = (*(e * c for c in chunks[:-1]), weight, *previous, *gathered)
        return last_chunk, model_end, *loss
    saved = [f * tokens * model.vocab_size for tokens in _chunk_lengths(s * b, LITGPT_LOSS_CHUNK_TOKENS)]
    return model_end, (f * sbv, f * sbv, *saved, *gathered), (f * sbv, f * sbv, f * sbv, *gathered)


# lightning-thunder 3770bf0 thunder/benchmarks/benchmark_litgpt.py train() (lines 680-700): a
# loop of its own around litgpt's GPT, not litgpt's fit(): ``logits = self.model(input_ids)``,
# then ``torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))`` on the
# logits as the bf16 module returns them (no Fabric output conversion, no chunking), the loop's
# `logits` held through backward. Its loss is zeroplan.core.uncast_loss's: the log-softmax in the
# logits' dtype, then nll_loss_backward's and _log_softmax_backward_data's gradients (under CUDA
# autocast the fp32 copy and gradient), beside the held logits and, under FSDP1, the root unit.
def litgpt_loop_loss_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The loss's tensors at its forward's end and at its backward's first moment, as a loop that
    calls F.cross_entropy on litgpt's returned logits runs it (TrainingSpec.uncast_loss)."""
    from zeroplan.core.uncast_loss import uncast_logits_parts

    logits = request.training.precision.compute_bytes * request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    log_softmax, *gradients = uncast_logits_parts(request)
    gathered = fsdp_head_gathered_parts(request)
    return (logits, log_softmax, *gathered), (logits, log_softmax, *gradients, *gathered)


# transformers 4.31.0-4.48.0 OPTForCausalLM.forward (zeroplan.core.transformers_release
# OPT_OWN_FORWARD_UNTIL) runs the ops Qwen-1's modeling_qwen.py runs: lm_head's output in the
# compute dtype, ``logits[..., :-1, :].contiguous()`` and CrossEntropyLoss with no ``.float()``.
# Under HF's Trainer on an fp32 module in bf16 (hf_under_autocast) the forward and that loss run
# inside accelerate's torch.autocast, so CUDA's autocast keeps the log-softmax in bf16 and
# nll_loss works on an fp32 copy of it (zeroplan.core.own_loss, zeroplan.core.uncast_loss), and
# accelerate copies the returned logits to fp32: own_loss_tensors' moments, not the three
# compute-dtype tensors of a 16-bit module outside autocast (opt_loss_tensors).
def opt_loss_under_autocast(request: PlanRequest) -> bool:
    """Whether OPT's own compute-dtype loss runs under HF's Trainer autocast."""
    return runs_opt_own_forward(request.model, request.training) and hf_under_autocast(request)


def framework_logits_pieces(request: PlanRequest) -> tuple[int, ...]:
    """The loss's bytes at each moment that can be its largest (each affine in the micro-batch)."""
    return tuple(sum(moment) for moment in framework_logits_tensors(request))


def framework_logits_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """framework_logits_pieces' moments as the tensors each is made of, in the order the
    framework allocates them (what the caching-allocator model replays: zeroplan.allocator)."""
    from zeroplan.core.activations import logits_parts

    model, training = request.model, request.training
    if model.is_encoder_decoder:
        # The loss over the target tokens (zeroplan.core.encoder_decoder).
        from zeroplan.core.encoder_decoder import logits_tensors

        return (logits_tensors(request),)
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    chunks = loss_chunks(training)
    if tinyllama.runs_fork(request):
        return tinyllama.logits_tensors(request, fsdp_head_gathered_parts(request))
    if training.framework is Framework.litgpt and training.uncast_loss:
        return litgpt_loop_loss_tensors(request)
    if training.framework is Framework.litgpt:
        return litgpt_logits_tensors(request)
    if training.framework is Framework.megatron_deepspeed:
        from zeroplan.core.megatron_deepspeed import mds_logits_parts

        return (mds_logits_parts(request),)
    if training.framework is Framework.fairseq:
        # fairseq's criterion on torch 1.8 (zeroplan.core.fairseq), beside fairscale's root unit,
        # gathered from the forward on (fsdp1_root_stays_gathered, fsdp_head_gathered_parts).
        from zeroplan.core.fairseq import fairseq_logits_parts

        return ((*fairseq_logits_parts(request), *fsdp_head_gathered_parts(request)),)
    if training.framework is Framework.megatron:
        from zeroplan.core.megatron import megatron_logits_parts

        return (megatron_logits_parts(request),)
    if torchtitan_chunked_loss(training):
        return torchtitan_chunked_loss_parts(request), tuple(torchtitan_chunk_cross_entropy_parts(request))
    if training.fused_linear_cross_entropy:
        return fused_linear_cross_entropy_tensors(request)
    if training.objective is Objective.reward:
        # DeepSpeed-Chat's reward model (zeroplan.core.reward_model): a v_head's b x s scores and
        # its pairwise loss's, no vocabulary's logits.
        return reward_head_tensors(request)
    if runs_dschat_dpo(request):
        # DeepSpeed-Chat's DPO (zeroplan.core.dschat_dpo): compute-dtype log-softmaxes, both
        # models' logits held by the loop (with the activations).
        return dschat_dpo_logits_tensors(request)
    if training.objective is Objective.dpo:
        # torchtune's DPO recipes (zeroplan.core.dpo): unchunked logits, the reference's head
        # moment before torchtune's unchunked cross-entropy's backward moments.
        return dpo_logits_tensors(request, torchtune_unchunked_logits_tensors(request))
    if chunks > 1:
        moments = (compiled_chunked_logits_tensors if compiles_loss(training) else chunked_logits_tensors)(
            model, training, s, b, chunks, fsdp_chunked_head_parts(request))
        return (*moments, *chunked_head_accumulation_tensors(request))
    if training.unchunked_loss and training.framework is Framework.torchtune:
        return torchtune_unchunked_logits_tensors(request)
    if compiles_unchunked_loss(request):
        return (torchtitan_compiled_unchunked_loss_parts(request),)
    if runs_own_loss(model, training) or opt_loss_under_autocast(request):
        # The model's own compute-dtype loss (zeroplan.core.own_loss): under the Trainer's
        # autocast its three moments, under DeepSpeed's engine the module's 16-bit ops alone; its
        # forward moments beside the KV cache, if kept, and the head's unit gathered for the
        # forward; its backward's beside the head's unit gathered again.
        if runs_own_loss(model, training) and not loss_under_trainer_autocast(request):
            one_forward, loss = opt_loss_tensors(model, training, s, b)
            forward = [one_forward]
        else:
            *forward, loss = own_loss_tensors(model, training, s, b)
        ahead = (*kv_cache_tensors(request), *fsdp_head_gathered_parts(request, prefetched=False))
        return (*((*ahead, *moment) for moment in forward), (*loss, *fsdp_head_gathered_parts(request)))
    # The loss's fp32 tensors are alive at the start of its backward, beside the head's unit
    # that FSDP2 gathers then (fsdp_head_gathered_bytes; 0 outside a framework's FSDP2).
    # A release that shifts the logits (before 4.49) runs the loss on b x (s - 1) rows, then the
    # slice's backward makes the b x s-row gradient (zeroplan.core.transformers_release).
    opt = runs_opt_own_forward(model, training)
    loss = opt_loss_tensors(model, training, s, b)[1] if opt else logits_parts(model, shifted_rows(training, s), b)
    backward = (*loss, *fsdp_head_gathered_parts(request))
    cache = kv_cache_tensors(request)
    if not cache and training.transformers_version is None:
        return (backward,)
    gradient_bytes = training.precision.compute_bytes if opt else FP32_BYTES
    slice_backward = slice_backward_tensors(model, training, s, b, gradient_bytes)
    after = ((*slice_backward, *fsdp_head_gathered_parts(request)),) if slice_backward else ()
    # With transformers' KV cache kept (zeroplan.core.kv_cache) the loss's forward, formed inside
    # the model's forward beside the head's gathered unit, is a moment of its own: every layer's
    # K and V are alive until the output object goes. So it is for an older release, whose loss
    # forward holds more than 4.56.2's (zeroplan.core.transformers_release: 4.46-4.48 an fp32 copy
    # of the shifted logits beside the upcast, 16 bytes a logit with bf16 logits, more than the
    # backward's 12).
    return (*cache, *loss_forward_tensors(request), *fsdp_head_gathered_parts(request, prefetched=False)), backward, *after


# torchtune 0.6.1 with a plain torch.nn.CrossEntropyLoss as its recipe's loss (TrainingSpec.
# unchunked_loss): the loss runs outside the model on logits the model upcast whole
# (modules/transformer.py unembed), so its backward (logits_bytes: three fp32 sbV tensors) runs
# before any FSDP2 unit's pre-backward; the output unit is gathered only once the logits' fp32
# gradient reaches the `.float()`, beside it and its bf16 cast (measured: the framework's own
# step, benchmarks/framework-step-records `+unchunked-loss`: FSDPMemTracker's 'unsharded_param'
# 0 at the peak, 'temp' the two fp32 gradients, 'act' the log-softmax).
def torchtune_unchunked_logits_tensors(request: PlanRequest) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensors of (the loss's backward, the start of the output projection's backward): the
    three fp32 tensors; then the fp32
    gradient, its bf16 cast and the output unit (all-gather output and copy-out)."""
    from zeroplan.core.activations import logits_parts

    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    sbv = s * b * model.vocab_size
    head = (FP32_BYTES * sbv, training.precision.compute_bytes * sbv, *(2 * fsdp_head_gathered_parts(request, prefetched=False)))
    return logits_parts(model, s, b), head


# torchtitan's unchunked loss compiled (zeroplan.core.compiled.compiles_unchunked_loss): trainer's
# `del pred` frees nothing, the compiled forward having saved the bf16 logits (with two fp32
# values a row); its backward writes the logits' bf16 gradient while they are saved, the largest
# moment, beside the head's unit FSDP2 holds gathered. No fp32 logit-sized tensor is made outside
# inductor's fused kernels (benchmarks/compiled-loss-records chunks1: 2 bytes a logit saved,
# against eager's 4-byte log-softmax and its two 4-byte gradients).
def torchtitan_compiled_unchunked_loss_parts(request: PlanRequest) -> tuple[int, ...]:
    """The compiled unchunked loss's backward moment, in allocation order: the bf16 logits, the
    row statistics, the bf16 logit gradient, then the gathered units."""
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    logits = request.training.precision.compute_bytes * s * b * request.model.vocab_size
    return (logits, COMPILED_CROSS_ENTROPY_ROW_BYTES * s * b, logits, *fsdp_head_gathered_parts(request))


# liger-kernel 0.6.2 ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward:
# inc_factor = cdiv(V, H), chunk_size = next_power_of_2(cdiv(BT, inc_factor)), so that one
# chunk's logits are about as large as the BT x H input; the last chunk is what is left of BT.
def fused_linear_cross_entropy_chunk_rows(model: ModelSpec, tokens: int) -> int:
    """Rows (tokens) of the largest chunk whose logits liger's fused linear cross-entropy forms."""
    inc_factor = -(-model.vocab_size // model.hidden_size)
    chunk_size = 1 << (-(-tokens // inc_factor) - 1).bit_length()
    return min(chunk_size, tokens)


def _fused_loss_widths(request: PlanRequest) -> tuple[int, int]:
    """(bytes of an element of the head's input and weight, bytes of an element of a matmul
    output): under HF's autocast with fp32 parameters the final norm's output and lm_head's
    weight are fp32 and the matmuls write bf16; on a bf16 module all three are bf16."""
    compute = request.training.precision.compute_bytes
    return (FP32_BYTES if hf_under_autocast(request) else compute), compute


# liger-kernel 0.6.2 ops/fused_linear_cross_entropy.py, as transformers 4.56.2's Trainer applies
# it (model/llama.py lce_forward -> loss_utils.py LigerForCausalLMLoss, accum_dtype None).
# fused_linear_cross_entropy_forward allocates grad_input = zeros_like(_input) (BT x H) and
# grad_weight = zeros_like(weight) (V x H), both in their input's dtype, and loss_1d (BT fp32).
# Per chunk: logits_chunk = _input_chunk @ weight.t() (r x V, in place of its gradient after the
# Triton cross-entropy kernel, which works in registers), then
# grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float(): a V x H matmul output
# and, unless that is already fp32, its fp32 copy, both alive at the add. From the second chunk
# on, the new logits_chunk is formed while the previous one is still bound (grad_logits_chunk).
# ctx.save_for_backward keeps grad_input and grad_weight; backward only scales them in place
# (element_mul_kernel) and hands them to autograd, so the head's input (counted in
# outside_layers_bytes) is no longer alive then. Three moments: the weight-gradient add, the
# second chunk's logits (only with more than one chunk) and the loss's backward; under FSDP2 the
# head's unit is gathered at each (fsdp_head_gathered_bytes: the loss runs inside the root
# unit's forward, and the backward gathers it again with the last block prefetched). Under
# autocast with an fp32 weight (torch 2.13 aten/src/ATen/autocast_mode.cpp cached_cast: casts of
# leaf tensors that require grad are cached until the autocast region exits) a bf16 copy of
# lm_head.weight lives through the forward's chunks. The label tensors (int64 shift_labels and
# its bool mask, 9 bytes a token) are left out, as the unfused loss leaves out its labels.
def fused_linear_cross_entropy_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The tensors of the fused loss's moments (weight-gradient add, next chunk, loss backward):
    grad_input, grad_weight,
    loss_1d, the weight's bf16 cast and the gathered head, with the chunk's logits and the
    weight gradient's matmul output and fp32 copy (or two chunks' logits); at the backward,
    grad_input less the head's input (counted among the activations, gone by then),
    grad_weight and the gathered units."""
    model, training = request.model, request.training
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    vh = model.vocab_size * model.hidden_size
    stored, matmul = _fused_loss_widths(request)
    kept = (stored * tokens * model.hidden_size, stored * vh)
    weight_cast = (matmul * vh,) if matmul != stored else ()
    forward = (*kept, FP32_BYTES * tokens, *weight_cast, *fsdp_head_gathered_parts(request, prefetched=False))
    rows = fused_linear_cross_entropy_chunk_rows(model, tokens)
    chunk_logits = matmul * rows * model.vocab_size
    moments = [(*forward, chunk_logits, matmul * vh, *((FP32_BYTES * vh,) if matmul != FP32_BYTES else ()))]
    if rows < tokens:
        moments.append((*forward, chunk_logits, chunk_logits))
    head_input = training.precision.compute_bytes * tokens * model.hidden_size
    moments.append(tuple(p for p in (kept[0] - head_input, kept[1], *fsdp_head_gathered_parts(request)) if p > 0))
    return tuple(moments)


def loss_parallel_applies(request: PlanRequest) -> bool:
    """Whether the loss runs under torch's loss_parallel(): torchtitan 9dec370 with tensor
    parallelism (parallelisms/parallel_dims.py loss_parallel_enabled: tp > 1 and not
    training.disable_loss_parallel, whose default is off; train.py enters
    utils.get_train_context's loss_parallel() around the forward, the loss and backward, and
    apply_tp keeps the output projection's logits vocab-sharded, Shard(-1))."""
    training = request.training
    return (training.framework is Framework.torchtitan and training.torchtitan_release == "9dec370"
            and request.parallel.tp > 1)


# torch/distributed/tensor/parallel/loss.py (the same in torch 2.6.0 and 2.13): under
# loss_parallel() cross_entropy on the vocab-sharded logits runs DTensor's own handlers on the
# rank's shard. Forward (_log_softmax): the fp32 upcast, `shifted` and exp(shifted) at once beside
# the bf16 logits (3.5 fp32 shards). Backward (_nll_loss_and_log_softmax_backward): beside the
# saved log-softmax x it makes grad_input = zeros_like(x), exp(x) and their sum, then the
# product with grad_output once exp(x) is freed: four fp32 shards at once, one more than torch's
# own cross-entropy backward (logits_parts); _log_softmax_backward_data passes the result on.
# Measured with a dispatch mode that sees DTensor's local operations (torch 2.6.0 and 2.13 alike):
# forward 3.5, backward 4.0 fp32 local-logit tensors.
def loss_parallel_logits_tensors(chunk: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The loss's largest moment under loss_parallel on one rank, as its tensors in allocation
    order; ``chunk`` is the rank's chunk (zeroplan.core.parallel.activations.chunk_request: the
    vocabulary already split tp ways, the rank's tokens): the saved fp32 log-softmax, the zeros
    of grad_input, exp(x), their sum, and the head's unit FSDP2 holds gathered."""
    shard = FP32_BYTES * chunk.batch.seq_len * chunk.batch.micro_batch_size * chunk.model.vocab_size
    return ((shard, shard, shard, shard, *fsdp_head_gathered_parts(chunk)),)
