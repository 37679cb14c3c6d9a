"""What a reward-model step of DeepSpeed-Chat holds at its head, per rank, where a causal-LM step
holds the vocabulary's logits.

DeepSpeed-Chat (microsoft/DeepSpeedExamples applications/DeepSpeed-Chat/training at 3a77097)
step2_reward_model_finetuning/main.py:209-213 builds the model with utils/model/model_utils.py
create_critic_model (:51-64): ``AutoModel.from_pretrained`` (the bare decoder, OPTModel for OPT:
no lm_head, no loss) wrapped in utils/model/reward_model.py RewardModel, whose v_head is
``nn.Linear(word_embed_proj_dim or hidden_size, 1, bias=False)`` (:17-27). The training loop
(main.py:319-324) calls ``rm_model(**batch, use_cache=False)`` on a batch whose first half is the
chosen and second half the rejected sequences of each pair (utils/data/data_utils.py
DataCollatorReward), then ``rm_model.backward(loss)`` and ``rm_model.step()`` under DeepSpeed's
engine. RewardModel.forward (:37-112): the decoder's last hidden states, ``rewards =
self.v_head(hidden_states).squeeze(-1)`` (b x s scores in the module's dtype), then a Python loop
over the pairs: the chosen and rejected scores from the first position they differ to the longer
one's end (at most s - 1 positions: ``assert divergence_ind > 0``), ``-torch.log(
torch.sigmoid(c - r)).mean()``, summed over the pairs and divided by their count. The outputs are
the loss and two vectors of one score a pair.

So the blocks' activations are the causal-LM formulas at the batch's 2 x pairs rows (the same
decoder forward), and the head holds b x s scores where a causal-LM step holds b x s x vocab
logits and their loss's copies. The v_head's own weights (word_embed_proj_dim elements: 2,048 for
OPT-1.3b) are not counted with the model's parameters: with the fp16 optimizer's 16 bytes of
states an element, 32 KiB.
"""

from __future__ import annotations

from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Objective, StateConvention


# DeepSpeed-Chat utils/model/reward_model.py:56 (at 3a77097): ``self.v_head(hidden_states)
# .squeeze(-1)``, the v_head's output in the module's dtype (DeepSpeed's engine casts the module
# to 16 bits); :102-103 per pair ``c_truncated_reward - r_truncated_reward`` (at most s - 1
# positions), its sigmoid (SigmoidBackward keeps its output, which LogBackward keeps as its input)
# and its log, whose mean is one scalar. The pairs before the current one keep their sigmoid.
def reward_forward_tensors(request: PlanRequest) -> tuple[int, ...]:
    """The head's tensors at the last pair's log, the largest moment of the forward's head."""
    b, s, e = request.batch.micro_batch_size, request.batch.seq_len, request.training.precision.compute_bytes
    pairs, span = b // 2, e * (s - 1)
    return e * b * s, pairs * span, span, span


# reward_model.py:102-105 backward: each pair's MeanBackward, LogBackward and SigmoidBackward
# (at most s - 1 positions each, two alive at once), SubBackward's two views, then the slices'
# and selects' backward (rewards[:bs][i], rewards[bs:][i]: each writes its slice into a zeroed
# b x s gradient, which autograd adds into the rewards' accumulated one): two b x s scores
# beside a pair's two spans; the v_head's backward then reads the accumulated b x s.
def reward_backward_tensors(request: PlanRequest) -> tuple[int, ...]:
    """The head's tensors at its backward's largest moment."""
    b, s, e = request.batch.micro_batch_size, request.batch.seq_len, request.training.precision.compute_bytes
    span = e * (s - 1)
    return e * b * s, e * b * s, span, span


def reward_head_tensors(request: PlanRequest) -> tuple[tuple[int, ...], ...]:
    """The reward step's head moments (zeroplan.core.framework_loss.framework_logits_tensors'
    place for the vocabulary's logits): its forward's, then its backward's."""
    return reward_forward_tensors(request), reward_backward_tensors(request)


# What DeepSpeed-Chat's step2 runs (module docstring): an hf model's bare decoder under
# DeepSpeed's engine (its state convention: ZeRO stage 0 as ddp with --state-convention deepspeed,
# or a ZeRO strategy), data parallelism alone; its --lora_dim adapters are DeepSpeed-Chat's own
# LinearLayer_LoRA (utils/module/lora.py), not peft's. The micro-batch's evenness (pairs) is
# checked where the user names it (zeroplan.cli.fit), as DPO's: the search probes every row count.
def check_reward_request(request: PlanRequest) -> None:
    """Refuse, in one line naming the field, a reward step DeepSpeed-Chat's step 2 does not run."""
    training, parallel = request.training, request.parallel
    if training.objective is not Objective.reward:
        return
    if training.framework is not Framework.hf or request.convention is not StateConvention.deepspeed:
        raise ZeroplanError("objective", "reward is DeepSpeed-Chat's step 2, an hf model under DeepSpeed's engine "
                            "(allowed: framework hf with a ZeRO strategy, or ddp with state convention deepspeed)")
    if request.model.is_encoder_decoder:
        raise ZeroplanError("objective", "reward is planned for a decoder's v_head, not an encoder-decoder (allowed: sft)")
    if training.finetune.is_lora:
        raise ZeroplanError("finetune", "DeepSpeed-Chat's --lora_dim adapters are its own LinearLayer_LoRA, not peft's "
                            "(allowed: a full fine-tune under objective reward)")
    if field := training.first_switched_on(("keep_outputs", "unchunked_loss", "compile", "activation_offloading",
                                             "fused_linear_cross_entropy", "fused_cross_entropy", "uncast_loss",
                                             "use_cache")):
        raise ZeroplanError(field, "is not planned with objective reward: its head is a v_head's b x s scores, "
                                   "not a vocabulary's logits (allowed: off)")
    if (parallel.tp, parallel.cp, parallel.pp, parallel.ep) != (1, 1, 1, 1):
        raise ZeroplanError("parallel", "reward is planned with data parallelism alone (allowed: tp, cp, pp, ep all 1)")
