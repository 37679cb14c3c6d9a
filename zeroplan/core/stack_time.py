"""Stack profiles for time: what each training stack runs that decides how fast its step is
(docs/communication-time.md, "Stack profiles"), read from the stack's own source at a pinned
commit, and the kernel class a step's compute efficiency is keyed by.

The efficiency a run reaches is a property of its stack, not only of its GPU: the attention
kernel and its generation, the fused ops, torch.compile and float8, and how the stack overlaps
its collectives with compute. Each profile states these with the file they were read from.
What the planner keys its compute efficiency by is the profile's kernel class (attention kernel
x compiled or not) and the GPU generation: one efficiency per mechanism, never per row
(zeroplan.validate.step_calibration fits and scores it leave-one-source-out).

Nothing here imports torch; the core reads these as data.
"""

from __future__ import annotations

from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.strategy import StrategyKind


@frozen
class StackTimeProfile:
    """What one training stack runs, as far as its step time goes, read from its source."""

    stack: str
    """The stack's name (its repository's)."""
    read_at: str
    """Repository and commit the profile was read from."""
    attention_kernel: str
    """The attention kernel its default model code reaches on an A100/H100, as a kernel class
    (zeroplan.core.attention_rate's names: 'flash-attn-2' for FlashAttention-2's kernels, whether
    called directly or through PyTorch's SDPA flash backend; 'flash-attn-triton'; 'cudnn' for
    cuDNN's fused attention, FlashAttention-3-like on Hopper)."""
    attention_source: str
    """Where the kernel choice is made (file: function or config default)."""
    fused_ops: tuple[str, ...]
    """Fused kernels its defaults use (norm, rope, cross-entropy, optimizer, bias/activation)."""
    fused_source: str
    compile_default: bool
    """Whether its default configuration compiles the model (torch.compile or an equivalent)."""
    float8: str
    """How float8 training is offered ('' where it is not)."""
    compile_source: str
    overlap: str
    """How its data-parallel collectives overlap compute by default, and what is opt-in."""
    overlap_source: str
    overlap_grad_reduce: bool = True
    """Its data-parallel gradient reductions overlap the backward by default
    (PerformanceAssumptions.overlap_grad_reduce)."""
    overlap_param_gather: bool = False
    """Its post-step parameter all-gather overlaps the next forward by default."""
    tp_comm_overlap: bool = False
    """Its tensor-parallel collectives overlap the GEMMs by default."""
    no_grad_overlap_strategies: tuple[StrategyKind, ...] = ()
    """Strategies under which it does not overlap the gradient reductions though it does under
    the others (the hf stack's DeepSpeed ZeRO-1/2: overlap_comm is on for stage 3 only)."""


_TT = "pytorch/torchtitan@b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
_TT_ROWS = "pytorch/torchtitan@041336434916bdc0f88c1f89fda176fd3c2092e4"
_LF = "mosaicml/llm-foundry@c90b9b312c644dbde5c9e6eef75c6f1c117d8782"
_COMPOSER = "mosaicml/composer@6405188805a0054b4551ec49e4919c54c971d0e8"
_MEGATRON = "NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553"
_FMS = "foundation-model-stack/fms-fsdp@5a296afe42f9932f590783cb053fa0f9384e01fc"
_MDS = "bigscience-workshop/Megatron-DeepSpeed@8387ae17c4704f6579f88a84500b535d19d7fbbf"
_DSE = "microsoft/DeepSpeedExamples@ece5e0e077f5b4fd60d6f31c68129a11741aa81b"
_LLMC = "karpathy/llm.c@42dff8793988b1f72793b0dfdbc02d8d0f15acc2"
_LLMC_H100 = "karpathy/llm.c@c6efd90a861e038b0bfb5c9cd4c19199a6f5f9eb"
_TINYLLAMA = "jzhang38/TinyLlama@bf122247c486b6b897050e98cbb7bedae8eeba73"

PROFILES: dict[str, StackTimeProfile] = {
    "torchtitan": StackTimeProfile(
        stack="torchtitan", read_at=f"{_TT} (and {_TT_ROWS}, the commit of its published Llama 2/3 tables)",
        attention_kernel="flash-attn-2",
        attention_source=(f"{_TT} torchtitan/models/common/attention.py ScaledDotProductAttention: sdpa_kernel with "
                          "[CUDNN_ATTENTION, FLASH_ATTENTION, MATH] by priority (cuDNN first on current releases); at "
                          f"{_TT_ROWS} torchtitan/models/llama/model.py: F.scaled_dot_product_attention(is_causal=True), "
                          "PyTorch's flash backend (FlashAttention-2's kernels)"),
        fused_ops=("AdamW fused (optimizer implementation default 'fused'; 'foreach' at the tables' commit)",
                   "RMSNorm: nn.RMSNorm (fused only under compile)", "cross-entropy: F.cross_entropy, unfused"),
        fused_source=(f"{_TT} torchtitan/components/optimizer/optimizer.py (implementation = 'fused'), "
                      "torchtitan/models/common/nn_modules.py RMSNorm(nn.RMSNorm), torchtitan/components/loss.py "
                      f"cross_entropy_loss; {_TT_ROWS} train.py AdamW(foreach=True)"),
        compile_default=False, float8="torchao Float8Linear via model.converters (compiled only; timed, zeroplan.core.float8_time)",
        compile_source=f"{_TT} torchtitan/config/configs.py Compile.enable = False; torchtitan/components/quantization/float8.py",
        overlap=("FSDP2 fully_shard: implicit prefetch of the next unit's all-gather in forward and backward; "
                 "reshard_after_forward 'default' (True except the last unit / under PP); explicit prefetch only with "
                 "expert parallelism; async TP opt-in (compiled)"),
        overlap_source=f"{_TT} torchtitan/distributed/fsdp.py get_fsdp_reshard_after_forward_policy, lines on explicit prefetching",
    ),
    "llm-foundry": StackTimeProfile(
        stack="llm-foundry", read_at=f"{_LF} (Composer {_COMPOSER})",
        attention_kernel="flash-attn-2",
        attention_source=(f"{_LF} llmfoundry/models/utils/config_defaults.py attn_config 'attn_impl': 'flash' "
                          "(flash-attn 2); scripts/train/benchmarking/submit_benchmarks.py --attn_impl (its tables' "
                          "rows ran 'triton', the row's attention_implementation)"),
        fused_ops=("cross-entropy: flash-attn's fused CrossEntropyLoss (ComposerMPTCausalLM loss_fn 'fused_crossentropy')",
                   "LayerNorm: Composer's low_precision_layernorm (bf16 autocast, not a fused kernel)",
                   "optimizer: Composer DecoupledLionW/AdamW (torch ops)"),
        fused_source=(f"{_LF} llmfoundry/models/mpt/modeling_mpt.py ComposerMPTCausalLM(loss_fn='fused_crossentropy'); "
                      "scripts/train/benchmarking/submit_benchmarks.py norm_type = 'low_precision_layernorm'"),
        compile_default=False, float8=("TransformerEngine amp_fp8 on H100 (precision amp_fp8; its 'H100 80GB FP8' table): "
                                        "te.Linear under DelayedScaling HYBRID, timed as Float8Recipe.te_delayed"),
        compile_source=(f"{_LF} scripts/train/benchmarking/submit_benchmarks.py (no compile option; fp8 needs te on "
                        "h100_80gb: b2a43a14 sets fc_type 'te' and installs TransformerEngine v0.10); Composer "
                        "composer/core/precision.py get_precision_context (AMP_FP8's DelayedScaling)"),
        overlap=("Composer FSDP1: backward_prefetch BACKWARD_POST, forward_prefetch False, limit_all_gathers True "
                 "(benchmarks leave them at these defaults)"),
        overlap_source=(f"{_COMPOSER} composer/utils/parallelism.py FSDPConfig; {_LF} "
                        "scripts/train/benchmarking/submit_benchmarks.py --fsdp_config_* default None"),
    ),
    "megatron-lm": StackTimeProfile(
        stack="megatron-lm", read_at=_MEGATRON,
        attention_kernel="cudnn",
        attention_source=(f"{_MEGATRON} megatron/core/transformer/transformer_config.py attention_backend = "
                          "AttnBackend.auto and transformer_impl = 'transformer_engine': TransformerEngine's "
                          "DotProductAttention picks cuDNN fused attention or flash-attn per shape"),
        fused_ops=("RoPE, bias-SwiGLU, masked softmax fused (training defaults: --no-rope-fusion, "
                   "--no-bias-swiglu-fusion, --no-masked-softmax-fusion turn them off)",
                   "gradient-accumulation fusion into the weight-gradient GEMM (--no-gradient-accumulation-fusion)",
                   "Adam: TransformerEngine's FusedAdam, else apex's", "TE LayerNorm/RMSNorm fused with the linear",
                   "cross-entropy fusion opt-in (--cross-entropy-loss-fusion)"),
        fused_source=(f"{_MEGATRON} megatron/training/arguments.py (--no-*-fusion flags), "
                      "megatron/core/optimizer/__init__.py (FusedAdam import), megatron/core/model_parallel_config.py "
                      "cross_entropy_loss_fusion = False"),
        compile_default=False, float8="TransformerEngine fp8 (--fp8-format e4m3|hybrid; off by default)",
        compile_source=f"{_MEGATRON} megatron/core/transformer/transformer_config.py fp8 = None",
        overlap=("data-parallel gradient reduce and distributed-optimizer parameter gather overlap only when asked "
                 "(overlap_grad_reduce, overlap_param_gather default False); TP communication overlap opt-in "
                 "(tp_comm_overlap False)"),
        overlap_source=(f"{_MEGATRON} megatron/core/distributed/distributed_data_parallel_config.py, "
                        "megatron/core/model_parallel_config.py tp_comm_overlap"),
        overlap_grad_reduce=False,
    ),
    "megatron-deepspeed": StackTimeProfile(
        stack="megatron-deepspeed", read_at=f"{_MDS} (with deepspeed 0.19.8's pipeline engine)",
        attention_kernel="eager",
        attention_source=(f"{_MDS} megatron/model/transformer.py ParallelAttention: QK^T, FusedScaleMaskSoftmax "
                          "(megatron/model/fused_softmax.py, a fused masked-softmax CUDA kernel), dropout, then AV: "
                          "every score materialised, no flash kernel"),
        fused_ops=("masked softmax, bias-GeLU and bias-dropout-add fused (on unless --no-masked-softmax-fusion, "
                   "--no-bias-gelu-fusion, --no-bias-dropout-fusion)", "apex FusedAdam", "apex FusedLayerNorm"),
        fused_source=(f"{_MDS} megatron/arguments.py (--no-*-fusion flags), megatron/optimizer/__init__.py "
                      "(from apex.optimizers import FusedAdam), megatron/model/fused_layer_norm.py"),
        compile_default=False, float8="",
        compile_source=f"{_MDS} megatron/arguments.py (no compile or fp8 option)",
        overlap=("DeepSpeed's pipeline engine reduces the gradients after the last micro-batch (ReduceTiedGrads, "
                 "ReduceGrads, then OptimizerStep): nothing overlaps the backward; ZeRO-1's (BF16_Optimizer's) "
                 "parameter gather after the step"),
        overlap_source="deepspeed 0.19.8 runtime/pipe/schedule.py TrainSchedule, runtime/pipe/engine.py _exec_reduce_grads",
        overlap_grad_reduce=False,
    ),
    "deepspeed": StackTimeProfile(
        stack="deepspeed", read_at=f"{_DSE} (DeepSpeed's ZeRO-Offload tutorial's Megatron-LM v1.1.5 GPT-2, deepspeed 0.3.0)",
        attention_kernel="eager",
        attention_source=(f"{_DSE} Megatron-LM/mpu/transformer.py GPT2ParallelSelfAttention.forward: QK^T, scale, "
                          "mask by multiply-subtract, torch.nn.Softmax, dropout, then AV: every score materialised, "
                          "unfused"),
        fused_ops=("apex FusedLayerNorm", "DeepSpeedCPUAdam on the host under --cpu-optimizer (apex FusedAdam otherwise)",
                   "GeLU: OpenAI's tanh form in eager ops"),
        fused_source=(f"{_DSE} Megatron-LM/mpu/transformer.py (from apex.normalization.fused_layer_norm import "
                      "FusedLayerNorm, gelu_impl), Megatron-LM/pretrain_gpt2.py get_optimizer"),
        compile_default=False, float8="",
        compile_source=f"{_DSE} Megatron-LM/arguments.py (no compile or fp8 option)",
        overlap=("DeepSpeed ZeRO-2: reduce buckets and the offload's gradient copies on the compute stream unless "
                 "overlap_comm, which the tutorial's config file does not set"),
        overlap_source=(f"{_DSE} Megatron-LM/scripts/ds_zero-offload_10B_config.json; deepspeed 0.3.0 "
                        "runtime/zero/stage2.py reduce_ipg_grads"),
        overlap_grad_reduce=False,
    ),
    "hf": StackTimeProfile(
        stack="hf", read_at="transformers 4.56.2, accelerate 1.10.1, deepspeed 0.19.8 (the planner's hf profile)",
        attention_kernel="flash-attn-2",
        attention_source=("transformers 4.56.2 modeling_utils.py _check_and_adjust_attn_implementation: 'sdpa' by default "
                          "(PyTorch's flash backend on A100/H100), flash_attention_2/3 opt-in"),
        fused_ops=("AdamW: 'adamw_torch_fused' with torch >= 2.8, else 'adamw_torch' (TrainingArguments.optim)",
                   "DeepSpeed: FusedAdam unless torch_adam", "norm, rope, cross-entropy: the model's eager ops"),
        fused_source="transformers 4.56.2 training_args.py default_optim; deepspeed 0.19.8 runtime/engine.py",
        compile_default=False, float8="accelerate's fp8 (TransformerEngine/torchao/MS-AMP) opt-in",
        compile_source="transformers 4.56.2 training_args.py torch_compile = False",
        overlap=("DeepSpeed ZeRO: overlap_comm defaults to True for stage 3 only (False for 1 and 2); accelerate "
                 "FSDP1: backward_prefetch BACKWARD_PRE unless set, forward_prefetch False"),
        overlap_source=("deepspeed 0.19.8 runtime/zero/config.py overlap_comm_valid; accelerate 1.10.1 "
                        "utils/dataclasses.py FullyShardedDataParallelPlugin"),
        no_grad_overlap_strategies=(StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero2_offload),
    ),
    "fms-fsdp": StackTimeProfile(
        stack="fms-fsdp", read_at=_FMS,
        attention_kernel="flash-attn-2",
        attention_source=f"{_FMS} README ('SDPA Flash v2 implementation'): ibm-fms LLaMA through F.scaled_dot_product_attention",
        fused_ops=("AdamW: torch.optim.AdamW at its defaults (foreach)", "everything else fused only by torch.compile"),
        fused_source=f"{_FMS} main_training_llama.py optim.AdamW(...)",
        compile_default=True, float8="",
        compile_source=f"{_FMS} fms_fsdp/config/training.py use_torch_compile = True",
        overlap=("FSDP1: limit_all_gathers True, backward_prefetch left at BACKWARD_PRE, no forward_prefetch; "
                 "HSDP (HYBRID_SHARD) by default"),
        overlap_source=f"{_FMS} main_training_llama.py FSDP(...), fms_fsdp/config/training.py sharding_strategy = 'hsdp'",
    ),
    "torchtune": StackTimeProfile(
        stack="torchtune", read_at="torchtune 0.6.1 (the planner's torchtune profile)",
        attention_kernel="flash-attn-2",
        attention_source=("torchtune 0.6.1 modules/attention_utils.py _sdpa_or_flex_attention: SDPA (flash backend), "
                          "flex_attention for packed samples with a block mask"),
        fused_ops=("AdamW fused=True in most recipes (the 70B full recipe sets fused: False with CPU offload)",
                   "loss: CEWithChunkedOutputLoss (chunked, not fused)"),
        fused_source="torchtune 0.6.1 recipes/configs/llama3_1/*_full.yaml optimizer, loss",
        compile_default=False, float8="",
        compile_source="torchtune 0.6.1 recipes/configs/llama3_1/70B_full.yaml compile: False",
        overlap="FSDP2 fully_shard per block, implicit prefetch; no explicit prefetch",
        overlap_source="torchtune 0.6.1 training/_distributed.py shard_model",
    ),
    "llm.c": StackTimeProfile(
        stack="llm.c", read_at=f"{_LLMC} (the A100 GPT-2 scripts) and {_LLMC_H100} (the H100 1558M script)",
        attention_kernel="cudnn",
        attention_source=(f"{_LLMC} README.md ('As of May 1, 2024 we use the Flash Attention from cuDNN', built with "
                          "USE_CUDNN=1 as scripts/run_gpt2_*.sh do); train_gpt2.cu attention_forward_cudnn / "
                          "attention_backward_cudnn (llmc/cudnn_att.cpp, cudnn-frontend SDPA)"),
        fused_ops=("residual add and LayerNorm in one kernel (fused_residual_forward5), LayerNorm backward accumulating "
                   "the residual gradient", "bias in the cuBLASLt GEMM epilogue; GeLU separate (gelu_fusion 0 by default)",
                   "classifier: softmax, loss and its gradient in one kernel over the bf16 logits (fused_classifier)",
                   "one fused QKV projection", "AdamW: one CUDA kernel (adamw_update) with fp32 master weights"),
        fused_source=(f"{_LLMC} train_gpt2.cu (gpt2_forward, gpt2_backward, gpt2_update), llmc/fused_classifier.cuh, "
                      "llmc/layernorm.cuh; README.md"),
        compile_default=False, float8="",
        compile_source=f"{_LLMC} README.md (C/CUDA, no PyTorch: nothing to compile)",
        overlap=("ZeRO-1 (-z 1): at the A100 scripts' commit the gradients are reduce-scattered once after the last "
                 "micro-batch's backward; from the H100 script's commit each block's are handed to NCCL on its own "
                 "stream as the backward finishes them; the updated parameters are all-gathered after the step"),
        overlap_source=(f"{_LLMC} train_gpt2.cu gpt2_multi_gpu_loss_and_grad_reduce; {_LLMC_H100} llmc/zero.cuh "
                        "multi_gpu_async_reduce_gradient; README.md ('multi-GPU training')"),
        overlap_grad_reduce=False,
    ),
    "tinyllama": StackTimeProfile(
        stack="tinyllama", read_at=f"{_TINYLLAMA} (its fork of lit-gpt on Lightning 2.1.2)",
        attention_kernel="flash-attn-2",
        attention_source=f"{_TINYLLAMA} lit_gpt/model.py CausalSelfAttention.scaled_dot_product_attention: flash_attn_func",
        fused_ops=("RMSNorm: flash-attn's fused dropout_layer_norm (FusedRMSNorm)", "rotary: flash-attn's fused rotary",
                   "SwiGLU: xformers' fused SwiGLU", "cross-entropy: flash-attn's FusedCrossEntropyLoss",
                   "AdamW: torch.optim.AdamW(foreach=False)"),
        fused_source=(f"{_TINYLLAMA} lit_gpt/model.py, lit_gpt/config.py tiny_LLaMA_1b, pretrain/tinyllama.py; "
                      "README.md ('fused layernorm, fused cross entropy loss, and fused rotary positional embedding')"),
        compile_default=False, float8="",
        compile_source=f"{_TINYLLAMA} pretrain/tinyllama.py (no torch.compile)",
        overlap=("Lightning Fabric FSDPStrategy (FSDP1 FULL_SHARD, limit_all_gathers True, backward_prefetch left at "
                 "BACKWARD_PRE); no_backward_sync on the accumulating micro-batches; bf16-mixed gathers fp32 "
                 "parameters (param_dtype float32)"),
        overlap_source=(f"{_TINYLLAMA} pretrain/tinyllama.py setup/train; Lightning 2.1.2 "
                        "src/lightning/fabric/plugins/precision/fsdp.py mixed_precision_config"),
    ),
}
"""The stacks' time profiles, by stack name."""

FRAMEWORK_STACKS: dict[Framework, str] = {
    Framework.torchtitan: "torchtitan", Framework.hf: "hf", Framework.torchtune: "torchtune",
}
"""The stack whose profile a request's --framework picks; the reference transformer has none."""


def stack_profile(framework: Framework) -> StackTimeProfile | None:
    """The time profile of a request's framework (None for zeroplan's reference transformer)."""
    stack = FRAMEWORK_STACKS.get(framework)
    return None if stack is None else PROFILES[stack]


def overlaps_grad_reduce(framework: Framework, strategy: StrategyKind) -> bool:
    """Whether the framework's stack reduces gradients during the backward under ``strategy``
    by default (PerformanceAssumptions.overlap_grad_reduce left unset); True for the reference
    transformer. DeepSpeed's ZeRO-1/2 under the reference transformer and hf are decided before
    this, by their overlap_comm (zeroplan.core.communication.overlaps_grad_reduce)."""
    if framework is Framework.megatron:
        # megatron-core 0.16.1 reduces after the backward unless told otherwise:
        # DistributedDataParallelConfig.overlap_grad_reduce = False
        # (megatron/core/distributed/distributed_data_parallel_config.py), and
        # megatron/training/arguments.py's --overlap-grad-reduce is store_true.
        return False
    profile = stack_profile(framework)
    if profile is None:
        return True
    return profile.overlap_grad_reduce and strategy not in profile.no_grad_overlap_strategies


# The mechanism a compute efficiency is keyed by: what attention kernel runs (its class) and
# whether the rest of the step is compiled (inductor fuses the elementwise ops the eager step
# runs as separate memory-bound kernels), on one GPU generation.
def kernel_class(attention_kernel: str, compiled: bool, float8: str | None = None) -> str:
    """'ATTENTION-KERNEL, compiled|not compiled[, float8 RECIPE]', e.g. 'flash-attn-2, compiled' or
    'flash-attn-triton, not compiled, float8 te-delayed': a float8 run's linears run other kernels
    (TransformerEngine's or torchao's scaled matmuls and casts) than a bf16 run's, so its class is
    its own (zeroplan.core.default_efficiency)."""
    base = f"{attention_kernel}, {'compiled' if compiled else 'not compiled'}"
    return base if float8 is None else f"{base}, float8 {float8}"
