"""DeepSpeed ZeRO-3's gathered parameters, replayed module by module as its
PartitionedParameterCoordinator fetches, prefetches and releases them over the step's trace:
one model for every stack planned under the ``deepspeed`` state convention (hf's Trainer and
accelerate, megatron-deepspeed). Rules quoted from DeepSpeed 0.13.3
runtime/zero/partitioned_param_coordinator.py (the PEFT rows' release; 0.19.8 and 0.6.2, the
Azure recipes' release, follow the same rules at the lines given beside them).

ZeRO-3 hooks every module and gathers the parameters of one module at a time
(fetch_sub_module: iter_params(current_submodule, recurse=False), 0.13.3 lines 261-290), not a
whole block. The modules are the model's own: one per linear (its weight and bias), one per
norm, megatron-deepspeed's fused query_key_value (Megatron-DeepSpeed@62bc4562
megatron/model/transformer.py line 147) where hf's Llama has q_proj, k_proj and v_proj, and under
peft's LoRA each adapted linear's base_layer, lora_A and lora_B (peft tuners/lora/layer.py
Linear.forward: base_layer(x), then lora_B(lora_A(dropout(x)))). Every module's fetch runs the
prefetch, whether or not it has parameters to gather (0.13.3 lines 323-391).

With a complete trace (recorded in the first step, 0.13.3 reset_step lines 204-239), each fetch
first pops its own parameters off the parameter queue (lines 325-343), then prefetches from it
until at least min(stage3_max_live_parameters - elements available, stage3_prefetch_bucket_size)
elements are in flight (lines 353-385), whole parameters: one not available is gathered, one
available is passed over, and either way ``__most_recent_step_id_param_fetched_for`` is raised
to that later use (lines 371-373). After a module's forward or backward (release_sub_module at
step_id = its fetch's + 1, lines 391-405) its parameters are released unless a prefetch scan
marked them for a later use (``__params_to_release``, lines 500-504) or the trace within
stage3_max_reuse_distance elements uses them again (lines 506-516). ``__n_available_params`` is
counted in ds_numel (unpadded): += at each gather (line 447), -= at each release (line 483).
Persistent parameters (partition_parameters.py _partition_param: ds_numel <=
stage3_param_persistence_threshold) are gathered once when the engine is built and never
counted or released (``__params_to_release`` skips ds_persist, lines 491-493; ds_persist is set
in partition_parameters.py lines 1086-1091).

The trace is the forward's modules, then unit by unit from the last its modules' backward in
reverse, after a block's forward again where every block is recomputed (hf's
gradient_checkpointing_enable, Megatron's --checkpoint-activations): DeepSpeed 0.13.3's own
engine under peft's 70B LoRA shapes (benchmarks/deepspeed_zero3_allocator_replay.py) gathers the
lm_head, then the last block's recompute, then its backward, block by block.

This module does not import torch."""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import DEEPSPEED_ZERO_DEFAULTS, StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, StateConvention, TrainingSpec
from zeroplan.units import ceil_div


def models_deepspeed_gathers(request: PlanRequest) -> bool:
    """Whether the ZeRO-3 gathers are DeepSpeed's plain ones (the deepspeed state convention at
    stage 3; not FSDP, nor ZeRO++ (hpZ, qwZ) or MiCS, whose gathers have terms of their own)."""
    kind = request.strategy.kind
    return (request.convention is StateConvention.deepspeed and kind.zero_stage == 3 and not kind.is_fsdp
            and not kind.uses_hpz and not kind.quantizes_communication and kind is not StrategyKind.zero3_mics)


def replays_gathers(request: PlanRequest) -> bool:
    """Whether the coordinator's replay gives the request's gathered parameters: DeepSpeed's plain
    ZeRO-3 gathers without a pipeline (DeepSpeed's pipeline engine runs stage 1 at most), with no
    recomputation, or recomputation whose trace is the forward's modules (selective: the
    attention core holds no parameters), or every block recomputed."""
    return (models_deepspeed_gathers(request) and request.parallel.pp == 1
            and request.training.activation_checkpointing in (ActivationCheckpointing.none, ActivationCheckpointing.full,
                                                              ActivationCheckpointing.selective))


# DeepSpeed 0.19.3 (deepspeedai/DeepSpeed a31eb3165, "Z3: Support for activation ckpt with frozen
# params"; 0.19.8 partitioned_param_coordinator.py fetch_sub_module lines 389-394 and
# release_sub_module lines 500-524): a frozen parameter fetched in a checkpoint's recompute (a
# forward inside the backward's graph task) is attributed to the module whose backward was last
# entered (update_recompute_parameters adds that module to its ds_active_sub_modules) and released
# with that module's backward. Under transformers' default reentrant checkpoint (the hf profile's;
# modeling_utils.py gradient_checkpointing_enable: use_reentrant True) the recompute runs in
# CheckpointFunction.backward, outside any block module's backward, and the owner is an outer
# module whose backward ends with the step's: each recomputed block's frozen parameters stay
# gathered to the end of the backward. Measured on DeepSpeed 0.19.8's own engine
# (benchmarks/deepspeed_zero3_qlora_step.py --bf16-base: 1.89, 3.43, 5.10 and 6.77 MB gathered at
# blocks 3 to 0, the replay 1.99, 3.37, 5.04 and 6.71 with its counter starting at 0 as 0.19.8's
# does, resets_counter_at_forward; --non-reentrant 0.09 to 0.25 MB).
def holds_recomputed_frozen(training: TrainingSpec) -> bool:
    """Whether the frozen parameters a block's recompute gathers stay gathered to the end of the
    backward: hf's reentrant checkpoint under every block recomputed, DeepSpeed 0.19.3 or later."""
    from zeroplan.core.profiles import checkpoint_is_reentrant

    reentrant = checkpoint_is_reentrant(training)
    return (training.framework is Framework.hf and reentrant and training.deepspeed_release in (None, "0.19.8")
            and training.activation_checkpointing is ActivationCheckpointing.full)


# DeepSpeed 0.13.3 (and 0.19.8, 0.6.2) runtime/zero/config.py DeepSpeedZeroConfig: stage3_prefetch_bucket_size
# 5e7 (line 194), stage3_param_persistence_threshold 1e5 (200), stage3_max_live_parameters 1e9
# (217), stage3_max_reuse_distance 1e9 (223): what a run whose config leaves them out (accelerate's
# DeepSpeedPlugin without a config file, the PEFT docs' runs) gets.
RELEASE_DEFAULTS = {"prefetch_bucket": DEEPSPEED_ZERO_DEFAULTS["stage3_prefetch_bucket_size"],
                    "persistence": DEEPSPEED_ZERO_DEFAULTS["stage3_param_persistence_threshold"],
                    "max_live": DEEPSPEED_ZERO_DEFAULTS["stage3_max_live_parameters"],
                    "reuse": DEEPSPEED_ZERO_DEFAULTS["stage3_max_reuse_distance"]}


def _release_defaults(request: PlanRequest) -> bool:
    """Whether the stage-3 settings the strategy leaves unset are DeepSpeed's defaults: under hf
    (accelerate's DeepSpeedPlugin and the Trainer write no such keys unless a config file sets
    them: zeroplan.core.hf_deepspeed) or where the request names the release it plans
    (--deepspeed-release); otherwise what ``--emit`` writes (zeroplan.emit.formats.deepspeed_config)."""
    return request.training.framework is Framework.hf or request.training.deepspeed_release is not None


def prefetch_bucket_elements(request: PlanRequest) -> int:
    """stage3_prefetch_bucket_size: the strategy's, else the release's default, else what --emit
    writes (prefetch_units largest units)."""
    chosen = request.strategy.deepspeed_prefetch_bucket_elements
    if chosen is not None:
        return chosen
    if _release_defaults(request):
        return RELEASE_DEFAULTS["prefetch_bucket"]
    return request.strategy.prefetch_units * largest_unit_elements(request)


def max_live_parameters(request: PlanRequest) -> int:
    """stage3_max_live_parameters: the strategy's, else the release's default, else what --emit
    writes ((1 + prefetch_units) largest units)."""
    chosen = request.strategy.deepspeed_max_live_parameters
    if chosen is not None:
        return chosen
    if _release_defaults(request):
        return RELEASE_DEFAULTS["max_live"]
    return (1 + request.strategy.prefetch_units) * largest_unit_elements(request)


def max_reuse_distance(request: PlanRequest) -> int:
    """stage3_max_reuse_distance: the strategy's, else the release's default, else what --emit writes (0)."""
    chosen = request.strategy.deepspeed_max_reuse_distance
    if chosen is not None:
        return chosen
    return RELEASE_DEFAULTS["reuse"] if _release_defaults(request) else 0


def persistence_threshold(request: PlanRequest) -> int:
    """stage3_param_persistence_threshold: the strategy's, else the release's default, else what --emit writes (0)."""
    chosen = request.strategy.deepspeed_param_persistence_threshold
    if chosen is not None:
        return chosen
    return RELEASE_DEFAULTS["persistence"] if _release_defaults(request) else 0


# partition_parameters.py pads each parameter to a multiple of the group (ceil(ds_numel / N) per rank).
def _padded_gathered_bytes(numel: int, group: int, bytes_per_element: int) -> int:
    """Bytes an all-gather brings in for one trainable parameter of ``numel`` elements."""
    return ceil_div(numel, group) * group * bytes_per_element


def _gathered_bytes(request: PlanRequest, tensor, bytes_per_element: int) -> int:
    """Bytes an all-gather brings in for one tensor: a trainable one padded to the group
    (_padded_gathered_bytes); a frozen tensor in its own storage (zeroplan.core.finetune.storage)."""
    group = request.shard_group_size
    if tensor.trainable:
        return _padded_gathered_bytes(tensor.numel, group, bytes_per_element)
    from zeroplan.core.finetune.storage import frozen_tensor_bytes

    return group * ceil_div(frozen_tensor_bytes(request, tensor, gathered=True), group)


QUANT_STORAGE_BYTES = 2
"""Bytes of one element of bitsandbytes' Params4bit as PEFT's DeepSpeed QLoRA guide stores it
(bnb_4bit_quant_storage bf16: four 4-bit codes an element; zeroplan.frameworks.lora.BNB_QUANT_STORAGE)."""


# DeepSpeed counts a parameter's elements as the tensor it partitions holds them
# (partition_parameters.py _convert_to_deepspeed_param: param.ds_numel = param.numel(), 0.13.3
# line 1076, 0.19.8 line 1282): for bitsandbytes' Params4bit that is the packed codes, a quarter
# of the weight's elements in bf16 storage. Every element count of the coordinator reads ds_numel:
# the persistence threshold (line 1086), stage3_max_live_parameters and the prefetch bucket
# (__n_available_params, numel_prefetching) and the reuse distance (the trace's running sum). So
# under a 4-bit base DeepSpeed keeps gathered and prefetches four times the weights that the same
# settings do for a 16-bit base: DeepSpeed 0.19.8's own engine under bitsandbytes 0.50.2 on a
# 4-block Llama whose packed model (417,792 elements) is within its scaled reuse distance
# (976,562) keeps every block's packed weights gathered through the step.
def ds_numel(request: PlanRequest, tensor) -> int:
    """The elements DeepSpeed counts for one tensor (ds_numel): a quantized frozen weight's
    stored elements, else its elements."""
    if tensor.quantized and not tensor.trainable:
        from zeroplan.core.finetune.storage import quantized_layout

        return ceil_div(quantized_layout(request, tensor)[0], QUANT_STORAGE_BYTES)
    return tensor.numel


def _fuses_qkv(request: PlanRequest) -> bool:
    # Megatron's ParallelAttention computes q, k and v with one query_key_value linear
    # (megatron/model/transformer.py line 147); hf's Llama has q_proj, k_proj, v_proj.
    return request.training.framework is Framework.megatron_deepspeed


# torch's nn.MultiheadAttention holds q, k and v in one in_proj_weight and in_proj_bias of its
# own and calls its out_proj's weight and bias from its forward (out_proj's forward never runs):
# DeepSpeed's ZeROOrderedDict getter registers those as the attention module's external
# parameters (0.19.8 parameter_offload.py lines 80-89), so one fetch gathers all four.
_TORCH_ATTENTION = ("attention.q", "attention.k", "attention.v", "attention.o")


_IN_PROJECTION = ("attention.q", "attention.k", "attention.v")


def _packed_in_projection(request: PlanRequest, unit) -> dict[str, int]:
    """Under torch's nn.MultiheadAttention, the elements of the unit's packed in_proj_weight and
    in_proj_bias ('weight', 'bias': its q, k and v tensors' together; one parameter each to
    DeepSpeed); empty elsewhere."""
    if not request.training.torch_multihead_attention:
        return {}
    packed: dict[str, int] = {}
    for tensor in unit.tensors:
        prefix, _, kind = tensor.name.rpartition(".")
        if prefix in _IN_PROJECTION:
            packed[kind] = packed.get(kind, 0) + tensor.numel
    return packed


def _module_name(request: PlanRequest, tensor_name: str) -> str:
    """The module a tensor belongs to: its dotted prefix ('attention.q' of 'attention.q.weight'
    and '.bias'; 'attention.q.lora_a' is LoRA's lora_A module), q, k and v one module where the
    stack fuses them, q, k, v and o one under torch's nn.MultiheadAttention."""
    prefix = tensor_name.rsplit(".", 1)[0]
    if request.training.torch_multihead_attention and prefix in _TORCH_ATTENTION:
        return "attention"
    if _fuses_qkv(request) and prefix in ("attention.q", "attention.k", "attention.v"):
        return "attention.qkv"
    return prefix


@frozen
class _Param:
    unit: int
    name: str
    numel: int
    gathered_bytes: int
    gradient_bytes: int


@frozen
class Replay:
    """What the replay found: the most held at once (gathered parameters, with the module's full
    gradients at its backward) and the bytes gathered per unit in the forward and the backward."""

    peak_bytes: int
    forward_gathered_bytes: tuple[int, ...]
    backward_gathered_bytes: tuple[int, ...]
    gathers: tuple[tuple[int, str], ...]
    """(trace step, '<unit name>.<tensor name>') of each parameter gathered, in order."""
    held_bytes: tuple[int, ...]
    """Per trace step, what is held after its fetch and prefetch (as peak_bytes)."""
    forward_steps: int
    """The forward's trace steps: gathers at a later step are the backward's (and its recomputation's)."""
    gathered_bytes: tuple[tuple[str, int], ...]
    """('<unit name>.<tensor name>', bytes one gather of it brings in) of each parameter fetched."""
    after_forward_bytes: int = 0
    """What stays gathered once the forward's last module is released: what the loss and its
    backward run beside, before the model's pre-backward fetch."""


def _modules(request: PlanRequest) -> tuple[list[tuple[int, list[int]]], list[_Param], list[bool], int | None]:
    """(each module's unit and parameter ids in forward order, persistent ones left out: the
    module still fetches, so it still prefetches; the parameters; whether each unit is a block;
    the token embedding's module, None where the first unit has none).
    A tied output projection uses the embedding's weight again after the final norm
    (megatron/model/gpt_model.py line 130; transformers' tied lm_head): one more use of that
    parameter, last in the forward."""
    eb = element_bytes(request.training.precision, request.convention)
    wire = gradient_wire_bytes(request)
    threshold = persistence_threshold(request)
    params: list[_Param] = []
    modules: list[tuple[int, list[int]]] = []
    units = rank_parameter_units(request)
    word_embeddings = token_module = None
    for index, unit in enumerate(units):
        by_module: dict[str, list[int]] = {}
        packed = _packed_in_projection(request, unit)
        for tensor in unit.tensors:
            name, numel = tensor.name, ds_numel(request, tensor)
            prefix, _, kind = name.rpartition(".")
            if packed and prefix in _IN_PROJECTION:
                if prefix != _IN_PROJECTION[0]:
                    continue  # packed into q's place
                name, numel = f"attention.in_proj_{kind}", packed[kind]
            own = by_module.setdefault(_module_name(request, name), [])
            if numel <= threshold:
                continue  # persistent: gathered at the engine's start, never fetched
            own.append(len(params))
            if name == "token.weight":
                word_embeddings = len(params)
            # The packed in-projection is one trainable parameter (torch_multihead_attention is
            # refused beside frozen or quantized tensors).
            gathered = (_padded_gathered_bytes(numel, request.shard_group_size, eb.compute_parameter)
                        if name != tensor.name else _gathered_bytes(request, tensor, eb.compute_parameter))
            params.append(_Param(index, f"{unit.name}.{name}", numel, gathered,
                                 numel * wire if tensor.trainable else 0))
        if index == 0 and "token" in by_module:
            token_module = len(modules) + list(by_module).index("token")
        modules += [(index, ids) for ids in by_module.values()]
    if request.model.tied_embeddings and word_embeddings is not None:
        modules.append((len(units) - 1, [word_embeddings]))
    return modules, params, [unit.name.startswith("block.") for unit in units], token_module


# DeepSpeed 0.14.2 runtime/zero/parameter_offload.py _pre_backward_module_hook (lines 328-365)
# applies PreBackwardFunctionForModule to a module's outputs, whose backward (the module's fetch
# for its backward) runs only where an output requires grad (0.19.8 lines 412 and 450-487 alike).
# The token embedding's output does where its weight trains, or where transformers'
# enable_input_require_grads forward hook marks it: a LoRA under a reentrant checkpoint needs it
# for any adapter to get a gradient, and peft 0.17.1 (utils/other.py:166-170
# prepare_model_for_kbit_training; PeftModel.__init__ peft_model.py:137-138 where checkpointing is
# on first, zeroplan.frameworks.lora) and TRL's SFTTrainer call it, both skipping it under
# use_reentrant False ("there is no need for this hack"). A frozen embedding otherwise is gathered
# in the forward alone. Measured on DeepSpeed 0.14.2's own engine
# (benchmarks/deepspeed_zero3_coordinator_counter.py --frozen-embedding: gathered and released in
# each forward, never in the backward; with --input-require-grads gathered again at the backward's
# end and still gathered after it).
def embedding_backward_fetched(request: PlanRequest) -> bool:
    """Whether the coordinator fetches the token embedding for its backward: its weight trains, or
    a LoRA under hf with every block recomputed by the reentrant checkpoint
    (enable_input_require_grads)."""
    from zeroplan.core.profiles import checkpoint_is_reentrant

    training = request.training
    token = next((t for t in rank_parameter_units(request)[0].tensors if t.name == "token.weight"), None)
    if token is None or token.trainable:
        return True
    return (training.finetune.is_lora and training.framework is Framework.hf
            and training.activation_checkpointing is ActivationCheckpointing.full and checkpoint_is_reentrant(training))


# DeepSpeed hooks every module, containers too (0.13.3 parameter_offload.py _register_hooks_recursively,
# lines 262-439):
# the model itself, whose pre-forward fetch is the trace's first and whose pre-backward fetch
# (PreBackwardFunction on its output) is the backward's first, and each block's layer module,
# fetched before its children in the forward, the recomputation and the backward. They gather
# nothing but take trace steps (a release keeps what the next step uses: lines 500-504) and
# run the prefetch. The containers inside a block (attention, mlp) are left out.
def _trace(request: PlanRequest, modules: list[tuple[int, list[int]]], blocks: list[bool],
           skipped: frozenset[int] = frozenset()) -> list[tuple[int, bool]]:
    """(module, whether it is its backward) in the order the coordinator fetches them: the model,
    the forward; the model again, then unit by unit from the last its backward in reverse, after
    a block's forward again under full recomputation (module -1: a container, no parameters);
    the modules in ``skipped`` have no backward fetch (embedding_backward_fetched)."""
    full = request.training.activation_checkpointing is ActivationCheckpointing.full
    container = [[-1] if block else [] for block in blocks]
    of_unit: list[list[int]] = [[] for _ in blocks]
    for m, (index, _) in enumerate(modules):
        of_unit[index].append(m)
    trace = [(-1, False)]
    for unit in range(len(blocks)):
        trace += [(m, False) for m in container[unit] + of_unit[unit]]
    trace.append((-1, True))
    for unit in reversed(range(len(blocks))):
        own = of_unit[unit]
        if full and blocks[unit]:
            trace += [(m, False) for m in container[unit] + own]
        trace += [(m, True) for m in container[unit] + list(reversed(own)) if m not in skipped]
    return trace


# The counter starts a step below zero by the persistent parameters' elements: the optimizer step
# (0.13.3 stage3.py:2021 step -> _partition_all_parameters, parameter_offload.py:162) runs
# release_and_reset_all (coordinator lines 407-421), whose __release_param (478-483) subtracts the
# ds_numel of every available parameter, the persistent ones too (only __params_to_release skips
# ds_persist); _post_step gathers those again outside the coordinator (stage3.py:1986, no +=), and
# reset_step zeroes the counter only at the end of the next backward (line 239, called at
# stage3.py:2215). So from the third step on, the micro-batch after each optimizer step prefetches
# that many elements beyond stage3_max_live_parameters (0.19.8 subtracts alike, lines 537-546 and
# 624-630, but zeroes the counter at the next forward's start: resets_counter_at_forward).
# In DeepSpeed 0.13.3's own run of the 70B LoRA row's shapes over 1,024 (step 2 of
# benchmarks/deepspeed_zero3_allocator_replay.py's events) that is 1,556,736 elements, more than
# the scaled stage3_max_live_parameters (976,562): the prefetch there takes three blocks ahead.
def persistent_elements(request: PlanRequest) -> int:
    """The elements of the persistent parameters (ds_numel, whole: every rank holds them)."""
    threshold = persistence_threshold(request)
    counts = (ds_numel(request, t) for unit in rank_parameter_units(request) for t in unit.tensors)
    return sum(n for n in counts if n <= threshold)


# DeepSpeed 0.14.2 runtime/zero/parameter_offload.py _post_backward_module_hook (lines 387-439)
# releases a module's parameters after its backward through PostBackwardFunctionModule on the
# module's inputs, whose backward runs only where an input requires grad (line 402). The token
# embedding's input is the token ids: once its backward fetch (embedding_backward_fetched) gathers
# its weight, nothing releases it before the optimizer step (partition_all_parameters' docstring,
# lines 158-162, says as much). reset_step zeroes the counter at the backward's end (stage3.py:2215,
# coordinator line 239) and the step's release_and_reset_all (stage3.py:2021, parameter_offload.py:162;
# coordinator lines 407-421, __release_param 478-483) then subtracts the weight's ds_numel: the next
# micro-batch starts that many elements further below zero, a tied head's weight as an untied
# one's. Measured on DeepSpeed 0.14.2's own engine (benchmarks/deepspeed_zero3_coordinator_counter.py,
# 2 blocks): the embedding gathered after every backward, untied and --tied; step 1 starts at
# -2,052,096 (the embedding's 8,016 x 256), step 2 at -2,053,376 (the 5 persistent norms' 1,280
# too); tied at 8 blocks, past the reuse distance, at -2,056,448, its weight gathered for the
# embedding, the head and the backward's end as the replay does; --frozen-embedding at -256 and -1,280. Under --accumulation 2 a micro-batch after one with
# no optimizer step starts at 0 with the embedding still gathered (-2,052,096 in effect): the one
# after a step, which the replay runs, starts lowest.
def embedding_held_elements(request: PlanRequest) -> int:
    """ds_numel of the token embedding's weight where it is still gathered after the backward
    (fetched for its backward and not persistent), else 0."""
    if not embedding_backward_fetched(request):
        return 0
    token = next((t for t in rank_parameter_units(request)[0].tensors if t.name == "token.weight"), None)
    numel = 0 if token is None else ds_numel(request, token)
    return numel if numel > persistence_threshold(request) else 0


# From DeepSpeed 0.15.4 (deepspeedai/DeepSpeed 351569dd4, "Use one param coordinator for both
# train/inference scenarios", #6662) the engine's forward pre-hook on the model calls reset_step
# at the start of every forward (0.19.8 parameter_offload.py:299-306; reset_step zeroes the counter
# at partitioned_param_coordinator.py:287), after the optimizer step's releases; and from 0.19.3
# (a31eb3165) the backward's epilogue releases what a module whose post-backward hook never fired
# still holds (stage3.py:3059-3068 backward_epilogue -> coordinator release_backward_leftovers,
# lines 554-566), the embedding included, so nothing stays gathered into the next micro-batch,
# under gradient accumulation either. Measured on 0.19.8's own engine
# (benchmarks/deepspeed_zero3_coordinator_counter.py without --deepspeed-src, and with
# --accumulation 2): the embedding is released at each backward's end, and every micro-batch's
# first fetch sees 0.
def resets_counter_at_forward(request: PlanRequest) -> bool:
    """Whether the release zeroes the coordinator's counter at each forward's start and releases
    the embedding at the backward's end (the planner's default 0.19.8), rather than zeroing it at
    the backward's end alone (0.13.3, 0.14.2, 2022)."""
    return request.training.deepspeed_release in (None, "0.19.8")


def initial_counter(request: PlanRequest) -> int:
    """Where __n_available_params starts the micro-batch after an optimizer step: 0 under 0.19.8;
    before 0.15.4 minus the persistent elements and the embedding held after the backward."""
    if resets_counter_at_forward(request):
        return 0
    return -(persistent_elements(request) + embedding_held_elements(request))


@lru_cache(maxsize=64)
def _quantizes(units: tuple) -> bool:
    """Whether any of the units' tensors is stored quantized (its gathered bytes then read more of
    the request than the replay's key names: finetune.storage.quantized_layout)."""
    return any(t.quantized for unit in units for t in unit.tensors)


def _replay_key(request: PlanRequest) -> tuple:
    """Everything replay reads of the request, as values: _modules (the rank's units, q/k/v
    fused or not, one module under torch's nn.MultiheadAttention, tied embeddings, the gathered and gradient element bytes, the persistence
    threshold, the shard group, and where a tensor is quantized the request itself), _trace
    (whether every block is recomputed), whether a recompute's frozen weights stay gathered
    (holds_recomputed_frozen), whether the embedding is fetched for its backward
    (embedding_backward_fetched) and whether the release zeroes the counter at each forward
    (resets_counter_at_forward): with the units and the threshold, where the counter starts
    (initial_counter); and the three stage-3 settings. Requests that differ in
    nothing else (fit's ZeRO-3 strategies with and without offload under one framework) have one
    replay."""
    units = rank_parameter_units(request)
    return (units, _fuses_qkv(request), request.training.torch_multihead_attention, request.model.tied_embeddings,
            element_bytes(request.training.precision, request.convention).compute_parameter,
            gradient_wire_bytes(request), persistence_threshold(request), request.shard_group_size,
            request if _quantizes(units) else None,
            request.training.activation_checkpointing is ActivationCheckpointing.full,
            holds_recomputed_frozen(request.training), embedding_backward_fetched(request), resets_counter_at_forward(request),
            max_live_parameters(request), prefetch_bucket_elements(request), max_reuse_distance(request))


_REPLAYS: dict[tuple, Replay] = {}
"""(_replay_key, counter_start) -> the replay (a 70B model's costs ~15 ms)."""
_REPLAYS_LIMIT = 256


def replay(request: PlanRequest, counter_start: int | None = None) -> Replay:
    """The coordinator's step, fetch by fetch (the module docstring's rules), in the micro-batch
    after an optimizer step (counter_start: where __n_available_params starts; None:
    initial_counter). Kept by what it reads of the request (_replay_key)."""
    key = (_replay_key(request), counter_start)
    found = _REPLAYS.get(key)
    if found is None:
        if len(_REPLAYS) >= _REPLAYS_LIMIT:
            _REPLAYS.clear()
        found = _REPLAYS[key] = _replay(request, counter_start)
    return found


def _replay(request: PlanRequest, counter_start: int | None) -> Replay:
    """replay, computed: reads of ``request`` only what _replay_key holds."""
    modules, params, blocks, token_module = _modules(request)
    skipped = frozenset() if token_module is None or embedding_backward_fetched(request) else frozenset((token_module,))
    trace = _trace(request, modules, blocks, skipped)
    forward_steps = next(step for step, (m, backward) in enumerate(trace) if backward)
    ids = [own for _, own in modules] + [[]]  # ids[-1]: a container's
    limit, bucket, reuse = max_live_parameters(request), prefetch_bucket_elements(request), max_reuse_distance(request)
    queue = deque((p, step) for step, (m, _) in enumerate(trace) for p in ids[m])
    available: set[int] = set()
    most_recent = [-1] * len(params)
    gathered = [[0] * len(blocks), [0] * len(blocks)]
    n_available = initial_counter(request) if counter_start is None else counter_start
    peak = held_gathered = after_forward = 0
    # The reuse scan (lines 506-516) walks the trace from the next step, counting every module's
    # elements before it looks at the module: a parameter stays when its next use j satisfies
    # elements[j] - elements[step + 1] < stage3_max_reuse_distance (elements[k]: the trace's
    # elements before step k, a running sum, so the next use decides).
    elements = [0]
    for m, _ in trace:
        elements.append(elements[-1] + sum(params[p].numel for p in ids[m]))
    next_use: list[dict[int, int]] = [{} for _ in trace]
    seen: dict[int, int] = {}
    for step in reversed(range(len(trace))):
        for p in ids[trace[step][0]]:
            if p in seen:
                next_use[step][p] = seen[p]
            seen[p] = step
    order: list[tuple[int, str]] = []
    series: list[int] = []
    holds, held_frozen = holds_recomputed_frozen(request.training), set()

    def gather(p: int, step: int) -> int:
        nonlocal held_gathered
        available.add(p)
        held_gathered += params[p].gathered_bytes
        order.append((step, params[p].name))
        gathered[step >= forward_steps][params[p].unit] += params[p].gathered_bytes
        return params[p].numel

    for step, (m, is_backward) in enumerate(trace):
        for p in ids[m]:
            if p not in available:
                n_available += gather(p, step)
        # The current module's own entries leave the queue (lines 325-336).
        while queue and queue[0][1] <= step:
            p, used_at = queue.popleft()
            most_recent[p] = max(most_recent[p], used_at)
        # Prefetch: whole parameters until at least min(max_live - available, bucket) elements
        # are in flight; available ones are passed over but marked (lines 353-373).
        wanted, fetching = (min(limit - n_available, bucket), 0) if bucket > 0 else (0, 0)
        while queue and fetching < wanted:
            p, used_at = queue.popleft()
            most_recent[p] = max(most_recent[p], used_at)
            if p not in available:
                numel = gather(p, step)
                n_available += numel
                fetching += numel
        held = held_gathered
        if is_backward:
            held += sum(params[p].gradient_bytes for p in ids[m])
        peak = max(peak, held)
        series.append(held)
        # Release after the module's forward or backward, at step_id = step + 1 (lines 487-518).
        if holds and step > forward_steps and not is_backward:
            held_frozen.update(p for p in ids[m] if params[p].gradient_bytes == 0)
        for p in ids[m]:
            if p in held_frozen:
                continue  # attributed to an outer module's backward (holds_recomputed_frozen)
            later = next_use[step].get(p)
            if (most_recent[p] > step + 1 or p not in available
                    or (later is not None and elements[later] - elements[step + 1] < reuse)):
                continue
            available.discard(p)
            held_gathered -= params[p].gathered_bytes
            n_available -= params[p].numel
        if step == forward_steps - 1:
            after_forward = held_gathered
    return Replay(peak, tuple(gathered[0]), tuple(gathered[1]), tuple(order), tuple(series), forward_steps,
                  tuple((p.name, p.gathered_bytes) for p in params), after_forward)


def released_after_forward(request: PlanRequest) -> dict[str, int]:
    """'<unit name>.<tensor name>' -> gathered bytes of each parameter the forward gathered and
    the coordinator released after it: the backward (or a recomputation) gathers it again."""
    found = replay(request)
    forward = {name for step, name in found.gathers if step < found.forward_steps}
    again = {name for step, name in found.gathers if step >= found.forward_steps}
    return {name: size for name, size in found.gathered_bytes if name in forward and name in again}


# DeepSpeed 0.19.8 runtime/zero/parameter_offload.py lines 410-487: the model's own pre-backward
# fetch (PreBackwardFunctionForModule, applied to the model's outputs by its forward hook) runs
# only once the gradient reaches the model's output, after the loss's backward; the last forward
# module's release (partitioned_param_coordinator.py release_sub_module, lines 494-535) is the last
# change before it. So the loss's forward and backward run beside what the forward left gathered. One
# rank gathers nothing: partition_parameters.py all_gather_coalesced (lines 1559-1560) hands a
# partition world of 1 to _no_gather_coalesced, whose NoGatherHandle points param.data at the
# partition itself (lines 61-76).
def loss_gathered_bytes(request: PlanRequest) -> int:
    """The gathered parameters alive at the loss's backward: what the coordinator keeps after the
    forward (0 on one rank, or where the replay does not give the request's gathers)."""
    if not replays_gathers(request) or request.shard_group_size == 1:
        return 0
    return replay(request).after_forward_bytes


def peak_gathered_bytes(request: PlanRequest) -> int:
    """The most the coordinator holds at once: the gathered parameters after a fetch and its
    prefetch, and, at a module's backward, that module's full gradients before they are reduced."""
    return replay(request).peak_bytes


def forward_gather_bytes(request: PlanRequest) -> list[int]:
    """Per unit, the bytes the forward's fetches and prefetches gather."""
    return list(replay(request).forward_gathered_bytes)


def backward_gather_bytes(request: PlanRequest) -> list[int]:
    """Per unit, the bytes the backward (with its recomputation) gathers: what the forward left
    gathered for it gathers nothing."""
    return list(replay(request).backward_gathered_bytes)


def first_module_gathered_bytes(request: PlanRequest, bytes_per_element: int) -> int:
    """The gathered bytes of the forward's first module (its non-persistent parameters), at
    ``bytes_per_element``."""
    threshold = persistence_threshold(request)
    first = rank_parameter_units(request)[0]
    name = _module_name(request, first.tensors[0].name)
    return sum(_gathered_bytes(request, t, bytes_per_element) for t in first.tensors
               if _module_name(request, t.name) == name and ds_numel(request, t) > threshold)
