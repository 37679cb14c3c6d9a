"""Gradients and optimizer states made inside an epoch of varying-length micro-batches, where the
planner's step makes them before its first activation: the one more segment of the step's
largest request a run may need, which the room its step leaves may not hold
(docs/memory-model.md, "Gradients and optimizer states made inside the epoch").

What the loops do (their source, read at the releases the profiles model):
- transformers 4.36 trainer.py Trainer._inner_training_loop (ms-swift's Seq2SeqTrainer at
  cfcb672 keeps that loop): ``self.optimizer.step()`` then ``model.zero_grad()`` after each
  accumulation window; torch 2.x nn/modules/module.py Module.zero_grad(set_to_none=True) sets
  every ``.grad`` to None, so the next window's first backward makes them again
  (torch/csrc/autograd/functions/accumulate_grad.h accumulateGrad: an undefined grad takes the
  backward's new tensor), in the cached blocks of that moment.
- torch 2.1 torch/optim/adamw.py AdamW._init_group: a parameter whose state is empty gets
  ``exp_avg`` and ``exp_avg_sq`` (``torch.zeros_like(p)``) inside ``step()``: at the first
  optimizer step, after the first window's micro-batches (Adam, SGD's momentum alike).
- torchtune recipes/full_finetune_single_device.py (01067f61) train():
  ``self._optimizer.step()`` then ``self._optimizer.zero_grad(set_to_none=True)``, the
  optimizer built in setup without a state; litgpt finetune/full.py (0077627) fit():
  ``optimizer.step()`` then ``optimizer.zero_grad()`` (torch 2's default set_to_none);
  zeroplan's own harness (the zeroplan profile: harness/runner.py _one_step, then
  harness/engine.py TorchOptimizerSteps: ``optimizer.step()``, ``zero_grad(set_to_none=True)``).

c10/cuda/CUDACachingAllocator.cpp (source.ALLOCATOR_SOURCE): get_free_block serves each of those
tensors from the smallest cached block at least as large (best fit), which in an epoch of varying
lengths may be a segment of the step's largest request (a loss tensor at seq_len) left free
while a shorter batch ran. A tensor that splits it leaves a remainder that cannot serve that
request again, and release_cached_blocks frees only unsplit segments; states that fill it hold it
for good. The next batch at seq_len then needs one more segment of that size beyond the step's
own footprint. In the replays of benchmarks/swift_full_lazy_states.py --segments (ms-swift's
Qwen-7B at 8192 tokens) the orders that run out show each way: AdamW states splitting two of
the three 4.64 GiB loss segments (seed 2), states filling the shorter records' segments so that
the long batch's own checkpoint splits one (seed 3), states filling all three (seed 5). With
every batch at seq_len the step's own loss tensors hold those segments whenever the states are
made (its --fixed replay completes); whether it happens in an epoch depends on the order of its
lengths, so the planner says where the room cannot hold that segment, not how likely it is.
"""

from __future__ import annotations

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.rules import SMALL_SIZE_BYTES, allocation_size, round_size
from zeroplan.allocator.varying_lengths import record_tensor_bytes
from zeroplan.core.finetune import modules_to_save
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.core.peak import PeakTerms
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind

LAZY_STATE_FRAMEWORKS = frozenset({Framework.hf, Framework.torchtune, Framework.litgpt, Framework.zeroplan})
"""The loops whose source makes the gradients in each window's first backward and the optimizer
states at the first step (module docstring). Not here: DeepSpeed's engine (its flat partitions
and buckets are made at initialisation; ZeRO-3's optimizer states are made in the first step too,
which zeroplan.allocator.deepspeed_first_step replays at seq_len, not against an epoch's lengths), FSDP (its own schedule, zeroplan.allocator.fsdp_schedule),
megatron's and fairseq's flat buffers, and torchtitan (its loop not read for this)."""


def makes_states_in_epoch(request: PlanRequest) -> bool:
    """Whether the loop makes its gradients and optimizer states inside the epoch: one of
    LAZY_STATE_FRAMEWORKS under plain DDP or one GPU, its optimizer stepped after the backward."""
    training = request.training
    return (training.framework in LAZY_STATE_FRAMEWORKS and request.strategy.kind is StrategyKind.ddp
            and not training.optimizer_in_backward)


# c10/cuda/CUDACachingAllocator.cpp get_pool: a request of at most kSmallSize (1 MiB) is served
# from the small pool's 2 MiB segments, never from a block of the large pool; only a larger
# gradient (and its states) can take a loss tensor's segment.
def largest_gradient_bytes(request: PlanRequest, states: ModelStateBytes) -> int:
    """The largest gradient tensor the step makes: the largest trainable parameter's elements at
    the gradients' bytes per element."""
    trainable = [t.numel for unit in rank_parameter_units(request) for t in unit.tensors if t.trainable]
    elements = sum(trainable)
    # PEFT's trainable copies, in their own dtype (zeroplan.core.finetune.modules_to_save).
    copy = modules_to_save.largest_copy_tensor_bytes(request)
    if not elements:
        return copy
    return max(max(trainable) * (states.gradient_bytes - modules_to_save.copy_gradient_bytes(request)) // elements, copy)


def lazy_state_segment_bytes(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                             one_step_bytes: int, usable_bytes: int) -> int:
    """The segment of the step's largest request that a run may need beyond the step at seq_len
    (``one_step_bytes`` reserved), where the room the usable memory leaves cannot hold it and
    tensors made inside the epoch can take it; 0 where that cannot happen."""
    if request.batch.varying_lengths is None or not makes_states_in_epoch(request):
        return 0
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    if config.expandable_segments:
        # Pages of one growing segment: a longer request maps pages past the end
        # (zeroplan.allocator.varying_lengths: no record reserve under expandable segments).
        return 0
    if largest_gradient_bytes(request, states) <= SMALL_SIZE_BYTES:
        return 0
    tensors = record_tensor_bytes(request, terms)
    if not tensors:
        return 0
    segment = allocation_size(round_size(max(tensors), config))
    return segment if one_step_bytes + segment > usable_bytes else 0
