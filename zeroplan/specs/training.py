"""How the model is trained: numeric precision, optimizer, activation checkpointing, batch shape."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import Field, model_serializer

from zeroplan.specs.base import Frozen
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.lengths import VaryingLengths


class Precision(str, Enum):
    """Numeric formats of parameters, gradients and activations."""

    fp32 = "fp32"
    """Everything in fp32."""
    bf16_mixed = "bf16-mixed"
    """bf16 compute with an fp32 master copy of the weights (Micikevicius et al. 2018)."""
    fp16_mixed = "fp16-mixed"
    """fp16 compute with an fp32 master copy and loss scaling."""
    bf16_pure = "bf16-pure"
    """bf16 parameters, gradients and optimizer states; no fp32 copy."""

    @property
    def is_mixed(self) -> bool:
        return self in (Precision.bf16_mixed, Precision.fp16_mixed)

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self is Precision.fp32 else 2


# torchtitan 0.3.0 config/configs.py TrainingConfig: dtype and mixed_precision_param "bfloat16" |
# "float32", no fp16 and no loss scaler. torchtune 0.6.1 recipes/full_finetune_distributed.py
# (and the LoRA recipes): "In GPUs which do not support bfloat16, we fall back to fp32", and a
# dtype of fp16 is refused ("fp16 precision is not supported in this recipe").
_FP32_WITHOUT_BF16 = (Framework.torchtitan, Framework.torchtune)


def precision_without_bf16(framework: Framework) -> Precision:
    """The precision a framework's users run on a GPU whose tensor cores take no bf16 (a V100):
    fp16 with an fp32 master copy and a loss scaler where the stack has it (torch AMP's
    GradScaler under zeroplan's and Hugging Face's --fp16, Lightning's "16-mixed", Megatron's
    and DeepSpeed's --fp16, fairseq's --fp16), fp32 where it has no fp16 (torchtitan, torchtune)."""
    return Precision.fp32 if framework in _FP32_WITHOUT_BF16 else Precision.fp16_mixed


class Optimizer(str, Enum):
    """Optimizers whose state size zeroplan knows."""

    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    sgd_momentum = "sgd-momentum"
    adafactor = "adafactor"
    adam_8bit = "adam-8bit"
    lion = "lion"
    muon = "muon"
    """Muon on the blocks' matrices, AdamW on the rest (zeroplan.core.muon): torch.optim.Muon
    beside AdamW under DDP, DeepSpeed's MuonWithAuxAdam (its "Muon" optimizer type) under ZeRO-1/2."""


class OptimizerLoop(str, Enum):
    """How torch.optim's Adam/AdamW (and SGD) walk the parameters (torch/optim/adam.py)."""

    foreach = "foreach"
    """_multi_tensor_adam: every tensor at once; torch's default on CUDA."""
    for_loop = "for-loop"
    """_single_tensor_adam (``foreach=False``): one tensor after another."""
    fused = "fused"
    """_fused_adam (``fused=True``): torch._fused_adamw_, in place."""


class ModelLoad(str, Enum):
    """How each rank builds the model before the engine partitions it (zeroplan.core.model_load)."""

    sharded = "sharded"
    """Each parameter is partitioned as it is made: transformers' from_pretrained inside
    DeepSpeed's zero.Init, which it enters under ZeRO-3 when TrainingArguments (whose
    __post_init__ makes the HfTrainerDeepSpeedConfig that is_deepspeed_zero3_enabled reads)
    exists before the model is loaded. Nothing whole is held at load."""
    full_per_rank = "full-per-rank"
    """Every rank materialises the whole model in host memory in its load dtype (from_pretrained
    without zero.Init: the model loaded before TrainingArguments is built), and DeepSpeed's engine
    then moves that whole module onto the rank's GPU before ZeRO-3 partitions it."""


class ActivationCheckpointing(str, Enum):
    """What the backward pass recomputes (Korthikanti et al. 2022, sec. 4 and 5)."""

    none = "none"
    """Store every activation the backward pass needs."""
    selective = "selective"
    """Recompute only the attention core (the terms quadratic in sequence length)."""
    full = "full"
    """Store only each block's input; recompute the block in backward."""
    selective_op = "selective-op"
    """torchtitan's op-level selective checkpointing: keep the outputs of the ops on its save
    list (matmuls, with every second one recomputed; attention), recompute the rest."""
    selective_layer = "selective-layer"
    """Layer-level selective checkpointing: checkpoint every k-th block fully (blocks k, 2k, ...
    counted from 1; k = TrainingSpec.selective_layer_interval), keep the others' activations
    (torchtune's ``ac_mode: selective`` with ``ac_option: k``)."""


class AttentionKernel(str, Enum):
    """How attention stores its intermediates for the backward pass."""

    eager = "eager"
    """Materialises softmax(QK^T) (a*s*s per sample), as in Korthikanti et al. eq. (1)."""
    flash = "flash"
    """Fused kernel (FlashAttention, PyTorch SDPA): keeps only Q, K, V, the output and the
    per-row log-sum-exp (Dao et al. 2022, sec. 3.1)."""
    sdpa_masked = "sdpa-masked"
    """torch 2.1's F.scaled_dot_product_attention given an additive b x 1 x s x s mask (Qwen-1's
    modeling_qwen.py without use_flash_attn): on CUDA the memory-efficient kernel, which keeps
    Q, K, V, the output, a per-row fp32 log-sum-exp and the mask as the b x a x s x s tensor
    torch 2.1 materialises for it (zeroplan.core.activations.attention_core_terms). Framework
    hf, torch release 2.1 only."""


class AttentionImplementation(str, Enum):
    """Which flash kernel runs attention: it sets the rate attention's FLOPs run at relative to
    the matrix products (zeroplan.core.attention_rate)."""

    flash_attn_2 = "flash-attn-2"
    """FlashAttention-2's CUDA kernels (flash-attn 2.x; PyTorch SDPA's flash backend since
    torch 2.2, which vendors them)."""
    flash_attn_triton = "flash-attn-triton"
    """The Triton FlashAttention of flash-attn's ``flash_attn_triton.py`` (llm-foundry's MPT
    ``attn_impl: triton``)."""


class Kernels(str, Enum):
    """Which dispatch path the activation terms follow: the ops that save a different set of
    tensors on a GPU than on a CPU (torch 2.13 native_functions.yaml: ``_fused_rms_norm`` has a
    CUDA kernel and is CompositeImplicitAutograd elsewhere; docs/memory-model.md, section 3)."""

    cuda = "cuda"
    """What a run on an NVIDIA GPU saves: every fit verdict."""
    cpu = "cpu"
    """What a run on the CPU saves: used only to reproduce CPU measurements (the harness on
    gloo, the fake-tensor simulation, the framework records)."""


class StateConvention(str, Enum):
    """Where the bytes of mixed-precision training live. Each is a documented layout, not a
    fudge factor; see docs/memory-model.md."""

    zero = "zero"
    """ZeRO paper sec. 3.1: half-precision parameters and gradients (2+2 bytes) plus K bytes of
    optimizer state that include the fp32 master copy (K=12 for Adam)."""
    deepspeed = "deepspeed"
    """DeepSpeed's engines: as ``zero`` but the gradients the optimizer reads are held in fp32
    (2 + 4 + 12 = 18 bytes per parameter, deepspeed/runtime/zero/stage3.py)."""
    fsdp2 = "fsdp2"
    """PyTorch FSDP2 and DDP under autocast: parameters and gradients stay fp32 (4+4 bytes) and
    are cast to bf16 only for compute; the fp32 parameter is the master copy."""


class Objective(str, Enum):
    """What the step trains for."""

    sft = "sft"
    """A causal-LM step: one forward of the micro-batch, cross-entropy on its next tokens."""
    dpo = "dpo"
    """Direct preference optimization as torchtune 0.6.1's LoRA DPO recipes run it
    (recipes/lora_dpo_single_device.py, lora_dpo_distributed.py): chosen and rejected sequences in
    one forward, the reference forward under no_grad with the adapters disabled, DPOLoss
    (zeroplan.core.dpo). BatchSpec.micro_batch_size counts the forward's rows, chosen and rejected
    both: twice the recipe's ``batch_size`` of pairs."""
    reward = "reward"
    """A reward model's step as DeepSpeed-Chat's step 2 runs it (step2_reward_model_finetuning at
    3a77097): the bare decoder and a scalar v_head, chosen and rejected sequences in one forward,
    a pairwise loss on their scores (zeroplan.core.reward_model). BatchSpec.micro_batch_size counts
    the forward's rows: twice the script's per_device_train_batch_size of pairs."""

    @property
    def pairwise(self) -> bool:
        """Whether a micro-batch is rows of chosen and rejected pairs (an even count)."""
        return self is not Objective.sft


class Float8Recipe(str, Enum):
    """torchao's float8 training recipes (torchao 0.14.1 float8/config.py Float8LinearRecipeName),
    as torchtitan's float8 converter applies them (components/quantization/float8.py)."""

    rowwise = "rowwise"
    """One scale per row (Float8LinearConfig.from_recipe_name("rowwise")): torchtitan 0.3.0's
    default recipe_name."""
    rowwise_with_gw_hp = "rowwise_with_gw_hp"
    """Rowwise float8 for the output and the input's gradient, the weight's gradient in bf16
    (torchao float8/config.py:312-337 Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"):
    cast_config_input_for_grad_weight and cast_config_grad_output_for_grad_weight
    ScalingType.DISABLED; torchao 0.13.0+git4fc4068d6 and 0.14.1 alike), torchtitan's other
    recipe_name (--float8.recipe_name). Float8Linear saves the high-precision input and weight
    either way (float8_linear.py:45 matmul_with_hp_or_float8_args.forward); compiled, the
    partitioner keeps the bf16 matmul inputs the grad-weight product reads where rowwise
    recomputes them (zeroplan.core.compiled.compiled_layer_bytes)."""
    tensorwise = "tensorwise"
    """One scale per tensor for inputs, weights and gradients (torchao's Float8LinearConfig()
    default; torchtitan 0.3.0's converter no longer names it)."""
    te_delayed = "te-delayed"
    """TransformerEngine's delayed scaling over te.Linear, as llm-foundry's ``precision: amp_fp8``
    runs it (Composer get_precision_context: fp8_autocast with DelayedScaling(fp8_format HYBRID,
    E4M3 forward and E5M2 gradients, amax_history_len 16, amax_compute_algo max); the model's
    ``fc_type: te``). Timed only (zeroplan.core.float8_time): the memory is the bf16 run's, though
    TransformerEngine v0.10 keeps a float8 copy and transpose of every te.Linear weight unsharded
    (module/base.py set_fp8_weights: 2 bytes an element more) and saves the inputs' float8
    transposes for backward instead of the bf16 inputs. Framework zeroplan only, eager, tp 1."""


class FsdpStateDict(str, Enum):
    """The state-dict type a Hugging Face run under accelerate's FSDP1 saves its checkpoints with
    (accelerate's ``fsdp_state_dict_type``; zeroplan.core.checkpoint_save plans the save)."""

    full = "full"
    """FULL_STATE_DICT: accelerate's default under FSDP1 (0.28.0 utils/dataclasses.py:1101-1103,
    1.10.1 :1973-1977), with FullStateDictConfig(offload_to_cpu=True, rank0_only=True) on several
    processes (utils/fsdp_utils.py save_fsdp_model): one unit gathered at a time, the copies on the host."""
    sharded = "sharded"
    """SHARDED_STATE_DICT: every parameter's local chunk cloned; on the GPU until accelerate 0.31.0
    gave it ShardedStateDictConfig(offload_to_cpu=True) (accelerate 67308ca, #2762)."""
    none = "none"
    """The run saves no checkpoint (the Trainer's save_strategy "no")."""


class TrainingSpec(Frozen):
    """Numerics and optimizer."""

    precision: Precision = Precision.bf16_mixed
    """Numeric formats."""
    optimizer: Optimizer = Optimizer.adamw
    """Optimizer (fixes the optimizer-state bytes)."""
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    """Activation recomputation mode."""
    attention_kernel: AttentionKernel = AttentionKernel.flash
    """Attention implementation (decides whether a*s^2 terms are stored)."""
    attention_implementation: AttentionImplementation = AttentionImplementation.flash_attn_2
    """Which flash kernel (read with attention_kernel flash): the rate of attention's FLOPs
    relative to the matrix products' (zeroplan.core.attention_rate)."""
    state_convention: StateConvention | None = None
    """Byte layout of model states; None takes the strategy's own (fsdp2 for PyTorch's DDP
    and FSDP, zero for DeepSpeed's ZeRO stages and offload)."""
    framework: Framework = Framework.zeroplan
    """The training stack whose model code, checkpointing and loss are predicted."""
    selective_layer_interval: int = Field(default=2, gt=0)
    """k of selective-layer checkpointing: every k-th block is checkpointed, 1 <= k <= the
    model's blocks (torchtune's ``ac_option``; its 0, also every block, is k = 1 here). Read
    only with activation_checkpointing selective-layer."""
    kernels: Kernels = Kernels.cuda
    """The device whose kernels the activation terms follow: cuda for a GPU run (the default,
    every verdict), cpu only to reproduce a measurement made on the CPU."""
    activation_offloading: bool = False
    """Move saved activations to host memory between forward and backward (torchtune's
    ``enable_activation_offloading``, which its recipe allows only with full checkpointing)."""
    partition_activations: bool = False
    """DeepSpeed's activation checkpointing splits each checkpointed block input over the
    tensor-parallel ranks, each keeping 1/tp of it and gathering it whole for the block's
    recompute (DeepSpeed config ``activation_checkpointing.partition_activations``,
    Megatron-DeepSpeed's ``--partition-activations``; with full checkpointing)."""
    cpu_checkpointing: bool = False
    """DeepSpeed's activation checkpointing keeps each checkpointed block input (or its
    partition) in host memory, copied back for the block's recompute (DeepSpeed config
    ``activation_checkpointing.cpu_checkpointing``, Megatron-DeepSpeed's
    ``--checkpoint-in-cpu``; with full checkpointing)."""
    fused_linear_cross_entropy: bool = False
    """Compute the output projection and the cross-entropy chunk by chunk with liger-kernel's
    fused linear cross-entropy, never materialising the logits (Hugging Face only: transformers'
    ``use_liger_kernel`` with ``liger_kernel_config={"fused_linear_cross_entropy": True}`` and
    its RMSNorm, SwiGLU and RoPE kernels off; docs/frameworks.md, "Loss")."""
    fused_cross_entropy: bool = False
    """The reference model's loss as flash-attn's fused CrossEntropyLoss over the compute-dtype
    logits instead of torch's on an fp32 copy (llm-foundry's default ``loss_fn:
    fused_crossentropy``): it saves the logits and a fp32 log-sum-exp per row, and its backward
    writes one logits-sized gradient (framework zeroplan only; docs/memory-model.md section 3,
    "Logits and loss")."""
    torch_multihead_attention: bool = False
    """Framework zeroplan only: every block's attention is torch's ``nn.MultiheadAttention``
    called as self-attention (``attention(x, x, x)``, one packed ``in_proj_weight`` and
    ``in_proj_bias`` for q, k and v, and its ``out_proj``), as DeepSpeedExamples'
    bf16_master_weight model builds it. Under DeepSpeed's ZeRO-3 engine (the deepspeed state
    convention) each block's gathered in-projection then outlives its release until the block's
    backward (zeroplan.core.deepspeed_mha_views)."""
    deepspeed_torch_linear: bool = False
    """Framework zeroplan only: under DeepSpeed's ZeRO-3 engine (the deepspeed state convention)
    the model's linears run torch's own F.linear, not DeepSpeed's zero3_linear_wrap, so each
    released linear's gathered weight stays alive until that linear's backward
    (zeroplan.core.deepspeed_torch_linear): every ZeRO-3 run of DeepSpeed 0.3.12 or 0.3.13, and a model
    built outside a zero.Init context and handed to deepspeed.initialize under 0.3.14 to 0.19.3."""
    deepspeed_fused_adam: bool = Field(default=False, exclude_if=lambda fused: not fused)
    """Framework hf under DeepSpeed's stage 0 in fp16: the script hands deepspeed.initialize its own
    FusedAdam (DeepSpeed-Chat's main.py), which DeepSpeed wraps in FP16_Optimizer, not
    FP16_UnfusedOptimizer: its step makes each group's fp32 gradient copies and their flat
    concatenation beside the fp16 gradients (zeroplan.core.deepspeed_fused_fp16)."""
    deepspeed_bf16_autocast: bool = False
    """Framework zeroplan under DeepSpeed's ZeRO-3 engine, bf16-pure precision: DeepSpeed's
    bf16 ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` with ``torch_autocast``
    in bf16 (DeepSpeed PR 7700, since 0.18.3): a separate bf16 master partition beside the bf16
    parameters, and CUDA autocast's fp32 softmax and layer_norm over the bf16 module
    (zeroplan.core.deepspeed_bf16_autocast). Set by a --deepspeed-config file that holds the
    three switches."""
    uncast_loss: bool = Field(default=False, exclude_if=lambda uncast: not uncast)
    """Framework zeroplan: the loop computes torch's nn.CrossEntropyLoss on the logits as the
    model returns them, without the reference model's fp32 upcast (DeepSpeedExamples'
    training/bf16_master_weight train.py): on a 16-bit module outside autocast its log-softmax
    and both gradients are in the logits' dtype; under CUDA autocast the log-softmax keeps that
    dtype and nll_loss works on an fp32 copy of it, with an fp32 gradient
    (zeroplan.core.uncast_loss). Framework litgpt: a loop's F.cross_entropy on the logits litgpt's
    GPT returns, held through backward, in place of litgpt fit()'s chunked fp32 loss
    (lightning-thunder's benchmark_litgpt.py; zeroplan.core.framework_loss.litgpt_loop_loss_tensors)."""
    checkpoint_early_stop: bool | None = None
    """Whether the block checkpoint stops recomputing once every tensor the backward saved is back
    (torch's non-reentrant checkpoint as rewritten after 2.0, set_checkpoint_early_stop); None: the
    framework's (zeroplan.core.profiles.FrameworkProfile.checkpoint_early_stop). False for torch
    1.13, whose non-reentrant checkpoint (torch/utils/checkpoint.py, _checkpoint_without_reentrant)
    reruns the whole block at the backward's first unpack: llm-foundry's runs on its 1.13.1 image."""
    checkpoint_reentrant: bool | None = None
    """Hugging Face only: whether a fully checkpointed block runs torch's reentrant checkpoint
    (True: transformers' gradient_checkpointing_enable without
    gradient_checkpointing_kwargs) or the non-reentrant one (False: gradient_checkpointing_kwargs=
    {"use_reentrant": False}, or ms-swift 1.x, which patches torch.utils.checkpoint.checkpoint to
    default to it); None: the framework's (zeroplan.core.profiles.checkpoint_is_reentrant). Under the
    non-reentrant one a custom Function's plain ctx attributes escape the checkpoint: bitsandbytes
    before 0.43.2 keeps every block's 4-bit matmul inputs through the backward
    (zeroplan.core.finetune.activations.checkpoint_escaping_inputs_bytes)."""
    unchunked_loss: bool = False
    """torchtitan only: its unchunked ``CrossEntropyLoss`` (the output projection in the model's
    forward, one fp32 cross-entropy over all the logits, as ``llama3_debugmodel_ce_loss``)
    instead of the ``ChunkedLossWrapper(num_chunks=8)`` its Llama-3 trainer configs build
    (docs/frameworks.md, "Loss")."""
    use_cache: bool = False
    """Hugging Face only: the model keeps transformers' KV cache in training (LlamaConfig's
    default use_cache=True, which only transformers' own gradient checkpointing turns off), so
    under checkpointing applied from outside transformers (torch's checkpoint_wrapper:
    llama-recipes' FSDP, accelerate's fsdp_activation_checkpointing) every layer's K and V stay
    alive with the model's output object; without checkpointing the cache is the K and V the
    attention saves anyway. Runs on transformers before 4.36 (its tuple cache): 4.36's
    DynamicCache and later make torch's non-reentrant checkpoint raise in backward
    (zeroplan.core.kv_cache)."""
    keep_outputs: bool = False
    """Hugging Face: the training loop holds the model's output object (its logits and,
    with use_cache, its cache) through backward (``outputs = model(**batch); loss =
    outputs.loss``) instead of keeping only the loss (``loss = model(**batch).loss``, the
    Trainer's compute_loss). zeroplan: the loop holds the logits the model returns through
    backward (``logits = model(ids); loss = loss_fn(logits, ...)``, DeepSpeedExamples'
    training/bf16_master_weight train.py). torchtune: its recipes' loop before August 2024 holds the fp32
    copy of the shifted logits through backward (``logits = logits[..., :-1, :].contiguous()``)."""
    transformers_version: str | None = None
    """Hugging Face only: the transformers release the model code is planned at (MAJOR.MINOR[.PATCH],
    4.31 to 4.56.2); None plans the profile's 4.56.2. Before 4.46 the causal-LM forward returns
    fp32 logits (the output object, and a loop that holds it, keep 4 bytes a logit), and before
    4.49 the loss makes a contiguous fp32 copy of the shifted logits; OPT's own attention clamps
    its scores and its loss runs in the compute dtype before 4.49 (zeroplan.core.transformers_release)."""
    deepspeed_release: str | None = None
    """megatron-deepspeed and hf: the DeepSpeed release planned; None plans 0.19.8. Under
    megatron-deepspeed its ZeRO stage-1 optimizer, one of zeroplan.specs.framework.DEEPSPEED_RELEASES:
    "2022-bigscience", the source of February 2022 (no reduce bucket, the step's flat 16-bit copy
    beside the kept gradients; zeroplan.core.deepspeed_2022). Under hf, one of
    HF_DEEPSPEED_RELEASES: "0.13.3", a release whose engine casts peft's fp32 adapters to 16 bits
    under ZeRO-3's zero.Init (every release before 0.19.2; zeroplan.core.finetune.activations
    adapters_stay_fp32) and whose ZeRO-2 allocates its ipg bucket before the loss's backward
    (before 0.18.0; zeroplan.core.buffers.deepspeed_bucket_from_backward_start); "0.14.2", the same
    but for the ZeRO-2 offload's step, which copies the fp32 partition onto the GPU (0.14.1 to
    0.16.x; zeroplan.core.deepspeed_offload.step_upcopy_bytes)."""
    torch_release: str | None = None
    """hf and zeroplan: the torch release the loop runs (MAJOR.MINOR[.PATCH], 1.7 to 2.13); None plans
    2.13. Before 2.0 zero_grad() zeroes the gradients in place instead of dropping them, so under
    DDP or one GPU they stay allocated through the next forward, and torch's Adam/AdamW step
    tensor by tensor unless optimizer_loop says otherwise (zeroplan.core.torch_release). The NCCL its
    wheels load decides NVLS's buffers outside the allocator (zeroplan.core.nccl_release)."""
    # The two checkpoint-save inputs are left out of the JSON when unset, so a request that does
    # not name them dumps (and every answer's digest reads) as before the fields existed.
    accelerate_version: str | None = Field(default=None, exclude_if=lambda version: version is None)
    """hf only: the accelerate release that wraps the model (MAJOR.MINOR[.PATCH], 0.28 to 1.10.1); None
    plans the profile's 1.10.1. It decides where an FSDP1 SHARDED_STATE_DICT save puts its chunks
    (zeroplan.core.checkpoint_save): on the GPU before 0.31.0, on the host from it."""
    fsdp_state_dict: FsdpStateDict | None = Field(default=None, exclude_if=lambda kind: kind is None)
    """hf under FSDP1 only (StrategySpec.fsdp1_root_stays_gathered, fsdp-full-shard or
    fsdp-shard-grad-op): the state-dict type the Trainer's checkpoint saves use (accelerate's
    ``fsdp_state_dict_type``); the save is a moment of its own (zeroplan.core.checkpoint_save).
    None plans accelerate's default under FSDP1, full."""
    torchtitan_release: str | None = None
    """torchtitan only: the release whose FSDP2 wrapping and loss are planned, one of
    zeroplan.specs.framework.TORCHTITAN_RELEASES; None plans the profile's 0.3.0. "9dec370"
    (December 2024): the embedding, final norm and output projection form the root unit, which
    FSDP2 then kept gathered from the forward to the end of backward, the last block is not
    resharded after forward, and the loss is unchunked (unchunked_loss must be set)."""
    litgpt_fork: str | None = None
    """litgpt only: a fork of lit-gpt whose model code and loss are planned instead of litgpt
    0.4.13.dev1's, one of zeroplan.specs.framework.LITGPT_FORKS: "tinyllama" (TinyLlama@bf12224's
    pretraining: flash-attn's fused RMSNorm, rotary and cross-entropy, xformers' fused SwiGLU,
    under Lightning 2.1.2's FSDP at bf16-mixed; zeroplan.core.tinyllama)."""
    optimizer_loop: OptimizerLoop | None = None
    """How the optimizer steps the tensors (decides its step temporary); None takes the
    framework's own: fused for the stacks whose recipes fuse AdamW (FrameworkProfile.fused_optimizer),
    else foreach, torch's default on CUDA."""
    optimizer_in_backward: bool = False
    """Step each parameter's optimizer in a post-accumulate-grad hook as soon as its gradient
    is reduced, and free that gradient (torchtune's ``optimizer_in_bwd``; its recipe refuses it
    with gradient accumulation or clipping), so the gradients are never all alive at once."""
    paged_optimizer: bool = False
    """bitsandbytes' paged optimizer (PagedAdamW, PagedAdamW8bit, PagedLion...: the QLoRA
    paper's and torchtune's single-GPU recipes): the states of every tensor of at least 1e5
    elements live in CUDA managed memory (bitsandbytes 0.50.2 optim/optimizer.py
    get_state_buffer -> functional.get_paged -> cget_managed_ptr), outside PyTorch's caching
    allocator, and the driver pages them to host RAM when the GPU runs short. They neither
    count in torch.cuda's memory statistics nor make the step run out of memory."""
    fsdp_cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy (torchtune's ``fsdp_cpu_offload``, torchtitan's
    ``training.enable_cpu_offload``, accelerate's ``fsdp_offload_params``): sharded parameters, their gradients and the optimizer
    states live in host memory and the optimizer steps on the CPU; the GPU holds the gathered
    units and each unit's gradient until it is reduced and copied out. FSDP strategies only."""
    compile: bool = False
    """torch.compile each decoder block as the framework's recipe does (torchtitan
    ``compile.enable``, torchtune ``compile: True``, transformers ``torch_compile``): inductor's
    partitioner decides what each block keeps for backward (zeroplan.core.compiled)."""
    float8: Float8Recipe | None = None
    """Train the linears in float8 with torchao's Float8Linear under this recipe (torchtitan's
    ``model.converters: ["float8"]``; compiled only), or with TransformerEngine's te.Linear
    (``te-delayed``: llm-foundry's amp_fp8, framework zeroplan, eager). None: no float8."""
    float8_all_gather: bool = False
    """torchao's ``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``
    (torchao float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor): FSDP2 gathers each
    Float8Linear weight already cast, one byte an element (tensorwise recipe only)."""
    float8_skips_output: bool = False
    """The output projection stays bf16 (torchtitan's ``float8.filter_fqns = ["output"]``, as its
    Llama 3 configs set before 0.3.0); False: converted too (0.3.0's default, filter_fqns empty)."""
    # Left out of the JSON when unset, so a request that does not name its load dumps (and every
    # answer's digest reads) as before the field existed.
    model_load: ModelLoad | None = Field(default=None, exclude_if=lambda load: load is None)
    """hf only: how from_pretrained builds the model (zeroplan.core.model_load); None takes the
    profile's, sharded: what a Trainer user who builds TrainingArguments first gets under ZeRO-3."""
    # Left out of the JSON when sft, so a causal-LM request dumps as before the field existed.
    objective: Objective = Field(default=Objective.sft, exclude_if=lambda objective: objective is Objective.sft)
    """sft (a causal-LM step), dpo (zeroplan.core.dpo: torchtune's LoRA DPO recipes) or reward
    (zeroplan.core.reward_model: DeepSpeed-Chat's reward model)."""
    finetune: FineTuneSpec = FineTuneSpec()
    """Which parameters train (LoRA adapters over a frozen, optionally quantized base; frozen
    embeddings or blocks): every one by default (zeroplan.specs.finetune)."""

    def first_switched_on(self, fields: tuple[str, ...]) -> str | None:
        """The first of these boolean fields that is set, in the order given; None when none is
        (an objective refusing the loss options it does not plan names that one)."""
        return next((field for field in fields if getattr(self, field)), None)


class BatchSpec(Frozen):
    """The shape of one optimizer step on one GPU."""

    micro_batch_size: int = Field(default=1, gt=0)
    """b: sequences per forward/backward pass per GPU."""
    seq_len: int = Field(default=4096, gt=0)
    """s: tokens per sequence."""
    grad_accum_steps: int = Field(default=1, gt=0)
    """Micro-batches accumulated before each optimizer step."""
    target_len: int | None = Field(default=None, gt=0)
    """An encoder-decoder's decoder (target) tokens per sequence, seq_len being its encoder's
    (source) tokens; None: as many as seq_len. Refused for a model with one stack
    (zeroplan.core.encoder_decoder.check_encoder_decoder_request)."""
    allow_longer_seq: bool = False
    """Accept a seq_len above the model's max_positions (RoPE models only; a learned position
    table has no row past max_positions). See specs.request.check_seq_len."""
    varying_lengths: VaryingLengths | None = None
    """Each micro-batch is padded to its own longest sample, drawn from a dataset with these
    length statistics, up to seq_len (zeroplan.allocator.varying_lengths adds what the caching
    allocator keeps cached from the epoch's record-long batches); None: every micro-batch is
    seq_len tokens."""
    padded_batches: bool | None = Field(default=None, exclude_if=lambda padded: padded is None)
    """Whether a micro-batch carries padding tokens (a padding mask with zeros in it); None: as
    the lengths imply (pads_batches). Left out of the JSON when unset, so requests dump as before."""

    @property
    def pads_batches(self) -> bool:
        """Whether a micro-batch carries padding (batch_pads)."""
        return batch_pads(self)

    # A request without varying lengths dumps as it did before the field existed (the answers'
    # JSON, and every digest of it, stay as they were).
    @model_serializer(mode="wrap")
    def _without_unset_lengths(self, handler):
        dumped = handler(self)
        if self.varying_lengths is None and isinstance(dumped, dict):
            dumped.pop("varying_lengths", None)
        return dumped


def measured_on(training: TrainingSpec, device_type: str) -> TrainingSpec:
    """The training spec a measurement records: its kernels are those of the device it ran on
    (a torch device type, 'cpu' or 'cuda')."""
    return training.model_copy(update={"kernels": Kernels(device_type)})


def recorded_before_kernels(training: object) -> object:
    """A record's ``training`` as read from JSON: every record written before the ``kernels``
    field existed ran on the CPU (the harness on gloo, the fake-tensor simulation, the framework
    records), so an absent field reads as cpu, never as the cuda default."""
    if isinstance(training, dict) and "kernels" not in training:
        return {**training, "kernels": Kernels.cpu.value}
    return training


def batch_pads(batch) -> bool:
    """Whether a micro-batch carries padding: as padded_batches says, else only where samples of
    varying length share a micro-batch (one sample, or every sample at seq_len or packed to it,
    leaves no padding). Reads the three fields alone, so a planner cache's view of the batch that
    keeps them answers it (BatchSpec.pads_batches, a property, is not on the view)."""
    if batch.padded_batches is not None:
        return batch.padded_batches
    return batch.varying_lengths is not None and batch.micro_batch_size > 1
