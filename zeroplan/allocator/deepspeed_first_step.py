"""DeepSpeed ZeRO-3's optimizer from its build to its first step, as each release the planner
models makes it (docs/memory-model.md, "DeepSpeed ZeRO-3's optimizer build and first step"): the
one owner of what the schedule allocates before the step's first activation and of where the
optimizer's own states are made. Nothing here imports torch.

Read in runtime/zero/stage3.py at each release (0.13.3 and 0.14.2 have the same lines here;
0.19.8 is the one installed in the project's environment):
- _create_fp16_partitions_with_defragmentation -> defragment (0.13.3/0.14.2 :526-551,
  ``gc.collect(); empty_cache()`` at :550-551; 0.19.8 zero/utils.py:215-234): every parameter's
  partition copied into one flat buffer in the model dtype after the cache was emptied: what the
  process holds from there on starts here.
- _create_fp32_partitions: each sub-group's fp32 master is made from its flat partition, in
  order. 0.13.3/0.14.2 :861-864 ``flat.to(device).clone().float().detach()``, one expression: a
  clone in the model dtype, then its fp32 copy, the clone dropped at once (its segment cached).
  From 0.18.3 (39a682d79), 0.19.8 :1170-1172: ``converted = flat.to(device, dtype=fp32)`` then
  ``append(converted.clone().detach())``: the transient is the fp32 copy, held by the local until
  the next sub-group's ``converted`` is made (the last one until the function returns).
- initialize_optimizer_states (0.13.3/0.14.2 :978-1044; 0.19.8 :1301-1371): a gradient buffer of
  the largest sub-group's elements in the master's dtype (``torch.zeros``, :983 / :1306) handed to
  every master's ``.grad`` as a view and dropped at the end (``group.grad = None``): made and
  freed. No optimizer step: the step that made Adam's states there (``self._optimizer_step(i)``,
  0.12.3 :1008) went in 0.13.2 (18179807f, "Remove optimizer step on initialization"); only
  torch's Adagrad, rebuilt there, has its states from construction (no optimizer the planner
  offers).
- _setup_for_real_optimizer (0.13.3/0.14.2 :488-499; 0.19.8 :779-791): the ipg bucket, then
  grad_partitions_flat_buffer (the planner's resident buffers), carved from the gradient buffer's
  cached segment where they fit.
- The optimizer's states: ops/adam/fused_adam.py:149-157 at all three releases (the FusedAdam a
  config's "AdamW"/"Adam" builds on the GPU) makes ``exp_avg`` and ``exp_avg_sq`` with
  ``torch.zeros_like`` when a master's state is empty, inside the step; torch's Adam/AdamW
  (``torch_adam``, or the Trainer's own optimizer handed in) and SGD's momentum make theirs in
  their step's _init_group alike. ZeRO-3 steps one sub-group at a time (stage3.py _optimizer_step
  in step()), so each sub-group's states are made as its update starts, in the first step that is
  not skipped for overflow (fp16's loss scaler may skip the first ones; bf16's none): after that
  step's forward and backward have freed their tensors into the cache, whose blocks they take and
  split. CPU Adam runs only under offload_optimizer, outside this schedule.

So the trace allocates the model's buffers the engine moved before (zeroplan.core.buffers
engine_module_buffer_bytes), the flat parameters, each sub-group's transient and master, the
gradient buffer made and freed, the ipg bucket and the gradient partitions, then runs two steps:
the first makes each sub-group's optimizer states as its update starts, the second runs with them.

Measured on DeepSpeed's own engines on gloo (rank 0's allocator events, sizes scaled back):
- 0.12.3 and 0.13.3, Qwen-1.8B 16 times narrower under Qwen's ds_config_zero3.json, bf16, one rank
  (benchmarks/deepspeed_zero3_one_rank_process.py): after the last empty_cache the flat
  parameters, per sub-group the clone and its fp32 copy, the fp32 gradient buffer, the gradient
  partition buffer, and the Adam states (at the build in 0.12.3, in the first step in 0.13.3), in
  that order; reserved 35.70 / 35.72 GiB at 256 tokens.
- 0.14.2, fp16 (benchmarks/deepspeed_zero3_load_cache.py): Qwen1.5-0.5B on one rank, full
  checkpointing: after defragment's empty_cache the flat buffer, the clone, the master, the clone
  freed, the gradient buffer made and freed, the ipg bucket, the gradient partitions, in that
  order; reserved through steps 0-2 from there 14.77 / 21.10 / 21.69 GiB at micro-batch 1 / 2 / 3
  x 2,048 (planned 14.91 / 19.00 / 21.89), 12.53 / 15.98 / 21.74 under expandable segments
  (planned 12.68 / 16.15 / 21.96); without checkpointing 13.68 at 1 x 1,024 and 24.84 at
  2 x 2,048 (planned 14.99 and 23.14); Llama-3-8B on 8 ranks, 1 x 1,040 without checkpointing:
  the same build, 46.23 (planned 45.03; 40.26 and 40.27 under expandable segments); 4 x 2,048 on 23.5 GiB runs out from step 0 and completes from step 1
  (the published run ran out); Llama-3-8B on 8 ranks, 12 x 2,048
  (benchmarks/deepspeed_zero3_fp16_streams.py --layers 32): 77.79 GiB on 78.93 from step 0,
  70.67 from step 1 (published 76.24).
What deepspeed.initialize allocates before defragment's empty_cache (module.to, each parameter's
partition) is not replayed: that cache is emptied before the build starts."""

from __future__ import annotations

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.core.buffers import engine_module_buffer_bytes
from zeroplan.core.deepspeed_accumulation import _bucket_elements, _model_dtype_bytes, stage3_resident_bytes
from zeroplan.core.deepspeed_bf16_autocast import step_cast_element_bytes
from zeroplan.core.deepspeed_stage3_step import steps_by_sub_group
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms
from zeroplan.core.nvme import sub_group_partition_elements
from zeroplan.core.record import frozen
from zeroplan.specs.framework import EARLIER_HF_DEEPSPEED_RELEASES
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


@frozen(slots=True)
class DeepSpeedFirstStep:
    """The optimizer's allocations from the build to the first step, in bytes (module docstring)."""

    flat_parameters: int
    """The flat partition buffer in the model dtype."""
    sub_groups: tuple[tuple[int, int], ...]
    """Each sub-group's (transient, fp32 master), in order: the transient made before its master."""
    transient_to_next: bool
    """The transient is freed once the next sub-group's is made (the last at the build's end),
    not as soon as its master is (clones_fp32_copy)."""
    master_rest: int
    """What the planner's optimizer state holds beside the masters and the states made in the
    first step (the step counters; states not of a master's shape), allocated with the masters."""
    init_gradient_buffer: int
    """initialize_optimizer_states' gradient buffer of the largest sub-group, made and freed."""
    lazy_states: tuple[tuple[int, ...], ...]
    """The optimizer's states per sub-group (each its master's size: Adam's two), made as the
    first step updates it."""
    module_buffers: int
    """The model's own buffers the engine moved to the device before the build (allocated first)."""
    resident_parts: tuple[int, ...]
    """The planner's resident buffers as the build makes them after the gradient buffer: the ipg
    bucket, grad_partitions_flat_buffer, then the rest (scalars, hpZ's secondary partition)."""

    @property
    def sub_group_masters(self) -> tuple[int, ...]:
        """Each sub-group's fp32 master."""
        return tuple(master for _, master in self.sub_groups)


# stage3.py:861-864 at v0.13.3/v0.14.2: ``flat.to(device).clone().float().detach()``, one expression,
# whose model-dtype clone is dropped once .float() has made the master. From 0.18.3 (39a682d79),
# 0.19.8 :1170-1172: ``converted = flat.to(device, dtype=fp32)`` then
# ``append(converted.clone().detach())``: the transient is the fp32 copy, a local that lives until
# the next sub-group's ``converted`` is made and rebinds it (the last until the function returns).
def clones_fp32_copy(request: PlanRequest) -> bool:
    """Whether _create_fp32_partitions casts each sub-group first and clones the fp32 copy (0.19.8),
    rather than cloning it in the model dtype (0.13.3, 0.14.2)."""
    return request.training.deepspeed_release not in EARLIER_HF_DEEPSPEED_RELEASES


# initialize_optimizer_states makes no optimizer step at any release modelled (0.13.3/0.14.2
# stage3.py:978-1044, 0.19.8 :1301-1371; removed in 0.13.2, 18179807f): ops/adam/fused_adam.py:149-157
# (torch's Adam alike) makes the states inside the first step, fp16 or bf16.
def applies(request: PlanRequest) -> bool:
    """Whether the optimizer's build and first step are replayed: DeepSpeed ZeRO-3's step on the
    GPU (no offload) over fp32 masters of a 16-bit model, at any release the profiles model
    (all make the optimizer's states in the first step: module docstring)."""
    if not steps_by_sub_group(request):
        return False
    e = _model_dtype_bytes(request)
    return e != FP32_BYTES and step_cast_element_bytes(request, e) == FP32_BYTES


# stage3.py _setup_for_real_optimizer after initialize_optimizer_states: 0.13.3/0.14.2 :488-499
# (``torch.empty(reduce_bucket_size)`` under contiguous_gradients, then grad_partitions_flat_buffer
# ``torch.zeros``), 0.19.8 :779-791 the same two; the model's buffers were moved with the module
# before the optimizer was built (engine.py:1099-1112 at v0.14.2, zeroplan.core.buffers).
def resident_parts(request: PlanRequest, resident_buffers: int) -> tuple[int, tuple[int, ...]] | None:
    """The module's buffers and the build's resident buffers in their order (None where the
    planner's resident buffers are not made of them)."""
    module = engine_module_buffer_bytes(request)
    stage3 = stage3_resident_bytes(request)
    bucket = _bucket_elements(request) * _model_dtype_bytes(request) if request.strategy.deepspeed_contiguous_gradients else 0
    rest = resident_buffers - module - stage3
    if rest < 0 or bucket > stage3:
        return None
    return module, (bucket, stage3 - bucket, rest)


def first_step(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms) -> DeepSpeedFirstStep | None:
    """The request's optimizer from its build to its first step (None where it does not apply,
    or where the planner's states are not the sub-groups' fp32 masters and what lies beside)."""
    if not applies(request):
        return None
    resident = resident_parts(request, terms.resident_buffers)
    if resident is None:
        return None
    elements = sub_group_partition_elements(request)
    fp32_copy = clones_fp32_copy(request)
    transient = FP32_BYTES if fp32_copy else _model_dtype_bytes(request)
    masters = [n * FP32_BYTES for n in elements]
    others = states.optimizer_state_bytes - sum(masters)
    if not masters or others < 0 or sum(masters) != FP32_BYTES * states.optimizer_elements:
        return None
    # The states of a master's shape (Adam's exp_avg and exp_avg_sq; SGD's momentum), made in the
    # first step; what is left (step counters) is allocated with the masters.
    per_master = others // sum(masters)
    lazy = tuple(tuple(master for _ in range(per_master)) for master in masters)
    return DeepSpeedFirstStep(flat_parameters=states.parameter_bytes,
                              sub_groups=tuple((n * transient, n * FP32_BYTES) for n in elements),
                              transient_to_next=fp32_copy,
                              master_rest=others - per_master * sum(masters),
                              init_gradient_buffer=max(elements) * FP32_BYTES, lazy_states=lazy,
                              module_buffers=resident[0], resident_parts=resident[1])


def record_constructed_states(b: TraceBuilder, states: DeepSpeedFirstStep) -> None:
    """What the engine's build leaves, in its order: the module's buffers, then after
    defragment's empty_cache the flat parameters, each sub-group's transient (freed) and master,
    the rest of the planner's optimizer state, the gradient buffer made and freed, the resident
    buffers."""
    b.alloc(states.module_buffers)
    b.alloc(states.flat_parameters)
    previous: list[int] = []
    for transient, master in states.sub_groups:
        made = b.alloc(transient)
        if states.transient_to_next:
            b.free(previous)
            previous = made
            b.alloc(master)
        else:
            b.alloc(master)
            b.free(made)
    b.free(previous)
    b.alloc(states.master_rest)
    b.free(b.alloc(states.init_gradient_buffer))
    for part in states.resident_parts:
        b.alloc(part)
