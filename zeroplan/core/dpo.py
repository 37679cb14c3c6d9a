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

from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Objective
from zeroplan.units import FP32_BYTES


# torchtune 0.6.1 recipes/lora_dpo_single_device.py concatenated_forward: chosen and rejected
# concatenated along the batch dimension, one forward of both.
def dpo_rows(micro_batch_pairs: int) -> int:
    """Rows of the one forward a DPO step runs per model: chosen and rejected stacked."""
    return 2 * micro_batch_pairs


# torchtune 0.6.1 rlhf/sequence_processing.py get_batch_log_probs: logits[:, :-1] then
# F.log_softmax in the logits' dtype (fp32 after unembed's .float()); LogSoftmaxBackward saves
# its result.
def policy_log_softmax_bytes(rows: int, seq_len: int, vocab_size: int) -> int:
    """The policy's fp32 log_softmax over ``rows`` (dpo_rows) sequences, saved for backward
    until the loss's backward."""
    return FP32_BYTES * rows * (seq_len - 1) * vocab_size


# torchtune 0.6.1 recipes/lora_dpo_single_device.py train(): the reference's concatenated_forward
# under no_grad. At its log_softmax three fp32 vocabulary-wide tensors are live: the logits
# (modules/transformer.py unembed .float()), ``logits / temperature`` and the log_softmax
# (rlhf/sequence_processing.py logits_to_logprobs), the last two one position shorter.
def reference_head_transient_parts(rows: int, seq_len: int, vocab_size: int) -> tuple[int, int, int]:
    """The reference forward's vocabulary-wide fp32 tensors at its largest moment."""
    shifted = FP32_BYTES * rows * (seq_len - 1) * vocab_size
    return FP32_BYTES * rows * seq_len * vocab_size, shifted, shifted


# The two above together: the reference's head runs while the policy's log_softmax is saved;
# the loss's own tensors are (2 x micro-batch) scalars, and backward's vocabulary-wide
# gradients (at most three fp32 tensors beside the saved log_softmax) never exceed this.
def dpo_reference_moment(rows: int, seq_len: int, vocab_size: int) -> tuple[int, ...]:
    """The tensors of the reference head's moment: the policy's saved log_softmax and the
    reference's three transients."""
    return (policy_log_softmax_bytes(rows, seq_len, vocab_size), *reference_head_transient_parts(rows, seq_len, vocab_size))


# torchtune 0.6.1 recipes/lora_dpo_single_device.py train() lines 535-568: the policy's
# concatenated_forward, ``del`` of its logits, the reference's under no_grad, then backward.
# The moments: the reference's head (the policy's saved log_softmax beside the reference's three
# fp32 tensors), then the loss's backward and the output projection's, which are torchtune's
# unchunked cross-entropy's (``unchunked_moments``, zeroplan.core.framework_loss
# torchtune_unchunked_logits_tensors: the saved log_softmax and two fp32 gradients, then the fp32
# gradient, its bf16 cast and the output unit).
def dpo_logits_tensors(request: PlanRequest, unchunked_moments: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The DPO step's logits tensors at each of its moments, on this rank."""
    return (dpo_reference_moment(request.batch.micro_batch_size, request.batch.seq_len, request.model.vocab_size), *unchunked_moments)


# The recipes measured (benchmarks/dpo_head_records.py) and their limits: torchtune's LoRA DPO
# recipes over FSDP2 (lora_dpo_distributed) or one GPU (lora_dpo_single_device).
# The micro-batch's evenness is checked where the user names it (zeroplan.cli.fit: the recipe's
# pairs are whole), not here: the search for the largest micro-batch probes every row count.
def check_dpo_request(request: PlanRequest) -> None:
    """Refuse, in one line naming the field, a DPO step no measured recipe runs."""
    training, parallel = request.training, request.parallel
    if training.objective is not Objective.dpo:
        return
    if training.framework is Framework.hf:
        # DeepSpeed-Chat's DPO script (zeroplan.core.dschat_dpo).
        from zeroplan.core.dschat_dpo import check_dschat_dpo

        return check_dschat_dpo(request)
    if training.framework is not Framework.torchtune:
        raise ZeroplanError("objective", f"dpo is planned for torchtune's LoRA DPO recipes and DeepSpeed-Chat's DPO (hf), "
                            f"not {training.framework.value} (allowed: framework torchtune or hf)")
    if not training.finetune.is_lora:
        raise ZeroplanError("objective", "full_dpo_distributed's separately sharded reference model is not measured "
                            "(allowed: dpo with LoRA/QLoRA, finetune.lora_rank >= 1)")
    if training.unchunked_loss:
        raise ZeroplanError("unchunked_loss", "the DPO recipes' logits are unchunked already (allowed: off under objective dpo)")
    if field := training.first_switched_on(("keep_outputs", "compile", "activation_offloading", "optimizer_in_backward",
                                             "fused_linear_cross_entropy")):
        raise ZeroplanError(field, "is not measured with objective dpo (allowed: off)")
    if (parallel.tp, parallel.cp, parallel.pp, parallel.ep) != (1, 1, 1, 1):
        raise ZeroplanError("parallel", "dpo is measured without tensor, context, pipeline or expert parallelism "
                            "(allowed: tp, cp, pp, ep all 1)")
