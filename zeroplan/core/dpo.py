"""What a DPO step of torchtune's DPO recipes holds beyond a causal-LM step, per rank.

The recipes (torchtune 0.6.1 recipes/lora_dpo_single_device.py, lora_dpo_distributed.py,
full_dpo_distributed.py) stack the chosen and rejected sequences into one batch of
2 x micro-batch rows, so the blocks' activations are the causal-LM formulas at twice the
micro-batch. What differs is the head: the decoder's logits are never chunked (the recipes do
not call set_num_output_chunks) and are cast to fp32 (modules/transformer.py unembed:
``self.output(h).float()``), and rlhf.get_batch_log_probs takes a full fp32 log_softmax over the
vocabulary (rlhf/sequence_processing.py logits_to_logprobs), which autograd keeps for backward.
The reference forward (the same weights under disable_adapter for LoRA; a second, frozen model
for full DPO) runs under no_grad after the policy's logits are deleted: its logits and
log-probs are transient, but live on top of the policy's saved log-probs.
"""

from __future__ import annotations

FP32_BYTES = 4


# torchtune 0.6.1 recipes/lora_dpo_single_device.py concatenated_forward: chosen and rejected
# concatenated along the batch dimension, one forward of both.
def dpo_rows(micro_batch_pairs: int) -> int:
    """Rows of the one forward a DPO step runs per model: chosen and rejected stacked."""
    return 2 * micro_batch_pairs


# torchtune 0.6.1 rlhf/sequence_processing.py get_batch_log_probs: logits[:, :-1] then
# F.log_softmax in the logits' dtype (fp32 after unembed's .float()); LogSoftmaxBackward saves
# its result.
def policy_log_softmax_bytes(micro_batch_pairs: int, seq_len: int, vocab_size: int) -> int:
    """The policy's fp32 log_softmax, saved for backward until the loss's backward."""
    return FP32_BYTES * dpo_rows(micro_batch_pairs) * (seq_len - 1) * vocab_size


# torchtune 0.6.1 recipes/lora_dpo_single_device.py train(): the reference's concatenated_forward
# under no_grad. At its log_softmax three fp32 vocabulary-wide tensors are live: the logits
# (modules/transformer.py unembed .float()), ``logits / temperature`` and the log_softmax
# (rlhf/sequence_processing.py logits_to_logprobs), the last two one position shorter.
def reference_head_transient_bytes(micro_batch_pairs: int, seq_len: int, vocab_size: int) -> int:
    """The reference forward's vocabulary-wide fp32 tensors at its largest moment."""
    rows = dpo_rows(micro_batch_pairs)
    return FP32_BYTES * rows * vocab_size * (seq_len + 2 * (seq_len - 1))


# The two above together: the reference's head runs while the policy's log_softmax is saved;
# the loss's own tensors are (2 x micro-batch) scalars, and backward's vocabulary-wide
# gradients (at most three fp32 tensors beside the saved log_softmax) never exceed this.
def dpo_head_peak_bytes(micro_batch_pairs: int, seq_len: int, vocab_size: int) -> int:
    """The DPO step's vocabulary-wide bytes at its peak (the reference forward's head)."""
    return (policy_log_softmax_bytes(micro_batch_pairs, seq_len, vocab_size)
            + reference_head_transient_bytes(micro_batch_pairs, seq_len, vocab_size))
