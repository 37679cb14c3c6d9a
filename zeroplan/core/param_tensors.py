"""The parameter tensor and the sharding unit, and the shapes of the layers every model is built
from (a norm, a linear, a feed-forward MLP): below zeroplan.core.params and the
encoder-decoder's units, which both compose them.
"""

from functools import cached_property
from math import prod

from pydantic import Field

from zeroplan.specs.base import Frozen
from zeroplan.specs.model import ModelSpec, NormKind


class ParamTensor(Frozen):
    """One parameter tensor."""

    name: str
    """Dotted name inside its unit, e.g. 'attention.q.weight'."""
    shape: tuple[int, ...] = Field(min_length=1)
    """Tensor shape; dim 0 is the one FSDP2 shards."""
    shard_group_divisor: int = Field(default=1, gt=0)
    """Data-parallel sharding of this tensor runs over the shard group divided by this: ep for
    the routed experts under expert parallelism (torchtitan 0.3.0 distributed/fsdp.py shards
    them over the efsdp mesh, dp_shard x cp x tp / ep ranks), 1 for everything else."""
    trainable: bool = True
    """Whether the optimizer steps it (False: a frozen weight, which has no gradient, no
    optimizer state and no master copy; zeroplan.core.finetune)."""
    quantized: bool = False
    """A frozen base weight stored in the fine-tune's quantized format (QLoRA's nf4, ...)."""

    # Cached: the planner sums these thousands of times per fit (the tensor is frozen).
    @cached_property
    def numel(self) -> int:
        return prod(self.shape)


class ParamUnit(Frozen):
    """A group of parameters gathered and reduced together."""

    name: str
    """'embedding', 'block.<i>' or 'head'."""
    tensors: tuple[ParamTensor, ...]
    """Tensors in registration order."""

    @cached_property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def norm_tensors(prefix: str, model: ModelSpec) -> list[ParamTensor]:
    h = model.hidden_size
    tensors = [ParamTensor(name=f"{prefix}.weight", shape=(h,))]
    if model.norm is NormKind.layernorm and model.norm_bias:
        tensors.append(ParamTensor(name=f"{prefix}.bias", shape=(h,)))
    return tensors


def linear_tensors(prefix: str, in_features: int, out_features: int, bias: bool) -> list[ParamTensor]:
    tensors = [ParamTensor(name=f"{prefix}.weight", shape=(out_features, in_features))]
    if bias:
        tensors.append(ParamTensor(name=f"{prefix}.bias", shape=(out_features,)))
    return tensors


def mlp_tensors(prefix: str, model: ModelSpec, width: int | None = None) -> list[ParamTensor]:
    """A feed-forward MLP of inner width ``width`` (default ffn_hidden_size)."""
    h, f, bias = model.hidden_size, width if width is not None else model.ffn_hidden_size, model.mlp_biased
    if not model.mlp.gated:
        return linear_tensors(f"{prefix}.fc1", h, f, bias) + linear_tensors(f"{prefix}.fc2", f, h, bias)
    return (
        linear_tensors(f"{prefix}.gate", h, f, bias)
        + linear_tensors(f"{prefix}.up", h, f, bias)
        + linear_tensors(f"{prefix}.down", f, h, bias)
    )
