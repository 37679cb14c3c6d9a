"""DeepSpeed ZeRO-3's coordinator replay (zeroplan.core.deepspeed_coordinator.replay) is kept by
what it reads of the request: fit's ZeRO-3 strategies with and without offload share one replay,
which is the one each computes afresh, and a setting the replay reads (recomputation) has its own."""

from __future__ import annotations

from zeroplan.core import deepspeed_coordinator
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus


def _request(kind: str, checkpointing: str = "none") -> PlanRequest:
    return PlanRequest(model=get_model("tinyllama-1.1b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                       strategy=StrategySpec(kind=kind), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                       training=TrainingSpec(framework="hf", activation_checkpointing=checkpointing))


def test_zero3_strategies_share_the_replay_they_would_each_compute() -> None:
    deepspeed_coordinator._REPLAYS.clear()
    requests = [_request(kind) for kind in ("zero3", "zero3-offload", "zero3-param-offload")]
    assert all(deepspeed_coordinator.replays_gathers(r) for r in requests)
    shared = [deepspeed_coordinator.replay(r) for r in requests]
    assert len(deepspeed_coordinator._REPLAYS) == 1
    assert all(s == deepspeed_coordinator._replay(r, None) for s, r in zip(shared, requests))


def test_recomputation_is_in_the_key() -> None:
    deepspeed_coordinator._REPLAYS.clear()
    plain, full = _request("zero3"), _request("zero3", "full")
    assert deepspeed_coordinator.replay(full) == deepspeed_coordinator._replay(full, None)
    assert deepspeed_coordinator.replay(plain) != deepspeed_coordinator.replay(full)
    assert len(deepspeed_coordinator._REPLAYS) == 2


def test_the_release_that_holds_recomputed_frozen_weights_is_in_the_key() -> None:
    # DeepSpeed 0.19.3+ keeps a reentrant recompute's frozen weights gathered (holds_recomputed_frozen);
    # 0.13.3 does not: the same units and settings otherwise, two replays.
    deepspeed_coordinator._REPLAYS.clear()
    base = _request("zero3", "full")
    lora = FineTuneSpec(lora_rank=8)
    current = base.model_copy(update={"training": base.training.model_copy(update={"finetune": lora})})
    earlier = base.model_copy(update={"training": base.training.model_copy(update={"finetune": lora, "deepspeed_release": "0.13.3"})})
    assert deepspeed_coordinator.holds_recomputed_frozen(current.training)
    assert not deepspeed_coordinator.holds_recomputed_frozen(earlier.training)
    assert deepspeed_coordinator.replay(current) == deepspeed_coordinator._replay(current, None)
    assert deepspeed_coordinator.replay(earlier) == deepspeed_coordinator._replay(earlier, None)
    assert deepspeed_coordinator.replay(current) != deepspeed_coordinator.replay(earlier)


def test_no_checkpoint_reentrant_releases_what_the_replay_holds_and_the_report_says_why(capsys) -> None:
    import json

    from zeroplan.cli.main import main

    flags = ["fit", "llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "hf", "--lora-rank", "8",
             "--activation-checkpointing", "full", "--format", "json"]

    def zero3(extra: list[str]) -> tuple[int, float]:
        main(flags + extra)
        plan = next(p for p in json.loads(capsys.readouterr().out)["plans"] if p["strategy"] == "zero3")
        return plan["memory"]["peak_bytes"], plan["time"]["tokens_per_s_per_gpu"]

    (reentrant, reentrant_rate), (non_reentrant, non_reentrant_rate) = zero3([]), zero3(["--no-checkpoint-reentrant"])
    # 31 blocks' frozen weights (~0.4 GB each in bf16) stay gathered under the reentrant recompute.
    assert reentrant - non_reentrant > 31 * 0.35e9
    assert zero3(["--checkpoint-reentrant"])[0] == reentrant
    # torch 2's non-reentrant checkpoint stops early: each block's down projection is not rerun.
    assert non_reentrant_rate > reentrant_rate
    main(flags[:-2] + ["--detail"])
    assert "--no-checkpoint-reentrant" in capsys.readouterr().out
