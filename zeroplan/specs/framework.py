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
    litgpt = "litgpt"
    """Lightning AI's litgpt (its own GPT model code, its finetune scripts on Lightning Fabric)."""
    megatron = "megatron"
    """NVIDIA's Megatron-LM on megatron-core (its GPTModel, DistributedDataParallel with the
    contiguous gradient buffer, the distributed optimizer, its tensor/sequence/pipeline
    parallelism and vocabulary-parallel cross-entropy)."""
    megatron_deepspeed = "megatron-deepspeed"
    """Microsoft's Megatron-DeepSpeed fork: Megatron's legacy GPT model (tensor, sequence and
    pipeline parallelism) trained by DeepSpeed's engine, its BF16_Optimizer or ZeRO stage-1
    optimizer and its pipeline engine."""
    fairseq = "fairseq"
    """Meta's fairseq as its fully-sharded README ran it (c6006678, March 2021): its
    transformer_lm decoder (torch 1.8's multi_head_attention_forward, its fp32 GELU and
    log-softmax loss) under fairscale's FullyShardedDataParallel (zeroplan.core.fairseq)."""

    @property
    def megatron_layout(self) -> bool:
        """Megatron's GPT model, its tensor-parallel layers and vocabulary-parallel loss, under
        megatron-core (megatron) or DeepSpeed (megatron-deepspeed)."""
        return self in (Framework.megatron, Framework.megatron_deepspeed)


# torchtitan 9dec370 (2024-12-26), the commit of its published H100 benchmarks
# (benchmarks/llama3_h100_202412_torchtitan.md): torchtitan/parallelisms/parallelize_llama.py
# apply_fsdp shards each block (reshard_after_forward False for the last one) and then the whole
# model, whose own unit is the embedding, the final norm and the output projection; train.py's
# loss_fn is one cross_entropy over the logits upcast to fp32.
TORCHTITAN_RELEASES: tuple[str, ...] = ("0.3.0", "9dec370")
DEEPSPEED_RELEASES: tuple[str, ...] = ("0.19.8", "2022-bigscience")
"""The DeepSpeed releases the megatron-deepspeed profile models (TrainingSpec.deepspeed_release):
PyPI 0.19.8 (the default) and the early-2022 source BigScience trained with (zeroplan.core.deepspeed_2022)."""
HF_DEEPSPEED_RELEASES: tuple[str, ...] = ("0.19.8", "0.13.3", "0.14.2")
"""The DeepSpeed releases the hf profile models under ZeRO (TrainingSpec.deepspeed_release): PyPI
0.19.8 (the default) and 0.13.3, which stands for the earlier releases in the two respects that
differ: its engine casts the whole module to 16 bits, peft's fp32 adapters included (every release
before 0.19.2: zeroplan.core.finetune.activations.adapters_stay_fp32), and ZeRO-2 allocates its ipg
bucket before the loss's backward (before 0.18.0: zeroplan.core.buffers.deepspeed_bucket_from_backward_start).
Its ZeRO-3 also reduces the gradients on the engine's clone of the world group while the parameters
gather on the default group, two NCCL communicators (zeroplan.core.communicators), and its ZeRO-2
offload checks each gradient for overflow on the GPU (before 0.18.0:
zeroplan.core.deepspeed_offload.gradient_path_bytes). 0.14.2 is 0.13.3 but for one respect: from
0.14.1 to 0.16.x the ZeRO-2 offload's step copies the whole fp32 partition onto the GPU before
casting it (zeroplan.core.deepspeed_offload.step_upcopy_bytes)."""
EARLIER_HF_DEEPSPEED_RELEASES: tuple[str, ...] = ("0.13.3", "0.14.2")
"""The hf releases that differ from 0.19.8 in the respects 0.13.3 stands for."""
"""The torchtitan releases the profile models (TrainingSpec.torchtitan_release; None is the
first, the profile's own)."""


LAUNCH_ALLOCATOR_CONF: dict[Framework, str] = {
    # torchtitan's run_train.sh (commit 0168bd5) launches torchrun under
    # PYTORCH_ALLOC_CONF="expandable_segments:True".
    Framework.torchtitan: "expandable_segments:True",
}
"""The PYTORCH_CUDA_ALLOC_CONF a framework's own launcher sets, which a request of that
framework is judged under unless it names one (MemoryAssumptions.allocator_conf). Frameworks
whose launchers set none (torchtune's `tune run`, Hugging Face's Trainer and accelerate) run
PyTorch's defaults."""


MULTINODE_LAUNCH_ALLOCATOR_CONF: dict[Framework, str] = {
    # torchtitan's README ("Multi-Node Training", 9dec370 and b5bcd76 alike) sends multi-node
    # users to multinode_trainer.slurm, whose `srun torchrun ...` (9dec370 line 62, b5bcd76 line
    # 63) runs under no PYTORCH_CUDA_ALLOC_CONF (it sets NCCL and EFA variables only):
    # PyTorch's defaults. Only the single-node run_llama_train.sh / run_train.sh set expandable
    # segments, and torchtitan's own code sets no allocator configuration.
    Framework.torchtitan: "",
}
"""The PYTORCH_CUDA_ALLOC_CONF a framework's multi-node launcher sets, where it is not the
single-node one's (launch_allocator_conf)."""


def launch_allocator_conf(framework: Framework, num_nodes: int) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF the framework's own launcher sets for a run over
    ``num_nodes`` nodes (None: its launchers set none, PyTorch's defaults)."""
    if num_nodes > 1 and framework in MULTINODE_LAUNCH_ALLOCATOR_CONF:
        return MULTINODE_LAUNCH_ALLOCATOR_CONF[framework]
    return LAUNCH_ALLOCATOR_CONF.get(framework)


# litgpt 0.4.13.dev1 (commit 00af8b0) litgpt/model.py GPT.__init__ builds lm_head as a Linear of its
# own beside transformer.wte, whatever the checkpoint ties; scripts/convert_hf_checkpoint.py
# (lines 206-207, 281-282) copies wte into lm_head.weight when a tied checkpoint has none, and
# finetune/full.py, lora.py and adapter.py validate_args refuse train.tie_embeddings. So a
# model that ties its head (Gemma, Llama 3.2, Falcon) holds a second V x h matrix there.
UNTIES_EMBEDDINGS: frozenset[Framework] = frozenset({Framework.litgpt})
"""Frameworks whose own model code builds the output projection apart from the embedding even
for a model whose checkpoint ties them (PlanRequest plans that model untied)."""

# litgpt 0.4.13.dev1 (00af8b0) and 9a1b82b litgpt/model.py build no nn.Dropout: the config's
# dropouts are not read, and CausalSelfAttention passes dropout_p=0.0 to SDPA (line 318-319).
# Measured: litgpt's Phi-2 block keeps no dropout mask (benchmarks/eager-litgpt-records).
BUILDS_NO_DROPOUT: frozenset[Framework] = frozenset({Framework.litgpt})
"""Frameworks whose own model code has no attention or hidden dropout, whatever the checkpoint's
config says (PlanRequest plans the model without them)."""


LAUNCH_ENVIRONMENT: dict[Framework, str] = {
    # Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (and every script under
    # examples/) exports CUDA_DEVICE_MAX_CONNECTIONS=1 before torchrun, and
    # megatron/training/arguments.py validate_args (Megatron-LM d98e8a6) asserts it is 1 with
    # tensor or context parallelism on GPUs before Blackwell, so a tensor-parallel collective is
    # queued before the GEMM it overlaps. Neither sets PYTORCH_CUDA_ALLOC_CONF: the caching
    # allocator runs PyTorch's defaults.
    Framework.megatron: "CUDA_DEVICE_MAX_CONNECTIONS=1",
}
"""Environment a framework's own launch scripts set that does not change the bytes planned,
shown in the report's header so a user's launch can be compared with it."""


ACCELERATE_VERSION = "1.10.1"
"""The accelerate release the hf profile reads (TrainingSpec.accelerate_version None)."""
ACCELERATE_OLDEST = (0, 28)
"""The oldest accelerate release whose FSDP1 checkpoint save is modelled (0.28.0
utils/fsdp_utils.py save_fsdp_model, read with transformers 4.39.0's Trainer)."""
ACCELERATE_NEWEST = (1, 10, 1)

TRANSFORMERS_VERSION = "4.56.2"
"""The transformers release the hf profile measures (TrainingSpec.transformers_version None)."""
TRANSFORMERS_OLDEST = (4, 31, 0)
"""The oldest transformers release whose causal-LM loss the hf profile models (4.31.0, the
release of llama-recipes' first published runs): LlamaForCausalLM.forward upcasts the logits
and shifts them as every release up to 4.45 does."""
TRANSFORMERS_NEWEST = (4, 56, 2)
"""The newest release modelled: the profile's own."""


LITGPT_FORKS: tuple[str, ...] = ("tinyllama",)
"""The lit-gpt forks TrainingSpec.litgpt_fork plans: TinyLlama's (jzhang38/TinyLlama@bf12224,
zeroplan.core.tinyllama)."""
