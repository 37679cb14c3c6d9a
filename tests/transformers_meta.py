"""The parameter count of transformers' own model for a config.json, built on the meta device
(no weights allocated): what the presets' and config readers' counts are checked against."""

from __future__ import annotations

import pytest


def meta_parameter_count(config: dict, auto_class: str = "AutoModelForCausalLM") -> int:
    """Parameters of ``transformers.<auto_class>.from_config`` built from ``config`` under
    torch.device("meta"); the test is skipped where torch or transformers is missing."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = getattr(transformers, auto_class).from_config(transformers.AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())
