"""The base request the plan-search tests build: a model on a catalog GPU, DDP as the knobs'
carrier (the search varies the strategy), the framework's default precision."""

from __future__ import annotations

from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.training import Precision


def base_request(model: str, gpus: int, gpu: str, seq_len: int, framework: Framework = Framework.zeroplan,
                 host_memory_bytes: int | None = None) -> PlanRequest:
    cluster = cluster_from_gpus(get_gpu(gpu), gpus)
    if host_memory_bytes is not None:
        cluster = cluster.model_copy(update={"host_memory_bytes_per_node": host_memory_bytes})
    precision = Precision.bf16_pure if framework is Framework.torchtune else Precision.bf16_mixed
    return PlanRequest(
        model=get_model(model), cluster=cluster, strategy=StrategySpec(kind=StrategyKind.ddp),
        batch=BatchSpec(seq_len=seq_len), training=TrainingSpec(framework=framework, precision=precision),
    )
