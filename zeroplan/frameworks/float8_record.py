"""What one block's FSDP2 all-gather moved, with torchao's float8 all-gather or in bf16, on a fake
process group (torch-free: read by the planner's tests). Written by benchmarks/compiled_records.py."""

from __future__ import annotations

from pydantic import Field

from zeroplan.specs import ModelSpec
from zeroplan.frameworks.record import ReleaseRecord
from zeroplan.specs.base import Frozen


class AllGatherCall(Frozen):
    """One all-gather a rank issued, as the dispatcher saw it."""

    op: str
    """The c10d operator (``c10d._allgather_base_.default``)."""
    dtype: str
    """dtype of the gathered buffer (FSDP2 gathers mixed dtypes as uint8 bytes)."""
    element_bytes: int = Field(ge=1)
    input_elements: int = Field(ge=0)
    """Elements this rank contributes."""
    output_elements: int = Field(ge=0)
    """Elements of the gathered result (input x ranks)."""


class Float8AllGatherRecord(ReleaseRecord):
    """The all-gathers one torchtitan Llama block's FSDP2 unit issues in its forward."""

    model: ModelSpec
    world_size: int = Field(ge=2)
    """Ranks of the fake process group (this is rank 0)."""
    float8_all_gather: bool
    """torchao tensorwise Float8Linear with enable_fsdp_float8_all_gather; False: torchtitan's
    bf16 param_dtype all-gather of its fp32 shards."""
    parameter_elements: int = Field(ge=0)
    """Elements of the block's parameters (unsharded)."""
    collectives: list[AllGatherCall]
    wall_time_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the gathered results (what each rank receives, its own shard included)."""
        return sum(c.output_elements * c.element_bytes for c in self.collectives)

    @property
    def name(self) -> str:
        kind = "float8" if self.float8_all_gather else "bf16"
        return f"torchtitan:{self.model.name}:all-gather-{kind}:n{self.world_size}"
