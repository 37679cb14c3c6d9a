"""Executed and model FLOPs from the matmul shapes (zeroplan/core/flops.py), checked against a
tiny model whose every count is derived by hand below."""

from __future__ import annotations

import pytest

from zeroplan.core.default_efficiency import default_hfu
from zeroplan.core.flops import (
    StepFlops, attention_forward_flops_per_token,     layers_linear_forward_flops_per_token, model_flops_per_token, recompute_flops_per_token, step_flops,
)
from zeroplan.core.params import total_parameters
from zeroplan.core.timing import compute_time_s, gpu_optimizer_time_s, hfu_from_mfu, step_time
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, AttentionKernel, BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind,
    StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.model import ModelSpec

# h = 8, a = 2 query heads of d = 4, one key/value head (kv width 4), f = 16 (SwiGLU), L = 2,
# V = 10, untied head; s = 6.
TINY = ModelSpec(name="tiny", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                 ffn_hidden_size=16, max_positions=6)
S = 6
# One block's linears per token: 2 * (h*q + 2*h*kv + q*h + 3*h*f) = 2 * (64 + 64 + 64 + 384) = 1152.
BLOCK = 1152
# Output projection: 2 * h * V = 160. The embedding lookup: 0.
HEAD = 160
# QK^T and AV per block per token: 2 * (2 * s * d) * a = 4 * 6 * 4 * 2 = 192; causal flash: 96.
ATTENTION, CAUSAL = 192, 96


def _request(checkpointing=ActivationCheckpointing.none, kernel=AttentionKernel.flash, micro=1, accum=1):
    return PlanRequest(
        model=TINY,
        training=TrainingSpec(activation_checkpointing=checkpointing, attention_kernel=kernel),
        batch=BatchSpec(micro_batch_size=micro, seq_len=S, grad_accum_steps=accum),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
        strategy=StrategySpec(kind=StrategyKind.ddp),
        # Every executed FLOP at one rate: the identities below are the flat-HFU model's.
        performance=PerformanceAssumptions(attention_rate="matmul"),
    )


def _per_token(flops: StepFlops) -> StepFlops:
    """The step's FLOPs over its S tokens (one sequence, one micro-batch)."""
    return StepFlops(**{name: value / S for name, value in flops.model_dump().items()})


def test_tiny_model_parameters_are_the_hand_count() -> None:
    # embedding 80; block: norms 16, q 64, k 32, v 32, o 64, MLP 384 = 592, twice; head: norm 8 + 80.
    assert total_parameters(TINY) == 80 + 2 * 592 + 88 == 1352


def test_flash_forward_and_backward_per_token_by_hand() -> None:
    flops = _per_token(step_flops(_request()))
    # Forward: L*(block + causal attention) + head = 2*(1152 + 96) + 160 = 2656.
    assert flops.forward_flops == 2 * (BLOCK + CAUSAL) + HEAD == 2656
    # Backward: 2x the linears, 2.5x flash attention: 2*(2*1152 + 160) + 2.5*2*96 = 5408.
    assert flops.backward_flops == 2 * (2 * BLOCK + HEAD) + 2.5 * 2 * CAUSAL == 5408
    assert flops.recompute_flops == 0


def test_eager_attention_computes_the_whole_score_matrix() -> None:
    flops = _per_token(step_flops(_request(kernel=AttentionKernel.eager)))
    assert flops.forward_flops == 2 * (BLOCK + ATTENTION) + HEAD
    assert flops.backward_flops == 2 * (2 * BLOCK + HEAD) + 2 * 2 * ATTENTION


# The harness's non-reentrant checkpoint stops early: a recomputed block skips its last matmul,
# the MLP's down projection (f x h): 2 * 16 * 8 = 256 per token.
DOWN = 256


@pytest.mark.parametrize(("mode", "recomputed"), [
    (ActivationCheckpointing.full, 2 * (BLOCK + CAUSAL - DOWN)),  # each block's forward, never the head
    (ActivationCheckpointing.selective, 2 * CAUSAL),  # the attention core
    (ActivationCheckpointing.selective_layer, 1 * (BLOCK + CAUSAL - DOWN)),  # floor(2/2) = 1 block
    (ActivationCheckpointing.selective_op, 2 * 2 * (8 * 8 + 8 * 16)),  # wo (q x h) and w3 (h x f)
])
def test_recomputation_is_what_each_policy_runs_again(mode, recomputed) -> None:
    flops = _per_token(step_flops(_request(mode)))
    assert flops.recompute_flops == recomputed
    assert flops.backward_flops == 5408 + recomputed
    assert flops.forward_flops == 2656


@pytest.mark.parametrize("framework, early_stop", [("zeroplan", True), ("torchtune", True), ("hf", False),
                                                   ("torchtitan", False)])
def test_full_recomputation_skips_the_last_matmul_only_where_the_checkpoint_stops_early(framework, early_stop) -> None:
    """torch's non-reentrant checkpoint (the harness, torchtune) stops once every saved tensor is
    back, so the down projection is not rerun; HF's reentrant checkpoint and torchtitan's
    early_stop=False rerun the whole block. Dropout after the MLP keeps it in (its mask is saved)."""
    model = get_model("llama-3.1-8b")
    training = TrainingSpec(activation_checkpointing=ActivationCheckpointing.full, framework=framework)
    down = 2 * 14336 * 4096
    linear = layers_linear_forward_flops_per_token(model)
    attention = model.num_layers * attention_forward_flops_per_token(model, 4096, 0.5)
    expected = linear + attention - (model.num_layers * down if early_stop else 0)
    assert recompute_flops_per_token(model, training, 4096) == expected
    dropped = model.model_copy(update={"hidden_dropout": 0.1})
    assert recompute_flops_per_token(dropped, training, 4096) == linear + attention



def test_a_run_on_torch_1_13_reruns_the_whole_block() -> None:
    """TrainingSpec.checkpoint_early_stop overrides the framework's: torch 1.13's non-reentrant
    checkpoint has no early stop (llm-foundry's A100 40GB table ran on its 1.13.1 image)."""
    from zeroplan.validate.step_time import load_published_throughput

    model = get_model("llama-3.1-8b")
    linear = layers_linear_forward_flops_per_token(model)
    attention = model.num_layers * attention_forward_flops_per_token(model, 4096, 0.5)
    training = TrainingSpec(activation_checkpointing=ActivationCheckpointing.full, checkpoint_early_stop=False)
    assert recompute_flops_per_token(model, training, 4096) == linear + attention
    forced = TrainingSpec(activation_checkpointing=ActivationCheckpointing.full, framework="hf", checkpoint_early_stop=True)
    assert recompute_flops_per_token(model, forced, 4096) == linear + attention - model.num_layers * 2 * 14336 * 4096
    rows = load_published_throughput().rows
    old = {row.name for row in rows if row.request().training.checkpoint_early_stop is False}
    assert old == {row.name for row in rows if row.source_section.startswith("'A100 40GB")
                   or (row.source_section.startswith("'A100 80GB") and row.model == "mpt-70b")}

def test_model_flops_are_palm_appendix_b() -> None:
    # 6N + 12 L a d s = 6 * 1352 + 12 * 2 * 2 * 4 * 6 = 8112 + 1152, whatever the policy or kernel.
    assert model_flops_per_token(TINY, S) == 9264
    for mode in ActivationCheckpointing:
        assert step_flops(_request(mode, micro=3, accum=2)).model_flops == 9264 * S * 6


def test_flops_scale_with_tokens() -> None:
    one, many = step_flops(_request(micro=3, accum=2)), step_flops(_request())
    assert one.executed_flops == pytest.approx(6 * S * many.executed_flops / S)


def test_published_mfu_converts_to_the_hfu_that_gives_the_same_compute_time() -> None:
    for mode in ActivationCheckpointing:
        # A real model and sequence: the tiny one's memory-bound kernels (autocast's weight casts,
        # the optimizer step) alone outlast its FLOPs at MFU 0.5.
        tiny = _request(mode)
        request = tiny.model_copy(update={"model": get_model("llama-2-7b"),
                                          "batch": tiny.batch.model_copy(update={"seq_len": 4096, "micro_batch_size": 4})})
        flops = step_flops(request)
        hfu = hfu_from_mfu(request, 0.5)
        assert hfu is not None and hfu_from_mfu(tiny, 0.5) is None
        timed = request.model_copy(update={"performance": PerformanceAssumptions(hardware_flops_utilization=hfu,
                                                                                 attention_rate="matmul")})
        forward_s, backward_s = compute_time_s(flops, timed)
        peak = request.cluster.gpu.peak_bf16_flops_per_s
        # Compute and the GPU's optimizer step last what the MFU says the step lasts; the HFU is
        # above MFU x executed / model FLOPs by the memory-bound kernels' share.
        assert forward_s + backward_s + gpu_optimizer_time_s(timed) == pytest.approx(
            flops.model_flops / (0.5 * peak), rel=1e-12)
        assert hfu > 0.5 * flops.executed_flops / flops.model_flops


def test_step_time_reports_throughput_and_mfu() -> None:
    request = _request(ActivationCheckpointing.full, micro=2, accum=3)
    t = step_time(request, ())
    peak = request.cluster.gpu.peak_bf16_flops_per_s
    # Without an HFU the request's fitted default applies (zeroplan.core.default_efficiency).
    hfu = default_hfu(request).hfu
    assert t.hardware_flops_utilization == hfu
    assert t.memory_bound_s > 0
    assert t.compute_s == pytest.approx(t.executed_flops / (peak * hfu) + t.memory_bound_s)
    assert t.tokens_per_s_per_gpu == pytest.approx(2 * 3 * S / t.step_with_overlap_s)
    assert t.model_flops_utilization == pytest.approx(t.model_flops / (t.step_with_overlap_s * peak))
    # Full recomputation executes more than the model FLOPs count, so MFU falls below the HFU.
    assert t.model_flops_utilization < hfu


def test_in_hfu_times_every_kernel_at_the_hfu_as_on_a_gpu_without_a_measured_bandwidth() -> None:
    # PerformanceAssumptions.memory_bound 'in-hfu' (how the flat 0.4 is scored): no memory-bound
    # term and no GPU optimizer step, compute = executed FLOPs at the HFU; a GPU without a
    # measured copy bandwidth (b200) is timed that way whatever the setting.
    request = _request(ActivationCheckpointing.full, micro=2, accum=3)
    inside = request.model_copy(update={"performance": PerformanceAssumptions(
        hardware_flops_utilization=0.4, attention_rate="matmul", memory_bound="in-hfu")})
    t = step_time(inside, ())
    assert t.memory_bound_s == 0 and t.optimizer_step_s == 0
    assert t.compute_s == pytest.approx(t.executed_flops / (0.4 * request.cluster.gpu.peak_bf16_flops_per_s))
    b200 = inside.model_copy(update={"cluster": cluster_from_gpus(get_gpu("b200"), 1),
                                     "performance": inside.performance.model_copy(update={"memory_bound": "copy-bandwidth"})})
    t = step_time(b200, ())
    assert t.memory_bound_s == 0 and t.optimizer_step_s == 0
    assert t.compute_s == pytest.approx(t.executed_flops / (0.4 * get_gpu("b200").peak_bf16_flops_per_s))


@pytest.mark.parametrize("model_name", ["llama-2-7b", "mixtral-8x7b", "gpt2-xl", "qwen3-8b"])
def test_the_trained_steps_flops_are_the_per_token_flops_times_its_tokens(model_name) -> None:
    """Training every weight, the FLOPs kept per sequence and multiplied by the step's tokens are
    the floats the per-token equations give times the whole batch's tokens (every policy, both
    kernels, several shapes): linears (the head's included) and attention forward, twice the
    linears and the kernel's share of attention backward, the recomputed FLOPs on top."""
    from zeroplan.core.flops import (
        BACKWARD_MATMULS_PER_FORWARD_MATMUL, _step_flops, attention_backward_over_forward, executed_causal_fraction,
        head_forward_flops_per_token, recompute_attention_flops_per_token,
    )

    model = get_model(model_name)
    for mode in ActivationCheckpointing:
        for kernel in AttentionKernel:
            training = TrainingSpec(activation_checkpointing=mode, attention_kernel=kernel)
            for micro, seq_len, accum in ((1, 512, 1), (3, 1024, 2), (7, 333, 5), (16, 4096, 8)):
                batch = BatchSpec(micro_batch_size=micro, seq_len=seq_len, grad_accum_steps=accum)
                tokens = micro * seq_len * accum
                linear = layers_linear_forward_flops_per_token(model) + head_forward_flops_per_token(model)
                attention = model.num_layers * attention_forward_flops_per_token(
                    model, seq_len, executed_causal_fraction(kernel, model.causal))
                recompute = recompute_flops_per_token(model, training, seq_len)
                backward = BACKWARD_MATMULS_PER_FORWARD_MATMUL * linear + attention_backward_over_forward(kernel) * attention
                expected = StepFlops(
                    forward_flops=tokens * (linear + attention), backward_flops=tokens * (backward + recompute),
                    recompute_flops=tokens * recompute, model_flops=tokens * model_flops_per_token(model, seq_len),
                    attention_forward_flops=tokens * attention,
                    attention_backward_flops=tokens * (attention_backward_over_forward(kernel) * attention
                                                       + recompute_attention_flops_per_token(model, training, seq_len)))
                kept = _step_flops(model, training, batch, 0, 0)  # step_flops' own call training every weight
                assert kept == expected
                assert kept.model_dump_json() == expected.model_dump_json()
