"""What transformers' KV cache holds in a training forward, measured on its own Llama on fake
tensors (torch-free: the planner's tests read the committed records). Written by
benchmarks/kv_cache_records.py."""

from __future__ import annotations

from pydantic import Field

from zeroplan.specs import BatchSpec, ModelSpec
from zeroplan.frameworks.record import ReleaseRecord
from zeroplan.specs.base import Frozen


class KvCacheRun(Frozen):
    """One forward (with labels, so the loss is formed inside it) at two depths."""

    use_cache: bool
    """LlamaConfig.use_cache (transformers' default True)."""
    checkpointing: str
    """'none', or 'checkpoint_wrapper': torch's apply_activation_checkpointing with a
    non-reentrant checkpoint_wrapper on every LlamaDecoderLayer (llama-recipes'
    apply_fsdp_checkpointing, accelerate's fsdp_activation_checkpointing)."""
    retained_bytes: list[int] = Field(min_length=2, max_length=2)
    """Live bytes once the forward has returned with its output object held (parameters
    excluded), with built_layers and built_layers + 1 blocks."""
    loss_only_bytes: list[int] = Field(min_length=2, max_length=2)
    """The same once only the loss is held (``loss = model(**batch).loss``)."""
    forward_peak_bytes: list[int] = Field(min_length=2, max_length=2)
    """How far live bytes rose during the model's forward (the loss's forward included)."""
    backward: str
    """'ok', or the first line of the error the backward raised."""


class KvCacheRecord(ReleaseRecord):
    """What the KV cache adds to a training forward of transformers' Llama, by checkpointing."""

    model: ModelSpec
    batch: BatchSpec
    built_layers: int = Field(ge=2)
    module_dtype: str
    runs: list[KvCacheRun]
    wall_time_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)
    replayed_release: str | None = None
    """None: the installed transformers' own forward; else the older release whose
    LlamaForCausalLM head and loss ran on the installed model (zeroplan.frameworks.transformers_release)."""

    def run(self, use_cache: bool, checkpointing: str) -> KvCacheRun:
        return next(r for r in self.runs if r.use_cache == use_cache and r.checkpointing == checkpointing)

    def cache_block_bytes(self, checkpointing: str) -> int:
        """What one more block adds, with the outputs held, with the cache beyond without it."""
        on, off = self.run(True, checkpointing), self.run(False, checkpointing)
        return (on.retained_bytes[1] - on.retained_bytes[0]) - (off.retained_bytes[1] - off.retained_bytes[0])

    @property
    def name(self) -> str:
        release = f":transformers-{self.replayed_release}" if self.replayed_release else ""
        return f"hf:{self.model.name}:kv-cache:s{self.batch.seq_len}:b{self.batch.micro_batch_size}{release}"
