"""What one fake-process-group run of torchtitan's own expert parallelism (its MoE model, its
parallelize function, FSDP2 on top) measured on one rank. Torch-free: tests and the planner's
checks read the committed records without torch. zeroplan.frameworks.expert_parallel writes them."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from zeroplan.frameworks.parallel_record import ActivationMeasurement, CollectiveCount, ParamShard, RankParameters
from zeroplan.frameworks.record import ReleaseRecord, load_records


class ExpertParallelRecord(RankParameters, ReleaseRecord):
    """torchtitan's own MoE model at full width, a few blocks deep, parallelized by its own
    parallelize function with expert parallelism and FSDP2, measured on rank 0 of a fake group."""

    family: str
    """torchtitan's model package ('deepseek_v3')."""
    flavor: str
    """Its config registry key ('16B')."""
    dim: int
    num_experts: int
    top_k: int
    moe_hidden: int
    vocab_size: int
    n_layers_full: int
    n_dense_layers_full: int
    """Blocks of the flavour with a dense feed-forward instead of a MoE (the first ones)."""
    spmd_backend: str
    ep: int = Field(ge=1)
    dp_shard: int = Field(ge=1)
    efsdp: int = Field(ge=1)
    """FSDP degree of the routed experts: dp_shard x cp x tp / ep (parallel_dims.py)."""
    world_size: int = Field(ge=1)
    rank: int = Field(ge=0)
    parallelize: str
    param_dtype: str
    params: list[ParamShard]
    """Every parameter of the built model (``built_layers`` blocks: the dense ones first)."""
    built_layers: int = Field(ge=1)
    built_dense_layers: int = Field(ge=0)
    routing: str = ""
    """How the tokens were routed in the activation run (empty for a states record)."""
    split_sizes: list[int] = Field(default_factory=list)
    """The all-to-all split sizes the token dispatcher read on the rank, in the order it read
    them (per MoE block: input splits, then output splits, ep each); empty for states."""
    activations: ActivationMeasurement | None = None
    """The activation run: the shallow run has ``built_layers`` blocks, the deep run one MoE
    block more, so the per-block figures are those of one MoE block."""
    wall_time_s: float = Field(ge=0)
    how: str
    notes: list[str] = Field(default_factory=list)

    def layer_param_bytes(self, index: int) -> int:
        return sum(p.local_bytes for p in self.params if p.fqn.startswith(f"layers.{index}."))

    @property
    def dense_block_param_bytes(self) -> int:
        """Local bytes of the first dense block (0 if the flavour has none)."""
        return self.layer_param_bytes(0) if self.built_dense_layers else 0

    @property
    def moe_block_param_bytes(self) -> int:
        """Local bytes of the first MoE block."""
        return self.layer_param_bytes(self.built_dense_layers)

    def full_depth_param_bytes(self) -> int:
        """Local parameter bytes at the flavour's full depth: its dense blocks are alike and so
        are its MoE blocks (each built block of a kind has the same local bytes)."""
        moe_layers = self.n_layers_full - self.n_dense_layers_full
        return (self.outside_blocks_param_bytes + self.n_dense_layers_full * self.dense_block_param_bytes
                + moe_layers * self.moe_block_param_bytes)

    def block_all_to_all(self, phase: str) -> list[CollectiveCount]:
        """One MoE block's all-to-alls over the ep group in ``phase``."""
        return [c for c in self.activations.block_collectives
                if c.phase == phase and "all_to_all" in c.op and c.group_size == self.ep]

    @property
    def name(self) -> str:
        return "_".join(self.name_parts(f"torchtitan-{self.family}-{self.flavor}", f"ep{self.ep}", f"dp{self.dp_shard}"))


def load_expert_records(directory: Path) -> list[ExpertParallelRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, ExpertParallelRecord, "expert-parallel record")
