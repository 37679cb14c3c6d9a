"""The roofline compute model (zeroplan.core.roofline) against one GPU's profiled steps
(benchmarks/gpu-step-profile-records, made by benchmarks/gpu_step_profile.py on an H200).

Torch-free: a record is gzipped JSON with every device kernel of one profiled step (name, start,
duration), the phase times from CUDA events, and the model. Kernels are put in the model's
categories by name (cuBLAS/nvjet products, cuDNN/flash attention, everything else memory-bound)
and by time (kernels inside the optimizer's annotation are the optimizer step), then compared
with the roofline's terms for the same request: docs/validation.md, "Step time, kernel by kernel".
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from zeroplan.core.roofline.operations import OpKind, OpPass
from zeroplan.core.roofline.step import RooflineStep, roofline_step
from zeroplan.presets.gpus import get_gpu
from zeroplan.specs import (
    ActivationCheckpointing, BatchSpec, ClusterSpec, ModelSpec, PerformanceAssumptions, PlanRequest, StrategyKind,
    StrategySpec, TrainingSpec,
)
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import OptimizerLoop
from zeroplan.specs.recipe_defaults import as_run
from zeroplan.validate.rows import FLAT_RESERVE

STEP_PROFILE_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu-step-profile-records" / "steps"

ANNOTATION_PREFIXES = ("Optimizer.", "DistributedDataParallel.", "FSDP::", "ProfilerStep", "autograd::")
"""torch.profiler's user annotations, which the device timeline lists beside the kernels."""
MATMUL_MARKERS = ("nvjet", "gemm", "cutlass", "xmma")
ATTENTION_MARKERS = ("sdpa", "flash", "fmha", "cudnn")

CATEGORIES = ("matmul", "attention", "memory", "optimizer")


def kernel_category(name: str) -> str | None:
    """'matmul', 'attention' or 'memory' for a device kernel; None for an annotation."""
    if name.startswith(ANNOTATION_PREFIXES):
        return None
    lowered = name.lower()
    if any(marker in lowered for marker in MATMUL_MARKERS):
        return "matmul"
    if any(marker in lowered for marker in ATTENTION_MARKERS):
        return "attention"
    return "memory"


class StepProfile(Frozen):
    """One profiled step and its kernels' device seconds by category."""

    name: str
    strategy: StrategyKind
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: ActivationCheckpointing
    world_size: int
    device_name: str
    torch_version: str
    model: ModelSpec
    forward_backward_s: float | None
    """CUDA events around forward and backward: the fastest of the timed steps (None for a CPU
    smoke run, which has no CUDA events)."""
    optimizer_step_s: float | None
    """CUDA events around the optimizer step: the fastest of the timed steps (None likewise)."""
    kernel_s: dict[str, float]
    """Device seconds of the profiled step's kernels per category (CATEGORIES)."""


def _fastest(seconds: list[float]) -> float | None:
    return min(seconds) if seconds else None


def load_step_profile(path: Path) -> StepProfile:
    with gzip.open(path, "rt") as handle:
        document = json.load(handle)
    events = document["device_events"]
    windows = [(e["start_us"], e["start_us"] + e["duration_us"]) for e in events if e["name"].startswith("Optimizer.")]
    kernel_s = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        category = kernel_category(event["name"])
        if category is None:
            continue
        if any(start <= event["start_us"] <= end for start, end in windows):
            category = "optimizer"
        kernel_s[category] += event["duration_us"] / 1e6
    strategy = document["strategy_engine"].split(":")[0]
    return StepProfile(
        name=path.name.removesuffix(".json.gz"), strategy=StrategyKind(strategy), micro_batch_size=document["micro_batch"],
        seq_len=document["seq_len"], activation_checkpointing=ActivationCheckpointing(document["activation_checkpointing"]),
        world_size=document["world_size"], device_name=document["device_name"], torch_version=document["torch_version"],
        model=ModelSpec.model_validate(document["model"]),
        forward_backward_s=_fastest(document["phase_device_s"]["forward_backward"]),
        optimizer_step_s=_fastest(document["phase_device_s"]["optimizer_step"]), kernel_s=kernel_s,
    )


def step_profiles(directory: Path = STEP_PROFILE_DIR) -> list[StepProfile]:
    return [load_step_profile(path) for path in sorted(directory.glob("*.json.gz"))]


def profile_request(profile: StepProfile) -> PlanRequest:
    """The planner's request for a profiled step: the harness's engine on rank 0 of the fake
    group (FSDP2 with bf16 parameters, or DDP under autocast over fp32 parameters), its AdamW
    with foreach=False (zeroplan/harness/engine.py), bf16-mixed, flash attention, one H200."""
    training = TrainingSpec(activation_checkpointing=profile.activation_checkpointing,
                            optimizer_loop=OptimizerLoop.for_loop)
    return PlanRequest(
        model=profile.model, training=as_run(training),
        batch=BatchSpec(micro_batch_size=profile.micro_batch_size, seq_len=profile.seq_len, allow_longer_seq=True),
        cluster=ClusterSpec(gpu=get_gpu("h200-141gb"), gpus_per_node=profile.world_size),
        strategy=StrategySpec(kind=profile.strategy), performance=PerformanceAssumptions(compute_model="roofline"),
        assumptions=FLAT_RESERVE,
    )


def predicted_kernel_s(step: RooflineStep) -> dict[str, float]:
    """The roofline's seconds in the profile's categories."""
    compute = (OpPass.forward, OpPass.backward, OpPass.recompute)
    return {
        "matmul": step.seconds(*compute, kind=OpKind.matmul),
        "attention": step.seconds(*compute, kind=OpKind.attention),
        "memory": step.seconds(*compute, kind=OpKind.memory),
        "optimizer": step.optimizer_s,
    }


class ProfileComparison(Frozen):
    """Measured and predicted seconds of one profiled step."""

    profile: StepProfile
    predicted_s: dict[str, float]
    """Per category, and 'forward_backward' (the roofline's forward plus backward)."""

    @property
    def measured_kernel_forward_backward_s(self) -> float:
        return sum(self.profile.kernel_s[c] for c in ("matmul", "attention", "memory"))


def compare_profile(profile: StepProfile) -> ProfileComparison:
    step = roofline_step(profile_request(profile))
    predicted = predicted_kernel_s(step)
    predicted["forward_backward"] = step.forward_s + step.backward_s
    return ProfileComparison(profile=profile, predicted_s=predicted)
