"""When nothing fits: the smallest change that makes something fit, each candidate asked of the
planner (not a fixed hint). Tried in order of what it costs the user: recomputing activations,
then (for a LoRA) storing the base in nf4, then more GPUs of the same kind."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import FineTuneSpec, Quantization
from zeroplan.specs.base import kept_copy
from zeroplan.specs.request import PlanRequest, revalidated
from zeroplan.specs.training import ActivationCheckpointing

MAX_GPU_DOUBLINGS = 6
"""More GPUs are tried up to 2^6 = 64 times the request's (each every strategy's memory and
verdict, the rest of the plans only where one fits: core.plan.suggestion_fit)."""


# A LoRA's base stored in nf4 (QLoRA) is the next change after recomputation; a base already
# 4-bit (nf4, or a GPTQ checkpoint: its own quantized model, which nf4 would not store smaller)
# is not offered it.
def offers_nf4_base(finetune: FineTuneSpec) -> bool:
    """Whether the smallest-change search tries an nf4 base for this fine-tune."""
    return finetune.is_lora and finetune.quantize not in (Quantization.nf4, Quantization.gptq_int4)


def _with_training(base: PlanRequest, **update) -> PlanRequest | None:
    try:
        return revalidated(base, training=kept_copy(base.training, **update))
    except (ZeroplanError, ValidationError):
        return None


def _with_gpus(base: PlanRequest, gpus: int) -> PlanRequest | None:
    """The request on ``gpus`` GPUs of the same kind: filling a node first (up to 8 per node, as
    --gpus does), then more nodes; None where the layout's degrees do not divide it."""
    cluster = base.cluster
    per_node = cluster.gpus_per_node if cluster.num_nodes > 1 or gpus <= cluster.gpus_per_node else min(gpus, max(8, cluster.gpus_per_node))
    if gpus % per_node:
        return None
    try:
        return revalidated(base, cluster=cluster.model_copy(update={"num_nodes": gpus // per_node, "gpus_per_node": per_node}))
    except (ZeroplanError, ValidationError):
        return None


def smallest_change(base: PlanRequest, fit: Callable[[PlanRequest], object]) -> tuple[str, object] | None:
    """The first change that makes a strategy fit (its flags) and the fit's report; None when
    none of the candidates does. A change whose recommendation the caching-allocator model finds running
    out of memory (FitReport.allocator_caution) is passed over for the next, and given only
    when no later candidate fits without one. ``fit`` answers a request (every strategy its
    framework runs) without suggesting anything itself: its recommendation, verdict and
    allocator_caution, as FitReport names them (core.plan.suggestion_fit)."""
    cautioned: list[tuple[str, object]] = []

    def answer(change: str, request: PlanRequest | None) -> tuple[str, object] | None:
        if request is None:
            return None
        try:
            report = fit(request)
        except (ZeroplanError, ValidationError):
            # The change is refused for the strategies asked (torchtune runs no DDP on two
            # GPUs): not a change that fits, so the next one is tried.
            return None
        if report.recommended is None:
            return None
        if report.allocator_caution:
            cautioned.append((change, report))
            return None
        return change, report

    changes: list[tuple[str, PlanRequest | None]] = []
    current = base
    if base.training.activation_checkpointing is not ActivationCheckpointing.full:
        current = _with_training(base, activation_checkpointing=ActivationCheckpointing.full)
        changes.append(("--activation-checkpointing full", current))
    finetune = base.training.finetune
    flags = "--activation-checkpointing full and " if current is not base else ""
    if offers_nf4_base(finetune) and current is not None:
        quantized = _with_training(current, finetune=finetune.model_copy(update={"quantize": Quantization.nf4}))
        changes.append((f"{flags}--quantize nf4", quantized))
    for change, request in changes:
        if (found := answer(change, request)) is not None:
            return found
    if current is not None:
        for doubling in range(1, MAX_GPU_DOUBLINGS + 1):
            gpus = base.cluster.world_size * 2**doubling
            if (found := answer(f"{flags}--gpus {gpus}", _with_gpus(current, gpus))) is not None:
                return found
    return cautioned[0] if cautioned else None
