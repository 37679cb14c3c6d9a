"""What a transformers block's SDPA attention saves beyond the unmasked kernel when the batch
carries padding (docs/memory-model.md, "Padded batches under SDPA"). Nothing here imports torch."""

from __future__ import annotations

from zeroplan.core.profiles import profile
from zeroplan.core.transformers_release import builds_positions_mask
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import AttentionKernel, batch_pads


# transformers 4.56.2 masking_utils.py sdpa_mask_recent_torch: _ignore_causal_mask_sdpa returns
# None (SDPA's is_causal instead) only when the 2-D padding mask is all ones, so a padded batch
# builds one b x 1 x s x s bool mask that every block receives. integrations/sdpa_attention.py:
# use_gqa_in_sdpa is false once a mask is passed, so repeat_kv expands K and V to the query heads
# and reshapes them, a copy unless one K/V head makes the reshape a view (multi-query); SDPA
# saves the copies in place of the grouped K and V. torch 2.13 attention.cpp
# scaled_dot_product_attention converts the bool mask to an additive one in the query's dtype
# (convert_boolean_attn_mask) at every call, and the kernel that takes a mask (memory-efficient
# on CUDA, flash on the CPU) saves it for backward: e bytes per mask element, per block.
# Measured with saved-tensor hooks on transformers' LlamaModel (tests/test_hf_padding_mask.py).
# transformers 4.38.x (zeroplan.core.transformers_release.POSITIONS_MASK_RELEASES) passes SDPA a
# mask whether or not the batch pads: LlamaSdpaAttention.forward (4.38.2 modeling_llama.py:660-662)
# takes ``causal_mask[:, :, cache_position, : key_states.shape[-2]]`` of the b x 1 x P x P mask,
# an index by the cache_position tensor and so a new b x 1 x s x s tensor in every layer, and
# passes it as attn_mask (:672-677), which the masked kernel saves (the memory-efficient kernel on
# CUDA, under autocast the cast to the compute dtype it runs in). Measured with saved-tensor hooks
# on 4.38.2's own LlamaForCausalLM on the CPU (benchmarks/transformers438-causal-mask-records.json):
# one b x 1 x s x s tensor of its own per layer under SDPA, none under eager (``attn_weights +
# causal_mask`` keeps neither). 4.39.0's is a view of one s x s tensor that every layer shares,
# e·s² bytes whatever the batch: not planned.
def padding_mask_extra_bytes(request: PlanRequest) -> int:
    """Bytes one block saves beyond the unmasked SDPA block because the batch carries padding, or
    because transformers 4.38.x gives SDPA its causal mask."""
    training, model, batch = request.training, request.model, request.batch
    if not profile(training.framework).sdpa_keeps_padding_mask or training.attention_kernel is not AttentionKernel.flash:
        return 0
    e, s, b = training.precision.compute_bytes, batch.seq_len, batch.micro_batch_size
    if not batch_pads(batch):
        return e * b * s * s if builds_positions_mask(model, training) else 0
    copies = 2 * e * s * b * (model.q_size - model.kv_size) if 1 < model.kv_heads < model.num_heads else 0
    return copies + e * b * s * s
