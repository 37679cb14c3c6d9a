"""What a transformers release's causal-LM forward returns and allocates at its loss
(TrainingSpec.transformers_version; docs/frameworks.md, "transformers releases"). Read from each
release's own source (the wheels' transformers/models/llama/modeling_llama.py and
transformers/loss/loss_utils.py); the profile's own 4.56.2 is measured (benchmarks/kv-cache-records).
Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.finetune import version_tuple
from zeroplan.specs.framework import TRANSFORMERS_VERSION
from zeroplan.specs.training import TrainingSpec

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


def transformers_release(training: TrainingSpec) -> tuple[int, int, int]:
    """The release planned: TrainingSpec.transformers_version, else the profile's 4.56.2."""
    return version_tuple(training.transformers_version or TRANSFORMERS_VERSION)


def returns_fp32_logits(training: TrainingSpec) -> bool:
    """Whether the forward's output object carries fp32 logits (releases before 4.46)."""
    return transformers_release(training) < FP32_LOGITS_UNTIL


def shifts_logits_copy(training: TrainingSpec) -> bool:
    """Whether the loss makes a contiguous fp32 copy of the shifted logits (before 4.49)."""
    return transformers_release(training) < SHIFTED_COPY_UNTIL


def returned_logit_bytes(training: TrainingSpec) -> int:
    """Bytes of one logit in the output object: fp32 before 4.46, else the compute dtype."""
    return 4 if returns_fp32_logits(training) else training.precision.compute_bytes
