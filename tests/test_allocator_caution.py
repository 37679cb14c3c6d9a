"""A fit under --flat-reserve asks the caching-allocator model about its recommendation
when the allocated peak comes near the usable memory, and cautions when the model runs out."""

from __future__ import annotations

import zeroplan.core.plan as plan_module
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import fit
from zeroplan.specs import StrategyKind
from zeroplan.units import GiB

# The dangerous kind: the flat reserve fits FSDP2 full sharding (33.9 GiB allocated, 35.6 with
# the 5 %), the allocator model's step needs 39.1 GiB (its OOM capacity, default settings). With
# each loss moment allocated tensor by tensor no preset GPU of benchmarks/allocator_verdict_sweep.py
# lands between the two, so the card here is one of 38 GiB (37.4 usable).
A10G_TORCHTITAN = ("llama-3.1-8b --framework torchtitan --gpu a100-40gb --gpu-memory-gib 38 --gpus 8 --micro-batch 1 "
                   "--seq-len 8192 --activation-checkpointing selective-op")

# hf without recomputation at 4 x 1024: full sharding and HSDP allocate 44.1 GiB and need 47.0
# (OOM capacity); a 47.25 GiB card leaves 46.6 usable, where ZeRO-3 with offload completes.
HF_80GB = ("llama-3.1-8b --framework hf --gpu a100-80gb --gpu-memory-gib 47.25 --gpus 8 --micro-batch 4 --seq-len 1024 "
           "--activation-checkpointing none")

# torchtune's full fine-tune at 4 x 1024 with full recomputation: 11.7 GiB allocated, OOM
# capacity 13.5 GiB; a 13.25 GiB card leaves 12.6 usable.
TORCHTUNE_13GB = ("llama-3.1-8b --framework torchtune --gpu a100-40gb --gpu-memory-gib 13.25 --gpus 8 --micro-batch 4 "
                  "--seq-len 1024 --activation-checkpointing full")
THREE = [StrategyKind.fsdp_full_shard, StrategyKind.hsdp, StrategyKind.zero3_offload]


def _base(flags: str, *extra: str):
    """The request under the flat reserve (whose verdict the caution checks) unless ``extra``
    names an allocator setting."""
    flat = () if "--allocator-conf" in extra else ("--flat-reserve",)
    return request_from_args(build_parser().parse_args(["fit", *flags.split(), *flat, *extra]))


def _counting_checks(monkeypatch) -> list:
    calls = []
    real = plan_module._fits_under_allocator

    def counted(request):
        calls.append(request.strategy.kind)
        return real(request)

    monkeypatch.setattr(plan_module, "_fits_under_allocator", counted)
    return calls


def test_a_recommendation_the_allocator_model_cannot_run_is_cautioned():
    report = fit(_base(A10G_TORCHTITAN))
    chosen = report.plan_for(report.recommended)
    assert chosen.fits  # the flat reserve's verdict stands in the table
    assert f"Caution: for {report.recommended.value}, PyTorch's caching allocator" in report.verdict
    modelled = fit(_base(A10G_TORCHTITAN, "--allocator-conf", ""), [report.recommended]).plans[0]
    assert not modelled.fits and modelled.memory.peak_bytes > chosen.usable_memory_bytes
    assert f"would reserve {modelled.memory.peak_bytes / GiB:.1f} GiB on a larger GPU" in report.verdict


def test_the_caution_is_not_given_when_the_verdict_is_already_the_allocators():
    report = fit(_base(A10G_TORCHTITAN, "--allocator-conf", ""))
    assert "PyTorch's caching allocator" not in report.verdict
    # The model's own verdict: neither FSDP2 strategy fits the A10G.
    assert not report.plan_for("fsdp-full-shard").fits


def test_far_below_the_usable_memory_nothing_is_replayed(monkeypatch):
    calls = _counting_checks(monkeypatch)
    report = fit(_base("llama-3.1-8b --framework torchtitan --gpu h100-80gb --gpus 8 --micro-batch 1 --seq-len 2048 "
                       "--activation-checkpointing full"))
    chosen = report.plan_for(report.recommended)
    assert chosen.memory.allocated_peak_bytes * 3 < chosen.usable_memory_bytes * 2
    assert calls == [] and "PyTorch's caching allocator" not in report.verdict


def test_near_the_usable_memory_the_model_is_asked_and_silent_when_it_completes(monkeypatch):
    calls = _counting_checks(monkeypatch)
    report = fit(_base("llama-3.1-8b --framework hf --gpu a100-80gb --gpus 8 --micro-batch 2 --seq-len 4096 "
                       "--activation-checkpointing none"))
    chosen = report.plan_for(report.recommended)
    assert chosen.memory.allocated_peak_bytes * 3 >= chosen.usable_memory_bytes * 2
    assert calls == [report.recommended]
    assert "PyTorch's caching allocator" not in report.verdict


def test_the_caution_names_the_next_fitting_strategy_the_model_lets_complete(monkeypatch):
    calls = _counting_checks(monkeypatch)
    report = fit(_base(HF_80GB), THREE)
    assert report.recommended.value == "fsdp-full-shard"
    assert "for fsdp-full-shard, PyTorch's caching allocator (modelled, default settings) runs out of the 46.6 GiB usable (it would reserve 55.2 GiB" in report.verdict
    assert "under the model zero3-offload completes" in report.verdict
    # hsdp (the next in recommendation order) was asked before zero3-offload, and failed too.
    assert [kind.value for kind in calls] == ["fsdp-full-shard", "hsdp", "zero3-offload"]
    modelled = fit(_base(HF_80GB, "--allocator-conf", ""), THREE)
    assert [p.fits for p in modelled.plans] == [False, False, True]


def test_when_no_other_fitting_strategy_completes_the_caution_says_so():
    report = fit(_base(A10G_TORCHTITAN))
    assert [p.strategy.value for p in report.plans if p.fits] == ["fsdp-full-shard", "hsdp"]
    assert "under the model none of the others that fit completes" in report.verdict


def test_a_suggestion_the_allocator_model_would_fail_is_passed_over_for_the_next():
    # Nothing fits without recomputation; full recomputation on the same 8 cards fits under the
    # flat reserve but not under the allocator model, so the suggestion goes on to 16 GPUs.
    report = fit(_base(TORCHTUNE_13GB.replace("full", "none")))
    assert report.recommended is None
    cautioned_on_eight = fit(_base(TORCHTUNE_13GB), suggest=False)
    assert cautioned_on_eight.allocator_caution
    assert "With --activation-checkpointing full and --gpus 16: Recommended: fsdp-full-shard" in report.verdict
    assert "PyTorch's caching allocator" not in report.verdict


def test_a_cautioned_suggestion_is_given_when_no_later_one_fits(monkeypatch):
    # Every candidate that fits made to run out under the model: the first of them is the
    # answer, with its caution.
    monkeypatch.setattr(plan_module, "allocator_runs_out", lambda request: True)
    report = fit(_base("llama-3.1-8b --framework torchtune --gpus 1 --gpu a10g --micro-batch 8 --seq-len 2048 "
                       "--lora-rank 16 --activation-checkpointing full"))
    assert report.recommended is None
    assert "With --gpus 8: Recommended: fsdp-full-shard" in report.verdict
    assert "for fsdp-full-shard, PyTorch's caching allocator (modelled, default settings) runs out of the 21.8 GiB usable" in report.verdict


def test_at_most_three_other_strategies_are_asked(monkeypatch):
    # Every strategy made to fail the model: the recommendation and the next three fitting ones
    # are asked, no more, and the caution says how many were.
    asked = []

    def always_out(request):
        asked.append(request.strategy.kind)
        return True

    monkeypatch.setattr(plan_module, "allocator_runs_out", always_out)
    report = fit(_base("llama-3.1-8b --framework hf --gpu a100-80gb --gpus 8 --micro-batch 1 --seq-len 2048 "
                       "--activation-checkpointing full"), suggest=False)
    fitting = [p for p in report.plans if p.fits]
    assert len(fitting) > 4
    assert asked[0] is report.recommended and len(asked) == 1 + plan_module.MAX_ALLOCATOR_ALTERNATIVES
    assert "under the model none of the next 3 that fit completes" in report.allocator_caution


def _plan(zeroplan_cli, *flags: str) -> dict:
    import json

    code, out, err = zeroplan_cli("plan", "llama-3.1-8b", "--framework", "torchtitan", "--gpus", "8", "--gpu", "a10g",
                                  "--seq-len", "2048", "--format", "json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_every_configuration_the_plan_search_shows_carries_fits_verdict(zeroplan_cli):
    # Data parallel only, 8 sequences: the one configuration that fits is this A10G setup,
    # judged as fit judges it by default (torchtitan's launcher sets expandable segments).
    result = _plan(zeroplan_cli, "--global-batch", "8", "--no-model-parallel")
    best = result["best"]
    assert (best["strategy"], best["activation_checkpointing"], best["micro_batch_size"]) == ("fsdp-full-shard", "full", 1)
    a10g = ("llama-3.1-8b --framework torchtitan --gpu a10g --gpus 8 --micro-batch 1 --seq-len 2048 "
            "--activation-checkpointing full")
    launch_default = request_from_args(build_parser().parse_args(["fit", *a10g.split()]))
    fitted = fit(launch_default, [StrategyKind.fsdp_full_shard]).plans[0]
    for shown in (result["ranked"][0], result["pareto"][0]):
        assert shown["allocator_fits"] is fitted.fits is True
        assert shown["allocator_peak_bytes"] == fitted.memory.peak_bytes
    assert result["allocator_caution"] == ""


def test_the_plan_search_cautions_on_a_best_configuration_the_allocator_model_cannot_run():
    from zeroplan.core.search import search

    # Under PyTorch's default settings the same best configuration runs out of memory.
    base = _base(A10G_TORCHTITAN, "--allocator-conf", "")
    result = search(base, 8)
    best = result.best
    assert best.allocator_fits is False and best.peak_bytes <= best.usable_memory_bytes
    modelled = fit(base, [StrategyKind.fsdp_full_shard]).plans[0]
    assert not modelled.fits and best.allocator_peak_bytes == modelled.memory.peak_bytes
    assert result.allocator_caution.startswith(
        " Caution: for #1, PyTorch's caching allocator (modelled, default settings) runs out of the 37.4 GiB usable "
        f"(it would reserve {modelled.memory.peak_bytes / GiB:.1f} GiB on a larger GPU")
    assert result.explanation.endswith(result.allocator_caution)


def test_the_plan_search_is_silent_when_the_model_lets_its_best_complete(zeroplan_cli):
    result = _plan(zeroplan_cli, "--global-batch", "16")
    best = result["best"]
    # Near the usable memory (20.9 of 21.9 GiB), and the model lets it complete.
    assert best["peak_bytes"] > 0.9 * best["usable_memory_bytes"]
    assert best["allocator_fits"] is True and result["allocator_caution"] == ""
    assert all(c["allocator_fits"] is not None for c in result["ranked"] + result["pareto"])
