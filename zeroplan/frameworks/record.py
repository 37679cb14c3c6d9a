"""What one fake-tensor run of a framework's own model code measured (torch-free: the planner's
tests and benchmarks/framework_accuracy.py read the committed records without torch)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.finetune import BITSANDBYTES_VERSION
from zeroplan.specs.training import recorded_before_kernels

SCHEMA_VERSION = 1
"""The layout of every measured record here (a kind that changes a field's meaning overrides its
``schema_version`` default with a version of its own)."""


class NamedRecord(Frozen):
    """A record stored in a file named after its ``name`` (each subclass defines it)."""

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def file_name(self) -> str:
        """The record's file name: its name with ':' (not allowed on every file system) as '_'."""
        return self.name.replace(":", "_") + ".json"


class ReleaseRecord(NamedRecord):
    """A named record of what a framework release's own code did under a torch release: the
    fields every such record starts with (its own fields follow them)."""

    schema_version: int = SCHEMA_VERSION
    """Bumped when a field changes meaning."""
    framework_version: str
    """The installed release whose code ran (e.g. 'transformers 4.56.2', 'torchtitan 0.3.0'; the
    model code, and the sharding, loss or builder code where the record's kind ran them)."""
    torch_version: str
    """torch.__version__ that ran it."""


class FrameworkRecord(ReleaseRecord):
    """Live bytes one framework's decoder block keeps for backward, measured at full width."""

    model: ModelSpec
    """The architecture at its full depth (the planner's request uses it as is)."""
    built_layers: int = Field(ge=3)
    """Decoder blocks actually built (full width; fewer than the model's depth)."""
    added_layers: int = Field(default=1, ge=1)
    """Blocks the deeper forward adds (selective-layer: its interval k, one period)."""
    strategy: StrategyKind
    """The strategy the run stands for (it decides the module dtype HF trains in)."""
    training: TrainingSpec
    """Framework, precision and activation-checkpointing policy, as the planner reads them."""
    _training_kernels = field_validator("training", mode="before")(recorded_before_kernels)
    batch: BatchSpec
    """Micro-batch size and sequence length of the forward."""
    module_dtype: str
    """dtype of the module's parameters during the forward ('torch.bfloat16', ...)."""
    retained_bytes: list[int] = Field(min_length=2, max_length=2)
    """Device bytes still live once the forward has returned (parameters excluded; the logits
    included; with activation offloading, the framework's host copies excluded), with
    built_layers and with built_layers + added_layers blocks."""
    block_growth_bytes: list[int]
    """Growth of live bytes across each block's forward after the first, in the deeper run
    (under autocast it also holds the bf16 weight copies autocast caches until forward ends)."""
    block_saved_tensors: list[str] = Field(default_factory=list)
    """What autograd saved (saved_tensors_hooks) from the end of the second-to-last block's forward
    to the end of the last one's, in the deeper run: 'shape dtype storage-bytes', '(parameter)'
    for a parameter's storage, '(again)' for a storage listed before (empty in older records)."""
    block_forward_peak_bytes: int | None = None
    """How far live bytes rose inside the last block's forward, in the deeper run, above what was
    live when it began (MemTracker's per-module local peak): less the block's own growth, the
    transient its forward holds beyond what it keeps (None in older records)."""
    wall_time_s: float = Field(ge=0)
    """Seconds the run took, model construction included."""
    notes: list[str] = Field(default_factory=list)
    """Caveats specific to this run."""

    @property
    def block_kept_bytes(self) -> int:
        """What the added blocks (one, unless added_layers says more) keep for backward: the
        difference of the two retained figures."""
        return self.retained_bytes[1] - self.retained_bytes[0]

    @property
    def name(self) -> str:
        t, b = self.training, self.batch
        policy = t.activation_checkpointing.value
        if t.activation_checkpointing is ActivationCheckpointing.selective_layer:
            policy += f"-k{t.selective_layer_interval}"
        if t.activation_offloading:
            policy += "+offload"
        return (f"{t.framework.value}:{self.model.name}:{self.strategy.value}:{t.precision.value}{finetune_tag(t)}:"
                f"ac={policy}:s{b.seq_len}:b{b.micro_batch_size}")


TARGET_LETTERS = {"q": "q", "k": "k", "v": "v", "o": "o", "gate": "g", "up": "u", "down": "d", "output": "h"}
"""One letter per LoRA target in a record's name (h: the LM head)."""


def finetune_tag(training: TrainingSpec) -> str:
    """What a record's name adds for a fine-tune: '' for a full fine-tune, else e.g.
    '+lora-r8-qvogud' or '+qlora-nf4-r8-qvogud' (the targets in force, in LoraTarget order),
    with '-a32' (an alpha other than 2 r), '-bs128'/'-nodq' (quantization other than QLoRA's
    blocks of 64 with double quantization), '-bnb0.43.1' (a bitsandbytes other than the default), '-drop0.1', '-dora' and '-basefp32' (a base loaded
    in fp32) where they apply."""
    f = training.finetune
    if f.trains_everything:
        return ""
    if not f.is_lora:
        return f"+frozen{'-embeddings' if f.freeze_embeddings else ''}-blocks{f.frozen_blocks}"
    named = {t.value for t in f.targets(training.framework)}
    letters = "".join(letter for target, letter in TARGET_LETTERS.items() if target in named)
    tag = f"+qlora-{f.quantize.value}" if f.quantize.is_quantized else "+lora"
    tag += f"-r{f.lora_rank}-{letters}"
    if f.quantize.is_quantized and (f.quant_block_size != 64 or not f.double_quant):
        tag += f"-bs{f.quant_block_size}{'' if f.double_quant else '-nodq'}"
    if f.bitsandbytes_version != BITSANDBYTES_VERSION:
        tag += f"-bnb{f.bitsandbytes_version}"
    if f.lora_alpha is not None and f.lora_alpha != 2 * f.lora_rank:
        tag += f"-a{f.lora_alpha:g}"
    if f.lora_dropout:
        tag += f"-drop{f.lora_dropout:g}"
    if f.dora:
        tag += "-dora"
    if f.base_dtype.value != "bf16":
        tag += f"-base{f.base_dtype.value}"
    return tag


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
