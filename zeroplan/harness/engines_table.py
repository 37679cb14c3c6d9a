"""Which engine implements which strategy: the one table the runner and the CLI share (no
torch here, so the command line can check a request before any rank starts)."""

from __future__ import annotations

from enum import Enum

from zeroplan.errors import ZeroplanError
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



def check_supported_names(strategy: str, engine: str) -> str:
    """As check_supported, from the command line's strings."""
    return check_supported(StrategyKind(strategy), EngineKind(engine))
