"""Run an older transformers release's causal-LM head and loss on the installed Llama
(zeroplan.core.transformers_release says what each release does; torch and transformers needed).

transformers 4.56.2 is what is installed; 4.31.0-4.48.0 differ from it only after the decoder
stack, in LlamaForCausalLM.forward and its loss. The forward is swapped, while the block runs,
for one that runs the installed LlamaModel and then what those releases ran:

- 4.31.0 modeling_llama.py:818-838, 4.45.2 lines 1213-1231: ``logits = lm_head(h).float()``,
  then ``shift_logits = logits[..., :-1, :].contiguous()``, ``shift_labels = labels[..., 1:]
  .contiguous()`` and CrossEntropyLoss over the flattened shifted tensors;
- 4.46.0 modeling_llama.py:1210-1214 with loss/loss_utils.py:32-46 ForCausalLMLoss (4.48.0 the
  same): ``logits = lm_head(h)``, then in the loss ``logits.float()`` and the same shift.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zeroplan.core.transformers_release import FP32_LOGITS_UNTIL, SHIFTED_COPY_UNTIL
from zeroplan.specs.finetune import version_tuple


@contextlib.contextmanager
def release_forward(release: str | None) -> Iterator[None]:
    """LlamaForCausalLM.forward as ``release`` runs it (None or 4.49 and later: the installed one)."""
    if release is None or version_tuple(release) >= SHIFTED_COPY_UNTIL:
        yield
        return
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    upcast_in_forward = version_tuple(release) < FP32_LOGITS_UNTIL
    installed = LlamaForCausalLM.forward

    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        if upcast_in_forward:
            logits = logits.float()
        loss = None
        if labels is not None:
            # ForCausalLMLoss's own `logits = logits.float()` holds the upcast until the loss
            # returns; before 4.46 the logits are fp32 already and .float() returns them.
            upcast = logits.float()
            shift_logits = upcast[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = torch.nn.functional.cross_entropy(shift_logits.view(-1, self.config.vocab_size),
                                                     shift_labels.view(-1).to(shift_logits.device))
            del upcast, shift_logits, shift_labels
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

    LlamaForCausalLM.forward = forward
    try:
        yield
    finally:
        LlamaForCausalLM.forward = installed
