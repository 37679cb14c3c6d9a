"""What one fake-process-group run of torchtitan's own tensor/sequence/context parallelism
measured on one rank (torch-free: tests and the planner's checks read the committed records
without torch). zeroplan.frameworks.tensor_parallel writes them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field

from zeroplan.frameworks.record import ReleaseRecord, load_records
from zeroplan.specs.base import Frozen

Part = Literal["embedding", "block", "norm", "output"]
"""Where a parameter sits in the decoder: tok_embeddings, layers.N, the final norm, lm_head."""


class ParamShard(Frozen):
    """One parameter as the measured rank holds it."""

    fqn: str
    """Fully qualified name in the unwrapped model ('layers.0.feed_forward.w1.weight')."""
    part: Part
    global_shape: list[int]
    """Shape of the whole parameter before any parallelism is applied."""
    local_shape: list[int]
    """Shape of the tensor this rank stores (a DTensor's to_local())."""
    dtype: str
    local_bytes: int = Field(ge=0)
    """Bytes of the local tensor: numel(local_shape) x element size."""
    placements: str = ""
    """A DTensor's placements as torch prints them; empty for a plain (local) tensor."""


class SavedTensor(Frozen):
    """One distinct storage one decoder block saved for backward (through autograd's
    saved-tensor hooks), parameters excluded."""

    module: str
    """The innermost module running when it was first saved, relative to the block
    ('feed_forward.w1'; '' for the block itself)."""
    shape: list[int]
    dtype: str
    nbytes: int = Field(ge=0)
    """Bytes of the whole storage under the tensor (a view counts its storage once)."""


class CollectiveCount(Frozen):
    """``count`` identical collectives one decoder block issues (on the measured rank)."""

    phase: Literal["forward", "backward"]
    kind: str
    """all_gather, reduce_scatter, all_reduce, broadcast or other (zeroplan.simulate.record)."""
    op: str
    """The operator as the dispatcher saw it ('c10d._allgather_base_.default')."""
    dtype: str
    input_bytes: int = Field(ge=0)
    """Bytes this rank hands to one call (its shard for an all-gather)."""
    output_bytes: int = Field(ge=0)
    """Bytes one call leaves on this rank (the gathered tensor for an all-gather)."""
    group_size: int = Field(ge=1)
    count: int = Field(ge=1)


class ActivationMeasurement(Frozen):
    """What one rank's forward keeps for backward, and which collectives a block issues."""

    micro_batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    """The global sequence length of one sample (before any sequence or context sharding)."""
    activation_checkpointing: Literal["none", "full", "selective-op"]
    module_dtype: str
    """dtype of the parameters the forward computed with."""
    norm_formula: Literal["cpu", "cuda"] = "cpu"
    """What F.rms_norm saved: "cpu", torch's composite on the CPU (two fp32 copies of its input);
    "cuda", the fused CUDA kernel's autograd formula (its input and an fp32 rstd per row),
    registered for the CPU by zeroplan.simulate.fused_rms_norm."""
    layers: list[int] = Field(min_length=2, max_length=2)
    """Decoder blocks built in the shallow and in the deep run."""
    retained_bytes: list[int] = Field(min_length=2, max_length=2)
    """Bytes still live (MemTracker) once each run's forward returned, parameters excluded and
    the model's output (logits) included."""
    block_growth_bytes: list[int]
    """Growth of live bytes across each block's forward after the first, in the deep run."""
    block_saved: list[SavedTensor]
    """What the last block of the deep run saved for backward, tensor by tensor (empty under
    full checkpointing, whose wrapper saves through its own hooks)."""
    block_collectives: list[CollectiveCount]
    """Collectives of the deep run less those of the shallow run: what one block issues."""
    model_collectives: list[CollectiveCount]
    """Every collective of the deep run (the blocks and the rest of the model)."""
    backward_ran: bool
    """Whether backward ran on the fake tensors (the run fails if it raises, so every committed
    record says true; a field so that a record made without it could say so)."""

    @property
    def block_kept_bytes(self) -> int:
        """What one block keeps for backward: the difference of the two retained figures."""
        return (self.retained_bytes[1] - self.retained_bytes[0]) // (self.layers[1] - self.layers[0])

    @property
    def outside_blocks_bytes(self) -> int:
        """What the forward keeps outside the blocks (embedding output, final norm, logits,
        the attention mask shared by every block): the shallow run less its blocks."""
        return self.retained_bytes[0] - self.layers[0] * self.block_kept_bytes

    @property
    def block_saved_bytes(self) -> int:
        return sum(t.nbytes for t in self.block_saved)

    def block_collective_bytes(self, phase: str) -> int:
        """Output bytes of one block's collectives in ``phase``."""
        return sum(c.output_bytes * c.count for c in self.block_collectives if c.phase == phase)


class RankParameters:
    """What a record of torchtitan's own parallelism reads off its ``params`` (the measured rank's
    parameter shards) and its ``activations`` (None for a record of model states only)."""

    def part_bytes(self, part: Part) -> int:
        return sum(p.local_bytes for p in self.params if p.part == part)

    @property
    def local_param_bytes(self) -> int:
        return sum(p.local_bytes for p in self.params)

    @property
    def outside_blocks_param_bytes(self) -> int:
        """Local bytes of the embedding, the final norm and the output projection."""
        return self.part_bytes("embedding") + self.part_bytes("norm") + self.part_bytes("output")

    def name_parts(self, head: str, *layout: str) -> list[str]:
        """The name's parts: ``head``, the SPMD backend, the ``layout``'s degrees, then 'states' or
        the activation run's checkpointing and shape."""
        backend = {"spmd_types": "spmd", "partial_dtensor": "dtensor"}.get(self.spmd_backend, self.spmd_backend)
        a = self.activations
        run = ["states"] if a is None else [f"ac-{a.activation_checkpointing}", f"s{a.seq_len}", f"b{a.micro_batch_size}"]
        return [head, backend, *layout, *run]


class ParallelRecord(RankParameters, ReleaseRecord):
    """torchtitan's own parallelism applied to its Llama-3 at full width, a few blocks deep,
    measured on rank 0 of a fake process group."""

    flavor: str
    """torchtitan's llama3_configs key whose config was built ('8B', '70B')."""
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    n_layers_full: int
    """Blocks the flavour has; fewer are built."""
    spmd_backend: str
    """torchtitan's ParallelismConfig.spmd_backend the run used."""
    tp: int = Field(ge=1)
    dp_shard: int = Field(ge=1)
    cp: int = Field(ge=1)
    sequence_parallel: bool
    world_size: int = Field(ge=1)
    rank: int = Field(ge=0)
    parallelize: str
    """The torchtitan calls that applied the parallelism."""
    param_dtype: str
    """dtype the trainer builds the parameters in (TrainingConfig.dtype)."""
    params: list[ParamShard]
    """Every parameter of the built model (``built_layers`` blocks), as the rank holds it."""
    built_layers: int = Field(ge=1)
    activations: ActivationMeasurement | None = None
    """None for a record of model states only."""
    wall_time_s: float = Field(ge=0)
    how: str
    """The command that regenerates it."""
    notes: list[str] = Field(default_factory=list)

    @property
    def block_param_bytes(self) -> int:
        """Local bytes of one block's parameters (block 0)."""
        return sum(p.local_bytes for p in self.params if p.fqn.startswith("layers.0."))

    def full_depth_param_bytes(self) -> int:
        """Local parameter bytes at the flavour's full depth: the built blocks are identical."""
        return self.outside_blocks_param_bytes + self.n_layers_full * self.block_param_bytes

    @property
    def name(self) -> str:
        parts = self.name_parts(f"torchtitan-llama3-{self.flavor}", f"tp{self.tp}", f"dp{self.dp_shard}", f"cp{self.cp}",
                                "sp" if self.sequence_parallel else "nosp")
        if self.activations is not None and self.activations.norm_formula != "cpu":
            parts.append(f"{self.activations.norm_formula}norm")
        return "_".join(parts)


def collective_counts(records: list[tuple]) -> list[CollectiveCount]:
    """Counted collectives from (phase, kind, op, dtype, input_bytes, output_bytes, group) keys."""
    counter = Counter(records)
    return [CollectiveCount(phase=key[0], kind=key[1], op=key[2], dtype=key[3], input_bytes=key[4],
                            output_bytes=key[5], group_size=key[6], count=n)
            for key, n in sorted(counter.items())]


def load_parallel_records(directory: Path) -> list[ParallelRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, ParallelRecord, "parallel record")
