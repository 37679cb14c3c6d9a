"""The harness names its model as the planner does: a harness preset, a planner preset, or a
config.json, whose own refusal (not "unknown model") is what a bad file gets."""

from __future__ import annotations

import json

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.harness.args import resolve_model


def test_a_refused_config_file_keeps_its_own_reason(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ZeroplanError, match="vocab_size: missing from config.json"):
        resolve_model(str(config))
    with pytest.raises(ZeroplanError, match="cannot read"):
        resolve_model(str(tmp_path / "missing.json"))


def test_an_unknown_name_gets_close_matches_from_both_catalogs() -> None:
    with pytest.raises(ZeroplanError, match="unknown 'tiny-lama'; did you mean 'tiny-llama'"):
        resolve_model("tiny-lama")
    assert resolve_model("tiny-llama").name == "tiny-llama"
    assert resolve_model("llama-2-7b").name == "llama-2-7b"
