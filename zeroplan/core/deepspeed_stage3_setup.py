"""What DeepSpeed ZeRO-3's optimizer makes on the device as it is built, after its last
empty_cache: the transients whose cached segments the caching allocator keeps into training
(neither the engine nor the Trainer empties the cache again). Nothing here imports torch.

stage3.py at v0.12.3 (v0.13.3 and v0.14.2 the same lines, give or take ten):
- _create_fp16_partitions_with_defragmentation -> defragment (:519-553): the parameter
  partitions go to one CPU buffer, ``gc.collect(); empty_cache()`` (:544), then back as one flat
  device buffer in the model dtype: what the process holds from there on starts here.
- _create_fp32_partitions (:853-854): each sub-group's master is
  ``fp16_partitioned_groups_flat[i].to(device).clone().float().detach()``: a clone in the model
  dtype, then its fp32 copy; the clone is freed, its segment cached (none where the model dtype is
  fp32: ``.float()`` returns the clone, which is the master). DeepSpeed 0.19.8 (stage3.py:1170-1172)
  casts first, ``.to(device, dtype=fp32)``, then clones the fp32 copy: the transient is fp32.
- initialize_optimizer_states (:965-1034): ``gradient_buffer = torch.zeros(largest sub-group,
  fp32)``, each sub-group's fp32 ``.grad`` a view of it (through 0.13.1 the Adam states were made
  there by an optimizer step; from 0.13.2, 18179807f, they are made lazily at the first step), and
  every ``.grad`` set to None at the end (:1030-1032): freed, its segment cached.
- _setup_for_real_optimizer (:481-501): the ipg bucket and grad_partitions_flat_buffer are made
  after it, and are carved from those cached segments where they fit.

Measured on DeepSpeed 0.12.3's and 0.13.3's own engines, one gloo rank, Qwen-1.8B made 16 times
narrower under Qwen's ds_config_zero3.json (benchmarks/deepspeed_zero3_one_rank_process.py): the
allocations after the last empty_cache are the flat parameters, then per sub-group the clone and
its fp32 copy, then the fp32 gradient buffer, the gradient partition buffer, and the Adam states
(at init in 0.12.3, in the first step in 0.13.3), in that order."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _model_dtype_bytes
from zeroplan.core.deepspeed_bf16_autocast import step_cast_element_bytes
from zeroplan.core.deepspeed_stage3_step import steps_by_sub_group
from zeroplan.core.nvme import sub_group_partition_elements
from zeroplan.specs.framework import EARLIER_HF_DEEPSPEED_RELEASES
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


def models_setup(request: PlanRequest) -> bool:
    """Whether the optimizer's build is modelled: DeepSpeed ZeRO-3's step on the GPU over fp32
    masters of a 16-bit model (elsewhere the trace starts from the states as they stand)."""
    if not steps_by_sub_group(request):
        return False
    e = _model_dtype_bytes(request)
    return e != FP32_BYTES and step_cast_element_bytes(request, e) == FP32_BYTES


# stage3.py:853-854 at v0.12.3 (.clone() in the model dtype, then .float()); 0.19.8 :1170-1172
# (.to(fp32), then .clone() of the fp32 copy).
def setup_sub_groups(request: PlanRequest) -> tuple[tuple[int, int], ...]:
    """Each optimizer sub-group's (transient, fp32 master) bytes as _create_fp32_partitions makes
    them, in order (empty where models_setup does not hold)."""
    if not models_setup(request):
        return ()
    release = request.training.deepspeed_release
    transient = _model_dtype_bytes(request) if release in EARLIER_HF_DEEPSPEED_RELEASES else FP32_BYTES
    return tuple((n * transient, n * FP32_BYTES) for n in sub_group_partition_elements(request))


# stage3.py:968-970 at v0.12.3: torch.zeros(largest sub-group's elements, fp32), freed at :1030-1032.
def init_gradient_buffer_bytes(request: PlanRequest) -> int:
    """initialize_optimizer_states' fp32 gradient buffer of the largest sub-group (0 where
    models_setup does not hold)."""
    if not models_setup(request):
        return 0
    return max(sub_group_partition_elements(request), default=0) * FP32_BYTES
