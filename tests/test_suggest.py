"""When nothing fits, the verdict names the smallest change the planner finds that fits."""

from __future__ import annotations

from zeroplan.core.plan import fit
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus


def _request(model: str, gpus: int, gpu: str = "a100-80gb", **training) -> PlanRequest:
    return PlanRequest(model=get_model(model), training=TrainingSpec(**training), batch=BatchSpec(seq_len=4096),
                       cluster=cluster_from_gpus(get_gpu(gpu), gpus), strategy=StrategySpec(kind="ddp"))


def test_checkpointing_comes_first() -> None:
    report = fit(_request("llama-2-70b", 8))
    assert report.recommended is None
    assert "With --activation-checkpointing full: Recommended:" in report.verdict


def test_more_gpus_are_named_when_nothing_else_helps_and_the_named_count_fits() -> None:
    base = _request("llama-3.1-8b", 1, "rtx-4090", framework="hf", activation_checkpointing="full")
    report = fit(base, ["fsdp-full-shard"])
    assert report.recommended is None
    named = int(report.verdict.split("--gpus ")[1].split(":")[0])
    assert named > 1 and named % 2 == 0
    bigger = base.model_copy(update={"cluster": cluster_from_gpus(get_gpu("rtx-4090"), named)})
    named_report = fit(bigger, ["fsdp-full-shard"], suggest=False)
    assert named_report.recommended is not None and not named_report.allocator_caution
    # Half as many GPUs: nothing fits, or only what the caching-allocator model finds running
    # out of memory (a suggestion passes those over).
    smaller = base.model_copy(update={"cluster": cluster_from_gpus(get_gpu("rtx-4090"), named // 2)})
    smaller_report = fit(smaller, ["fsdp-full-shard"], suggest=False)
    assert smaller_report.recommended is None or smaller_report.allocator_caution


def test_a_lora_is_offered_an_nf4_base_before_more_gpus() -> None:
    base = _request("llama-3.1-8b", 1, "a10g", framework="torchtune", precision="bf16-pure", activation_checkpointing="full",
                    finetune=FineTuneSpec(lora_rank=8))
    report = fit(base.model_copy(update={"cluster": cluster_from_gpus(get_gpu("v100-16gb"), 1)}))
    assert report.recommended is None
    assert "With --quantize nf4: Recommended:" in report.verdict


def test_a_gptq_base_is_not_offered_nf4() -> None:
    # A GPTQ checkpoint is already a 4-bit model: the search tries recomputation and more GPUs
    # only, and the verdict lists only what it tried.
    base = PlanRequest(model=get_model("qwen-14b"),
                       training=TrainingSpec(framework="hf", precision="fp16-mixed",
                                             finetune=FineTuneSpec(lora_rank=64, quantize="gptq-int4")),
                       batch=BatchSpec(seq_len=32768, allow_longer_seq=True),
                       cluster=cluster_from_gpus(get_gpu("a10g"), 1), strategy=StrategySpec(kind="zero2"))
    report = fit(base, ["zero2"])
    assert report.recommended is None
    assert "nf4" not in report.verdict
