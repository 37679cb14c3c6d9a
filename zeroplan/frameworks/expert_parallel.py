"""Run torchtitan's own expert parallelism (EP, FSDP2 on top) on a fake process group and record,
for rank 0, the parameters it holds, what one MoE block keeps for backward and which collectives
(the token all-to-alls among them) a MoE block issues.

Nothing of torchtitan's placement is re-written here: the model is its DeepSeek-V3 (or Qwen3)
config from its own registry (``deepseekv3_configs``, ``qwen3_configs``), its sharding
declarations come from ``set_deepseek_v3_sharding_config(enable_ep=True)`` (``set_qwen3_...``),
and ``parallelize_deepseekv3`` (``parallelize_qwen3``) applies EP (``model.parallelize``) and
FSDP2 (the routed experts over efsdp, the rest over fsdp) on torchtitan's own ``ParallelDims``
meshes, over torch's fake process group.
Memory and collectives are counted as zeroplan.frameworks.tensor_parallel counts them. Two
things fake tensors cannot do are supplied (each recorded in the record's notes):

- the all-to-all split sizes: torchtitan's AllToAllTokenDispatcher reads them with ``.tolist()``
  (a value read a fake tensor has no answer for). The routing is made balanced with torchtitan's
  own option (``debug.moe_force_load_balance`` -> ``router._debug_force_load_balance``:
  round-robin experts), the split sizes are computed by torchtitan's own router on real CPU
  tensors of the same token count, and the fake run's reads are answered with them
  (_torch_private.ScalarReads);
- the router's fp32 autocast, which torch disables on the CPU and a GPU keeps
  (_torch_private.cpu_autocast_float32).

This module does not import the planner (zeroplan.core).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from zeroplan.frameworks.build import _eager_flex_attention, build_on_meta
from zeroplan.frameworks.expert_record import ExpertParallelRecord
from zeroplan.frameworks.parallel_record import ActivationMeasurement, collective_counts
from zeroplan.frameworks.tensor_parallel import (
    COMPUTE_DTYPE, PARAM_DTYPE, _Run as _ParallelRun, _subtract, fake_step, global_parameter_shapes, parameter_shards,
    torchtitan_parallel_world,
)
from zeroplan.simulate import _torch_private as private

HOW = "python benchmarks/expert_records.py"
BACKEND = "partial_dtensor"
"""torchtitan 0.3.0's default spmd_backend "spmd_types" leaves the EP shards plain tensors with
SPMD annotations, which the installed torch's fully_shard (given dp_mesh_dims by
resolve_fsdp_mesh) refuses ("all parameters must be DTensors on the full SPMD mesh"); under
"partial_dtensor" parallelize_deepseekv3 runs whole (EP as DTensors, then FSDP2)."""


def _family(family: str):
    """torchtitan 0.3.0's config registry, sharding declarations and parallelize function of a
    MoE model package."""
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_configs, parallelize_deepseekv3
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        return deepseekv3_configs, set_deepseek_v3_sharding_config, parallelize_deepseekv3
    if family == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3, qwen3_configs
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        return qwen3_configs, set_qwen3_sharding_config, parallelize_qwen3
    raise ValueError(f"no MoE family {family!r}")


def moe_config(family: str, flavor: str, layers: int, seq_len: int):
    """torchtitan's own config for ``family``/``flavor`` with its first ``layers`` blocks, its
    RoPE caches sized to ``seq_len``, balanced routing and its EP sharding declarations; with
    the flavour's depth and dense blocks."""
    configs, set_sharding, _ = _family(family)
    # torchtitan 0.3.0 models/deepseek_v3/__init__.py and models/qwen3/__init__.py
    # model_registry: attn_backend "flex", moe_comm_backend "standard" (the DeepSeek default; the
    # Qwen3 MoE flavours' own default) -> AllToAllTokenDispatcher under EP.
    config = configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    full_depth = len(config.layers)
    dense = sum(1 for layer in config.layers if getattr(layer, "moe", None) is None)
    config.layers = config.layers[:layers]
    # models/common/decoder.py Decoder.Config.update_from_config (what the trainer runs): RoPE
    # caches resized to training.seq_len, router._debug_force_load_balance =
    # debug.moe_force_load_balance; then the family's update_from_config (models/deepseek_v3/
    # model.py, models/qwen3/model.py): set_*_sharding_config(enable_sp, enable_ep=
    # expert_parallel_degree > 1). The method imports torchtitan.trainer (which needs
    # torchdata); its effects are applied directly.
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
        if getattr(layer, "moe", None) is not None:
            layer.moe.router._debug_force_load_balance = True
    set_sharding(config, enable_sp=True, enable_ep=True)
    return config, full_depth, dense


@contextlib.contextmanager
def expert_world(ep: int, dp_shard: int) -> Iterator[tuple[object, object]]:
    """Rank 0 of a fake group of dp_shard ranks with torchtitan's ParallelDims (ep borrowed from
    dp_shard, efsdp = dp_shard / ep) built over it; yields (parallel_dims, parallelism config)."""
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, expert_parallel_degree=ep,
                                    spmd_backend=BACKEND)
    with torchtitan_parallel_world(parallelism, dp_shard) as parallel_dims:
        yield parallel_dims, parallelism


def _parallelize(family: str, module, parallel_dims, parallelism, policy: str = "none") -> str:
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    _, _, parallelize = _family(family)

    training = TrainingConfig()
    # torchtitan 0.3.0 models/deepseek_v3/parallelize.py (models/qwen3/parallelize.py the same
    # with apply_fsdp_to_decoder): model.parallelize(parallel_dims) (EP: the grouped experts
    # Shard(0) over ep), then apply_fsdp_to_mtp_decoder over the fsdp mesh
    # with the experts over the efsdp mesh, in the training config's mixed precision; between
    # the two, ac_config.build(dump_folder).apply(model) (full: FullAC wraps every block).
    ac_config = FullAC.Config() if policy == "full" else None
    parallelize(module, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    _, set_sharding, _ = _family(family)
    return (f"{set_sharding.__name__}(enable_sp=True, enable_ep=True), {parallelize.__name__}(parallel_dims; "
            f"spmd_backend={BACKEND}, mixed_precision_param={training.mixed_precision_param}, "
            f"mixed_precision_reduce={training.mixed_precision_reduce}"
            + (", ac_config=FullAC.Config()" if policy == "full" else "") + ")")


def _dims(config, full_depth: int, dense: int) -> dict[str, int]:
    moe = next(layer.moe for layer in config.layers if getattr(layer, "moe", None) is not None)
    return dict(dim=config.dim, num_experts=moe.num_experts, top_k=moe.router.top_k,
                moe_hidden=moe.routed_experts.inner_experts.hidden_dim, vocab_size=config.vocab_size,
                n_layers_full=full_depth, n_dense_layers_full=dense)


def measure_states(flavor: str, ep: int, dp_shard: int, layers: int = 2, family: str = "deepseek_v3") -> ExpertParallelRecord:
    """The parameters rank 0 holds after the family's parallelize function (EP, then FSDP2),
    built in the trainer's fp32, ``layers`` blocks deep (the flavour's dense blocks first)."""
    from importlib.metadata import version

    start_s = time.perf_counter()
    config, full_depth, dense = moe_config(family, flavor, layers, 4096)
    global_shapes = global_parameter_shapes(config)
    with expert_world(ep, dp_shard) as (parallel_dims, parallelism):
        module = build_on_meta(config, PARAM_DTYPE)
        calls = _parallelize(family, module, parallel_dims, parallelism)
        params = parameter_shards(module, global_shapes)
    return ExpertParallelRecord(
        framework_version=f"torchtitan {version('torchtitan')}", torch_version=torch.__version__, family=family,
        flavor=flavor, **_dims(config, full_depth, dense), spmd_backend=BACKEND, ep=ep, dp_shard=dp_shard,
        efsdp=dp_shard // ep, world_size=dp_shard, rank=0, parallelize=calls, param_dtype=str(PARAM_DTYPE),
        params=params, built_layers=layers, built_dense_layers=min(dense, layers),
        wall_time_s=time.perf_counter() - start_s, how=HOW,
    )


def balanced_split_sizes(config, tokens: int, ep: int) -> list[int]:
    """The dispatcher's split sizes (input, then output: ep each) for ``tokens`` tokens on
    every rank under torchtitan's own forced balance, from its router run on real CPU tensors.

    models/common/moe.py MoE.forward counts num_local_tokens_per_expert_E from the router's
    expert ids; token_dispatcher.py _sync_token_count_exchange sums them per destination rank
    (input splits) and the exchanged counts per source rank (output splits). The forced routing
    (TokenChoiceTopKRouter._debug_force_load_balance_routing: expert = position x K + j mod E)
    depends on positions only, so every rank routes as rank 0 does: rank 0 receives from each
    rank what that rank's input split 0 is, its own input split 0."""
    moe = next(layer.moe for layer in config.layers if getattr(layer, "moe", None) is not None)
    router = moe.router.build()
    torch.nn.init.normal_(router.gate.weight, std=0.02)
    with torch.no_grad(), private.cpu_autocast_float32():
        _, expert_ids, scores = router(torch.randn(1, tokens, config.dim))
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, expert_ids, True)
        per_expert = routing_map.sum(dim=(0, 1))
    input_splits = per_expert.view(ep, -1).sum(dim=1).tolist()
    return input_splits + [input_splits[0]] * ep


@dataclasses.dataclass
class _Run(_ParallelRun):
    """A tensor-parallel run's figures, the split sizes answered and the parallelize calls."""

    answered: list[int]
    calls: str


def _run(family: str, flavor: str, ep: int, dp_shard: int, seq_len: int, micro_batch: int, layers: int,
         policy: str) -> _Run:
    config, _, dense = moe_config(family, flavor, layers, seq_len)
    global_shapes = global_parameter_shapes(config)
    moe_blocks = layers - min(dense, layers)
    splits = balanced_split_sizes(config, seq_len * micro_batch, ep)
    # One MoE block's forward reads its 2 ep split sizes; full checkpointing runs the forward
    # again in backward, which reads them again.
    reads = private.ScalarReads(splits * moe_blocks * (2 if policy == "full" else 1))
    with expert_world(ep, dp_shard) as (parallel_dims, parallelism):
        module = build_on_meta(config, PARAM_DTYPE)
        calls = _parallelize(family, module, parallel_dims, parallelism, policy)
        params = parameter_shards(module, global_shapes)
        step = fake_step(module, parallel_dims, config.vocab_size, micro_batch, seq_len,
                         outer=(private.cpu_autocast_float32(),), inner=(reads,))
    if reads.answers:
        raise RuntimeError(f"the dispatcher left {len(reads.answers)} of the split sizes given unread")
    return _Run(*step, params, reads.answered, calls)


def measure_activations(flavor: str, ep: int, dp_shard: int, seq_len: int, micro_batch: int = 1,
                        layers: int = 2, policy: str = "none", family: str = "deepseek_v3") -> ExpertParallelRecord:
    """Forward and backward of torchtitan's EP + FSDP2 model with ``layers`` and ``layers + 1``
    blocks (the deeper one a MoE block more) on rank 0, under ``policy`` ("none" or "full")."""
    from importlib.metadata import version

    start_s = time.perf_counter()
    _eager_flex_attention()
    shallow, deep = (_run(family, flavor, ep, dp_shard, seq_len, micro_batch, depth, policy)
                     for depth in (layers, layers + 1))
    config, full_depth, dense = moe_config(family, flavor, layers, seq_len)
    block = _subtract(deep.collectives, shallow.collectives)
    notes = [
        "FSDP2 (apply_fsdp_to_mtp_decoder) over fp32 parameters: the blocks compute on the bf16 parameters its "
        "MixedPrecisionPolicy gathers; the live bytes include the unsharded parameters of the units it does not "
        "reshard after forward (final norm + lm_head), the same at both depths",
        "FlexAttention run eagerly: each block also keeps its fp32 max_scores (4 bytes x heads x tokens), which "
        "a compiled run does not (zeroplan/frameworks/build.py _eager_flex_attention)",
        "routing: torchtitan's own forced balance (debug.moe_force_load_balance -> "
        "TokenChoiceTopKRouter._debug_force_load_balance: round-robin experts); the all-to-all split sizes, which "
        "AllToAllTokenDispatcher._sync_token_count_exchange reads with .tolist() and a fake tensor cannot give, "
        "are those torchtitan's router yields for the same token count on real CPU tensors (split_sizes), "
        "answered to the fake run's reads in order (zeroplan.simulate._torch_private.ScalarReads)",
        "the router's gate runs under torch.autocast(cpu, float32), enabled as on a GPU "
        "(zeroplan.simulate._torch_private.cpu_autocast_float32); torch disables it on the CPU",
        "backward seeded by the local logits' sum (the loss's own bytes and collectives are not measured)",
    ]
    activations = ActivationMeasurement(
        micro_batch_size=micro_batch, seq_len=seq_len, activation_checkpointing=policy, module_dtype=str(COMPUTE_DTYPE),
        norm_formula="cpu", layers=[layers, layers + 1], retained_bytes=[shallow.retained, deep.retained],
        block_growth_bytes=deep.growth, block_saved=deep.saved, block_collectives=collective_counts(block),
        model_collectives=collective_counts(deep.collectives), backward_ran=True,
    )
    return ExpertParallelRecord(
        framework_version=f"torchtitan {version('torchtitan')}", torch_version=torch.__version__, family=family,
        flavor=flavor, **_dims(config, full_depth, dense), spmd_backend=BACKEND, ep=ep, dp_shard=dp_shard,
        efsdp=dp_shard // ep, world_size=dp_shard, rank=0,
        parallelize=deep.calls,
        param_dtype=str(PARAM_DTYPE), params=shallow.params, built_layers=layers, built_dense_layers=min(dense, layers),
        routing="torchtitan forced balance (router._debug_force_load_balance)", split_sizes=deep.answered,
        activations=activations, wall_time_s=time.perf_counter() - start_s, how=HOW, notes=notes,
    )
