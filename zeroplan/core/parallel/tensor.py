"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM sec. 3) and sequence parallelism
(Korthikanti et al. 2022, sec. 4.2.2): which parameters a tensor-parallel rank holds, what one
block saves for backward on it, and the collectives each block issues.

Symbols: t the tensor-parallel degree, s sequence, b micro-batch, h hidden, e bytes of an
activation element.
"""

from __future__ import annotations

from enum import Enum

from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.specs.model import ModelSpec
from zeroplan.units import ceil_div


class TensorSplit(str, Enum):
    """How one parameter tensor is cut across the t ranks of a tensor-parallel group."""

    column = "column"
    """Output features split (dim 0): Megatron's ColumnParallelLinear, torch's ColwiseParallel
    (Shard(0) of the weight and the bias)."""
    row = "row"
    """Input features split (dim 1): RowParallelLinear / RowwiseParallel (the bias, added after
    the reduction, is replicated)."""
    vocabulary = "vocabulary"
    """Rows of the vocabulary split (dim 0): Megatron's VocabParallelEmbedding and the output
    projection (ColwiseParallel on the head; RowwiseParallel shards an nn.Embedding's weight
    on dim 0)."""
    replicated = "replicated"
    """Every rank holds the whole tensor: norms, the MoE router, learned position tables."""


# Megatron-LM sec. 3 (Figure 3): q, k, v and the MLP's first matrices column-parallel, the
# attention output and the MLP's last matrix row-parallel, so each block needs one reduction
# after attention and one after the MLP. torchtitan 0.3.0 models/common/decoder_sharding.py
# (set_gqa_attention_sharding, set_dense_ffn_sharding) declares the same split for wq/wkv/wo
# and w1/w3/w2; norms replicated (norm_config); tok_embeddings and output over the vocabulary.
_COLUMN_LEAVES = frozenset({"q", "k", "v", "gate", "up", "fc1"})
_ROW_LEAVES = frozenset({"o", "down", "fc2"})


def tensor_split(name: str) -> TensorSplit:
    """How the planner's tensor ``name`` (zeroplan.core.params naming: 'attention.q.weight',
    'mlp.experts.3.down.weight', ...) is split."""
    if name in ("token.weight", "lm_head.weight", "shared_embedding.weight"):
        return TensorSplit.vocabulary
    module, _, kind = name.rpartition(".")
    leaf = module.rsplit(".", 1)[-1]
    if leaf in _COLUMN_LEAVES:
        return TensorSplit.column
    if leaf in _ROW_LEAVES:
        return TensorSplit.row if kind == "weight" else TensorSplit.replicated
    return TensorSplit.replicated


# DTensor's Shard(dim) cuts like torch.chunk: the first ranks get ceil(n / t) (torch 2.13
# distributed/tensor/placement_types.py Shard._split_tensor); rank 0, the largest, is planned.
def local_shape(tensor: ParamTensor, tp: int) -> tuple[int, ...]:
    """The shape tensor-parallel rank 0 holds of ``tensor``."""
    split = tensor_split(tensor.name)
    shape = list(tensor.shape)
    if split in (TensorSplit.column, TensorSplit.vocabulary):
        shape[0] = ceil_div(shape[0], tp)
    elif split is TensorSplit.row:
        shape[1] = ceil_div(shape[1], tp)
    return tuple(shape)


def tensor_parallel_units(units: tuple[ParamUnit, ...], tp: int) -> tuple[ParamUnit, ...]:
    """The units as one tensor-parallel rank holds them (the units themselves when t = 1)."""
    if tp == 1:
        return units
    return tuple(_rank_unit(unit, tp) for unit in units)


def _rank_unit(unit: ParamUnit, tp: int) -> ParamUnit:
    """One unit as a tensor-parallel rank holds it."""
    # The model's units are built once (zeroplan.core.params caches them) and the plan search
    # asks for the ranks of every pipeline layout of each tp: a unit's is kept by its identity,
    # the entry holding it (the units are immutable).
    known = _RANK_UNITS.get((id(unit), tp))
    if known is not None and known[0] is unit:
        return known[1]
    if len(_RANK_UNITS) >= 65536:
        _RANK_UNITS.clear()
    # Built unvalidated (Frozen.trusted): a name that is already a str and a shape of ints of
    # the tensor's own length, as validating them gives (a 70B model's ranks: ~2,000 tensors a
    # plan search, ~5 us of pydantic's validation each); the tensor's other fields are its own.
    # Not model_copy: it would carry the whole tensor's cached numel into the split one.
    split = ParamUnit.trusted(name=unit.name, tensors=tuple(
        ParamTensor.trusted(name=t.name, shape=local_shape(t, tp), shard_group_divisor=t.shard_group_divisor,
                            trainable=t.trainable, quantized=t.quantized)
        for t in unit.tensors))
    _RANK_UNITS[id(unit), tp] = (unit, split)
    return split


_RANK_UNITS: dict[tuple[int, int], tuple[ParamUnit, ParamUnit]] = {}


def tensor_parallel_model(model: ModelSpec, tp: int) -> ModelSpec:
    """The block one tensor-parallel rank computes, as a model of its own: a/t query heads,
    kv/t key-value heads, f/t inner width and V/t vocabulary columns of the logits (a
    vocabulary-parallel loss: Megatron's vocab_parallel_cross_entropy, torchtitan's
    loss_parallel). Its hidden size is the model's: without sequence parallelism the residual
    stream, the norms and the linears' inputs are whole on every rank (Korthikanti et al.
    2022, Table 2, "tensor parallel": 10 sbh of 34 not divided by t)."""
    if tp == 1:
        return model
    return model.model_copy(update={
        "num_heads": model.num_heads // tp,
        "num_kv_heads": model.kv_heads // tp,
        "head_dim": model.head_size,
        "ffn_hidden_size": model.ffn_hidden_size // tp,
        "vocab_size": ceil_div(model.vocab_size, tp),
    })
