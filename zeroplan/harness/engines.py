"""Which engine implements which strategy: the one table the runner and the CLI share."""

from __future__ import annotations

from enum import Enum

import torch

from zeroplan.errors import ZeroplanError
from zeroplan.harness.engine import Engine
from zeroplan.harness.model import Transformer
from zeroplan.specs import StrategyKind


class EngineKind(str, Enum):
    """Whose implementation runs the strategy."""

    zeroplan = "zeroplan"
    """zeroplan's reference ZeRO (zeroplan.harness.zero)."""
    torch = "torch"
    """PyTorch: DDP, ZeroRedundancyOptimizer (zero1), FSDP2 fully_shard (fsdp-*)."""
    torch_fsdp1 = "torch-fsdp1"
    """PyTorch's FullyShardedDataParallel (FSDP1), for the fsdp-* strategies."""


SUPPORTED: dict[tuple[StrategyKind, EngineKind], str] = {
    (StrategyKind.ddp, EngineKind.torch): "DistributedDataParallel",
    (StrategyKind.zero1, EngineKind.zeroplan): "reference ZeRO stage 1",
    (StrategyKind.zero2, EngineKind.zeroplan): "reference ZeRO stage 2",
    (StrategyKind.zero3, EngineKind.zeroplan): "reference ZeRO stage 3",
    (StrategyKind.zero1, EngineKind.torch): "DDP + ZeroRedundancyOptimizer",
    (StrategyKind.fsdp_full_shard, EngineKind.torch): "FSDP2 fully_shard(reshard_after_forward=True)",
    (StrategyKind.fsdp_shard_grad_op, EngineKind.torch): "FSDP2 fully_shard(reshard_after_forward=False)",
    (StrategyKind.fsdp_full_shard, EngineKind.torch_fsdp1): "FSDP1 FULL_SHARD",
    (StrategyKind.fsdp_shard_grad_op, EngineKind.torch_fsdp1): "FSDP1 SHARD_GRAD_OP",
}


def check_supported(strategy: StrategyKind, engine: EngineKind) -> str:
    """The implementation's name; a one-line error naming the valid engines otherwise."""
    if (strategy, engine) in SUPPORTED:
        return SUPPORTED[(strategy, engine)]
    engines = sorted(e.value for (s, e) in SUPPORTED if s is strategy)
    if not engines:
        strategies = sorted({s.value for s, _ in SUPPORTED})
        raise ZeroplanError("strategy", f"{strategy.value!r} cannot be measured (measurable: {', '.join(strategies)})")
    raise ZeroplanError(
        "engine", f"{engine.value!r} does not implement {strategy.value!r} (use: {', '.join(engines)})"
    )


def build_engine(model: Transformer, strategy: StrategyKind, engine: EngineKind, dtype: torch.dtype) -> Engine:
    check_supported(strategy, engine)
    if engine is EngineKind.zeroplan:
        from zeroplan.harness.zero import ReferenceZero

        return ReferenceZero(model, strategy.zero_stage, dtype)
    from zeroplan.harness import torch_engines as te

    if strategy is StrategyKind.ddp:
        return te.DdpEngine(model, dtype)
    if strategy is StrategyKind.zero1:
        return te.DdpEngine(model, dtype, zero1=True)
    full_shard = strategy is StrategyKind.fsdp_full_shard
    if engine is EngineKind.torch_fsdp1:
        return te.Fsdp1Engine(model, dtype, full_shard)
    return te.Fsdp2Engine(model, dtype, reshard_after_forward=full_shard)
