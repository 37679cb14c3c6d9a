"""What a compiled decoder block saves for backward under tensor, sequence and context
parallelism, and what torchtune's activation offloading moves off the device under compile
(torch-free: the planner's tests read the committed records without torch). Written by
benchmarks/compiled_parallel_records.py (zeroplan.frameworks.compiled_parallel)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from zeroplan.frameworks.compiled_record import SavedValue, counted_saved_bytes
from zeroplan.frameworks.record import ReleaseRecord, finetune_tag, load_records
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec, TrainingSpec
from zeroplan.specs.finetune import FineTuneSpec


class CompiledParallelBlockRecord(ReleaseRecord):
    """One torchtitan block on rank 0 of a fake tp x cp group, compiled and eager."""

    model: ModelSpec
    """The preset the torchtitan flavour matches (its dimensions are the flavour's)."""
    flavor: str
    """torchtitan's llama3_configs key ('8B')."""
    activation_checkpointing: ActivationCheckpointing
    float8_recipe: str | None = None
    batch: BatchSpec
    """The global sequence: the rank's block runs seq_len / cp tokens (seq_len / (cp tp) of the
    residual stream under sequence parallelism)."""
    tp: int = Field(ge=1)
    sequence_parallel: bool
    cp: int = Field(ge=1)
    spmd_backend: str
    parallelize: str
    """torchtitan's calls that sharded the block, in order."""
    compiled_saved_values: list[SavedValue]
    """The rank's local tensors the partitioned forward graph saves, in its output order."""
    compiled_runtime_saved_bytes: int = Field(ge=0)
    """Distinct storages the compiled autograd node held after a fake run (parameters, buffers,
    shared inputs left out)."""
    eager_live_bytes: int = Field(ge=0)
    """Live bytes after the eager block's forward with only its autograd graph kept, less before."""
    wall_time_s: float = Field(ge=0)
    how: str
    notes: list[str] = Field(default_factory=list)

    @property
    def compiled_saved_bytes(self) -> int:
        return counted_saved_bytes(self.compiled_saved_values)

    @property
    def name(self) -> str:
        fp8 = f":float8-{self.float8_recipe}" if self.float8_recipe else ""
        sp = "sp" if self.sequence_parallel else "nosp"
        return (f"torchtitan:{self.model.name}:tp{self.tp}-{sp}:cp{self.cp}:ac={self.activation_checkpointing.value}{fp8}:"
                f"s{self.batch.seq_len}:b{self.batch.micro_batch_size}")


class CompiledOffloadRecord(ReleaseRecord):
    """torchtune's activation offloading around its model with every layer compiled as its
    recipes compile it, against the same model eager: forward only, on fake tensors."""

    model: ModelSpec
    finetune: FineTuneSpec = FineTuneSpec()
    """torchtune's LoRA/QLoRA model measured (zeroplan.frameworks.lora); the default: a full fine-tune."""
    batch: BatchSpec
    activation_checkpointing: ActivationCheckpointing
    layers: list[int]
    """The model depths run (the difference of two is one block)."""
    eager_host_bytes: list[int]
    """Bytes OffloadActivations had copied to host after the forward, eager, at each depth."""
    compiled_host_bytes: list[int]
    """The same with every layer compiled."""
    dynamo_graphs: int = Field(ge=0)
    """Graphs dynamo compiled for the deepest compiled run (the layers share one)."""
    compiled_layer_saved_values: list[SavedValue]
    """What the compiled layer's partitioned forward saves (the checkpoint outside it drops them in
    forward; its recompute in backward rebuilds them): the last graph dynamo compiled, the one
    every layer whose input needs a gradient runs."""
    compiled_first_layer_saved_values: list[SavedValue] = Field(default_factory=list)
    """With a frozen embedding (LoRA) the first layer's input needs no gradient and dynamo compiles
    that layer as a graph of its own: what its partition saves (empty with one graph)."""
    wall_time_s: float = Field(ge=0)
    how: str
    notes: list[str] = Field(default_factory=list)

    @property
    def compiled_layer_saved_bytes(self) -> int:
        return counted_saved_bytes(self.compiled_layer_saved_values)

    @property
    def compiled_first_layer_saved_bytes(self) -> int:
        return counted_saved_bytes(self.compiled_first_layer_saved_values)

    @property
    def name(self) -> str:
        tune = finetune_tag(TrainingSpec(framework="torchtune", finetune=self.finetune))
        return (f"torchtune{tune}_{self.model.name}_offload_ac={self.activation_checkpointing.value}_"
                f"s{self.batch.seq_len}_b{self.batch.micro_batch_size}")


def load_compiled_parallel_records(directory: Path) -> list[CompiledParallelBlockRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, CompiledParallelBlockRecord, "compiled parallel block record")
