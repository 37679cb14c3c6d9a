"""Assemble the per-GPU answer for one request, and the fit report over many strategies."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import NamedTuple, TypeVar

from zeroplan.core.activations import activation_bytes, backward_workspace_bytes, layer_bytes, logits_bytes
from zeroplan.core.deepspeed_mha_views import check_torch_multihead_attention, pinned_in_projection_bytes
from zeroplan.core.deepspeed_coordinator import loss_gathered_bytes
from zeroplan.core.deepspeed_torch_linear import pinned_linear_weight_bytes
from zeroplan.core.uncast_loss import check_uncast_loss, uncast_logits_parts
from zeroplan.core.dpo import check_dpo_request
from zeroplan.core.reward_model import check_reward_request
from zeroplan.core.deepspeed_bf16_autocast import activation_extra_bytes as bf16_autocast_activation_bytes, check_bf16_autocast
from zeroplan.core.buffers import (
    backward_end_buffer_bytes, backward_end_gradient_bytes, backward_held_buffer_bytes, block_backward_gradient_bytes,
    block_backward_transient_bytes, block_copy_buffer_bytes, draining_held_buffer_bytes, first_layer_activation_blocks,
    first_layer_buffer_bytes, first_layer_copy_buffer_bytes, first_layer_gather_buffer_bytes, first_layer_gather_flat_bytes,
    first_layer_gradient_bytes, fsdp_no_sync_carried_gradient_bytes,
    optimizer_step_temporary_bytes, resident_buffer_bytes, reference_logits_gradient_bytes, root_gather_buffer_bytes,
    root_gathers_beside_logits_gradient, transient_buffer_bytes,
)
from zeroplan.core.communication import Collective, collectives
from zeroplan.core.compiled import check_compiled
from zeroplan.core import (
    deepspeed_2022, deepspeed_epilogue, deepspeed_fused_fp16, deepspeed_stage0, deepspeed_stage3_step, dschat_dpo,
)
from zeroplan.core.deepspeed_accumulation import accumulated_bytes, runs_deepspeed_engine
from zeroplan.core.encoder_decoder import check_encoder_decoder_request
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.finetune.activations import (
    dequantized_weight_bytes, dora_weight_norm_bytes, frozen_blocks_kept_bytes, lora_layer_delta_bytes,
)
from zeroplan.core.frameworks import (
    autocast_copies_bytes, autocast_head_copy_bytes, framework_activation_bytes, framework_recompute_bytes,
)
from zeroplan.core.framework_loss import framework_logits_pieces, fsdp_head_gathered_bytes
from zeroplan.core.fused_cross_entropy import fused_cross_entropy_bytes
from zeroplan.core.hf_eager_backward import softmax_backward_extra_bytes as hf_eager_softmax_backward_bytes
from zeroplan.core.kv_cache import kept_outputs_bytes
from zeroplan.core.torch_release import check_torch_release, check_torch_release_strategy, zero_grad_zeroes
from zeroplan.core.profiles import (
    check_framework_request, check_framework_strategies, check_fsdp_cpu_offload, framework_strategies,
    fsdp1_root_stays_gathered, fsdp_cpu_offload_strategies,
)
from zeroplan.core.margin import (
    PeakErrorBand, band_capacities_bytes, error_band, is_borderline, margin_words,
)
from zeroplan.core.memo import KeptAnswers, batch_keyed
from zeroplan.core.model_load import load_fits_gpu, load_gpu_bytes, load_host_bytes
from zeroplan.core.nvme import nvme_bytes
from zeroplan.core.model_states import ModelStateBytes, model_state_bytes
from zeroplan.core.bf16_accumulation_time import check_fp32_accumulation
from zeroplan.core.megatron_deepspeed import bf16_optimizer_runs, check_grad_accum_dtype
from zeroplan.core.checkpoint_save import check_fsdp_state_dict, save_peak_bytes, save_units
from zeroplan.core.peak import (
    MomentBytes, PeakTerms, largest_moment, moment_totals, peak_allocated_bytes, peak_moments_and_block_pieces,
    peak_terms_of, with_terms,
)
from zeroplan.core.parallel.pipeline import device_map_gpu_is_empty, in_flight_chunks, request_rank_stages
from zeroplan.core.parallel.activations import (
    host_checkpoint_bytes,
    rank_activation_bytes,
    rank_logits_pieces,
    rank_workspace_bytes,
)
from zeroplan.core.parallel.ring_attention import ring_attention_backward_extra_bytes
from zeroplan.core.parallel.ulysses import ulysses_all_to_all_bytes
from zeroplan.core.params import total_parameters
from zeroplan.core.suggest import smallest_change
from zeroplan.core.timing import StepTime, step_time
from zeroplan.errors import ZeroplanError
from zeroplan.answers import FitReport
from zeroplan.results import MemoryBreakdown, PeakMoment, StrategyPlan
from zeroplan.core.parallel.expert import expert_dispatch_bytes
from zeroplan.specs.parallel import EXPERT_PARALLEL_STRATEGIES, PIPELINE_STRATEGIES
from zeroplan.specs.finetune import Quantization
from zeroplan.specs.base import kept_copy
from zeroplan.specs.request import (
    GPTQ_STRATEGIES, HF_FSDP1_STRATEGIES, INT8_STRATEGIES, PlanRequest, check_compiled_layout, check_compiled_strategy,
    check_optimizer_in_backward,
)
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing, BatchSpec, TrainingSpec

MAX_MICRO_BATCH_SEARCH = 1 << 20
"""The largest micro-batch the search tries."""


def fairseq_softmax_backward_bytes(request: PlanRequest) -> int:
    """The eager softmax's backward under fairseq (zeroplan.core.fairseq); 0 elsewhere."""
    if request.training.framework is not Framework.fairseq:
        return 0
    from zeroplan.core.fairseq import softmax_backward_extra_bytes

    return softmax_backward_extra_bytes(request)


def hf_softmax_backward_bytes(request: PlanRequest) -> int:
    """transformers' eager softmax backward on CUDA (zeroplan.core.hf_eager_backward); 0 elsewhere."""
    return hf_eager_softmax_backward_bytes(request)


def _workspace(request: PlanRequest) -> int:
    return backward_workspace_bytes(request.model, request.training, request.batch.seq_len, request.batch.micro_batch_size)


def reference_activations(request: PlanRequest) -> tuple[int, int]:
    """(kept, recompute) of the reference model under full recomputation: the block rebuilt in
    backward apart (checkpointed_layers_bytes counts it with the rest)."""
    model, training, batch = request.model, request.training, request.batch
    s, b, autocast = batch.seq_len, batch.micro_batch_size, request.runs_under_autocast
    total = activation_bytes(model, training, s, b, autocast=autocast)
    full = training.activation_checkpointing is ActivationCheckpointing.full
    recompute = layer_bytes(model, training, s, b, autocast=autocast) if full else 0
    # LoRA changes what each stored block keeps (only the recomputed one, under full recomputation).
    lora = lora_layer_delta_bytes(request)
    recompute += lora if full else 0
    total += lora if full else model.num_layers * lora
    # Under DDP's autocast each block also keeps bf16 copies of its weights and inputs, and the
    # head its weight's copy (zeroplan.core.frameworks.autocast_copies_bytes).
    copies = autocast_copies_bytes(request)
    recompute += copies if full else 0
    total += (copies if full else model.num_layers * copies) + autocast_head_copy_bytes(request)
    frozen = training.finetune.frozen_blocks
    if frozen:
        # The first K blocks of a partly frozen fine-tune (zeroplan.core.finetune.activations).
        layer = layer_bytes(model, training, s, b, autocast=autocast)
        block_input = training.precision.compute_bytes * s * b * model.hidden_size
        kept, kept_input = frozen_blocks_kept_bytes(request, layer, block_input)
        total -= frozen * ((block_input - kept_input) if full else (layer - kept))
    return total - recompute, recompute


# The loss's tensors, and beside them at its backward FSDP1's root unit, still gathered from the
# forward (profiles.fsdp1_root_stays_gathered; fsdp_head_gathered_bytes, 0 elsewhere).
def reference_logits(request: PlanRequest) -> tuple[int, ...]:
    root = fsdp_head_gathered_bytes(request)
    if request.training.fused_cross_entropy:
        return (fused_cross_entropy_bytes(request) + root,)
    if request.training.uncast_loss:
        # The loop's own loss on the logits as returned (zeroplan.core.uncast_loss).
        return (sum(uncast_logits_parts(request)) + root,)
    return (logits_bytes(request.model, request.training, request.batch.seq_len, request.batch.micro_batch_size) + root,)


def framework_activations(request: PlanRequest) -> tuple[int, int]:
    recompute = framework_recompute_bytes(request)
    return framework_activation_bytes(request) - recompute, recompute


def micro_batch_terms(request: PlanRequest) -> dict[str, object]:
    """The PeakTerms fields that change with the micro-batch: activations, the loss's pieces and
    the workspace (the model states and buffers do not)."""
    if request.parallel.is_trivial and not request.model.is_encoder_decoder:
        return dict(_one_rank_micro_batch_terms(request))
    return dict(_micro_batch_terms(request))


ALLOCATOR_SETTING = ("allocator_conf", "allocator_reserve_fraction", "exact_allocator", "exact_capacity")
"""The MemoryAssumptions fields only the verdict on the terms reads (memory_breakdown: the flat
reserve or the caching-allocator model's replay), not the terms: the caches of the terms leave
them out of their keys (core/memo.py enforces that none is read), so a request and the same
request under the other allocator setting (fit's allocator check, the plan search's answers
under the model) share its model states, buffers and micro-batch terms."""


def reference_engine(request: PlanRequest) -> tuple[tuple[str, object], ...] | None:
    """What the reference model's micro-batch terms read of the strategy: whether it runs under
    autocast (its dtypes) and whether FSDP1's root stays gathered at the loss (no: with it they
    read the strategy's units, so the whole strategy keys them); None for a framework's own
    terms, which read the strategy whole (its FSDP units, the head gathered at the loss)."""
    training, strategy = request.training, request.strategy
    if type(training) is not TrainingSpec or type(strategy) is not StrategySpec:
        return _reference_engine(request)  # a cache's view of either
    # Every micro-batch terms cache asks, hit or miss: kept per (training, strategy), all that
    # fsdp1_root_stays_gathered and PlanRequest.runs_under_autocast read of a request.
    key = (training, strategy)
    answer = _REFERENCE_ENGINES.entries.get(key, _NOT_KEPT)
    if answer is _NOT_KEPT:
        answer = _reference_engine(request)
        _REFERENCE_ENGINES.put(key, answer)
    return answer


def _reference_engine(request: PlanRequest) -> tuple[tuple[str, object], ...] | None:
    if request.training.framework is not Framework.zeroplan or fsdp1_root_stays_gathered(request):
        return None
    return (("runs_under_autocast", request.runs_under_autocast), ("root_stays_gathered", False))


_REFERENCE_ENGINES = KeptAnswers()
"""reference_engine's answers by (training, strategy)."""
_NOT_KEPT = object()


# The largest micro-batch search asks for the terms at micro-batches 1 and 2 of every request it
# is given, fit() for those of each strategy again and the plan search at each point it fits:
# the same requests, so the last answers are kept (every field of the request but the allocator
# setting keys them; of the reference model's strategy only what reference_engine names, so
# fit's strategies share them, and a read of anything else of it is answered uncached).
@batch_keyed(whole_batch=True, assumptions_but=ALLOCATOR_SETTING, strategy_view=reference_engine)
def _micro_batch_terms(request: PlanRequest) -> tuple[tuple[str, object], ...]:
    return _uncached_micro_batch_terms(request)


SEQUENCE_FIELDS = tuple(name for name in BatchSpec.model_fields if name != "grad_accum_steps")
"""The batch's fields but the accumulation: what a micro-batch's sequences are."""


# Without tensor, context or pipeline parallelism a rank computes and keeps one micro-batch of
# the whole model: its terms are those of the micro-batch's sequences
# (zeroplan.core.parallel.activations._of_sequences), read of the batch without the accumulation,
# so one cache keyed on the sequences serves every accumulation count (a read of it is answered
# uncached) and the terms within need no cache of their own.
@batch_keyed(*SEQUENCE_FIELDS, assumptions_but=ALLOCATOR_SETTING, strategy_view=reference_engine)
def _one_rank_micro_batch_terms(request: PlanRequest) -> tuple[tuple[str, object], ...]:
    """_micro_batch_terms of a request without model parallelism."""
    return _uncached_micro_batch_terms(request)


def _uncached_micro_batch_terms(request: PlanRequest) -> tuple[tuple[str, object], ...]:
    training = request.training
    if request.model.is_encoder_decoder:
        # An encoder and a decoder stack at their own lengths (zeroplan.core.encoder_decoder).
        from zeroplan.core.encoder_decoder import micro_batch_terms as encoder_decoder_terms

        return encoder_decoder_terms(request)
    # Each term below is the planner's own for one micro-batch through the whole model; with
    # tensor, context or pipeline parallelism zeroplan.core.parallel.activations applies it to
    # what this rank computes and keeps in flight.
    # DoRA's weight-norm temporaries arise in a block's forward and in a recomputing backward's
    # rerun; the block-backward moment, which holds every block's activations, bounds both.
    # A block's backward under torch's ring attention also holds the ring's buffers, and under
    # DeepSpeed-Ulysses the largest all-to-all's.
    workspace = (rank_workspace_bytes(request, _workspace) + expert_dispatch_bytes(request) + dequantized_weight_bytes(request)
                 + dora_weight_norm_bytes(request) + ring_attention_backward_extra_bytes(request)
                 + ulysses_all_to_all_bytes(request)
                 + fairseq_softmax_backward_bytes(request) + hf_softmax_backward_bytes(request))
    logits_pieces: tuple[int, ...] = ()
    # One rank's logits without model parallelism are the request's own (rank_logits_pieces),
    # asked directly; its activations pass rank_activation_bytes, which places the checkpointed
    # block inputs DeepSpeed's checkpointing moves (zeroplan.core.deepspeed_checkpointing).
    one_rank = request.parallel.is_trivial
    if training.framework is Framework.zeroplan:
        # The reference model's recomputed block stays with its activations at every moment.
        activations = sum(rank_activation_bytes(request, reference_activations))
        # Saved for backward block by block, as activations are: under DeepSpeed's ZeRO-3 each
        # block's released in-projection (zeroplan.core.deepspeed_mha_views), or under torch's own
        # F.linear every released linear weight (zeroplan.core.deepspeed_torch_linear).
        activations += pinned_in_projection_bytes(request) + pinned_linear_weight_bytes(request)
        # CUDA autocast's fp32 softmax and layer_norm over DeepSpeed's bf16 module
        # (zeroplan.core.deepspeed_bf16_autocast).
        activations += bf16_autocast_activation_bytes(request)
        # A loop that binds the logits before the loss holds them through backward (zeroplan.core.kv_cache).
        activations += kept_outputs_bytes(request)
        logits = max(reference_logits(request) if one_rank else rank_logits_pieces(request, reference_logits))
    else:
        # The block a recomputing backward rebuilds is alive only in a block's backward: it
        # joins that moment's workspace, not the loss's moment (framework_recompute_bytes).
        activations, recompute = rank_activation_bytes(request, framework_activations)
        # An hf model loaded outside zero.Init under DeepSpeed 0.13.3 trains on torch's F.linear,
        # which keeps each released linear weight to its backward (zeroplan.core.deepspeed_torch_linear).
        activations += pinned_linear_weight_bytes(request)
        # A loop that holds the model's output object keeps it through backward (zeroplan.core.kv_cache).
        activations += kept_outputs_bytes(request)
        logits_pieces = framework_logits_pieces(request) if one_rank else rank_logits_pieces(request, framework_logits_pieces)
        logits = max(logits_pieces)
        workspace += recompute
    if device_map_gpu_is_empty(request):
        # No block runs on a GPU the device map leaves empty: no block backward's workspace, no
        # rebuilt block, no dequantized or normed weight (its activations and logits are none).
        workspace = 0
    return (("activations", activations), ("logits", logits), ("workspace", workspace), ("logits_pieces", logits_pieces),
            ("logits_gradient", reference_logits_gradient_bytes(request)))


def _accumulated_gradient_bytes(request: PlanRequest) -> int | None:
    """PeakTerms.accumulated_gradients: DeepSpeed's micro-step buffers, or nothing beyond the held
    unsharded gradients under FSDP's no_sync accumulation; None where the model states' gradients
    are carried."""
    carried = deepspeed_accumulated_gradient_bytes(request)
    return fsdp_no_sync_carried_gradient_bytes(request) if carried is None else carried


def _step_gradient_bytes(request: PlanRequest) -> int | None:
    """PeakTerms.step_gradients: DeepSpeed stage 0's 16-bit gradients beside the fp32 copies its
    step reads, ZeRO-3's sub-group at a time; None (the model states' gradients) elsewhere."""
    if deepspeed_stage0.runs_deepspeed_stage0(request):
        return deepspeed_stage0.step_gradient_bytes(request)
    return deepspeed_stage3_step.step_gradient_bytes(request)


def deepspeed_accumulated_gradient_bytes(request: PlanRequest) -> int | None:
    """What DeepSpeed's ZeRO-1/2/3 keep between micro-steps beyond their resident buffers, run
    by its engine (runs_deepspeed_engine) without offload or a step in backward, and its stage 0
    (every gradient in the model dtype, nothing resident); None elsewhere (the peak then carries
    the model states' gradients)."""
    kind = request.strategy.kind
    if deepspeed_stage0.runs_deepspeed_stage0(request):
        return deepspeed_stage0.between_micro_steps_bytes(request)
    if (not runs_deepspeed_engine(request) or kind.zero_stage not in (1, 2, 3)
            or kind.offloads_optimizer or kind.offloads_parameters or request.training.optimizer_in_backward):
        return None
    if bf16_optimizer_runs(request):
        # BF16_Optimizer accumulates into its own kept buffers (the model states' gradients).
        return None
    if deepspeed_2022.models_2022(request):
        # No ipg bucket in 2022's stage 1: the micro-steps carry only the 16-bit gradients.
        return deepspeed_epilogue.stage1_gradient_bytes(request)
    return accumulated_bytes(request)


def peak_terms(request: PlanRequest) -> tuple[ModelStateBytes, PeakTerms]:
    """The model states and the byte terms the peak moments combine, for one request."""
    training = request.training
    check_encoder_decoder_request(request)
    # A pure check of the training and the model: each pair refused again every time, passed
    # once (the plan search asks of a few pairs hundreds of times).
    if (training, request.model) not in _FRAMEWORK_CHECKED.entries:
        check_framework_request(training, request.model)
        _FRAMEWORK_CHECKED.put((training, request.model), True)
    check_grad_accum_dtype(request)
    check_fp32_accumulation(request)
    check_compiled(training, request.model, request.cluster.gpu)
    # Requests varied by model_copy (the search's policies) skip the request's own validators.
    check_compiled_layout(training, request.parallel)
    check_compiled_strategy(training, request.strategy.kind)
    check_torch_multihead_attention(request)
    check_bf16_autocast(request)
    check_uncast_loss(request)
    check_dpo_request(request)
    check_reward_request(request)
    deepspeed_stage0.check_deepspeed_stage0(request)
    deepspeed_fused_fp16.check_fused_fp16_optimizer(request)
    if training.finetune.frozen_blocks and training.activation_checkpointing not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        raise ZeroplanError("finetune.frozen_blocks", f"is modelled with activation checkpointing none or full, not "
                            f"{training.activation_checkpointing.value!r}")
    if training.finetune.frozen_blocks and training.activation_offloading:
        raise ZeroplanError("finetune.frozen_blocks", "is not modelled with activation offloading (allowed without it)")
    states, state_terms = _state_terms(request)
    return states, peak_terms_of(micro_batch_terms(request), dict(state_terms))


_FRAMEWORK_CHECKED = KeptAnswers()
"""The (training, model) pairs check_framework_request passed (peak_terms)."""


# The model states and buffers do not change with the micro-batch or the sequence (the plan
# search's _terms shares them across both; its check against memory_breakdown confirms it), so
# the requests of one strategy at different micro-batches share one answer.
@batch_keyed("grad_accum_steps", training_but=("activation_checkpointing",), assumptions_but=ALLOCATOR_SETTING)
def _state_terms(request: PlanRequest) -> tuple[ModelStateBytes, tuple[tuple[str, int | None], ...]]:
    """The model states and the PeakTerms fields that are not micro_batch_terms'."""
    states, kept_whatever_the_accumulation = _accumulation_free_state_terms(request)
    # What earlier micro-batches leave for the next (gradients carried, what backward holds for
    # them and drains at the step's end), and the first layer's backward where a pipeline rank's
    # stages decide it: the terms that read the accumulation.
    return states, (
        *kept_whatever_the_accumulation,
        ("backward_held_buffers", backward_held_buffer_bytes(request)),
        ("accumulated_gradients", _accumulated_gradient_bytes(request)),
        ("backward_end_buffers", backward_end_buffer_bytes(request)),
        ("backward_end_gradients", backward_end_gradient_bytes(request)),
        ("draining_held_buffers", draining_held_buffer_bytes(request)),
        # A gradient buffer kept across steps (megatron-core's) or zeroed in place is counted
        # whole at every moment already (peak.peak_moments).
        ("first_layer_gradients", 0 if states.gradients_resident or states.gradients_kept
         else first_layer_gradient_bytes(request, states.gradient_bytes)),
        ("first_layer_gather_gradients", 0 if states.gradients_resident or states.gradients_kept
         else first_layer_gradient_bytes(request, states.gradient_bytes, before_block=1)),
        ("first_layer_gather_buffers", first_layer_gather_buffer_bytes(request)),
        ("first_layer_gather_flat_buffers", first_layer_gather_flat_bytes(request)),
        ("activation_blocks", first_layer_activation_blocks(request)),
        ("first_layer_buffers", first_layer_buffer_bytes(request)),
        ("first_layer_copy_buffers", first_layer_copy_buffer_bytes(request)),
    )


# The model states and the buffers that no micro-batch leaves to the next do not read the
# accumulation either: kept per request without it (the batch whole left out), so the requests of
# one strategy at different accumulations share them (the plan search asks each of its groups at
# 1, 2 and 3 micro-batches and every configuration it shows at its own; where one of them does
# read it, the memo answers on the whole request).
@batch_keyed(training_but=("activation_checkpointing",), assumptions_but=ALLOCATOR_SETTING)
def _accumulation_free_state_terms(request: PlanRequest) -> tuple[ModelStateBytes, tuple[tuple[str, int | None], ...]]:
    """_state_terms' model states and its fields that do not read the accumulation."""
    states = model_state_bytes(request)
    return states, (
        ("resident_buffers", resident_buffer_bytes(request)),
        ("transient_buffers", transient_buffer_bytes(request)),
        ("block_transient_buffers", block_backward_transient_bytes(request)),
        ("block_copy_buffers", block_copy_buffer_bytes(request)),
        ("root_gather_buffers", root_gather_buffer_bytes(request)),
        ("root_gather_after_loss", root_gathers_beside_logits_gradient(request)),
        # DeepSpeed-Chat's DPO loop holds both models' outputs through the step too (zeroplan.core.dschat_dpo).
        ("step_temporary", optimizer_step_temporary_bytes(request, states.optimizer_elements)
         + dschat_dpo.held_through_step_bytes(request)),
        ("step_gradients", _step_gradient_bytes(request)),
        ("block_backward_gradients", block_backward_gradient_bytes(request)),
        # What DeepSpeed's ZeRO-3 keeps gathered from the forward into the loss's backward.
        ("loss_held_buffers", loss_gathered_bytes(request)),
        # A checkpoint save after the step, where one is planned (hf under FSDP1).
        ("checkpoint_save", save_peak_bytes(save_units(request))),
    )


def replayed(states: ModelStateBytes, terms: PeakTerms) -> tuple[ModelStateBytes, PeakTerms]:
    """The states and terms the caching-allocator model replays. Its step allocates gradients
    at the end of backward (or from the start when accumulating); a gradient buffer allocated
    once before the first step and kept (megatron-core's, ModelStateBytes.gradients_resident) is
    replayed as what it is to the allocator, a resident buffer."""
    if not states.gradients_resident:
        return states, terms
    return (states.model_copy(update={"gradient_bytes": 0}),
            replace(terms, resident_buffers=terms.resident_buffers + states.gradient_bytes))


def checked_peak_terms(request: PlanRequest) -> tuple[ModelStateBytes, PeakTerms]:
    """peak_terms, after the refusals a whole breakdown makes first. The last few answers are
    kept (specs and terms are immutable): plan() asks for a request's terms twice, for its
    breakdown and for its largest micro-batch."""
    return _recent_peak_terms(request)


@batch_keyed(whole_batch=True, limit=4096, assumptions_but=ALLOCATOR_SETTING)
def _recent_peak_terms(request: PlanRequest) -> tuple[ModelStateBytes, PeakTerms]:
    check_optimizer_in_backward(request.training, request.batch.grad_accum_steps)
    check_fsdp_cpu_offload(request.training, request.strategy.kind)
    check_fsdp_state_dict(request)
    check_torch_release_strategy(request.training, request.strategy.kind)
    return peak_terms(request)


@functools.cache
def _allocator_planner():  # type: ignore[no-untyped-def]
    """zeroplan.allocator.planner, imported when first asked for (a flat-reserve answer never
    needs it) and kept: a from-import inside a function costs ~2.5 us each time it runs
    (timeit, Python 3.11; a cached call ~0.1), and fit ran ~21 of them a request, one in every
    breakdown and band. Its functions are read off the module at each call, as the import
    statement read them, so one wrapped there is the one called."""
    from zeroplan.allocator import planner

    return planner


def memory_breakdown(request: PlanRequest, usable_bytes: int | None = None) -> tuple[MemoryBreakdown, ModelStateBytes]:
    """The request's memory at its peak; ``usable_bytes``: its usable_memory_bytes where the
    caller has it (rank_memories), else found here where needed."""
    batch = request.batch
    states, terms = checked_peak_terms(request)
    activations, logits, workspace, step_temporary = terms.activations, terms.logits, terms.workspace, terms.step_temporary
    alive, blocks = peak_moments_and_block_pieces(states, terms, batch.grad_accum_steps)
    # The table's buffers column: every buffer at once (the most ever allocated for them), at
    # least what any piece of a block's backward holds (FSDP's root, two blocks and an input).
    # Lists unpacked, not generators: half the time (~0.4 us of a breakdown, fit ~16 a request).
    temporary = max(terms.resident_buffers + terms.backward_held_buffers + terms.transient_buffers + workspace,
                    *[piece.buffers for piece in blocks], *[moment_bytes.buffers for moment_bytes in alive.values()])
    # The moments once: the peak is their largest (peak_allocated_bytes).
    allocated, moment = largest_moment(alive)
    reserve = int(allocated * request.assumptions.allocator_reserve_fraction)
    reserved = oom_at = None
    if request.assumptions.allocator_conf is not None:
        # The caching-allocator model replays the step on the usable memory (docs/memory-model.md,
        # "The caching allocator"): the peak is what it reserves there, or, where it runs out,
        # what it reserves without a limit; where the allocated peak alone passes the usable
        # memory nothing is replayed and the peak is the allocated peak, the least it needs.
        usable = usable_memory_bytes(request) if usable_bytes is None else usable_bytes
        verdict = _allocator_planner().allocator_verdict(request, *replayed(states, terms), allocated, usable)
        reserved, oom_at = verdict.reserved_peak_bytes, verdict.oom_capacity_bytes
        reserve = 0 if reserved is None else max(reserved - allocated, 0)
    varying = split_segment = 0
    if request.batch.varying_lengths is not None and (reserved is not None or request.assumptions.allocator_conf is None):
        # What an epoch's shorter record batches leave cached (zeroplan.allocator.varying_lengths).
        from zeroplan.allocator.lazy_states import lazy_state_segment_bytes
        from zeroplan.allocator.varying_lengths import varying_length_reserve_bytes

        one_step = allocated + reserve if reserved is None else reserved
        usable = usable_memory_bytes(request) if usable_bytes is None else usable_bytes
        varying = varying_length_reserve_bytes(request, terms, one_step, usable, lambda other: peak_terms(other)[1])
        reserve += varying
        reserved = None if reserved is None else reserved + varying
        if allocated + reserve <= usable:
            # A fit the loop's gradients and states, made inside the epoch, may turn
            # (zeroplan.allocator.lazy_states).
            split_segment = lazy_state_segment_bytes(request, states, terms, one_step, usable)
    peak_gradients, peak_activations = _alive_at_peak(states, terms, moment, alive[moment])
    breakdown = MemoryBreakdown.trusted(
        parameter_bytes=states.parameter_bytes,
        gradient_bytes=states.gradient_bytes,
        optimizer_state_bytes=states.optimizer_state_bytes,
        paged_optimizer_bytes=states.paged_optimizer_bytes,
        activation_bytes=activations,
        logits_bytes=logits,
        temporary_bytes=temporary,
        step_temporary_bytes=step_temporary,
        peak_moment=moment,
        gradients_at_peak=alive[moment].gradients > 0,
        peak_buffer_bytes=alive[moment].buffers,
        peak_gradient_bytes=peak_gradients,
        peak_activation_bytes=peak_activations,
        allocated_peak_bytes=allocated,
        allocator_reserve_bytes=reserve,
        peak_bytes=allocated + reserve,
        allocator_modelled=request.assumptions.allocator_conf is not None,
        reserved_peak_bytes=reserved,
        oom_capacity_bytes=oom_at,
        varying_length_reserve_bytes=varying,
        lazy_state_segment_bytes=split_segment,
    )
    return breakdown, states


# peak.peak_moments: a moment's ``other`` bytes are the resident model states, the activations
# alive then and the loss's terms (at the loss's backward) or the step's temporaries (at the step).
def _alive_at_peak(states: ModelStateBytes, terms: PeakTerms, moment: PeakMoment,
                   alive: MomentBytes) -> tuple[int | None, int | None]:
    """MemoryBreakdown.peak_gradient_bytes and peak_activation_bytes: the gradients and the
    activations alive at the peak moment, None where the plain fields say so already."""
    gradients = None if alive.gradients in (0, states.gradient_bytes) else alive.gradients
    activations = alive.other - states.parameter_bytes - states.optimizer_state_bytes
    if moment is PeakMoment.loss_backward:
        activations -= terms.logits
    if moment is PeakMoment.optimizer_step:
        activations -= terms.step_temporary
    plain = terms.activations if moment in (PeakMoment.loss_backward, PeakMoment.block_backward) else 0
    return gradients, None if activations == plain else activations


def host_memory_fits(request: PlanRequest, host_bytes_per_rank: int) -> bool | None:
    """Whether the offloaded bytes of a node's ranks fit its host RAM, or what each holds at
    load where that is more (zeroplan.core.model_load), and, under the NVMe strategies, their
    swap files the node's NVMe capacity; None when neither is given."""
    limit = request.cluster.host_memory_bytes_per_node
    host_bytes_per_rank = max(host_bytes_per_rank, load_host_bytes(request))
    host = None if limit is None else host_bytes_per_rank * request.cluster.gpus_per_node <= limit
    nvme = nvme_capacity_fits(request)
    if host is None or nvme is None:
        return host if nvme is None else nvme
    return host and nvme


def nvme_capacity_fits(request: PlanRequest) -> bool | None:
    """Whether a node's ranks' NVMe swap files fit --nvme-capacity-gb; None when not given or
    the strategy keeps nothing on NVMe."""
    limit = request.cluster.nvme_capacity_bytes_per_node
    if limit is None or not request.strategy.kind.optimizer_on_nvme:
        return None
    return nvme_bytes(request) * request.cluster.gpus_per_node <= limit


def pipeline_rank_breakdowns(request: PlanRequest) -> list[tuple[MemoryBreakdown, ModelStateBytes]]:
    """Every pipeline rank's breakdown and model states, rank 0 first (the request's own rank
    alone without a pipeline)."""
    return [memory_breakdown(rank) for rank in pipeline_rank_requests(request)]


def pipeline_rank_requests(request: PlanRequest) -> list[PlanRequest]:
    """The request at every pipeline rank, rank 0 first (the request itself without a pipeline)."""
    if request.parallel.pp == 1:
        return [request]
    return [request.at_pipeline_rank(rank) for rank in range(request.parallel.pp)]


# Each pipeline rank has its own usable memory: the NCCL communicators it opens hold device
# memory outside the allocator, and a middle stage opens one per neighbour, a first or last stage
# one where the schedule does not wrap its chunks round, the tied embedding's ranks one more
# (zeroplan.core.communicators). Llama-2-13B under torchtitan on 8 H200s (pp 4, cp 2) leaves
# ranks 0 and 3 138.77 GiB and ranks 1 and 2 138.48: a rank's peak judged against another's
# usable memory turns a verdict either way.
def nearest_rank(peaks_bytes: list[int], usables_bytes: list[int]) -> int:
    """The pipeline rank nearest to running out, each against its own usable memory: the least
    headroom, the first on a tie (the highest peak where every rank's usable memory is the same);
    the plan reports it, and the step fits where it does."""
    return min(range(len(peaks_bytes)), key=lambda rank: usables_bytes[rank] - peaks_bytes[rank])


class RankMemory(NamedTuple):
    """One pipeline rank's request, breakdown and model states, and its own usable memory."""

    request: PlanRequest
    breakdown: MemoryBreakdown
    states: ModelStateBytes
    usable_bytes: int


def rank_memories(request: PlanRequest) -> list[RankMemory]:
    """Every pipeline rank's RankMemory, rank 0 first (the request's own alone without a pipeline)."""
    return [_rank_memory(rank, usable_memory_bytes(rank)) for rank in pipeline_rank_requests(request)]


def _rank_memory(rank: PlanRequest, usable_bytes: int) -> RankMemory:
    """The rank's RankMemory, its usable memory found once (usable_memory_bytes reads the
    rank's communicators: a pure function of the request, which refuses nothing)."""
    return RankMemory(rank, *memory_breakdown(rank, usable_bytes), usable_bytes)


def nearest_rank_memory(ranks: list[RankMemory]) -> RankMemory:
    """The rank of ``ranks`` nearest to running out (nearest_rank)."""
    return ranks[nearest_rank([r.breakdown.peak_bytes for r in ranks], [r.usable_bytes for r in ranks])]


def step_fits(request: PlanRequest) -> bool:
    """Whether the request's step fits its GPU (every pipeline rank, each on its own usable
    memory), as plan(...).fits says, without the rest of the plan: under the allocator model one
    or two replays per rank, no bisection for the OOM capacity."""
    if not load_fits_gpu(request, usable_memory_bytes(request)):
        return False
    if request.assumptions.allocator_conf is not None:
        return _fits_under_allocator(request)
    return all(memory_breakdown(rank)[0].peak_bytes <= usable_memory_bytes(rank)
               for rank in pipeline_rank_requests(request))


def step_fits_unrefused(request: PlanRequest) -> bool:
    """Whether every pipeline rank's step completes under the allocator model without the
    allocator ever being refused device memory (allocator_fits_unrefused); under the flat
    reserve, step_fits."""
    if request.assumptions.allocator_conf is None:
        return step_fits(request)
    if not load_fits_gpu(request, usable_memory_bytes(request)):
        return False
    return _every_rank_replay_fits(request, _allocator_planner().allocator_fits_unrefused)


def _fits_under_allocator(request: PlanRequest) -> bool:
    """Every pipeline rank's step completing on the usable memory under the allocator model:
    what the breakdown's verdict says, without bisecting for the capacity itself."""
    return _every_rank_replay_fits(request, _allocator_planner().allocator_fits)


def _every_rank_replay_fits(request: PlanRequest, fits) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``fits`` (an allocator predicate of a rank's replayed step, its allocated peak and
    the usable memory) holds for every pipeline rank, each on its own usable memory."""
    for rank in pipeline_rank_requests(request):
        states, terms = checked_peak_terms(rank)
        allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
        if not fits(rank, *replayed(states, terms), allocated, usable_memory_bytes(rank)):
            return False
    return True


def peak_rank_reason(request: PlanRequest) -> str:
    """What the request's pipeline rank holds, for a person: its stages, blocks, embedding or
    head, and the micro-batches it keeps in flight."""
    parallel = request.parallel
    rank = parallel.pipeline_rank
    stages = request_rank_stages(request, rank)
    blocks = ", ".join(f"{s.first_block}-{s.first_block + s.num_blocks - 1}" if s.num_blocks else "none" for s in stages)
    extra = "".join([" + embedding" if any(s.has_embedding for s in stages) else "",
                     " + head" if any(s.has_head for s in stages) else ""])
    if parallel.device_map is not None:
        return (f"GPU {rank} of {parallel.pp} under device_map {parallel.device_map.value!r} (blocks {blocks}{extra}), "
                f"one micro-batch in flight")
    chunks = in_flight_chunks(parallel, rank, request.batch.grad_accum_steps)
    return (f"pipeline rank {rank} of {parallel.pp}: stage{'s' if len(stages) > 1 else ''} "
            f"{', '.join(str(s.index) for s in stages)} (blocks {blocks}{extra}), {chunks} micro-batch chunk(s) "
            f"in flight under {parallel.pp_schedule.value}")


def max_micro_batch_size(request: PlanRequest) -> int:
    """Largest micro-batch that fits, it and every smaller one; 0 if none. Under the flat
    reserve the peak grows monotonically with the micro-batch: solved from the moments at
    micro-batches 1 and 2 where each is affine in it (a dense model on one pipeline rank),
    searched by bisection otherwise. Under the allocator model that answer bounds this one from
    above (no step completes where its allocated peak passes the usable memory), and replays
    decide below it (_completing_prefix): a replay need not complete at every micro-batch below
    one that completes."""
    # Every step of the search sets its own micro-batch: the answer is the same whatever the
    # request's, so requests that differ only there (a sweep over micro-batches) share it, kept
    # by every field of the request but the micro-batch (the request at micro-batch 1, without
    # building it: a copy of the batch and of the request cost a kept answer's lookup five times over).
    key = (_FIELDS_BUT_BATCH(request), _BATCH_BUT_MICRO_BATCH(request.batch))
    answer = _MAX_MICRO_BATCHES.entries.get(key)
    if answer is None:
        answer = _max_micro_batch_size(request.with_micro_batch(1))
        _MAX_MICRO_BATCHES.put(key, answer)
    # Under DPO or a reward model a micro-batch is rows of chosen and rejected pairs
    # (TrainingSpec.objective): an even count, and every smaller one fits too.
    return answer - answer % 2 if request.training.objective.pairwise else answer


_FIELDS_BUT_BATCH = operator.attrgetter(*(name for name in PlanRequest.model_fields if name != "batch"))
_BATCH_BUT_MICRO_BATCH = operator.attrgetter(*(name for name in BatchSpec.model_fields if name != "micro_batch_size"))
_MAX_MICRO_BATCHES = KeptAnswers()
"""max_micro_batch_size's answers by the request's fields but the micro-batch."""


def _max_micro_batch_size(request: PlanRequest) -> int:
    """max_micro_batch_size of a request at micro-batch 1."""
    if not load_fits_gpu(request, usable_memory_bytes(request)):
        return 0  # no micro-batch runs where the load already runs out (zeroplan.core.model_load)
    bound = None
    if request.parallel.pp == 1 and not request.model.is_moe:
        bound = _max_micro_batch_affine(request)
        if bound is not None and request.assumptions.allocator_conf is None:
            return bound
    if bound is None:
        bound = bisect_max_micro_batch_size(request)
        if request.assumptions.allocator_conf is None:
            return bound
    return _completing_prefix(request, bound)


# Under the allocator model a step that needs more than the GPU holds completes only where
# freeing the cache and retrying packs it tightly enough, and when in the step that first happens
# moves with the micro-batch: tinyllama-1.1b under litgpt on 16 RTX 4090s (fsdp-full-shard,
# s 2048, full checkpointing) runs out at micro-batches 20 to 23 and completes at 24; Llama-2-7B
# QLoRA under FSDP1 on 8 MI300X (s 512, full checkpointing) completes to 428, runs out at 429 to
# 487 and completes at 488. A user reading max-mb takes every smaller micro-batch to run too, so
# the answer is the largest micro-batch below which none runs out. Replaying every micro-batch
# would cost one replay each (hundreds for a small model); instead the largest micro-batch whose
# step the allocator is never refused memory in (step_fits_unrefused: what it reserves without a
# limit within the usable memory) is found from the reserved peaks at micro-batch 1 and at the
# bound, taken as linear in the micro-batch, by galloping and bisection, each micro-batch above
# it is replayed, and the micro-batches below it are walked down (_verified_below).
def _completing_prefix(request: PlanRequest, bound: int) -> int:
    """The largest micro-batch b up to ``bound`` (above which none completes) such that the
    step completes under the allocator model at b and at every micro-batch below it (below the
    walk of _verified_below, as taken there)."""
    if bound == 0:
        return 0
    if step_fits_unrefused(request.with_micro_batch(bound)):
        return _verified_below(request, bound, bound)
    low = _largest_fitting_between(request, *_unrefused_bracket(request, bound), step_fits_unrefused)
    largest = low
    while (following := _next_run_micro_batch(request, largest)) <= bound \
            and step_fits(request.with_micro_batch(following)):
        largest = following
    return _verified_below(request, low, largest) if low else largest


# Under DPO or a reward model a micro-batch counts chosen and rejected rows (TrainingSpec.objective,
# check_dpo_request, check_reward_request): an odd count never runs, so its replay neither stops
# the walk up nor lowers the answer below.
def _runs(request: PlanRequest, micro_batch: int) -> bool:
    """Whether a step of ``micro_batch`` rows can run at all (every count; pairwise, even ones)."""
    return not request.training.objective.pairwise or micro_batch % 2 == 0


def _next_run_micro_batch(request: PlanRequest, micro_batch: int) -> int:
    """The next micro-batch above ``micro_batch`` that can run (_runs)."""
    following = micro_batch + 1
    return following if _runs(request, following) else following + 1


SEGMENT_MARGIN_WALK = 16
"""Micro-batches below the top over which _verified_below also asks for one segment of the step's
largest request as margin; below them only the rise seen. A cost bound, not a rule of the
allocator: where max-mb is in the hundreds or thousands (a small model on a large GPU) that
margin is many micro-batches wide, and walking it one replay at a time made a fit of the
harness's tiny-llama take 33 s. The dip the margin is for (verdict invariants seed 470) lay 2 to
5 micro-batches below the top."""


# What the allocator reserves without a limit mostly grows with the micro-batch, but not always:
# Qwen3-30B-A3B under Hugging Face's FSDP on 16 A100-80GB (s 1024, two micro-batches a step,
# full checkpointing) reserves 85.5 GiB at micro-batch 21 and 78.2 at 22 of 79.3 usable, and 21
# runs out. The rise comes from requests a cached block served at the larger micro-batch finding
# none at the smaller, each then getting a segment of its own (allocator_largest_segment_bytes),
# and it need not show on the way down before it comes: qwen2.5-1.5b under Hugging Face's FSDP
# on one B200 (s 512, two micro-batches a step, no checkpointing) reserves 173.7 GiB at
# micro-batch 63 and 176.3 at 64 of 178.6 usable, but at 62 the second micro-batch's logits miss
# the first's cached 18 GiB blocks and it reserves 189.2 (59 to 62 run out). So the micro-batches
# below the largest that is never refused are replayed down from it until one reserves less
# than the usable memory by more than the largest rise toward smaller micro-batches seen on the
# way and, over the first SEGMENT_MARGIN_WALK of them, by more than one segment of the step's
# largest request: below that the reserved peak is taken to stay within the usable memory
# (benchmarks/verdict_invariants.py replays micro-batches below max-mb).
def _verified_below(request: PlanRequest, unrefused: int, largest: int) -> int:
    """``largest``, or less where a micro-batch below ``unrefused`` (whose step is never refused)
    runs out: the largest below every one that does."""
    top = request.with_micro_batch(unrefused)
    lowest_above = _unlimited_excess_bytes(top)
    segment = _largest_segment_bytes(top)
    rise = 0
    for walked, micro in enumerate(m for m in range(unrefused - 1, 0, -1) if _runs(request, m)):
        excess = _unlimited_excess_bytes(request.with_micro_batch(micro))
        rise = max(rise, excess - lowest_above)
        lowest_above = min(lowest_above, excess)
        if not step_fits(request.with_micro_batch(micro)):
            largest = micro - 1
        margin = max(rise, segment) if walked < SEGMENT_MARGIN_WALK else rise
        if excess <= -margin:
            break
    return largest



def _largest_segment_bytes(request: PlanRequest) -> int:
    """The largest segment any pipeline rank's step would allocate for one request of its own
    (allocator_largest_segment_bytes): at a smaller micro-batch the requests are no larger."""
    allocator_largest_segment_bytes = _allocator_planner().allocator_largest_segment_bytes
    largest = 0
    for rank in pipeline_rank_requests(request):
        # The terms as planned, not as replayed (replayed): a resident gradient buffer's parts
        # are its requests here, read from a trace built for them. Where the two are the same,
        # the trace is the one step_fits_unrefused has just replayed at this micro-batch (the
        # same allocated peak), whose kept shape answers.
        states, terms = checked_peak_terms(rank)
        allocated = None
        if replayed(states, terms) == (states, terms):
            allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
        largest = max(largest, allocator_largest_segment_bytes(rank, states, terms, allocated))
    return largest


def _unrefused_bracket(request: PlanRequest, bound: int) -> tuple[int, int]:
    """(low, high): micro-batch ``low`` completes unrefused (or is 0) and ``high`` does not,
    ``bound`` not, found by galloping from the linear guess (_unrefused_guess)."""
    guess = _unrefused_guess(request, bound)
    if guess == 0:
        return 0, 1
    if step_fits_unrefused(request.with_micro_batch(guess)):
        low, stride = guess, 1
        while low + stride < bound and step_fits_unrefused(request.with_micro_batch(low + stride)):
            low, stride = low + stride, stride * 2
        return low, min(low + stride, bound)
    high, stride = guess, 1
    while True:
        probe = max(high - stride, 0)
        if probe == 0 or step_fits_unrefused(request.with_micro_batch(probe)):
            return probe, high
        high, stride = probe, stride * 2


def _unrefused_guess(request: PlanRequest, bound: int) -> int:
    """The largest micro-batch below ``bound`` whose reserved peak without a limit, taken as
    linear through micro-batch 1 and ``bound``, is within the usable memory (0 where even
    micro-batch 1's is not), every pipeline rank on its own usable memory."""
    at_one, at_bound = (_unlimited_excess_bytes(request.with_micro_batch(b)) for b in (1, bound))
    if at_one > 0:
        return 0
    if at_bound <= at_one or bound == 1:
        return bound - 1
    return min(bound - 1, 1 + -at_one * (bound - 1) // (at_bound - at_one))


def _unlimited_excess_bytes(request: PlanRequest) -> int:
    """The most any pipeline rank's step reserves without a device limit beyond that rank's
    usable memory (negative where every rank's is within its own)."""
    return max(reserved - usable_memory_bytes(rank) for rank, reserved in _unlimited_rank_reserved_bytes(request))


def _unlimited_reserved_bytes(request: PlanRequest) -> int:
    """The most any pipeline rank's step reserves without a device limit."""
    return max(reserved for _, reserved in _unlimited_rank_reserved_bytes(request))


def _unlimited_rank_reserved_bytes(request: PlanRequest) -> list[tuple[PlanRequest, int]]:
    """Each pipeline rank's request and what its step reserves without a device limit."""
    allocator_unlimited_reserved_bytes = _allocator_planner().allocator_unlimited_reserved_bytes
    reserved = []
    for rank in pipeline_rank_requests(request):
        states, terms = checked_peak_terms(rank)
        allocated, _ = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
        reserved.append((rank, allocator_unlimited_reserved_bytes(rank, *replayed(states, terms), allocated)))
    return reserved


def _largest_fitting_between(request: PlanRequest, low: int, high: int, fits=step_fits) -> int:  # type: ignore[no-untyped-def]
    """The largest micro-batch in [low, high) that ``fits`` (step_fits, or another predicate of
    the request at a micro-batch), ``low`` fitting (or 0) and ``high`` not, by bisection (fitting
    assumed monotone in the micro-batch)."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(request.with_micro_batch(middle)):
            low = middle
        else:
            high = middle
    return low


def _largest_allocated_within(usable_bytes: int, reserve_fraction: float) -> int:
    """The most allocated bytes A whose peak, A + int(A x reserve_fraction) as memory_breakdown
    counts it, stays within ``usable_bytes`` (-1 when none does)."""
    allocated = int(usable_bytes / (1 + reserve_fraction))
    while allocated + 1 + int((allocated + 1) * reserve_fraction) <= usable_bytes:
        allocated += 1
    while allocated >= 0 and allocated + int(allocated * reserve_fraction) > usable_bytes:
        allocated -= 1
    return allocated


def _max_micro_batch_affine(request: PlanRequest) -> int | None:
    """max_micro_batch_size in closed form: each moment's bytes at micro-batch b are
    m1 + (b - 1)(m2 - m1); None when a moment shrinks with it or is not affine in it (bisection
    decides then)."""
    # liger's fused linear cross-entropy forms its logits a chunk at a time, the chunk's rows a
    # power of two of the tokens (framework_loss.fused_linear_cross_entropy_chunk_rows), so the
    # loss's moments step with the micro-batch: no line through micro-batches 1 and 2 holds past
    # them (Qwen2.5-32B LoRA under hf's zero1 on 8 H100s, s 1024: 64 rows at micro-batch 1, 128
    # at 2 and 3, 256 at 4 to 7; the line said 9 where 10 fits).
    if request.training.fused_linear_cross_entropy:
        return None
    # A batch of varying lengths carries padding from its second sample on (BatchSpec.pads_batches),
    # and with it hf SDPA's mask and repeated K/V (zeroplan.core.hf_padding_mask): the terms switch
    # on at micro-batch 2, so the line through 1 and 2 over-counts every further sample (Mistral-7B
    # LoRA under hf's zero3 on 32 H200s, s 1024: the line said 19 where 20 and 21 fit).
    batch = request.batch
    if batch.padded_batches is None and batch.varying_lengths is not None:
        return None
    # The states and buffers do not change with the micro-batch: only its own terms are new
    # (the request's own terms are the ones its breakdown just computed).
    states, own_terms = checked_peak_terms(request)
    terms = own_terms if request.batch.micro_batch_size == 1 else with_terms(
        own_terms, micro_batch_terms(request.with_micro_batch(1)))
    at_two_terms = with_terms(own_terms, micro_batch_terms(request.with_micro_batch(2)))
    accumulation = request.batch.grad_accum_steps
    at_one, at_two = moment_totals(states, terms, accumulation), moment_totals(states, at_two_terms, accumulation)
    # The allocator model's reserve is what its replay adds: no step completes past the usable memory.
    reserve_fraction = 0.0 if request.assumptions.allocator_conf is not None else request.assumptions.allocator_reserve_fraction
    limit_bytes = _largest_allocated_within(usable_memory_bytes(request), reserve_fraction)
    largest = MAX_MICRO_BATCH_SEARCH
    for first, second in zip(at_one, at_two):
        slope = second - first
        if slope < 0:
            return None
        if first > limit_bytes:
            return 0
        if slope:
            largest = min(largest, (limit_bytes - first) // slope + 1)
    # The bisection stops doubling past MAX_MICRO_BATCH_SEARCH at its largest power of two.
    ceiling = 1 << (MAX_MICRO_BATCH_SEARCH.bit_length() - 1)
    return min(ceiling, largest)


def bisect_max_micro_batch_size(request: PlanRequest) -> int:
    """max_micro_batch_size by doubling and bisection over whole breakdowns."""
    if not step_fits(request.with_micro_batch(1)):
        return 0
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH_SEARCH and step_fits(request.with_micro_batch(high)):
        low, high = high, high * 2
    if high > MAX_MICRO_BATCH_SEARCH:
        return low
    return _largest_fitting_between(request, low, high)


def plan(request: PlanRequest, largest_micro_batch: bool = True, timed: bool = True) -> StrategyPlan:
    """Memory and communication of one strategy on one GPU: under pipeline parallelism the
    pipeline rank nearest to running out (nearest_rank; every rank's peak is kept beside it). Without
    ``largest_micro_batch`` the largest micro-batch that fits is not searched (None); without
    ``timed`` the step is not timed (StrategyPlan.time None: fit's verdict for a suggestion reads
    neither)."""
    return _plan_at_peak(peak_rank_memory(request), largest_micro_batch, timed)


class PeakRankMemory(NamedTuple):
    """The memory half of a plan: the pipeline rank nearest to running out (nearest_rank; the
    request itself without a pipeline), its breakdown and model states, and the verdict on them."""

    request: PlanRequest
    """The request at the peak rank."""
    breakdown: MemoryBreakdown
    states: ModelStateBytes
    rank_peaks: tuple[int, ...]
    """Every pipeline rank's peak, rank 0 first; () without a pipeline."""
    usable_bytes: int
    fits: bool
    """StrategyPlan.fits."""
    host_fits: bool | None
    """StrategyPlan.host_fits."""
    host_bytes_per_rank: int
    """StrategyPlan.host_bytes_per_rank (rank_host_bytes), which host_fits judges."""
    load_fits: bool
    """Whether the module moved onto the GPU at load fits the usable memory (load_fits_gpu)."""


def peak_rank_memory(request: PlanRequest) -> PeakRankMemory:
    """plan()'s memory and verdict for the request, without its collectives, step time and
    largest micro-batch (fit's suggestion asks every strategy this first: a candidate change
    where none fits needs nothing more)."""
    # Feasibility: allocated peak + allocator reserve against capacity less the CUDA context
    # and NCCL buffers (docs/frameworks.md, "Feasibility"), each rank against its own.
    if request.parallel.pp == 1:
        # One rank, the request's own (rank_memories' one entry, nearest_rank's only choice):
        # found directly, without the ranks' list and their comparison (fit asks ~16 of these).
        usable = usable_memory_bytes(request)
        breakdown, states = memory_breakdown(request, usable)
        rank_peaks: tuple[int, ...] = ()
    else:
        ranks = rank_memories(request)
        request, breakdown, states, usable = nearest_rank_memory(ranks)
        rank_peaks = tuple(r.breakdown.peak_bytes for r in ranks)
    # The whole module DeepSpeed's engine moves onto the GPU at load (zeroplan.core.model_load)
    # must fit before any step runs.
    load_fits = load_fits_gpu(request, usable)
    fits = breakdown.peak_bytes <= usable and load_fits
    host_bytes = rank_host_bytes(request, states)
    return PeakRankMemory(request, breakdown, states, rank_peaks, usable, fits, host_memory_fits(request, host_bytes),
                          host_bytes, load_fits)


def rank_host_bytes(request: PlanRequest, states: ModelStateBytes) -> int:
    """The rank's host-memory peak: at the step, its offloaded model states and the block inputs
    DeepSpeed's cpu_checkpointing keeps there (zeroplan.core.parallel.activations.host_checkpoint_bytes);
    at load, the model from_pretrained builds (zeroplan.core.model_load); the larger."""
    return max(states.host_bytes + host_checkpoint_bytes(request), load_host_bytes(request))


def _plan_at_peak(memory: PeakRankMemory, largest_micro_batch: bool, timed: bool, banded: bool = True) -> StrategyPlan:
    """plan() from its memory half; without ``banded`` not borderline whatever its peak (for
    suggestion_fit's plans, whose verdict reads the band of the recommended plan alone)."""
    request, breakdown, usable = memory.request, memory.breakdown, memory.usable_bytes
    reason = peak_rank_reason(request) if request.parallel.pp > 1 else ""
    # Without the band (or where the load runs out, by exact bytes, before any step) not borderline.
    borderline, turns_on = _band(memory) if banded else (False, None)
    host_per_rank = memory.host_bytes_per_rank
    host_per_node = host_per_rank * request.cluster.gpus_per_node
    step_collectives = tuple(collectives(request))
    return StrategyPlan.trusted(
        strategy=request.strategy.kind,
        state_convention=request.convention,
        shard_group_size=request.shard_group_size,
        micro_batch_size=request.batch.micro_batch_size,
        memory=breakdown,
        usable_memory_bytes=usable,
        fits=memory.fits,
        borderline=borderline,
        borderline_capacity_bytes=turns_on,
        headroom_bytes=usable - breakdown.peak_bytes,
        max_micro_batch_size=max_micro_batch_size(request) if largest_micro_batch else None,
        host_bytes_per_rank=host_per_rank,
        host_bytes_per_node=host_per_node,
        host_fits=memory.host_fits,
        load_gpu_bytes=load_gpu_bytes(request) or None,
        load_host_bytes_per_node=load_host_bytes(request) * request.cluster.gpus_per_node or None,
        nvme_bytes_per_rank=nvme_bytes(request),
        collectives=step_collectives,
        sent_bytes_per_step=sum(c.sent_bytes_per_step for c in step_collectives),
        communication_volume_elements=sum(c.volume_elements_per_step for c in step_collectives),
        # An encoder-decoder's step is not timed (zeroplan.core.timing.step_time refuses it).
        time=pipeline_step_time(request, step_collectives) if timed and not request.model.is_encoder_decoder else None,
        parallel=request.parallel,
        pipeline_rank_peak_bytes=memory.rank_peaks,
        peak_rank_reason=reason,
    )


def _band(memory: PeakRankMemory) -> tuple[bool, int | None]:
    """StrategyPlan.borderline and borderline_capacity_bytes of the plan of ``memory``: False
    and None where the load runs out, by exact bytes, before any step."""
    if not memory.load_fits:
        return False, None
    request, breakdown, usable = memory.request, memory.breakdown, memory.usable_bytes
    band = error_band(request.batch.varying_lengths is not None)
    borderline = is_borderline(breakdown.peak_bytes, usable, band, breakdown.lazy_state_segment_bytes,
                               breakdown.allocated_peak_bytes)
    turns_on = None if borderline else _turns_in_band(request, breakdown, memory.fits, usable, band)
    return borderline or turns_on is not None, turns_on


# A pipeline's ranks end their step together: each ends it with the gradient norm's all-reduce
# over the model-parallel group, its pipeline ranks included (megatron-core
# optimizer/clip_grads.py get_grad_norm_fp32, DeepSpeed's runtime/utils.py over
# mpu.get_model_parallel_group(), torchtitan's distributed/utils.py clip_grad_norm_ with pp_mesh:
# zeroplan.core.communicators), and its sends chain the stages every micro-batch, so no rank
# starts the next step before the slowest has finished this one. The step is therefore the
# slowest rank's, not the rank nearest to running out of memory: the two differ where the
# stages hold different parameters (the embedding, the head), and taking the memory's rank
# made the step time jump down when a larger micro-batch or sequence moved the peak to a
# rank with fewer gradients to reduce (each rank's own time only grows with the batch, and
# so does the largest of them). A device map's GPUs (one process, a micro-batch through each
# in turn) are timed as ranks too, the slowest GPU's figure the step's.
def pipeline_step_time(request: PlanRequest, step_collectives: tuple[Collective, ...]) -> StepTime:
    """The step time of ``request`` (a pipeline rank's, ``step_collectives`` its collectives): the
    slowest pipeline rank's StepTime, that rank's own breakdown (on a tie the request's own, else
    the lowest rank); the request's own without a pipeline."""
    own = step_time(request, step_collectives)
    if request.parallel.pp == 1:
        return own
    times = [own if rank.parallel.pipeline_rank == request.parallel.pipeline_rank
             else step_time(rank, tuple(collectives(rank))) for rank in pipeline_rank_requests(request)]
    # On a tie the request's own rank, whose collectives the plan lists.
    return max(times, key=lambda time: (time.step_with_overlap_s, time is own))


def _turns_in_band(request: PlanRequest, breakdown: MemoryBreakdown, fits: bool, usable_bytes: int,
                   band: PeakErrorBand) -> int | None:
    """Under the caching-allocator model, for a verdict not borderline by its peak: the least
    memory within the band's reach of the usable memory (margin.band_capacities_bytes) on which
    the step goes the other way (completes where it runs out on the usable memory, runs out where
    it completes), else None. A refused cudaMalloc frees the cache, and when it comes decides how
    the rest of the step packs, so a step that runs out may complete on a little less memory, or
    a little more than its unlimited peak says, and one that completed only after a refusal may
    run out on a little more; with the measured error the run on the GPU may go either way."""
    if (breakdown.reserved_peak_bytes is None or not breakdown.allocator_modelled
            or breakdown.varying_length_reserve_bytes):
        return None
    low, high = band_capacities_bytes(usable_bytes, band)
    return _allocator_planner().allocator_turns_in_band(request, *replayed(*checked_peak_terms(request)),
                                                        breakdown.allocated_peak_bytes, low, high, fits)


# Simpler first: fewer model states sharded, no engine before an engine (docs/memory-model.md,
# "Recommendation"). The last tie-break, so list order never decides.
SIMPLICITY: dict[StrategyKind, int] = {
    StrategyKind.ddp: 0,
    StrategyKind.zero1: 1,
    StrategyKind.zero2: 2,
    StrategyKind.fsdp_shard_grad_op: 3,
    StrategyKind.zero3: 4,
    StrategyKind.fsdp_full_shard: 5,
    StrategyKind.hsdp: 6,
    StrategyKind.zero2_offload: 7,
    StrategyKind.zero3_offload: 8,
    StrategyKind.zero3_param_offload: 9,
    StrategyKind.zero3_mics: 10,
    StrategyKind.zero3_hpz: 11,
    StrategyKind.zero3_nvme: 12,
    StrategyKind.zero3_param_nvme: 13,
    StrategyKind.zero3_zeropp: 14,
}
"""Rank of each strategy by how much it shards and offloads (0 = plain training or DDP)."""


def _shards_nothing(p: StrategyPlan) -> bool:
    """A sharding strategy over a group of one rank: the whole model states, inside an engine."""
    return p.strategy is not StrategyKind.ddp and p.shard_group_size == 1


def recommendation_key(p: StrategyPlan) -> tuple[int | bool, ...]:
    """The ranking rule, smallest first (docs/memory-model.md, "Recommendation"): (1) the least
    offload (each offload adds host-link traffic and a CPU optimizer step), (2) the fewest bytes
    sent per step, (3) a strategy that shards something over one that shards over a single
    rank (on one GPU: plain training), (4) the lowest peak, (5) the simpler strategy."""
    return (*_key_before_peak(p), p.memory.peak_bytes, SIMPLICITY[p.strategy])


def _key_before_peak(p: StrategyPlan) -> tuple[int | bool, ...]:
    """recommendation_key's rules (1)-(3): what decides before the peaks are compared."""
    # NVMe after host RAM at the same offload: (offloads_parameters, optimizer_on_nvme) in one place.
    return (p.strategy.offloads_optimizer, (p.strategy.offloads_parameters, p.strategy.optimizer_on_nvme),
            p.sent_bytes_per_step, _shards_nothing(p))


def recommend(plans: Iterable[StrategyPlan]) -> StrategyKind | None:
    """The best of the plans that fit (host memory included) by ``recommendation_key``."""
    fitting = [p for p in plans if p.fits and p.host_fits is not False]
    if not fitting:
        return None
    return min(fitting, key=recommendation_key).strategy


def _verdict(
    plans: tuple[StrategyPlan, ...], recommended: StrategyKind | None, host_limit_bytes: int | None, single_gpu: bool,
    band: PeakErrorBand,
) -> str:
    fitting = [p.strategy.value for p in plans if p.fits and p.host_fits is not False]
    short_of_host = [p for p in plans if p.fits and p.host_fits is False]
    out_at_load = [p for p in plans if p.runs_out_at_load and p.memory.peak_bytes <= p.usable_memory_bytes]
    if not fitting and out_at_load:
        # The step would fit: the load is what fails, so say so.
        least = min(out_at_load, key=lambda p: p.memory.peak_bytes)
        return (
            f"Nothing fits at load: {least.strategy.value}'s step fits on the GPU "
            f"({least.memory.peak_bytes / 2**30:.1f} GiB of {least.usable_memory_bytes / 2**30:.1f} GiB usable) but "
            f"DeepSpeed's engine first moves the whole model, {least.load_gpu_bytes / 2**30:.1f} GiB, onto each GPU "
            f"(--model-load full-per-rank: the model loaded before TrainingArguments)."
        )
    if not fitting and short_of_host and host_limit_bytes is None:
        least = min(short_of_host, key=lambda p: p.nvme_bytes_per_rank)
        return (f"Nothing fits in NVMe: {least.strategy.value} fits on the GPU but its swap files need "
                f"{least.nvme_bytes_per_rank / 1e9:.0f} GB per rank, more than --nvme-capacity-gb allows.")
    if not fitting and short_of_host:
        # The GPU is not what fails: say so, with the host RAM each needs and has.
        least = min(short_of_host, key=lambda p: p.host_bytes_per_node)
        return (
            f"Nothing fits in host RAM: {least.strategy.value} fits on the GPU "
            f"({least.memory.peak_bytes / 2**30:.1f} GiB of {least.usable_memory_bytes / 2**30:.1f} GiB usable) "
            f"but needs {least.host_bytes_per_node / 2**30:.1f} GiB of host RAM per node"
            f"{' at load (each rank the whole model)' if least.load_sets_host_peak else ''}, "
            f"{host_limit_bytes / 2**30:.1f} GiB available (--host-memory-gib)."
        )
    if not fitting:
        closest = min(plans, key=lambda p: p.memory.peak_bytes)
        # Under the allocator model a step whose allocated peak alone passes the usable memory
        # is not replayed: its peak is what it needs at the least.
        memory = closest.memory
        least = "at least " if memory.peak_is_least else ""
        return (
            f"Nothing fits; the smallest footprint is {closest.strategy.value} "
            f"({least}{memory.peak_bytes / 2**30:.1f} GiB per GPU of "
            f"{closest.usable_memory_bytes / 2**30:.1f} GiB usable{_margin(closest, band)})."
        )
    others = [name for name in fitting if name != recommended.value]
    also = f"; also fits: {', '.join(others)}" if others else ""
    plain = " = plain training (one GPU: nothing to shard across, no DDP wrapper)" if recommended is StrategyKind.ddp and single_gpu else ""
    chosen = next(p for p in plans if p.strategy is recommended)
    return (
        f"Recommended: {recommended.value}{plain} (of those that fit: least offload, then least sent per step, "
        f"then lowest peak, then simplest{_margin(chosen, band)}){also}."
    )


def _margin(plan: StrategyPlan, band: PeakErrorBand) -> str:
    """'; borderline: the real peak of runs like it lies at 93-108 % of usable' where it does."""
    if not plan.borderline:
        return ""
    return "; " + margin_words(plan.memory.peak_bytes, plan.usable_memory_bytes, band, plan.borderline_capacity_bytes,
                               plan.fits, plan.memory.lazy_state_segment_bytes, plan.memory.allocated_peak_bytes)


# benchmarks/allocator_verdict_sweep.py: over 1,440 strategy plans the caching-allocator
# model's OOM capacity reached at most 1.160 x the allocated peak (1.491 before the loss was
# replayed tensor by tensor), so below two thirds of the usable memory it cannot overturn the
# flat reserve's "fits" there; above, it is asked.
ALLOCATOR_CHECK_FRACTION = (2, 3)
"""Allocated peak / usable memory from which a recommendation is checked against the
caching-allocator model (numerator, denominator)."""


MAX_ALLOCATOR_ALTERNATIVES = 3
"""Fitting strategies, after a cautioned recommendation, asked of the allocator model in turn."""


def allocator_runs_out(request: PlanRequest) -> bool:
    """Whether the caching-allocator model, with PyTorch's default settings, finds that the
    request's step runs out of memory (docs/validation.md, "The caching allocator"); False
    without asking when every pipeline rank's allocated peak is below ALLOCATOR_CHECK_FRACTION
    of the usable memory."""
    numerator, denominator = ALLOCATOR_CHECK_FRACTION
    if all(peak_allocated_bytes(*checked_peak_terms(rank), rank.batch.grad_accum_steps)[0] * denominator
           < usable_memory_bytes(rank) * numerator for rank in pipeline_rank_requests(request)):
        return False
    return not _fits_under_allocator(under_allocator_model(request))


def allocator_answer(request: PlanRequest) -> tuple[bool, int]:
    """(whether every pipeline rank's step completes, each on its own usable memory, the peak
    of the rank nearest to running out, as plan() reports it) under the caching-allocator model,
    with the request's PYTORCH_CUDA_ALLOC_CONF or, under the flat reserve, PyTorch's defaults."""
    modelled = request if request.assumptions.allocator_conf is not None else under_allocator_model(request)
    nearest = nearest_rank_memory(rank_memories(modelled))
    return nearest.breakdown.peak_bytes <= nearest.usable_bytes, nearest.breakdown.peak_bytes


def allocator_shortfall(request: PlanRequest) -> str:
    """What the caching-allocator model finds for the request's step, against the usable memory
    of the pipeline rank nearest to running out (each rank on its own)."""
    nearest = nearest_rank_memory(rank_memories(under_allocator_model(request)))
    reserved, usable = nearest.breakdown.peak_bytes, nearest.usable_bytes
    return (f"PyTorch's caching allocator (modelled, default settings) runs out of the "
            f"{usable / 2**30:.1f} GiB usable (it would reserve {reserved / 2**30:.1f} GiB on a "
            f"larger GPU; the flat {request.assumptions.allocator_reserve_fraction:.0%} reserve is too little here)")


def under_allocator_model(request: PlanRequest) -> PlanRequest:
    """The request under the caching-allocator model with PyTorch's default settings."""
    return request.with_allocator_conf("")


def allocator_check(ranked: list[PlanRequest]) -> tuple[str, int | None] | None:
    """The caching-allocator model's check of a flat-reserve answer, ``ranked`` best first (fit's
    recommendation and the other fitting strategies; the plan search asks the model of every
    configuration it shows instead, core.search._answered): None when the best already takes
    its verdict from the model (--allocator-conf) or the model lets its step complete
    (allocator_runs_out); else what the best would reserve (allocator_shortfall) and the index
    in ``ranked`` of the first of the next MAX_ALLOCATOR_ALTERNATIVES whose step completes (None
    when none does)."""
    best = ranked[0]
    if best.assumptions.allocator_conf is not None or not allocator_runs_out(best):
        return None
    shortfall = allocator_shortfall(best)
    alternatives = ranked[1:1 + MAX_ALLOCATOR_ALTERNATIVES]
    return shortfall, next((i for i, request in enumerate(alternatives, start=1) if not allocator_runs_out(request)), None)


def allocator_caution(requests: dict[StrategyKind, PlanRequest], plans: tuple[StrategyPlan, ...],
                      recommended: StrategyKind) -> str:
    """A caution for the verdict when the flat reserve recommends a strategy whose step the
    caching-allocator model finds running out of memory, naming the next fitting strategy (in
    recommendation order, up to MAX_ALLOCATOR_ALTERNATIVES) the model lets complete; '' when
    allocator_check finds nothing to say."""
    if requests[recommended].assumptions.allocator_conf is not None:
        # The verdict is the model's own already (allocator_check's first answer): the others
        # that fit need not be ranked for it.
        return ""
    others = sorted((p for p in plans if p.fits and p.host_fits is not False and p.strategy is not recommended),
                    key=recommendation_key)
    check = allocator_check([requests[recommended]] + [requests[p.strategy] for p in others])
    if check is None:
        return ""
    shortfall, completing = check
    caution = f" Caution: for {recommended.value}, {shortfall}"
    asked = min(len(others), MAX_ALLOCATOR_ALTERNATIVES)
    if completing is not None:
        caution += f"; under the model {others[completing - 1].strategy.value} completes"
    elif asked == len(others) > 0:
        caution += "; under the model none of the others that fit completes"
    elif asked:
        caution += f"; under the model none of the next {asked} that fit completes"
    return caution + '; without --flat-reserve the verdict is the allocator model\'s (docs/validation.md).'


_Answer = TypeVar("_Answer")


def _fit_strategies(base: PlanRequest, strategies: Iterable[StrategyKind | StrategySpec] | None,
                    ) -> tuple[tuple[StrategyKind | StrategySpec, ...], bool]:
    """The strategies fit plans for ``base`` (its framework's own list where None, checked
    against the framework) and whether the caller named them."""
    framework = base.training.framework
    given = strategies is not None
    if strategies is None:
        # FSDP2's CPUOffloadPolicy applies only to the framework's FSDP strategies.
        strategies = (fsdp_cpu_offload_strategies(framework) if base.training.fsdp_cpu_offload
                      else framework_strategies(framework, base.cluster.world_size))
        if base.parallel.pp > 1:
            strategies = tuple(k for k in strategies if k.value in PIPELINE_STRATEGIES)
        if base.parallel.ep > 1:
            strategies = tuple(k for k in strategies if k.value in EXPERT_PARALLEL_STRATEGIES)
        if base.training.finetune.quantize is Quantization.int8:
            strategies = tuple(k for k in strategies if k in INT8_STRATEGIES)
        if base.training.finetune.quantize is Quantization.gptq_int4:
            strategies = tuple(k for k in strategies if k in GPTQ_STRATEGIES)
        # A named checkpoint save applies to hf's FSDP1 strategies alone (core.checkpoint_save).
        if base.training.fsdp_state_dict is not None and framework is Framework.hf:
            strategies = tuple(k for k in strategies if k in HF_FSDP1_STRATEGIES) or strategies
        # torch 1.x has no FSDP2 (zeroplan.core.torch_release.check_torch_release_strategy).
        if base.training.torch_release is not None:
            check_torch_release(base.training)
            if zero_grad_zeroes(base.training):
                strategies = tuple(k for k in strategies if not k.is_fsdp)
    strategies = tuple(strategies)
    check_framework_strategies(
        framework, tuple(s.kind if isinstance(s, StrategySpec) else _kind(s) for s in strategies), base.cluster.world_size,
    )
    return strategies, given


def _kind(strategy: StrategyKind | str) -> StrategyKind:
    """StrategyKind(strategy): a kind itself without the enum's call (two Python calls, twice
    for each of fit's strategies), a name through it."""
    return strategy if type(strategy) is StrategyKind else StrategyKind(strategy)


def _each_strategy(base: PlanRequest, strategies: tuple[StrategyKind | StrategySpec, ...], given: bool,
                   answer: Callable[[PlanRequest], _Answer],
                   ) -> tuple[list[_Answer], dict[StrategyKind, PlanRequest], list[tuple[str, ZeroplanError]]]:
    """``answer`` of ``base`` under each strategy, in order, each asked as soon as its request
    is made (so the first refusal met is the one raised); the requests by kind (the last of a
    kind named twice, for allocator_caution); and the default list's strategies that cannot
    apply, each with its refusal. Refuses a named strategy that cannot apply, and raises the
    first refusal left out when none applies."""
    answers, requests, left_out = [], {}, []
    for strategy in strategies:
        spec = strategy if isinstance(strategy, StrategySpec) else kept_copy(base.strategy, kind=_kind(strategy))
        try:
            requests[spec.kind] = base.with_strategy(spec)
        except ZeroplanError as error:
            if given:
                raise
            # A strategy of the default list that cannot apply to this layout (HSDP's default
            # group of a node's GPUs wider than the ranks holding the same parameters): the user
            # did not ask for it, so it leaves the table with its reason instead of refusing all.
            left_out.append((spec.kind.value, error))
            continue
        answers.append(answer(requests[spec.kind]))
    if not answers and left_out:
        raise left_out[0][1]
    return answers, requests, left_out


def _fit_verdict(base: PlanRequest, plans: tuple[StrategyPlan, ...], requests: dict[StrategyKind, PlanRequest],
                 recommended: StrategyKind | None = _NOT_KEPT) -> tuple[StrategyKind | None, str, str]:
    """fit's recommendation, its verdict (the caution included) and the caution alone, before
    any suggestion; ``recommended``: recommend(plans), where the caller has it."""
    if recommended is _NOT_KEPT:
        recommended = recommend(plans)
    verdict = _verdict(plans, recommended, base.cluster.host_memory_bytes_per_node, base.cluster.world_size == 1,
                       error_band(base.batch.varying_lengths is not None))
    caution = allocator_caution(requests, plans, recommended) if recommended is not None else ""
    return recommended, verdict + caution, caution


class SuggestionFit(NamedTuple):
    """What smallest_change and fit's verdict read of a candidate change's fit."""

    recommended: StrategyKind | None
    verdict: str
    """FitReport.verdict; '' where nothing fits (a suggestion never words a change that fits nothing)."""
    allocator_caution: str


def suggestion_fit(request: PlanRequest, strategies: tuple[StrategyKind | StrategySpec, ...] | None) -> SuggestionFit:
    """fit(request, strategies, suggest=False, largest_micro_batch=False, timed=False)'s
    recommendation, verdict and caution, which is all a suggestion reads (recommend, _verdict
    and allocator_caution read no largest micro-batch and no step time), its verdict left
    unworded where nothing fits. Every strategy's memory and verdict come first, as plan()
    finds them (peak_rank_memory); only where one fits (its host memory too) are the plans
    that fit completed (collectives and the rest) for the verdict: a candidate change that fits
    nothing (most of the doubled GPU counts tried) costs no collectives. Refuses as fit does,
    but where nothing fits a refusal from the collectives is not reached: either way the
    suggestion passes the change over (smallest_change)."""
    strategies, given = _fit_strategies(request, strategies)
    memories, requests, _ = _each_strategy(request, strategies, given, peak_rank_memory)
    if not any(memory.fits and memory.host_fits is not False for memory in memories):
        return SuggestionFit(None, "", "")
    # Where one fits, recommend, _verdict and allocator_caution read the plans that fit alone
    # (those that fit on the GPU but not in host memory only where none fits), so only those are
    # completed, in their order. _verdict reads the band (StrategyPlan.borderline,
    # borderline_capacity_bytes) of the recommended plan alone (_margin), and recommend reads no
    # band: the others are completed without it (_turns_in_band asks the allocator model), the
    # recommended with it.
    fitting = [memory for memory in memories if memory.fits and memory.host_fits is not False]
    plans = tuple(_plan_at_peak(memory, False, False, banded=False) for memory in fitting)
    recommended = recommend(plans)
    # The recommended plan's band added to the plan already made (the band's two fields are all
    # that _plan_at_peak with it would make differently), not the whole plan made again.
    plans = tuple(_banded(memory, plan) if plan.strategy is recommended else plan
                  for memory, plan in zip(fitting, plans, strict=True))
    # recommend reads no band: the recommendation of the plans made without it stands.
    return SuggestionFit(*_fit_verdict(request, plans, requests, recommended))


def _banded(memory: PeakRankMemory, unbanded: StrategyPlan) -> StrategyPlan:
    """_plan_at_peak(memory, ...) from its plan made without the band: the same plan with the
    band's fields (_band) set."""
    borderline, turns_on = _band(memory)
    return unbanded.model_copy(update={"borderline": borderline, "borderline_capacity_bytes": turns_on})


def fit(base: PlanRequest, strategies: Iterable[StrategyKind | StrategySpec] | None = None, *,
        suggest: bool = True, largest_micro_batch: bool = True, timed: bool = True) -> FitReport:
    """Plan ``base`` under each strategy; the strategy in ``base`` supplies the knobs. None
    plans every strategy the request's framework runs (all of them for zeroplan and hf). When
    nothing fits and ``suggest``, the verdict names the smallest change that fits
    (zeroplan.core.suggest). Without ``largest_micro_batch`` no plan searches its largest
    micro-batch (StrategyPlan.max_micro_batch_size None); without ``timed`` none is timed
    (StrategyPlan.time None)."""
    strategies, given = _fit_strategies(base, strategies)
    plans, requests, left_out = _each_strategy(base, strategies, given,
                                               lambda request: plan(request, largest_micro_batch, timed))
    plans_tuple = tuple(plans)
    recommended, verdict, caution = _fit_verdict(base, plans_tuple, requests)
    suggested_change, suggested_recommendation = "", None
    if recommended is None and suggest:
        # The strategies the user named stay the ones tried; else each retry plans every
        # strategy its framework runs on its GPUs.
        kept = strategies if given else None
        found = smallest_change(base, lambda request: suggestion_fit(request, kept))
        if found is not None:
            suggested_change, suggested = found
            suggested_recommendation = suggested.recommended
            verdict += f" With {suggested_change}: {suggested.verdict}"
    return FitReport.trusted(
        model=base.model,
        num_parameters=total_parameters(base.model),
        training=base.training,
        batch=base.batch,
        cluster=base.cluster,
        plans=plans_tuple,
        recommended=recommended,
        verdict=verdict,
        suggested_change=suggested_change,
        suggested_recommendation=suggested_recommendation,
        allocator_caution=caution,
        compute_model=base.performance.compute_model,
        fsdp_version=1 if base.strategy.fsdp1_root_stays_gathered else 2,
        left_out=tuple(f"{kind}: {error.detail}" for kind, error in left_out),
        allocator_conf=base.assumptions.allocator_conf,
        allocator_conf_is_launch_default=base.allocator_conf_is_launch_default,
    )
