"""fit() and plan() answer as the committed snapshot says (tests/api_snapshot.py): the
planner's speed-ups change how an answer is computed, never the answer."""

from __future__ import annotations

import json

import pytest

from tests.api_snapshot import SNAPSHOT, answers, requests, settings

_SNAPSHOT = json.loads(SNAPSHOT.read_text())
_REQUESTS = requests()


def _check(name: str, setting: str) -> None:
    assert answers(settings(_REQUESTS[name])[setting]) == _SNAPSHOT[name][setting]


def test_snapshot_names_every_request() -> None:
    assert sorted(_SNAPSHOT) == sorted(_REQUESTS)


@pytest.mark.parametrize("name", sorted(_REQUESTS))
def test_flat_reserve_answers_unchanged(name: str) -> None:
    _check(name, "flat")


# Under the caching-allocator model each fit replays steps: about 0.1 s a request.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_REQUESTS))
def test_allocator_model_answers_unchanged(name: str) -> None:
    _check(name, "allocator")
