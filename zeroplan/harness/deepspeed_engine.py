"""DeepSpeed's ZeRO stages 0 (its unpartitioned optimizer), 1, 2 and 3 behind the :class:`~zeroplan.harness.engine.Engine` interface.

DeepSpeed is optional: it is imported when this engine is built, never by the rest of the
harness. Configuration (:func:`deepspeed_config`), chosen so that every recorded byte can be
explained:

* AdamW with :func:`~zeroplan.harness.engine.make_adamw`'s hyper-parameters, as
  ``torch.optim.AdamW`` (``torch_adam``, ``foreach=False``): no compiled op.
* One parameter group (``model.parameters()``), so DeepSpeed flattens the whole model into one
  buffer (stages 1-2) or one sub-group (stage 3, ``sub_group_size`` 1e9).
* ``train_micro_batch_size_per_gpu`` = what the runner feeds, ``gradient_accumulation_steps``
  the run's micro-batches per step, ``gradient_clipping`` 0. With accumulation the engine is
  driven as DeepSpeed's training loop drives it: ``backward`` and ``step`` after every
  micro-batch; DeepSpeed scales each loss by 1/accumulation itself, reduces (stages 2-3) or
  keeps (stage 1) gradients by its own boundary test, and its ``step`` steps the optimizer only
  at the boundary (deepspeed/runtime/engine.py is_gradient_accumulation_boundary).
* fp32, or ``bf16.enabled`` for bf16-mixed: DeepSpeed then casts the module to bf16 and keeps
  an fp32 master partition (no autocast).
* Buckets: ``reduce_bucket_size`` and ``allgather_bucket_size`` = DeepSpeed's default 5e8
  elements capped at the model's parameter count (rounded up to even, which DeepSpeed
  requires): one bucket for a small model, as zeroplan's buffer model assumes
  (zeroplan/core/buffers.py). ``overlap_comm`` off, ``contiguous_gradients`` on (defaults).
* Stage 0: the ``zero_optimization`` block names the stage alone (deepspeed 0.19.8
  runtime/engine.py reads no bucket of it: allreduce_gradients flattens the gradients into
  buckets of MEMORY_OPT_ALLREDUCE_SIZE, 5e8 elements). Under fp16 or bf16 the engine wraps the
  torch AdamW in FP16_UnfusedOptimizer (_do_optimizer_sanity_check: FP16 or DDP_BFLOAT16;
  _configure_fp16_optimizer: not a FusedAdam); under fp32 it steps the torch AdamW itself.
* Stage 3: ``stage3_param_persistence_threshold`` 0 (DeepSpeed's 1e5 default would keep every
  tensor of a small model replicated), ``stage3_max_reuse_distance`` 0 and
  ``stage3_prefetch_bucket_size`` 0 (release each parameter after use, no prefetch), so the
  gather pattern is the ZeRO paper's.

Gradients: DeepSpeed frees them inside ``DeepSpeedEngine.step()`` (its optimizer's
``zero_grad`` is part of the step), before the runner records model states. The gradient
tensors DeepSpeed holds when its inner optimizer starts stepping (the fp32 gradient partition
it hands to AdamW, plus any low-precision partition and bucket still allocated) are captured by
an optimizer step pre-hook and kept until :meth:`DeepSpeedZero.zero_grad`, so the record counts
them at the same point as the other engines' gradients.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zeroplan.errors import ZeroplanError
from zeroplan.harness.engine import (
    ADAMW_BETAS, ADAMW_EPS, ADAMW_LR, ADAMW_WEIGHT_DECAY, MicroBatch, ModelStateTensors, optimizer_state_tensors,
)
from zeroplan.harness.engines_table import DEEPSPEED_INSTALL
from zeroplan.harness.extension_locks import check_no_stale_extension_lock
from zeroplan.harness.model import Transformer, next_token_loss

DEFAULT_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default reduce_bucket_size and allgather_bucket_size (deepspeed/runtime/zero/config.py)."""


def import_deepspeed() -> Any:
    """``import deepspeed`` on the CPU accelerator unless CUDA is there; a one-line error when
    it is not installed, or when a stale JIT build lock would make its op build wait forever
    (checked in every rank too, for runs started with torchrun directly)."""
    check_no_stale_extension_lock()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as error:
        raise ZeroplanError(
            "engine", f"'deepspeed' needs DeepSpeed, which is not importable ({error}); install it with: {DEEPSPEED_INSTALL}"
        ) from None
    return deepspeed


def bucket_elements(model: nn.Module) -> int:
    total = sum(p.numel() for p in model.parameters())
    return min(DEFAULT_BUCKET_ELEMENTS, total + total % 2)


def deepspeed_config(stage: int, dtype: torch.dtype, micro_batch_size: int, buckets: int,
                     offload: bool = False, grad_accum_steps: int = 1, hpz_partition_size: int = 1,
                     mics_shard_size: int = 0) -> dict:
    """The DeepSpeed configuration of a measured run (see the module docstring);
    ``hpz_partition_size`` > 1 turns on ZeRO++'s hpZ at stage 3 (zero_hpz_partition_size);
    ``mics_shard_size`` > 0 MiCS (a DeepSpeed release that still has runtime/zero/mics.py:
    0.19 refuses the key)."""
    if stage == 0:
        return _engine_config(stage, {"stage": 0}, dtype, micro_batch_size, grad_accum_steps)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": buckets,
        "allgather_bucket_size": buckets,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "use_multi_rank_bucket_allreduce": True,
        "round_robin_gradients": False,
    }
    if stage == 3:
        zero.update({
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": DEFAULT_BUCKET_ELEMENTS * 2,
            "sub_group_size": 1_000_000_000,
        })
    if hpz_partition_size > 1:
        assert stage == 3, "hpZ partitions stage 3's parameters"
        zero["zero_hpz_partition_size"] = hpz_partition_size
    if mics_shard_size > 0:
        assert stage == 3, "MiCS shards stage 3's states"
        zero["mics_shard_size"] = mics_shard_size
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return _engine_config(stage, zero, dtype, micro_batch_size, grad_accum_steps)


def _engine_config(stage: int, zero: dict[str, Any], dtype: torch.dtype, micro_batch_size: int,
                   grad_accum_steps: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {
            "lr": ADAMW_LR, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS, "weight_decay": ADAMW_WEIGHT_DECAY,
            "torch_adam": True, "foreach": False,
        }},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.float16:
        config["fp16"] = {"enabled": True}
    return config


class DeepSpeedZero:
    """``deepspeed.initialize`` over ``model`` on the process group the runner started."""

    def __init__(self, model: Transformer, stage: int, dtype: torch.dtype, micro_batch_size: int,
                 offload: bool = False, grad_accum_steps: int = 1, hpz_partition_size: int = 1,
                 file_config: dict | None = None, mics_shard_size: int = 0) -> None:
        """``file_config``: a DeepSpeed config JSON (``--deepspeed-config``, checked against the
        run's flags by zeroplan.harness.deepspeed_file) whose settings replace the harness's;
        :attr:`notes` then says which came from the file and which were kept."""
        assert stage in (0, 1, 2, 3)
        deepspeed = import_deepspeed()
        self.stage, self.offload, self.grad_accum_steps = stage, offload, grad_accum_steps
        config = deepspeed_config(stage, dtype, micro_batch_size, bucket_elements(model), offload, grad_accum_steps,
                                  hpz_partition_size, mics_shard_size)
        self.notes: list[str] = []
        if file_config is not None:
            from zeroplan.harness.deepspeed_file import merge_deepspeed_file

            config, self.notes = merge_deepspeed_file(config, file_config)
        self.config = config
        # torch.distributed is initialised already: deepspeed.comm wraps the default group.
        self.ds, self.zero_optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, dist_init_required=False,
        )
        self.module: nn.Module = self.ds.module
        # The torch AdamW that steps the flat fp32 partitions (stage 0: the fp32 masters, or the
        # parameters themselves under fp32): what MemTracker and the optimizer-state count read.
        self.optimizer: torch.optim.Optimizer = getattr(self.zero_optimizer, "optimizer", self.zero_optimizer)
        self._step_gradients: list[torch.Tensor] = []
        self._step_buffers: list[torch.Tensor] = []
        self.optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self._capture_gradients())

    @property
    def stage3_settings(self):
        """The ZeRO-3 settings that decide the parameter gathers (the record's deepspeed_stage3);
        None below stage 3. deepspeed_config sets all three at stage 3 and a file's replace them."""
        if self.stage != 3:
            return None
        from zeroplan.harness.record import DeepSpeedStage3Settings

        zero = self.config["zero_optimization"]
        return DeepSpeedStage3Settings(
            prefetch_bucket_size=int(zero["stage3_prefetch_bucket_size"]),
            max_live_parameters=int(zero["stage3_max_live_parameters"]),
            param_persistence_threshold=int(zero["stage3_param_persistence_threshold"]),
        )

    # -- training ---------------------------------------------------------------------------

    def forward_backward(
        self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, micro: MicroBatch = MicroBatch()
    ) -> torch.Tensor:
        assert micro.count == self.grad_accum_steps, "the runner feeds the micro-batches DeepSpeed was configured for"
        loss = next_token_loss(self.ds(tokens_BS), targets_BS)
        self.ds.backward(loss)
        if not micro.is_last:
            # Not the boundary: DeepSpeed's step only counts the micro-batch (the runner's own
            # step() after the last one is the boundary's).
            self.ds.step()
        return loss.detach()

    def step(self) -> None:
        self._step_gradients, self._step_buffers = [], []
        self.ds.step()

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        self._step_gradients, self._step_buffers = [], []

    # -- what DeepSpeed holds ---------------------------------------------------------------

    def _held_gradients(self) -> list[torch.Tensor]:
        """Every gradient tensor DeepSpeed's ZeRO optimizer holds right now."""
        opt = self.zero_optimizer
        found: list[torch.Tensor] = []

        def add(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    add(item)
            elif isinstance(value, dict):
                for item in value.values():
                    add(item)
            elif value is not None and hasattr(value, "flat_partition"):
                add(value.flat_partition)

        for p in self.module.parameters():  # low-precision gradients not yet reduced or freed
            add(p.grad)
            add(getattr(p, "grad_accum", None))
        if self.stage == 0:
            return [t for t in found + [m.grad for m in self._masters() if m.grad is not None]
                    if t.untyped_storage().nbytes() > 0]
        add(getattr(opt, "averaged_gradients", None))
        add(getattr(opt, "grads_in_partition", None))
        if self.stage == 3:
            masters = opt.fp32_partitioned_groups_flat
        else:
            masters = opt.single_partition_of_fp32_groups
        for master in masters:
            add(master.grad)  # the fp32 gradient partition AdamW reads
        return [t for t in found if t.untyped_storage().nbytes() > 0]

    def _held_buffers(self) -> list[torch.Tensor]:
        """DeepSpeed's communication buffers held right now: the reduce ("ipg") buckets
        (stage_1_and_2.py / stage3.py, torch.empty(reduce_bucket_size) with contiguous_gradients)
        and at stage 3 grad_partitions_flat_buffer, which the reduced partitions are copied into
        before the fp32 partition AdamW reads is made from it (stage3.py __init__,
        partition_grads). The planner counts both as buffers (zeroplan.core.deepspeed_accumulation
        stage3_resident_bytes), not gradients: one definition (docs/harness.md)."""
        opt = self.zero_optimizer
        found = [getattr(bucket, "buffer", None) for bucket in getattr(opt, "ipg_buckets", {}).values()]
        if self.stage == 3:
            found.append(getattr(opt, "grad_partitions_flat_buffer", None))
        return [t for t in found if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0]

    def _capture_gradients(self) -> None:
        self._step_gradients = self._held_gradients()
        self._step_buffers = self._held_buffers()

    def _masters(self) -> list[torch.Tensor]:
        opt = self.zero_optimizer
        if self.stage == 0:
            # FP16_UnfusedOptimizer's per-parameter fp32 copies (unfused_optimizer.py __init__:
            # fp32_groups); none under fp32, where AdamW steps the parameters.
            return [m for group in getattr(opt, "fp32_groups", []) for m in group]
        return list(opt.fp32_partitioned_groups_flat if self.stage == 3 else opt.single_partition_of_fp32_groups)

    def _parameters(self) -> list[torch.Tensor]:
        opt = self.zero_optimizer
        if self.stage == 0:
            return [p.data for p in self.module.parameters()]
        if self.stage == 3:
            # The partitioned working parameters (views of DeepSpeed's flat lp buffer), then any
            # parameter that is gathered right now.
            held = list(opt.fp16_partitioned_groups_flat)
            held += [p.ds_tensor for p in self.module.parameters()]
            held += [p.data for p in self.module.parameters() if p.data.numel() > 0]
            return held
        return list(opt.bit16_groups_flat)

    def secondary_parameter_tensors(self) -> list[torch.Tensor]:
        """hpZ's secondary parameter partitions held right now (deepspeed 0.19.8
        partition_parameters.py _partition_param_sec: param.ds_secondary_tensor, built as the
        forward releases each parameter, dropped by the step's invalidate_secondary_tensor)."""
        return [p.ds_secondary_tensor for p in self.module.parameters()
                if getattr(p, "ds_secondary_tensor", None) is not None]

    def _host_tensors(self) -> list[torch.Tensor]:
        """With offload_optimizer, what DeepSpeed places on its offload device ('cpu'): the fp32
        master partition, its gradient, AdamW's states, and the staging buffers it copies
        through (stage_1_and_2.py: param_buffer_of_bit16_for_cpu_offload_groups,
        temp_grad_buffer_for_cpu_offload; stage3.py: grad_partitions_flat_buffer)."""
        opt = self.zero_optimizer
        host = self._masters() + [m.grad for m in self._masters() if m.grad is not None]
        host += optimizer_state_tensors(self.optimizer)
        for name in ("param_buffer_of_bit16_for_cpu_offload_groups",):
            host += list(getattr(opt, name, None) or [])
        for name in ("temp_grad_buffer_for_cpu_offload", "grad_partitions_flat_buffer"):
            value = getattr(opt, name, None)
            if isinstance(value, torch.Tensor):
                host.append(value)
        return host

    def model_state_tensors(self) -> ModelStateTensors:
        gradients = self._step_gradients or self._held_gradients()
        buffers = self._step_buffers or self._held_buffers()
        if self.offload:
            host = self._host_tensors()
            on_host = {t.untyped_storage().data_ptr() for t in host}
            gradients = [g for g in gradients if g.untyped_storage().data_ptr() not in on_host]
            buffers = [b for b in buffers if b.untyped_storage().data_ptr() not in on_host]
            # The device-side staging buffer of offloaded gradients (the largest parameter).
            staging = getattr(self.zero_optimizer, "temp_grad_buffer_for_gpu_offload", None)
            if isinstance(staging, torch.Tensor):
                buffers.append(staging)
            return ModelStateTensors(self._parameters(), gradients, [], host, buffers)
        # As in the reference ZeRO, the fp32 master partition is counted with the optimizer
        # states (the ZeRO paper's K). DeepSpeed clones it even under fp32, so unlike the
        # reference it is never the parameter storage itself.
        optimizer = self._masters() + optimizer_state_tensors(self.optimizer)
        return ModelStateTensors(self._parameters(), gradients, optimizer, buffers=buffers)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        named = list(self.module.named_parameters())
        if self.stage < 3:
            return {name: p.detach().clone() for name, p in named}
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {name: p.detach().clone() for name, p in named}
