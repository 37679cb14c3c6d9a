"""What one fake-tensor measurement of a compiled decoder block found (torch-free: the planner's
tests read the committed records without torch). Written by benchmarks/compiled_records.py."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.record import ReleaseRecord, finetune_tag, load_records
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework

SAVED_KINDS = ("intermediate", "hidden", "parameter", "buffer", "shared")
"""What a saved value is: made inside the block; the block's hidden-state input; a parameter or
buffer of the block; an input every block shares (positions, the attention mask)."""

COUNTED_KINDS = ("intermediate", "hidden")
"""The kinds that are the block's own bytes (the rest exist once per model or per step)."""


class SavedValue(Frozen):
    """One tensor the compiled forward graph saves for backward."""

    name: str
    """Its node's name in the partitioned forward graph."""
    op: str
    """The aten operator that made it (``aten::mm``), or ``input <dynamo source>``."""
    shape: list[int]
    dtype: str
    """``torch.bfloat16``, ..."""
    bytes: int = Field(ge=0)
    """Elements times element size, from its FakeTensor metadata."""
    kind: str
    """One of SAVED_KINDS."""

    @model_validator(mode="after")
    def _known_kind(self) -> SavedValue:
        if self.kind not in SAVED_KINDS:
            raise ZeroplanError("kind", f"{self.kind!r} is not a saved-value kind (allowed: {', '.join(SAVED_KINDS)})")
        return self


def counted_saved_bytes(values: list[SavedValue], kinds: tuple[str, ...] = COUNTED_KINDS) -> int:
    """The bytes of ``values`` of ``kinds`` (by default the block's own, COUNTED_KINDS)."""
    return sum(v.bytes for v in values if v.kind in kinds)


class CompiledBlockRecord(ReleaseRecord):
    """What one decoder block saves for backward compiled (inductor's partitioner) and eagerly."""

    model: ModelSpec
    """The architecture (one block of it is built at full width)."""
    framework: Framework
    activation_checkpointing: ActivationCheckpointing
    """The framework's checkpointing policy wrapped around the block before compile."""
    memory_budget: float | None = None
    """torchtitan's MemoryBudgetAC (functorch's activation_memory_budget); None: torch's default 1.0."""
    float8_recipe: str | None = None
    """torchao Float8Linear recipe the block's linears were converted with ('tensorwise',
    'rowwise'); None: none."""
    finetune: FineTuneSpec = FineTuneSpec()
    """The LoRA/QLoRA block measured (zeroplan.frameworks.lora); the default: a full fine-tune."""
    autocast: bool = False
    """The forward ran under torch.autocast(bfloat16), as transformers' Trainer runs it with
    bf16=True (peft's fp32 adapters then compute in bf16)."""
    batch: BatchSpec
    module_dtype: str
    compiled_saved_values: list[SavedValue]
    """Every tensor the partitioned forward graph saves for backward, in its output order."""
    compiled_runtime_saved_bytes: int = Field(ge=0)
    """Bytes of the distinct storages the compiled block's autograd node held after a fake run of
    its forward (parameters, buffers, shared inputs left out): the list, checked at run time."""
    eager_live_bytes: int = Field(ge=0)
    """Live bytes after the eager block's forward with only its autograd graph kept, less those
    before: what it keeps for backward, as zeroplan.frameworks.measure measures a block."""
    eager_saved_values: list[SavedValue] = Field(default_factory=list)
    """The tensors autograd's saved-tensor hooks saw in the eager forward (one per storage, its
    bytes the storage's; ``op`` the autograd node that made it); listed only without
    checkpointing, where no checkpoint keeps tensors past the hooks."""
    wall_time_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)

    @property
    def compiled_saved_bytes(self) -> int:
        """The block's own saved bytes: intermediates and its hidden-state input."""
        return counted_saved_bytes(self.compiled_saved_values)

    @property
    def name(self) -> str:
        policy = self.activation_checkpointing.value
        if self.memory_budget is not None:
            policy = f"memory-budget-{self.memory_budget:g}"
        fp8 = f":float8-{self.float8_recipe}" if self.float8_recipe else ""
        tune = finetune_tag(TrainingSpec(framework=self.framework, finetune=self.finetune))
        autocast = ":autocast" if self.autocast else ""
        return (f"{self.framework.value}{tune}:{self.model.name}:ac={policy}{fp8}{autocast}:"
                f"s{self.batch.seq_len}:b{self.batch.micro_batch_size}")


def load_compiled_records(directory: Path) -> list[CompiledBlockRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, CompiledBlockRecord, "compiled block record")


class CompiledLossRecord(ReleaseRecord):
    """What one chunk of a framework's cross-entropy saves for backward, compiled as the
    framework compiles its loss and eagerly (zeroplan.frameworks.compiled_loss)."""

    model: ModelSpec
    """The architecture whose logits the loss reads (its vocabulary sets a row's width)."""
    framework: Framework
    batch: BatchSpec
    chunks: int = Field(gt=0)
    """The framework's loss chunks (8 in torchtune's CEWithChunkedOutputLoss and torchtitan's
    ChunkedLossWrapper): one chunk's logits are batch.micro_batch_size x seq_len / chunks rows."""
    logits_shape: list[int]
    """The chunk's logits as the compiled function receives them."""
    logits_dtype: str
    compiled_saved_values: list[SavedValue]
    """Every tensor the partitioned forward graph saves for backward (``hidden``: the logits
    input; ``shared``: the labels)."""
    compiled_runtime_saved_bytes: int = Field(ge=0)
    """Bytes of the distinct storages the compiled function's autograd node held after a fake
    run of its forward."""
    compiled_gradient_dtype: str
    """The dtype of the logits' gradient the partitioned backward graph returns."""
    eager_saved_values: list[SavedValue]
    """The tensors autograd's saved-tensor hooks saw in the eager loss, one per storage."""
    wall_time_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.batch.micro_batch_size * self.batch.seq_len // self.chunks

    def saved_bytes(self, compiled: bool, kinds: tuple[str, ...] = ("intermediate",)) -> int:
        """Bytes of the saved values of ``kinds`` (intermediates: what the loss itself makes)."""
        return counted_saved_bytes(self.compiled_saved_values if compiled else self.eager_saved_values, kinds)

    @property
    def name(self) -> str:
        return (f"{self.framework.value}:{self.model.name}:loss:chunks{self.chunks}:"
                f"s{self.batch.seq_len}:b{self.batch.micro_batch_size}")


def load_compiled_loss_records(directory: Path) -> list[CompiledLossRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, CompiledLossRecord, "compiled loss record")
