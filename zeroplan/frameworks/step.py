"""One whole training step of a framework's own model on one simulated rank of N.

The framework's model is built at its full depth on the meta device (zeroplan.frameworks.build),
wrapped by the framework's own FSDP2 code (``BuiltModel.shard``: torchtune's shard_model, the
fully_shard calls accelerate's fsdp2_prepare_model makes for the HF Trainer), moved to fake
tensors, and driven through the framework's forward, its loss, backward and the AdamW step its
recipe builds, over a fake process group (zeroplan.simulate.fake_world). FSDP2's own
FSDPMemTracker counts what the rank holds; its peak is the record. Nothing here knows the
planner's formulas: tests/test_framework_step.py puts the two side by side.
"""

from __future__ import annotations

import contextlib
import time

import torch

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.build import build
from zeroplan.frameworks.measure import DEFAULT_PRECISION
from zeroplan.frameworks.step_record import AllocatorFigures, FrameworkStepRecord, StepPhase
from zeroplan.harness.engine import local_tensor
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.alloc_trace import HOPPER_CUBLAS_WORKSPACE_BYTES, recording_storages
from zeroplan.simulate.fake_world import (
    DEVICE, check_rank_of_world, device_mesh, fake_process_group, storage_bytes,
)
from zeroplan.specs import BatchSpec, ModelSpec, Optimizer, Precision, StrategyKind, TrainingSpec, check_seq_len
from zeroplan.specs.training import Objective
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import measured_on

STEP_STRATEGIES = (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op)
"""Strategies a whole step runs: the frameworks' FSDP2 with and without reshard_after_forward."""

STEP_PRECISION = {
    # accelerate 1.10.1 fsdp2_prepare_model upcasts the module to fp32 and computes in the
    # MixedPrecisionPolicy's bf16 (zeroplan.frameworks.build._hf_fsdp2).
    Framework.hf: (Precision.bf16_mixed, torch.float32),
    # torchtune 0.6.1 recipes/configs/llama3_1/*_full.yaml: dtype bf16, no mixed-precision policy.
    Framework.torchtune: (Precision.bf16_pure, torch.bfloat16),
    # torchtitan 0.3.0 config/configs.py: fp32 parameters, mixed_precision_param bfloat16 and
    # mixed_precision_reduce float32 (zeroplan.frameworks.build._torchtitan_llama's shard).
    Framework.torchtitan: (Precision.bf16_mixed, torch.float32),
}
"""Framework -> (the precision its FSDP2 recipe trains in, the module dtype that makes it)."""

SINGLE_DEVICE = ("torchtune lora_finetune_single_device: no FSDP, no process group; the whole model on the one "
                 "device (torch MemTracker instead of FSDPMemTracker)")

ADAMW_LR = 2e-5
"""torchtune 0.6.1 configs/llama3_1/8B_full.yaml optimizer lr (the step's bytes do not depend on it)."""


def check_step(framework: Framework, strategy: StrategyKind, training: TrainingSpec, world_size: int, rank: int) -> None:
    """Refuse, in one line naming the field, a step this runner cannot run."""
    if framework not in STEP_PRECISION:
        allowed = ", ".join(f.value for f in STEP_PRECISION)
        raise ZeroplanError("--framework", f"{framework.value!r} has no whole-step runner (allowed: {allowed})")
    if strategy is StrategyKind.ddp and world_size == 1:
        # torchtune 0.6.1 recipes/lora_finetune_single_device.py: no process group, no FSDP.
        if framework is not Framework.torchtune or not training.finetune.is_lora:
            raise ZeroplanError("--strategy", "a single-device step (ddp at 1 rank) is simulated only for torchtune's "
                                              "lora_finetune_single_device recipe (allowed: --framework torchtune with LoRA)")
    elif strategy not in STEP_STRATEGIES:
        allowed = ", ".join(k.value for k in STEP_STRATEGIES)
        raise ZeroplanError("--strategy", f"{strategy.value!r} is not a whole step the frameworks' FSDP2 runs (allowed: {allowed})")
    precision = STEP_PRECISION[framework][0]
    if training.precision is not precision:
        raise ZeroplanError("--precision", f"{training.precision.value!r}: {framework.value} under FSDP2 trains in {precision.value} (allowed: {precision.value})")
    if training.unchunked_loss and framework is Framework.hf:
        raise ZeroplanError("--unchunked-loss", "hf's loss is unchunked already (allowed with --framework torchtitan, torchtune)")
    if training.optimizer_in_backward and framework is not Framework.torchtune:
        raise ZeroplanError("--optimizer-in-backward", f"not offered by {framework.value} (allowed only with --framework torchtune)")
    if training.optimizer is not Optimizer.adamw:
        raise ZeroplanError("--optimizer", f"{training.optimizer.value!r} cannot be simulated (allowed: adamw)")
    if training.fused_linear_cross_entropy:
        # liger-kernel's kernels are Triton (CUDA only): the step would run HF's own loss instead.
        raise ZeroplanError("fused_linear_cross_entropy", "cannot be simulated: liger-kernel runs only on CUDA (allowed: false)")
    # torchtune 0.6.1 recipes/lora_dpo_single_device.py is the DPO step simulated: one device,
    # LoRA (disable_adapter gives the reference), a forward of chosen and rejected rows.
    if training.objective is Objective.dpo and not (framework is Framework.torchtune and training.finetune.is_lora
                                                    and strategy is StrategyKind.ddp and world_size == 1):
        raise ZeroplanError("objective", "a DPO step is simulated only as torchtune's lora_dpo_single_device runs it "
                                         "(allowed: --framework torchtune with LoRA, ddp at 1 rank)")
    if training.objective is Objective.reward:
        raise ZeroplanError("objective", "a reward step is not simulated (allowed: sft, or dpo as above)")
    check_rank_of_world(world_size, rank, "--world-size", "--rank")


def step_training(framework: Framework, policy: str = "none") -> TrainingSpec:
    """The TrainingSpec a framework's FSDP2 recipe trains with, under ``policy``."""
    precision = STEP_PRECISION.get(framework, (DEFAULT_PRECISION.get(framework, Precision.bf16_mixed),))[0]
    return TrainingSpec(framework=framework, precision=precision, activation_checkpointing=policy)


def run_step(model: ModelSpec, strategy: StrategyKind, training: TrainingSpec, batch: BatchSpec,
             world_size: int, rank: int = 0, allocator_conf: str | None = None) -> FrameworkStepRecord:
    """Forward, loss, backward and AdamW step of ``training.framework``'s model on ``rank``: the
    second step of training (the first, untracked, creates AdamW's states). With
    ``allocator_conf`` (a PYTORCH_CUDA_ALLOC_CONF) every storage of both steps is recorded and
    replayed through the caching-allocator model (zeroplan.simulate.alloc_trace)."""
    framework = training.framework
    strategy = StrategyKind(strategy)
    check_step(framework, strategy, training, world_size, rank)
    check_seq_len(model, batch)
    start_s = time.perf_counter()
    dtype = STEP_PRECISION[framework][1]
    built = build(framework, model, model.num_layers, training.activation_checkpointing, dtype, batch.seq_len,
                  finetune=training.finetune)
    notes = []
    if batch.grad_accum_steps > 1:
        notes.append(f"one micro-batch simulated of grad_accum_steps={batch.grad_accum_steps}")
    single_device = strategy is StrategyKind.ddp
    with contextlib.nullcontext() if single_device else fake_process_group(world_size, rank):
        if single_device:
            # recipes/lora_finetune_single_device.py _setup_model: the model built on the device,
            # set_trainable_params, set_activation_checkpointing; no sharding, no process group.
            sharding = SINGLE_DEVICE
        else:
            sharding = built.shard(device_mesh(world_size), strategy is StrategyKind.fsdp_full_shard)
        built.materialize()
        config = None if allocator_conf is None else parse_alloc_conf(allocator_conf)
        recording = contextlib.nullcontext() if config is None else recording_storages(HOPPER_CUBLAS_WORKSPACE_BYTES)
        with private.fake_tensor_mode(), recording as recorder:
            built.to_empty(DEVICE)
            params = list(built.module.parameters())
            shards = [private.dtensor_local_storage(p) for p in params]
            # torchtune 0.6.1 configs/llama3_1/8B_full.yaml: torch.optim.AdamW, fused: True; the
            # HF Trainer's default optim on torch >= 2.8 is adamw_torch_fused (transformers
            # 4.56.2 training_args.py), i.e. torch.optim.AdamW(fused=True). It is built over
            # the local shards (see _step_on_shards).
            optimizer = torch.optim.AdamW(shards, lr=ADAMW_LR, fused=True)
            in_backward = training.optimizer_in_backward
            if in_backward:
                _register_optimizer_in_backward(built.module, optimizer, params, shards)
                notes.append(OPTIMIZER_IN_BACKWARD_NOTE)
            tokens = torch.randint(0, model.vocab_size, (batch.micro_batch_size, batch.seq_len))
            # A first, untracked step: AdamW creates its states lazily in the first step, and a
            # run that fits must fit from the second step on, with the states alive throughout.
            unchunked = training.unchunked_loss
            dpo = training.objective is Objective.dpo
            _backward(_forward_and_loss(framework, built, tokens, None, {}, unchunked, dpo), in_backward, world_size, tokens)
            if not in_backward:
                _step_on_shards(optimizer, params, shards)
                # Both trainers clear the gradients after the step: torchtune's recipe calls
                # optimizer.zero_grad(set_to_none=True), the HF Trainer model.zero_grad().
                built.module.zero_grad(set_to_none=True)
                optimizer.zero_grad(set_to_none=True)
            if single_device:
                # Without FSDP, FSDP2's FSDPMemTracker has nothing to follow: torch's MemTracker,
                # of which it is the FSDP2 subclass, counts the same storages by category.
                tracker = private.live_bytes_tracker()
                tracker.track_external(built.module, optimizer)
            else:
                tracker = private.passing_higher_order_ops(private.fsdp_mem_tracker_class()(mod=built.module, optm=optimizer))
            private.frozen_parameters_unhooked(tracker, built.module)
            running: dict[StepPhase, int] = {}
            with tracker:
                loss = _forward_and_loss(framework, built, tokens, tracker, running, unchunked, dpo)
                _backward(loss, in_backward, world_size, tokens)
                del loss
                running[StepPhase.backward] = _peak(tracker)
                gradient_bytes = storage_bytes(local_tensor(p.grad) for p in params if p.grad is not None)
                if not in_backward:  # else every parameter has stepped in backward
                    _step_on_shards(optimizer, params, shards)
                    running[StepPhase.optimizer] = _peak(tracker)
            peak = private.mem_tracker_peak_bytes(tracker)
            states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
            parameter_bytes = storage_bytes(shards)
            optimizer_state_bytes = storage_bytes(states)
    notes.append(OPTIMIZER_NOTE)
    allocator = None
    if config is not None:
        trace = recorder.trace(f"fake tensors: {framework.value} {strategy.value}")
        verdict = oom_capacity(trace, config)
        allocator = AllocatorFigures(
            alloc_conf=allocator_conf, cublas_workspace_bytes=HOPPER_CUBLAS_WORKSPACE_BYTES, events=len(trace.events),
            requested_peak_bytes=verdict.unlimited.requested_peak_bytes,
            reserved_peak_bytes=verdict.unlimited.reserved_peak_bytes, oom_capacity_bytes=verdict.oom_capacity_bytes,
        )
        notes.append(ALLOCATOR_NOTE)
    phase = next(p for p, nbytes in running.items() if nbytes == peak["total"])
    return FrameworkStepRecord(
        framework_version=built.version, torch_version=torch.__version__, model=model, strategy=strategy,
        world_size=world_size, rank=rank, training=measured_on(training, DEVICE), batch=batch, sharding=sharding,
        optimizer=f"torch.optim.AdamW(fused=True), {dtype} parameters", peak_bytes=peak["total"],
        peak_by_category={k: v for k, v in peak.items() if k != "total"}, peak_phase=phase,
        running_peak_bytes=running, parameter_bytes=parameter_bytes, gradient_bytes=gradient_bytes,
        optimizer_state_bytes=optimizer_state_bytes, allocator=allocator, wall_time_s=time.perf_counter() - start_s,
        notes=notes,
    )


ALLOCATOR_NOTE = (
    "allocator: the trace is both steps on CPU kernels (each norm saves what the CPU's composite "
    "RMSNorm saves, a little more than CUDA's fused one), on the streams FSDP2 selects, with two "
    f"{HOPPER_CUBLAS_WORKSPACE_BYTES >> 20} MiB cuBLAS workspaces as on an sm90 GPU; CUDA context and NCCL buffers "
    "are outside it"
)


OPTIMIZER_NOTE = (
    "AdamW stepped over the DTensors' local shards: the same elementwise update on the same bytes, "
    "but under fake tensors FSDPMemTracker also counts DTensor's sharding propagation, which runs "
    "each op at the global shape (Llama-3.1-8B at 8 ranks: 68 GB counted for 4 GB of states)"
)


OPTIMIZER_IN_BACKWARD_NOTE = (
    "optimizer_in_bwd: torchtune's training.register_optim_in_bwd_hooks on the model's parameters, "
    "its per-parameter optimizer stepping one shard of the fused AdamW above (the recipe builds "
    "one AdamW per parameter: the same states and update); no step after backward"
)


class _ShardOptimizer:
    """What torchtune's optimizer_in_bwd hook calls for one parameter (``step``, then
    ``zero_grad``): the AdamW over the local shards, given only this parameter's gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, shard: torch.Tensor) -> None:
        self.optimizer, self.param, self.shard = optimizer, param, shard

    def step(self) -> None:
        # AdamW skips parameters without a gradient: only this shard steps.
        self.shard.grad = private.dtensor_local_storage(self.param.grad)
        self.optimizer.step()

    def zero_grad(self) -> None:
        # torch.optim.Optimizer.zero_grad(set_to_none=True) on the recipe's one-parameter AdamW.
        self.param.grad = None
        self.shard.grad = None


def _register_optimizer_in_backward(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                    params: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
    """torchtune 0.6.1 recipes/full_finetune_distributed.py _setup_optimizer(optimizer_in_bwd=True):
    optim_dict = {param: optimizer over [param]}, then training.register_optim_in_bwd_hooks,
    whose post-accumulate-grad hook FSDP2 calls once it assigns each reduced gradient shard."""
    from torchtune import training as torchtune_training

    optim_dict = {param: _ShardOptimizer(optimizer, param, shard) for param, shard in zip(params, shards)}
    torchtune_training.register_optim_in_bwd_hooks(model=module, optim_dict=optim_dict)


def _backward(loss: torch.Tensor, in_backward: bool, world_size: int, tokens: torch.Tensor) -> None:
    if in_backward:
        # torchtune 0.6.1 recipes/full_finetune_distributed.py train(): with optimizer_in_bwd the
        # loss is normalised before backward, current_loss * (world_size / num_tokens).
        loss = loss * (world_size / tokens.numel())
    loss.backward()


def _step_on_shards(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
    """optimizer.step() over the local shards, each given its DTensor gradient's local shard."""
    for param, shard in zip(params, shards):
        shard.grad = None if param.grad is None else private.dtensor_local_storage(param.grad)
    optimizer.step()


def _peak(tracker: object | None) -> int:
    """The tracker's peak so far (0 without a tracker: the untracked first step)."""
    return 0 if tracker is None else private.mem_tracker_peak_bytes(tracker)["total"]


def _forward_and_loss(framework: Framework, built, tokens: torch.Tensor, tracker: object | None,
                      running: dict[StepPhase, int], unchunked: bool = False, dpo: bool = False) -> torch.Tensor:
    """The framework's forward and loss, as its trainer calls them; the logits are dropped
    before backward as the trainer drops them."""
    if dpo:
        return _torchtune_dpo_loss(built, tokens, tracker, running)
    if framework is Framework.hf:
        # transformers 4.56.2 trainer.py compute_loss: outputs = model(**inputs) with labels in
        # the inputs; the model shifts them and computes ForCausalLMLoss (loss/loss_utils.py:
        # logits.float(), cross_entropy); only outputs.loss leaves compute_loss.
        loss = built.module(input_ids=tokens, labels=tokens).loss
        running[StepPhase.forward] = _peak(tracker)
        return loss
    if framework is Framework.torchtitan:
        return _torchtitan_loss(built, tokens, unchunked, tracker, running)
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    # torchtune 0.6.1 recipes/full_finetune_distributed.py train(): logits = model(tokens) (a
    # list of num_output_chunks chunks), labels shifted by hstack with ignore_index,
    # CEWithChunkedOutputLoss, then `del logits` before backward. With a plain
    # torch.nn.CrossEntropyLoss as the config's `loss:` the recipe never sets output chunks
    # (lines 347-349), so the model returns its logits whole and upcast, and the recipe flattens
    # logits and labels before the loss (lines 795-797).
    if unchunked:
        built.module.set_num_output_chunks(0)
        loss_fn = torch.nn.CrossEntropyLoss()
    else:
        loss_fn = CEWithChunkedOutputLoss()
    logits = built.forward(tokens)
    running[StepPhase.forward] = _peak(tracker)
    ignore = torch.full((tokens.shape[0], 1), loss_fn.ignore_index)
    labels = torch.hstack((tokens[..., 1:], ignore))
    if unchunked:
        labels, logits = labels.reshape(-1), logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits
    running[StepPhase.loss] = _peak(tracker)
    return loss


TORCHTITAN_LOSS_CHUNKS = 8
"""torchtitan 0.3.0 components/loss.py ChunkedLossWrapper.Config.num_chunks default, which its
models/llama3/config_registry.py llama3_8b, llama3_70b and llama3_405b leave as it is."""


def _torchtune_dpo_loss(built, tokens: torch.Tensor, tracker: object | None, running: dict[StepPhase, int]) -> torch.Tensor:
    """torchtune 0.6.1 recipes/lora_dpo_single_device.py train() lines 535-568: the policy's
    concatenated_forward over the rows (``tokens``: chosen and rejected stacked, as
    data/_collate.py padded_collate_dpo makes them; the labels are the tokens, which only the
    values of the log-probs depend on), the logits' detached means, ``del`` of the logits, the
    reference's concatenated_forward under no_grad and disable_adapter, DPOLoss and its mean."""
    from torchtune import rlhf
    from torchtune.modules.peft import disable_adapter
    from torchtune.rlhf.loss import DPOLoss

    # The DPO recipes never call set_num_output_chunks: the model returns its logits whole.
    built.module.set_num_output_chunks(0)
    half = tokens.shape[0] // 2

    def concatenated_forward() -> tuple[torch.Tensor, ...]:
        logits = built.forward(tokens)
        log_probs = rlhf.get_batch_log_probs(logits, tokens)
        return log_probs[:half], log_probs[half:], logits[:half], logits[half:]

    policy_chosen, policy_rejected, chosen_logits, rejected_logits = concatenated_forward()
    means = chosen_logits.detach().mean(), rejected_logits.detach().mean()
    del chosen_logits, rejected_logits
    running[StepPhase.forward] = _peak(tracker)
    # The reference forward calls the same modules again (MemTracker's per-module stats set aside).
    aside = contextlib.nullcontext() if tracker is None else private.tracker_module_stats_set_aside(tracker)
    with aside, torch.no_grad(), disable_adapter(built.module):
        reference_chosen, reference_rejected, _, _ = concatenated_forward()
    loss, _, _ = DPOLoss()(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    del means
    running[StepPhase.loss] = _peak(tracker)
    return loss.mean()


def _torchtitan_loss(built, tokens: torch.Tensor, unchunked: bool, tracker: object | None,
                     running: dict[StepPhase, int]) -> torch.Tensor:
    """torchtitan 0.3.0 trainer.py _forward_backward_body: pred = model(inputs, **extra_kwargs)
    (positions and block mask: BuiltModel.forward), loss, _ = self.loss_fn(pred, labels,
    global_valid_tokens), then `del pred` before loss.backward(). The labels are the next
    tokens; their values change no byte."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    valid_tokens = torch.tensor(float(tokens.numel()))
    if unchunked:
        # models/llama3/config_registry.py llama3_debugmodel_ce_loss: CrossEntropyLoss
        # (cross_entropy_loss: pred.flatten(0, 1).float(), cross_entropy with sum reduction).
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    else:
        # models/llama3/config_registry.py llama3_8b/70b/405b: ChunkedLossWrapper over
        # CrossEntropyLoss; trainer.py (after building the model) set_lm_head(model.lm_head)
        # and model._skip_lm_head = True, so the forward returns the normed hidden states and
        # the wrapper runs lm_head, the cross-entropy and their backward chunk by chunk.
        loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=TORCHTITAN_LOSS_CHUNKS))
        loss_fn.set_lm_head(built.module.lm_head)
        built.module._skip_lm_head = True
    pred = built.forward(tokens)
    running[StepPhase.forward] = _peak(tracker)
    # FSDPMemTracker refuses a second forward of one FSDP module outside the root's forward
    # ("does not support memory tracking for multiple iterative calls"); each chunk's
    # backward resets its module tracker's parents, so every chunk's lm_head call is one.
    hook = None if tracker is None or unchunked else private.fsdp_tracker_forgets_each_call(tracker, built.module.lm_head)
    loss, _ = loss_fn(pred, tokens, valid_tokens)
    if hook is not None:
        hook.remove()
    del pred
    running[StepPhase.loss] = _peak(tracker)
    return loss

