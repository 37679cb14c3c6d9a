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


LAUNCH_ALLOCATOR_CONF: dict[Framework, str] = {
    # torchtitan's run_train.sh (commit 0168bd5) launches torchrun under
    # PYTORCH_ALLOC_CONF="expandable_segments:True".
    Framework.torchtitan: "expandable_segments:True",
}
"""The PYTORCH_CUDA_ALLOC_CONF a framework's own launcher sets, which a request of that
framework is judged under unless it names one (MemoryAssumptions.allocator_conf). Frameworks
whose launchers set none (torchtune's `tune run`, Hugging Face's Trainer and accelerate) run
PyTorch's defaults."""
