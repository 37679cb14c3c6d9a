"""Which engine implements which strategy, and with which optimizers: the one table the runner
and the CLI share (no torch here, so the command line can check a request before any rank
starts)."""

from __future__ import annotations

import importlib.util
from enum import Enum

from zeroplan.errors import ZeroplanError
from zeroplan.specs import Optimizer, StrategyKind, TrainingSpec
from zeroplan.specs.training import OptimizerLoop, StateConvention


class EngineKind(str, Enum):
    """Whose implementation runs the strategy."""

    zeroplan = "zeroplan"
    """zeroplan's reference ZeRO (zeroplan.harness.zero)."""
    torch = "torch"
    """PyTorch: DDP, ZeroRedundancyOptimizer (zero1), FSDP2 fully_shard (fsdp-*)."""
    torch_fsdp1 = "torch-fsdp1"
    """PyTorch's FullyShardedDataParallel (FSDP1), for the fsdp-* strategies."""
    deepspeed = "deepspeed"
    """DeepSpeed's ZeRO (optional: zeroplan.harness.deepspeed_engine imports it when built)."""


SUPPORTED: dict[tuple[StrategyKind, EngineKind], str] = {
    (StrategyKind.ddp, EngineKind.torch): "DistributedDataParallel",
    (StrategyKind.zero1, EngineKind.zeroplan): "reference ZeRO stage 1",
    (StrategyKind.zero2, EngineKind.zeroplan): "reference ZeRO stage 2",
    (StrategyKind.zero3, EngineKind.zeroplan): "reference ZeRO stage 3",
    (StrategyKind.zero1, EngineKind.torch): "DDP + ZeroRedundancyOptimizer",
    (StrategyKind.fsdp_full_shard, EngineKind.torch): "FSDP2 fully_shard(reshard_after_forward=True)",
    (StrategyKind.fsdp_shard_grad_op, EngineKind.torch): "FSDP2 fully_shard(reshard_after_forward=False)",
    (StrategyKind.fsdp_full_shard, EngineKind.torch_fsdp1): "FSDP1 FULL_SHARD",
    (StrategyKind.fsdp_shard_grad_op, EngineKind.torch_fsdp1): "FSDP1 SHARD_GRAD_OP",
    (StrategyKind.zero1, EngineKind.deepspeed): "DeepSpeed ZeRO stage 1",
    (StrategyKind.zero2, EngineKind.deepspeed): "DeepSpeed ZeRO stage 2",
    (StrategyKind.zero3, EngineKind.deepspeed): "DeepSpeed ZeRO stage 3",
    (StrategyKind.zero2_offload, EngineKind.deepspeed): "DeepSpeed ZeRO stage 2, offload_optimizer cpu",
    (StrategyKind.zero3_offload, EngineKind.deepspeed): "DeepSpeed ZeRO stage 3, offload_optimizer cpu",
}

MEASURABLE_OPTIMIZERS = (Optimizer.adamw, Optimizer.adam, Optimizer.sgd, Optimizer.sgd_momentum, Optimizer.adafactor)
"""Optimizers the harness builds (torch.optim; zeroplan.harness.engine.make_optimizer). Lion
and 8-bit Adam are not in torch.optim."""

# The byte layout an engine's model states follow, where it is not the strategy's default
# (StrategyKind.default_convention): DeepSpeed keeps fp32 gradient partitions for its optimizer.
ENGINE_CONVENTIONS: dict[EngineKind, StateConvention] = {EngineKind.deepspeed: StateConvention.deepspeed}


# zeroplan/harness/engine.py _OPTIMIZERS: this package's engines build torch.optim with
# foreach=False (the per-tensor loop); so does the DeepSpeed engine's configuration
# (deepspeed_engine.py: "torch_adam": True, "foreach": False, where DeepSpeed would otherwise
# build its FusedAdam), so that it runs on the CPU.
ENGINE_OPTIMIZER_LOOPS: dict[EngineKind, OptimizerLoop] = {
    EngineKind.zeroplan: OptimizerLoop.for_loop, EngineKind.torch: OptimizerLoop.for_loop,
    EngineKind.torch_fsdp1: OptimizerLoop.for_loop, EngineKind.deepspeed: OptimizerLoop.for_loop,
}


def training_as_run(training: TrainingSpec, engine: EngineKind) -> TrainingSpec:
    """The training spec a record states: the engine's own state convention and optimizer loop
    where none was set."""
    update = {}
    if training.state_convention is None and engine in ENGINE_CONVENTIONS:
        update["state_convention"] = ENGINE_CONVENTIONS[engine]
    if training.optimizer_loop is None and engine in ENGINE_OPTIMIZER_LOOPS:
        update["optimizer_loop"] = ENGINE_OPTIMIZER_LOOPS[engine]
    return training.model_copy(update=update) if update else training


ELEMENTWISE_OPTIMIZERS = (Optimizer.adamw, Optimizer.adam, Optimizer.sgd, Optimizer.sgd_momentum)
"""Optimizers whose update of an element reads only that element's parameter, gradient and
state: exact on any shard of a tensor."""

# Adafactor (torch/optim/_adafactor.py) reads whole tensors: row and column means of each
# matrix's squared gradient, and the RMS of each parameter. A flat 1-D shard (reference ZeRO's
# units, FSDP1's FlatParameter) splits and joins tensors, so the update would be a different
# one; on FSDP2's DTensor shards torch 2.13's Adafactor fails (an in-place op on a partial
# norm). DDP and ZeroRedundancyOptimizer step whole tensors.
_WHOLE_TENSOR_ENGINES = {
    (StrategyKind.ddp, EngineKind.torch),
    (StrategyKind.zero1, EngineKind.torch),
}


def supported_optimizers(strategy: StrategyKind, engine: EngineKind) -> tuple[Optimizer, ...]:
    """The optimizers that implementation can run exactly."""
    if engine is EngineKind.deepspeed:
        # deepspeed_engine builds DeepSpeed's own optimizer from its config: AdamW only here.
        return (Optimizer.adamw,)
    if (strategy, engine) in _WHOLE_TENSOR_ENGINES:
        return MEASURABLE_OPTIMIZERS
    return ELEMENTWISE_OPTIMIZERS


def check_supported(
    strategy: StrategyKind, engine: EngineKind, optimizer: Optimizer = Optimizer.adamw, grad_accum_steps: int = 1,
) -> str:
    """The implementation's name; a one-line error naming the valid engines (or optimizers, or
    micro-batches per step) otherwise."""
    if (strategy, engine) not in SUPPORTED:
        engines = sorted(e.value for (s, e) in SUPPORTED if s is strategy)
        if not engines:
            strategies = sorted({s.value for s, _ in SUPPORTED})
            raise ZeroplanError("strategy", f"{strategy.value!r} cannot be measured (measurable: {', '.join(strategies)})")
        raise ZeroplanError(
            "engine", f"{engine.value!r} does not implement {strategy.value!r} (use: {', '.join(engines)})"
        )
    implementation = SUPPORTED[(strategy, engine)]
    allowed = supported_optimizers(strategy, engine)
    if optimizer not in allowed:
        raise ZeroplanError(
            "optimizer",
            f"{optimizer.value!r} is not supported by {implementation} (--strategy {strategy.value} "
            f"--engine {engine.value}; allowed: {', '.join(o.value for o in allowed)})",
        )
    return implementation


def check_supported_names(strategy: str, engine: str, optimizer: str = Optimizer.adamw.value,
                          grad_accum_steps: int = 1) -> str:
    """As check_supported, from the command line's strings; also that an optional engine is
    installed, so a missing one is reported before any rank starts."""
    implementation = check_supported(StrategyKind(strategy), EngineKind(engine), Optimizer(optimizer), grad_accum_steps)
    if EngineKind(engine) is EngineKind.deepspeed and not _module_installed("deepspeed"):
        raise ZeroplanError("engine", f"'deepspeed' needs DeepSpeed, which is not installed; install it with: {DEEPSPEED_INSTALL}")
    return implementation



DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed==0.19.8' (after torch)"


def _module_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# Model parallelism the harness runs (zeroplan/harness/parallel_engines.py): tensor (and
# sequence) parallelism under FSDP2, a pipeline of one stage per rank under DDP or FSDP2, never
# both at once; only PyTorch's own engines compose with torch's parallel APIs.
TP_STRATEGIES = (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op)
PP_STRATEGIES = (StrategyKind.ddp, StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op)
PP_SCHEDULES = ("1f1b", "gpipe")


def parallel_implementation(strategy: StrategyKind, tp: int, sequence_parallel: bool, pp: int, schedule: str) -> str:
    """The implementation's name for a record (e.g. 'TP 2 (SP) + FSDP2 fully_shard(...)')."""
    data = SUPPORTED[(strategy, EngineKind.torch)]
    if pp > 1:
        names = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
        return f"PipelineStage x {pp} ({names[schedule]}) + {data}"
    return f"parallelize_module TP {tp}{' + SequenceParallel' if sequence_parallel else ''} + {data}"


def check_parallel_supported(strategy: StrategyKind, engine: EngineKind, model, nproc: int, tp: int,
                             sequence_parallel: bool, pp: int, schedule: str, seq_len: int) -> None:
    """One-line errors naming the flag and what is allowed, before any rank starts."""
    if tp == 1 and pp == 1:
        if sequence_parallel:
            raise ZeroplanError("--sequence-parallel", "needs tensor parallelism (allowed: with --tp 2 or more)")
        return
    if tp > 1 and pp > 1:
        raise ZeroplanError("--tp", f"{tp} with --pp {pp}: the harness runs one model-parallel dimension at a time "
                                    "(allowed: --tp N or --pp N, not both)")
    flag, degree = ("--tp", tp) if tp > 1 else ("--pp", pp)
    if nproc % degree or nproc == degree:
        divisors = [d for d in range(2, nproc) if nproc % d == 0]
        allowed = ", ".join(map(str, divisors)) if divisors else "none: use --nproc 4 or more"
        raise ZeroplanError(flag, f"{degree} must divide --nproc {nproc} and leave at least 2 data-parallel ranks "
                                  f"(allowed: {allowed})")
    if engine is not EngineKind.torch:
        raise ZeroplanError("--engine", f"{engine.value!r} does not compose with {flag} (allowed: torch)")
    strategies = TP_STRATEGIES if tp > 1 else PP_STRATEGIES
    if strategy not in strategies:
        raise ZeroplanError("--strategy", f"{strategy.value!r} is not measured with {flag} "
                                          f"(allowed: {', '.join(s.value for s in strategies)})")
    if model.is_moe:
        raise ZeroplanError(flag, f"{model.name} has experts, which the harness does not split (allowed: a dense model, e.g. tiny-llama)")
    if tp > 1:
        for name, value in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads),
                            ("ffn_hidden_size", model.ffn_hidden_size)):
            if value % tp:
                raise ZeroplanError("--tp", f"{tp} does not divide {model.name}'s {name} {value} "
                                            f"(allowed: a divisor of {value} that divides --nproc {nproc})")
        if model.tied_embeddings:
            raise ZeroplanError("--tp", f"{model.name} ties its embeddings, which the harness does not split "
                                        "(allowed: a model with untied embeddings, e.g. tiny-llama)")
        if sequence_parallel and seq_len % tp:
            raise ZeroplanError("--sequence-parallel", f"--seq-len {seq_len} is not a multiple of --tp {tp} "
                                                       f"(allowed: a multiple of {tp})")
        if sequence_parallel and model.position.value == "learned":
            raise ZeroplanError("--sequence-parallel", f"{model.name}'s learned position table is added to a whole "
                                                       "sequence (allowed: a RoPE model, e.g. tiny-llama)")
    if pp > 1:
        if schedule not in PP_SCHEDULES:
            raise ZeroplanError("--pp-schedule", f"{schedule!r} (allowed: {', '.join(PP_SCHEDULES)})")
        if model.num_layers < pp:
            raise ZeroplanError("--pp", f"{pp} stages for {model.name}'s {model.num_layers} blocks "
                                        f"(allowed: at most {model.num_layers})")
        if model.tied_embeddings:
            raise ZeroplanError("--pp", f"{model.name} ties its embeddings to the head, which sit on different stages "
                                        "(allowed: a model with untied embeddings, e.g. tiny-llama)")
