"""Batches of varying length: the length statistics of an unpacked dataset whose batches are each
padded to their own longest sample (HF's DataCollatorForSeq2Seq, ms-swift's data_collate_fn,
torchtune's padded_collate), as a user reads them off the dataset."""

from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen


class LongSamples(str, Enum):
    """What the data pipeline does with a sample longer than the sequence length."""

    drop = "drop"
    """Dropped (ms-swift's default truncation_strategy 'delete'): the lengths seen are the
    dataset's below --seq-len."""
    truncate = "truncate"
    """Cut to --seq-len: every longer sample becomes a batch of --seq-len tokens."""


class VaryingLengths(Frozen):
    """The dataset's sample lengths in tokens: mean, standard deviation, shortest, and how many
    samples an epoch draws from (before any longer than --seq-len are dropped)."""

    mean_tokens: float = Field(gt=0)
    sd_tokens: float = Field(ge=0)
    min_tokens: int = Field(gt=0)
    samples: int = Field(gt=0)
    long_samples: LongSamples = LongSamples.drop

    @model_validator(mode="after")
    def _check(self) -> "VaryingLengths":
        if self.mean_tokens <= self.min_tokens:
            raise ZeroplanError("batch.varying_lengths", f"mean {self.mean_tokens:g} tokens must exceed the shortest sample's "
                                f"{self.min_tokens} (allowed: MEAN > MIN)")
        if self.sd_tokens == 0:
            raise ZeroplanError("batch.varying_lengths", "a standard deviation of 0 is one length: leave the flag out "
                                "(allowed: SD > 0)")
        return self
