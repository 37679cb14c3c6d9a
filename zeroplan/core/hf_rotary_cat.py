"""Where a block's SDPA output is copied for its output projection because RoPE's torch.cat left
q heads-major (zeroplan.core.frameworks.rotary_cat_extra_bytes counts what is kept of it; the
frozen blocks of a partly frozen fine-tune keep nothing of it, zeroplan.core.finetune.activations).
Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.model import PositionKind
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import AttentionKernel, batch_pads


# litgpt 00af8b0 model.py:263-266 and transformers 4.56.2 models/gpt_neox/modeling_gpt_neox.py
# apply_rotary_pos_emb (lines 82-93), models/phi/modeling_phi.py PhiAttention.forward (lines
# 155-168): the rotated and pass-through parts of q and k are joined by torch.cat, new [b, heads,
# s, d] tensors, and SDPA's output takes the query's layout, so the head merge before the output
# projection (attn_output.transpose(1, 2).contiguous(), .reshape) copies it. A padded hf batch
# runs the memory-efficient kernel, whose output is allocated [b, s, heads, d]: no copy.
def runs_rotary_cat(request: PlanRequest) -> bool:
    """Whether the block's q and k come from RoPE's torch.cat ahead of an unmasked SDPA."""
    model, training, batch = request.model, request.training, request.batch
    litgpt = training.framework is Framework.litgpt
    hf = training.framework is Framework.hf and model.rotary_cat and not batch_pads(batch)
    return (litgpt or hf) and model.position is PositionKind.rope and training.attention_kernel is AttentionKernel.flash


def rotary_cat_output_copy_bytes(request: PlanRequest) -> int:
    """Bytes of the copy of SDPA's output the output projection reads (0 where there is none)."""
    if not runs_rotary_cat(request):
        return 0
    batch = request.batch
    return request.training.precision.compute_bytes * batch.seq_len * batch.micro_batch_size * request.model.q_size
