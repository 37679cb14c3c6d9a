"""What one fake-tensor run of a framework's own model code measured (torch-free: the planner's
tests and benchmarks/framework_accuracy.py read the committed records without torch)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen

SCHEMA_VERSION = 1


class FrameworkRecord(Frozen):
    """Live bytes one framework's decoder block keeps for backward, measured at full width."""

    schema_version: int = SCHEMA_VERSION
    """Bumped when a field changes meaning."""
    framework_version: str
    """The installed release whose model code ran (e.g. 'transformers 4.56.2')."""
    torch_version: str
    """torch.__version__ that ran the forward."""
    model: ModelSpec
    """The architecture at its full depth (the planner's request uses it as is)."""
    built_layers: int = Field(ge=3)
    """Decoder blocks actually built (full width; fewer than the model's depth)."""
    strategy: StrategyKind
    """The strategy the run stands for (it decides the module dtype HF trains in)."""
    training: TrainingSpec
    """Framework, precision and activation-checkpointing policy, as the planner reads them."""
    batch: BatchSpec
    """Micro-batch size and sequence length of the forward."""
    module_dtype: str
    """dtype of the module's parameters during the forward ('torch.bfloat16', ...)."""
    retained_bytes: list[int] = Field(min_length=2, max_length=2)
    """Bytes still live once the forward has returned (parameters excluded; the logits
    included), with built_layers and with built_layers + 1 blocks."""
    block_growth_bytes: list[int]
    """Growth of live bytes across each block's forward after the first, in the deeper run
    (under autocast it also holds the bf16 weight copies autocast caches until forward ends)."""
    wall_time_s: float = Field(ge=0)
    """Seconds the run took, model construction included."""
    notes: list[str] = Field(default_factory=list)
    """Caveats specific to this run."""

    @property
    def block_kept_bytes(self) -> int:
        """What one more block keeps for backward: the difference of the two retained figures."""
        return self.retained_bytes[1] - self.retained_bytes[0]

    @property
    def file_name(self) -> str:
        """The record's file name: its name with ':' (not allowed on every file system) as '_'."""
        return self.name.replace(":", "_") + ".json"

    @property
    def name(self) -> str:
        t, b = self.training, self.batch
        return (f"{t.framework.value}:{self.model.name}:{self.strategy.value}:{t.precision.value}:"
                f"ac={t.activation_checkpointing.value}:s{b.seq_len}:b{b.micro_batch_size}")


def load_framework_records(directory: Path) -> list[FrameworkRecord]:
    """Every ``*.json`` record in ``directory``, sorted by file name; a bad file is one line."""
    return load_records(directory, FrameworkRecord, "framework record")


def load_records(directory: Path, record_type: type[Frozen], what: str) -> list:
    """Every ``*.json`` file in ``directory`` read as ``record_type``, sorted by file name; a
    file that is not one is a one-line error naming ``what`` it should have been."""
    records = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            records.append(record_type.model_validate_json(path.read_text(encoding="utf-8")))
        except (ValidationError, UnicodeDecodeError) as error:
            raise ZeroplanError(what, f"{path.name} is not a {what}: {str(error).splitlines()[0]}") from None
    return records
