"""What a compiled decoder block keeps for backward (torch.compile, optionally float8).

Under torch.compile, AOTAutograd traces each block's forward and backward as one graph and
inductor's partitioner (torch 2.13 torch/_inductor/compile_fx.py hands
torch/_functorch/partitioners.py min_cut_rematerialization_partition to aot_autograd) picks the
forward values the backward reads: the matmul and attention outputs it cannot recompute
cheaply, and the inputs of the pointwise chains it recomputes (norms, SiLU, RoPE, casts). The
values below are those the partitioner saved for each framework's own Llama block on fake
tensors (benchmarks/compiled-records, zeroplan/frameworks/compiled.py; docs/compile-float8.md),
written as the shapes they have; nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.profiles import profile, torchtitan_compiles_loss
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import LoraTarget, Quantization, lora_adapters
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import GpuSpec
from zeroplan.specs.model import ModelSpec, PositionKind
from zeroplan.specs.parallel import ParallelSpec, ulysses_runs_checkpointing
from zeroplan.specs.request import PlanRequest, check_float8_compiled, check_float8_gpu, compiled_policy_measured
from zeroplan.specs.training import ActivationCheckpointing, Float8Recipe, Precision, TrainingSpec
from zeroplan.units import FP32_BYTES, even_split

COMPILED_POLICIES = {
    Framework.torchtitan: (ActivationCheckpointing.none, ActivationCheckpointing.full, ActivationCheckpointing.selective_op),
    Framework.torchtune: (ActivationCheckpointing.none, ActivationCheckpointing.full),
    # transformers 4.56.2 GradientCheckpointingLayer checkpoints outside the compiled forward,
    # which then runs under no_grad: a compiled block under full recomputation is not what the
    # partitioner decides, and was not measured.
    Framework.hf: (ActivationCheckpointing.none,),
    # litgpt's GPT compiled whole (litgpt_compiled_layer_bytes), measured without checkpointing,
    # as lightning-thunder's benchmark_litgpt.py runs it by default (checkpoint_activations False).
    Framework.litgpt: (ActivationCheckpointing.none,),
}
"""Framework -> checkpointing policies whose compiled blocks were measured
(benchmarks/compiled-records)."""


def runs_checkpointing(training: TrainingSpec, policy: ActivationCheckpointing, parallel: ParallelSpec | None = None) -> bool:
    """Whether ``policy`` is modelled for the training's compile setting (every policy eager),
    under ``parallel``'s layout when given."""
    if parallel is not None and not compiled_policy_measured(training, policy, parallel):
        return False
    if parallel is not None and not ulysses_runs_checkpointing(parallel, training.framework, policy):
        return False
    return not training.compile or policy in COMPILED_POLICIES.get(training.framework, ())


# llm-foundry b2a43a14 scripts/train/benchmarking/submit_benchmarks.py: amp_fp8 on h100_80gb sets
# the MPT model's fc_type 'te' (llm-foundry v0.3.0 llmfoundry/models/layers/fc.py: te.Linear), an
# eager model under Composer's FSDP1 (no compile option); TransformerEngine's own modules run in
# zeroplan's reference transformer's place. Its memory is not modelled (Float8Recipe.te_delayed):
# the parts that would change it (torchtitan's compiled float8 block, the FSDP float8 all-gather)
# are refused rather than mixed with it.
def check_transformer_engine_float8(training: TrainingSpec, model: ModelSpec) -> None:
    """Refuse, in one line naming the field, TransformerEngine float8 outside what it models."""
    if training.framework is not Framework.zeroplan:
        raise ZeroplanError("float8", f"te-delayed is TransformerEngine's te.Linear as llm-foundry runs it, not "
                            f"{training.framework.value}'s (allowed only with framework zeroplan; torchtitan: rowwise, "
                            "tensorwise)")
    if training.compile:
        raise ZeroplanError("float8", "te-delayed is modelled eager, as llm-foundry runs it (allowed: without compile)")
    if training.float8_skips_output:
        raise ZeroplanError("float8", "te-delayed never converts the output projection (llm-foundry's head is not a "
                            "te.Linear); float8_skips_output is torchtitan's filter_fqns (allowed: without it)")
    if training.activation_checkpointing not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        # zeroplan.core.float8_time.transformer_engine_cast_bytes counts what full recomputes.
        raise ZeroplanError("float8", f"te-delayed is timed with activation checkpointing none or full, not "
                            f"{training.activation_checkpointing.value!r} (allowed: none, full)")
    if model.is_moe:
        raise ZeroplanError("float8", "te-delayed is timed for dense models, as llm-foundry's MPT rows ran (allowed: "
                            "a dense model)")


def check_compiled(training: TrainingSpec, model: ModelSpec, gpu: GpuSpec | None = None) -> None:
    """Refuse, in one line naming the field, a compiled or float8 run that was not measured (or,
    given the GPU, float8 on one without float8 matmuls)."""
    check_float8_gpu(training, gpu)
    if (training.float8_all_gather or training.float8_skips_output) and training.float8 is None:
        raise ZeroplanError("float8", "float8_all_gather and float8_skips_output need float8 training (allowed: with a "
                            "float8 recipe)")
    if training.float8_all_gather and training.float8 is not Float8Recipe.tensorwise:
        # torchao float8/config.py Float8LinearConfig.__post_init__: the float8 all-gather needs
        # dynamic tensorwise scaling of the weight.
        raise ZeroplanError("float8", f"the FSDP float8 all-gather needs the tensorwise recipe, not "
                            f"{training.float8.value} (allowed: tensorwise)")
    if training.float8 is Float8Recipe.te_delayed:
        check_transformer_engine_float8(training, model)
    elif training.float8 is not None:
        if training.framework is not Framework.torchtitan:
            raise ZeroplanError("float8", f"float8 training is torchtitan's converter, not {training.framework.value}'s "
                                "(allowed only with framework torchtitan)")
        check_float8_compiled(training)
    if not training.compile:
        return
    if training.framework not in COMPILED_POLICIES:
        allowed = ", ".join(f.value for f in COMPILED_POLICIES)
        raise ZeroplanError("compile", f"compiled blocks were measured for the frameworks' own code, not {training.framework.value}'s "
                            f"(allowed only with framework {allowed})")
    policies = COMPILED_POLICIES[training.framework]
    if training.activation_checkpointing not in policies:
        allowed = ", ".join(p.value for p in policies)
        raise ZeroplanError("compile", f"with {training.framework.value} and activation checkpointing "
                            f"{training.activation_checkpointing.value!r} was not measured (allowed: {allowed})")
    # Activation offloading (torchtune's, full checkpointing only) is modelled compiled: with
    # every layer compiled as torchtune's compile_model does, OffloadActivations moves exactly
    # the bytes it moves eager (the block inputs; benchmarks/compiled-parallel-records/offload,
    # a full fine-tune and torchtune's LoRA and QLoRA), and the block its backward recomputes is
    # the compiled one (compiled_layer_bytes, the LoRA block's delta included).
    if not compiled_finetune_measured(training):
        raise ZeroplanError("finetune", "is not modelled compiled: no compiled run of it was measured (allowed without "
                                        "compile, torchtune's LoRA/QLoRA without dropout or DoRA, or hf's LoRA over a "
                                        "bf16 base under bf16-mixed without dropout, DoRA or quantization)")
    if training.framework is Framework.litgpt:
        if training.precision is not Precision.bf16_pure:
            # The records build the GPT cast to bf16 (benchmark_litgpt.py init_model, litgpt's
            # bf16-true): an fp32 module under autocast (bf16-mixed) is another graph.
            raise ZeroplanError("compile", f"litgpt's whole-model compile was measured on the module cast to bf16, not "
                                f"{training.precision.value} (allowed: bf16-pure)")
        reason = litgpt_compiled_unmeasured(model)
        if reason:
            raise ZeroplanError("compile", f"{model.name!r} has {reason}; litgpt's whole-model compile was measured for "
                                "litgpt's default GPT-NeoX block only")
        return
    if not model.is_dense_llama_layout:
        raise ZeroplanError("compile", f"{model.name!r}: compiled blocks were measured for dense Llama-layout models "
                            "(RoPE, RMSNorm, SwiGLU, no biases) only")


# benchmarks/compiled-finetune-records: torchtune 0.6.1's LoRA and QLoRA blocks compiled as its
# recipes compile each layer (zeroplan/frameworks/compiled.py with a FineTuneSpec), lora_dropout 0
# as its configs ship; peft 0.17.1's LoRA over transformers' bf16 LlamaDecoderLayer under the
# Trainer's bf16 autocast (bf16-mixed; the data-parallel layout it runs in:
# zeroplan.specs.request.check_compiled_strategy). Not compiled: DoRA, dropout, peft's adapters
# without autocast (fp32 matmuls) and bitsandbytes' quantized bases.
def compiled_finetune_measured(training: TrainingSpec) -> bool:
    """Whether the training's fine-tune (or a full one) was measured compiled."""
    finetune = training.finetune
    if finetune.trains_everything:
        return True
    if not finetune.is_lora or finetune.dora or finetune.lora_dropout != 0:
        return False
    if training.framework is Framework.hf:
        return (training.precision is Precision.bf16_mixed and finetune.loads_base_in_bf16
                and not finetune.quantize.is_quantized)
    return training.framework is Framework.torchtune


def _kv_width(request: PlanRequest) -> int:
    # torchtune 0.6.1 modules/attention.py expands K and V to the query heads before SDPA, and
    # the compiled block saves the expanded copies (zeroplan.core.frameworks.expanded_kv_extra_bytes).
    model = request.model
    return model.q_size if profile(request.training.framework).expands_kv_heads else model.kv_size


# The compiled Llama block's saved values (benchmarks/compiled-records, ac=none, all three
# frameworks): its input x; the attention norm's output (the QKV matmuls' input); Q and K after
# RoPE and V; the attention output and its fp32 log-sum-exp (one per head and token); the output
# projection's result (with x it rebuilds the residual sum the MLP norm recomputes); the MLP
# norm's output; the gate and up projections' outputs and their gated product (the down
# projection's input); and each norm's fp32 per-token rsqrt. Everything else is recomputed.
# Llama-3.1-8B at s 4096, b 1: 570,982,400 bytes (hf) and 621,314,048 (torchtune, K and V expanded),
# to the byte; torchtitan adds its position-gathered RoPE cache (torchtitan_rope_cache_bytes).
def compiled_layer_bytes(request: PlanRequest) -> int:
    """One compiled block's saved bytes without recomputation."""
    model = request.model
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    h, q, kv, f = model.hidden_size, model.q_size, _kv_width(request), model.ffn_hidden_size
    if request.training.float8 is not None and not float8_keeps_matmul_inputs(request.training):
        # torchao 0.14.1 Float8Linear under compile: the partitioner keeps the matmul outputs but
        # recomputes every float8 matmul input (both norms' outputs and the gated product) from
        # the values above, so those three are not kept (tensorwise and rowwise; records with float8).
        widths = 2 * h + 2 * q + 2 * kv + 2 * f
    else:
        widths = 4 * h + 2 * q + 2 * kv + 3 * f
    statistics = FP32_BYTES * tokens * model.num_heads + 2 * FP32_BYTES * tokens
    return e * tokens * widths + statistics + compiled_lora_delta_bytes(request)


# torchao's rowwise_with_gw_hp (Float8Recipe.rowwise_with_gw_hp) computes each weight's gradient in
# bf16 from the saved high-precision input (float8_linear.py matmul_with_hp_or_float8_args.backward:
# cast_config_input_for_grad_weight DISABLED), so under compile without recomputation the
# partitioner keeps the three bf16 matmul inputs (both norms' outputs and the gated product) as the
# bf16 block does (benchmarks/compiled-records float8-rowwise_with_gw_hp, ac=none: Llama-3.1-8B s 4096
# b 1, 573,079,552 bytes against rowwise's 388,530,176 and bf16's 573,079,552). Under selective-op
# and full recomputation it keeps what rowwise keeps (the same records, to the byte).
def float8_keeps_matmul_inputs(training: TrainingSpec) -> bool:
    """Whether the float8 recipe's compiled block keeps its bf16 matmul inputs, as bf16's does."""
    return training.float8 is Float8Recipe.rowwise_with_gw_hp


# torchtune's compiled LoRA block (benchmarks/compiled-finetune-records): the partitioner saves
# what the compiled full block saves (above) less each linear input no adapter reads (the
# attention norm's output when none of q, k, v has one, the MLP norm's output when neither gate
# nor up has, the gated product when down has none; the attention output o reads is the
# attention's own saved output), plus each adapter's r-wide lora_a output (lora_b's input); the
# eager rule (zeroplan.core.finetune.activations) with the compiled block's norms. Over an NF4
# base (torchtune 0.6.1 modules/low_precision/nf4_linear.py _LinearNF4: F.linear(input,
# weight.to(input.dtype)) in forward, the same cast in backward) the partitioner saves each
# dequantized bf16 weight for the backward instead of dequantizing it again: a block keeps its
# linears' weights in bf16. Llama-3.1-8B at s 4096, b 1, r 8: q, v 470,450,176 bytes; all seven
# 621,772,800; all seven over NF4 1,057,980,416. hf's peft block under autocast keeps two more
# things (hf_compiled_lora_extra_bytes).
def compiled_lora_delta_bytes(request: PlanRequest) -> int:
    """What a compiled LoRA block keeps less the compiled full block (0 without adapters)."""
    from zeroplan.core.finetune.activations import INPUT_GROUPS, input_width

    finetune = request.training.finetune
    if not finetune.is_lora:
        return 0
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    targets = finetune.targets(request.training.framework)
    unread = sum(e * tokens * input_width(request, kind) for group, kind, kept_anyway in INPUT_GROUPS
                 if not kept_anyway and not any(t in targets for t in group))
    adapters = sum(e * tokens * finetune.lora_rank
                   for module in lora_adapters(finetune, request.model, request.training.framework)
                   if module != (LoraTarget.output,))
    dequantized = e * _block_linear_elements(request.model) if finetune.quantize is Quantization.nf4 else 0
    return adapters + dequantized - unread + hf_compiled_lora_extra_bytes(request)


# peft 0.17.1's LoRA over transformers 4.56.2's LlamaDecoderLayer, compiled under the Trainer's
# bf16 autocast (benchmarks/compiled-finetune-records hf+lora-*:autocast): get_peft_model leaves
# the adapters in fp32 (tuners_utils.py _cast_adapter_dtype), tuners/lora/layer.py Linear.forward
# casts each adapter's input to fp32 (_cast_input_dtype) and autocast casts input and weight back
# to bf16 for lora_A's and lora_B's matmuls. Beyond torchtune's rule (compiled_lora_delta_bytes)
# the partitioner saves (a) both bf16 weight copies of every adapter (lora_A's r x in for its
# input's gradient, lora_B's out x r for lora_A output's: the permute_* values) and (b) with an
# adapter on o, o's input, the attention output transposed to [tokens, heads x head_dim], as its
# own copy beside the attention's saved output (view_24), which torchtune's block recomputes.
# Llama-3.1-8B at s 4096, b 1, r 8: q, v +212,992 bytes (420,331,520 a block); all seven
# +1,310,720 and +33,554,432 (606,306,304).
def hf_compiled_lora_extra_bytes(request: PlanRequest) -> int:
    """What hf's compiled LoRA block keeps beyond torchtune's rule (0 for other frameworks)."""
    training = request.training
    if training.framework is not Framework.hf or not training.finetune.is_lora:
        return 0
    e = training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    targets = [t for t in training.finetune.targets(training.framework) if t is not LoraTarget.output]
    widths = _linear_widths(request.model)
    # One adapter per module: a fused module's (zeroplan.specs.finetune.lora_adapters) reads the
    # shared input once and writes its projections' outputs together.
    modules = [m for m in lora_adapters(training.finetune, request.model, training.framework) if m != (LoraTarget.output,)]
    weight_copies = sum(e * training.finetune.lora_rank * (widths[m[0]][0] + sum(widths[t][1] for t in m)) for m in modules)
    o_input = e * tokens * request.model.attention_output_size if LoraTarget.o in targets else 0
    return weight_copies + o_input


def _linear_widths(model: ModelSpec) -> dict[LoraTarget, tuple[int, int]]:
    """(input, output) width of each block linear an adapter can wrap."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return {LoraTarget.q: (h, model.q_size), LoraTarget.k: (h, model.kv_size), LoraTarget.v: (h, model.kv_size),
            LoraTarget.o: (model.attention_output_size, h), LoraTarget.gate: (h, f), LoraTarget.up: (h, f),
            LoraTarget.down: (f, h)}


def _block_linear_elements(model: ModelSpec) -> int:
    """Elements of one block's seven linear weights."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return h * model.q_size + 2 * h * model.kv_size + model.attention_output_size * h + 3 * h * f


# torchtitan 0.3.0 SelectiveAC under compile (records ac=selective-op): the block's input, the
# fused QKV projection's output, the attention output with its log-sum-exp and w1's output: the
# policy's kept matmul outputs (zeroplan.core.frameworks.selective_op_layer_bytes) except w2's,
# which no backward op reads once the graph is partitioned. Llama-3.1-8B at s 4096, b 1:
# 235,405,312 bytes; 70B 454,033,408.
def compiled_selective_op_layer_bytes(request: PlanRequest) -> int:
    model = request.model
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    widths = model.hidden_size + (model.q_size + 2 * model.kv_size) + model.q_size + model.ffn_hidden_size
    return e * tokens * widths + FP32_BYTES * tokens * model.num_heads


# The loss each framework compiles with its model (benchmarks/compiled-loss-records,
# zeroplan/frameworks/compiled_loss.py): torchtune 0.6.1's compile_loss compiles
# CEWithChunkedOutputLoss.compute_cross_entropy, one chunk's upcast and cross-entropy, and
# torchtitan 0.3.0 its per-chunk CrossEntropyLoss. Inductor's partition of either saves the
# chunk's bf16 logits (its input), the labels and two fp32 values per row (the row's max and the
# log of its exponentials' sum), where eager saves the fp32 log-softmax (4 bytes per logit), and
# its backward returns the logits' gradient in bf16: every record, to the byte.
COMPILED_CROSS_ENTROPY_ROW_BYTES = 2 * FP32_BYTES
"""What the compiled cross-entropy saves per row (token) beyond its input and the labels."""


def compiles_loss(training: TrainingSpec) -> bool:
    """Whether the framework compiles its chunked cross-entropy with the model: torchtune's
    recipes with compile: True (training.compile_loss); torchtitan's default
    CompileConfig.components holds "loss" too, but its modelled loss moment (the last chunk's
    head reduce-scatter, zeroplan.core.framework_loss.torchtitan_chunked_loss_bytes) holds no
    cross-entropy tensor, so only torchtune's pieces change."""
    return training.compile and training.framework is Framework.torchtune and not training.unchunked_loss


# torchtitan's unchunked cross-entropy under compile at the releases that compile their loss
# (zeroplan.core.profiles.torchtitan_compiles_loss: 2c8b594 components/loss.py:25-30, 0.3.0
# BaseLoss._maybe_compile): the whole [b, s, V] is one compiled call, whose partition saves its
# bf16 logits, the labels and two fp32 values a row and whose backward returns the logits' bf16
# gradient (benchmarks/compiled-loss-records chunks1, torchtitan 0.3.0's CrossEntropyLoss
# unchunked), where eager keeps the fp32 log-softmax and makes two fp32 gradients. Measured on
# the data-parallel layout: under tensor parallelism 0.3.0 runs its _LossParallelCrossEntropy
# (components/loss.py:68), and pipeline and context parallelism were not measured compiled, so
# those keep the eager loss (more memory, never less).
def compiles_unchunked_loss(request: PlanRequest) -> bool:
    """Whether torchtitan's unchunked loss runs compiled (torchtitan_compiled_unchunked_loss_parts)."""
    training = request.training
    return (training.compile and training.framework is Framework.torchtitan and training.unchunked_loss
            and not training.fused_linear_cross_entropy and torchtitan_compiles_loss(training)
            and request.parallel.model_parallel_size == 1)


# torchtune's chunked loss, compiled (compare zeroplan.core.framework_loss.chunked_logits_pieces, its
# eager moments): in forward each chunk's compiled cross-entropy keeps the chunk's bf16 logits,
# so the n chunks (2sbV in bf16) stay alive past the recipe's `del logits` with 8 bytes a token
# beside them, and no fp32 copy is made outside inductor's fused kernels; in backward autograd
# runs the n cross-entropy backwards before the head's (later nodes first): each writes its
# chunk's bf16 gradient while that chunk's saved logits are still held, so the first holds all
# the logits and one chunk's gradient, and the head's backward then starts beside the n bf16
# gradients, as eager.
def compiled_chunked_logits_pieces(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int) -> tuple[int, int, int]:
    """The compiled loss's bytes at its three moments: its forward, its backward, the head's backward."""
    forward, backward, head = (sum(m) for m in compiled_chunked_logits_tensors(model, training, s, b, chunks))
    return forward, backward, head


def compiled_chunked_logits_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int, chunks: int,
                                    head_backward_parts: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
    """The tensors of compiled_chunked_logits_pieces' moments: the n bf16 chunks and each
    chunk's row statistics (and, in backward, one chunk's bf16 gradient); then the n bf16
    gradients and ``head_backward_parts``."""
    e = training.precision.compute_bytes
    sbv = s * b * model.vocab_size
    held = (*even_split(e * sbv, chunks), *even_split(COMPILED_CROSS_ENTROPY_ROW_BYTES * s * b, chunks))
    head = (*even_split(e * sbv, chunks), *(p for p in head_backward_parts if p > 0))
    return held, (*held, e * sbv // chunks), head


# What a compiled torchtitan block under tensor parallelism keeps beyond the data-parallel
# values (benchmarks/compiled-parallel-records; docs/compile-float8.md, "Under model
# parallelism"). Tensor parallelism alone (spmd_types: every rank holds the whole sequence): the
# block keeps compiled_layer_bytes of the rank's tensor-parallel block (a/t and k/t heads, f/t),
# the output projection's all-reduced result standing for its local matmul output: exact in the
# records. With sequence parallelism the block's input x, the output projection's
# reduce-scattered result and both norms' fp32 rsqrt are the rank's s/t tokens; the norms'
# outputs are saved as the all-gathered whole-sequence matmul inputs (the partitioner does not
# recompute a collective), and so are Q, K, V, the attention output and the MLP values:
# Llama-3.1-8B, tp 2, s 4096: 321,142,784 bytes to the byte; 70B tp 8: 260,182,016.
def compiled_sequence_sharded_bytes(request: PlanRequest) -> int:
    """The bytes of a compiled block (of ``request``'s tensor-parallel chunk) that sequence
    parallelism shards: x, the output projection's result and the two norms' rsqrt."""
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return e * tokens * 2 * request.model.hidden_size + 2 * FP32_BYTES * tokens


# torchtitan 0.3.0 distributed/activation_checkpoint.py SelectiveAC under compile and tensor
# parallelism (records ac=selective-op, tp 2): besides the data-parallel values the block keeps
# one more [b s, h] tensor: the MLP output projection's local matmul output without sequence
# parallelism (the policy saves every second mm: wqkv, w1 and w2, whose output, all-reduced, no
# longer goes unread), and with it a reduce_scatter_tensor output (the policy's comm_ops save
# list), s/t of the tokens. 168,034,304 and 134,479,872 bytes for Llama-3.1-8B at s 4096, to the byte.
def compiled_selective_op_tensor_parallel_extra_bytes(request: PlanRequest) -> int:
    """The [b s, h] tensor a compiled SelectiveAC block keeps under tensor parallelism, whole
    (the chunk's tokens; sequence parallelism shards it, compiled_sequence_sharded_bytes' way)."""
    e = request.training.precision.compute_bytes
    return e * request.batch.seq_len * request.batch.micro_batch_size * request.model.hidden_size


FLOAT8_BYTES = 1
"""torch.float8_e4m3fn."""


# torchtitan 0.3.0 Float8Linear (its converter's config swap, then its sharding) under compile,
# tensor and sequence parallelism (records float8-tensorwise, tp 2 and 8, sp): as without tensor
# parallelism the partitioner recomputes the bf16 matmul inputs and the SwiGLU product, but the
# two norms' outputs reach their linears through an all-gather, which it does not recompute:
# it keeps their float8 casts instead, the whole sequence at one byte an element. Llama-3.1-8B,
# tp 2, s 4096: 228,868,134 bytes (the planner leaves out 38 bytes of per-linear scalars).
def compiled_float8_gathered_inputs_bytes(request: PlanRequest) -> int:
    """The float8 all-gathered norm outputs a compiled float8 block keeps under sequence
    parallelism (0 without float8); ``request`` is the rank's chunk."""
    if request.training.float8 is None:
        return 0
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return FLOAT8_BYTES * tokens * 2 * request.model.hidden_size


# litgpt's GPT compiled whole: torch.compile(model), as lightning-thunder 3770bf0
# thunder/benchmarks/benchmark_litgpt.py:555 (its 'Torch Compile' runs) and litgpt 00af8b0
# pretrain.py:209 compile it; the loss stays outside the compiled module. AOTAutograd traces the
# whole forward and backward as one graph and inductor's partitioner picks what it keeps across
# every block (benchmarks/litgpt_compiled_records.py, benchmarks/compiled-litgpt-records: litgpt
# 9a1b82b's own model.py, stablecode-completion-alpha-3b at full width with 1, 2 and 3 layers,
# s 2048 and 4096; each layer adds the same bytes and the rest does not grow with depth).
# Counted by storage: a saved view keeps its base whole, and the V the attention reads is a view
# of the fused qkv matmul's output, so that whole output stays. Per block, GPT-NeoX's layout
# (parallel residual: norm_1 and norm_2 read the same x, and the graph computes their mean and
# rstd once): the block input x; the two statistics (one value a token each: fp32 on CUDA, where
# the records' CPU graph has them in the input's dtype, torch 2.13 _refs/__init__.py
# native_layer_norm converting mean and rstd "if input.device.type in ['cpu', 'mtia']");
# norm_1's output (the qkv matmul's input); the qkv output (q + 2 kv wide); Q and K
# after the partial RoPE's cat; the attention output, its fp32 log-sum-exp (one a head and
# token) and its contiguous [tokens, heads x head_dim] copy (the projection's input); norm_2's
# output (the fc matmul's input); the fc output (GELU's input) and the GELU output (the proj
# matmul's input). Everything else (the residual sums, the biases' adds) is recomputed or not
# needed. stablecode-completion-alpha-3b at s 2048, b 1: 189,014,016 bytes a layer on the CPU, to
# the byte (189,022,208 with CUDA's fp32 statistics). Broken at every block, as FSDP's units break
# the graph (each block one compiled graph; GPT.forward's loop then runs eagerly: the embedding,
# final norm and head eager), the records hold the same bytes.
def litgpt_compiled_layer_bytes(request: PlanRequest) -> int:
    """One block's share of what litgpt's whole compiled GPT keeps for backward."""
    model = request.model
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    widths = h + h + (q + 2 * kv) + q + kv + q + model.attention_output_size + h + 2 * f
    statistics = 2 * FP32_BYTES * tokens + FP32_BYTES * tokens * model.num_heads
    return e * tokens * widths + statistics


# The same records: beyond the blocks the compiled graph keeps the final norm's input (the last
# block's output), its two statistics in the compute dtype and its output (the head's input);
# the embedding's output is the first block's input, counted there. stablecode-3b at s 2048,
# b 1: 20,979,712 bytes on the CPU, to the byte (the statistics fp32 on CUDA, as above); the
# eager final norm and head of a graph broken at the blocks save the same.
def litgpt_compiled_outside_bytes(request: PlanRequest) -> int:
    """What litgpt's whole compiled GPT keeps outside its blocks (the final norm and the head)."""
    e = request.training.precision.compute_bytes
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return 2 * e * tokens * request.model.hidden_size + 2 * FP32_BYTES * tokens


def litgpt_compiled_unmeasured(model: ModelSpec) -> str | None:
    """Why litgpt's whole compiled GPT of ``model`` was not measured, or None.

    The records are litgpt's default block (litgpt 9a1b82b config.py Config: LayerNorm,
    GptNeoxMLP, parallel_residual True, shared_attention_norm False, bias True): what zeroplan's
    GPT-NeoX spec describes (zeroplan.presets.hf_config._gpt_neox_spec: LayerNorm, biased
    linears, a GELU MLP, rotary positions, one fused qkv; a single shared norm is parallel_block,
    litgpt's shared_attention_norm, another graph), with every head its own K and V."""
    from zeroplan.specs.model import MlpKind, NormKind

    if model.norm is not NormKind.layernorm or model.mlp is not MlpKind.gelu or not model.bias or not model.fused_qkv:
        return "a block other than GPT-NeoX's (LayerNorm, biased linears, fused qkv, a GELU MLP)"
    if model.parallel_block or model.post_norms or model.is_moe or model.is_mla or model.position is not PositionKind.rope:
        return "a shared block norm, post-norms, experts, latent attention or positions other than rotary"
    if not model.parallel_residual:
        return "a sequential block (the records are litgpt's parallel residual over two norms)"
    if model.kv_heads != model.num_heads:
        return "grouped-query attention (litgpt expands K and V to every head, a copy the records do not hold)"
    return None
