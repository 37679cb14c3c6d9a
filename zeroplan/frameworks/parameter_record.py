"""Bytes of the parameters a framework's own builder makes, trainable and frozen, by dtype, per
decoder block and for the embedding, final norm and LM head (torch-free: the planner's tests read
the committed records without torch). What the planner's model-state terms of a LoRA/QLoRA
fine-tune are checked against: the frozen base in bf16 or NF4 (with its quantization scales),
the adapters in their dtype."""

from __future__ import annotations

from pydantic import Field, field_validator

from zeroplan.frameworks.record import ReleaseRecord, finetune_tag
from zeroplan.specs import ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import recorded_before_kernels


class ParameterBytes(Frozen):
    """Bytes of one group of parameters by dtype ('bfloat16', 'float32'; 'nf4' for a torchao
    NF4Tensor: the bytes of every tensor it holds, FrameworkParameterRecord.quantized_storage)."""

    trainable: dict[str, int] = Field(default_factory=dict)
    """requires_grad=True."""
    frozen: dict[str, int] = Field(default_factory=dict)
    """requires_grad=False."""

    @property
    def trainable_bytes(self) -> int:
        return sum(self.trainable.values())

    @property
    def frozen_bytes(self) -> int:
        return sum(self.frozen.values())


class FrameworkParameterRecord(ReleaseRecord):
    """Parameter storage of a framework's model as its builder makes it (on the meta device: the
    bytes are each tensor's elements times its element size)."""

    model: ModelSpec
    """The architecture at its full depth (built_layers blocks of it were built)."""
    built_layers: int = Field(ge=1)
    strategy: StrategyKind
    """The strategy the run stands for (it decides the module dtype HF builds in)."""
    training: TrainingSpec
    """Framework, precision and fine-tune, as the planner reads them."""
    _training_kernels = field_validator("training", mode="before")(recorded_before_kernels)
    module_dtype: str
    """The dtype the model was built in ('torch.bfloat16', ...)."""
    blocks: list[ParameterBytes]
    """Each built decoder block (identical blocks: the planner's per-block figure is any one)."""
    embedding: ParameterBytes
    """The token embedding (with tied embeddings, the LM head's weight too)."""
    final_norm: ParameterBytes
    head: ParameterBytes
    """The LM head (empty with tied embeddings), its adapters included."""
    quantized_storage: dict[str, int] = Field(default_factory=dict)
    """One decoder block's quantized weights: bytes of each tensor a quantized weight holds,
    summed over the block (torchao NF4Tensor: quantized_data, quantized_scalers,
    quantization_factor, scaler_mean, nf4; bitsandbytes Params4bit: data (the packed 4-bit
    weights in their quant_storage dtype), absmax, code, offset, state2.absmax, state2.code);
    empty without quantization."""
    quantized_layout: dict[str, str] = Field(default_factory=dict)
    """How the quantized weights of one block are laid out (NF4Tensor: block_size,
    scaler_block_size; Params4bit: blocksize, quant_type, quant_storage, nested_blocksize; and
    per weight its tensors' dtype and shape)."""
    wall_time_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)

    @property
    def name(self) -> str:
        t = self.training
        return f"{t.framework.value}:{self.model.name}:{self.strategy.value}:{t.precision.value}{finetune_tag(t)}:parameters"
