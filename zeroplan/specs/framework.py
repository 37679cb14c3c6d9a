"""Which training stack runs the model: its own model code, checkpointing, loss and numerics
decide what a GPU holds. ``zeroplan`` is the project's reference transformer
(zeroplan/harness/model.py); the others are the frameworks' own model code, whose profiles are
documented in docs/frameworks.md with the source file and version each was read from."""

from __future__ import annotations

from enum import Enum


class Framework(str, Enum):
    """A training stack whose memory the planner predicts."""

    zeroplan = "zeroplan"
    """The reference transformer of zeroplan's own harness."""
    torchtitan = "torchtitan"
    """PyTorch's torchtitan (its Llama-3 model code, FSDP2, its activation checkpointing)."""
    hf = "hf"
    """Hugging Face Transformers models (Trainer / Accelerate / its DeepSpeed integration)."""
    torchtune = "torchtune"
    """PyTorch's torchtune (its Llama-3 builders, full-finetune recipes)."""
