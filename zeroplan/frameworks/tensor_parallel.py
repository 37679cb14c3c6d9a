"""Run torchtitan's own tensor (and sequence, context, FSDP) parallelism on a fake process group
and record, for rank 0, the model states it holds, what a decoder block keeps for backward and
which collectives a block issues.

Nothing of torchtitan's sharding is re-written here: its Llama-3 config comes from its own
registry (``llama3_configs``), its sharding declarations from ``set_llama3_sharding_config``, and
they are applied by ``Module.parallelize`` / ``parallelize_llama`` on torchtitan's own
``ParallelDims`` meshes, over torch's fake process group (zeroplan.simulate.fake_world). Memory
is counted as zeroplan.frameworks.measure counts it (MemTracker, the difference of a shallow
and a one-block-deeper forward); collectives by zeroplan.simulate.collectives. This module does
not import the planner (zeroplan.core): its records are an independent check of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from zeroplan.frameworks.build import _eager_flex_attention, build_on_meta
from zeroplan.frameworks.parallel_record import (
    ActivationMeasurement,
    ParallelRecord,
    ParamShard,
    SavedTensor,
    collective_counts,
)
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.collectives import CollectiveRecorder
from zeroplan.simulate.fake_world import fake_process_group
from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula
from zeroplan.simulate.record import Phase

HOW = "python benchmarks/parallel_records.py"
DEFAULT_LAYERS = 2
"""Blocks of the shallow run; the deep run has one more. The retained difference is one block
whatever the depth (the block mask and the logits are the same in both runs)."""
PARAM_DTYPE = torch.float32
"""torchtitan 0.3.0 config/configs.py TrainingConfig.dtype default "float32": the trainer builds
the model in fp32 (trainer.py: utils.set_default_dtype(TORCH_DTYPE_MAP[training.dtype]))."""
COMPUTE_DTYPE = torch.bfloat16
"""torchtitan 0.3.0 config/configs.py mixed_precision_param default "bfloat16": FSDP2's
MixedPrecisionPolicy hands the blocks bf16 parameters, so the activations are bf16. The
activation runs build the module in bf16 instead of wrapping it in FSDP2 (as
zeroplan.frameworks.measure does for torchtitan)."""


def _part(fqn: str) -> str:
    # torchtitan 0.3.0 models/common/decoder.py Decoder.__init__: tok_embeddings, layers, norm, lm_head.
    if fqn.startswith("tok_embeddings."):
        return "embedding"
    if fqn.startswith("layers."):
        return "block"
    if fqn.startswith("norm."):
        return "norm"
    return "output"


def llama3_config(flavor: str, layers: int, seq_len: int, enable_sp: bool):
    """torchtitan's own Llama-3 config for ``flavor`` with its first ``layers`` blocks, its RoPE
    cache sized to ``seq_len`` and its sharding declarations filled in; and the flavour's depth."""
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    # torchtitan 0.3.0 models/llama3/__init__.py model_registry: llama3_configs[flavor](attn_backend)
    # with the default attn_backend "flex".
    config = llama3_configs[flavor](attn_backend="flex")
    full_depth = len(config.layers)
    config.layers = config.layers[:layers]
    # torchtitan 0.3.0 models/llama3/model.py Llama3Model.Config.update_from_config does two things
    # for a trainer: Decoder.Config.update_from_config resizes every RoPE cache to
    # training.seq_len, then set_llama3_sharding_config(enable_sp=enable_sequence_parallel). The
    # method itself imports torchtitan.trainer (which needs torchdata); its two effects are called
    # directly.
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config, full_depth


@contextlib.contextmanager
def torchtitan_world(tp: int, dp_shard: int = 1, cp: int = 1, enable_sp: bool = True,
                     spmd_backend: str = "spmd_types") -> Iterator[tuple[object, object]]:
    """Rank 0 of a fake process group of dp_shard x cp x tp ranks, with torchtitan's own
    ParallelDims meshes built over it; yields (parallel_dims, parallelism config)."""
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(tensor_parallel_degree=tp, data_parallel_shard_degree=dp_shard,
                                    context_parallel_degree=cp, enable_sequence_parallel=enable_sp,
                                    spmd_backend=spmd_backend)
    with torchtitan_parallel_world(parallelism, tp * dp_shard * cp) as parallel_dims:
        yield parallel_dims, parallelism


@contextlib.contextmanager
def torchtitan_parallel_world(parallelism, world_size: int) -> Iterator[object]:
    """Rank 0 of a fake process group of ``world_size`` ranks with torchtitan's ParallelDims for
    ``parallelism`` (its ParallelismConfig) built over it, as its trainer sets them up; yields
    the ParallelDims."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    # torchtitan 0.3.0 tools/utils.py: device_type is the available accelerator, or "cuda" when
    # there is none; ParallelDims.build_mesh builds its meshes on it. The fake group runs on CPU.
    original_device_type = parallel_dims_module.device_type
    parallel_dims_module.device_type = "cpu"
    # torchtitan 0.3.0 trainer.py: dist_utils.set_spmd_backend(parallelism.spmd_backend) after
    # init_distributed, which also turns off autograd's multithreading so that a backward
    # recompute sees the thread-local SPMD mesh (distributed/utils.py init_distributed).
    previous_backend = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    torch.autograd.set_multithreading_enabled(False)
    try:
        with fake_process_group(world_size, 0):
            parallel_dims = ParallelDims.from_config(parallelism, world_size)
            parallel_dims.build_mesh()
            yield parallel_dims
    finally:
        parallel_dims_module.device_type = original_device_type
        dist_utils.set_spmd_backend(previous_backend)
        torch.autograd.set_multithreading_enabled(True)


def parameter_shards(module: torch.nn.Module, global_shapes: dict[str, list[int]]) -> list[ParamShard]:
    """Every parameter of ``module`` as this rank holds it (a DTensor's local shard), by its
    name without the checkpoint wrapper's extra level."""
    shards = []
    for fqn, param in module.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "")
        local = param.to_local() if hasattr(param, "to_local") else param
        shards.append(ParamShard(
            fqn=fqn, part=_part(fqn), global_shape=global_shapes[fqn], local_shape=list(local.shape),
            dtype=str(local.dtype), local_bytes=local.numel() * local.element_size(),
            placements=str(tuple(param.placements)) if hasattr(param, "placements") else "",
        ))
    return shards


def global_parameter_shapes(config) -> dict[str, list[int]]:
    """Every parameter's shape in the unsharded model the config builds (on meta)."""
    with torch.device("meta"):
        plain = config.build()
    return {fqn: list(p.shape) for fqn, p in plain.named_parameters()}


def measure_states(flavor: str, tp: int, dp_shard: int = 1, enable_sp: bool = True,
                   layers: int = DEFAULT_LAYERS, spmd_backend: str = "spmd_types") -> ParallelRecord:
    """The parameters rank 0 holds after torchtitan's parallelize_llama (TP, then FSDP2 over
    dp_shard), built in the trainer's fp32."""
    from importlib.metadata import version

    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    start_s = time.perf_counter()
    config, full_depth = llama3_config(flavor, layers, 8192, enable_sp)
    global_shapes = global_parameter_shapes(config)
    notes = []
    training = TrainingConfig()
    calls = (f"set_llama3_sharding_config(enable_sp={enable_sp}), parallelize_llama(parallel_dims; "
             f"mixed_precision_param={training.mixed_precision_param}, "
             f"mixed_precision_reduce={training.mixed_precision_reduce})")
    with torchtitan_world(tp, dp_shard, 1, enable_sp, spmd_backend) as (parallel_dims, parallelism):
        with torch.device("meta"):
            model = config.build().to(PARAM_DTYPE)
        try:
            # torchtitan 0.3.0 models/llama3/parallelize.py parallelize_llama: TP by
            # model.parallelize(parallel_dims), then apply_fsdp_to_decoder over the dp mesh with the
            # training config's mixed precision (always, even at dp_shard 1: it installs the policy).
            parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder="")
        except ValueError as error:
            if spmd_backend != "spmd_types":
                raise
            # Under spmd_types the TP shards are plain tensors with SPMD annotations, which the
            # installed torch's fully_shard (given dp_mesh_dims by resolve_fsdp_mesh) refuses; the
            # TP step alone is what parallelize_llama runs before it.
            notes.append(f"parallelize_llama refused at apply_fsdp_to_decoder -> fully_shard: {error}; "
                         "model states after its TP step, model.parallelize(parallel_dims), instead")
            calls = f"set_llama3_sharding_config(enable_sp={enable_sp}), model.parallelize(parallel_dims)"
            with torch.device("meta"):
                model = config.build().to(PARAM_DTYPE)
            model.parallelize(parallel_dims)
        params = parameter_shards(model, global_shapes)
    return ParallelRecord(
        framework_version=f"torchtitan {version('torchtitan')}", torch_version=torch.__version__, flavor=flavor,
        **_dims(config, full_depth), spmd_backend=parallelism.spmd_backend, tp=tp, dp_shard=dp_shard, cp=1,
        sequence_parallel=enable_sp, world_size=tp * dp_shard, rank=0, parallelize=calls,
        param_dtype=str(PARAM_DTYPE), params=params, built_layers=layers,
        wall_time_s=time.perf_counter() - start_s, how=HOW, notes=notes,
    )


def _dims(config, full_depth: int) -> dict[str, int]:
    attention = config.layers[0].attention
    feed_forward = config.layers[0].feed_forward
    return dict(dim=config.dim, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads or attention.n_heads,
                ffn_hidden=feed_forward.w1.out_features, vocab_size=config.vocab_size, n_layers_full=full_depth)


@dataclasses.dataclass
class _Run:
    retained: int
    growth: list[int]
    collectives: list[tuple]
    saved: list[SavedTensor]
    params: list[ParamShard]


def measure_activations(flavor: str, tp: int, enable_sp: bool, seq_len: int, micro_batch: int = 1,
                        policy: str = "none", cp: int = 1, layers: int = DEFAULT_LAYERS,
                        norm_formula: str = "cpu", spmd_backend: str = "spmd_types", dp_shard: int = 1) -> ParallelRecord:
    """Forward and backward of torchtitan's TP model with ``layers`` and ``layers + 1`` blocks
    on rank 0 of a fake group of dp_shard x cp x tp ranks; ``norm_formula`` "cuda" makes
    F.rms_norm save what torch's fused CUDA kernel saves (zeroplan.simulate.fused_rms_norm).
    With ``dp_shard`` > 1 the whole parallelize_llama runs (FSDP2 on top; partial_dtensor only,
    no checkpointing)."""
    from importlib.metadata import version

    if dp_shard > 1 and (spmd_backend != "partial_dtensor" or policy != "none"):
        # See measure_states: under spmd_types the installed torch's fully_shard refuses TP's
        # plain shards.
        raise ValueError("FSDP2 on top of TP runs only under spmd_backend='partial_dtensor', without checkpointing")

    start_s = time.perf_counter()
    _eager_flex_attention()
    norms = cuda_rms_norm_formula if norm_formula == "cuda" else contextlib.nullcontext
    with norms():
        runs = [_run(flavor, tp, enable_sp, seq_len, micro_batch, policy, cp, depth, spmd_backend, dp_shard)
                for depth in (layers, layers + 1)]
    shallow, deep = runs
    config, full_depth = llama3_config(flavor, layers, seq_len, enable_sp)
    block = _subtract(deep.collectives, shallow.collectives)
    fsdp = dp_shard > 1
    notes = [
        ("FSDP2 (apply_fsdp_to_decoder) over fp32 parameters: the blocks compute on the bf16 parameters its "
         "MixedPrecisionPolicy gathers; the live bytes include the unsharded parameters of the units it does "
         "not reshard after forward (final norm + lm_head), the same at both depths" if fsdp else
         "activations: a bf16 module (what FSDP2's MixedPrecisionPolicy hands the blocks), without FSDP2"),
        "FlexAttention run eagerly: each block also keeps its fp32 max_scores (4 bytes x local heads x "
        "tokens), which a compiled run does not (zeroplan/frameworks/build.py _eager_flex_attention)",
        "backward seeded by the local logits' sum (the loss's own bytes and collectives are not measured)",
    ]
    if cp > 1 and spmd_backend != "spmd_types":
        notes.append(
            "apply_cp_to_forward all-gathers K and V through torch's custom op cplib::flex_cp_allgather "
            "(torch/distributed/tensor/experimental/_context_parallel/_cp_custom_ops.py); under fake tensors "
            "its registered fake implementation runs instead of its body, so its all-gathers (and the "
            "reduce-scatters of its backward) are not among the recorded collectives; the gathered K and V "
            "are in block_saved")
    activations = ActivationMeasurement(
        micro_batch_size=micro_batch, seq_len=seq_len, activation_checkpointing=policy, module_dtype=str(COMPUTE_DTYPE),
        norm_formula=norm_formula, layers=[layers, layers + 1], retained_bytes=[shallow.retained, deep.retained], block_growth_bytes=deep.growth,
        block_saved=deep.saved, block_collectives=collective_counts(block), model_collectives=collective_counts(deep.collectives),
        backward_ran=True,  # _run raises if backward does
    )
    return ParallelRecord(
        framework_version=f"torchtitan {version('torchtitan')}", torch_version=torch.__version__, flavor=flavor,
        **_dims(config, full_depth), spmd_backend=spmd_backend, tp=tp, dp_shard=dp_shard, cp=cp,
        sequence_parallel=enable_sp, world_size=tp * cp * dp_shard, rank=0,
        parallelize=f"set_llama3_sharding_config(enable_sp={enable_sp}), "
                    + ("apply_cp_to_forward(inner attentions, cp mesh), " if cp > 1 and spmd_backend != "spmd_types" else "")
                    + ("parallelize_llama(parallel_dims; mixed_precision_param=bfloat16, mixed_precision_reduce=float32)"
                       if fsdp else "model.parallelize(parallel_dims)")
                    + ("" if policy == "none" else f", {_AC_NAMES[policy]}.apply(model)"),
        param_dtype=str(PARAM_DTYPE if fsdp else COMPUTE_DTYPE), params=shallow.params, built_layers=layers, activations=activations,
        wall_time_s=time.perf_counter() - start_s, how=HOW, notes=notes,
    )


_AC_NAMES = {"full": "FullAC", "selective-op": "SelectiveAC"}


def step_inputs(module: torch.nn.Module, tokens: torch.Tensor, parallel_dims, cp: int) -> tuple:
    """(tokens, positions, block mask) as torchtitan 0.3.0's trainer.py post_dataloading_process
    hands them to the model: positions per document (one here) and the block mask
    model.get_attention_masks builds from them (once per step, shared by every block); with CP,
    prepare_context_parallel_input shards tokens, labels, positions and the mask over the cp mesh
    with the configured load balancer (config/configs.py default "headtail")."""
    micro_batch, seq_len = tokens.shape
    positions = torch.arange(seq_len).repeat(micro_batch, 1)
    masks = module.get_attention_masks(positions)
    if cp > 1:
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input

        private.context_parallel_block_mask_without_compile()
        tokens, _, extra = prepare_context_parallel_input(
            tokens, tokens.clone(), {"positions": positions, "attention_masks": masks},
            parallel_dims.get_mesh("cp"), torch.device("cpu"), "headtail")
        positions, masks = extra["positions"], extra["attention_masks"]
    return tokens, positions, masks


def _subtract(deep: list[tuple], shallow: list[tuple]) -> list[tuple]:
    from collections import Counter

    remaining = Counter(deep)
    remaining.subtract(Counter(shallow))
    if any(n < 0 for n in remaining.values()):
        raise RuntimeError("the shallow run issued a collective the deep run did not: no per-block difference")
    return list(remaining.elements())


def _key(record, phase: str) -> tuple:
    return (phase, record.kind.value, record.op, record.dtype, record.input_elements * record.element_bytes,
            record.output_elements * record.element_bytes, record.group_size)


def _run(flavor: str, tp: int, enable_sp: bool, seq_len: int, micro_batch: int, policy: str, cp: int,
         layers: int, spmd_backend: str = "spmd_types", dp_shard: int = 1) -> _Run:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    import spmd_types as spmd

    config, _ = llama3_config(flavor, layers, seq_len, enable_sp)
    global_shapes = global_parameter_shapes(config)
    with torchtitan_world(tp, dp_shard, cp, enable_sp, spmd_backend) as (parallel_dims, parallelism):
        module = build_on_meta(config, PARAM_DTYPE if dp_shard > 1 else COMPUTE_DTYPE)
        # torchtitan 0.3.0 models/llama3/parallelize.py parallelize_llama: under spmd_types,
        # model.parallelize(parallel_dims) (CP is declared in the inner attention's sharding);
        # under partial_dtensor, apply_cp_to_forward on every inner attention when CP is on and
        # model.parallelize(parallel_dims) when TP is on; then ac_config.build().apply(model).
        if dp_shard > 1:
            from torchtitan.config import CompileConfig, TrainingConfig
            from torchtitan.models.llama3 import parallelize_llama

            parallelize_llama(module, parallel_dims=parallel_dims, training=TrainingConfig(), parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder="")
        else:
            if cp > 1 and spmd_backend != "spmd_types":
                from torchtitan.distributed.context_parallel import apply_cp_to_forward

                apply_cp_to_forward([block.attention.inner_attention for block in module.layers.values()],
                                    parallel_dims.get_mesh("cp"))
            if spmd_backend == "spmd_types" or parallel_dims.tp_enabled:
                module.parallelize(parallel_dims)
        if policy == "full":
            FullAC(FullAC.Config()).apply(module)
        elif policy == "selective-op":
            SelectiveAC(SelectiveAC.Config()).apply(module)
        params = parameter_shards(module, global_shapes)
        # trainer.py: loss.backward() under spmd.no_typecheck().
        step = fake_step(module, parallel_dims, config.vocab_size, micro_batch, seq_len, cp, backward=spmd.no_typecheck)
    return _Run(*step, params)


def fake_step(module: torch.nn.Module, parallel_dims, vocab_size: int, micro_batch: int, seq_len: int, cp: int = 1,
              outer: tuple = (), inner: tuple = (), backward=contextlib.nullcontext) -> tuple[int, list[int], list[tuple], list[SavedTensor]]:
    """One forward and backward of the parallelized ``module`` on fake tensors: the bytes its
    forward left live, each block's growth after the first, its collectives and what its last
    block saved. ``outer`` and ``inner``: contexts entered for the step before and after the
    tracker and the recorder; ``backward``: the context of loss.backward()."""
    from torchtitan.distributed import utils as dist_utils

    # torchtitan 0.3.0 trainer.py _forward_backward_body runs under train_context,
    # distributed/utils.py get_spmd_context: the SPMD meshes registered and the dense mesh current.
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    blocks = list(module.layers.values())
    with private.fake_tensor_mode():
        module.to_empty(device="cpu")
        tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
        tracker = private.live_bytes_tracker()
        recorder = private.passing_higher_order_ops(CollectiveRecorder())
        marks: list[int] = []
        for block in blocks:
            block.register_forward_hook(lambda *_: marks.append(private.tracker_live_bytes(tracker)))
        saved = _SavedInLastBlock(blocks[-1], module)
        private.track_existing(tracker, module)
        with context():
            tokens, positions, masks = step_inputs(module, tokens, parallel_dims, cp)
        with context(), contextlib.ExitStack() as inside:
            for mode in (*outer, tracker, recorder, *inner):
                inside.enter_context(mode)
            before = private.tracker_live_bytes(tracker)
            recorder.phase = Phase.forward
            with saved:
                output = module(tokens, positions=positions, attention_masks=masks)
            retained = private.tracker_live_bytes(tracker) - before
            recorder.phase = Phase.backward
            with backward():
                output.sum().backward()
            del output
    collectives = [_key(r, r.phase.value) for r in recorder.records]
    growth = [marks[k] - marks[k - 1] for k in range(1, len(marks))]
    return retained, growth, collectives, saved.tensors()


class _SavedInLastBlock:
    """Autograd saved-tensor hooks that note each distinct storage saved while ``block`` runs,
    with the innermost module of the block running at the time; parameters (sharded or
    FSDP2's unsharded ones) are left out."""

    def __init__(self, block: torch.nn.Module, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        self.inside = False
        self.found: dict[int, SavedTensor] = {}
        # A storage saved into a graph branch the forward drops is freed during the block, and
        # its address (storage_key) may pass to a storage saved later: identities never reused.
        self.identity = private.StorageIdentities()
        self.model = model
        for name, submodule in block.named_modules():
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_checkpoint_wrapped_module", "")
            submodule.register_forward_pre_hook(lambda *_, n=name: self._enter(n))
            submodule.register_forward_hook(lambda *_: self._leave())
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _enter(self, name: str) -> None:
        self.stack.append(name)

    def _leave(self) -> None:
        # A forward hook's return value would replace the module's output.
        self.stack.pop()

    def _pack(self, saved: torch.Tensor) -> torch.Tensor:
        # A DTensor (the partial_dtensor backend) reports its global shape; the rank keeps its
        # local tensor.
        tensor = private.dtensor_local_storage(saved)
        if self.stack and isinstance(tensor, torch.Tensor):
            key = self.identity(tensor)
            # The parameters as the module holds them now: FSDP2 swaps in its unsharded ones
            # for the forward.
            params = {self.identity(private.dtensor_local_storage(p)) for p in self.model.parameters()}
            if key not in params and key not in self.found:
                self.found[key] = SavedTensor(module=self.stack[-1], shape=list(tensor.shape), dtype=str(tensor.dtype),
                                              nbytes=tensor.untyped_storage().nbytes())
        return saved

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def tensors(self) -> list[SavedTensor]:
        return list(self.found.values())
