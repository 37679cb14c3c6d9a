"""Build the engine that runs a strategy (the table of which is where: engines_table.py)."""

from __future__ import annotations

import torch

from zeroplan.harness.engine import Engine
from zeroplan.harness.engines_table import EngineKind, check_supported  # noqa: F401  (re-exported)
from zeroplan.harness.model import Transformer
from zeroplan.specs import Optimizer, StrategyKind


def build_engine(
    model: Transformer, strategy: StrategyKind, engine: EngineKind, dtype: torch.dtype,
    optimizer: Optimizer = Optimizer.adamw, keep_unsharded_grads_on_accum: bool = False,
    micro_batch_size: int = 1, grad_accum_steps: int = 1, deepspeed_file: dict | None = None,
) -> Engine:
    """The engine; ``keep_unsharded_grads_on_accum`` is the planner's StrategySpec knob of the
    same name (ddp and zero1 reduce once per step either way); ``micro_batch_size`` and
    ``grad_accum_steps`` are what the runner feeds each rank per step (DeepSpeed's config needs
    both); ``deepspeed_file`` is a checked ``--deepspeed-config`` JSON (deepspeed_file.py)."""
    check_supported(strategy, engine, optimizer)
    keep = keep_unsharded_grads_on_accum
    if engine is EngineKind.deepspeed:
        from zeroplan.harness.deepspeed_engine import DeepSpeedZero

        return DeepSpeedZero(model, strategy.zero_stage, dtype, micro_batch_size,
                             offload=strategy.offloads_optimizer, grad_accum_steps=grad_accum_steps,
                             file_config=deepspeed_file)
    if engine is EngineKind.zeroplan:
        from zeroplan.harness.zero import ReferenceZero

        return ReferenceZero(model, strategy.zero_stage, dtype, optimizer, keep_unsharded_grads_on_accum=keep)
    from zeroplan.harness import torch_engines as te

    if strategy is StrategyKind.ddp:
        return te.DdpEngine(model, dtype, optimizer)
    if strategy is StrategyKind.zero1:
        return te.DdpEngine(model, dtype, optimizer, zero1=True)
    full_shard = strategy is StrategyKind.fsdp_full_shard
    if engine is EngineKind.torch_fsdp1:
        return te.Fsdp1Engine(model, dtype, optimizer, full_shard, keep_unsharded_grads_on_accum=keep)
    return te.Fsdp2Engine(model, dtype, optimizer, reshard_after_forward=full_shard, keep_unsharded_grads_on_accum=keep)
