"""The Python API's answers for a varied set of requests, kept as a snapshot: each fit() and
plan() answer's JSON digested (SHA-256) beside its verdict, so a change that only makes the
planner faster can show it answers byte for byte as before (tests/test_api_snapshot.py).

A change meant to move an answer rewrites the snapshot, and says so in its commit:

    python -m tests.api_snapshot --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from zeroplan.core.plan import fit, plan
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec, Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.training import ActivationCheckpointing, Precision, StateConvention

SNAPSHOT = Path(__file__).parent / "fixtures" / "api_snapshot.json"


def _request(model: str, gpu: str, gpus: int, kind: str, seq_len: int, micro_batch: int, *, accumulation: int = 1,
             parallel: ParallelSpec | None = None, host_memory_bytes: int | None = None, **training: object) -> PlanRequest:
    cluster = cluster_from_gpus(get_gpu(gpu), gpus)
    if host_memory_bytes is not None:
        cluster = cluster.model_copy(update={"host_memory_bytes_per_node": host_memory_bytes})
    return PlanRequest(model=get_model(model), cluster=cluster, strategy=StrategySpec(kind=kind),
                       batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch, grad_accum_steps=accumulation),
                       training=TrainingSpec(**training), parallel=parallel or ParallelSpec())


def requests() -> dict[str, PlanRequest]:
    """Named requests across models, frameworks, layouts, policies and fine-tunes; each is
    answered under the caching-allocator model (its own default) and the flat reserve."""
    full, selective = ActivationCheckpointing.full, ActivationCheckpointing.selective
    return {
        "llama-2-7b zero3 8xA100 s2048 b4": _request("llama-2-7b", "a100-80gb", 8, "zero3", 2048, 4),
        "llama-2-7b zero3 8xA100 s1024 b20 (nothing fits)": _request("llama-2-7b", "a100-80gb", 8, "zero3", 1024, 20),
        "gpt2 ddp 1xA100 s1024 b8": _request("gpt2", "a100-80gb", 1, "ddp", 1024, 8),
        "gpt2-xl zero2 4xA100 selective accum 4 deepspeed": _request(
            "gpt2-xl", "a100-80gb", 4, "zero2", 1024, 2, accumulation=4, activation_checkpointing=selective,
            state_convention=StateConvention.deepspeed),
        "llama-2-70b fsdp 64xH100 full fp16": _request(
            "llama-2-70b", "h100-sxm", 64, "fsdp-full-shard", 4096, 1, activation_checkpointing=full,
            precision=Precision.fp16_mixed),
        "llama-2-70b zero3 16xA100 host 512 GiB": _request(
            "llama-2-70b", "a100-80gb", 16, "zero3", 4096, 1, activation_checkpointing=full, host_memory_bytes=512 << 30),
        "mixtral-8x7b fsdp 16xH100 ep 2": _request(
            "mixtral-8x7b", "h100-sxm", 16, "fsdp-full-shard", 4096, 1, activation_checkpointing=full, parallel=ParallelSpec(ep=2)),
        "llama-3-8b torchtitan fsdp 8xH100 cp 2": _request(
            "llama-3-8b", "h100-sxm", 8, "fsdp-full-shard", 8192, 1, framework=Framework.torchtitan,
            # Named: its llama3_8b configuration's selective-op is what an unnamed policy plans.
            activation_checkpointing=ActivationCheckpointing.none, parallel=ParallelSpec(cp=2)),
        "llama-2-13b megatron tp 2 pp 2 16xA100": _request(
            "llama-2-13b", "a100-80gb", 16, "zero1", 4096, 1, accumulation=8, framework=Framework.megatron,
            parallel=ParallelSpec(tp=2, sequence_parallel=True, pp=2)),
        "llama-2-7b interleaved pp 4 8xA100": _request(
            "llama-2-7b", "a100-80gb", 8, "ddp", 4096, 1, accumulation=8, activation_checkpointing=full,
            parallel=ParallelSpec(pp=4, pp_schedule=PipelineSchedule.interleaved_1f1b, virtual_stages=2)),
        "llama-2-7b hf lora 1xA100": _request(
            "llama-2-7b", "a100-80gb", 1, "ddp", 2048, 2, framework=Framework.hf, finetune=FineTuneSpec(lora_rank=16)),
        "llama-3-8b torchtune qlora 1xA100": _request(
            "llama-3-8b", "a100-80gb", 1, "ddp", 2048, 4, framework=Framework.torchtune, precision=Precision.bf16_pure,
            activation_checkpointing=full, finetune=FineTuneSpec(lora_rank=8, quantize=Quantization.nf4)),
        "falcon-7b litgpt 4xA100": _request("falcon-7b", "a100-80gb", 4, "fsdp-full-shard", 2048, 2,
                                            framework=Framework.litgpt),
        "mistral-7b zero3 2 nodes x 8 H100": _request("mistral-7b", "h100-sxm", 16, "zero3", 4096, 2),
    }


def _digest(answer: object) -> str:
    return hashlib.sha256(answer.model_dump_json().encode()).hexdigest()


def settings(request: PlanRequest) -> dict[str, PlanRequest]:
    return {"allocator": request, "flat": request.with_allocator_conf(None)}


def answers(request: PlanRequest) -> dict[str, object]:
    """fit() and plan() of one request, digested, with fit's verdict in words."""
    report = fit(request)
    return {"fit": _digest(report), "verdict": report.verdict, "plan": _digest(plan(request))}


def snapshot() -> dict[str, dict[str, dict[str, object]]]:
    return {name: {setting: answers(r) for setting, r in settings(request).items()}
            for name, request in requests().items()}


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.api_snapshot --write")
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
