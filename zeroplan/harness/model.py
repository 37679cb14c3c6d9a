"""A real PyTorch decoder-only transformer built from a :class:`~zeroplan.specs.ModelSpec`.

Shape legend: B batch, S sequence, H hidden, A query heads, K key/value heads, D head size,
F ffn inner width, E experts, V vocabulary.

The module tree fixes the parameter registration order that the reference ZeRO layout
(``zeroplan.harness.zero``) flattens: ``embed`` (token table, then the learned position table),
``blocks[0..L-1]`` (attention norm, q, k, v, o, mlp norm, mlp weights), then ``head`` (final norm,
then the output projection when it is not tied to the token table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroplan.errors import ZeroplanError
from zeroplan.specs import MlpKind, ModelSpec, NormKind, PositionKind

_NORM_EPS = 1e-5
_INIT_STD = 0.02  # GPT-2's initialiser; keeps a few AdamW steps numerically tame.


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm is NormKind.layernorm:
        return nn.LayerNorm(spec.hidden_size, eps=_NORM_EPS, bias=True)
    return nn.RMSNorm(spec.hidden_size, eps=_NORM_EPS)


def _rope(x_BSnD: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, eq. 34), half-split layout as in Llama/NeoX."""
    seq_len, head_size = x_BSnD.shape[1], x_BSnD.shape[-1]
    half = head_size // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle_SD = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    cos = angle_SD.cos()[None, :, None, :].to(x_BSnD.dtype)
    sin = angle_SD.sin()[None, :, None, :].to(x_BSnD.dtype)
    x1, x2 = x_BSnD[..., :half], x_BSnD[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Embeddings(nn.Module):
    """Unit 0: the token table and, for learned positions, the position table."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = (
            nn.Embedding(spec.max_positions, spec.hidden_size)
            if spec.position is PositionKind.learned
            else None
        )

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.tok(tokens_BS)
        if self.pos is not None:
            x_BSH = x_BSH + self.pos(torch.arange(tokens_BS.shape[1], device=tokens_BS.device))
        return x_BSH


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, spec.kv_heads, spec.head_size
        self.rope = spec.position is PositionKind.rope
        self.dropout_p = spec.attention_dropout
        self.q = nn.Linear(spec.hidden_size, spec.q_size, bias=spec.bias)
        self.k = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.bias)
        self.v = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.bias)
        self.o = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x_BSH.shape
        # -1 heads: under tensor parallelism q, k and v are column shards holding A/t and K/t
        # heads (torchtitan 0.3.0 models/llama3/model.py views with -1 the same way).
        q_BSAD = self.q(x_BSH).view(batch, seq_len, -1, self.head_size)
        k_BSKD = self.k(x_BSH).view(batch, seq_len, -1, self.head_size)
        v_BSKD = self.v(x_BSH).view(batch, seq_len, -1, self.head_size)
        if self.rope:
            q_BSAD, k_BSKD = _rope(q_BSAD), _rope(k_BSKD)
        out_BASD = F.scaled_dot_product_attention(
            q_BSAD.transpose(1, 2),
            k_BSKD.transpose(1, 2),
            v_BSKD.transpose(1, 2),
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=True,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o(out_BASD.transpose(1, 2).reshape(batch, seq_len, -1))


class GeluMlp(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.fc2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x_BSH), approximate="tanh"))


class SwigluMlp(nn.Module):
    """Shazeer (2020), eq. 6: down(silu(gate x) * up x)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.up = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.down = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x_BSH)) * self.up(x_BSH))


def _dense_mlp(spec: ModelSpec) -> nn.Module:
    return GeluMlp(spec) if spec.mlp is MlpKind.gelu else SwigluMlp(spec)


class MoeMlp(nn.Module):
    """Top-k routed experts (Shazeer et al. 2017; Mixtral's softmax over the chosen k)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_per_token
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = nn.ModuleList(_dense_mlp(spec) for _ in range(spec.num_experts))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weight_TK, expert_TK = self.router(x_TH).topk(self.top_k, dim=-1)
        weight_TK = weight_TK.softmax(dim=-1)
        out_TH = torch.zeros_like(x_TH)
        for index, expert in enumerate(self.experts):
            token, slot = (expert_TK == index).nonzero(as_tuple=True)
            # Every expert runs, even on zero tokens, so every parameter gets a gradient
            # (zeros when unused): sharded engines then see the same set of gradients each step.
            contribution = expert(x_TH[token]) * weight_TK[token, slot, None]
            out_TH = out_TH.index_add(0, token, contribution)
        return out_TH.view_as(x_BSH)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = _norm(spec)
        self.mlp = MoeMlp(spec) if spec.is_moe else _dense_mlp(spec)
        self.dropout = nn.Dropout(spec.hidden_dropout)
        self.checkpointed = False
        """Full activation checkpointing: keep only the block input, recompute in backward."""

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            # The recompute calls _body, not the module, so module hooks (the sharded
            # engines' gather/free) fire once per forward, not again during backward.
            return checkpoint(self._body, x_BSH, use_reentrant=False)
        return self._body(x_BSH)

    def _body(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.dropout(self.attn(self.attn_norm(x_BSH)))
        return x_BSH + self.dropout(self.mlp(self.mlp_norm(x_BSH)))


class Head(nn.Module):
    """Last unit: the final norm, then the output projection (absent when tied)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.proj = None if spec.tied_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, x_BSH: torch.Tensor, tied_weight_VH: torch.Tensor | None) -> torch.Tensor:
        x_BSH = self.norm(x_BSH)
        if self.proj is None:
            assert tied_weight_VH is not None
            return F.linear(x_BSH, tied_weight_VH)
        return self.proj(x_BSH)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = Embeddings(spec)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.head = Head(spec)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=_INIT_STD)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for block in self.blocks:
            block.checkpointed = enabled

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Return logits (B, S, V)."""
        x_BSH = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        tied = self.embed.tok.weight if self.head.proj is None else None
        return self.head(x_BSH, tied)


def check_buildable(spec: ModelSpec) -> None:
    """Refuse, in one line naming the field, a model this harness's Transformer does not build
    (the measure command calls it before launching any rank)."""
    for field in ("qkv_bias", "qk_norm", "post_norms", "attention_softcapping", "parallel_block", "head_bias",
                  "token_types", "head_transform", "embedding_projection"):
        if getattr(spec, field):
            raise ZeroplanError(f"model.{field}", "not built by the measurement harness (allowed: false)")
    if not spec.final_norm:
        raise ZeroplanError("model.final_norm", "a decoder without a final norm is not built by the measurement harness (allowed: true)")
    if spec.mlp in (MlpKind.geglu, MlpKind.relu):
        raise ZeroplanError("model.mlp", f"{spec.mlp.value} is not built by the measurement harness (allowed: gelu, swiglu)")
    if spec.mlp_bias is not None and spec.mlp_bias != spec.bias:
        raise ZeroplanError("model.mlp_bias", "not built by the measurement harness (allowed: null or equal to bias)")
    if not spec.norm_bias:
        raise ZeroplanError("model.norm_bias", "a LayerNorm without bias is not built by the measurement harness (allowed: true)")
    if spec.position_offset:
        raise ZeroplanError("model.position_offset", "not built by the measurement harness (allowed: 0)")
    if not spec.causal:
        raise ZeroplanError("model.causal", "an encoder's attention is not built by the measurement harness (allowed: true)")
    if spec.position is PositionKind.alibi or spec.embedding_norm:
        field = "position" if spec.position is PositionKind.alibi else "embedding_norm"
        raise ZeroplanError(f"model.{field}", "ALiBi and an embedding norm are not built by the measurement harness "
                            "(allowed: learned or rope positions, no embedding norm)")


def build_model(spec: ModelSpec, seed: int = 0) -> Transformer:
    """Build the model on the CPU with a fixed seed, so every rank starts from the same weights."""
    check_buildable(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(spec)


def next_token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens; computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())
