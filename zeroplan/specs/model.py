"""The architecture of a decoder-only transformer, as the planner and the harness both read it."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen


class MlpKind(str, Enum):
    """Feed-forward block: ``gelu`` is GPT's two-matrix MLP, ``swiglu`` Llama's gated three-matrix one,
    ``geglu`` the same gated block with GeLU in place of SiLU (Gemma; Shazeer 2020, "GLU Variants")."""

    gelu = "gelu"
    swiglu = "swiglu"
    geglu = "geglu"

    @property
    def gated(self) -> bool:
        """Whether the block has gate, up and down projections (three matrices) rather than two."""
        return self is not MlpKind.gelu


class NormKind(str, Enum):
    """``layernorm`` has a weight and a bias per channel, ``rmsnorm`` only a weight."""

    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class PositionKind(str, Enum):
    """``learned`` adds a (max_positions x hidden) table; ``rope`` has no parameters."""

    learned = "learned"
    rope = "rope"


class ModelSpec(Frozen):
    """A decoder-only transformer. Symbols follow Korthikanti et al. (2022): h, a, L, V, s."""

    name: str = Field(min_length=1)
    """Human-readable name, e.g. 'llama-2-7b'."""
    vocab_size: int = Field(gt=0)
    """V: vocabulary size (rows of the embedding table)."""
    hidden_size: int = Field(gt=0)
    """h: model width."""
    num_layers: int = Field(gt=0)
    """L: number of transformer blocks."""
    num_heads: int = Field(gt=0)
    """a: number of attention (query) heads; must divide hidden_size."""
    num_kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads for grouped-query attention; None means num_heads (multi-head attention)."""
    head_dim: int | None = Field(default=None, gt=0)
    """Width of one head; None means hidden_size // num_heads."""
    ffn_hidden_size: int = Field(gt=0)
    """f: inner width of the feed-forward block (4h for GPT-2, 11008 for Llama-2-7B)."""
    mlp: MlpKind = MlpKind.swiglu
    """Feed-forward kind."""
    norm: NormKind = NormKind.rmsnorm
    """Normalisation kind (pre-norm, two per block plus a final one)."""
    position: PositionKind = PositionKind.rope
    """Position encoding."""
    max_positions: int = Field(default=4096, gt=0)
    """Longest sequence; sizes the learned position table."""
    bias: bool = False
    """Whether linear layers carry biases (GPT-2/3: yes; Llama: no)."""
    qkv_bias: bool = False
    """Whether only the q/k/v projections carry biases while the rest do not (Qwen2; HF modeling_qwen2.py)."""
    qk_norm: bool = False
    """Whether each block RMS-normalises queries and keys per head (q_norm/k_norm of head_dim each; Qwen3)."""
    post_norms: bool = False
    """Whether each block also normalises the attention and MLP outputs before adding them to the residual
    stream: four norms per block instead of two (Gemma 2; HF modeling_gemma2.py, post_attention_layernorm
    and post_feedforward_layernorm)."""
    tied_embeddings: bool = False
    """Whether the output projection reuses the input embedding matrix."""
    num_experts: int = Field(default=1, gt=0)
    """Experts per MoE layer; 1 is a dense model."""
    experts_per_token: int = Field(default=1, gt=0)
    """Experts each token is routed to (top-k)."""
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on attention probabilities; >0 stores a 1-byte mask (Korthikanti sec. 4.1)."""
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout after the attention and MLP blocks; >0 stores 1-byte masks."""
    parameter_count_exact: bool = True
    """Whether the parameter count is known to equal the checkpoint's; False when a config.json carried
    keys the reader does not model (parameter_count_caveat names them)."""
    parameter_count_caveat: str = ""
    """Why the count may not be exact (empty when it is); shown by ``zeroplan fit`` as a caution."""

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelSpec":
        if self.head_dim is None and self.hidden_size % self.num_heads != 0:
            raise ZeroplanError(
                "model.num_heads",
                f"{self.num_heads} heads do not divide hidden_size {self.hidden_size}",
            )
        if self.num_heads % self.kv_heads != 0:
            raise ZeroplanError(
                "model.num_kv_heads",
                f"{self.kv_heads} key/value heads do not divide num_heads {self.num_heads}",
            )
        if self.parameter_count_exact == bool(self.parameter_count_caveat):
            raise ZeroplanError(
                "model.parameter_count_caveat",
                "must be empty when parameter_count_exact is true and say why when it is false",
            )
        if self.experts_per_token > self.num_experts:
            raise ZeroplanError(
                "model.experts_per_token",
                f"{self.experts_per_token} exceeds num_experts {self.num_experts}",
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (a * head_size)."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_size

    @property
    def norms_per_block(self) -> int:
        """Normalisation layers in one block: 2 (pre-attention, pre-MLP), 4 with post_norms."""
        return 4 if self.post_norms else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1
