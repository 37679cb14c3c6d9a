"""What a compiled decoder block saves for backward under torchtitan's own tensor (with or without
sequence) and context parallelism, and what torchtune's activation offloading moves under
compile, measured on fake tensors as zeroplan.frameworks.compiled measures a data-parallel block.

Parallel blocks: torchtitan 0.3.0's Llama-3 config from its registry, one block deep at full
width, sharded by torchtitan's own calls on rank 0 of a fake tp x cp process group
(zeroplan.frameworks.tensor_parallel: ``set_llama3_sharding_config``, ``model.parallelize`` under
its default spmd_types backend, which also declares CP in the inner attention; its FullAC /
SelectiveAC), in the order models/llama3/parallelize.py parallelize_llama applies them (TP, then
checkpointing, then apply_compile per block). The block's inputs are those the model's forward
hands it under torchtitan's SPMD context (with CP, after prepare_context_parallel_input shards
tokens, positions and the block mask); then zeroplan.frameworks.compiled.block_saves compiles it
as apply_compile does (inductor's partitioner, no code generation) and runs it eagerly. Saved
values are the rank's local tensors. Float8: torchtitan's own Float8Linear.Config swapped into
the config before the sharding is set (torchtitan_float8_swap), as its model registry converts
before its trainer shards.

Pipeline parallelism is not run here: torchtitan 0.3.0 distributed/pipeline_parallel.py
pipeline_llm calls the same parallelize_fn (parallelize_llama, apply_compile included) on each
stage's model part, so a stage's block is this block at the micro-batch's shape.

Offloading: torchtune 0.6.1's model with full checkpointing and OffloadActivations
(zeroplan.frameworks.build, offloading on), every TransformerSelfAttentionLayer compiled as
training/_compile.py compile_model compiles it (``m.compile(backend=...)``, the checkpoint
wrapper outside), forward only (its backward's unpack copies to "cuda"): the host bytes it
moved and the compiled layer's partition.
"""

from __future__ import annotations

import time

import torch

from zeroplan.frameworks.compiled import block_inputs_of, block_saves, partition_saved_values
from zeroplan.frameworks.compiled_parallel_record import CompiledOffloadRecord, CompiledParallelBlockRecord
from zeroplan.frameworks.compiled_record import SavedValue
from zeroplan.simulate import _torch_private as private
from zeroplan.specs.finetune import FineTuneSpec

HOW = "python benchmarks/compiled_parallel_records.py"
PRESETS = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}
"""torchtitan flavour -> the preset with its dimensions."""


def measure_parallel_compiled_block(flavor: str, tp: int, enable_sp: bool, seq_len: int, policy: str = "none",
                                    cp: int = 1, micro_batch: int = 1,
                                    float8_recipe: str | None = None) -> CompiledParallelBlockRecord:
    """One torchtitan block on rank 0 of a fake tp x cp group, eager and compiled."""
    from importlib.metadata import version

    from zeroplan.presets.models import get_model
    from zeroplan.specs import ActivationCheckpointing, BatchSpec

    start_s = time.perf_counter()
    notes: list[str] = []
    saves, calls = {}, ""
    for compiled in (False, True):
        saves[compiled], calls = _run(flavor, tp, enable_sp, seq_len, micro_batch, policy, cp, compiled, float8_recipe, notes)
    compiled_saves = saves[True]
    return CompiledParallelBlockRecord(
        framework_version=f"torchtitan {version('torchtitan')}", torch_version=torch.__version__,
        model=get_model(PRESETS[flavor]), flavor=flavor, activation_checkpointing=ActivationCheckpointing(policy),
        float8_recipe=float8_recipe, batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), tp=tp,
        sequence_parallel=enable_sp, cp=cp, spmd_backend="spmd_types", parallelize=calls,
        compiled_saved_values=compiled_saves.values, compiled_runtime_saved_bytes=compiled_saves.bytes,
        eager_live_bytes=saves[False].bytes, wall_time_s=time.perf_counter() - start_s, how=HOW,
        notes=list(dict.fromkeys(notes)),
    )


def _run(flavor: str, tp: int, enable_sp: bool, seq_len: int, micro_batch: int, policy: str, cp: int, compiled: bool,
         float8_recipe: str | None, notes: list[str]):
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from zeroplan.frameworks.build import _eager_flex_attention, build_on_meta
    from zeroplan.frameworks.tensor_parallel import COMPUTE_DTYPE, llama3_config, torchtitan_world

    torch._dynamo.reset()
    # torchtitan compiles its FlexAttention and create_block_mask itself; on fake tensors the
    # uncompiled functions run (zeroplan/frameworks/build.py), and dynamo traces flex_attention
    # inside the compiled block as the higher-order op it is.
    _eager_flex_attention()
    config, _ = llama3_config(flavor, 1, seq_len, enable_sp)
    calls = [f"set_llama3_sharding_config(enable_sp={enable_sp})"]
    if float8_recipe is not None:
        notes.append(torchtitan_float8_swap(config, float8_recipe))
        # torchtitan 0.3.0: the model registry converts the config (models/llama3/__init__.py,
        # converter.convert(config)) before the trainer's update_from_config sets the sharding
        # (trainer.py), so the swapped Float8Linear.Config gets the same declarations.
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=enable_sp)
        calls = [f"Float8LinearConverter.convert(config) as torchtitan's, recipe {float8_recipe}", *calls]
    with torchtitan_world(tp, 1, cp, enable_sp) as (parallel_dims, _):
        module = build_on_meta(config, COMPUTE_DTYPE)
        # torchtitan 0.3.0 parallelize_llama under spmd_types: model.parallelize(parallel_dims),
        # then ac_config.build().apply(model), then apply_compile.
        module.parallelize(parallel_dims)
        calls.append("model.parallelize(parallel_dims)")
        if policy == "full":
            FullAC(FullAC.Config()).apply(module)
            calls.append("FullAC.apply(model)")
        elif policy == "selective-op":
            SelectiveAC(SelectiveAC.Config()).apply(module)
            calls.append("SelectiveAC.apply(model)")
        calls.append("block.compile(fullgraph=True) as apply_compile")
        context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
        block = next(iter(module.layers.values()))
        with private.fake_tensor_mode():
            module.to_empty(device="cpu")
            with context():
                hidden, rest, kwargs = _block_inputs(module, block, config.vocab_size, seq_len, micro_batch, cp, parallel_dims)
                saves = block_saves(block, hidden, rest, kwargs, compiled=compiled, listed=False)
    return saves, ", ".join(calls)


def torchtitan_float8_swap(config, recipe: str) -> str:
    """torchtitan 0.3.0 components/quantization/float8.py Float8LinearConverter.convert on a
    model config: every Linear.Config its module_filter_fn admits becomes its own
    Float8Linear.Config with torchao's Float8LinearConfig for ``recipe``. The converter's
    constructor (SM89 check) is not run; its module is loaded as its package imports it (the
    package's next import, its mx module, fails on the installed triton after float8 loaded)."""
    import sys

    from torchtitan.models.common.linear import Linear

    from zeroplan.frameworks.float8 import _torchtitan_filter, float8_config

    try:
        import torchtitan.components.quantization  # noqa: F401
    except ValueError:
        pass
    float8_module = sys.modules["torchtitan.components.quantization.float8"]
    torchao_config = float8_config(recipe)
    module_filter_fn = _torchtitan_filter()
    swapped = []
    for fqn, linear_config, parent, attr in config.traverse(Linear.Config):
        if module_filter_fn(linear_config, fqn, []):
            new_config = float8_module.Float8Linear.Config(
                in_features=linear_config.in_features, out_features=linear_config.out_features,
                bias=linear_config.bias, param_init=linear_config.param_init, _torchao_config=torchao_config)
            if isinstance(parent, list):
                parent[attr] = new_config
            else:
                setattr(parent, attr, new_config)
            swapped.append(fqn)
    return f"torchtitan Float8Linear.Config (torchao Float8LinearConfig recipe {recipe}) for {', '.join(swapped)}"


def _block_inputs(module, block, vocab_size: int, seq_len: int, micro_batch: int, cp: int, parallel_dims):
    """What the model's forward hands its first block (a forward pre-hook, the forward stopped
    there), after torchtitan's trainer prepared the inputs (trainer.py post_dataloading_process:
    per-document positions, the block mask, with CP their shards)."""
    from zeroplan.frameworks.tensor_parallel import step_inputs

    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
    tokens, positions, masks = step_inputs(module, tokens, parallel_dims, cp)
    return block_inputs_of(block, lambda: module(tokens, positions=positions, attention_masks=masks))


def measure_compiled_offload(model_name: str, seq_len: int, micro_batch: int = 1,
                             depths: tuple[int, int] = (2, 3), finetune: FineTuneSpec = FineTuneSpec()) -> CompiledOffloadRecord:
    """torchtune's offloading with full checkpointing, eager and with every layer compiled;
    ``finetune``: its LoRA/QLoRA model (zeroplan.frameworks.lora), as its LoRA recipes wrap it."""
    from importlib.metadata import version

    from zeroplan.presets.models import get_model
    from zeroplan.specs import ActivationCheckpointing, BatchSpec

    start_s = time.perf_counter()
    model = get_model(model_name)
    runs = {(compiled, layers): _offload_run(model, layers, seq_len, micro_batch, compiled, finetune)
            for compiled in (False, True) for layers in depths}
    graphs, partitions = runs[(True, depths[-1])][1:]
    return CompiledOffloadRecord(
        framework_version=f"torchtune {version('torchtune')}", torch_version=torch.__version__, model=model,
        finetune=finetune, batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), activation_checkpointing=ActivationCheckpointing.full,
        layers=list(depths), eager_host_bytes=[runs[(False, n)][0] for n in depths],
        compiled_host_bytes=[runs[(True, n)][0] for n in depths],
        dynamo_graphs=graphs,
        # The last graph compiled is the one the deeper layers run (their input needs a gradient);
        # with a frozen embedding the first layer's input needs none and dynamo compiles it apart.
        compiled_layer_saved_values=partitions[-1],
        compiled_first_layer_saved_values=partitions[0] if len(partitions) > 1 else [],
        wall_time_s=time.perf_counter() - start_s, how=HOW,
        notes=["torchtune 0.6.1 training/_compile.py compile_model compiles each TransformerSelfAttentionLayer "
               "(m.compile(backend), no fullgraph), inside the CheckpointWrapper set_activation_checkpointing put "
               "around it: the checkpoint's saved-tensor hooks drop what the compiled layer saves in forward and "
               "its recompute in backward runs the compiled layer again",
               "forward only: OffloadActivations' unpack in backward copies to 'cuda', which a CPU run lacks",
               *_offload_finetune_notes(model, finetune)],
    )


def _offload_finetune_notes(model, finetune: FineTuneSpec) -> list[str]:
    if finetune.trains_everything:
        return []
    notes = ["the embedding is frozen: the first layer's input needs no gradient, dynamo compiles that layer "
             "as a graph of its own (compiled_first_layer_saved_values: no input, no first-norm rsqrt) and the "
             "deeper layers share the second"]
    if model.tied_embeddings:
        notes.append("built as zeroplan.frameworks.lora builds torchtune's LoRA model (lora_llama3_1's component "
                     "builder at this model's sizes, an untied output): the same TransformerSelfAttentionLayer; "
                     "get_act_offloading_ctx_manager puts a TiedLinear's linear under NoOpManager as it does an "
                     "untied output")
    return notes


def _offload_run(model, layers: int, seq_len: int, micro_batch: int, compiled: bool,
                 finetune: FineTuneSpec = FineTuneSpec()) -> tuple[int, int, list[list[SavedValue]]]:
    """(host bytes after the forward, dynamo graphs, each compiled partition's saved values in
    the order dynamo compiled them)."""
    from torchtune import modules

    from zeroplan.frameworks.build import build
    from zeroplan.specs import ActivationCheckpointing
    from zeroplan.specs.framework import Framework

    torch._dynamo.reset()
    built = build(Framework.torchtune, model, layers, ActivationCheckpointing.full, torch.bfloat16, seq_len,
                  activation_offloading=True, finetune=finetune)
    built.materialize()
    graphs: list[list[tuple[str, object]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(private.dynamo_graph_inputs(gm))
        return private.inductor_without_codegen(gm, example_inputs)

    if compiled:
        # torchtune 0.6.1 training/_compile.py compile_model, its default per-layer compile.
        for submodule in reversed(list(built.module.modules())):
            if isinstance(submodule, modules.TransformerSelfAttentionLayer):
                submodule.compile(backend=backend)
    with private.recording_inductor_partitions() as partitions, private.fake_tensor_mode():
        built.to_empty(device="cpu")
        tokens = torch.randint(0, model.vocab_size, (micro_batch, seq_len))
        hidden_inputs: list[torch.Tensor] = []
        handles = [block.register_forward_pre_hook(lambda _m, args: hidden_inputs.append(args[0]))
                   for block in built.blocks]
        built.forward(tokens)
        for handle in handles:
            handle.remove()
        host = built.host_bytes()
    saved: list[list[SavedValue]] = []
    # One partition per dynamo graph, compiled in order on the first layer that needs it (graph i
    # on layer i while each layer compiles a new one).
    for (forward, _, user_outputs), inputs, hidden in zip(partitions if compiled else [], graphs, hidden_inputs):
        values = partition_saved_values(forward, user_outputs, inputs, hidden)
        # partition_saved_values knows the hidden input by identity; the compiled layer's first
        # graph input is the hidden state (dynamo source L['x']).
        saved.append([v.model_copy(update={"kind": "hidden"}) if v.op == "input L['x']" else v for v in values])
    return host, len(graphs), saved

