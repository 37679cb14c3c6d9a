"""The per-operation compute model (zeroplan/core/roofline): its FLOPs are the FLOP model's, kernel
by kernel; each kernel takes the longer of its arithmetic and its memory traffic; the ceilings
are the cited ones; the step time, the compare table and the plan search carry it; what it cannot
price is refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zeroplan.core.communication import collectives
from zeroplan.core.flops import step_flops
from zeroplan.core.roofline import roofline_step
from zeroplan.core.roofline.ceilings import CEILINGS, gpu_ceilings, special_function_rate
from zeroplan.core.roofline.operations import (
    OpKind, OpPass, Operation, block_memory_passes, matmul, memory_pass, step_operations,
)
from zeroplan.core.roofline.optimizer import optimizer_bytes_per_element
from zeroplan.core.roofline.step import operation_seconds
from zeroplan.core.timing import step_time
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, AttentionKernel, BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind,
    StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.training import FineTuneSpec, Optimizer, OptimizerLoop
from zeroplan.specs.framework import Framework

ROOFLINE = PerformanceAssumptions(compute_model="roofline")


def _request(model="llama-3.1-8b", strategy=StrategyKind.fsdp_full_shard, checkpointing=ActivationCheckpointing.none,
             kernel=AttentionKernel.flash, micro=2, seq=512, accum=3, gpu="h100-80gb", gpus=8, **training):
    if kernel is AttentionKernel.sdpa_masked:
        # torch 2.1's masked SDPA is planned only under the hf profile at that release.
        training = {"framework": Framework.hf, "torch_release": "2.1", **training}
    return PlanRequest(
        model=get_model(model),
        training=TrainingSpec(activation_checkpointing=checkpointing, attention_kernel=kernel, **training),
        batch=BatchSpec(micro_batch_size=micro, seq_len=seq, grad_accum_steps=accum),
        cluster=cluster_from_gpus(get_gpu(gpu), gpus), strategy=StrategySpec(kind=strategy), performance=ROOFLINE,
    )


def _flops(request, *passes: OpPass) -> float:
    batch = request.batch
    ops = step_operations(request.model, request.training, batch.micro_batch_size, batch.seq_len,
                          batch.grad_accum_steps, 2)
    return sum(op.flops for op in ops if op.op_pass in passes and op.kind is not OpKind.memory)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gpt2", "mixtral-8x7b"])
@pytest.mark.parametrize("checkpointing", list(ActivationCheckpointing))
@pytest.mark.parametrize("kernel", list(AttentionKernel))
def test_the_kernels_execute_exactly_the_flop_models_flops(model, checkpointing, kernel) -> None:
    """Summed kernel by kernel, the matmuls and attention cores are zeroplan.core.flops' counts:
    forward, backward with its recomputation, and the recomputation alone."""
    request = _request(model, checkpointing=checkpointing, kernel=kernel)
    flops = step_flops(request)
    assert math.isclose(_flops(request, OpPass.forward), flops.forward_flops, rel_tol=1e-12)
    assert math.isclose(_flops(request, OpPass.backward, OpPass.recompute), flops.backward_flops, rel_tol=1e-12)
    assert math.isclose(_flops(request, OpPass.recompute), flops.recompute_flops, rel_tol=1e-12, abs_tol=1e-3)


def test_a_kernel_takes_the_longer_of_its_arithmetic_and_its_traffic() -> None:
    ceilings = gpu_ceilings(get_gpu("h100-80gb"))
    big = matmul("square", OpPass.forward, 8192, 8192, 8192, 2, 1)
    seconds, bound = operation_seconds(big, ceilings)
    assert bound == "compute" and seconds == pytest.approx(2 * 8192**3 / ceilings.matmul_flops_per_s)
    # A matrix-vector product moves its whole matrix for 2 FLOPs per element: memory-bound.
    skinny = matmul("matrix-vector", OpPass.forward, 1, 8192, 8192, 2, 1)
    seconds, bound = operation_seconds(skinny, ceilings)
    assert bound == "memory" and seconds == pytest.approx(skinny.moved_bytes / ceilings.memory_bytes_per_s)
    copy = memory_pass("copy", OpPass.forward, 1e9, 3)
    assert operation_seconds(copy, ceilings) == (pytest.approx(3e9 / ceilings.memory_bytes_per_s), "memory")


def test_attention_adds_its_exponentials_so_wider_heads_run_nearer_the_matmul_ceiling() -> None:
    """Per score, QK^T and PV are 4d FLOPs and the softmax one exponential (FlashAttention-3 sec.
    3.1): at d = 64 the exponentials cost the H100 about as much as the products."""
    ceilings = gpu_ceilings(get_gpu("h100-80gb"))
    rates = {}
    for head_size in (64, 128):
        scores = 1e12
        core = Operation(name="attention core", kind=OpKind.attention, op_pass=OpPass.forward,
                         flops=4 * head_size * scores, moved_bytes=0, exponentials=scores)
        rates[head_size] = core.flops / operation_seconds(core, ceilings)[0]
    assert rates[64] < rates[128] < ceilings.matmul_flops_per_s
    assert rates[64] == pytest.approx(256 / (256 / 792.1e12 + 1 / special_function_rate(132, 1.83e9)))
    # FlashAttention-3 sec. 3.1 rounds the H100's exponential rate to 3.9 T/s.
    assert ceilings.exp_per_s == pytest.approx(3.9e12, rel=0.01)


def test_the_ceilings_are_the_cited_measurements() -> None:
    assert CEILINGS["a100-80gb"].matmul_flops_per_s == pytest.approx(267.9e12)
    assert CEILINGS["h100-80gb"].matmul_flops_per_s == pytest.approx(792.1e12)
    assert CEILINGS["h200-141gb"].memory_bytes_per_s == 4.168e12
    # The copy fraction measured on the H200 carried to the H100's 3.35 TB/s datasheet figure.
    assert CEILINGS["h100-80gb"].memory_bytes_per_s == pytest.approx(3.35e12 * 4.168 / 4.8)
    for ceilings in CEILINGS.values():
        assert ceilings.source


def test_a_gpu_without_measured_ceilings_is_refused_in_one_line() -> None:
    with pytest.raises(ZeroplanError) as error:
        roofline_step(_request(gpu="b200"))
    message = str(error.value)
    assert message.startswith("compute-model: ") and "'b200'" in message and "h100-80gb" in message
    assert "\n" not in message


def test_frozen_weights_are_refused_rather_than_priced_as_full_training() -> None:
    request = _request(finetune=FineTuneSpec(lora_rank=8))
    with pytest.raises(ZeroplanError, match="compute-model: roofline prices full training only"):
        roofline_step(request)


@pytest.mark.parametrize("optimizer, loop, master, expected", [
    (Optimizer.adamw, OptimizerLoop.fused, False, 7 * 4),
    (Optimizer.adamw, OptimizerLoop.foreach, False, 20 * 4),
    (Optimizer.adamw, OptimizerLoop.for_loop, True, 20 * 4 + 6),
    (Optimizer.sgd, OptimizerLoop.foreach, False, 3 * 4),  # read param and gradient, write param
    (Optimizer.sgd_momentum, OptimizerLoop.foreach, False, 5 * 4),
])
def test_optimizer_traffic_per_element(optimizer, loop, master, expected) -> None:
    assert optimizer_bytes_per_element(optimizer, loop, 4, master) == expected


def test_the_optimizer_steps_the_elements_the_rank_holds() -> None:
    """DDP steps every parameter, ZeRO-1 and FSDP their 1/N shard; offload steps on the host."""
    seconds = {kind: roofline_step(_request(strategy=kind)).optimizer_s
               for kind in (StrategyKind.ddp, StrategyKind.zero1, StrategyKind.fsdp_full_shard, StrategyKind.zero2_offload)}
    assert seconds[StrategyKind.zero2_offload] == 0
    assert seconds[StrategyKind.fsdp_full_shard] == pytest.approx(seconds[StrategyKind.ddp] / 8, rel=1e-3)
    # The reference ZeRO layout casts its fp32 master back to bf16 parameters: 86 bytes, not 80.
    assert seconds[StrategyKind.zero1] == pytest.approx(seconds[StrategyKind.ddp] / 8 * 86 / 80, rel=1e-3)


def test_fsdp_copies_each_gathered_parameter_out_and_each_gradient_in() -> None:
    def copies(kind):
        return {(t.operation.op_pass, t.operation.name): t.operation.moved_bytes for t in roofline_step(_request(strategy=kind)).terms
                if t.operation.name.startswith("fsdp")}
    full, grad_op = copies(StrategyKind.fsdp_full_shard), copies(StrategyKind.fsdp_shard_grad_op)
    assert set(full) == {(OpPass.forward, "fsdp all-gather copy-out"), (OpPass.backward, "fsdp all-gather copy-out"),
                         (OpPass.backward, "fsdp reduce-scatter copy-in")}
    assert (OpPass.backward, "fsdp all-gather copy-out") not in grad_op  # shard-grad-op keeps the gathered weights
    assert copies(StrategyKind.zero3) == {}
    parameters = 8_030_261_248
    # Three micro-batches: each reads and writes 2 bytes per gathered element, and packs the bf16
    # gradient into an fp32 reduce-scatter input (2 + 4 bytes).
    assert full[OpPass.forward, "fsdp all-gather copy-out"] == 3 * parameters * 4
    assert full[OpPass.backward, "fsdp reduce-scatter copy-in"] == 3 * parameters * 6


def test_block_memory_passes_per_token() -> None:
    """Llama's block: 2 norms (2h forward), RoPE on q and k, two residual adds, SwiGLU (5F)."""
    model = get_model("llama-3.1-8b")
    h, q, kv, f = 4096, 4096, 1024, 14336
    forward = {op.name: op.moved_bytes for op in block_memory_passes(model, False, 1, 1, OpPass.forward, 1)}
    assert forward == {"norms": 2 * 2 * h, "rotary embedding": 2 * (q + kv), "residual adds": 6 * h, "activation": 5 * f}
    backward = {op.name: op.moved_bytes for op in block_memory_passes(model, False, 1, 1, OpPass.backward, 1)}
    assert backward["norms"] == 2 * 3 * h and backward["activation"] == 9 * f
    # The normed inputs are read by q, k, v and by gate, up: 2 + 1 gradient sums of h, 3h each;
    # torchtitan's fused wqkv reads the attention's once.
    assert backward["gradient sums"] == 3 * 3 * h
    fused = {op.name: op.moved_bytes for op in block_memory_passes(model, False, 1, 1, OpPass.backward, 1, fused_qkv=True)}
    assert fused["gradient sums"] == 3 * h
    assert "gradient sums" not in forward


def test_step_time_adds_the_gpu_optimizer_step_under_either_compute_model() -> None:
    request = _request(strategy=StrategyKind.ddp, gpus=1)
    roofline = step_time(request, tuple(collectives(request)))
    step = roofline_step(request)
    assert roofline.forward_compute_s == pytest.approx(step.forward_s)
    assert roofline.backward_compute_s == pytest.approx(step.backward_s)
    assert roofline.optimizer_step_s == pytest.approx(step.optimizer_s) and step.optimizer_s > 0
    assert roofline.step_with_overlap_s == pytest.approx(
        roofline.compute_s + roofline.exposed_communication_s + roofline.optimizer_step_s)
    # The flat-HFU model times the same memory-bound pass (zeroplan.core.timing.gpu_optimizer_time_s).
    flat = request.model_copy(update={"performance": PerformanceAssumptions()})
    assert step_time(flat, tuple(collectives(flat))).optimizer_step_s == pytest.approx(step.optimizer_s)


def test_the_plan_search_times_roofline_groups_as_the_scalar_planner(zeroplan_cli) -> None:
    """The search prices compute affine in the micro-batch (per pass + per sequence) and keeps a
    group vectorised only when that agrees with step_time at a point it did not fit."""
    from zeroplan.core import search as search_module

    request = search_module.on_flat_reserve(_request(seq=2048, gpus=16, micro=1, accum=1))
    group = search_module._build_group(request)
    assert not group.scalar_only
    micro, accum = np.array([3]), np.array([2])
    _, _, seconds = search_module._vectorised(group, micro, accum)
    at = search_module._at(request, 3, 2)
    assert float(seconds[0]) == pytest.approx(step_time(at, tuple(collectives(at))).step_with_overlap_s, abs=1e-9)


def test_cli_compute_model_roofline(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("compare", "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--compute-model", "roofline",
                                  "--strategies", "fsdp-full-shard,zero2")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert "opt-step" in header.split()
    assert "792 TFLOP/s (measured matmul ceiling)" in out
    code, out, _ = zeroplan_cli("compare", "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--strategies", "zero2")
    # The flat-HFU model: FLOPs at the HFU, the memory-bound kernels and the optimizer step at the copy bandwidth.
    assert code == 0 and "opt-step" in out and "memory-bound kernels at 2.91 TB/s (copy bandwidth)" in out


@pytest.mark.parametrize("argv, field", [
    (["--gpu", "b200", "--compute-model", "roofline"], "compute-model"),
    (["--gpu", "h100", "--compute-model", "roofline", "--hfu", "0.5"], "hfu"),
])
def test_cli_refuses_what_the_roofline_cannot_honour(zeroplan_cli, argv, field) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--gpus", "8", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and f"error: {field}: " in err


def test_plan_shows_the_gpu_optimizer_step_under_the_roofline(zeroplan_cli) -> None:
    argv = ("plan", "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "16", "--seq-len", "2048")
    code, out, err = zeroplan_cli(*argv, "--compute-model", "roofline")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line.replace("peak GiB", "peak").replace("alloc GiB", "alloc-gib").replace("step s", "step").split()
                  for line in lines if line.startswith("#   strategy"))
    first = lines[lines.index(next(line for line in lines if line.startswith("--  "))) + 1].split()
    row = dict(zip(header, first))
    parts = sum(float(row[name]) for name in ("compute", "mp-comm", "bubble", "exposed", "cpu-step", "opt-step")
                if name in row)
    assert "opt-step" in header and float(row["opt-step"]) > 0
    assert float(row["step"]) == pytest.approx(parts, abs=0.002)  # printed to the millisecond
    # The flat-HFU model steps the optimizer at the copy bandwidth too; a GPU without a measured
    # bandwidth has its HFU cover it, and no column.
    code, out, _ = zeroplan_cli(*argv)
    assert code == 0 and "opt-step" in out
    code, out, _ = zeroplan_cli(*argv[:-6], "--gpu", "b200", *argv[-4:])
    assert code == 0 and "opt-step" not in out


def test_autocast_casts_every_linear_weight_each_way_under_ddp_only() -> None:
    # Llama-3.1-8B's linears: 32 blocks of q, k, v, o, gate, up, down and the untied head.
    model = get_model("llama-3.1-8b")
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = model.num_kv_heads * (h // model.num_heads)
    linear = model.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f) + model.vocab_size * h
    ddp = _request(strategy=StrategyKind.ddp, accum=3)
    casts = {(t.operation.name, t.operation.op_pass): t.operation.moved_bytes for t in roofline_step(ddp).terms
             if t.operation.name.startswith("autocast")}
    assert casts == {("autocast weight casts", OpPass.forward): 3 * 6 * linear,
                     ("autocast weight-gradient casts", OpPass.backward): 3 * 6 * linear}
    full = _request(strategy=StrategyKind.ddp, accum=1, checkpointing=ActivationCheckpointing.full)
    recast = [t.operation.moved_bytes for t in roofline_step(full).terms
              if t.operation.name == "autocast weight casts" and t.operation.op_pass is OpPass.recompute]
    assert recast == [6 * (linear - model.vocab_size * h)]
    # FSDP2 and DeepSpeed cast the module's parameters to bf16 themselves: no autocast casts.
    for kind in (StrategyKind.fsdp_full_shard, StrategyKind.zero3):
        assert not [t for t in roofline_step(_request(strategy=kind)).terms if t.operation.name.startswith("autocast")]


@pytest.mark.parametrize("strategy", [StrategyKind.ddp, StrategyKind.fsdp_full_shard, StrategyKind.zero3_offload])
@pytest.mark.parametrize("training", [{}, {"compile": True}, {"precision": "fp32"},
                                      {"activation_checkpointing": ActivationCheckpointing.full},
                                      {"activation_checkpointing": ActivationCheckpointing.selective_op},
                                      {"activation_checkpointing": ActivationCheckpointing.selective,
                                       "attention_kernel": AttentionKernel.eager}])
def test_memory_bound_seconds_are_the_memory_bound_steps_sums(strategy, training) -> None:
    """The flat-HFU model's memory-bound seconds, summed without building the step, are the
    step's own sums to the last bit (forward, backward with recomputation, optimizer)."""
    from zeroplan.core.roofline.step import memory_bound_seconds, memory_bound_step

    checkpointing = training.pop("activation_checkpointing", ActivationCheckpointing.none)
    kernel = training.pop("attention_kernel", AttentionKernel.flash)
    request = _request("mixtral-8x7b" if training.get("precision") else "llama-3.1-8b", strategy=strategy,
                       checkpointing=checkpointing, kernel=kernel, **training)
    step = memory_bound_step.__wrapped__(request)
    assert memory_bound_seconds(request) == (step.forward_s, step.backward_s, step.optimizer_s)
    # The memory passes alone are the full step's memory passes, in the same order.
    batch = request.batch
    every = step_operations(request.model, request.training, batch.micro_batch_size, batch.seq_len, batch.grad_accum_steps, 2)
    assert step_operations(request.model, request.training, batch.micro_batch_size, batch.seq_len, batch.grad_accum_steps, 2,
                           memory_only=True) == [op for op in every if op.kind is OpKind.memory]


def test_tensor_parallel_ranks_run_the_norms_and_residual_adds_whole_without_sequence_parallelism() -> None:
    """Megatron's tensor parallelism splits the products, the heads and the MLP width; the norms,
    the residual adds and the normed input's gradient sums run on the whole h on every tp rank
    unless sequence parallelism splits them along the sequence."""
    from zeroplan.core.roofline.step import TP_REPLICATED_PASSES, memory_bound_seconds, memory_bound_step
    from zeroplan.specs.parallel import ParallelSpec

    base = _request("gpt2", strategy=StrategyKind.ddp, kernel=AttentionKernel.eager)
    tp = base.model_copy(update={"parallel": ParallelSpec(tp=4)})
    sp = base.model_copy(update={"parallel": ParallelSpec(tp=4, sequence_parallel=True)})
    one, four, split = (memory_bound_step.__wrapped__(r) for r in (base, tp, sp))
    for a, b, c in zip(one.terms, four.terms, split.terms, strict=True):
        if a.operation.name.startswith(("autocast", "optimizer")):
            continue  # the request's own passes, over the rank's parameters
        assert a.operation == b.operation == c.operation
        assert c.seconds == pytest.approx(a.seconds / 4)
        replicated = a.operation.name in TP_REPLICATED_PASSES
        assert b.seconds == pytest.approx(a.seconds if replicated else a.seconds / 4), a.operation.name
    names = {t.operation.name for t in one.terms}
    assert {"norms", "residual adds", "final norm"} <= names and "activation" in names and "attention softmax" in names
    assert memory_bound_seconds(tp) == (four.forward_s, four.backward_s, four.optimizer_s)
    assert sum(memory_bound_seconds(tp)) > sum(memory_bound_seconds(sp))


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gpt2", "mixtral-8x7b", "qwen3-0.6b"])
@pytest.mark.parametrize("checkpointing", list(ActivationCheckpointing))
@pytest.mark.parametrize("kernel", list(AttentionKernel))
def test_the_memory_passes_byte_polynomials_give_the_operations_own_seconds(model, checkpointing, kernel) -> None:
    """The flat-HFU model's memory passes priced from their byte polynomials are the very floats
    the operations give, phase by phase and pass by pass, at shapes other than the probes'
    (a micro-batch of 3 x 4,097 tokens, 5 micro-batches, tensor-parallel passes replicated)."""
    from zeroplan.core.roofline.step import (
        _memory_pass_polynomials, _memory_seconds_by_phase, _model_memory_priced, _model_memory_seconds,
    )

    request = _request(model, checkpointing=checkpointing, kernel=kernel)
    assert _memory_pass_polynomials(request.model, request.training, 2) is not None
    for shape in ((1, 1024, 1, 1, 1), (3, 4097, 5, 8, 4)):
        args = (request.model, request.training, *shape[:3], 2, request.cluster.gpu, *shape[3:])
        assert _model_memory_seconds(*args) == _memory_seconds_by_phase(list(_model_memory_priced(*args)))
