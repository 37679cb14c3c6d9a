"""Framework profiles: what torchtitan, Hugging Face Transformers and torchtune offer and do,
as data read from each one's source (docs/frameworks.md, "Profiles"), and the one-line
refusals of what a framework does not offer. The byte formulas that read these profiles live in
zeroplan.core.frameworks; this module imports only the specs, so every part of the core can
consult a profile without an import cycle. Nothing here imports torch.
"""

from __future__ import annotations

import functools

from zeroplan.core.record import frozen
from zeroplan.core.torch_release import check_torch_release, torch_release
from zeroplan.core.transformers_release import is_opt, returns_fp32_logits
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import check_release_range
from zeroplan.specs.framework import ACCELERATE_NEWEST, ACCELERATE_OLDEST, ACCELERATE_VERSION, DEEPSPEED_RELEASES, HF_DEEPSPEED_RELEASES, TORCHTITAN_RELEASES, TRANSFORMERS_NEWEST, TRANSFORMERS_OLDEST, TRANSFORMERS_VERSION, Framework
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind
from zeroplan.specs.request import PlanRequest, check_activation_offloading
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.hardware import GpuSpec
from zeroplan.specs.training import (
    ActivationCheckpointing, Objective, Optimizer, OptimizerLoop, Precision, StateConvention, TrainingSpec,
    precision_without_bf16,
)



@frozen
class FrameworkProfile:
    """What one training stack does, as read from its source (docs/frameworks.md)."""

    framework: Framework
    version: str
    """The release the profile was read from."""
    checkpointing: tuple[ActivationCheckpointing, ...]
    """Activation-checkpointing policies the framework offers, by their zeroplan names."""
    checkpointing_names: str
    """The same policies as the framework's own config spells them."""
    default_precision: Precision
    """The numerics its recipes default to."""
    expands_kv_heads: bool
    """Grouped-query K and V are copied to the query head count before SDPA (so SDPA saves
    them at that width)."""
    bf16_module_norm_saves_bf16: bool
    """With the module in bf16 its RMSNorm saves the normalised tensor in bf16 (HF's
    LlamaRMSNorm casts back before the weight multiply) instead of in fp32."""
    loss_chunks: int
    """Chunks the output projection and cross-entropy are split into (1: one piece)."""
    offers_activation_offloading: bool
    """Whether saved activations can be moved to host memory between forward and backward."""
    strategies: tuple[StrategyKind, ...]
    """The data-parallel strategies the framework itself runs (its own sharding options)."""
    named_strategies: tuple[StrategyKind, ...] = ()
    """Strategies of its distributed wrapper that its own scripts never set: planned only when
    named (--strategies), never searched by default."""
    sdpa_keeps_padding_mask: bool = False
    """A batch with padding passes its mask to SDPA, which then runs on K and V copied to the
    query heads and saves them with the mask (zeroplan.core.hf_padding_mask)."""
    fsdp_reduces_in_compute_dtype: bool = False
    """Its FSDP2 wrapping reduce-scatters gradients in the compute dtype (bf16), whatever
    StrategySpec.fsdp_reduce_in_fp32 says."""
    fsdp_loss_backward_gathers_head: bool = False
    """Measured from its own FSDP2 step (benchmarks/framework-step-records): at the loss's
    backward the unit holding the output projection is gathered again (fsdp_head_gathered_bytes)."""
    accumulates_without_gradient_sync: bool = False
    """Its loop runs the micro-batches before each optimizer step without gradient sync (FSDP1's
    no_sync()): the unsharded gradients accumulate, StrategySpec.keep_unsharded_grads_on_accum
    (the command line's default for it)."""
    syncs_alone: bool = False
    """Its loop enters no_sync() only where there is more than one data-parallel rank, so on one
    rank every micro-batch reduces (and accumulates into the sharded fp32 gradient) as without
    accumulation: accumulates_without_gradient_sync applies from two ranks on."""
    runs_fsdp1: bool = False
    """Its FSDP full sharding is torch's FSDP1 (FullyShardedDataParallel) with a root unit, whose
    parameters stay gathered from the forward to the end of backward (fsdp1_root_stays_gathered)."""
    fsdp_separate_embedding_and_head: bool = False
    """Under FSDP the token embedding and the output projection are fully_shard units of their
    own (instead of part of the root unit with the final norm)."""
    fsdp_is_fully_shard: bool = False
    """Its FSDP is torch's FSDP2 (fully_shard) at every release the profile models, whose
    all-gather outputs live as _fsdp_param_group.py wait_for_unshard keeps them
    (zeroplan.allocator.fsdp_schedule); False where a release the profile covers runs FSDP1."""
    fsdp_head_unit_holds_final_norm: bool = True
    """With fsdp_separate_embedding_and_head, the head's unit holds the final norm beside the
    output projection (torchtitan 0.3.0's [norm, lm_head]); False: the projection alone, the
    norm staying in the root unit (torchtune's custom_sharded_layers ['tok_embeddings', 'output'])."""
    offers_fused_linear_cross_entropy: bool = False
    """liger-kernel's fused linear cross-entropy can replace the output projection and loss
    (TrainingSpec.fused_linear_cross_entropy)."""
    fuses_qkv: bool = False
    """Each block projects q, k and v with one fused weight (so two parameter tensors fewer
    per block for the optimizer to step)."""
    nf4_library: str = ""
    """What stores and multiplies an nf4 base (docs/finetuning.md), and which releases the
    profile models: bitsandbytes' per FineTuneSpec.bitsandbytes_version, torchao's at the
    profile's release ('': no nf4 base)."""
    lora_library: str = ""
    """What builds its LoRA adapters and which releases the profile models ('': its own modules,
    at the profile's release)."""
    fused_optimizer: bool = False
    """Its recipes build Adam/AdamW with ``fused=True``: torch's fused kernel (torch 2.13
    optim/adam.py _fused_adam -> torch._fused_adamw_) updates each tensor in place, with no
    state-sized temporary such as the foreach path's _foreach_sqrt output."""
    fsdp_reduces_norm_gradients_over_tp: bool = False
    """Under sequence parallelism the norms' partial weight gradients are summed over tp by its
    FSDP wrapping rather than by a separate all-reduce of the stack's own."""
    sequence_parallel_saves_gathered_inputs: bool = False
    """Under sequence parallelism the column-parallel linears keep their all-gathered (whole
    sequence) input for the weight gradient, instead of the sequence shard Megatron-LM keeps and
    gathers again in backward (Korthikanti et al. 2022, sec. 4.2.2)."""
    context_parallel_gathers_kv: bool = False
    """Context parallelism all-gathers K and V to the whole sequence (and reduce-scatters their
    gradients) instead of passing them round a ring; each block saves the gathered K and V."""
    offers_optimizer_in_backward: bool = False
    """Whether each parameter's optimizer can step in backward, freeing its gradient
    (TrainingSpec.optimizer_in_backward)."""
    offers_fsdp_cpu_offload: bool = False
    """Whether its FSDP2 wrapping can take CPUOffloadPolicy (TrainingSpec.fsdp_cpu_offload)."""
    precisions: tuple[Precision, ...] = tuple(Precision)
    """The numerics its configs can express."""
    rms_norm_spelled_out: bool = False
    """Its RMSNorm is written out in elementwise ops (upcast, mean of squares, rsqrt, multiply,
    cast back, weight multiply) rather than calling F.rms_norm, so it saves those ops' operands
    on any device (zeroplan.core.activations.rms_norm_operand_bytes)."""
    eager_attention_upcasts_softmax: bool = False
    """Its eager attention repeats grouped K and V to the query head count and runs the softmax
    in fp32 before casting the probabilities back, so it keeps the fp32 probabilities and the
    repeated K and V besides what zeroplan.core.activations.attention_core_terms counts
    (zeroplan.core.frameworks.eager_attention_extra_bytes)."""
    checkpoint_early_stop: bool = False
    """Its block checkpoint is torch's non-reentrant one with early stop on, the default
    (torch/utils/checkpoint.py, set_checkpoint_early_stop): recomputation ends once every tensor
    the backward saved is back, so a block's last matmul is not run again
    (zeroplan.core.flops.early_stop_skipped_flops_per_token)."""


_NONE_FULL = (ActivationCheckpointing.none, ActivationCheckpointing.full)

PROFILES: dict[Framework, FrameworkProfile] = {
    # zeroplan/harness/model.py: the reference model; its policies are Korthikanti et al.'s.
    Framework.zeroplan: FrameworkProfile(
        framework=Framework.zeroplan, version="this package",
        checkpointing=(ActivationCheckpointing.none, ActivationCheckpointing.selective, ActivationCheckpointing.full),
        checkpointing_names="none, selective, full",
        default_precision=Precision.bf16_mixed, expands_kv_heads=False, bf16_module_norm_saves_bf16=False,
        loss_chunks=1, offers_activation_offloading=False, strategies=tuple(StrategyKind),
        # zeroplan/harness/model.py Block.forward: checkpoint(self._body, x, use_reentrant=False).
        checkpoint_early_stop=True,
        nf4_library="bitsandbytes 0.39.0 and later (Linear4bit, MatMul4Bit; FineTuneSpec.bitsandbytes_version, "
                    "default 0.50.2; before 0.43.2 refused under full recomputation)",
    ),
    # torchtitan 0.3.0, torchtitan/distributed/activation_checkpoint.py: ActivationCheckpointingConfig
    # is selective (SelectiveAC, per-op) | full (FullAC) | memory-budget (compiled only) | none;
    # 0.3.0 has no layer-level selective option. models/common/attention.py passes enable_gqa to
    # SDPA (no K/V copy); models/common/nn_modules.py RMSNorm is nn.RMSNorm (F.rms_norm).
    Framework.torchtitan: FrameworkProfile(
        framework=Framework.torchtitan, version="0.3.0",
        checkpointing=(*_NONE_FULL, ActivationCheckpointing.selective_op),
        checkpointing_names="none, full, selective-op (torchtitan's `selective`)",
        default_precision=Precision.bf16_mixed, expands_kv_heads=False, bf16_module_norm_saves_bf16=False,
        # Its Llama-3 configs chunk the loss with the output projection inside the loss
        # (torchtitan_chunked_loss_bytes), unlike torchtune's: loss_chunks counts only the
        # latter; TrainingSpec.unchunked_loss selects its one-piece CrossEntropyLoss.
        loss_chunks=1, offers_activation_offloading=False,
        # torchtitan 0.3.0 config/configs.py ParallelismConfig: data_parallel_shard_degree (FSDP2),
        # with data_parallel_replicate_degree > 1 HSDP, or replicate alone DDP;
        # fsdp_reshard_after_forward="never" keeps units gathered (shard-grad-op).
        strategies=(StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.hsdp, StrategyKind.ddp),
        # torchtitan 0.3.0 distributed/fsdp.py apply_fsdp_to_decoder (untied weights): fully_shard
        # tok_embeddings, then [norm, lm_head] with reshard_after_forward only under the "always"
        # policy (not the default), each block, then the root: the embedding and the head are
        # units of their own, and the head's stays gathered from its forward through the loss's
        # backward (the bytes fsdp_head_gathered_bytes counts; benchmarks/framework-step-records).
        fsdp_separate_embedding_and_head=True, fsdp_loss_backward_gathers_head=True, fsdp_is_fully_shard=True,
        # torchtitan 0.3.0 models/llama3/__init__.py: every flavour builds fuse_qkv=True
        # (models/common/attention.py FusedQKVLinear: one wqkv weight).
        fuses_qkv=True,
        # torchtitan 0.3.0 components/optimizer/optimizer.py OptimizersContainer.Config:
        # implementation = "fused" by default (_build_impl_kwargs: fused=True).
        fused_optimizer=True,
        # Measured (benchmarks/parallel-records, torchtitan 0.3.0 model.parallelize with
        # enable_sp): wqkv and w1 each save the all-gathered [s, h] bf16 input while the norms
        # save their s/t shard; DTensor's linear keeps the redistributed input autograd sees.
        sequence_parallel_saves_gathered_inputs=True,
        # torchtitan 0.3.0 models/common/decoder_sharding.py norm_config: the norms' gradient
        # all-reduce is "handled by FSDP" (measured: it appears only with FSDP2 on top).
        fsdp_reduces_norm_gradients_over_tp=True,
        # Measured the same way: under apply_cp_to_forward with FlexAttention each block
        # all-gathers K and V over the cp ranks (2 all-gathers forward, 2 reduce-scatters
        # backward) and saves them at the whole sequence; there is no ring.
        context_parallel_gathers_kv=True,
        # torchtitan 0.3.0 config/configs.py training.enable_cpu_offload -> distributed/fsdp.py
        # apply_fsdp(cpu_offload=True): fsdp_config["offload_policy"] = CPUOffloadPolicy(), the
        # same policy as torchtune's, on every fully_shard call (FSDP and HSDP; not its DDP).
        offers_fsdp_cpu_offload=True,
        # torchtitan 0.3.0 distributed/activation_checkpoint.py FullAC._wrap_block and the
        # selective policy pass ptd_checkpoint_wrapper(..., early_stop=False): full recomputation.
        checkpoint_early_stop=False,
        # torchtitan 0.3.0 config/configs.py TrainingConfig: dtype "bfloat16" | "float32" and
        # mixed_precision_param "bfloat16" | "float32"; no fp16 and no loss scaler.
        precisions=(Precision.fp32, Precision.bf16_mixed, Precision.bf16_pure),
    ),
    # transformers 4.56.2: modeling_utils.gradient_checkpointing_enable wraps each decoder layer
    # (full recomputation per layer); models/llama/modeling_llama.py LlamaRMSNorm returns
    # weight * hidden_states.to(input_dtype); integrations/sdpa_attention.py use_gqa_in_sdpa is
    # true on CUDA with torch >= 2.5 and no attention mask, so K/V are not repeated.
    Framework.hf: FrameworkProfile(
        framework=Framework.hf, version="transformers 4.56.2",
        # bitsandbytes 0.50.2 measured (benchmarks/framework-finetune-records), and MatMul4Bit
        # as 0.39.1 to 0.43.1 kept its input (the -bnb0.43.1 records).
        nf4_library="bitsandbytes 0.39.0 and later (Linear4bit, MatMul4Bit; FineTuneSpec.bitsandbytes_version, "
                    "default 0.50.2)",
        # peft 0.6.2, 0.11.1 and 0.17.1 measured (benchmarks/peft-adapter-dtype-records).
        lora_library="peft 0.4 to 0.20 (LoRA Linear; FineTuneSpec.peft_version, default 0.20.0: the adapters' dtype "
                     "by release, zeroplan.core.finetune.adapter_dtype)",
        checkpointing=_NONE_FULL, checkpointing_names="none, full (gradient_checkpointing)",
        default_precision=Precision.bf16_mixed, expands_kv_heads=False, bf16_module_norm_saves_bf16=True,
        loss_chunks=1, offers_activation_offloading=False, sdpa_keeps_padding_mask=True,
        # transformers 4.56.2 trainer.py / accelerate: DDP, FSDP (FULL_SHARD, SHARD_GRAD_OP,
        # HYBRID_SHARD) and the DeepSpeed integration (ZeRO 1-3 and its offloads).
        strategies=tuple(StrategyKind),
        # accelerate 1.10.1 utils/dataclasses.py set_mixed_precision("bf16") for FSDP2:
        # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16).
        fsdp_reduces_in_compute_dtype=True, fsdp_loss_backward_gathers_head=True,
        # transformers 4.56.2 training_args.py use_liger_kernel / liger_kernel_config and
        # trainer.py __init__: liger_kernel.transformers._apply_liger_kernel_to_instance
        # (liger-kernel >= 0.3.0, utils/import_utils.py is_liger_kernel_available).
        offers_fused_linear_cross_entropy=True,
        # transformers 4.56.2 training_args.py: default_optim = "adamw_torch_fused" with
        # torch >= 2.8 (torch.optim.AdamW(fused=True)); earlier transformers or torch releases
        # build it unfused (transformers_release.trainer_fuses_adamw).
        fused_optimizer=True,
        # transformers 4.56.2 modeling_utils.py gradient_checkpointing_enable: without
        # gradient_checkpointing_kwargs it checkpoints with use_reentrant=True, which reruns
        # the whole block (early stop is the non-reentrant checkpoint's).
        checkpoint_early_stop=False,
        # transformers 4.56.2 models/llama/modeling_llama.py LlamaRMSNorm.forward spells the norm out.
        rms_norm_spelled_out=True,
        # transformers 4.56.2 models/llama/modeling_llama.py eager_attention_forward (lines
        # 181-190), as 4.31.0 LlamaAttention.forward (lines 327-347) before SDPA existed there:
        # repeat_kv, softmax(..., dtype=torch.float32).to(query.dtype).
        eager_attention_upcasts_softmax=True,
        # accelerate 1.10.1 utils/dataclasses.py FullyShardedDataParallelPlugin.set_cpu_offload:
        # cpu_offload / FSDP_OFFLOAD_PARAMS true (the Trainer's fsdp "offload") becomes
        # CPUOffloadPolicy() under fsdp_version 2, which utils/fsdp_utils.py fsdp2_prepare_model
        # passes as offload_policy to every fully_shard (FSDP strategies; not its DDP, whose
        # prepare_model takes no offload, nor DeepSpeed, which has offloads of its own).
        # Under fsdp_version 1 it is CPUOffload(offload_params=True): FSDP1 likewise keeps the
        # sharded FlatParameter and its sharded gradient on the host (_runtime_utils.py
        # _post_backward_hook -> _offload_grad) and steps there; the device holds the gathered
        # units as under FSDP2, so both are planned with model_states' CPUOffloadPolicy accounting.
        offers_fsdp_cpu_offload=True,
    ),
    # torchtune 0.6.1: modules/attention.py (lines 285-291) expands K and V to num_heads with
    # unsqueeze/expand/flatten (a copy) before SDPA; modules/loss/ce_chunked_output_loss.py
    # CEWithChunkedOutputLoss(num_output_chunks=8); its configs train in dtype: bf16
    # (parameters, gradients and optimizer states in bf16). recipes/full_finetune_distributed.py
    # _setup_model checkpoints with enable_activation_checkpointing (and no ac_mode):
    # training.set_activation_checkpointing on every TransformerSelfAttentionLayer; or, with
    # enable_activation_checkpointing false and ac_mode set, training/activations.py
    # apply_selective_activation_checkpointing: ac_mode "full" wraps every block alike,
    # "selective" with an integer ac_option k every k-th. Its docstring's ac_option "op" fails
    # in int(ac_style) with a ValueError, so op-level selective is not offered.
    Framework.torchtune: FrameworkProfile(
        framework=Framework.torchtune, version="0.6.1",
        # modules/peft/lora.py LoRALinear(quantize_base=True): torchao 0.14.1's to_nf4.
        nf4_library="torchao 0.14.1 NF4Tensor (not bitsandbytes)",
        checkpointing=(*_NONE_FULL, ActivationCheckpointing.selective_layer),
        checkpointing_names=(
            "none, full (enable_activation_checkpointing, or ac_mode: full), "
            "selective-layer (ac_mode: selective, ac_option: k = --selective-layer-interval)"
        ),
        default_precision=Precision.bf16_pure, expands_kv_heads=True, bf16_module_norm_saves_bf16=False,
        loss_chunks=8, offers_activation_offloading=True,
        # torchtune 0.6.1 recipes/configs/llama3_1/*_full.yaml: custom_sharded_layers
        # ['tok_embeddings', 'output'], which training.get_shard_conditions shards on their own;
        # training/_distributed.py shard_model then fully_shard(model): the final norm is the root's.
        fsdp_separate_embedding_and_head=True, fsdp_head_unit_holds_final_norm=False, fsdp_is_fully_shard=True,
        # training.shard_model passes no mp_policy: the bf16 module's gradients are reduced in bf16.
        fsdp_reduces_in_compute_dtype=True, fsdp_loss_backward_gathers_head=True,
        # torchtune 0.6.1 recipes/full_finetune_distributed.py _setup_optimizer(optimizer_in_bwd):
        # one optimizer per parameter, stepped and zeroed by training/memory.py
        # register_optim_in_bwd_hooks' post-accumulate-grad hook (model_states.model_state_bytes).
        offers_optimizer_in_backward=True,
        # torchtune 0.6.1 recipes/configs/llama3_1/8B_full.yaml (and its other full configs):
        # optimizer torch.optim.AdamW with fused: True.
        fused_optimizer=True,
        # torchtune 0.6.1 recipes/full_finetune_distributed.py: FSDP2 with
        # fsdp_reshard_after_forward (True: full shard; False: SHARD_GRAD_OP, its docstring);
        # fsdp_cpu_offload: training/_distributed.py shard_model(cpu_offload=True) passes
        # offload_policy=CPUOffloadPolicy() to every fully_shard (model_states.model_state_bytes).
        strategies=(StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op),
        offers_fsdp_cpu_offload=True,
        # torchtune 0.6.1 training/activations.py: checkpoint_wrapper(..., use_reentrant=False),
        # early stop left at torch's default (on).
        checkpoint_early_stop=True,
    ),
    # litgpt 0.4.13.dev1 (commit 00af8b0; lightning 2.4.0.dev20240728) as its finetune scripts run
    # it (finetune/full.py, lora.py, adapter.py setup). The model is litgpt's own GPT
    # (litgpt/model.py; PlanRequest unties the head, zeroplan.specs.framework.UNTIES_EMBEDDINGS).
    # model.py CausalSelfAttention.forward (lines 255-262): with fewer query groups than heads
    # k and v are expand()ed to every head and reshape()d, a copy SDPA keeps. model.py RMSNorm
    # (00af8b0 lines 564-571, 9a1b82b the same) upcasts x, multiplies it by rsqrt(mean(x*x) + eps)
    # and multiplies the fp32 result by weight.float() before casting back: unlike transformers'
    # LlamaRMSNorm (which casts back first) its product keeps the normalised x in fp32, so no
    # hf_bf16_norm_savings_bytes (measured: benchmarks/eager-litgpt-records, Llama-2-7B and
    # Llama-3-8B; the rsqrt and the weight's fp32 copy: zeroplan.core.frameworks.litgpt_rms_norm_extra_bytes).
    Framework.litgpt: FrameworkProfile(
        framework=Framework.litgpt, version="0.4.13.dev1 (00af8b0)",
        # finetune/full.py and lora.py setup: one device runs strategy "auto" without
        # checkpointing; more run FSDPStrategy(activation_checkpointing_policy={Block}).
        checkpointing=_NONE_FULL, checkpointing_names="none (one device), full (FSDPStrategy's policy {Block})",
        # config_hub/finetune/*/*.yaml: precision bf16-true (parameters, gradients and AdamW
        # states in bf16: Fabric's HalfPrecision casts the module, torch.optim.AdamW keeps its
        # states in the parameters' dtype).
        default_precision=Precision.bf16_pure, expands_kv_heads=True, bf16_module_norm_saves_bf16=False,
        rms_norm_spelled_out=True,
        loss_chunks=1, offers_activation_offloading=False,
        # finetune/*.py setup: FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full",
        # limit_all_gathers=True, cpu_offload=False) and no sharding_strategy: lightning's
        # default FULL_SHARD (FSDP1, planned with the FSDP accounting as hf's FSDP1 is).
        strategies=(StrategyKind.fsdp_full_shard,),
        # lightning 2.4 fabric/strategies/fsdp.py FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")
        # (its _init_sharding_strategy) keeps every Block unit gathered from its forward to its
        # backward, as FSDP2's fully_shard(reshard_after_forward=False) per Block and root does
        # (lightning-thunder 3770bf0 benchmark_litgpt.py's fsdp2 zero2 around litgpt's GPT): the
        # planner's fsdp-shard-grad-op terms, which the FSDP1/FSDP2 difference does not reach
        # without accumulation (fsdp1_root_stays_gathered is FULL_SHARD's; no_sync's cat is
        # accumulation's). litgpt's scripts never set it: planned when named only.
        named_strategies=(StrategyKind.fsdp_shard_grad_op,),
        # lightning 2.4 fabric/plugins/precision/fsdp.py FSDPPrecision.mixed_precision_config for
        # "bf16-true": MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16).
        fsdp_reduces_in_compute_dtype=True,
        # finetune/full.py fit() (lines 253-254) and lora.py fit() run every micro-batch but the
        # step's last under fabric.no_backward_sync(model), which lightning 2.4's FSDPStrategy makes
        # FSDP1's no_sync() (fabric/strategies/fsdp.py _FSDPBackwardSyncControl).
        accumulates_without_gradient_sync=True,
        # auto_wrap_policy={Block} leaves wte, ln_f and lm_head in the root unit, and torch's FSDP1
        # (torch/distributed/fsdp/_runtime_utils.py _post_forward_reshard) does not free the
        # root's gathered parameters after forward: the root is gathered at the loss's backward
        # and its backward gathers nothing. The loss runs outside the module, before the root's
        # pre-backward hook (on its logits) prefetches the last block (fsdp1_root_stays_gathered).
        runs_fsdp1=True,
        # model.py Block: Linear q/k/v as one `attn` weight (n_head + 2 n_query_groups) x head_size.
        fuses_qkv=True,
        # finetune/lora.py setup: --quantize bnb.nf4 | bnb.nf4-dq is lightning's
        # BitsandbytesPrecision (_NF4Linear, _NF4DQLinear: bnb.nn.Linear4bit); pyproject.toml pins
        # bitsandbytes==0.42.0, and lora.py warns for any other release.
        nf4_library="bitsandbytes through lightning's BitsandbytesPrecision (litgpt pins 0.42.0; "
                    "FineTuneSpec.bitsandbytes_version)",
        # lightning 2.4 fabric/strategies/fsdp.py _setup_activation_checkpointing ->
        # torch's apply_activation_checkpointing(checkpoint_wrapper_fn=checkpoint_wrapper), whose
        # default is the non-reentrant checkpoint with early stop left on.
        checkpoint_early_stop=True,
        # finetune/full.py setup docstring: "bf16-true", "bf16-mixed", "32-true" (and Fabric's
        # "16-true", "16-mixed"): every numerics zeroplan names.
    ),
    # megatron-core 0.16.1 (PyPI), as Megatron-LM's pretrain_gpt.py drives it; file paths are
    # megatron/core/... in that release (docs/frameworks.md, "Megatron-LM").
    Framework.megatron: FrameworkProfile(
        framework=Framework.megatron, version="megatron-core 0.16.1",
        # transformer/transformer_config.py recompute_granularity: "selective" (recompute_modules
        # ["core_attn"] by default: Korthikanti et al. 2022 sec. 5's selective recomputation of the
        # attention core) or "full" (recompute_method "uniform", recompute_num_layers 1: every
        # block checkpointed, transformer/transformer_block.py _checkpointed_forward).
        checkpointing=(*_NONE_FULL, ActivationCheckpointing.selective),
        checkpointing_names="none, selective (--recompute-granularity selective), full (--recompute-granularity full)",
        default_precision=Precision.bf16_mixed,
        # transformer/dot_product_attention.py DotProductAttention.forward (the local spec's
        # core attention) repeat_interleaves key and value to the query heads before the
        # baddbmm and bmm that save them; Transformer Engine's fused attention (the default
        # spec, --use-flash-attn) takes grouped K and V: expanded only with eager attention
        # (zeroplan.core.megatron.megatron_expanded_kv_bytes).
        expands_kv_heads=False, bf16_module_norm_saves_bf16=False,
        loss_chunks=1, offers_activation_offloading=False,
        # distributed/distributed_data_parallel.py DistributedDataParallel: all-reduce of the
        # gradient buffer (ddp), or, with DistributedDataParallelConfig.use_distributed_optimizer,
        # its reduce-scatter and the parameter all-gather of optimizer/distrib_optimizer.py
        # DistributedOptimizer (ZeRO-1's sharding: zero1). Megatron-FSDP and torch FSDP2 under
        # Megatron are not modelled.
        strategies=(StrategyKind.ddp, StrategyKind.zero1),
        # transformer/attention.py SelfAttention: one linear_qkv weight; transformer/mlp.py: one
        # linear_fc1 holding gate and up for gated MLPs.
        fuses_qkv=True,
        # optimizer/__init__.py: Adam is Transformer Engine's or apex's FusedAdam (multi-tensor,
        # no state-sized temporary), torch's AdamW only where neither is installed.
        fused_optimizer=True,
        # Korthikanti et al. 2022 sec. 4.2.2, tensor_parallel/layers.py
        # LinearWithGradAccumulationAndAsyncCommunication: under sequence parallelism the
        # column-parallel linears save the sequence shard and all-gather it again in backward.
        sequence_parallel_saves_gathered_inputs=False,
        # tensor_parallel/random.py CheckpointFunction reruns the whole block in backward.
        checkpoint_early_stop=False,
        # training/arguments.py: --fp16, --bf16 or neither (fp32); bf16 parameters with bf16
        # optimizer states (--use-precision-aware-optimizer) are not modelled.
        precisions=(Precision.fp32, Precision.bf16_mixed, Precision.fp16_mixed),
    ),
    # microsoft/Megatron-DeepSpeed f4157be (docs/frameworks.md, "Megatron-DeepSpeed"): the fork's
    # legacy GPT model (megatron/model/transformer.py, gpt_model.py GPTModelPipe) under deepspeed
    # 0.19.8's engine; its model states are zeroplan.core.megatron_deepspeed's.
    Framework.megatron_deepspeed: FrameworkProfile(
        framework=Framework.megatron_deepspeed, version="Megatron-DeepSpeed f4157be, deepspeed 0.19.8",
        # megatron/arguments.py --checkpoint-activations (GPTModelPipe: DeepSpeed's
        # PipelineModule checkpoints every checkpoint_num_layers = 1 block, full recomputation)
        # or --recompute-granularity selective (transformer.py:629, the core attention).
        checkpointing=(*_NONE_FULL, ActivationCheckpointing.selective),
        checkpointing_names="none, selective (--recompute-granularity selective), full (--checkpoint-activations)",
        default_precision=Precision.bf16_mixed,
        # transformer.py:743-745 repeats grouped K and V before any attention kernel; the block
        # term counts the copies (zeroplan.core.megatron_deepspeed.mds_layer_delta_bytes).
        expands_kv_heads=False, bf16_module_norm_saves_bf16=False,
        loss_chunks=1, offers_activation_offloading=False,
        # ZeRO stage 1 (--zero-stage 1: BF16_Optimizer with fp32 accumulation under bf16, the
        # ZeRO stage-1 optimizer under fp16); runtime/pipe/engine.py refuses ZeRO-2 and -3 under
        # the pipeline engine. Stage 0 (BF16_Optimizer with bf16 accumulation under the pipeline
        # engine, FP16_Optimizer or DDP_BFLOAT16 without) is not planned.
        strategies=(StrategyKind.zero1,),
        # transformer.py ParallelAttention: one query_key_value weight.
        fuses_qkv=True,
        # megatron/optimizer/__init__.py:5 apex's FusedAdam (or DeepSpeed's, --ds-fused-adam).
        fused_optimizer=True,
        # megatron/core/tensor_parallel/layers.py (the fork's copy of Megatron's) keeps the
        # sequence shard under sequence parallelism and gathers it again in backward.
        sequence_parallel_saves_gathered_inputs=False,
        # deepspeed runtime/activation_checkpointing/checkpointing.py CheckpointFunction (the
        # pipeline module's) and the fork's tensor_parallel.checkpoint rerun the whole block.
        checkpoint_early_stop=False,
        # megatron/arguments.py --fp16 | --bf16; DeepSpeed's fp32 engine is not planned.
        precisions=(Precision.bf16_mixed, Precision.fp16_mixed),
    ),
    # fairseq c6006678 (2021-03-09, the commit of examples/fully_sharded_data_parallel/README.md)
    # with the fairscale of that day (05ce7971) and torch 1.8; the byte terms are
    # zeroplan.core.fairseq's (docs/frameworks.md, "fairseq").
    Framework.fairseq: FrameworkProfile(
        framework=Framework.fairseq, version="fairseq c6006678, fairscale 05ce7971, torch 1.8",
        # fairseq/models/transformer.py build_decoder_layer: --checkpoint-activations wraps every
        # decoder layer in fairseq/modules/checkpoint_activations.py checkpoint_wrapper, whose
        # CheckpointFunction saves the layer's inputs and reruns the whole layer in backward.
        checkpointing=_NONE_FULL, checkpointing_names="none, full (--checkpoint-activations)",
        checkpoint_early_stop=False,
        # --fp16 (fairscale FSDP mixed_precision: fp32 shards, fp16 compute) or fp32.
        default_precision=Precision.fp16_mixed, precisions=(Precision.fp32, Precision.fp16_mixed),
        # transformer_lm builds multi-head attention only (no grouped K/V) and LayerNorm.
        expands_kv_heads=False, bf16_module_norm_saves_bf16=False,
        loss_chunks=1, offers_activation_offloading=False,
        # fairseq/distributed/fully_sharded_data_parallel.py (--ddp-backend fully_sharded):
        # reshard_after_forward = not --no-reshard-after-forward; --ddp-backend c10d is torch's
        # DDP with FP16Optimizer's flat fp32 master (zeroplan.core.fairseq).
        strategies=(StrategyKind.ddp, StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op),
        # fairscale 05ce7971 fully_sharded_data_parallel.py _lazy_init: the root instance sets
        # reshard_after_forward = False, so the root unit (fairseq wraps each decoder layer with
        # fsdp_wrap and then the whole model: the embeddings, positions, final norm and output
        # projection) stays gathered from its forward to the end of backward, as FSDP1's root.
        runs_fsdp1=True,
        # fairseq/distributed/fully_sharded_data_parallel.py: fp32_reduce_scatter is
        # --fp32-reduce-scatter (default False): fairscale reduce-scatters the fp16 gradient and
        # casts the reduced shard to fp32 after (_post_reduction_hook).
        fsdp_reduces_in_compute_dtype=True,
        # trainer.py train_step maybe_no_sync: every micro-batch of --update-freq but the last
        # runs under the model's no_sync() (fairscale's: _require_backward_grad_sync False, the
        # full fp16 gradients accumulate unreduced)...
        accumulates_without_gradient_sync=True,
        # ...where `self.data_parallel_world_size > 1` (the first condition of maybe_no_sync): on
        # one GPU fairscale's post-backward hook casts every micro-batch's gradient to the fp32
        # shard and accumulates it there.
        syncs_alone=True,
        # fairseq/optim/adam.py: apex's multi-tensor FusedAdam on the GPU; --optimizer cpu_adam
        # (DeepSpeedCPUAdam) steps on the host under --cpu-offload.
        fused_optimizer=True,
        # fairscale 05ce7971 FSDP(cpu_offload=True): the fp32 shard, its gradient (move_grads_to_cpu)
        # and so the optimizer's states live on the host (zeroplan.core.fairseq for what the device
        # still allocates).
        offers_fsdp_cpu_offload=True,
        # torch 1.8 nn/functional.py multi_head_attention_forward (fairseq's MultiheadAttention
        # calls it in training) runs softmax in the compute dtype: no fp32 upcast.
        eager_attention_upcasts_softmax=False,
    ),
}


def profile(framework: Framework) -> FrameworkProfile:
    return PROFILES[framework]


def default_precision(framework: Framework, gpu: GpuSpec) -> Precision:
    """The precision a request that names none is planned in: the framework's recipes' own, or
    on a GPU without bf16 tensor cores (a V100) what the framework runs there instead
    (specs.training.precision_without_bf16): torch would run the bf16 default emulated, at no
    tensor-core rate (GpuSpec.has_bf16_tensor_cores)."""
    own = profile(framework).default_precision
    if gpu.has_bf16_tensor_cores or own not in (Precision.bf16_mixed, Precision.bf16_pure):
        return own
    return precision_without_bf16(framework)


# Which checkpoint a framework's block runs under full recomputation: Hugging Face's
# gradient_checkpointing_enable passes no use_reentrant unless told (transformers 4.35 and 4.36
# modeling_utils.py: functools.partial(checkpoint, **{}), torch before 2.4 then defaulting to the
# reentrant one; from 4.41 {"use_reentrant": True} explicitly), and so does the model code of
# Hub models that call torch.utils.checkpoint.checkpoint themselves (Qwen-1's modeling_qwen.py).
# TrainingSpec.checkpoint_reentrant overrides it for hf. Its two readers (DeepSpeed's recompute
# hold, deepspeed_coordinator.holds_recomputed_frozen; bitsandbytes' escaping inputs,
# finetune.activations.bnb_inputs_escape_checkpoint) are Hugging Face's mechanisms and ask under
# hf alone: the False of the other frameworks is no reading of their checkpoints (Megatron's and
# fairscale's are autograd Functions of their own).
def checkpoint_is_reentrant(training: TrainingSpec) -> bool:
    """Whether a fully checkpointed hf block runs torch's reentrant checkpoint."""
    if training.checkpoint_reentrant is not None:
        return training.checkpoint_reentrant
    return training.framework is Framework.hf


# torch/utils/checkpoint.py: the non-reentrant checkpoint stops recomputing once every saved tensor
# is back from 2.0 (set_checkpoint_early_stop, on by default); 1.x's _checkpoint_without_reentrant
# and the reentrant CheckpointFunction rerun the whole block.
NON_REENTRANT_EARLY_STOP_FROM = (2, 0, 0)


def checkpoint_stops_early(training: TrainingSpec) -> bool:
    """Whether the block checkpoint stops recomputing early: TrainingSpec.checkpoint_early_stop,
    else a non-reentrant checkpoint chosen for hf (checkpoint_reentrant False) on torch 2.0 or
    later, else the framework's."""
    if training.checkpoint_early_stop is not None:
        return training.checkpoint_early_stop
    if training.checkpoint_reentrant is False:
        return torch_release(training) >= NON_REENTRANT_EARLY_STOP_FROM
    return profile(training.framework).checkpoint_early_stop


# Like transformers' gradient_checkpointing_kwargs, the choice stands whether or not the blocks
# are checkpointed (the plan search tries both): without checkpointing it changes nothing.
def check_checkpoint_reentrant(training: TrainingSpec) -> None:
    """Refuse checkpoint_reentrant outside hf, in one line."""
    if training.checkpoint_reentrant is not None and training.framework is not Framework.hf:
        raise ZeroplanError("checkpoint_reentrant", f"{training.framework.value} {profile(training.framework).version} "
                            "has one block checkpoint of its own (allowed only with framework hf)")


# torchtune 0.6.1 recipes/configs/llama3_1/*_lora.yaml (and *_qlora*) set no
# custom_sharded_layers, which its full-finetune configs set to ['tok_embeddings', 'output']:
# under a LoRA recipe the embedding and output projection stay in the root unit with the final
# norm (recipes/lora_finetune_distributed.py _setup_model passes cfg.get("custom_sharded_layers")).
#
# torch 2.13 distributed/fsdp/_runtime_utils.py _post_forward_reshard: FSDP1 never reshards the
# root unit after its forward (the harness's torch-fsdp1 engine: StrategySpec's flag; litgpt
# through Lightning's FSDPStrategy: FrameworkProfile.runs_fsdp1).
def fsdp1_root_stays_gathered(request: PlanRequest) -> bool:
    """Whether FSDP1 full-shards the run with a root unit kept gathered from the forward to the
    end of backward."""
    if type(request.strategy) is not StrategySpec:
        # A planner cache's view of the strategy that keys on this answer alone, and holds it
        # (zeroplan.core.plan.reference_engine).
        return request.strategy.root_stays_gathered
    if request.strategy.kind not in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp):
        return False  # the flag rides on a request that fit() plans under every strategy
    return request.strategy.fsdp1_root_stays_gathered or profile(request.training.framework).runs_fsdp1


# torchtitan 9dec370 torchtitan/parallelisms/parallelize_llama.py apply_fsdp: fully_shard on each
# block, then fully_shard(model, reshard_after_forward=not pp_enabled): tok_embeddings, norm and
# output stay in the root unit. The torch it ran (1963fc8, 2024-12-23) set the root's
# post_forward_mesh_info to None in FSDPState._lazy_init ("for the root, do not reshard after
# forward"), so the root stays gathered from its forward to its own post-backward, and the last
# block (reshard_after_forward=False there) is still gathered at the loss's backward: the bytes
# fsdp_head_gathered_bytes counts for a root unit (embedding, head and one block).
def fsdp_separates_embedding_and_head(request: PlanRequest) -> bool:
    """Whether the framework's FSDP2 wrapping makes the embedding and the head units of their own."""
    training = request.training
    separate = profile(training.framework).fsdp_separate_embedding_and_head
    if training.framework is Framework.torchtitan and torchtitan_root_holds_head(training):
        return False
    return separate and not (training.framework is Framework.torchtune and training.finetune.is_lora)


def torchtitan_root_holds_head(training: TrainingSpec) -> bool:
    """Whether the torchtitan release planned wraps embedding, norm and head into the root unit
    (9dec370) rather than into units of their own (0.3.0)."""
    return training.torchtitan_release == "9dec370"


# torchtitan compiles its loss with the model from bbb1b616 (2025-04-02, PR 1033) on: 2c8b594
# components/loss.py:25-30 build_cross_entropy_loss wraps cross_entropy_loss in torch.compile
# under training.compile; 0.3.0 components/loss.py:309-316 BaseLoss._maybe_compile under
# CompileConfig.enable with "loss" in its components (config/configs.py:298, the default). Before
# it the call is commented out ("compiling loss function causes CUDA errors"): 9dec370 train.py:136-138,
# 0da8901 components/loss.py:17-18. 9dec370 stands for the commits before bbb1b616, 0.3.0 for
# those after it.
def torchtitan_compiles_loss(training: TrainingSpec) -> bool:
    """Whether the torchtitan release planned compiles its loss under compile (0.3.0, and the
    commits from April 2025 it stands for) rather than leaving it eager (9dec370)."""
    return training.torchtitan_release != "9dec370"


# torchtitan 9dec370's train.py calls pp_schedule.step() with no return_outputs (the published
# runs' torch 1963fc8 had none; torch 2.6.0, the nearest release, appends every stage's output to
# output_chunks: distributed/pipelining/stage.py:703); torchtitan 0.3.0's trainer.py:862 passes
# return_outputs=False, and torch 2.13 keeps only the last stage's even without it (stage.py:907).
def torchtitan_keeps_stage_outputs(training: TrainingSpec) -> bool:
    """Whether every pipeline stage keeps each micro-batch's output until the next step (9dec370
    on the torch of its runs) rather than only while the micro-batch is in flight (0.3.0)."""
    return training.torchtitan_release == "9dec370"


# torch 2.6.0 distributed/pipelining/_backward.py:359 reads each stage input's gradient off the
# receive buffer it accumulated into (.grad) and leaves it there until the next step's
# clear_runtime_states (stage.py:525); torch 2.13's _backward.py:450 sets it to None at once.
# The runs of torchtitan 9dec370 used the former's era (torch 1963fc8), 0.3.0 the latter.
def torchtitan_keeps_input_gradients(training: TrainingSpec) -> bool:
    """Whether each non-first pipeline stage keeps every micro-batch's input gradient until the
    next step (9dec370 on the torch of its runs) rather than only until it is sent (0.3.0)."""
    return training.torchtitan_release == "9dec370"


# torchtitan 0.3.0 models/common/attention.py FusedQKVLinear: one wqkv Linear (and its bias,
# where the projections have one) stands for the q, k and v projections, each a tensor of its
# own in zeroplan.core.params' units; FSDP2 shards, and AdamW steps, per tensor.
def fused_qkv_fewer_tensors(request: PlanRequest, num_blocks: int) -> int:
    """Parameter tensors ``num_blocks`` of the framework's blocks have fewer than the planner's
    units list."""
    model = request.model
    if not profile(request.training.framework).fuses_qkv:
        return 0
    per_projection = 2 if (model.bias or model.qkv_bias) else 1
    return 2 * per_projection * num_blocks


# fairseq trainer.py (c6006678) maybe_no_sync enters no_sync() only where
# data_parallel_world_size > 1 (FrameworkProfile.syncs_alone); the other no_sync loops enter it at
# any size.
def accumulates_without_sync(framework: Framework, data_parallel_size: int) -> bool:
    """Whether the framework's loop runs the micro-batches before each optimizer step under
    no_sync() at this data-parallel size (FrameworkProfile.accumulates_without_gradient_sync,
    from two ranks on where FrameworkProfile.syncs_alone): StrategySpec.keep_unsharded_grads_on_accum's
    default for it."""
    prof = profile(framework)
    return prof.accumulates_without_gradient_sync and (data_parallel_size > 1 or not prof.syncs_alone)


# torchtune 0.6.1 ships single-device recipes beside the distributed ones
# (recipes/full_finetune_single_device.py, lora_finetune_single_device.py: the model on one GPU,
# no FSDP wrapping); on one GPU zeroplan plans that as plain training (ddp at world size 1).
# litgpt's finetune scripts on one device use Fabric's strategy "auto" (the model on that GPU,
# no wrapping): planned likewise as ddp at world size 1.
# Kept by its two arguments (the profiles are fixed): fit asks it, and check_framework_strategies
# of its answer, for every strategy list it plans (a suggestion's change one more), each a scan of
# the profile's strategies through StrategyKind.is_opt_in, a Python property.
@functools.lru_cache(maxsize=64)
def framework_strategies(framework: Framework, world_size: int) -> tuple[StrategyKind, ...]:
    """The strategies the framework runs on ``world_size`` GPUs that are planned when none are
    named (the opt-in ones, StrategyKind.is_opt_in, are planned only when named)."""
    kinds = tuple(k for k in profile(framework).strategies if not k.is_opt_in)
    if world_size == 1 and framework in (Framework.torchtune, Framework.litgpt):
        return (StrategyKind.ddp, *kinds)
    return kinds


def check_framework_strategies(framework: Framework, strategies: tuple[StrategyKind, ...], world_size: int = 2) -> None:
    """Refuse, in one line, a strategy the framework does not run."""
    prof = profile(framework)
    runs = _strategies_run(framework, world_size)
    for kind in strategies:
        if kind not in runs:
            allowed = ", ".join(k.value for k in runs)
            raise ZeroplanError(
                "strategies", f"{kind.value!r} is not run by {framework.value} {prof.version} (allowed: {allowed})"
            )


@functools.lru_cache(maxsize=64)
def _strategies_run(framework: Framework, world_size: int) -> tuple[StrategyKind, ...]:
    """Every strategy the framework runs on ``world_size`` GPUs, named or not (kept as
    framework_strategies is)."""
    prof = profile(framework)
    return (framework_strategies(framework, world_size) + tuple(k for k in prof.strategies if k.is_opt_in)
            + prof.named_strategies)


FRAMEWORK_OPTIONS = {
    "activation_offloading": lambda prof: prof.offers_activation_offloading,
    # DeepSpeed's deepspeed.checkpointing.checkpoint, which Megatron-DeepSpeed's
    # --deepspeed-activation-checkpointing and the Megatron-LM of DeepSpeed's examples run;
    # zeroplan's own model stands for the latter (zeroplan.core.deepspeed_checkpointing).
    "partition_activations": lambda prof: prof.framework in (Framework.megatron_deepspeed, Framework.zeroplan),
    "cpu_checkpointing": lambda prof: prof.framework in (Framework.megatron_deepspeed, Framework.zeroplan),
    "fused_linear_cross_entropy": lambda prof: prof.offers_fused_linear_cross_entropy,
    # The frameworks' own losses are modelled from their code (zeroplan.core.framework_loss);
    # flash-attn's fused cross-entropy replaces the reference model's.
    "fused_cross_entropy": lambda prof: prof.framework is Framework.zeroplan,
    # The reference model's attention as torch's nn.MultiheadAttention (zeroplan.core.deepspeed_mha_views).
    "torch_multihead_attention": lambda prof: prof.framework is Framework.zeroplan,
    # The reference model's linears as torch's own F.linear under DeepSpeed's ZeRO-3
    # (zeroplan.core.deepspeed_torch_linear); the hf profile's model is built inside zero.Init.
    "deepspeed_torch_linear": lambda prof: prof.framework is Framework.zeroplan,
    # A script's own FusedAdam under DeepSpeed's stage 0 (zeroplan.core.deepspeed_fused_fp16): DeepSpeed-Chat's hf models.
    "deepspeed_fused_adam": lambda prof: prof.framework is Framework.hf,
    # torchtitan 0.3.0 models/llama3/config_registry.py: llama3_debugmodel_ce_loss builds the
    # unchunked CrossEntropyLoss beside the ChunkedLossWrapper of every other Llama-3 config.
    # torchtune 0.6.1 recipes instantiate whatever `loss:` the config names; with a plain
    # torch.nn.CrossEntropyLoss they never call set_num_output_chunks, and the model returns its
    # logits whole, upcast (modules/transformer.py unembed: self.output(h).float()).
    "unchunked_loss": lambda prof: prof.framework in (Framework.torchtitan, Framework.torchtune),
    "optimizer_in_backward": lambda prof: prof.offers_optimizer_in_backward,
    "fsdp_cpu_offload": lambda prof: prof.offers_fsdp_cpu_offload,
    "torchtitan_release": lambda prof: prof.framework is Framework.torchtitan,
    # The DeepSpeed release under the fork (zeroplan.core.deepspeed_2022), and the one Hugging
    # Face's ZeRO runs (zeroplan.core.finetune.activations.adapters_stay_fp32).
    "deepspeed_release": lambda prof: prof.framework in (Framework.megatron_deepspeed, Framework.hf),
    # transformers' KV cache and the output object its caller holds (zeroplan.core.kv_cache).
    "use_cache": lambda prof: prof.framework is Framework.hf,
    # torchtune's single-device recipes before August 2024 hold the shifted fp32 logits through
    # backward (zeroplan.core.kv_cache.torchtune_kept_logits_bytes).
    # A loop over the reference model that binds its logits before the loss (DeepSpeedExamples'
    # training/bf16_master_weight train.py) holds them the same way.
    "keep_outputs": lambda prof: prof.framework in (Framework.hf, Framework.torchtune, Framework.zeroplan),
    # torch's nn.CrossEntropyLoss on the reference model's logits without its upcast
    # (zeroplan.core.uncast_loss); litgpt: a loop's F.cross_entropy on its GPT's logits
    # (zeroplan.core.framework_loss.litgpt_loop_loss_tensors).
    "uncast_loss": lambda prof: prof.framework in (Framework.zeroplan, Framework.litgpt),
    # The causal-LM forward and loss of an older transformers release (zeroplan.core.transformers_release).
    "transformers_version": lambda prof: prof.framework is Framework.hf,
    # The accelerate release under the Trainer (zeroplan.core.checkpoint_save).
    "accelerate_version": lambda prof: prof.framework is Framework.hf,
    # zero_grad's and the optimizers' defaults before torch 2.0 (zeroplan.core.torch_release): the
    # loops that call torch's own; torchtune, torchtitan and litgpt need torch 2.x, and megatron
    # and megatron-deepspeed keep their gradients in their own buffers.
    "torch_release": lambda prof: prof.framework in (Framework.hf, Framework.zeroplan),
    # How transformers' from_pretrained builds the model beside DeepSpeed's engine (zeroplan.core.model_load).
    "model_load": lambda prof: prof.framework is Framework.hf,
}
"""TrainingSpec fields only some frameworks offer -> whether a profile offers the option."""


# torchtitan 0.3.0 torchtitan/models/: llama3 (RoPE, RMSNorm, SwiGLU, no biases), qwen3 (the
# same with per-head q/k RMSNorm; dense and MoE) and deepseek_v3 (multi-head latent attention,
# MoE with shared experts and dense first layers); gpt_oss, flux and the rest are not families
# the config reader builds. A model outside these would be planned with a model torchtitan
# cannot build.
def torchtitan_builds(model: ModelSpec) -> str | None:
    """Why torchtitan 0.3.0 has no model of this architecture, or None when it has one."""
    if model.position is not PositionKind.rope or model.norm is not NormKind.rmsnorm:
        return "learned positions or LayerNorm (its models use RoPE and RMSNorm)"
    if model.mlp is not MlpKind.swiglu:
        return f"a {model.mlp.value} MLP (its models use SwiGLU)"
    if model.bias or model.qkv_bias or model.post_norms:
        return "linear biases or post-norms"
    if model.is_moe and model.kv_lora_rank is None and not model.qk_norm:
        return "a mixture of experts other than Qwen3-MoE's or DeepSeek's (its MoE models)"
    return None


# torchtune 0.6.1 models/ (llama2/3/3.1/3.2/3.3, mistral, gemma, gemma2, qwen2/2.5/3, phi3/4):
# every builder makes RoPE and RMSNorm decoders with gated MLPs and sequential blocks; none a
# learned position table, ALiBi, LayerNorm, a two-matrix GELU MLP, biased projections other than
# Qwen2's q/k/v, a parallel block or an embedding norm (GPT-2, Bloom, GPT-NeoX, Phi-1/2).
def torchtune_builds(model: ModelSpec) -> str | None:
    """Why torchtune 0.6.1 has no builder for this architecture, or None when it has one."""
    if model.position is not PositionKind.rope or model.norm is not NormKind.rmsnorm:
        return "learned or ALiBi positions, or LayerNorm"
    if not model.mlp.gated:
        return "a two-matrix (GELU or ReLU) MLP"
    if model.bias or model.parallel_block or model.head_bias or model.embedding_norm or not model.causal:
        return "biased projections, a parallel block, an embedding norm or bidirectional attention"
    return None


# litgpt 0.4.13.dev1 (commit 00af8b0) litgpt/model.py and config.py: causal decoders with
# rotary positions (full or partial, rotary_percentage), LayerNorm or RMSNorm, GptNeoxMLP,
# LLaMAMLP, GemmaMLP or LLaMAMoE, optional parallel residual and post-norms; no learned position
# table, ALiBi, embedding norm, bidirectional attention, per-head q/k norms or latent attention.
def litgpt_builds(model: ModelSpec) -> str | None:
    """Why litgpt's GPT has no configuration of this architecture, or None when it has one."""
    if model.position is not PositionKind.rope:
        return "learned or ALiBi positions (its GPT uses rotary positions)"
    if not model.causal or model.embedding_norm or model.head_transform or model.token_types:
        return "bidirectional attention or an embedding norm"
    if model.qk_norm or model.is_mla or model.qkv_bias:
        return "per-head query/key norms, latent attention or biases on q, k and v alone"
    # litgpt's Config.bias sets every linear's bias at once (GPT-J biases its MLP alone).
    if model.mlp_biased != model.bias or model.mlp is MlpKind.relu:
        return "biases on the MLP alone or a ReLU MLP"
    return None


# megatron-core 0.16.1 models/gpt/gpt_model.py GPTModel with models/gpt/gpt_layer_specs.py:
# position_embedding_type "learned_absolute" | "rope" | "none" (no ALiBi), LayerNorm or RMSNorm
# (normalization), a GELU or gated (swiglu) MLP, pre-norm sequential blocks with causal attention.
# Its MoE layers (transformer/moe/: token dispatchers, grouped GEMMs, capacity and padding) and
# multi-latent attention are other code whose bytes zeroplan has not read; they are refused
# rather than planned as dense blocks.
def megatron_builds(model: ModelSpec, *, bigscience_fork: bool = False) -> str | None:
    """Why the megatron profile does not plan this architecture, or None when it does
    (``bigscience_fork``: the BigScience fork's GPT, which adds ALiBi and an embedding norm)."""
    if model.is_moe or model.is_mla:
        return "a mixture of experts or latent attention (Megatron's MoE and MLA layers are not modelled)"
    if model.position is PositionKind.alibi and not bigscience_fork:
        return "ALiBi positions (GPTModel offers learned, rope or none)"
    if model.embedding_norm and not bigscience_fork:
        return "an embedding norm"
    if model.post_norms or model.parallel_block or not model.causal:
        return "post-norms, a parallel block or bidirectional attention"
    if model.mlp is MlpKind.relu or model.position_offset or model.mlp_biased != model.bias:
        # OPT's and GPT-J's layouts: the megatron profile's terms were not read for them.
        return "a ReLU MLP, an offset position table or biases on the MLP alone"
    return None


# bigscience-workshop/Megatron-DeepSpeed@541b967f (2022-02-17, the fork BigScience's tr11 runs
# trained with beside the 2022 DeepSpeed): --position-embedding-type alibi
# (megatron/model/transformer.py ParallelAttention adds the ALiBi bias in its baddbmm, no position
# table: megatron/model/language_model.py Embedding) and --embed-layernorm
# (megatron/mpu/layers.py:191, VocabParallelEmbedding's torch.nn.LayerNorm after the vocabulary
# all-reduce). The megatron-deepspeed profile plans that fork's GPT under deepspeed_release
# 2022-bigscience (zeroplan.core.deepspeed_2022).
def builds_bigscience_fork(framework: Framework, deepspeed_release: str | None) -> bool:
    """Whether the request's GPT is the BigScience fork's (ALiBi and the embedding norm built)."""
    return framework is Framework.megatron_deepspeed and deepspeed_release == "2022-bigscience"


# fairseq c6006678 fairseq/models/transformer_lm.py and transformer.py TransformerDecoder: token
# embeddings, learned (or sinusoidal) positions, pre- or post-norm LayerNorm blocks of
# MultiheadAttention (as many K/V heads as query heads) and a two-matrix feed-forward
# (utils.get_activation_fn: relu, gelu, tanh...), an optional final LayerNorm and output projection.
def fairseq_builds(model: ModelSpec) -> str | None:
    """Why fairseq's transformer_lm does not build this architecture, or None when it does."""
    if model.position is not PositionKind.learned:
        return f"{model.position.value} positions (transformer_lm has learned or sinusoidal ones)"
    if model.norm is not NormKind.layernorm or model.mlp.gated or model.mlp not in (MlpKind.gelu, MlpKind.relu):
        return "RMSNorm or a gated MLP (transformer_lm builds LayerNorm and a two-matrix ReLU or GELU feed-forward)"
    if model.kv_heads != model.num_heads or model.is_moe or model.is_mla:
        return "grouped K/V heads, experts or latent attention"
    if (model.post_norms or model.parallel_block or not model.causal or model.qk_norm or model.embedding_norm
            or model.head_transform or model.token_types):
        return "a block layout transformer_lm does not build"
    return None


def check_framework_model(framework: Framework, model: ModelSpec, deepspeed_release: str | None = None) -> None:
    """Refuse, in one line, a model the framework's own code does not build."""
    if framework is Framework.fairseq:
        reason = fairseq_builds(model)
        if reason is not None:
            raise ZeroplanError("model", f"{model.name} has {reason}; the fairseq profile plans transformer_lm "
                                "decoders (allowed: framework zeroplan or hf for it)")
        return
    if framework is Framework.litgpt:
        reason = litgpt_builds(model)
        if reason is not None:
            raise ZeroplanError("model", f"{model.name} has {reason}; litgpt {PROFILES[framework].version} builds "
                                "rotary decoders (Llama, Mistral, Gemma, Phi, Falcon, GPT-NeoX/StableLM) "
                                "(allowed: framework zeroplan or hf for it)")
        return
    if framework.megatron_layout:
        # The fork's legacy GPT (megatron/model/language_model.py, transformer.py) offers the
        # same positions, norms and MLPs as megatron-core's GPTModel; its MoE is DeepSpeed's.
        reason = megatron_builds(model, bigscience_fork=builds_bigscience_fork(framework, deepspeed_release))
        if reason is not None:
            forked = framework is Framework.megatron_deepspeed and megatron_builds(model, bigscience_fork=True) is None
            allowed = "deepspeed_release 2022-bigscience, whose fork builds it, or framework zeroplan" if forked else (
                "framework zeroplan for it")
            raise ZeroplanError("model", f"{model.name} has {reason}; the {framework.value} profile plans dense GPT and "
                                f"Llama-style decoders (allowed: {allowed})")
        return
    if framework is Framework.torchtune:
        reason = torchtune_builds(model)
        if reason is not None:
            raise ZeroplanError("model", f"{model.name} has {reason}; torchtune {PROFILES[framework].version} builds "
                                "Llama, Mistral, Gemma, Qwen and Phi-3 models, RoPE and RMSNorm decoders with gated MLPs "
                                "(allowed: framework zeroplan or hf for it)")
        return
    if framework is not Framework.torchtitan:
        return
    reason = torchtitan_builds(model)
    if reason is not None:
        raise ZeroplanError(
            "model", f"{model.name} has {reason}; torchtitan {PROFILES[framework].version} builds Llama-3, Qwen3 "
            "(dense and MoE) and DeepSeek-V3 models (allowed: framework zeroplan or hf for it)",
        )


MEGATRON_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw, Optimizer.sgd, Optimizer.sgd_momentum)
"""optimizer/__init__.py _get_megatron_optimizer_based_on_param_groups: config.optimizer "adam"
(TE's or apex's FusedAdam in AdamW mode) or "sgd" (apex FusedSGD, with momentum)."""


def check_megatron_optimizer(optimizer: Optimizer) -> None:
    """Refuse, in one line, an optimizer the megatron profile does not plan."""
    if optimizer not in MEGATRON_OPTIMIZERS:
        allowed = ", ".join(o.value for o in MEGATRON_OPTIMIZERS)
        raise ZeroplanError("optimizer", f"{optimizer.value!r} is not a megatron-core optimizer the profile plans (allowed: {allowed})")


_TORCH_FUSED_OPTIMIZERS = (Optimizer.adam, Optimizer.adamw, Optimizer.sgd, Optimizer.sgd_momentum)


# torchtitan 9dec370 train.py loss_fn: cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)),
# the logits whole; the chunked loss came later.
def check_torchtitan_release(training: TrainingSpec) -> None:
    """Refuse a torchtitan release the profile does not model, or 9dec370 with a chunked loss."""
    release = training.torchtitan_release
    if release is None:
        return
    if release not in TORCHTITAN_RELEASES:
        raise ZeroplanError("torchtitan_release", f"{release!r} is not modelled (allowed: {', '.join(TORCHTITAN_RELEASES)})")
    if release == "9dec370" and not training.unchunked_loss:
        raise ZeroplanError("torchtitan_release", "9dec370's loss is unchunked (allowed with unchunked_loss)")


def check_deepspeed_release(training: TrainingSpec) -> None:
    """Refuse a DeepSpeed release the framework's profile does not model (megatron-deepspeed's
    DEEPSPEED_RELEASES, hf's HF_DEEPSPEED_RELEASES)."""
    release = training.deepspeed_release
    if release is None:
        return
    allowed = HF_DEEPSPEED_RELEASES if training.framework is Framework.hf else DEEPSPEED_RELEASES
    if release not in allowed:
        raise ZeroplanError("deepspeed_release", f"{release!r} is not modelled (allowed: {', '.join(allowed)})")


def check_transformers_version(training: TrainingSpec) -> None:
    """Refuse a transformers version that is not a release number or lies outside what is modelled."""
    check_release_range("transformers_version", training.transformers_version, TRANSFORMERS_OLDEST,
                        TRANSFORMERS_NEWEST, TRANSFORMERS_VERSION)
    check_release_range("accelerate_version", training.accelerate_version, ACCELERATE_OLDEST,
                        ACCELERATE_NEWEST, ACCELERATE_VERSION)


# Before 4.46 each model's forward computed its own loss: the Llama family's (Llama, Mistral,
# Mixtral, Qwen2, Gemma, Phi-3: RoPE and RMSNorm) upcast the logits to fp32
# (zeroplan.core.transformers_release, read from modeling_llama.py); GPT-2, Bloom, Falcon and
# GPT-NeoX shifted and cross-entropied them in the compute dtype (4.45.2 modeling_gpt2.py
# GPT2LMHeadModel.forward), which is not planned. From 4.46 every model goes through
# loss_utils.ForCausalLMLoss, as planned. OPT's own forward, attention and compute-dtype loss,
# is planned up to 4.48 (zeroplan.core.transformers_release.OPT_OWN_FORWARD_UNTIL).
def check_transformers_version_model(training: TrainingSpec, model: ModelSpec) -> None:
    """Refuse a release before 4.46 for a model outside the Llama family and OPT, whose old loss is not modelled."""
    if training.transformers_version is None or not returns_fp32_logits(training) or is_opt(model):
        return
    if model.norm is not NormKind.rmsnorm or model.position is not PositionKind.rope:
        raise ZeroplanError("transformers_version", f"{training.transformers_version} is modelled before 4.46 only for "
                            "the Llama family's forward (RoPE and RMSNorm models: Llama, Mistral, Qwen2, Gemma, Phi-3) and OPT's; "
                            f"{model.name} computed its loss its own way (allowed: 4.46.0 or later)")


def check_framework_request(training: TrainingSpec, model: ModelSpec | None = None) -> None:
    """Refuse, in one line naming the field, a policy the framework does not offer (and, given
    the model, a selective-layer interval that checkpoints no block)."""
    prof = profile(training.framework)
    if model is not None:
        check_framework_model(training.framework, model, training.deepspeed_release)
    if training.framework.megatron_layout:
        # The fork's megatron/optimizer/__init__.py:68-116 offers the same "adam" and "sgd".
        check_megatron_optimizer(training.optimizer)
    # torch 2.13 optim/adam.py, sgd.py: fused=True exists for Adam, AdamW and SGD only.
    if training.optimizer_loop is OptimizerLoop.fused and training.optimizer not in _TORCH_FUSED_OPTIMIZERS:
        allowed = ", ".join(o.value for o in _TORCH_FUSED_OPTIMIZERS)
        raise ZeroplanError("optimizer_loop", f"fused is offered by torch for {allowed}, not {training.optimizer.value} "
                            "(allowed: foreach, for-loop)")
    if training.precision not in prof.precisions:
        allowed = ", ".join(p.value for p in prof.precisions)
        raise ZeroplanError(
            "precision", f"{training.precision.value!r} is not offered by {training.framework.value} {prof.version} (allowed: {allowed})",
        )
    hf_stage0 = training.framework is Framework.hf and training.state_convention is StateConvention.deepspeed
    if training.state_convention is not None and training.framework is not Framework.zeroplan and not hf_stage0:
        # The framework's own engines decide where the bytes live (its profile and strategy;
        # hf's ZeRO strategies run DeepSpeed's engine: PlanRequest.convention). Under hf,
        # deepspeed says that ddp is DeepSpeed's stage 0 (zeroplan.core.deepspeed_stage0).
        engines = " (DeepSpeed's under its ZeRO strategies)" if training.framework is Framework.hf else ""
        raise ZeroplanError(
            "state_convention", f"{training.framework.value}'s own engines{engines} decide the state layout "
                                "(allowed only with framework zeroplan, or deepspeed under hf: DeepSpeed's stage 0)",
        )
    if training.activation_checkpointing not in prof.checkpointing:
        raise ZeroplanError(
            "activation_checkpointing",
            f"{training.activation_checkpointing.value!r} is not offered by {training.framework.value} "
            f"{prof.version} (allowed: {prof.checkpointing_names})",
        )
    for field, offers in FRAMEWORK_OPTIONS.items():
        if getattr(training, field) and not offers(prof):
            offering = ", ".join(f.value for f, p in PROFILES.items() if offers(p))
            raise ZeroplanError(
                field, f"not offered by {training.framework.value} {prof.version} (allowed only with framework {offering})"
            )
    # fairscale 05ce7971 FullyShardedDataParallel.__init__: "cpu_offload requires mixed_precision=True".
    if training.fsdp_cpu_offload and training.framework is Framework.fairseq and training.precision is not Precision.fp16_mixed:
        raise ZeroplanError("fsdp_cpu_offload", f"fairscale's cpu_offload requires mixed precision, not "
                            f"{training.precision.value} (allowed: precision fp16-mixed, fairseq's --fp16)")
    check_torchtitan_release(training)
    check_deepspeed_release(training)
    from zeroplan.core.tinyllama import check_fork_training

    check_fork_training(training)
    check_transformers_version(training)
    check_torch_release(training)
    check_model_load(training)
    check_checkpoint_reentrant(training)
    if model is not None:
        check_transformers_version_model(training, model)
    # torchtune's recipes held their logits only before August 2024, when the loss was a plain
    # nn.CrossEntropyLoss on the whole upcast logits (CEWithChunkedOutputLoss came later).
    if training.keep_outputs and training.framework is Framework.torchtune and not training.unchunked_loss:
        raise ZeroplanError("keep_outputs", "torchtune's loop held its logits only with a plain CrossEntropyLoss "
                            "(allowed with unchunked_loss, --unchunked-loss)")
    check_activation_offloading(training)
    # deepspeed runtime/activation_checkpointing/checkpointing.py: partitioning and the host copy
    # act on what deepspeed.checkpointing.checkpoint saves, the checkpointed block's input.
    for field in ("partition_activations", "cpu_checkpointing"):
        if getattr(training, field) and training.activation_checkpointing is not ActivationCheckpointing.full:
            raise ZeroplanError(field, f"acts on DeepSpeed's checkpointed block inputs (allowed with activation_checkpointing "
                                       f"'full', got {training.activation_checkpointing.value!r})")
    k = training.selective_layer_interval
    selective_layer = training.activation_checkpointing is ActivationCheckpointing.selective_layer
    if selective_layer and model is not None and k > model.num_layers:
        raise ZeroplanError(
            "selective_layer_interval",
            f"{k} checkpoints none of {model.name}'s {model.num_layers} blocks (allowed: 1 to {model.num_layers})",
        )


# transformers 4.26.0 modeling_utils.py from_pretrained (lines 2351-2358): a quantized model
# (load_in_8bit) is built under init_empty_weights and its weights placed on the GPU by
# accelerate, never whole on the host nor through zero.Init: neither load describes it.
def check_model_load(training: TrainingSpec) -> None:
    """Refuse a model load for a quantized base, which from_pretrained loads its own way."""
    if training.model_load is not None and training.finetune.quantize.is_quantized:
        raise ZeroplanError("model_load", f"a {training.finetune.quantize.value} base is loaded by bitsandbytes onto the "
                                          "GPU, neither sharded nor whole per rank (allowed: no --quantize)")


def fsdp_cpu_offload_strategies(framework: Framework) -> tuple[StrategyKind, ...]:
    """The framework's strategies that CPUOffloadPolicy applies to: its FSDP2 ones."""
    return tuple(kind for kind in profile(framework).strategies if kind.is_fsdp)


def check_fsdp_cpu_offload(training: TrainingSpec, kind: StrategyKind) -> None:
    """Refuse, in one line, FSDP CPU offload under a strategy that is not FSDP2."""
    if training.fsdp_cpu_offload and not kind.is_fsdp:
        allowed = ", ".join(k.value for k in fsdp_cpu_offload_strategies(training.framework))
        raise ZeroplanError(
            "fsdp_cpu_offload", f"FSDP2's CPUOffloadPolicy does not apply to {kind.value!r} (allowed: {allowed})"
        )


def loss_chunks(training: TrainingSpec) -> int:
    """How many pieces the framework's loss computes the logits in: its profile's, or 1 with
    TrainingSpec.unchunked_loss (torchtitan's ChunkedLossWrapper is modelled apart and counts 1).
    torchtune 0.6.1's DPO recipes never call set_num_output_chunks: one piece under dpo."""
    return 1 if training.unchunked_loss or training.objective is Objective.dpo else profile(training.framework).loss_chunks
