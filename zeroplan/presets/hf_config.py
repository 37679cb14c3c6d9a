"""Read a Hugging Face ``config.json`` offline into a ModelSpec (GPT-2 and Llama families)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import first_error
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind

_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
_GPT2_LIKE = ("gpt2",)
SUPPORTED_MODEL_TYPES = _GPT2_LIKE + _LLAMA_LIKE


def _require(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in config:
            return config[key]
    raise ZeroplanError(f"config.{keys[0]}", "missing from config.json")


def _gpt2_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    hidden = _require(config, "n_embd", "hidden_size")
    return ModelSpec(
        name=name,
        vocab_size=_require(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=_require(config, "n_layer", "num_hidden_layers"),
        num_heads=_require(config, "n_head", "num_attention_heads"),
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        mlp=MlpKind.gelu,
        norm=NormKind.layernorm,
        position=PositionKind.learned,
        max_positions=_require(config, "n_positions", "max_position_embeddings"),
        bias=True,
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attn_pdrop", 0.0),
        hidden_dropout=config.get("resid_pdrop", 0.0),
    )


def _llama_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ZeroplanError("config.attention_bias", "biased Llama-family projections are not modelled")
    return ModelSpec(
        name=name,
        vocab_size=_require(config, "vocab_size"),
        hidden_size=_require(config, "hidden_size"),
        num_layers=_require(config, "num_hidden_layers"),
        num_heads=_require(config, "num_attention_heads"),
        num_kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
        ffn_hidden_size=_require(config, "intermediate_size"),
        mlp=MlpKind.swiglu,
        norm=NormKind.rmsnorm,
        position=PositionKind.rope,
        max_positions=config.get("max_position_embeddings", 4096),
        bias=False,
        qkv_bias=config.get("model_type") == "qwen2",
        qk_norm=config.get("model_type") == "qwen3",
        tied_embeddings=config.get("tie_word_embeddings", False),
        num_experts=config.get("num_local_experts", 1),
        experts_per_token=config.get("num_experts_per_tok", 1),
        attention_dropout=config.get("attention_dropout", 0.0),
    )


# Keys whose value must be a JSON integer: pydantic's lax mode would turn "4096" into 4096 and
# true into 1, silently accepting a config that Hugging Face itself would reject.
_INTEGER_KEYS = (
    "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings", "n_positions",
    "num_local_experts", "num_experts_per_tok",
)


MAX_CONFIG_SIZE = 1 << 24
"""Largest width, count or vocabulary a config.json may give (16,777,216): far above any
published model (vocabularies ~256k, widths ~32k), low enough that a typo such as 10^30 is
refused instead of making the planner's integer arithmetic run for minutes."""
MAX_CONFIG_POSITIONS = 1 << 30
"""Largest max_position_embeddings / n_positions accepted."""
_POSITION_KEYS = ("max_position_embeddings", "n_positions")


def _check_integer_keys(config: dict[str, Any]) -> None:
    for key in _INTEGER_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ZeroplanError(f"config.{key}", f"must be a JSON integer, got {value!r}")
        limit = MAX_CONFIG_POSITIONS if key in _POSITION_KEYS else MAX_CONFIG_SIZE
        if value > limit:
            raise ZeroplanError(f"config.{key}", f"must be at most {limit:,}, got {value:,}")


def parse_hf_config(config: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from an already-parsed config.json dictionary."""
    if not isinstance(config, dict):
        raise ZeroplanError("config", "config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ZeroplanError("config.model_type", f"missing (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _check_integer_keys(config)
    try:
        if model_type in _GPT2_LIKE:
            return _gpt2_spec(name, config)
        if model_type in _LLAMA_LIKE:
            return _llama_spec(name, config)
    except ValidationError as error:
        raise first_error(error, prefix="config") from None
    raise ZeroplanError(
        "config.model_type", f"unsupported {model_type!r} (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})"
    )


def load_hf_config(path: Path) -> ModelSpec:
    """Parse ``path`` (a config.json); errors name the file problem or the bad key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("model", f"cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ZeroplanError("model", f"{str(path)!r} is not UTF-8 text (byte {error.start}); config.json must be UTF-8 JSON") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ZeroplanError("model", f"{str(path)!r} is not valid JSON (line {error.lineno}: {error.msg})") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return parse_hf_config(config, name=name or "custom")
