"""``--deepspeed-config FILE`` on fit and compare: plan the ZeRO strategy and knobs a DeepSpeed
config file sets (zeroplan.specs.deepspeed_config reads it). The flags that say the same thing
must agree with it (accumulation, precision, optimizer, strategies; its micro-batch is planned
where no --micro-batch is given), and so must what the planner plans where the file sizes a
buffer itself (the NVMe swappers, aio)."""

from __future__ import annotations

import argparse

from zeroplan.errors import ZeroplanError
from zeroplan.specs.deepspeed_config import FLAG, DeepSpeedConfig, read_deepspeed_config
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.training import Optimizer, StateConvention

ADAM_STATES = (Optimizer.adam, Optimizer.adamw)


READ_ATTRIBUTE = "_deepspeed_config_read"
"""Where the namespace keeps the file once read: a command reads it once (a pipe such as
<(...) or /dev/stdin gives its content only once), however many of its steps ask."""


def deepspeed_config_from_args(args: argparse.Namespace) -> DeepSpeedConfig | None:
    """The file --deepspeed-config names, read (once per namespace); None without the flag."""
    path = getattr(args, "deepspeed_config", None)
    if path is None:
        return None
    read = getattr(args, READ_ATTRIBUTE, None)
    if read is None:
        read = read_deepspeed_config(path, hf_auto=Framework(args.framework) is Framework.hf)
        setattr(args, READ_ATTRIBUTE, read)
    return read


def kinds_of_config(config: DeepSpeedConfig, kinds: tuple[StrategyKind, ...] | None) -> tuple[StrategyKind, ...]:
    """The strategies fit plans: the file's one (--strategies may name only it)."""
    if kinds is not None and kinds != (config.kind,):
        raise ZeroplanError("--strategies", f"{','.join(k.value for k in kinds)}: the {FLAG} file runs "
                                            f"{config.kind.value} (allowed: {config.kind.value}, or leave --strategies out)")
    return (config.kind,)


# deepspeed 0.19.8 runtime/config.py _configure_train_batch_size / _batch_assertion: of
# train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps the engine
# derives a missing one from the other two and asserts train = micro x accumulation x the
# data-parallel ranks. The accumulation decides the engine's step boundary (what is planned); the
# micro-batch only its throughput log and that assertion: the script's data loader sets the batch
# the step runs (DeepSpeedExamples' bf16_master_weight train.py feeds --batch_size whatever the
# config says), so an explicit --micro-batch is planned, the file's only where none is given.
def batch_counts(config: DeepSpeedConfig, micro_flag: int | None, accum_flag: int | None,
                 data_parallel: int) -> tuple[int, int]:
    """The (micro-batch, accumulation) to plan from the flags and the file's batch keys."""
    micro, accum, train = config.micro_batch_size, config.grad_accum_steps, config.train_batch_size
    if train is not None and None not in (micro, accum) and train != micro * accum * data_parallel:
        raise ZeroplanError(f"{FLAG} train_batch_size", f"{train} is not train_micro_batch_size_per_gpu x "
                            f"gradient_accumulation_steps x data-parallel ranks = {micro} x {accum} x {data_parallel} "
                            f"= {micro * accum * data_parallel} (DeepSpeed refuses the file)")
    if train is not None and accum is None and micro is not None:
        accum, rest = divmod(train, micro * data_parallel)
        if rest or not accum:
            raise ZeroplanError(f"{FLAG} train_batch_size", f"{train} is not a multiple of train_micro_batch_size_per_gpu "
                                f"x data-parallel ranks = {micro} x {data_parallel} (DeepSpeed refuses the file)")
    if train is not None and micro is None and accum is not None:
        micro, rest = divmod(train, accum * data_parallel)
        if rest or not micro:
            raise ZeroplanError(f"{FLAG} train_batch_size", f"{train} is not a multiple of gradient_accumulation_steps "
                                f"x data-parallel ranks = {accum} x {data_parallel} (DeepSpeed refuses the file)")
    if accum_flag is not None and accum is not None and accum_flag != accum:
        raise ZeroplanError("--grad-accum", f"{accum_flag} but the {FLAG} file's engine steps every {accum} micro-batches "
                                            f"(gradient_accumulation_steps; give --grad-accum {accum})")
    return micro_flag or micro or 1, accum_flag or accum or 1


def apply_deepspeed_config(config: DeepSpeedConfig, request: PlanRequest, kind: StrategyKind) -> PlanRequest:
    """``request`` running the file's strategy and knobs; ``kind`` is the strategy the caller
    asked for (ddp: none chosen), refused where it is not the file's."""
    if kind is not StrategyKind.ddp and kind is not config.kind:
        raise ZeroplanError("--strategy", f"{kind.value}: the {FLAG} file runs {config.kind.value} (allowed: {config.kind.value})")
    training = request.training
    if config.precision is not None and config.precision is not training.precision:
        raise ZeroplanError("--precision", f"{training.precision.value} but the {FLAG} file runs {config.precision.value} "
                                           f"(give --precision {config.precision.value})")
    if config.optimizer is Optimizer.muon and training.optimizer is not Optimizer.muon:
        raise ZeroplanError("--optimizer", f"{training.optimizer.value} but the {FLAG} file's optimizer is Muon (give --optimizer muon)")
    if config.optimizer in ADAM_STATES and training.optimizer not in ADAM_STATES:
        raise ZeroplanError("--optimizer", f"{training.optimizer.value} but the {FLAG} file's optimizer keeps Adam's "
                                           "states (allowed: adamw, adam)")
    if config.bf16_autocast:
        # DeepSpeed's bf16 master weights under torch_autocast (zeroplan.core.deepspeed_bf16_autocast).
        training = training.model_copy(update={"deepspeed_bf16_autocast": True})
        request = request.model_copy(update={"training": training})
    if config.kind is StrategyKind.ddp:
        # Stage 0 is DeepSpeed's unpartitioned optimizer: the ddp strategy under DeepSpeed's state
        # convention (zeroplan.core.deepspeed_stage0), not torch's DDP.
        if training.state_convention not in (None, StateConvention.deepspeed):
            raise ZeroplanError("--state-convention", f"{training.state_convention.value} but the {FLAG} file runs "
                                                      "DeepSpeed's stage 0 (give --state-convention deepspeed, or leave it out)")
        request = request.model_copy(update={"training": training.model_copy(update={"state_convention": StateConvention.deepspeed})})
    strategy = request.strategy.model_copy(update={"kind": config.kind, **config.strategy_updates()})
    if training.framework is Framework.hf and config.kind is not StrategyKind.ddp:
        strategy = _hf_auto(config, strategy, request)
    # Validated again: model_copy skips the spec's own checks of the values the file set.
    planned = request.with_strategy(StrategySpec.model_validate(dict(strategy)))
    _check_planned_sizes(config, planned)
    return planned


def _hf_auto(config: DeepSpeedConfig, strategy: StrategySpec, request: PlanRequest) -> StrategySpec:
    """The "auto" bucket entries as Hugging Face fills them (zeroplan.core.hf_deepspeed)."""
    from zeroplan.core.hf_deepspeed import hf_auto_strategy

    filled = hf_auto_strategy(strategy, request.model)
    update = {}
    if config.zero_bucket_elements is None:
        update["zero_bucket_elements"] = filled.zero_bucket_elements
    if config.prefetch_bucket_elements is None and strategy.kind.zero_stage == 3:
        update["deepspeed_prefetch_bucket_elements"] = filled.deepspeed_prefetch_bucket_elements
    if config.persistence_threshold is None and strategy.kind.zero_stage == 3:
        update["deepspeed_param_persistence_threshold"] = filled.deepspeed_param_persistence_threshold
    return strategy.model_copy(update=update)


def _check_planned_sizes(config: DeepSpeedConfig, request: PlanRequest) -> None:
    """The NVMe swappers' sizes and the aio block the file sets must be what the planner counts
    (zeroplan.emit.formats writes them the same way)."""
    if not config.nvme_settings and not config.aio:
        return
    from zeroplan.emit.formats import AIO_CONFIG, nvme_offload_blocks

    planned: dict[str, object] = {}
    if request.strategy.kind.optimizer_on_nvme:
        blocks = nvme_offload_blocks(request)
        planned |= {f"offload_optimizer.{k}": v for k, v in blocks["offload_optimizer"].items()}
        planned |= {f"offload_param.{k}": v for k, v in blocks.get("offload_param", {}).items()}
    for key, value in config.nvme_settings:
        if key in planned and planned[key] != value:
            raise ZeroplanError(f"{FLAG} zero_optimization.{key}",
                                f"{value} is not what zeroplan plans for this request (allowed: {planned[key]})")
    for key, value in config.aio:
        if AIO_CONFIG.get(key, object()) != value:
            allowed = AIO_CONFIG.get(key, "not a key zeroplan plans")
            raise ZeroplanError(f"{FLAG} aio.{key}", f"{value!r} is not planned (allowed: {allowed!r})")


def _elements(count: int) -> str:
    """A count of elements as a DeepSpeed config writes it: 5e8, 1e9, 200000."""
    exponent = len(str(count)) - 1
    mantissa, rest = divmod(count, 10**exponent)
    return f"{mantissa}e{exponent}" if not rest and exponent >= 3 else f"{count:,}"


def deepspeed_config_line(path: str, request: PlanRequest) -> str:
    """The line fit and compare print under their answer: the strategy the file runs and the
    ZeRO settings planned for it (the file's, or DeepSpeed's defaults for the keys it leaves
    out), so that what was read is seen."""
    from zeroplan.core import deepspeed_coordinator as planned
    from zeroplan.core.deepspeed_accumulation import overlap_comm

    strategy = request.strategy
    if strategy.kind is StrategyKind.ddp:
        from zeroplan.core.deepspeed_stage0 import ALLREDUCE_BUCKET_ELEMENTS

        return (f"DeepSpeed config {path}: stage 0 (ddp under DeepSpeed's state convention), gradients all-reduced "
                f"in buckets of {_elements(ALLREDUCE_BUCKET_ELEMENTS)} elements (no ZeRO key is read at stage 0)")
    parts = [f"reduce bucket {_elements(strategy.zero_bucket_elements)}",
             f"overlap_comm {'on' if overlap_comm(request) else 'off'}"]
    if strategy.kind.zero_stage == 3:
        parts += [f"prefetch {_elements(planned.prefetch_bucket_elements(request))}",
                  f"live parameters {_elements(planned.max_live_parameters(request))}",
                  f"reuse distance {_elements(planned.max_reuse_distance(request))}",
                  f"persistence {_elements(planned.persistence_threshold(request))}",
                  f"sub-group {_elements(strategy.deepspeed_sub_group_elements)}"]
    if strategy.offload_optimizer_ratio is not None:
        from zeroplan.core.deepspeed_partial_offload import device_sub_group_elements
        from zeroplan.core.nvme import sub_group_partition_elements

        parts.append(f"offload ratio {strategy.offload_optimizer_ratio:g} ({len(device_sub_group_elements(request))} "
                     f"of {len(sub_group_partition_elements(request))} sub-groups on the GPU)")
    if request.training.deepspeed_bf16_autocast:
        parts.append("bf16 master weights, gradients and Adam states under torch_autocast")
    return (f"DeepSpeed config {path}: {strategy.kind.value}, {', '.join(parts)} "
            "(elements; keys it leaves out at DeepSpeed's defaults)")
