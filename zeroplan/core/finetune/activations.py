"""What one decoder block keeps for backward under LoRA, less what it keeps in a full fine-tune.

Autograd keeps a matmul's input only when the weight needs a gradient, and a product's factor
only when the other factor needs one (torch 2.13 tools/autograd/derivatives.yaml: mm saves
``self`` for ``mat2``'s gradient and ``mat2`` for ``self``'s; the generated VariableType code
saves each only if the corresponding output needs a gradient). A frozen base linear therefore
keeps nothing of its input and a frozen norm weight nothing of the normalised tensor it scales;
each adapter keeps its own input (for A's gradient) and A's r-wide output (for B's). The full
fine-tune's terms are those of zeroplan.core.activations.layer_terms.
"""

from __future__ import annotations

from zeroplan.core.activations import norm_bytes, rms_norm_is_composite
from zeroplan.core.finetune.adapter_dtype import (adapters_cast_their_input, peft_adapter_element_bytes, peft_matmul_bytes,
                                                   peft_plain_ddp)
from zeroplan.core.finetune.storage import hf_runs_fsdp1
from zeroplan.core.hf_rotary_cat import rotary_cat_output_copy_bytes
from zeroplan.core.model_load import model_load
from zeroplan.specs.finetune import BaseDtype, LoraTarget, Quantization, linear_modules, lora_adapters
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import NormKind
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, AttentionKernel, Kernels, ModelLoad, Precision, StateConvention
from zeroplan.units import FP32_BYTES


# torch 2.13 aten/src/ATen/native/Dropout.cpp: on CUDA dropout runs the fused native_dropout,
# which keeps a bool mask (one byte per element); elsewhere (is_fused_kernel_acceptable is false
# on the CPU) it multiplies by a noise tensor of the input's dtype, which the product keeps.
def dropout_mask_bytes(request: PlanRequest, input_bytes: int) -> int:
    return 1 if request.training.kernels is Kernels.cuda else input_bytes

# The input each group of a block's linears reads (zeroplan.core.activations.layer_terms names),
# and whether another op keeps that tensor anyway: q, k and v read the attention norm's output;
# o the attention's output, which the fused attention itself keeps for its backward (layer_terms
# counts it once, as output_projection_input: the kernel's output, returned transposed, is the
# tensor o reads); gate and up read the MLP norm's output; down the gated product.
INPUT_GROUPS = (
    ((LoraTarget.q, LoraTarget.k, LoraTarget.v), "hidden", False),
    ((LoraTarget.o,), "attention", True),
    ((LoraTarget.gate, LoraTarget.up), "hidden", False),
    ((LoraTarget.down,), "ffn", False),
)


# The attention output o reads is kept by a fused kernel for its own backward (torch's SDPA
# flash and memory-efficient kernels save their output; INPUT_GROUPS' True), but not by
# transformers' eager attention: transformers 4.56.2 models/llama/modeling_llama.py
# eager_attention_forward (lines 181-190; modeling_phi.py the same function) computes it as
# torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), and a matmul's backward
# keeps its operands, not its result. So under eager attention o's input is kept only by the
# readers that keep it (measured on peft's LoRA over PhiDecoderLayer: tests/test_hf_activation.py).
def input_kept_anyway(request: PlanRequest, kept_anyway: bool) -> bool:
    """INPUT_GROUPS' kept_anyway for the request's attention kernel."""
    return kept_anyway and request.training.attention_kernel is not AttentionKernel.eager


def base_modules(request: PlanRequest, group: tuple[LoraTarget, ...]) -> tuple[tuple[LoraTarget, ...], ...]:
    """The linear modules that compute ``group``'s projections in the request's model
    (zeroplan.specs.finetune.linear_modules)."""
    return linear_modules(group, request.model, request.training.framework)


def group_adapters(request: PlanRequest, group: tuple[LoraTarget, ...]) -> int:
    """How many adapters read ``group``'s input: one per wrapped module (a fused module's one
    adapter reads it once, zeroplan.specs.finetune.lora_adapters)."""
    finetune = request.training.finetune
    return sum(1 for module in lora_adapters(finetune, request.model, request.training.framework)
               if any(t in group for t in module))


def input_width(request: PlanRequest, kind: str) -> int:
    model = request.model
    return {"hidden": model.hidden_size, "attention": model.attention_output_size, "ffn": model.ffn_hidden_size}[kind]


def _output_width(request: PlanRequest, target: LoraTarget) -> int:
    model = request.model
    return {LoraTarget.q: model.q_size, LoraTarget.k: model.kv_size, LoraTarget.v: model.kv_size,
            LoraTarget.o: model.hidden_size, LoraTarget.gate: model.ffn_hidden_size,
            LoraTarget.up: model.ffn_hidden_size, LoraTarget.down: model.hidden_size}[target]


# DeepSpeed 0.19.8 runtime/engine.py _configure_distributed_model (lines 2074-2088) and
# _cast_module_mixed_precision (1851-1862): "ZeRO-Init params are already at the configured dtype
# and partitioned, so the per-parameter cast applies only in the non-zero-init path"; a model
# with any ds_id parameter (zero.Init, entered by transformers for a non-quantized model under
# ZeRO-3 with the sharded load: loaded_inside_zero_init) is not cast at all. peft's adapters are
# made after zero.Init has returned and upcast to fp32 by get_peft_model (peft 0.17.1 tuners_utils.py
# _cast_adapter_dtype), and ZeRO-3 partitions them as they are (zero/parameter_offload.py:258-264
# -> partition_parameters.py:1209-1215 _convert_to_zero_parameters: no dtype cast), so they stay
# fp32: their weights, their autograd gradients and the optimizer's "fp16" flat partition
# (stage3.py:238, the first trainable parameter's dtype), which then serves as the fp32 master
# itself (stage3.py:1162-1167, dtypes equal: no second copy); the engine runs no autocast
# (torch_autocast off by default). Those model-state differences are a few bytes per adapter
# element and are not modelled; what the adapters keep for backward is. Before 0.19.2 the same function called
# self.module.bfloat16() / half() on every model (0.13.3 engine.py:1099-1106; 0.19.1 the same;
# replaced in microsoft/DeepSpeed#8066, first released in 0.19.2), which cast the adapters with
# the rest. ZeRO-1/2 never pass zero.Init, so the cast holds there in every release. peft 0.7.0
# to 0.11.1 make the adapters in the base's bf16 and never upcast them
# (zeroplan.core.finetune.adapter_dtype.peft_adapter_element_bytes): nothing is fp32 to stay so.
def adapters_stay_fp32(request: PlanRequest) -> bool:
    """Whether DeepSpeed's ZeRO-3 engine leaves peft's fp32 adapters in fp32 under a 16-bit
    precision (hf, zero.Init entered, DeepSpeed 0.19.2 or later: deepspeed_release 0.19.8; a
    peft that makes them fp32)."""
    return (loaded_inside_zero_init(request) and request.training.finetune.is_lora
            and request.training.precision.compute_bytes < FP32_BYTES
            and request.training.deepspeed_release in (None, "0.19.8")
            and peft_adapter_element_bytes(request) == FP32_BYTES)


# peft 0.17.1 tuners/lora/layer.py Linear.forward casts the input to the adapter weight's dtype
# (_cast_input_dtype) before each adapter, and get_peft_model upcasts bf16 adapters to fp32
# (tuners_utils.py _cast_adapter_dtype, autocast_adapter_dtype=True). Where nothing casts the
# adapters back to bf16 for compute, each adapter makes its own fp32 copy of the shared input:
# the Trainer's DDP path (autocast, no engine cast: autocast casts the copy to bf16 again for
# lora_A's matmul, and that bf16 copy is what lora_A saves) and DeepSpeed ZeRO-3 from 0.19.2
# (adapters_stay_fp32: no autocast, lora_A saves the fp32 copy). FSDP2's MixedPrecisionPolicy
# (param_dtype bf16) and DeepSpeed's module cast (ZeRO-1/2; ZeRO-3 before 0.19.2) hand the
# adapters bf16 weights, so the input passes uncast and is kept once. accelerate's FSDP1 (hf with
# fsdp_version 1) does not: PEFT's fsdp_auto_wrap_policy makes each lora_A its own FSDP unit, so
# Linear.forward reads lora_A.weight before that unit's pre-forward gathers it, when use_orig_params
# points it at its fp32 shard (torch 2.13 distributed/fsdp/_flat_param.py _use_sharded_views);
# the input is cast to fp32 and autocast, which accelerate wraps the forward in, casts it to bf16
# again for the matmul, as under DDP (measured: benchmarks/framework-fsdp1-step-records, hf LoRA
# at ac none). Over a quantized base (hf) see quantized_adapters_copy_their_input.
def adapters_copy_their_input(request: PlanRequest) -> bool:
    """Whether each adapter makes its own copy of the input its widest linears read (the fp32
    input, then autocast's bf16 copy of it where autocast runs)."""
    if request.training.framework is Framework.hf and request.training.finetune.quantize.is_quantized:
        return quantized_adapters_copy_their_input(request, "hidden")
    # Under plain DDP, whether peft's adapters are of another dtype than their bf16 input (by
    # release: zeroplan.core.finetune.adapter_dtype.adapters_cast_their_input).
    return (request.training.framework is Framework.hf and request.strategy.kind is StrategyKind.ddp
            and adapters_cast_their_input(request)) or \
        adapters_stay_fp32(request) or (request.strategy.kind.is_fsdp and hf_runs_fsdp1(request))


# peft tuners/lora/bnb.py Linear4bit.forward and Linear8bitLt.forward (the same test in every
# release from 0.5.0, tuners/lora.py, to 0.20.0) cast the input to lora_A.weight.dtype only where
# torch.is_autocast_enabled() is false, which on a GPU reads CUDA's autocast. Under the Trainer's
# or accelerate's autocast nothing is cast: an adapter copies its input only where autocast casts
# it for lora_A's matmul, that is where the input is fp32 (quantized_base_outputs_fp32: the
# residual stream and MLP under prepare_model_for_kbit_training), never for o, which reads the
# attention's bf16 output. Without autocast (bf16-pure, DeepSpeed's engine, FSDP2's bf16 gather)
# the input and the adapters are in the compute dtype: the cast is a no-op. Measured:
# benchmarks/framework-finetune-records (hf QLoRA and int8: o's adapter keeps the attention
# output itself) and benchmarks/framework-fsdp1-orig-params-step-records.
def quantized_adapters_copy_their_input(request: PlanRequest, kind: str) -> bool:
    """Whether each bitsandbytes-wrapped adapter (hf) of the linears reading input ``kind``
    (INPUT_GROUPS) makes its own copy of it."""
    return quantized_base_outputs_fp32(request) and kind != "attention"


def group_adapters_copy_input(request: PlanRequest, kind: str) -> bool:
    """adapters_copy_their_input for the linears reading input ``kind`` (INPUT_GROUPS)."""
    if request.training.framework is Framework.hf and request.training.finetune.quantize.is_quantized:
        return quantized_adapters_copy_their_input(request, kind)
    return adapters_copy_their_input(request)


# What lora_A multiplies, and so saves for its weight's gradient, and what it returns, which
# lora_B saves: under autocast (hf's DDP with bf16-mixed) its bf16 cast of the (dropped) fp32
# input and a bf16 product; with fp32 adapters and no autocast (adapters_stay_fp32; hf's plain
# DDP under bf16-pure on a peft that leaves them fp32: adapter_dtype.peft_matmul_bytes) the fp32
# input and an fp32 product; otherwise the compute dtype.
def adapter_matmul_bytes(request: PlanRequest) -> int:
    """Bytes per element of lora_A's saved input and of its r-wide output."""
    if adapters_stay_fp32(request):
        return FP32_BYTES
    if peft_plain_ddp(request):
        return peft_matmul_bytes(request)
    return request.training.precision.compute_bytes


# bitsandbytes 0.50.2 autograd/_functions.py MatMul8bitLt.forward (what Linear8bitLt runs on a GPU):
# when its input needs a gradient it keeps the input itself (ctx.tensors = (CAt, subA, A), a plain
# attribute, not save_for_backward) to compute that gradient, whether or not the weight trains;
# subA, the input's outlier columns beyond llm_int8_threshold, is a few columns of real
# activations (LLM.int8 sec. 3.2) and left out. Under hf the input arrives in fp32:
# prepare_model_for_kbit_training holds the residual stream, the norms and (through
# MatMul8bitLt's output, in its input's dtype) the MLP's gate and up in fp32, and the custom op
# is not autocast (measured: benchmarks/framework-finetune-records, hf int8).
def int8_kept_input_bytes(request: PlanRequest) -> int:
    """Bytes per element of the input an int8 base linear keeps (0: the base is not int8)."""
    return FP32_BYTES if request.training.finetune.quantize is Quantization.int8 else 0


# bitsandbytes 0.39.1 to 0.43.1 autograd/_functions.py MatMul4Bit.forward: `if
# any(ctx.needs_input_grad[:2]): ctx.tensors = (A, B)`, a plain attribute holding the input A
# until backward, which never reads it (the weight is frozen); 0.43.2 keeps (None, B). So before
# 0.43.2 every 4-bit base linear keeps the input it multiplied, adapter or not. What A is:
# nn/modules.py Linear4bit.forward (the same in 0.43.1 and 0.50.2) passes `x.to(compute_dtype)`,
# the shared input itself where it is in the compute dtype already, its own bf16 copy per linear
# where it is not (hf's QLoRA: the fp32 residual stream and MLP, quantized_base_outputs_fp32).
def bnb_4bit_keeps_input(request: PlanRequest) -> bool:
    """Whether each bitsandbytes 4-bit base linear keeps its input for backward."""
    return request.training.finetune.bnb_4bit_keeps_input and request.training.framework is not Framework.torchtune


# torch 2.1 torch/utils/checkpoint.py _checkpoint_without_reentrant_generator (the non-reentrant
# checkpoint; the same in 2.13) runs the block's forward with grad enabled inside
# saved_tensors_hooks whose pack hook drops each tensor an op saves with save_for_backward and
# whose unpack recomputes it in backward; the reentrant CheckpointFunction runs the forward under
# no_grad, recording no node. A custom Function's plain ctx attribute is no saved tensor: under
# the non-reentrant checkpoint bitsandbytes' MatMul4Bit before 0.43.2 (ctx.tensors = (A, B),
# bnb_4bit_keeps_input) holds every block's input A from its forward until the step's graph is
# dropped after backward, while the recomputation's own nodes die with it (measured with
# bitsandbytes' Linear4bit on CPU, both checkpoints: benchmarks/bnb_checkpoint_escape.py). Hugging
# Face's checkpoint is the reentrant one unless gradient_checkpointing_kwargs says otherwise;
# ms-swift 1.x (swift/llm/utils/model.py fix_gradient_checkpointing_warning, from c445b330c of
# 2023-11-28 to its 3.0 refactor) rebinds torch.utils.checkpoint.checkpoint to default to
# use_reentrant=False, which Qwen-1's own modeling_qwen.py then calls for every block.
def bnb_inputs_escape_checkpoint(request: PlanRequest) -> bool:
    """Whether every fully checkpointed block keeps its quantized matmul inputs (hf's
    non-reentrant checkpoint over bitsandbytes' 4-bit before 0.43.2, or its int8 in any release)."""
    from zeroplan.core.profiles import checkpoint_is_reentrant

    training = request.training
    keeps = bnb_4bit_keeps_input(request) or training.finetune.quantize is Quantization.int8
    return (keeps and training.framework is Framework.hf
            and training.activation_checkpointing is ActivationCheckpointing.full and not checkpoint_is_reentrant(training))


# What MatMul4Bit holds per block: the tensor each 4-bit linear multiplied. Linear4bit.forward
# passes x.to(compute_dtype): in a bf16 module the shared input itself, one per tensor read (the
# attention norm's output for q, k, v, and in a parallel block the MLP; the attention output for
# o; the MLP norm's output for gate and up, or fc; the MLP's product for down); in hf's fp32
# module (prepare_model_for_kbit_training, quantized_base_outputs_fp32) a bf16 copy per linear,
# but for o, which reads the attention's bf16 output.
def checkpoint_escaping_inputs_bytes(request: PlanRequest) -> int:
    """Bytes of one block's 4-bit matmul inputs alive from its forward to the end of the step's
    backward (0 unless bnb_inputs_escape_checkpoint)."""
    if not bnb_inputs_escape_checkpoint(request):
        return 0
    model = request.model
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    hidden, attention, ffn = (input_width(request, kind) for kind in ("hidden", "attention", "ffn"))
    if request.training.finetune.quantize is Quantization.int8:
        # MatMul8bitLt keeps the input itself (int8_kept_input_bytes: fp32 under hf's recipe), o's
        # the attention's compute-dtype output.
        x = int8_kept_input_bytes(request)
        mlp_input = [hidden] if model.norms_per_block > 1 else []
        return tokens * (x * (hidden + ffn + sum(mlp_input)) + e * attention)
    if quantized_base_outputs_fp32(request):
        # One copy per base module (base_modules: a fused q/k/v or gate/up module is one Linear4bit).
        qkv = len(base_modules(request, (LoraTarget.q, LoraTarget.k, LoraTarget.v)))
        gate_up = len(base_modules(request, (LoraTarget.gate, LoraTarget.up))) if model.mlp.gated else 1
        reads = [hidden] * qkv + [attention] + [hidden] * gate_up + [ffn]
    else:
        reads = [hidden, attention, ffn] + ([hidden] if model.norms_per_block > 1 else [])
    return sum(e * tokens * width for width in reads)


# Autograd frees what a node saved with save_for_backward once backward has run the node, but
# the attributes of a custom Function's ctx live as long as the node, that is as long as anything
# references the step's graph (its output, its loss). bitsandbytes before 0.43.2 keeps
# MatMul4Bit's input as ctx.tensors (bnb_4bit_keeps_input), so every 4-bit linear's input of a
# step outlives that step's backward until its graph is dropped (measured from bitsandbytes' own
# Linear4bit with that line restored: benchmarks/bnb_ctx_retention.py; 0.43.2 and later keep
# nothing). litgpt 0.4.13.dev1 finetune/lora.py fit() (lines 304-308) holds the head's output in
# `logits` and rebinds it only when the next step's model(...) has returned: the previous step's
# inputs are alive through the whole next forward. They are the distinct tensors the linears
# read (zeroplan.core.finetune.activations INPUT_GROUPS), whole now (the attention's own copy of
# o's input was saved with save_for_backward and is gone): the attention norm's output (q, k, v;
# in a one-norm parallel block the MLP reads it too), the attention output (o), the MLP norm's
# output (gate/up, GPT's fc), the MLP's product (down), and the final norm's output, whose
# 128-token slices the 4-bit head (litgpt's lm_head) reads; not the first block's attention
# input, the frozen embedding's output: it needs no gradient, so MatMul4Bit keeps nothing there
# (ctx.needs_input_grad is false for both its operands).
def previous_step_matmul_inputs_bytes(request: PlanRequest) -> int:
    """Bytes of the previous step's 4-bit matmul inputs alive through litgpt's next forward (0
    where bitsandbytes drops them or the framework drops the graph before its next forward)."""
    return sum(previous_step_matmul_inputs_parts(request))


def previous_step_matmul_inputs_parts(request: PlanRequest) -> tuple[int, ...]:
    """previous_step_matmul_inputs_bytes tensor by tensor, block by block, the head's last (what
    the caching-allocator model replays)."""
    if request.training.framework is not Framework.litgpt or not bnb_4bit_keeps_input(request):
        return ()
    model = request.model
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    reads = [model.hidden_size, model.attention_output_size, model.ffn_hidden_size]
    if model.norms_per_block > 1:
        reads.append(model.hidden_size)
    first_block = reads[1:]  # its attention input is the frozen embedding's output
    blocks = [first_block, *([reads] * (model.num_layers - 1))]
    head_input = model.hidden_size
    return (*(e * tokens * width for block in blocks for width in block), e * tokens * head_input)


# DeepSpeed's zero.Init (partition_parameters.py, InsertPostInitMethodToModuleSubClasses: at
# microsoft/DeepSpeed@bf6b9802c, 2023-01-17, lines 399-404; in 0.19.8 _enable_mem_efficient_linear,
# lines 412-419, called from patch_init_and_builtins with zero_optimization.memory_efficient_linear,
# default true) sets torch.nn.functional.linear = zero3_linear_wrap and never puts it back ("This
# will persist unless manually reset"; shutdown_init_context leaves it commented out), so every
# nn.Linear of the process runs LinearFunctionForZeroStage3 from then on, whose forward calls
# ctx.save_for_backward(input, weight, bias) (zero/linear.py: bf6b9802c saves the input and the
# weight's id, 0.19.8 setup_context the input itself) whatever needs a gradient: a frozen base
# linear keeps the input it read once its node is recorded (the input needs a gradient). Hugging
# Face enters zero.Init for from_pretrained under ZeRO-3 (transformers 4.56.2 modeling_utils.py
# get_init_context, lines 4485-4498; accelerate 1.10.1 DeepSpeedPlugin.zero3_init_flag defaults to
# the config being stage 3), but not for a quantized model (the same lines: init_empty_weights
# instead), whose base linears call bitsandbytes' matmul_4bit / matmul, not F.linear, anyway.
# Measured: tests/test_zero3_linear_inputs.py (DeepSpeed 0.19.8's own zero3_linear_wrap on
# transformers' Llama block under peft's LoRA). A model loaded before zero.Init is entered
# (TrainingSpec.model_load full-per-rank) never passes __enter__: the engine partitions it with
# Init(module=...) (zero/parameter_offload.py _convert_to_zero_parameters). Before 0.19.4 that
# constructor converts the parameters without patching anything (v0.8.0
# partition_parameters.py:701-703, v0.13.3 :995-997, v0.19.3 :1100), so F.linear stays torch's;
# from 0.19.4 (DeepSpeed #8189) it calls _enable_mem_efficient_linear itself for a module
# (v0.19.4 partition_parameters.py:1060-1061), so the 0.19.8 the hf profile plans by default
# replaces F.linear under either load.
def zero3_linear_keeps_input(request: PlanRequest) -> bool:
    """Whether every base linear keeps its input under DeepSpeed ZeRO-3's replaced F.linear (hf
    at stage 3 under DeepSpeed's own state convention, the base not quantized, loaded inside
    zero.Init or partitioned by a release whose Init(module=...) replaces F.linear too)."""
    kind = request.strategy.kind
    return (request.training.framework is Framework.hf and kind.zero_stage == 3 and not kind.is_fsdp
            and request.convention is StateConvention.deepspeed
            and not request.training.finetune.quantize.is_quantized
            and (model_load(request) is ModelLoad.sharded or request.training.deepspeed_release in (None, "0.19.8")))


def loaded_inside_zero_init(request: PlanRequest) -> bool:
    """Whether the model's parameters come from zero.Init (hf at DeepSpeed's stage 3 under its own
    state convention, the base not quantized, the sharded load): the engine then finds them
    partitioned, with a ds_id."""
    return zero3_linear_keeps_input(request) and model_load(request) is ModelLoad.sharded


def quantized_base_outputs_fp32(request: PlanRequest) -> bool:
    """Whether a quantized base linear returns fp32 where it reads the fp32 residual stream or
    MLP: hf's QLoRA and int8 bases under prepare_model_for_kbit_training (FineTuneSpec.module_in_bf16),
    whose bitsandbytes linears return their output in their input's dtype."""
    return (request.training.finetune.quantize.is_quantized and request.training.framework is Framework.hf
            and request.runs_under_autocast)


QKV_TARGETS = frozenset({LoraTarget.q, LoraTarget.k, LoraTarget.v})
MLP_IN_TARGETS = frozenset({LoraTarget.gate, LoraTarget.up})


# litgpt 9a1b82b lora.py:426 LoRAQKVLinear.forward, after_A = F.linear(self.lora_dropout(x),
# self.lora_A): litgpt's fused qkv (model.py CausalSelfAttention.attn) takes one adapter whose
# lora_A spans every enabled projection (lora.py:233, r x sum(enable_lora) rows), so one dropout
# and one lora_A read its input however many of q, k and v are enabled; every other litgpt
# adapter (LoRALinear, lora.py:171) and every peft and torchtune adapter drops and multiplies
# its input on its own.
def group_input_readers(request: PlanRequest, group: tuple[LoraTarget, ...]) -> int:
    """How many adapters drop and multiply ``group``'s input apart (group_adapters, a litgpt
    fused q/k/v adapter once)."""
    wrapped = group_adapters(request, group)
    if request.training.framework is Framework.litgpt and wrapped and set(group) <= QKV_TARGETS:
        return 1
    return wrapped


def _group_input_bytes(request: PlanRequest, targets: tuple[LoraTarget, ...], kind: str, kept_anyway: bool) -> int:
    """What is kept of one input the group's linears read, given which of them an adapter wraps
    (and whether another op keeps the input itself regardless)."""
    return sum(_group_input_parts(request, targets, kind, kept_anyway))


def _group_input_parts(request: PlanRequest, targets: tuple[LoraTarget, ...], kind: str,
                       kept_anyway: bool) -> tuple[int, int]:
    """_group_input_bytes in two parts: the input itself (and the base linears' own copies of it),
    and what the adapters keep of their own (dropout masks, dropped or cast copies)."""
    finetune = request.training.finetune
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    width = input_width(request, kind)
    wrapped = group_input_readers(request, targets)
    kept_anyway = input_kept_anyway(request, kept_anyway)
    # The attention output o reads is the fused attention's own kept output (INPUT_GROUPS), so
    # an int8 o keeps no second copy of it, nor a 4-bit o (the input arrives in bf16: no cast).
    # Under the non-reentrant checkpoint a recomputed block's MatMul4Bit and MatMul8bitLt nodes
    # die with the recomputation; what the block keeps is its forward's
    # (checkpoint_escaping_inputs_bytes).
    escapes = bnb_inputs_escape_checkpoint(request)
    int8_kept = 0 if escapes else int8_kept_input_bytes(request)
    shared = e * tokens * width if kept_anyway else int8_kept * tokens * width
    own = 0  # bytes of the copies each base linear makes of the input and keeps
    if bnb_4bit_keeps_input(request) and not kept_anyway and not escapes:
        if quantized_base_outputs_fp32(request):
            own = len(base_modules(request, targets)) * e * tokens * width
        else:
            shared = e * tokens * width
    if zero3_linear_keeps_input(request):
        shared = max(shared, e * tokens * width)
    if not wrapped or adapters_keep_no_input(request):
        return shared + own, 0
    copies = group_adapters_copy_input(request, kind)
    a = adapter_matmul_bytes(request)
    if finetune.lora_dropout > 0:
        # peft lora_dropout[adapter] and torchtune LoRALinear.dropout are one nn.Dropout per
        # adapter: each keeps its mask, and lora_a its dropped input (adapter_matmul_bytes: under
        # hf's DDP autocast's bf16 copy of the dropped fp32 input, fp32 where adapters_stay_fp32).
        mask = dropout_mask_bytes(request, FP32_BYTES if copies else e)
        return shared + own, wrapped * (a + mask) * tokens * width
    if copies:
        return shared + own, wrapped * a * tokens * width
    return own + max(shared, e * tokens * width), 0


# litgpt 9a1b82b model.py:200-206 Block.forward: with parallel_residual and shared_attention_norm (Phi-2,
# Falcon: ModelSpec.parallel_block) the MLP reads norm_1's output, the tensor q/k/v read; the
# full fine-tune keeps it once (zeroplan.core.activations layer_terms: no mlp_input). Under LoRA
# it is kept once if any reader keeps it (a 4-bit base before bitsandbytes 0.43.2, an adapter
# without dropout), and nothing of it is kept where every reader is a frozen bf16 linear (its
# matmul keeps only the weight) or a dropout adapter (which keeps its own mask and dropped copy).
# Measured: benchmarks/lora-litgpt-records (Phi-2). transformers 4.56.2 models/phi/modeling_phi.py
# PhiDecoderLayer.forward (and models/gptj/modeling_gptj.py GPTJBlock.forward) pass the one
# input_layernorm output to self_attn and to self.mlp alike, so under the hf profile too the MLP's
# input is q/k/v's and is not subtracted a second time (measured on peft's LoRA over
# PhiDecoderLayer: tests/test_hf_activation.py).
def mlp_reads_attention_input(request: PlanRequest) -> bool:
    """Whether the block's MLP reads the very tensor its q/k/v read (one norm, parallel block)."""
    return request.model.parallel_block


# litgpt 9a1b82b lora.py:330 (LoRAQKVLinear.zero_pad returns lora_B's output as it is where q, k
# and v are all enabled) and :342-347 (else it scatters it into new zeros of the fused width with
# index_copy_, whose backward keeps its source: the [b, s, sum of the enabled widths] output of
# lora_B, lora.py:430). Measured: benchmarks/lora-litgpt-records (Llama 3.2 1B, q and v).
def litgpt_qkv_zero_pad_bytes(request: PlanRequest) -> int:
    """Bytes litgpt's fused q/k/v adapter keeps when it scatters lora_B's output (0 elsewhere)."""
    training = request.training
    if training.framework is not Framework.litgpt or not training.finetune.is_lora:
        return 0
    targets = set(training.finetune.targets(training.framework)) & QKV_TARGETS
    if not targets or targets == QKV_TARGETS or adapters_keep_no_input(request):
        return 0
    width = sum(_output_width(request, target) for target in targets)
    return training.precision.compute_bytes * request.batch.seq_len * request.batch.micro_batch_size * width


def lora_layer_delta_bytes(request: PlanRequest, norm_savings_bytes: int = 0) -> int:
    """Bytes one block keeps under LoRA less what the same block keeps in a full fine-tune (0
    unless the request trains adapters); ``norm_savings_bytes``: what the framework's norm
    keeps less than zeroplan.core.activations.norm_bytes in a full fine-tune (HF's bf16 module:
    zeroplan.core.frameworks.hf_bf16_norm_savings_bytes)."""
    if not request.training.finetune.is_lora:
        return 0
    return _lora_delta_bytes(request, norm_savings_bytes, BLOCK_TARGETS, request.model.norms_per_block)


BLOCK_TARGETS = frozenset(LoraTarget) - {LoraTarget.output}
"""The adapters inside a decoder block (the LM head's, LoraTarget.output, is outside)."""

AFTER_ATTENTION_TARGETS = frozenset({LoraTarget.o, LoraTarget.gate, LoraTarget.up, LoraTarget.down})
"""The block's linears that run after the attention core (its output projection and the MLP)."""


# The part of lora_layer_delta_bytes that the block's tensors saved after its attention core
# make: the groups of INPUT_GROUPS read there (o, gate/up, down), their adapters, the MLP's fp32
# outputs under hf's QLoRA and the norms after the first (the pre-attention one runs before it).
# What a block's backward has freed by the time it reaches the attention core (zeroplan.core.
# hf_eager_backward) is the full fine-tune's tensors there plus this.
def lora_after_attention_delta_bytes(request: PlanRequest, norm_savings_bytes: int = 0) -> int:
    """lora_layer_delta_bytes' share from the tensors a block saves after its attention core."""
    if not request.training.finetune.is_lora:
        return 0
    return _lora_delta_bytes(request, norm_savings_bytes, AFTER_ATTENTION_TARGETS, request.model.norms_per_block - 1)


def _lora_delta_bytes(request: PlanRequest, norm_savings_bytes: int, within: frozenset[LoraTarget], norms: int) -> int:
    """lora_layer_delta_bytes over the input groups and adapters of the linears ``within`` and
    ``norms`` of the block's norms."""
    finetune = request.training.finetune
    training = request.training
    e = training.precision.compute_bytes
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    tokens = s * b
    adapters = lora_adapters(finetune, request.model, training.framework)
    delta = 0
    # Full fine-tune: one copy of each input, kept by the linears that read it (layer_terms'
    # qkv_input, output_projection_input, mlp_input, and the product inside mlp_inner).
    reads_attention_input = mlp_reads_attention_input(request)
    shared_norm = reads_attention_input and within.issuperset(QKV_TARGETS | MLP_IN_TARGETS)
    for group, kind, kept_anyway in INPUT_GROUPS:
        if not within.issuperset(group):
            continue
        width = input_width(request, kind)
        if shared_norm and set(group) <= MLP_IN_TARGETS:
            continue  # counted with q/k/v's (mlp_reads_attention_input)
        if reads_attention_input and set(group) <= MLP_IN_TARGETS:
            # Without q/k/v among ``within`` (the share after the attention core): the input is
            # q/k/v's, saved before the core; only the MLP's own adapters' tensors are its.
            delta += _group_input_parts(request, group, kind, kept_anyway)[1]
            continue
        if shared_norm and set(group) <= QKV_TARGETS:
            kept, own = _group_input_parts(request, group, kind, kept_anyway)
            mlp_kept, mlp_own = _group_input_parts(request, (LoraTarget.gate, LoraTarget.up), "hidden", False)
            delta += max(kept, mlp_kept) + own + mlp_own - e * tokens * width
            continue
        delta += _group_input_bytes(request, group, kind, kept_anyway) - e * tokens * width
    if within.issuperset(QKV_TARGETS):
        delta += litgpt_qkv_zero_pad_bytes(request)
    # bitsandbytes 0.50.2 nn/modules.py Linear4bit.forward casts its output back to its input's
    # dtype, and MatMul8bitLt returns its product in its input's dtype: under hf's QLoRA the
    # residual stream is fp32 (FineTuneSpec.module_in_bf16), so the gate and up outputs and
    # SiLU's, which the MLP keeps, are fp32 (measured: the hf QLoRA and int8 block records'
    # three [b, s, f] fp32 saved tensors).
    if quantized_base_outputs_fp32(request) and LoraTarget.gate in within:
        delta += 3 * (FP32_BYTES - e) * tokens * request.model.ffn_hidden_size
    # auto-gptq's torch path keeps each base linear's dequantized fp16 weight (gptq_saved_weight_bytes).
    delta += gptq_saved_weight_bytes(request, within)
    # Each adapter's B keeps A's r-wide output (adapter_matmul_bytes): one for a fused module.
    # VeRA and LoRA-FA: what their adapters keep instead (variant_kept_bytes).
    if finetune.vera or finetune.lora_fa:
        delta += sum(variant_kept_bytes(request, module) for module in adapters if all(t in within for t in module))
    else:
        delta += sum(adapter_matmul_bytes(request) * tokens * finetune.lora_rank for module in adapters
                     if all(t in within for t in module))
    dora = dora_kept_bytes(request, within)
    whole_norms = frozen_norms_delta(request, norm_savings_bytes)
    return delta + dora + whole_norms * norms // max(1, request.model.norms_per_block)


# Without a trainable matrix in front of it an adapter keeps nothing of its input: peft 51c2ff6
# optimizers/lorafa.py:241-243 freezes lora_A (F.linear keeps its input only for the weight's
# gradient), and tuners/vera/layer.py:280-285 multiplies the input by the frozen buffer vera_A
# first. Both run only under hf's plain DDP without autocast (zeroplan.specs.finetune.
# check_adapter_variant_training), where LoRA's adapters each keep their own copy.
def adapters_keep_no_input(request: PlanRequest) -> bool:
    """Whether the adapters keep nothing of the input they read (LoRA-FA, VeRA)."""
    finetune = request.training.finetune
    return finetune.vera or finetune.lora_fa


VARIANT_KEPT_ELEMENT_BYTES = FP32_BYTES
"""Bytes per element of what a VeRA or LoRA-FA adapter keeps: peft's fp32 adapters
(get_peft_model's autocast_adapter_dtype; tuners/tuners_utils.py:2243-2288 cast_adapter_dtype)
make the input fp32 before they multiply it (_cast_input_dtype, tuners_utils.py:1777-1792), and
no autocast casts a product back (check_adapter_variant_training)."""


# What each adapter of ``module`` keeps for backward, read from peft 51c2ff6 and measured on its
# own modules (tests/test_peft_variants.py: a bf16 Llama under get_peft_model on the CPU):
# - LoRA-FA (lora/layer.py Linear.forward, lora_A frozen): lora_B keeps its input, lora_A's r-wide
#   fp32 output.
# - VeRA (vera/layer.py:285, result + lambda_b * F.linear(lambda_d * F.linear(x, sliced_A),
#   sliced_B)): lambda_d's product keeps its other factor, the r-wide x A^T, for lambda_d's
#   gradient; F.linear with the frozen sliced_B keeps only the buffer (its input needs no
#   weight gradient); lambda_b's product keeps the out-wide (lambda_d x A^T) B^T for lambda_b's.
#   Both fp32; the sliced buffers are views of vera_A and vera_B, nothing new.
def variant_kept_bytes(request: PlanRequest, module: tuple[LoraTarget, ...]) -> int:
    """Bytes one VeRA or LoRA-FA adapter over ``module`` (its projections together) keeps."""
    finetune = request.training.finetune
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    width = finetune.lora_rank
    if finetune.vera:
        width += sum(_output_width(request, target) for target in module)
    return VARIANT_KEPT_ELEMENT_BYTES * tokens * width


def _dora_linears(request: PlanRequest) -> list[tuple[LoraTarget, int, int]]:
    """(first target, in, out) of the block linears DoRA wraps (none without DoRA); a fused
    module is one linear whose output is its projections' together."""
    finetune = request.training.finetune
    if not finetune.dora:
        return []
    widths = {LoraTarget.q: "hidden", LoraTarget.k: "hidden", LoraTarget.v: "hidden", LoraTarget.o: "attention",
              LoraTarget.gate: "hidden", LoraTarget.up: "hidden", LoraTarget.down: "ffn"}
    return [(module[0], input_width(request, widths[module[0]]), sum(_output_width(request, t) for t in module))
            for module in lora_adapters(finetune, request.model, request.training.framework) if module[0] in widths]


def _adapter_bytes(request: PlanRequest) -> int:
    """Bytes of an element of the adapters' weights and of the input they see (peft casts the
    input to the adapters' dtype: fp32 where adapters_copy_their_input)."""
    return FP32_BYTES if adapters_copy_their_input(request) else request.training.precision.compute_bytes


# DoRA (Liu et al. 2024, eq. 5 with the norm detached as sec. 4.3 suggests; peft 0.17.1
# tuners/lora/dora.py DoraLinearLayer.forward, torchtune 0.6.1 modules/peft/dora.py
# DoRALinear.forward): out = (m/||W+sBA|| - 1) * base_out + m/||W+sBA|| * lora_out * s. Each of
# the two products keeps its [tokens, out] operand, base_out and lora_out, in the compute dtype;
# the division keeps the norm, and the products the two out-wide scales, in the adapters' dtype.
def dora_kept_bytes(request: PlanRequest, within: frozenset[LoraTarget] = frozenset(LoraTarget)) -> int:
    """What DoRA adds to what one LoRA block keeps (0 without DoRA), over the linears ``within``."""
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return sum((_base_output_bytes(request, target) + e) * tokens * out + 3 * _adapter_bytes(request) * out
               for target, _, out in _dora_linears(request) if target in within)


# bitsandbytes 0.50.2 Linear4bit.forward returns its output in its input's dtype: under hf's
# QLoRA the base output DoRA keeps is fp32 wherever the linear reads the fp32 residual stream or
# MLP (FineTuneSpec.module_in_bf16), bf16 for o, which reads the attention's bf16 output
# (measured: the hf QDoRA block record keeps the q, k, v, gate, up and down base outputs in fp32,
# o's in bf16, every adapter output in bf16).
def _base_output_bytes(request: PlanRequest, target: LoraTarget) -> int:
    """Bytes of an element of a DoRA linear's base output."""
    if quantized_base_outputs_fp32(request) and target is not LoraTarget.o:
        return FP32_BYTES
    return request.training.precision.compute_bytes


# The weight norm is computed anew in every forward (the same sources): lora_b(lora_a(eye)) over
# an in x in identity in the input's dtype (autocast casts it to bf16 for lora_a's matmul where
# the adapters are fp32; lora_a keeps that copy), its r- and out-wide outputs, the frozen weight
# cast to the input's dtype (a copy where their dtypes differ), s * BA and W + s * BA: alive
# together until the layer returns, in its forward and in a recomputing backward's rerun, beside
# peft's fp32 copy of the layer's input where the adapters are fp32 (_cast_input_dtype).
def dora_weight_norm_bytes(request: PlanRequest) -> int:
    """The largest DoRA layer's weight-norm temporaries (0 without DoRA)."""
    linears = _dora_linears(request)
    if not linears:
        return 0
    e = request.training.precision.compute_bytes
    x = _adapter_bytes(request)
    r = request.training.finetune.lora_rank
    weight = FP32_BYTES if request.training.finetune.base_dtype is BaseDtype.fp32 and adapters_copy_their_input(request) else e
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    quantized = request.training.finetune.quantize.is_quantized

    def temporaries(fan_in: int, fan_out: int) -> int:
        input_copy = x * tokens * fan_in if x != e else 0
        identity = input_copy + x * fan_in * fan_in + (e * fan_in * fan_in if x != e else 0)
        lora_weight = e * fan_in * r + e * fan_in * fan_out
        # Over an NF4 base (torchtune's QDoRA) the cast is a dequantization, whose own peak comes
        # before s * BA and W + s * BA exist.
        cast_weight = x * fan_in * fan_out if weight != x or quantized else 0
        norm = cast_weight + e * fan_in * fan_out + max(x, e) * fan_in * fan_out
        if quantized:
            norm = max(norm, nf4_dequantize_copies(request) * e * fan_in * fan_out)
        return identity + lora_weight + norm

    return max(temporaries(fan_in, fan_out) for _, fan_in, fan_out in linears)


# A frozen RMSNorm weight: the composite norm keeps only its fp32 input (and a per-token rsqrt),
# not the normalised tensor it scales (what the fused CUDA kernel keeps does not depend on the
# weight).
def frozen_norms_delta(request: PlanRequest, norm_savings_bytes: int) -> int:
    """What a block's norms keep with frozen weights, less with trained ones."""
    model, training = request.model, request.training
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    if model.norm is not NormKind.rmsnorm or not rms_norm_is_composite(training, autocast=request.runs_under_autocast):
        return 0
    full = norm_bytes(model, training, s, b, autocast=request.runs_under_autocast) - norm_savings_bytes
    return model.norms_per_block * (FP32_BYTES * s * b * model.hidden_size - full)


# QLoRA's frozen weights are dequantized for each use and freed after it (torchtune 0.6.1
# modules/low_precision/nf4_linear.py _LinearNF4: F.linear(input, weight.to(input.dtype)) in
# forward, grad_output @ weight.to(grad_output.dtype) in backward; bitsandbytes
# autograd/_functions.py MatMul4Bit: dequantize_4bit(B, quant_state) in both): the largest
# quantized weight in the compute dtype is alive at once beside a block's backward.
def dequantized_weight_bytes(request: PlanRequest) -> int:
    """What dequantizing the largest quantized weight holds at its peak (0 without
    quantization): one copy in the compute dtype, or torchao's NF4 steps (TORCHAO_NF4_DEQUANTIZE_COPIES),
    or (int8) one copy in the dtype of the input it multiplies, or (gptq-int4, in a block's forward
    and its recomputation) auto-gptq's unpacking above the fp16 weight it leaves."""
    quantize = request.training.finetune.quantize
    if not quantize.is_quantized:
        return 0
    if quantize is Quantization.gptq_int4:
        # The fp16 weight the dequantization leaves is the block's own (gptq_saved_weight_bytes).
        return max((gptq_dequantize_peak_bytes(request, fan_in, fan_out) - 2 * fan_in * fan_out
                    for _, fan_in, fan_out in gptq_linears(request)), default=0)
    if quantize is Quantization.int8:
        # MatMul8bitLt.backward: state.CB.to(ctx.dtype_A, copy=True).mul_(SCB / 127), the whole
        # weight in the input's dtype (int8_kept_input_bytes), for grad_output @ W.
        return largest_quantized_elements(request) * int8_kept_input_bytes(request)
    if request.training.framework is Framework.litgpt:
        return largest_quantized_elements(request) * litgpt_dequantized_element_bytes(request)
    if request.training.framework is Framework.torchtune and request.training.compile:
        # Compiled, the backward dequantizes nothing: it reads the bf16 weights the forward wrote
        # (COMPILED_NF4_DEQUANTIZE_COPIES), which the block keeps (zeroplan.core.compiled
        # compiled_lora_delta_bytes) or its recomputation rebuilds (the recompute term).
        return 0
    if bnb_dequantizes_via_fp16(request):
        return largest_quantized_elements(request) * litgpt_dequantized_element_bytes(request)
    return largest_quantized_elements(request) * request.training.precision.compute_bytes * nf4_dequantize_copies(request)


# auto-gptq 0.4.2 nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.forward at 4 bits (the
# module GPTQConfig(bits=4, disable_exllama=True) loads where desc_act is false), at or above
# kernel_switch_threshold rows (zeroplan.specs.finetune.GPTQ_CUDA_KERNEL_TOKENS; below it the
# CUDA kernel, refused) runs torch ops that autograd records:
#   lines 231-235: zeros, an int32 shift of qzeros (4 bytes per group x out), cast to int8, plus 1;
#   line 240: weight = (qweight >> wf).to(int8): the shift's int32 result, 4 bytes an element of
#             the in x out weight, beside its int8 cast, 1 byte an element;
#   line 266: weight = scales * (weight - zeros): the int8 weight, the int8 difference and the
#             fp16 product (4 bytes an element together);
#   line 269: out = torch.matmul(x.half(), weight): x is fp16 already under DeepSpeed's fp16 module.
# The weight needs no gradient and x does, so the matmul keeps the fp16 weight (mm saves mat2 for
# self's gradient: torch tools/autograd/derivatives.yaml) and nothing of x, until its backward,
# which dequantizes nothing. Measured with auto-gptq's own module on CPU:
# benchmarks/gptq_quantlinear_memory.py.
GPTQ_UNPACK_BYTES_PER_ELEMENT = 4 + 1
"""Bytes an element of a weight that line 240's unpacking holds at once (int32 shift, int8 cast)."""


def gptq_linears(request: PlanRequest) -> list[tuple[tuple[LoraTarget, ...], int, int]]:
    """(projections, in, out) of each QuantLinear of a decoder block: one per linear module of
    the framework's model (a fused q/k/v module is one: zeroplan.specs.finetune.linear_modules);
    none unless the base is gptq-int4."""
    if request.training.finetune.quantize is not Quantization.gptq_int4:
        return []
    model = request.model
    targets = [LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o, LoraTarget.gate, LoraTarget.up, LoraTarget.down]
    if not model.mlp.gated:
        targets = [LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o, LoraTarget.up, LoraTarget.down]
    widths = {LoraTarget.q: "hidden", LoraTarget.k: "hidden", LoraTarget.v: "hidden", LoraTarget.o: "attention",
              LoraTarget.gate: "hidden", LoraTarget.up: "hidden", LoraTarget.down: "ffn"}
    return [(module, input_width(request, widths[module[0]]), sum(_output_width(request, t) for t in module))
            for module in linear_modules(tuple(targets), model, request.training.framework)]


def gptq_saved_weight_bytes(request: PlanRequest, within: frozenset[LoraTarget] = frozenset(LoraTarget)) -> int:
    """The fp16 dequantized weights one block's gptq-int4 linears ``within`` keep for backward."""
    fp16 = 2
    return sum(fp16 * fan_in * fan_out for module, fan_in, fan_out in gptq_linears(request)
               if all(t in within for t in module))


def gptq_dequantize_peak_bytes(request: PlanRequest, fan_in: int, fan_out: int) -> int:
    """What dequantizing one in x out gptq-int4 weight holds at its peak (line 240, the group
    zero points beside it); the fp16 weight it leaves is gptq_saved_weight_bytes'."""
    groups = -(-fan_in // request.training.finetune.gptq_group_size)
    return GPTQ_UNPACK_BYTES_PER_ELEMENT * fan_in * fan_out + groups * fan_out


# bitsandbytes 0.39.0 to 0.42.0 nn/modules.py Params4bit.cuda quantizes
# `self.data.contiguous().half().cuda(device)`, so quantize_4bit records quant_state.dtype fp16
# and every MatMul4Bit dequantize_4bit(B, quant_state).to(A.dtype) writes an fp16 weight, then
# its copy in the input's dtype; 0.43.0's Params4bit._quantize (commit dcfb6f8, #970, FSDP
# support) moves `self.data.contiguous()` as loaded, so a bf16 base dequantizes to bf16 once.
def bnb_dequantizes_via_fp16(request: PlanRequest) -> bool:
    """Whether a bitsandbytes nf4 base (hf, zeroplan) was quantized from an fp16 copy."""
    from zeroplan.specs.finetune import BNB_4BIT_KEEPS_SOURCE_DTYPE, version_tuple

    finetune = request.training.finetune
    return (finetune.quantize is Quantization.nf4 and request.training.framework in (Framework.hf, Framework.zeroplan)
            and version_tuple(finetune.bitsandbytes_version) < BNB_4BIT_KEEPS_SOURCE_DTYPE)


# lightning 2.4 fabric/plugins/precision/bitsandbytes.py _Linear4bit.quantize (litgpt's
# bnb.nf4): w = weight.to(dtype=torch.half) before quantize_4bit, so quant_state.dtype is fp16;
# bitsandbytes' MatMul4Bit (autograd/_functions.py) runs dequantize_4bit(B, quant_state)
# .to(A.dtype): an fp16 weight, then its copy in the input's dtype (none under fp16), both alive
# while the cast runs.
def litgpt_dequantized_element_bytes(request: PlanRequest) -> int:
    """Bytes per element of a weight litgpt's 4-bit linear dequantizes at its peak."""
    fp16 = 2
    return fp16 + (0 if request.training.precision is Precision.fp16_mixed else request.training.precision.compute_bytes)


# torchao 0.14.1 dtypes/nf4tensor.py NF4Tensor.get_original_weight (what torchtune's NF4 weights
# run for .to(dtype) and linear_nf4): for N elements it holds the two int64 index tensors of the
# unpacked halves (4N bytes each), their looked-up bf16 values (N each), the scaled halves (N
# each) and the stacked result (2N) at once: 14N bytes, 7 copies of the bf16 weight (measured:
# the QDoRA block's forward peak is 5 such copies above DoRA's, whose weight needs no cast).
# bitsandbytes' dequantize_4bit is one kernel writing the weight once.
TORCHAO_NF4_DEQUANTIZE_COPIES = 7


# Compiled (torchtune's recipes compile each decoder layer), inductor fuses get_original_weight's
# unpacking, lookup and scaling into the kernel that writes the bf16 weight: the generated
# forward of torchtune 0.6.1's FrozenNF4Linear allocates one weight-sized bf16 buffer, which it
# saves for the backward, and the generated backward none (measured from inductor's CPU code:
# benchmarks/compiled_nf4_dequantize.py).
COMPILED_NF4_DEQUANTIZE_COPIES = 1


def nf4_dequantize_copies(request: PlanRequest) -> int:
    """Compute-dtype copies of a weight its dequantization holds at its peak."""
    if request.training.framework is not Framework.torchtune:
        return 1
    return COMPILED_NF4_DEQUANTIZE_COPIES if request.training.compile else TORCHAO_NF4_DEQUANTIZE_COPIES


def largest_quantized_elements(request: PlanRequest) -> int:
    from zeroplan.core.parallel.units import rank_parameter_units

    return max((t.numel for unit in rank_parameter_units(request) for t in unit.tensors if t.quantized), default=0)


# A full fine-tune with its first K blocks frozen (FineTuneSpec.frozen_blocks). With the
# embedding frozen too, nothing below block K needs a gradient: no autograd graph is recorded
# there (autograd records an op only when an input requires a gradient) and those blocks keep
# nothing, checkpointed or not. With the embedding training, the frozen blocks still pass the
# input's gradient down: they keep what a block without any adapter keeps under LoRA (no linear
# input, frozen norm weights), lora_layer_delta_bytes' rules with no target.
def frozen_blocks_kept_bytes(request: PlanRequest, layer_bytes: int, block_input_bytes: int,
                             norm_savings_bytes: int = 0) -> tuple[int, int]:
    """What one frozen block keeps without recomputation and under full recomputation, given
    what a trained block keeps in each (``norm_savings_bytes`` as in lora_layer_delta_bytes)."""
    if request.training.finetune.freeze_embeddings:
        return 0, 0
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    inputs = sum(e * tokens * input_width(request, kind) for group, kind, kept_anyway in INPUT_GROUPS
                 if not input_kept_anyway(request, kept_anyway)
                 and not (mlp_reads_attention_input(request) and set(group) <= MLP_IN_TARGETS))
    # Where o reads a copy of SDPA's output (zeroplan.core.hf_rotary_cat; a full fine-tune's
    # trained block keeps it), a frozen o keeps nothing of it (measured on a frozen
    # PhiDecoderLayer: tests/test_hf_activation.py).
    inputs += rotary_cat_output_copy_bytes(request)
    return layer_bytes - inputs + frozen_norms_delta(request, norm_savings_bytes), block_input_bytes
