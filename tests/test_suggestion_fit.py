"""A suggestion's candidate change is answered by core.plan.suggestion_fit, which completes the
plans (collectives and the rest) only where a strategy fits: its recommendation, verdict and
caution are the full fit's (fit(..., suggest=False, largest_micro_batch=False, timed=False)),
and fit()'s whole answer is the one the full fit of every candidate gives."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import zeroplan.core.plan as plan_module
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import SuggestionFit, fit, suggestion_fit
from zeroplan.core.suggest import smallest_change
from zeroplan.errors import ZeroplanError

# Bases whose candidate changes cover full recomputation, nf4, every GPU doubling, the flat
# reserve's allocator caution (a candidate passed over for the next), a step the flat reserve
# fits and the allocator model runs out on, named strategies, a pipeline with tensor
# parallelism, host RAM too small for the offloads, and lengths that vary.
QUICK = (
    # Nothing fits without recomputation; with it on 8 cards the flat reserve fits a step the
    # allocator model runs out on (a cautioned candidate), on 16 one that completes.
    ("llama-3.1-8b --framework torchtune --gpu a100-40gb --gpu-memory-gib 13.25 --gpus 8 --micro-batch 4 "
     "--seq-len 1024 --activation-checkpointing none --flat-reserve", None),
    ("llama-3.1-8b --framework torchtune --gpu a100-40gb --gpu-memory-gib 13.25 --gpus 8 --micro-batch 4 "
     "--seq-len 1024 --activation-checkpointing none", None),
)
SLOW = (
    ("llama-3.1-8b --framework torchtune --gpus 1 --gpu a10g --micro-batch 8 --seq-len 2048 --lora-rank 16 "
     "--activation-checkpointing full", None),
    ("llama-3.1-8b --framework torchtune --gpus 1 --gpu a10g --micro-batch 8 --seq-len 2048 --lora-rank 16 "
     "--activation-checkpointing none --flat-reserve", None),
    ("llama-3.1-8b --framework hf --gpus 1 --gpu rtx-4090 --seq-len 4096 --activation-checkpointing full",
     ("fsdp-full-shard",)),
    ("llama-2-70b --gpus 8 --gpu a100-80gb --seq-len 4096", None),
    ("llama-2-7b --gpus 8 --gpu a100-80gb --seq-len 4096 --micro-batch 20 --flat-reserve", None),
    ("llama-3.1-405b --gpus 8 --gpu h100-80gb --seq-len 8192 --framework torchtitan", None),
    ("llama-2-13b --framework megatron --gpus 16 --gpu a100-40gb --seq-len 4096 --tp 2 --pp 2 --grad-accum 8", None),
    ("llama-2-70b --gpus 8 --gpu a100-80gb --seq-len 4096 --host-memory-gib 256", None),
)
# Every candidate of a base with lengths that vary replays an epoch of record batches (seconds):
# only the whole answer is compared (the first candidate fits).
VARYING = "llama-2-7b --framework hf --gpus 1 --gpu a100-40gb --seq-len 4096 --micro-batch 8 --varying-lengths 1500,600,200,2000"


def _request(flags: str):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]))


def _candidates(base) -> list:
    """Every candidate change smallest_change would try for ``base``, in order (each answered
    as fitting nothing, so that it goes on to the next)."""
    tried = []

    def nothing_fits(request):
        tried.append(request)
        return SuggestionFit(None, "", "")

    smallest_change(base, nothing_fits)
    return tried


def _full(request, strategies) -> tuple:
    """What smallest_change reads of the full fit of a candidate, or the refusal's type."""
    try:
        report = fit(request, strategies, suggest=False, largest_micro_batch=False, timed=False)
    except (ZeroplanError, ValidationError):
        return "refused"
    if report.recommended is None:
        return None
    return report.recommended, report.verdict, report.allocator_caution


def _pruned(request, strategies) -> tuple:
    try:
        answer = suggestion_fit(request, strategies)
    except (ZeroplanError, ValidationError):
        return "refused"
    return None if answer.recommended is None else tuple(answer)


def _check_candidates(flags: str, strategies) -> list:
    base = _request(flags)
    candidates = _candidates(base)
    full = [_full(request, strategies) for request in candidates]
    assert [_pruned(request, strategies) for request in candidates] == full
    return full


def _whole_answer_unpruned(monkeypatch, flags: str, strategies) -> None:
    base = _request(flags)
    pruned = fit(base, strategies)
    monkeypatch.setattr(plan_module, "suggestion_fit", lambda request, kept: fit(
        request, kept, suggest=False, largest_micro_batch=False, timed=False))
    unpruned = fit(base, strategies)
    assert pruned.model_dump_json() == unpruned.model_dump_json()
    assert (pruned.suggested_change, pruned.suggested_recommendation) == (
        unpruned.suggested_change, unpruned.suggested_recommendation)


def test_each_candidate_reads_as_its_full_fit() -> None:
    answers = [answer for flags, strategies in QUICK for answer in _check_candidates(flags, strategies)]
    # The bases meet every kind of candidate: one that fits nothing, one that fits, one cautioned.
    assert None in answers and any(isinstance(answer, tuple) and not answer[2] for answer in answers)
    assert any(isinstance(answer, tuple) and answer[2] for answer in answers)


@pytest.mark.slow
@pytest.mark.parametrize("flags, strategies", SLOW)
def test_each_candidate_reads_as_its_full_fit_across_frameworks(flags, strategies) -> None:
    _check_candidates(flags, strategies)


@pytest.mark.parametrize("flags, strategies", QUICK)
def test_fit_answers_as_with_every_candidate_fitted_in_full(monkeypatch, flags, strategies) -> None:
    _whole_answer_unpruned(monkeypatch, flags, strategies)


@pytest.mark.slow
@pytest.mark.parametrize("flags, strategies", SLOW)
def test_fit_answers_as_with_every_candidate_fitted_in_full_across_frameworks(monkeypatch, flags, strategies) -> None:
    _whole_answer_unpruned(monkeypatch, flags, strategies)


@pytest.mark.slow
def test_fit_with_varying_lengths_answers_as_with_every_candidate_fitted_in_full(monkeypatch) -> None:
    _whole_answer_unpruned(monkeypatch, VARYING, None)


def test_a_cautioned_candidate_keeps_its_caution() -> None:
    # Full recomputation on the 8 cards of the first base: the flat reserve's recommendation
    # is cautioned, as the full fit cautions it.
    cautioned = _candidates(_request(QUICK[0][0]))[0]
    answer = suggestion_fit(cautioned, None)
    assert answer.recommended is not None and answer.allocator_caution
    assert tuple(answer) == _full(cautioned, None)


def test_a_candidate_that_fits_nothing_computes_no_collectives(monkeypatch) -> None:
    base = _request("llama-3.1-405b --gpus 8 --gpu h100-80gb --seq-len 8192 --framework torchtitan")
    # Full recomputation on 8 GPUs: nothing fits 405B's states.
    candidate = _candidates(base)[0]
    asked = []
    real = plan_module.collectives
    monkeypatch.setattr(plan_module, "collectives", lambda request: asked.append(request) or real(request))
    assert suggestion_fit(candidate, None).recommended is None
    assert asked == []
