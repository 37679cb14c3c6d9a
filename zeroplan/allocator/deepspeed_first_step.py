"""DeepSpeed 0.14.2's ZeRO-3 states as its construction leaves them, and the first optimizer
step, which makes Adam's two states inside the step (docs/memory-model.md, "DeepSpeed ZeRO-3's
first step"). Nothing here imports torch.

Read at v0.14.2:
- runtime/zero/stage3.py _create_fp16_partitions_with_defragmentation: every parameter's
  partition copied into one flat 16-bit buffer (the parameters the step gathers from);
- stage3.py:794-864 _create_fp32_partitions: per sub-group ``flat.clone().float()``, the fp32
  master of each sub-group its own tensor;
- stage3.py:978-1044 initialize_optimizer_states: a gradient buffer handed to the masters'
  ``.grad`` and dropped, no optimizer step (only Adagrad's states are made there);
- stage3.py:488-507 _setup_for_real_optimizer: the ipg bucket and grad_partitions_flat_buffer
  after the masters (the planner's resident buffers);
- ops/adam/fused_adam.py:149-157 (the optimizer a config's "AdamW" builds): ``exp_avg`` and
  ``exp_avg_sq`` made by ``torch.zeros_like`` when a parameter's state is empty, inside the first
  step that is not skipped for overflow, sub-group by sub-group (stage3.py _optimizer_step), after
  that step's forward and backward have freed their tensors into the cache, whose blocks they
  take and split.

So the trace allocates the flat parameters, the masters and the resident buffers, then runs two
steps: the first makes each sub-group's two states as its update starts, the second runs with
them. The one-step trace from an empty cache with every state allocated first lays them below
every activation, which no run does.

Measured on DeepSpeed 0.14.2's own engine on gloo (rank 0's allocator events, sizes scaled back;
reserved peaks of steps 0-2 against steps 1-2 from an empty cache, PyTorch's default settings):
Qwen1.5-0.5B on one rank, full checkpointing, 4 x 2,048 on 23.5 GiB
(benchmarks/deepspeed_zero3_load_cache.py): steps 1-2 complete, steps 0-2 run out (the published
run ran out); Llama-3-8B on 8 ranks, 12 x 2,048 (benchmarks/deepspeed_zero3_fp16_streams.py
--layers 32): 70.67 GiB on 78.93 for steps 1-2, 77.79 for steps 0-2 (published 76.24).

What deepspeed.initialize allocates before (module.to, each parameter's partition, the clones
and the gradient buffer: benchmarks/deepspeed_zero3_load_cache.py) is not replayed: on the
engine's own trace it adds 0.6-1.0 GiB to the steps' reserved peak, but replayed before this
schedule's steps it moved the peaks by -2.8 to +2.6 GiB, not as the engine's."""

from __future__ import annotations

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.core.deepspeed_stage3_step import steps_by_sub_group, sub_group_steps
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.record import frozen
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Optimizer, Precision
from zeroplan.units import FP32_BYTES

ADAM_STATES = 2
"""exp_avg and exp_avg_sq (fused_adam.py:155-157)."""
RELEASES = frozenset({"0.14.2"})
"""The DeepSpeed releases whose construction and first step were read and recorded."""


@frozen(slots=True)
class DeepSpeedFirstStep:
    """The states' allocations, in bytes (module docstring)."""

    flat_parameters: int
    """The flat 16-bit partition buffer."""
    sub_group_masters: tuple[int, ...]
    """Each sub-group's fp32 master."""
    master_rest: int
    """What the planner's optimizer state holds beside the masters and Adam's states (the step
    counters), allocated with the masters."""
    lazy_states: tuple[int, ...]
    """Adam's two states per sub-group, made in the first optimizer step."""


def applies(request: PlanRequest) -> bool:
    """Whether the request's step is the one read and recorded: DeepSpeed 0.14.2's ZeRO-3 with
    its states on the GPU, fp16 mixed precision, Adam or AdamW, a full fine-tune without
    accumulation, tensor or pipeline parallelism."""
    training = request.training
    return (training.deepspeed_release in RELEASES and steps_by_sub_group(request)
            and training.precision is Precision.fp16_mixed
            and training.optimizer in (Optimizer.adam, Optimizer.adamw) and not training.finetune.is_lora
            and not training.finetune.quantize.is_quantized
            and request.batch.grad_accum_steps == 1 and request.parallel.tp == 1 and request.parallel.pp == 1)


def first_step(request: PlanRequest, states: ModelStateBytes) -> DeepSpeedFirstStep | None:
    """The request's states by tensor (None where the step is not the one read, or where the
    planner's states are not the masters and two Adam states of its sub-groups)."""
    if not applies(request):
        return None
    masters = tuple(cast for _, cast in sub_group_steps(request))
    lazy = tuple(master for master in masters for _ in range(ADAM_STATES))
    rest = states.optimizer_state_bytes - sum(masters) - sum(lazy)
    if not masters or rest < 0 or sum(masters) != FP32_BYTES * states.optimizer_elements:
        return None
    return DeepSpeedFirstStep(flat_parameters=states.parameter_bytes, sub_group_masters=masters,
                              master_rest=rest, lazy_states=lazy)


def record_constructed_states(b: TraceBuilder, states: DeepSpeedFirstStep, resident_buffers: int) -> None:
    """What the engine's construction leaves allocated, in its order (never freed): the flat
    parameters, each sub-group's master, the resident buffers."""
    b.alloc(states.flat_parameters)
    b.alloc_parts(list(states.sub_group_masters))
    b.alloc(states.master_rest)
    b.alloc(resident_buffers)
