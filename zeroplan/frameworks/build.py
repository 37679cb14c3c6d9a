"""Each framework's own decoder, built from a zeroplan ModelSpec at full width and reduced depth,
with the activation checkpointing that framework applies (torch and the framework needed).

Only the constructors and policies are called here; nothing of the frameworks' layers is
re-written. What each call stands for is cited on the line above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeroplan.errors import ZeroplanError
from zeroplan.specs import ActivationCheckpointing, ModelSpec
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework

MEASURABLE = {
    Framework.hf: (ActivationCheckpointing.none, ActivationCheckpointing.full),
    Framework.torchtune: (ActivationCheckpointing.none, ActivationCheckpointing.full, ActivationCheckpointing.selective_layer),
    Framework.torchtitan: (ActivationCheckpointing.none, ActivationCheckpointing.full, ActivationCheckpointing.selective_op),
}
"""Framework -> checkpointing policies the measurement runs (torchtitan's with FlexAttention run
eagerly: _eager_flex_attention)."""


@dataclass
class BuiltModel:
    """A framework's model, its decoder blocks in order, and how to run its forward."""

    module: nn.Module
    blocks: list[nn.Module]
    forward: Callable[[torch.Tensor], torch.Tensor]
    """tokens [batch, seq] -> the logits the framework's loss reads."""
    version: str
    materialize: Callable[[], None] = lambda: None
    """What the framework's recipe runs on a meta-device model before training (run on real tensors)."""
    host_bytes: Callable[[], int] = lambda: 0
    """Bytes of the saved-tensor copies the framework has moved to host memory so far (live on
    a CPU-only fake run, but not on the accelerator): torchtune's activation offloading."""
    shard: Callable[[object, bool], str] | None = None
    """Apply the framework's own FSDP2 wrapping to ``module`` given (device_mesh,
    reshard_after_forward); returns a one-line description. None: the framework has none."""
    empty: Callable[[nn.Module, object], None] | None = None
    """How the module's parameters are allocated uninitialised on a device (``to_empty``); None:
    ``nn.Module.to_empty``. A quantized base overrides it (zeroplan.frameworks.lora)."""
    real: bool = False
    """The parameters are real CPU tensors already (not meta): bitsandbytes quantizes a
    Params4bit only on its move to a real device, so hf QLoRA is built and run for real
    (zeroplan.frameworks.lora.hf_bnb_qlora_llama); no ``to_empty``, no fake-tensor mode."""

    def to_empty(self, device: object) -> None:
        """Allocate every parameter and buffer of ``module`` on ``device``, uninitialised (under
        fake-tensor mode: fake tensors)."""
        if self.empty is None:
            self.module.to_empty(device=device)
        else:
            self.empty(self.module, device)


def check_measurable(framework: Framework, policy: ActivationCheckpointing, model: ModelSpec,
                     activation_offloading: bool = False) -> None:
    if framework not in MEASURABLE:
        allowed = ", ".join(f.value for f in MEASURABLE)
        raise ZeroplanError("--framework", f"{framework.value!r} cannot be measured yet (allowed: {allowed}); see docs/frameworks.md")
    if policy not in MEASURABLE[framework]:
        allowed = ", ".join(p.value for p in MEASURABLE[framework])
        raise ZeroplanError("--activation-checkpointing", f"{policy.value!r} cannot be measured for {framework.value} (allowed: {allowed})")
    # Both builders make Llama blocks: anything else would be measured as a Llama, silently.
    if not model.is_dense_llama_layout:
        raise ZeroplanError("model", f"{model.name!r}: only dense Llama-layout models (RoPE, RMSNorm, SwiGLU, no biases, "
                            "no q/k or post norms) are measured")
    if framework is Framework.torchtune and model.head_size * model.num_heads != model.hidden_size:
        # models/llama3_1/_component_builders.py llama3_1 takes no head_dim: embed_dim // num_heads.
        raise ZeroplanError("model", f"{model.name!r}: torchtune's llama3_1 builder derives head_dim as hidden_size / num_heads")
    if framework is Framework.torchtitan and model.head_size * model.num_heads != model.hidden_size:
        # torchtitan 0.3.0 models/llama3/__init__.py _build_llama3_layers passes no head_dim to
        # make_gqa_config (models/common/config_utils.py), which then uses dim // n_heads.
        raise ZeroplanError("model", f"{model.name!r}: torchtitan's Llama-3 builder derives head_dim as hidden_size / num_heads")

    if activation_offloading and (framework is not Framework.torchtune or policy is not ActivationCheckpointing.full):
        # torchtune 0.6.1 recipes/full_finetune_distributed.py: offloading needs enable_activation_checkpointing.
        raise ZeroplanError("--activation-offloading", "measured only for torchtune with --activation-checkpointing full")


def build(framework: Framework, model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype,
          seq_len: int | None = None, *, selective_layer_interval: int = 2, activation_offloading: bool = False,
          finetune: FineTuneSpec = FineTuneSpec()) -> BuiltModel:
    """The framework's model with ``layers`` blocks on the meta device, in ``dtype``; ``seq_len``
    is the training sequence length, where the framework sizes buffers by it (torchtitan); the
    interval and offloading are torchtune's ``ac_option`` and ``enable_activation_offloading``;
    ``finetune`` other than a full fine-tune builds the framework's LoRA/QLoRA model
    (zeroplan.frameworks.lora)."""
    check_measurable(framework, policy, model, activation_offloading)
    if not finetune.trains_everything:
        from zeroplan.frameworks import lora

        # The base builders are handed over (lora imports nothing of this module: no cycle).
        return lora.build_finetune(framework, model, layers, policy, dtype, finetune, selective_layer_interval,
                                   activation_offloading, hf_base=_hf_llama, hf_shard=_hf_fsdp2,
                                   torchtune_wrap=torchtune_built)
    if framework is Framework.torchtune:
        return _torchtune_llama(model, layers, policy, dtype, selective_layer_interval, activation_offloading)
    if framework is Framework.torchtitan:
        return _torchtitan_llama(model, layers, policy, dtype, seq_len or model.max_positions)
    builder = {Framework.hf: _hf_llama}[framework]
    return builder(model, layers, policy, dtype)


def hf_llama_config(model: ModelSpec, layers: int):
    """transformers' LlamaConfig for ``model`` with ``layers`` blocks."""
    from transformers import LlamaConfig

    # transformers models/llama/configuration_llama.py field names; attn_implementation "sdpa" is
    # what from_pretrained picks on torch >= 2.1 (modeling_utils._check_and_adjust_attn_implementation).
    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads or model.num_heads, head_dim=model.head_size,
        max_position_embeddings=model.max_positions, tie_word_embeddings=model.tied_embeddings,
        attn_implementation="sdpa",
    )


def _hf_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype) -> BuiltModel:
    import transformers
    from transformers import LlamaForCausalLM

    config = hf_llama_config(model, layers)
    with torch.device("meta"):
        module = LlamaForCausalLM(config).to(dtype)
    module.train()
    if policy is ActivationCheckpointing.full:
        # What Trainer(gradient_checkpointing=True) calls (trainer.py), with its default kwargs
        # (modeling_utils.gradient_checkpointing_enable: use_reentrant=True).
        module.gradient_checkpointing_enable()

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        return module(input_ids=tokens).logits

    def shard(mesh: object, reshard_after_forward: bool) -> str:
        return _hf_fsdp2(module, mesh, reshard_after_forward)

    return BuiltModel(module, list(module.model.layers), forward, f"transformers {transformers.__version__}", shard=shard)


HF_FSDP2_PARAM_DTYPE = torch.bfloat16
"""accelerate 1.10.1 utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision
("bf16", fsdp_version 2): MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
output_dtype=bf16), what Trainer(bf16=True) with fsdp_version 2 hands to fully_shard."""


def _hf_fsdp2(module: nn.Module, mesh: object, reshard_after_forward: bool) -> str:
    """accelerate 1.10.1 utils/fsdp_utils.py fsdp2_prepare_model, reproduced as the calls it makes
    (accelerate itself needs an Accelerator and a launched process group): fully_shard every
    module of a class in ``model._no_split_modules`` (LlamaDecoderLayer; the transformer wrap
    policy Trainer picks), bottom-up, then the root, each with the plugin's
    reshard_after_forward and MixedPrecisionPolicy; then, with mixed precision on,
    ``model.to(torch.float32)``: the sharded parameters, their gradients and AdamW's states
    are fp32. accelerate's _prepare_fsdp2 does not wrap the forward in autocast (only
    prepare_model, the non-FSDP2 path, does), so the forward computes in the policy's bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = HF_FSDP2_PARAM_DTYPE
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
    kwargs = dict(reshard_after_forward=reshard_after_forward, mp_policy=policy, mesh=mesh)
    wrap = tuple(type(m) for m in module.modules() if type(m).__name__ in module._no_split_modules)
    for submodule in reversed(list(module.modules())[1:]):
        if isinstance(submodule, wrap):
            fully_shard(submodule, **kwargs)
    fully_shard(module, **kwargs)
    module.to(torch.float32)
    return (f"accelerate fsdp2_prepare_model: fully_shard({', '.join(sorted(module._no_split_modules))}, root; "
            f"reshard_after_forward={reshard_after_forward}), MixedPrecisionPolicy(param_dtype={dtype}, "
            f"reduce_dtype={dtype}, output_dtype={dtype}), fp32 sharded parameters")


def _torchtune_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype,
                     interval: int = 2, offloading: bool = False) -> BuiltModel:
    from torchtune.models.llama3_1 import llama3_1

    # torchtune models/llama3_1/_component_builders.py llama3_1(): the builder its
    # llama3_1_8b/70b/405b presets call with their sizes.
    with torch.device("meta"):
        module = llama3_1(
            vocab_size=model.vocab_size, num_layers=layers, num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads or model.num_heads, embed_dim=model.hidden_size,
            max_seq_len=model.max_positions, intermediate_dim=model.ffn_hidden_size,
        ).to(dtype)
    # recipes/full_finetune_distributed.py: custom_sharded_layers ['tok_embeddings', 'output'] in
    # every shipped llama3_1 *_full.yaml.
    return torchtune_built(module, policy, interval, offloading, ["tok_embeddings", "output"])


def torchtune_built(module: nn.Module, policy: ActivationCheckpointing, interval: int, offloading: bool,
                    custom_sharded_layers: list[str] | None) -> BuiltModel:
    """A torchtune TransformerDecoder with what its distributed recipes apply after building it:
    activation checkpointing, the chunked output, offloading, RoPE init and shard_model."""
    import contextlib
    from importlib.metadata import version

    from torchtune import modules, training
    from torchtune.training import activations

    from zeroplan.frameworks._cuda_streams import host_cuda_streams

    module.train()
    if policy is ActivationCheckpointing.full:
        # recipes/full_finetune_distributed.py with enable_activation_checkpointing: True.
        training.set_activation_checkpointing(module, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    elif policy is ActivationCheckpointing.selective_layer:
        # recipes/full_finetune_distributed.py with enable_activation_checkpointing: False,
        # ac_mode: selective, ac_option: k (recipes/configs/dev/8B_full_experimental.yaml, k 2).
        # training/activations.py checkpoint_wrapper numbers the blocks in an attribute of
        # itself that lives as long as the process; a recipe builds one model, so it starts at 0.
        activations.checkpoint_wrapper._count = 0
        activations.apply_selective_activation_checkpointing(module, "selective", interval)
    # recipes/full_finetune_distributed.py: with CEWithChunkedOutputLoss the model returns
    # num_output_chunks logit chunks (8 in every shipped config).
    module.set_num_output_chunks(8)
    offload = contextlib.nullcontext()
    streams = host_cuda_streams if offloading else contextlib.nullcontext
    if offloading:
        # recipes/full_finetune_distributed.py _setup_model, then `with activations_handling_ctx:`
        # around the model's forward (the loss runs outside it); the context also puts the
        # output projection under NoOpManager.
        with streams():
            offload = training.get_act_offloading_ctx_manager(module, True)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        with streams(), offload:
            return module(tokens)

    def host_bytes() -> int:
        # OffloadActivations.tracker: tensor id -> (tensor, modified); modified is its host copy.
        tracker = getattr(offload, "tracker", {})
        return sum(tensor.untyped_storage().nbytes() for tensor, moved in tracker.values() if moved)

    def materialize() -> None:
        # recipes/full_finetune_distributed.py after loading on meta: rope_init() on each module
        # that has one (the RoPE cache is a non-persistent buffer). Its Llama-3.1 scaling reads
        # values, so it runs on real CPU tensors (a few MiB) before the fake forward.
        for submodule in module.modules():
            if hasattr(submodule, "rope_init"):
                submodule.to_empty(device="cpu")
                submodule.rope_init()

    def shard(mesh: object, reshard_after_forward: bool) -> str:
        # recipes/full_finetune_distributed.py (and lora_finetune_distributed.py) _setup_model:
        # shard_model with get_shard_conditions (every layers.i, and the names in
        # custom_sharded_layers), fsdp_reshard_after_forward, no cpu offload, no
        # mixed-precision policy (the module is already bf16).
        from functools import partial

        names = custom_sharded_layers
        condition = partial(training.get_shard_conditions, names_to_match=names)
        training.shard_model(model=module, shard_conditions=[condition], cpu_offload=False,
                             reshard_after_forward=reshard_after_forward, dp_mesh=mesh)
        return (f"torchtune training.shard_model(layers.i, custom_sharded_layers={names}, root; "
                f"reshard_after_forward={reshard_after_forward}), no MixedPrecisionPolicy (bf16 module)")

    return BuiltModel(module, list(module.layers), forward, f"torchtune {version('torchtune')}", materialize,
                      host_bytes=host_bytes, shard=shard)


def _eager_flex_attention() -> None:
    """Run torchtitan's FlexAttention without torch.compile, so that it runs on fake tensors.

    torchtitan 0.3.0 models/common/attention.py calls ``FlexAttention._compiled_flex_attn``
    (``torch.compile(flex_attention)``) and builds its block mask with
    ``_compiled_create_block_mask`` (``torch.compile(create_block_mask)``); neither compiles
    on fake tensors. Both are replaced by the same functions uncompiled, and eager
    ``flex_attention`` is made to call its higher-order op directly on fake CPU tensors
    (_torch_private.flex_attention_without_dynamo). That op's autograd function
    (torch/_higher_order_ops/flex_attention.py FlexAttentionAutogradOp) saves Q, K, V, the
    output, the fp32 log-sum-exp and the block-mask tensors (what the compiled backward reads),
    and also its fp32 max_scores (4·a·s·b bytes per block), which the backward never reads and
    the compiled graph therefore does not keep: the records hold that much more than a GPU run.
    The block mask is built once per step and shared by every block, so how it is built changes
    nothing a block keeps. SelectiveAC names the op itself (torch._higher_order_ops.flex_attention)
    in its save list, so its policy sees the same op. Installed for the process; idempotent.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    from zeroplan.simulate import _torch_private as private

    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask
    private.flex_attention_without_dynamo()


def build_on_meta(config, dtype: torch.dtype) -> nn.Module:  # type: ignore[no-untyped-def]
    """torchtitan's model ``config`` built on the meta device in ``dtype``, its RoPE caches as
    torchtitan makes them: Module.to casts the complex64 RoPE cache too; FSDP2's
    MixedPrecisionPolicy casts only parameters, so each RoPE rebuilds its own cache
    (RoPE._init_self_buffers, complex64)."""
    from torchtitan.models.common import RoPE

    with torch.device("meta"):
        module = config.build().to(dtype)
        for submodule in module.modules():
            if isinstance(submodule, RoPE):
                submodule.init_states(buffer_device=torch.device("meta"))
    return module


def _torchtitan_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype,
                      seq_len: int) -> BuiltModel:
    from importlib.metadata import version

    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    _eager_flex_attention()
    # torchtitan 0.3.0 models/llama3/__init__.py _8b/_70b: the config each Llama-3 flavour builds
    # (fused QKV, ComplexRoPE with Llama-3.1 scaling, the default "flex" attention backend), with
    # the spec's sizes; _build_llama3_layers is the layer builder every flavour calls. The trainer
    # sizes each RoPE cache to training.seq_len (models/common/decoder.py
    # Decoder.Config.update_from_config: rope max_seq_len = seq_len).
    config = Llama3Model.Config(
        dim=model.hidden_size, vocab_size=model.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=model.vocab_size, embedding_dim=model.hidden_size),
        norm=RMSNorm.Config(normalized_shape=model.hidden_size),
        lm_head=Linear.Config(in_features=model.hidden_size, out_features=model.vocab_size),
        layers=_build_llama3_layers(
            n_layers=layers, dim=model.hidden_size, n_heads=model.num_heads, n_kv_heads=model.kv_heads,
            hidden_dim=model.ffn_hidden_size, fuse_qkv=True, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=model.head_size, max_seq_len=seq_len, theta=500000, scaling="llama"),
        ),
    )
    module = build_on_meta(config, dtype)
    module.train()
    # torchtitan 0.3.0 models/llama3/parallelize.py: ac_config.build().apply(model) wraps each
    # block (distributed/activation_checkpoint.py); "selective" is SelectiveAC (per op).
    if policy is ActivationCheckpointing.full:
        FullAC(FullAC.Config()).apply(module)
    elif policy is ActivationCheckpointing.selective_op:
        SelectiveAC(SelectiveAC.Config()).apply(module)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        # trainer.py post_dataloading_process: the dataloader's per-document positions
        # (hf_datasets/text_datasets.py; one document per sample here) and the block mask
        # model.get_attention_masks builds from them, then model(inputs, positions, masks).
        batch, seq = tokens.shape
        positions = torch.arange(seq).repeat(batch, 1)
        masks = module.get_attention_masks(positions)
        return module(tokens, positions=positions, attention_masks=masks)

    def shard(mesh: object, reshard_after_forward: bool) -> str:
        # models/llama3/parallelize.py parallelize_llama -> distributed/fsdp.py
        # apply_fsdp_to_decoder with config/configs.py defaults: mixed_precision_param
        # "bfloat16", mixed_precision_reduce "float32", fsdp_reshard_after_forward "default"
        # (reshard every unit but norm + lm_head, without pipeline parallelism) or "never".
        policy_name = "default" if reshard_after_forward else "never"
        apply_fsdp_to_decoder(module, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              pp_enabled=False, reshard_after_forward_policy=policy_name)
        return (f"torchtitan apply_fsdp_to_decoder(param_dtype=bfloat16, reduce_dtype=float32, "
                f"reshard_after_forward_policy={policy_name!r})")

    blocks = list(module.layers.values())
    return BuiltModel(module, blocks, forward, f"torchtitan {version('torchtitan')}", shard=shard)
