"""Typed, frozen specs: what the user asks about."""

from zeroplan.specs.finetune import BaseDtype, FineTuneSpec, LoraTarget, Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import (
    AchievedBusBandwidth,
    ClusterSpec,
    GpuArchitecture,
    GpuSpec,
    HostSpec,
    LinkSpec,
    NodeNetworkSpec,
    cluster_from_gpus,
)
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind
from zeroplan.specs.request import MemoryAssumptions, PerformanceAssumptions, PlanRequest, check_seq_len
from zeroplan.specs.strategy import StrategyKind, StrategySpec, ZeroGradientReduce
from zeroplan.specs.training import (
    ActivationCheckpointing,
    AttentionImplementation,
    AttentionKernel,
    BatchSpec,
    Float8Recipe,
    Objective,
    Optimizer,
    OptimizerLoop,
    Kernels,
    Precision,
    StateConvention,
    TrainingSpec,
)

__all__ = [
    "AchievedBusBandwidth",
    "ActivationCheckpointing",
    "AttentionImplementation",
    "AttentionKernel",
    "BaseDtype",
    "BatchSpec",
    "ClusterSpec",
    "FineTuneSpec",
    "Float8Recipe",
    "Objective",
    "Framework",
    "GpuArchitecture",
    "GpuSpec",
    "HostSpec",
    "LinkSpec",
    "LoraTarget",
    "NodeNetworkSpec",
    "MemoryAssumptions",
    "MlpKind",
    "ModelSpec",
    "NormKind",
    "Optimizer",
    "OptimizerLoop",
    "PerformanceAssumptions",
    "PlanRequest",
    "PositionKind",
    "Kernels",
    "Precision",
    "Quantization",
    "StateConvention",
    "StrategyKind",
    "StrategySpec",
    "ZeroGradientReduce",
    "TrainingSpec",
    "check_seq_len",
    "cluster_from_gpus",
]
